"""`training.fp8` with `model.kernels="triton"`: the fused q/k/v and gate/up projections as one
FP8 GEMM each (fp8.py), the rest of triton_layers.py's attention and MLP unchanged.

One scale set covers the fused weight: tensorwise, the amax of q, k and v together (of gate
and up together), which is also what one GPU computes for the concatenation under any tensor
parallel split, since the amax is all-reduced over the group; rowwise, each output row has its
own scale anyway. The o and down projections are Fp8 linears of their own (fp8_layers.py).

With "selective" recomputation (`recompute_swiglu`), the SwiGLU and the down projection are
one op, `Fp8SwiGLULinear`: triton_swiglu.SwiGLULinear's recomputation with FP8 GEMMs. It keeps
gu, W_down and the scales, not the SwiGLU output h (N, I): backward computes dh = dy W (FP8),
then one kernel writes d(gu) and h (bitwise forward's h) and h^T is cast again for dW
(tensorwise with forward's scale, so dW is what keeping h would have given).
"""
import torch

from picotron.speed.fp8 import (E4M3, _cast_fast, cast_grad, cast_input, cast_weight,
                                cast_weight_t, fp8_linear, quantize, scaled_mm)
from picotron.speed.triton_layers import TritonAttention, TritonMLP
from picotron.speed.triton_swiglu import (_may_overwrite, _rows, _swiglu_backward,
                                          _swiglu_forward, swiglu_packed)


class Fp8SwiGLULinear(torch.autograd.Function):
    """y = swiglu(gu) @ W^T in FP8: gu (..., 2I) -> (..., O), W (O, I); under tensor
    parallelism I is this rank's share (row-parallel, `in_group`) and y a partial sum."""

    @staticmethod
    def forward(ctx, gu, rowwise, in_group, weight):
        ctx.inplace = _may_overwrite(gu)
        h = _swiglu_forward(_rows(gu))                  # (N, I), freed when forward returns
        (h_q, h_s), _ = cast_input(h, rowwise, in_group, transposed=False)
        w_q, w_s = cast_weight(weight, rowwise, in_group, None)
        ctx.rowwise = rowwise
        ctx.save_for_backward(gu, weight, h_s, w_s)
        return scaled_mm(h_q, h_s, w_q, w_s, gu.dtype, (*gu.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, dy):                                              # dy (..., O)
        gu, weight, h_s, w_s = ctx.saved_tensors
        gu2 = _rows(gu)                                                 # (N, 2I)
        (dy_q, dy_s), dyt = cast_grad(dy.reshape(-1, dy.shape[-1]), ctx.rowwise, None)
        dgu = dw = None
        if ctx.needs_input_grad[0]:
            wt_q, wt_s = cast_weight_t(weight, w_s, ctx.rowwise, None)
            dh2 = scaled_mm(dy_q, dy_s, wt_q, wt_s, gu.dtype)   # (N, I), fresh: h goes over it
            dgu2 = gu2 if ctx.inplace else torch.empty_like(gu2)
            _swiglu_backward(dh2, gu2, dgu2, store_h=True)
            h, dgu = dh2, dgu2.detach().view(gu.shape)
            if ctx.inplace:
                torch.autograd.graph.increment_version(gu)
        else:
            h = _swiglu_forward(gu2)
        if ctx.needs_input_grad[3]:                      # h^T (I, N): along the tokens
            ht = (quantize(h.t(), E4M3, True) if ctx.rowwise
                  else (_cast_fast(h.t(), h_s, E4M3), h_s))
            dw = scaled_mm(*dyt, *ht, weight.dtype)                     # (O, I)
        return dgu, None, None, dw


class Fp8TritonAttention(TritonAttention):
    fp8_recipe, fp8_group = "tensorwise", None       # set per module by fp8_layers.apply_fp8

    def project(self, x, weights):
        return fp8_linear(x, weights, self.fp8_recipe, out_group=self.fp8_group)


class Fp8TritonMLP(TritonMLP):
    fp8_recipe, fp8_group = "tensorwise", None
    project = Fp8TritonAttention.project

    def forward(self, x):
        gu = self.project(x, [self.gate_proj.weight, self.up_proj.weight])     # (B, T, 2I)
        if not self.recompute_swiglu:
            return self.down_proj(swiglu_packed(gu))     # an Fp8 linear: (B, T, C)
        y = Fp8SwiGLULinear.apply(gu, self.fp8_recipe == "rowwise",
                                  getattr(self.down_proj, "tp_group", None), self.down_proj.weight)
        reduce = getattr(self.down_proj, "reduce", None)     # row-parallel: g over TP
        return y if reduce is None else reduce(y)


FP8_CLASSES = {TritonAttention: Fp8TritonAttention, TritonMLP: Fp8TritonMLP}
