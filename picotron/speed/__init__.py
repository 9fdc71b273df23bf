"""The speed wing: plug-ins, each applied from outside, after the model, the axes and the
weights are built, by swapping modules or methods. The model never hears of them; the readable
PyTorch path (model.kernels=torch, no fused loss, no recomputation) is the reference each is
tested against. On GPUs the config's "auto" values turn them on (config.resolve_auto).

Reading order (each file needs only the ones before it):
    kernels/         model.kernels: the norms, attention and MLP as subclasses running fused
                     kernels, and the Triton kernels of the fused loss and AdamW (its
                     `__init__.py` lists them)
    fp8/             training.fp8: the decoder layers' projections as FP8 GEMMs (its
                     `__init__.py` lists them)
    recompute.py     training.activation_checkpointing: none | full | selective, per layer
    loss.py          training.fused_loss: the head moved into the loss, chunk by chunk
    adamw.py         training.use_fused_adam on a GPU: AdamW in one pass per gradient shard
    cuda_graphs.py   training.cuda_graphs: the layers' forward and backward as CUDA graphs
    __init__.py      `apply_speed`: the order they are applied in (below)

train.py applies them in this order: `apply_speed` on the built model, then the gradient
buckets, then `capture_layers` (graphs are captured where the buckets put the parameters),
then `build_optimizer`.
"""
from picotron.config import resolve_auto
from picotron.speed.adamw import build_optimizer  # noqa: F401
from picotron.speed.cuda_graphs import capture_layers  # noqa: F401
from picotron.speed.fp8.layers import apply_fp8
from picotron.speed.kernels.swap import apply_kernels
from picotron.speed.loss import apply_fused_loss
from picotron.speed.recompute import apply_activation_checkpointing


def apply_speed(model, loss_fn, config, tp_group=None, dp_group=None, cp_group=None):
    """(model, loss_fn) with the fast paths the config asks for, in place. `tp_group`: the
    tensor-parallel group (FP8 scales of sharded projections are all-reduced over it);
    `dp_group`: the data x context group (delayed FP8 scales are all-reduced over it too);
    `cp_group`: the context-parallel one (delayed FP8's first step scales over it).

    Order: kernels first (a class swap, which recomputation must see: it binds the layer's
    forward, and "selective" with our kernels is a flag on their MLP), then FP8 (a class swap
    of the projections, and of the kernels' attention and MLP), then recomputation,
    then the loss (it swaps the head), and torch.compile last, on the layers as they run.
    "auto" options are resolved first, if the config was not loaded by config_from_dict."""
    resolve_auto(config)
    apply_kernels(model, config)
    apply_fp8(model, config, tp_group, dp_group, cp_group)
    apply_activation_checkpointing(model, config)
    model, loss_fn = apply_fused_loss(model, loss_fn, config)
    if config.training.compile:     # in place: parameter names stay those of the layout
        for layer in model.layers.values():
            # static shapes: a run's layers see one (micro-batch, seq); another shape compiles
            # again rather than tracing symbolic sizes, which the FP8 GEMM (_scaled_mm with
            # out=) has no shape function for
            layer.compile(dynamic=False)
    return model, loss_fn
