"""`training.fp8` with `model.kernels="triton"`: the fused q/k/v and gate/up projections as one
FP8 GEMM each (linear.py), the rest of speed/kernels/triton_layers.py's attention and MLP unchanged.

One scale set covers the fused weight: tensorwise, the amax of q, k and v together (of gate
and up together), which is also what one GPU computes for the concatenation under any tensor
parallel split, since the amax is all-reduced over the group; rowwise, each output row has its
own scale anyway. The o and down projections are Fp8 linears of their own (layers.py).

With "selective" recomputation (`recompute_swiglu`), the SwiGLU and the down projection are
one op, `Fp8SwiGLULinear`: triton_swiglu.SwiGLULinear's recomputation with FP8 GEMMs. It keeps
gu and W_down's FP8 copies (and, tensorwise, h's amax), not the SwiGLU output h (N, I):
backward computes dh = dy W (FP8), then one kernel writes d(gu) and h (bitwise forward's h)
and h^T is cast again for dW (tensorwise with forward's amax, so forward's scale: dW is what
keeping h would have given; under "rowwise_bf16_dw" dW = dy^T h in bf16, no cast).
Its two SwiGLU kernels also cast (fused.py): under the row-scaled recipes forward writes
h's rowwise FP8 cast instead of h, backward d(gu)'s next to d(gu), handed to the gate/up
linear's dx GEMM (a GradCastHandoff made by fp8_swiglu_mlp, which Fp8TritonMLP runs);
tensorwise they take the amax of h and of d(gu) as they write them, so that no cast needs an
amax pass of its own.
"""
import torch

from picotron.speed.fp8.linear import (E4M3, FORWARD_FAST_ACCUM, Recipe, cast_grad, fp8_linear,
                                       quantize, recipe_of, scaled_mm, tensor_amax, weight_grad)
from picotron.speed.fp8.fused import (GradCastHandoff, fusable, swiglu_backward_cast, swiglu_cast)
from picotron.speed.fp8.delayed import for_this_call
from picotron.speed.fp8.delayed_swiglu import swiglu_backward_fp8, swiglu_fp8
from picotron.speed.fp8.quantize import amax_of, record_amax
from picotron.speed.fp8.weights import weight_casts
from picotron.speed.kernels.triton_layers import TritonAttention, TritonMLP
from picotron.speed.kernels.triton_swiglu import (_may_overwrite, _rows, _swiglu_backward,
                                                  _swiglu_forward, swiglu_packed)


def _cast_h(h, recipe: Recipe, in_group, site=None):
    """h (N, I) -> (h_q, h_s) for y = h W^T, and the amax h^T's cast reuses (tensorwise: h's
    own, or under delayed scaling the site's, h's own recorded for the next step)."""
    if recipe.rowwise:
        h_q, _, h_s = quantize(h, E4M3, "row", in_group)
        return h_q, h_s, None
    amax, record = tensor_amax(h, site, in_group)
    amax = amax_of(h, "tensor", in_group) if amax is None else amax
    h_q, _, h_s = quantize(h, E4M3, "tensor", amax=amax, record=record)
    return h_q, h_s, amax


def _cast_ht(h, recipe: Recipe, amax):
    """(h^T_q (I, N), its scale) for dW: per row of h^T along the tokens, or with forward's
    amax (so forward's scale): dW is what keeping h would have given."""
    scaling = "column" if recipe.rowwise else "tensor"
    return quantize(h, E4M3, scaling, rows=False, transposed=True, amax=amax)[1:]


