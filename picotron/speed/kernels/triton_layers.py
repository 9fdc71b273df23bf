"""`model.kernels = "triton"`: the textbook's norms, attention and MLP as subclasses that run
our Triton kernels and fused projections. Same parameters, names and hooks; only `forward`
differs (speed/kernels/swap.py swaps each module's class for its subclass here).

    TritonRMSNorm, TritonLayerNorm   triton_norms.py: one pass each way, a tiled weight-gradient
                                     sum, fp32 statistics, the reference's casting
    TritonDecoderLayer               the residual add before the MLP's norm done by that norm's
                                     kernel (`add_norm`), its gradient added in its backward
    TritonAttention                  one matmul for q, k and v (fused_linear.py), then RoPE
                                     straight out of the packed rows into contiguous q, k, v
                                     (triton_rope.py)
    TritonMLP                        one matmul for gate and up, SwiGLU on the packed result
                                     (triton_swiglu.py); with `recompute_swiglu` (activation
                                     checkpointing "selective") the SwiGLU and the down
                                     projection are one op that keeps gu, not the SwiGLU output
    TritonOverlapAttention, -MLP     distributed.tp_comm_overlap: the same, their fused
                                     projections run as the ring GEMMs of
                                     tensor_parallel/overlap.py on this rank's chunk of T;
                                     "selective" is RingSwiGLULinear, the ring's swiglu_linear

The projections stay separate named parameters (checkpoints and tensor-parallel shards are laid
out by them); their weights are concatenated at run time, or taken as a view of the gradient
buckets' flat buffer when they lie back to back there (fused_linear.stacked). Under tensor
parallelism each rank concatenates its own column shards, which are exactly its heads' q, k, v
rows and its slice of gate and up. What fusing buys is measured in bench/NOTES.md.
"""
import torch

from picotron.model import Attention, DecoderLayer, LayerNorm, MLP, RMSNorm
from picotron.speed.kernels.fused_linear import fused_linear, stacked
from picotron.speed.kernels.triton_norms import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from picotron.speed.kernels.triton_rope import qkv_rope
from picotron.speed.kernels.triton_swiglu import (_may_overwrite, _rows, _swiglu_backward,
                                                  _swiglu_forward, swiglu_linear, swiglu_packed)
from picotron.tensor_parallel.overlap import (OverlapAttention, OverlapMLP, gather_matmul,
                                              matmul_reduce_scatter, ring_column_linear)


class TritonRMSNorm(RMSNorm):
    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def add_norm(self, x, delta):
        """(x + delta, self(x + delta)) in one kernel each way (no module hooks run)."""
        return add_rms_norm(x, delta, self.weight, self.eps)


class TritonLayerNorm(LayerNorm):
    def forward(self, x):
        return layer_norm(x, self.weight, self.eps)

    def add_norm(self, x, delta):
        return add_layer_norm(x, delta, self.weight, self.eps)


