"""`model.kernels = "triton"`: picotron's own Triton kernels, with the projections fused.

    rms_norm, layer_norm   triton_norms.py: one pass each way, a tiled weight-gradient sum
    add_rms_norm, ...      the same with the residual add before them folded in
    qkv_rope               one matmul for q, k and v (fused_linear.py), then RoPE straight out
                           of the packed rows into contiguous q, k, v (triton_rope.py)
    swiglu_in              one matmul for gate and up, SwiGLU on the packed result
                           (triton_swiglu.py)
    mlp                    down(swiglu_in(x)); with recompute_swiglu (activation
                           checkpointing "selective") the SwiGLU and the down projection are
                           one op that keeps gu, not the SwiGLU output (swiglu_linear)

The projections stay separate named parameters (checkpoints and tensor-parallel shards are laid
out by them); their weights are concatenated at run time, a copy of a few MB per layer against
30-70 MB activations, or, once GradBuckets has laid them back to back in its buffer, a view of
it (fused_linear.stacked). Under tensor parallelism each rank concatenates its own column
shards, which are exactly its heads' q, k, v rows and its slice of gate and up. Why fuse (H200,
16 x 2048 tokens, bench/profile_step.py --gemm): at 360M's widths the q, k, v products forward
and backward take 0.67 ms as three matmuls and 0.44 ms as one; gate/up 1.39 -> 1.29 ms.
"""
import types

from picotron.config import MissingPackage
from picotron.ops.fused_linear import fused_linear


def sum_partials(linear, y):
    """A row-parallel layer's partial products summed over tensor parallelism (its `reduce`);
    a plain nn.Linear's output is already whole."""
    reduce = getattr(linear, "reduce", None)
    return y if reduce is None else reduce(y)


def triton_kernels(recompute_swiglu: bool = False):
    try:
        from picotron.ops.triton_norms import (add_layer_norm, add_rms_norm, layer_norm,
                                                 rms_norm)
        from picotron.ops.triton_rope import qkv_rope as rope_packed
        from picotron.ops.triton_swiglu import swiglu_linear, swiglu_packed
    except ImportError as e:
        raise MissingPackage("model.kernels='triton'", "the triton package on a CUDA machine "
                             "(`pip install triton`)", "or set model.kernels='torch'", e) from None

    def qkv_rope(x, attn, cos, sin):
        weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        heads, kv_heads = (w.shape[0] // attn.head_dim for w in weights[:2])   # this rank's
        return rope_packed(fused_linear(x, weights), cos, sin, heads, kv_heads)

    def swiglu_in(x, mlp):
        return swiglu_packed(fused_linear(x, [mlp.gate_proj.weight, mlp.up_proj.weight]))

    def mlp_recomputing_swiglu(x, mlp):
        gu = fused_linear(x, [mlp.gate_proj.weight, mlp.up_proj.weight])   # (B, T, 2I)
        return sum_partials(mlp.down_proj, swiglu_linear(gu, mlp.down_proj.weight))

    return types.SimpleNamespace(rms_norm=rms_norm, layer_norm=layer_norm,
                                 add_rms_norm=add_rms_norm, add_layer_norm=add_layer_norm,
                                 qkv_rope=qkv_rope, swiglu_in=swiglu_in,
                                 mlp=mlp_recomputing_swiglu if recompute_swiglu
                                 else lambda x, mlp: mlp.down_proj(swiglu_in(x, mlp)))