class Fp8SwiGLULinear(torch.autograd.Function):
    """y = swiglu(gu) @ W^T in FP8: gu (..., 2I) -> (..., O), W (O, I); under tensor
    parallelism I is this rank's share (row-parallel, `in_group`) and y a partial sum.
    `cache`: the down projection's Fp8WeightCache, or None. `handoff`: a GradCastHandoff to
    put d(gu)'s cast (or amax) in for gate/up's linear, or None (fused.py). `sites`: (h's,
    dy's, d(gu)'s) fp8_delayed.Site under "tensorwise_delayed", else None: once calibrated,
    with fusable operands, the SwiGLU kernels write FP8 only (delayed_swiglu.py) and
    d(gu)'s two casts go to gate/up's linear whole."""

    @staticmethod
    def forward(ctx, gu, recipe, in_group, cache, handoff, sites, weight):
        ctx.inplace, ctx.handoff = _may_overwrite(gu), handoff
        h_site, ctx.dy_site, ctx.dgu_site = sites or (None, None, None)
        delayed = h_site is not None and not h_site.calibrating          # last step's scale
        ctx.fp8_only = delayed and handoff is not None and fusable(in_group, gu)
        if ctx.fp8_only:
            h_amax = h_site.scale_amax(gu.device)
            h_q, h_s = swiglu_fp8(_rows(gu), h_amax, h_site.record_into(gu.device))
        elif fusable(in_group, gu) and not delayed and _own_amax(h_site):
            # cast from the SwiGLU kernel's amax
            h_q, h_s, h_amax = swiglu_cast(_rows(gu), recipe)
            if h_site is not None:                    # calibrating: record that amax
                _record(h_site, h_amax)
        else:
            h = _swiglu_forward(_rows(gu))              # (N, I), freed when forward returns
            h_q, h_s, h_amax = _cast_h(h, recipe, in_group, h_site)
        casts = weight_casts(cache, [weight], weight, recipe.rowwise, in_group, None,
                             transposed=ctx.needs_input_grad[0])
        ctx.recipe, ctx.casts, ctx.w_dtype = recipe, casts, weight.dtype
        ctx.save_for_backward(gu, h_amax, weight if cache is None else None)
        return scaled_mm(h_q, h_s, casts.w_q, casts.w_s, gu.dtype,
                         (*gu.shape[:-1], weight.shape[0]), fast_accum=FORWARD_FAST_ACCUM)

    @staticmethod
    def backward(ctx, dy):                                              # dy (..., O)
        gu, h_amax, weight = ctx.saved_tensors
        recipe, gu2 = ctx.recipe, _rows(gu)                             # (N, 2I)
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_dgu, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[6]
        dy_c, dyt = cast_grad(dy2, recipe, None, need_dgu, need_dw, site=ctx.dy_site)
        dgu = dw = ht = None
        if need_dgu:
            wt_q, wt_s = ctx.casts.transposed(weight)
            dh2 = scaled_mm(*dy_c, wt_q, wt_s, gu.dtype)        # (N, I), fresh: h goes over it
        if need_dgu and ctx.fp8_only:       # d(gu)'s casts and h^T's, no bf16 d(gu) or h
            site, device = ctx.dgu_site, gu.device
            dgu_c, dgut, ht = swiglu_backward_fp8(dh2, gu2, site.scale_amax(device),
                                                  site.record_into(device), h_amax)
            # stands for d(gu) in autograd (no bytes): gate/up's linear takes the casts
            dgu, h = gu.new_zeros(()).expand(gu.shape), None
            ctx.handoff.put(dgu, dgu_c, dgut, whole=True)
        elif need_dgu:
            dgu2 = gu2 if ctx.inplace else torch.empty_like(gu2)
            if ctx.handoff is not None:                 # d(gu)'s cast (or amax) too
                dgu_cast = swiglu_backward_cast(dh2, gu2, dgu2, recipe, store_h=True)
            else:
                _swiglu_backward(dh2, gu2, dgu2, store_h=True)
            h, dgu = dh2, dgu2.detach().view(gu.shape)
            if ctx.inplace:
                torch.autograd.graph.increment_version(gu)
            if ctx.handoff is not None:                 # after the version bump it sees
                ctx.handoff.put(dgu, *dgu_cast)
        else:
            h = _swiglu_forward(gu2)
        if need_dw:                                     # h^T (I, N): along the tokens
            if ht is None and not recipe.bf16_dw:
                ht = _cast_ht(h, recipe, h_amax)
            dw = weight_grad(dy2, dyt, ht, h, recipe, ctx.w_dtype)        # (O, I)
        ctx.casts = ctx.handoff = ctx.dy_site = ctx.dgu_site = None
        return dgu, None, None, None, None, None, dw