class TritonDecoderLayer(DecoderLayer):
    """DecoderLayer.forward with `x = x + attn` and the MLP's norm of it as one op: the sum
    (B, T, C) is written once and never read back, and its gradient is added inside the
    norm's backward (triton_norms.py). The textbook forward where that norm is hooked (tensor
    parallelism's entry into the MLP block, unless tp_comm_overlap) or absent (PaLM)."""

    def forward(self, x, cos, sin):
        norm = self.post_attention_layernorm
        if not hasattr(norm, "add_norm") or norm._forward_hooks or norm._forward_pre_hooks:
            return super().forward(x, cos, sin)
        x, h = norm.add_norm(x, self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp(h)


class TritonAttention(Attention):
    def project(self, x, weights):
        """x @ cat(weights)^T as one GEMM (speed/fp8/triton_layers.py's subclass runs it in FP8)."""
        return fused_linear(x, weights)

    def forward(self, x, cos, sin):
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        heads, kv_heads = (w.shape[0] // self.head_dim for w in weights[:2])   # this rank's
        qkv = self.project(x, weights)                              # (B, T, (H + 2K) * D)
        B, T, _ = qkv.shape           # all T tokens, even where x is a chunk (tp_comm_overlap)
        q, k, v = qkv_rope(qkv, cos, sin, heads, kv_heads)          # (B, H|K, T, D), rotated
        out = self.attention_fn(q, k, v)                            # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))              # (B, T, C)


class TritonMLP(MLP):
    recompute_swiglu = False     # set per layer by speed/recompute.py ("selective")
    project = TritonAttention.project

    def forward(self, x):
        gu = self.project(x, [self.gate_proj.weight, self.up_proj.weight])     # (B, T, 2I)
        if not self.recompute_swiglu:
            return self.down_proj(swiglu_packed(gu))
        # the down projection's own matmul, so a row-parallel one still needs its sum over TP
        y = swiglu_linear(gu, self.down_proj.weight)
        reduce = getattr(self.down_proj, "reduce", None)
        return y if reduce is None else reduce(y)


class TritonOverlapAttention(TritonAttention):
    """distributed.tp_comm_overlap: x is this rank's chunk (B, T/tp, C) and q, k, v come out of
    the ring all-gather + GEMM (tensor_parallel/overlap.py) on the weights `stacked` as above."""
    def project(self, x, weights):
        return ring_column_linear(x, weights, self.tp_group, stack=stacked)


class TritonOverlapMLP(TritonMLP):
    """Gate and up in one ring, as TritonOverlapAttention; with `recompute_swiglu`, the SwiGLU
    and the down projection as RingSwiGLULinear."""
    project = TritonOverlapAttention.project

    def forward(self, x):
        if not self.recompute_swiglu:
            return super().forward(x)       # the down projection is a RingRowParallelLinear
        gu = self.project(x, [self.gate_proj.weight, self.up_proj.weight])     # (B, T, 2I)
        return RingSwiGLULinear.apply(gu, self.down_proj.weight, self.tp_group)  # (B, T/tp, C)


class RingSwiGLULinear(torch.autograd.Function):
    """triton_swiglu.SwiGLULinear (keeps gu and W, not h) with the row-parallel GEMM and its
    reduce-scatter along T as overlap.py's ring: gu (B, T, 2I) -> y (B, T/tp, O). Backward
    gathers dy by the ring, computing dh = dy W chunk by chunk, then as SwiGLULinear: one
    kernel writes d(gu) (over gu when allowed) and h over dh, and dW = dy^T h."""

    @staticmethod
    def forward(ctx, gu, weight, group):
        ctx.inplace, ctx.group = _may_overwrite(gu), group
        h = _swiglu_forward(_rows(gu))                  # (N, I), freed when forward returns
        ctx.save_for_backward(gu, weight)
        return matmul_reduce_scatter(h.view(*gu.shape[:-1], -1), weight.t(), group)

    @staticmethod
    def backward(ctx, dy):                                              # (B, T/tp, O)
        gu, weight = ctx.saved_tensors
        dh, dy_full = gather_matmul(dy.contiguous(), weight, ctx.group)  # (B, T, I), (B, T, O)
        gu2, dh2 = _rows(gu), _rows(dh)
        dgu2 = gu2 if ctx.inplace else torch.empty_like(gu2)
        _swiglu_backward(dh2, gu2, dgu2, store_h=True)                  # h written over dh
        if ctx.inplace:
            torch.autograd.graph.increment_version(gu)
        dw = _rows(dy_full).t() @ dh2                                   # (O, N) @ (N, I)
        return dgu2.detach().view(gu.shape), dw, None


FAST_CLASSES = {RMSNorm: TritonRMSNorm, LayerNorm: TritonLayerNorm, Attention: TritonAttention,
                MLP: TritonMLP, OverlapAttention: TritonOverlapAttention,
                OverlapMLP: TritonOverlapMLP, DecoderLayer: TritonDecoderLayer}
