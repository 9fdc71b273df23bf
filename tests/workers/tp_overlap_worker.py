"""Worker for test_tp_overlap.py: the ring-overlapped sequence-parallel layers against the
non-overlapped ones, on 4 gloo ranks: tp = 4 (all ranks) and tp = 2 (ranks {0, 1}, {2, 3}).

1. Layers: the column projections of a block (three weights, as q, k, v) by the ring
   all-gather + GEMM against all-gather then one F.linear per weight, and the row projection
   by the ring GEMM + reduce-scatter against RowParallelLinear's F.linear then reduce-scatter:
   outputs, input gradients and weight gradients.
2. Whole models: two decoder layers (Llama, then PaLM's parallel block) built by
   apply_tensor_parallel with and without distributed.tp_comm_overlap, same seed; logits and
   every parameter's gradient. With model.kernels "torch" and "triton" (Triton's interpreter
   on CPU), the latter with its "selective" SwiGLU recomputation on one layer's MLP
   (RingSwiGLULinear).

Every rank builds the same full tensors from one seed. The error of a pair is
|a - b| / |b| (Frobenius norms); a pair above RTOL raises, and rank 0 prints the largest error
met (the figure test_tp_overlap.py quotes)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from picotron.attention import sdpa_attention  # noqa: E402
from picotron.config import Config, DistributedConfig, ModelConfig  # noqa: E402
from picotron.model import Decoder, materialize  # noqa: E402
from picotron.process_group_manager import ProcessGroupManager  # noqa: E402
from picotron.speed.kernels.swap import apply_kernels  # noqa: E402
from picotron.tensor_parallel import apply_tensor_parallel  # noqa: E402
from picotron.tensor_parallel.comms import gather_from_sequence  # noqa: E402
from picotron.tensor_parallel.layers import RowParallelLinear  # noqa: E402
from picotron.tensor_parallel.overlap import RingRowParallelLinear, ring_column_linear  # noqa: E402

B, T, C = 3, 16, 24
OUTS = (24, 8, 8)              # q, k, v widths (full); every one divisible by tp = 4
RTOL = 1e-6                    # fp32: only the order of the sums differs
worst = {"error": 0.0, "what": ""}


def check(name, actual, expected):
    error = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
    if error > worst["error"]:
        worst.update(error=error, what=name)
    if not error <= RTOL:
        raise AssertionError(f"{name}: relative error {error:.2e} > {RTOL:.0e}")


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def layer_checks(group, tag):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)                            # the same full tensors on every rank
    x, ws = torch.randn(B, T, C), [torch.randn(o, C) for o in OUTS]
    dy = torch.randn(B, T, sum(OUTS))
    chunk = slice(rank * T // tp, (rank + 1) * T // tp)
    shards = [w.chunk(tp)[rank] for w in ws]        # column shards: this rank's output rows
    dy_local = torch.cat([d.chunk(tp, -1)[rank] for d in dy.split(OUTS, -1)], -1)

    runs = []
    for overlap in (False, True):
        x_in, w_in = leaf(x[:, chunk]), [leaf(w) for w in shards]
        if overlap:
            y = ring_column_linear(x_in, w_in, group)
        else:
            gathered = gather_from_sequence(x_in, group)
            y = torch.cat([F.linear(gathered, w) for w in w_in], -1)
        y.backward(dy_local)
        runs.append([y.detach(), x_in.grad] + [w.grad for w in w_in])
    for i, (a, b) in enumerate(zip(*runs[::-1])):
        check(f"{tag} column {['output', 'dL/dx', 'dL/dWq', 'dL/dWk', 'dL/dWv'][i]}", a, b)

    w, x_wide, dy_row = torch.randn(C, 2 * C), torch.randn(B, T, 2 * C), torch.randn(B, T, C)
    runs = []
    for cls in (RowParallelLinear, RingRowParallelLinear):
        row = cls(2 * C, C, rank, tp, group, True)
        with torch.no_grad():
            row.weight.copy_(w[row.weight.local_slice])
        x_in = leaf(x_wide[..., row.weight.local_slice[1]])
        y = row(x_in)
        y.backward(dy_row[:, chunk])
        runs.append([y.detach(), x_in.grad, row.weight.grad])
    for name, a, b in zip(("output", "dL/dx", "dL/dW"), *runs[::-1]):
        check(f"{tag} row {name}", a, b)


def model_checks(pgm, tag, kernels, palm):
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, kernels=kernels,
                      parallel_residual=palm, norm_type="layernorm" if palm else "rmsnorm")
    ids = torch.randint(0, 40, (2, T), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, T, 40, generator=torch.Generator().manual_seed(2))
    runs = []
    for overlap in (False, True):
        config = Config(model=cfg, distributed=DistributedConfig(
            tp_size=pgm.tp_size, dp_size=pgm.dp_size, sequence_parallel=True,
            tp_comm_overlap=overlap, use_cpu=True))
        with torch.device("meta"):
            model = Decoder(cfg, sdpa_attention)
        model = materialize(apply_tensor_parallel(model, pgm, config), 3, "cpu", torch.float32)
        apply_kernels(model, config)
        if kernels == "triton":
            model.layers["1"].mlp.recompute_swiglu = True   # "selective" on layer 1's MLP
        logits = model(ids)                                  # (B, T, V/tp)
        cols = slice(pgm.tp_rank * 40 // pgm.tp_size, (pgm.tp_rank + 1) * 40 // pgm.tp_size)
        (logits * probe[..., cols]).sum().backward()
        runs.append([logits.detach()] + [p.grad for p in model.parameters()])
        names = ["logits"] + [n for n, _ in model.named_parameters()]
    if type(model.layers["0"].self_attn).__name__ not in ("OverlapAttention",
                                                          "TritonOverlapAttention"):
        raise AssertionError(f"overlap not applied: {type(model.layers['0'].self_attn)}")
    for name, a, b in zip(names, *runs[::-1]):
        check(f"{tag} {kernels} {'palm' if palm else 'llama'} {name}", a, b)


def main():
    dist.init_process_group("gloo")
    layer_checks(dist.group.WORLD, "tp4")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layer_checks(pairs[dist.get_rank() // 2], "tp2")
    for pgm, tag in ((ProcessGroupManager(tp=4), "tp4"), (ProcessGroupManager(dp=2, tp=2),
                                                         "dp2 tp2")):
        for kernels in ("torch", "triton"):
            for palm in (False, True):
                model_checks(pgm, tag, kernels, palm)
    if dist.get_rank() == 0:
        print(f"largest relative error {worst['error']:.2e} ({worst['what']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
