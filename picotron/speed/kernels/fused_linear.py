"""One matmul for several projections of the same input: q/k/v, or gate/up.

    y = fused_linear(x, [w_1, ..., w_n])  ==  cat([F.linear(x, w_i) for w_i], -1)

x (..., C), w_i (O_i, C), y (..., O) with O = sum O_i. The model keeps separate named
parameters (q_proj, k_proj, v_proj; gate_proj, up_proj): checkpoints and tensor parallelism
rely on those names and shapes. Under tensor parallelism each is a column shard, so the
concatenation of this rank's shards is this rank's share of the fused weight. The fusion
therefore happens at run time, here.

Why bother: one GEMM with O = 1600 outputs runs at a higher fraction of peak than three with
960, 320 and 320. On an H200, x (16, 2048, C) bf16, forward + backward (bench/fused_projections.py):
SmolLM-360M q/k/v 0.97 ms separate -> 0.58 ms fused, gate/up 1.36 -> 1.30 ms; at 1.7B's
widths (C = 2048, I = 8192) the GEMMs are already large and fusing gains nothing (q/k/v 3.40
-> 3.49 ms, gate/up 9.59 -> 9.68 ms). The price is one concatenation of the weights (O x C)
in forward and again in backward, unless they already lie back to back in one buffer, in
order: GradBuckets lays them out so (buckets.gradient_order), and `stacked` then takes the
(O, C) view of that buffer instead (profile at 1.7B: the concatenations were 2.3 ms a step).

Memory: backward saves x and the individual weights, which are alive anyway, NOT the
concatenated weight: keeping that would hold an extra copy of every layer's weights until its
backward (~92 MB a layer at 1.7B, q/k/v + gate/up). The gradient of the fused weight is
computed once and handed back as row slices (views): dW_i = dW[o_i : o_i + O_i].

Not autocast-aware: the weights must already have x's dtype (the model is built in bf16).
"""
import torch
import torch.nn.functional as F


def stacked(weights):
    """torch.cat(weights) (O, C): a view of their buffer when they lie back to back in it, in
    this order; else a concatenated copy."""
    w0 = weights[0]
    storage = w0.untyped_storage().data_ptr()
    in_place = all(w.is_contiguous() and w.untyped_storage().data_ptr() == storage
                   for w in weights) and all(b.storage_offset() == a.storage_offset() + a.numel()
                                             for a, b in zip(weights, weights[1:]))
    if in_place:
        return w0.as_strided((sum(w.shape[0] for w in weights), w0.shape[1]), (w0.shape[1], 1))
    return torch.cat(weights, dim=0)


class FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        w = stacked(weights)                    # (O, C): a view, or a copy freed on return
        ctx.save_for_backward(x, *weights)              # x and the weights, never w
        ctx.out_sizes = [wi.shape[0] for wi in weights]
        # F.linear folds the leading dims into one GEMM and returns a fresh (..., O) tensor
        # (not a view), which triton_swiglu's in-place backward relies on.
        return F.linear(x, w)                           # (..., O)

    @staticmethod
    def backward(ctx, dy):                              # dy (..., O)
        x, *weights = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1:])
        dx = dws = None
        if need_x or need_w:
            dy2 = dy.reshape(-1, dy.shape[-1])          # (N, O), N = prod(leading dims)
        if need_x:
            w = stacked(weights)                        # (O, C): a view, or a cheap copy
            dx = (dy2 @ w).view(x.shape)                # (N, O) @ (O, C): one GEMM, K = O
            del w
        if need_w:
            # (O, N) @ (N, C): one GEMM over every token; all rows computed even if only some
            # weights need a gradient (never the case in training).
            dw = dy2.t() @ x.reshape(-1, x.shape[-1])   # (O, C)
            dws = dw.split(ctx.out_sizes, dim=0)        # views (O_i, C), contiguous each
        grads = [dws[i] if dws is not None and ctx.needs_input_grad[1 + i] else None
                 for i in range(len(weights))]
        return (dx, *grads)


def fused_linear(x, weights):
    """cat([x @ w.T for w in weights], -1) as one GEMM. x (..., C), weights [(O_i, C)]."""
    weights = list(weights)
    assert len(weights) >= 1, "fused_linear needs at least one weight"
    for i, w in enumerate(weights):
        assert w.dim() == 2 and w.shape[1] == x.shape[-1], \
            f"weight {i} has shape {tuple(w.shape)}, expected (O_{i}, {x.shape[-1]})"
        assert w.dtype == x.dtype and w.device == x.device, \
            f"weight {i} is {w.dtype} on {w.device}, x is {x.dtype} on {x.device}"
    return FusedLinear.apply(x, *weights)


def fused_linear_reference(x, weights):
    """The readable version and test oracle: one F.linear per weight, concatenated."""
    return torch.cat([F.linear(x, w) for w in weights], dim=-1)
