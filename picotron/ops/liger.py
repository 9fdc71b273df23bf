"""`model.kernels = "liger"`: the model's pointwise ops from liger-kernel's Triton kernels
(Hsu et al. 2024, https://github.com/linkedin/Liger-Kernel), CUDA only.

Same names and signatures as the references in model.py (`rms_norm`, `layer_norm`, `qkv_rope`,
`swiglu_in`); tests/test_kernels_gpu.py compares each with its reference, forward and backward.
What each saves over the reference, per layer, with N = B*T tokens:
- rms_norm: one kernel instead of ~6 (upcast, square, mean, rsqrt, scale, gain), and backward
  keeps only the input and one fp32 rstd per token, not the fp32 copies.
- rope: q and k rotated in place in one kernel; the reference builds a rotated copy and two
  products per tensor, forward and backward.
- swiglu: silu(gate) * up in one kernel, recomputing silu in backward rather than storing it
  (saves N x I bf16 per layer).
LayerNorm (PaLM-style option) stays on F.layer_norm, already one fused kernel.
"""
import types

from picotron.config import MissingPackage
from picotron.model import layer_norm, project_qkv, with_residual


def liger_kernels():
    try:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu
    except ImportError as e:
        raise MissingPackage("model.kernels='liger'", "liger-kernel on a CUDA machine (`pip "
                             "install liger-kernel==0.8.5`)", "or set model.kernels='torch'",
                             e) from None

    def rms_norm(x, weight, eps: float):
        # "llama" casting: the statistics in fp32, x * rstd cast back before the gain, exactly
        # the reference's order. in_place=False: never overwrite an incoming gradient.
        return liger_rms_norm(x, weight, eps, 0.0, "llama", False)

    def qkv_rope(x, attn, cos, sin):
        # q (B, H, T, D), k (B, K, T, D) views of (B, T, H, D) projections; cos, sin (B, T, D)
        q, k, v = project_qkv(x, attn)
        return (*liger_rope(q, k, cos, sin), v)

    def swiglu_in(x, mlp):
        return liger_swiglu(mlp.gate_proj(x), mlp.up_proj(x))

    # the residual add stays a separate torch add, as in Hugging Face's Llama patched by liger
    return types.SimpleNamespace(rms_norm=rms_norm, layer_norm=layer_norm,
                                 add_rms_norm=with_residual(rms_norm),
                                 add_layer_norm=with_residual(layer_norm), qkv_rope=qkv_rope,
                                 swiglu_in=swiglu_in,
                                 mlp=lambda x, mlp: mlp.down_proj(swiglu_in(x, mlp)))
