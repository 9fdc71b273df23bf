"""RoPE straight out of the fused q/k/v projection, in one Triton kernel each way.

`model.kernels = "triton"` computes q, k and v with one matmul (fused_linear.py):
qkv (B, T, (H + 2K) * D), each token's row holding its H query heads, then K key heads, then K
value heads. `qkv_rope` reads that row once (one program per token, all H + 2K heads) and writes
three contiguous tensors:

    q (B, T, H, D) rotated,  k (B, T, K, D) rotated,  v (B, T, K, D) copied

returned as (B, H, T, D) / (B, K, T, D) views, the layout attention takes (SDPA's flash and
cuDNN kernels read (B, T, H, D) memory through those strides). The packed qkv is not kept:
backward needs only cos and sin, and writes d(qkv) packed, which is what the fused
projection's backward consumes. Against the reference (separate projections, then
`model.apply_rope`: a rotated copy, two products and a sum per tensor) it saves the three
extra passes each way; against liger's RoPE (in place on q and k) it saves the copies that make
q and k contiguous when they are slices of one packed row.

Rotation (model.apply_rope, pairs (i, i + D/2)): with x = (x1, x2) and c, s split the same way,
    out1 = x1 c1 - x2 s1,   out2 = x2 c2 + x1 s2
    dx1 = d1 c1 + d2 s2,    dx2 = d2 c2 - d1 s1
computed in fp32, rounded once to the input dtype.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rope_rows(q_ptr, k_ptr, v_ptr, qkv_ptr, cos_ptr, sin_ptr, q_stride, k_stride, v_stride,
               qkv_stride, H, K, HALF, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_HALF: tl.constexpr):
    """One token's H + 2K heads in one program: forward, the packed row of qkv into rows of
    q and k rotated and of v copied (torch's strided copy of a column slice ran at a third of
    this kernel's bandwidth on the H200); BACKWARD, rows of dq, dk un-rotated and dv copied
    into the packed row. Head j < H is q's head j, j < H + K k's head j - H, then v's."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]                      # (BLOCK_H, 1): H + 2K rounded up
    i = tl.arange(0, BLOCK_HALF)[None, :]                   # (1, D/2 rounded up to 2^n)
    mask = (h < H + 2 * K) & (i < HALF)
    cs = token * 2 * HALF + i
    c1 = tl.load(cos_ptr + cs, mask=i < HALF).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=i < HALF).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=i < HALF).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=i < HALF).to(tl.float32)
    packed = qkv_ptr + token * qkv_stride + h * 2 * HALF + i
    split = tl.where(h < H, q_ptr + token * q_stride + h * 2 * HALF,
                     tl.where(h < H + K, k_ptr + token * k_stride + (h - H) * 2 * HALF,
                              v_ptr + token * v_stride + (h - H - K) * 2 * HALF)) + i
    src, dst = (split, packed) if BACKWARD else (packed, split)
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    if BACKWARD:
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    rotate = h < H + K                                      # v's heads are copied
    y1, y2 = tl.where(rotate, y1, x1), tl.where(rotate, y2, x2)
    tl.store(dst, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(dst.dtype.element_ty), mask=mask)


def _launch(q, k, v, qkv, cos, sin, heads, kv_heads, backward):
    """Token rows: qkv (N, (H + 2K) * D) <-> q (N, H * D), k, v (N, K * D), any row strides;
    cos, sin (N, D)."""
    n, half = cos.shape[0], cos.shape[1] // 2
    _rope_rows[(n,)](q, k, v, qkv, cos, sin, q.stride(0), k.stride(0), v.stride(0),
                     qkv.stride(0), heads, kv_heads, half, BACKWARD=backward,
                     BLOCK_H=triton.next_power_of_2(heads + 2 * kv_heads),
                     BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)


class QKVRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads: int, num_kv_heads: int):
        B, T, width = qkv.shape
        D = cos.shape[-1]
        H, K = num_heads, num_kv_heads
        rows = qkv.reshape(B * T, width)                     # a view: qkv is a fresh matmul out
        cos, sin = cos.reshape(B * T, D).contiguous(), sin.reshape(B * T, D).contiguous()
        q = torch.empty(B * T, H * D, dtype=qkv.dtype, device=qkv.device)
        k = torch.empty(B * T, K * D, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty(B * T, K * D, dtype=qkv.dtype, device=qkv.device)
        _launch(q, k, v, rows, cos, sin, H, K, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.shape = (B, T, H, K, D)
        return tuple(t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        B, T, H, K, D = ctx.shape
        d_qkv = torch.empty(B * T, (H + 2 * K) * D, dtype=dq.dtype, device=dq.device)
        # the incoming gradients are (B, H, T, D) views; the kernel wants token rows
        dq, dk, dv = (g.transpose(1, 2).reshape(B * T, -1) for g in (dq, dk, dv))
        _launch(dq, dk, dv, d_qkv, cos, sin, H, K, backward=True)
        return d_qkv.view(B, T, -1), None, None, None, None


def qkv_rope(qkv, cos, sin, num_heads: int, num_kv_heads: int):
    """qkv (B, T, (H+2K)*D), cos/sin (B, T, D) -> q (B, H, T, D), k, v (B, K, T, D)."""
    return QKVRope.apply(qkv, cos, sin, num_heads, num_kv_heads)
