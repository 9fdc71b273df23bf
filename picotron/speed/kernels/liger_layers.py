"""`model.kernels = "liger"`: the textbook's RMSNorm, RoPE and SwiGLU from liger-kernel's Triton
kernels (Hsu et al. 2024, https://github.com/linkedin/Liger-Kernel), CUDA only, as subclasses
whose `forward` calls them (speed/kernels/swap.py swaps each module's class for its subclass here).

What each saves over the reference, per layer, with N = B*T tokens:
- rms_norm: one kernel instead of ~6 (upcast, square, mean, rsqrt, scale, gain), and backward
  keeps only the input and one fp32 rstd per token, not the fp32 copies.
- rope: q and k rotated in place in one kernel; the reference builds a rotated copy and two
  products per tensor, forward and backward.
- swiglu: silu(gate) * up in one kernel, recomputing silu in backward rather than storing it
  (saves N x I bf16 per layer).
LayerNorm (PaLM-style option) stays on F.layer_norm, already one fused kernel.
"""
from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu

from picotron.model import Attention, MLP, RMSNorm


class LigerRMSNorm(RMSNorm):
    def forward(self, x):
        # "llama" casting: the statistics in fp32, x * rstd cast back before the gain, exactly
        # the reference's order. in_place=False: never overwrite an incoming gradient.
        return liger_rms_norm(x, self.weight, self.eps, 0.0, "llama", False)


class LigerAttention(Attention):
    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # q (B, H, T, D), k and v (B, K, T, D): views of the (B, T, heads, D) projections
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = liger_rope(q, k, cos, sin)
        out = self.attention_fn(q, k, v)                                        # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))              # (B, T, C)


class LigerMLP(MLP):
    def forward(self, x):
        return self.down_proj(liger_swiglu(self.gate_proj(x), self.up_proj(x)))


FAST_CLASSES = {RMSNorm: LigerRMSNorm, Attention: LigerAttention, MLP: LigerMLP}
