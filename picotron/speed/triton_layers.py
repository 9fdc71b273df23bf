"""`model.kernels = "triton"`: the textbook's norms, attention and MLP as subclasses that run
our Triton kernels and fused projections. Same parameters, names and hooks; only `forward`
differs (speed/kernels.py swaps each module's class for its subclass here).

    TritonRMSNorm, TritonLayerNorm   triton_norms.py: one pass each way, a tiled weight-gradient
                                     sum, fp32 statistics, the reference's casting
    TritonAttention                  one matmul for q, k and v (fused_linear.py), then RoPE
                                     straight out of the packed rows into contiguous q, k, v
                                     (triton_rope.py)
    TritonMLP                        one matmul for gate and up, SwiGLU on the packed result
                                     (triton_swiglu.py); with `recompute_swiglu` (activation
                                     checkpointing "selective") the SwiGLU and the down
                                     projection are one op that keeps gu, not the SwiGLU output

The projections stay separate named parameters (checkpoints and tensor-parallel shards are laid
out by them); their weights are concatenated at run time, or taken as a view of the gradient
buckets' flat buffer when they lie back to back there (fused_linear.stacked). Under tensor
parallelism each rank concatenates its own column shards, which are exactly its heads' q, k, v
rows and its slice of gate and up. What fusing buys is measured in bench/NOTES.md.
"""
from picotron.model import Attention, LayerNorm, MLP, RMSNorm
from picotron.speed.fused_linear import fused_linear
from picotron.speed.triton_norms import layer_norm, rms_norm
from picotron.speed.triton_rope import qkv_rope
from picotron.speed.triton_swiglu import swiglu_linear, swiglu_packed


class TritonRMSNorm(RMSNorm):
    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class TritonLayerNorm(LayerNorm):
    def forward(self, x):
        return layer_norm(x, self.weight, self.eps)


class TritonAttention(Attention):
    def project(self, x, weights):
        """x @ cat(weights)^T as one GEMM (fp8_triton.py's subclass runs it in FP8)."""
        return fused_linear(x, weights)

    def forward(self, x, cos, sin, position_ids):
        B, T, _ = x.shape
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        heads, kv_heads = (w.shape[0] // self.head_dim for w in weights[:2])   # this rank's
        qkv = self.project(x, weights)                              # (B, T, (H + 2K) * D)
        q, k, v = qkv_rope(qkv, cos, sin, heads, kv_heads)          # (B, H|K, T, D), rotated
        out = self.attention_fn(q, k, v, position_ids)                          # (B, H, T, D)
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


FAST_CLASSES = {RMSNorm: TritonRMSNorm, LayerNorm: TritonLayerNorm, Attention: TritonAttention,
                MLP: TritonMLP}
