"""A projection's weight in FP8, cast once per optimizer step instead of at every use.

Within one optimizer step a weight does not change, yet without a cache it is cast (amax,
scale, rounding, and the TP amax all-reduce) at every forward and again at every backward:
2 x grad_acc_steps times, plus once more per recomputed forward. Fp8WeightCache keeps, per
module, what the three GEMMs need of W (O, C_in):
    W_q, W_s     forward  y = x W^T     rows along C_in (one scale, or one per output row)
    W^T_q, W^T_s backward dx = dy W     rows of W^T (C_in, O) along O (tensorwise: W_s again,
                                        both layouts written by one pass over W)
and serves them to every micro-batch's forward and backward (and to recomputation) until
the weight changes.

When it changes: the cache is keyed on each weight's `_version`, the counter every in-place
write to a tensor bumps: copy_ into a parameter (a checkpoint load), torch's in-place ops, and
the optimizer's step, which bumps every parameter's counter once it has written them
(DistributedAdamW.weights_changed: its update and ZeRO's all-gathers write the flat buffers
the parameters are views of, whose counters are not the parameters' own). So the first
forward after an optimizer step misses, recasts (and all-reduces the amax over TP, once per
step), and the rest of the step hits. Every TP rank makes the same writes, so all miss
together and the all-reduce never waits for a rank that hit; for that reason the key holds
no storage address, which could differ between ranks. Not used: inside training.compile's
compiled layers (the compiler fuses the casts into the layer it traces), and under ZeRO-3,
whose point is not to hold every layer's weights whole (fp8_layers._cache).

Under training.cuda_graphs the replayed graph skips this Python, so the layers' graphs read
the copies where the capture found them: `in_place` caches recast into those same tensors,
and cuda_graphs.py checks `stale` on the host before each replay (the same version check,
outside the graph) and then replays every cache's `recast`, captured as a graph of its own.

Memory: W_q and W^T_q, 1 byte each per element, kept between steps: 2 bytes per projection
parameter, as much as the bf16 weights themselves (3.2 GB at SmolLM-1.7B's 1.6 B projection
parameters), plus the scales (4 bytes per row, rowwise). Without the cache the same copies
exist only while a layer runs; the cache trades that memory for 2 x grad_acc_steps casts.
"""
from typing import NamedTuple

from picotron.speed.fp8.quantize import E4M3, quantize
from picotron.speed.kernels.fused_linear import stacked


def one_matrix(weights):
    """The weights as one (O, C_in) matrix: a single one as it is (no buffer-sharing test for
    the compiler to trace), several stacked as fused_linear does."""
    return weights[0] if len(weights) == 1 else stacked(weights)


def cast_weight(w, rowwise: bool, in_group, out_group, transposed: bool, into=None):
    """(W_q, W_s, (W^T_q, W^T_s) or None) for W (O, C_in). Rowwise: W's rows along C_in
    (sharded by in_group), W^T's along O (out_group). Tensorwise: one scale over every
    shard, both layouts in one pass. `into`: a WeightCasts whose tensors are written instead
    of new ones (its W^T too when `transposed`)."""
    if rowwise:
        w_q, _, w_s = quantize(w, E4M3, "row", in_group, out=into and (into.w_q, None, into.w_s))
        return w_q, w_s, (cast_weight_t(w, rowwise, in_group, out_group, into) if transposed
                          else None)
    w_q, wt_q, w_s = quantize(w, E4M3, "tensor", in_group or out_group, transposed=transposed,
                              out=into and (into.w_q, into.t[0] if transposed else None,
                                            into.w_s))
    return w_q, w_s, (wt_q, w_s) if transposed else None


