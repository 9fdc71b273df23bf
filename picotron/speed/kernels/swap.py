"""apply_kernels: the textbook modules' classes swapped for subclasses that run fused kernels.

    model.kernels = "torch"    nothing changes: model.py's formulas (the reference)
                  = "triton"   our Triton norms, RoPE and SwiGLU, fused q/k/v and gate/up
                               projections (triton_layers.py)
                  = "liger"    liger-kernel's RMSNorm, RoPE and SwiGLU (liger_layers.py)

Each fast subclass overrides only `forward`, computing what the textbook module computes
(tests/test_kernels_gpu.py and tests/test_triton_model.py check each against the reference).
Swapping `module.__class__` in place, rather than building new modules, keeps everything that
was attached to the module after it was built: its parameters (already drawn, loaded, perhaps
sharded), the hooks tensor parallelism registered on the norms, the attention function context
parallelism installed. Applied after the axes and the weights, so none of them ever meets a
kernel.
"""
from picotron.config import MissingPackage


def fast_classes(kernels: str) -> dict:
    """{textbook class: its fast subclass} for `model.kernels`; imports the kernels' package
    only when asked, and says how to do without it when it is missing."""
    if kernels == "torch":
        return {}
    package = {"triton": "the triton package on a CUDA machine (`pip install triton`)",
               "liger": "liger-kernel on a CUDA machine (`pip install liger-kernel==0.8.5`)"}
    try:
        if kernels == "triton":
            from picotron.speed.kernels.triton_layers import FAST_CLASSES
        else:
            from picotron.speed.kernels.liger_layers import FAST_CLASSES
    except ImportError as e:
        raise MissingPackage(f"model.kernels='{kernels}'", package[kernels],
                             "or set model.kernels='torch'", e) from None
    return FAST_CLASSES


def apply_kernels(model, config):
    """Swap, in place, every module whose class has a fast subclass for `model.kernels`."""
    swaps = fast_classes(config.model.kernels)
    for module in model.modules():
        fast = swaps.get(type(module))
        if fast is not None:
            module.__class__ = fast
    return model
