"""training.cuda_graphs: the decoder layers' forward and backward, each captured once as a
CUDA graph and replayed every micro-batch.

Why: a step is hundreds of kernels, and the host's time to launch them (Python, autograd, the
allocator) can leave the GPU idle between them. A replayed graph launches the whole layer
stack's forward as one call and its backward as another. The kernels are the same as eager,
so the numbers are too (tests/test_cuda_graphs_gpu.py: bit for bit). In bf16 the GPU
already runs ahead of the host inside the layers, so graphs gain no speed there, only peak
memory (the graph's pool holds one step's activations without the allocator's
fragmentation); FP8 adds a cast or two before each GEMM, more launches than the host keeps
up with at small widths, and there the graphs pay (measured: see bench/NOTES.md).

What a graph needs, and how each is met here:
- the same shapes every call: captured for (micro_batch_size, seq_length / cp_size); any
  other shape (or eval mode, or no autograd) runs the eager layers instead;
- the same memory: captured after GradBuckets has moved the parameters into their flat
  buckets, and everything later (optimizer steps, checkpoint loads) writes them in place;
- nothing that talks to the host or to other ranks inside: tp, pp and cp are refused by the
  config checks, and so are torch.compile and activation checkpointing (except "selective"
  with model.kernels=triton: its recomputation is inside the MLP's own autograd function, not
  torch's checkpoint, so the graphs capture it like any other op). Data parallelism is
  fine, with its reductions started after backward (GradBuckets.finish), not from the
  gradient hooks: the layers' gradients all arrive at once when the backward graph ends, so
  the hooks would overlap nothing, and launched from them, with the host running ahead of a
  replayed graph, the reductions raced: dp2 with graphs on one shared GPU matched one process
  for 1-4 steps, then its grad norm jumped by 0.7-4% at a step that changed from run to run,
  and matched it to the bit with the reductions started after backward or with
  CUDA_LAUNCH_BLOCKING=1 (bench/NOTES.md).
- training.fp8: its weight caches (speed/fp8/weights.py) decide on the host when a weight changed,
  which a replay would skip; so they recast in place, into the tensors the graphs read: the
  host checks the weights' versions before each replay, and after an optimizer step replays
  a third graph that holds every weight's recast (`capture_recasts`). Activations' scales
  stay on the GPU. Under "tensorwise_delayed" the first step calibrates the scales with
  casts that delayed steps do not run, so it runs eager, and the capture happens at the
  first forward after it.
Memory: the graph's private pool keeps one step's activations and the layers' bf16 weight
gradients (its outputs) between steps, instead of handing them back to the allocator.
"""
import torch
import torch.nn as nn

from picotron.model import rope_cos_sin


class LayerStack(nn.Module):
    """All of a Decoder's layers as one module (x, cos, sin) -> x (B, T, C): the
    form torch.cuda.make_graphed_callables captures, its parameters those of the layers."""

    def __init__(self, decoder):
        super().__init__()
        self.layers = nn.ModuleList(decoder.layers.values())
        self.keys = list(decoder.layers)
        self.eager = decoder.run_layers        # Decoder.run_layers, bound to the decoder

    def forward(self, x, cos, sin):
        return self.eager(self.keys, x, cos, sin)


def capture_layers(model, config, device, grads):
    """Capture `model`'s layers (all of them: pp is 1) for one micro-batch, and route the
    model's training forwards through the graphs by replacing `run_layers` on the instance.
    Call after GradBuckets(model, ...) (`grads`): under ZeRO its parameter gathers wait in
    the layers' forward pre-hooks, which a replay skips, so they are made to wait at the
    step's end instead (ParamGather.overlap), and its reductions start after backward. Under
    training.fp8="tensorwise_delayed" the capture waits for the end of the calibrating first
    step (speed/fp8/delayed.py), which runs eager."""
    if getattr(grads, "gather", None) is not None:
        grads.gather.overlap = False
    if grads is not None:          # the reductions start after backward (the docstring says why)
        grads.overlap = False
    t, m = config.training, config.model
    B, T = t.micro_batch_size, t.seq_length // config.distributed.cp_size
    dtype = next(model.parameters()).dtype
    stack = LayerStack(model)
    fp8_caches = [m.fp8_cache for m in stack.modules()
                  if getattr(m, "fp8_cache", None) is not None]
    for cache in fp8_caches:        # before the warm-ups, which cast what the graphs will read
        cache.in_place = True
    ledger = getattr(model, "fp8_ledger", None)
    graphs = {}

    def capture():
        x = torch.randn(B, T, m.hidden_size, device=device, dtype=dtype, requires_grad=True)
        position_ids = torch.arange(T, device=device).expand(B, T).contiguous()
        cos, sin = rope_cos_sin(position_ids, model.head_dim, m.rope_theta, dtype)
        # the warm-ups below cast random inputs: their amaxes must not reach the next scales
        seen = None if ledger is None else ledger.seen.clone()
        # Runs 3 warm-up forwards and backwards (Triton compiles, cuBLAS picks its kernels),
        # then captures; torch.autograd.grad is used throughout, so no parameter's .grad is
        # touched.
        graphs["stack"] = torch.cuda.make_graphed_callables(stack, (x, cos, sin))
        if seen is not None:
            ledger.seen.copy_(seen)
        # the caches the layers used (with our kernels the fused blocks', not their linears')
        graphs["caches"] = [cache for cache in fp8_caches if cache.entry is not None]
        if graphs["caches"]:
            graphs["recasts"] = capture_recasts(graphs["caches"])

    if ledger is None:
        capture()
    eager, keys = model.run_layers, stack.keys

    def run_layers(run_keys, x, cos, sin):
        if (list(run_keys) == keys and tuple(x.shape) == (B, T, m.hidden_size)
                and model.training and torch.is_grad_enabled()):
            if not graphs:
                if ledger.calibrating:
                    return eager(run_keys, x, cos, sin)
                torch.cuda.empty_cache()       # the eager step's blocks, before the pool
                capture()
            if any(cache.stale() for cache in graphs["caches"]):   # after an optimizer step
                graphs["recasts"].replay()
                for cache in graphs["caches"]:
                    cache.mark_fresh()
            return graphs["stack"](x, cos, sin)
        return eager(run_keys, x, cos, sin)
    model.run_layers = run_layers
    return model


def capture_recasts(caches):
    """Every weight's FP8 recast (Fp8WeightCache.recast: in place, into the tensors the layer
    graphs read) as one more graph. Launched one by one from the host they are a few hundred
    small kernels with ~100 us of Python each, the GPU idle meanwhile (bench/NOTES.md); a
    replay is one launch. A weight that did not change recasts to the same bits, so every
    replay recasts them all."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for cache in caches:
            cache.recast()
    return graph