def cast_weight_t(w, rowwise: bool, in_group, out_group, into=None):
    """(W^T_q (C_in, O), its scale) for dx = dy W: per row of W^T along O (rowwise), or the
    tensor's one scale, which is W_s again (the same W gives the same amax). `into`: as in
    cast_weight."""
    out = into and (None, *into.t)
    if rowwise:
        _, wt_q, wt_s = quantize(w, E4M3, "column", out_group, rows=False, transposed=True,
                                 out=out)
    else:
        _, wt_q, wt_s = quantize(w, E4M3, "tensor", in_group or out_group, rows=False,
                                 transposed=True, out=out)
    return wt_q, wt_s


class WeightCasts:
    """One weight's FP8 copies: forward's (q, scale), and backward's (q^T, scale) once cast."""

    def __init__(self, w, rowwise, in_group, out_group, transposed: bool):
        self.w_q, self.w_s, self.t = cast_weight(w, rowwise, in_group, out_group, transposed)
        self.args = rowwise, in_group, out_group

    def transposed(self, w):
        """(W^T_q, W^T_s), cast now if forward did not (a forward without gradients)."""
        if self.t is None:
            wt_q, wt_s = cast_weight_t(w, *self.args)
            self.t = wt_q, (wt_s if self.args[0] else self.w_s)    # tensorwise: W_s is W^T_s
        return self.t

    def cast_again(self, w):
        """Cast w into these same tensors (the ones a captured graph reads): no new copies,
        no copy of them."""
        cast_weight(w, *self.args, transposed=self.t is not None, into=self)


class Fp8WeightCache:
    """The FP8 copies of one module's (possibly fused: q/k/v, gate/up) weight, recast when a
    weight's version changes (module docstring). `casts` counts the recasts; `in_place`: recast
    into the same tensors (CUDA graphs), set by cuda_graphs.capture_layers."""

    def __init__(self):
        self.key, self.entry, self.casts, self.in_place = None, None, 0, False
        self.source = None                  # (weights, rowwise, in_group, out_group): recast

    def get(self, weights, w, rowwise: bool, in_group, out_group, transposed: bool):
        """WeightCasts of w, the (O, C_in) matrix of `weights` (the parameters themselves,
        whose versions key the cache); `transposed`: backward will need W^T."""
        self.source = weights, rowwise, in_group, out_group
        if self.stale() or (transposed and self.entry.t is None):
            if self.in_place and self.entry is not None:
                if transposed and self.entry.t is None:     # W^T asked for the first time
                    self.entry.transposed(w)
                if self.stale():
                    self.recast()
            else:
                self.key, self.entry = None, None           # the old copies go first
                self.entry = WeightCasts(w, rowwise, in_group, out_group, transposed)
            self.mark_fresh()
        return self.entry

    def _current_key(self):
        weights, rowwise = self.source[:2]
        return (rowwise, *(p._version for p in weights))

    def stale(self) -> bool:
        """Whether a weight changed since the copies were cast (or none were yet)."""
        return self.key != self._current_key()

    def mark_fresh(self):
        """The copies now hold the weights' current values."""
        self.key = self._current_key()
        self.casts += 1

    def recast(self):
        """Cast the weights again into the tensors the entry holds (in place: the ones a
        captured graph reads), whether they changed or not."""
        self.entry.cast_again(one_matrix(self.source[0]))


class OneUseCasts(NamedTuple):
    """W's forward cast for one use, without a cache; W^T is cast when backward asks. Nothing
    in it changes after it is made, so that torch.compile traces it inside the autograd
    function (a WeightCasts, which keeps W^T once cast, would break the graph there)."""
    w_q: object
    w_s: object
    args: tuple                                     # (rowwise, in_group, out_group)

    def transposed(self, w):
        return cast_weight_t(w, *self.args)


def weight_casts(cache, weights, w, rowwise: bool, in_group, out_group, transposed: bool):
    """From `cache`, or cast for this use only when there is none (W^T then waits for
    backward, so that forward does not hold it)."""
    if cache is None:
        w_q, w_s, _ = cast_weight(w, rowwise, in_group, out_group, transposed=False)
        return OneUseCasts(w_q, w_s, (rowwise, in_group, out_group))
    return cache.get(weights, w, rowwise, in_group, out_group, transposed)