def _own_amax(site) -> bool:
    """Whether h's calibrating cast may scale by this rank's amax alone: not under context
    parallelism, where it spans the sequence's other chunks (fp8_delayed.Site.whole_sequence:
    an all-reduce between the amax and the cast, which the fused SwiGLU cast has no room for;
    the first step only)."""
    return site is None or not site.ledger.sequence_split()


def _record(site, amax):
    """Calibrating: max the amax a current-scaled cast took into the site's record."""
    record = site.record_into(amax.device)
    if record is not None:
        record_amax(record, amax)


def fp8_swiglu_mlp(x, weights, down_weight, recipe: Recipe, group=None, down_group=None,
                   cache=None, down_cache=None, sites=None, down_sites=None):
    """swiglu(x @ cat(weights)^T) @ down_weight^T in FP8 as "selective" runs it: the gate/up
    linear, then Fp8SwiGLULinear. x (..., C) -> (..., O), a partial sum under TP (the caller
    reduces). `group` / `down_group`: the TP groups sharding gate/up's O and down's C_in;
    `cache` / `down_cache`: their Fp8WeightCaches; `sites` / `down_sites`: their delayed
    scaling sites, or None. Where fp8_fused applies, the SwiGLU backward hands d(gu)'s cast
    (or amax) to the gate/up linear through a GradCastHandoff."""
    handoff = GradCastHandoff() if fusable(group, x) else None
    gu = fp8_linear(x, weights, recipe.name, out_group=group, cache=cache,
                    grad_cast=handoff, sites=sites)                             # (..., 2I)
    down_sites = None if down_sites is None else (*down_sites, sites[1])
    return Fp8SwiGLULinear.apply(gu, recipe, down_group, down_cache, handoff,
                                 for_this_call(down_sites), down_weight)


class Fp8TritonAttention(TritonAttention):
    fp8_recipe, fp8_group = "tensorwise", None       # set per module by fp8_layers.apply_fp8
    fp8_cache, fp8_sites = None, None                # its Fp8WeightCache and delayed sites

    def project(self, x, weights):
        return fp8_linear(x, weights, self.fp8_recipe, out_group=self.fp8_group,
                          cache=self.fp8_cache, sites=self.fp8_sites)


class Fp8TritonMLP(TritonMLP):
    fp8_recipe, fp8_group, fp8_cache, fp8_sites = "tensorwise", None, None, None
    project = Fp8TritonAttention.project

    def forward(self, x):
        weights = [self.gate_proj.weight, self.up_proj.weight]
        if not self.recompute_swiglu:
            gu = self.project(x, weights)                                      # (B, T, 2I)
            return self.down_proj(swiglu_packed(gu))     # an Fp8 linear: (B, T, C)
        y = fp8_swiglu_mlp(x, weights, self.down_proj.weight, recipe_of(self.fp8_recipe),
                           self.fp8_group, getattr(self.down_proj, "tp_group", None),
                           self.fp8_cache, _down_cache(self.down_proj), self.fp8_sites,
                           self.down_proj.fp8_sites)
        reduce = getattr(self.down_proj, "reduce", None)     # row-parallel: g over TP
        return y if reduce is None else reduce(y)


def _down_cache(down_proj):
    """The down projection's weight cache, unless torch.compile is tracing (fp8_linear)."""
    return None if torch.compiler.is_compiling() else getattr(down_proj, "fp8_cache", None)


FP8_CLASSES = {TritonAttention: Fp8TritonAttention, TritonMLP: Fp8TritonMLP}
