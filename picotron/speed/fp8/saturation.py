"""Saturation under delayed scaling: the check of every site's scale at each roll, its count,
and the guard that holds the scales up for a few steps after one saturated.

A delayed cast (delayed.py) scales by A_s, the amax its site saw the step before, and takes
the tensor's own amax as it writes. A value above A_s saturates at the format's max, which the
cast cannot see in time; the roll between steps can. There each site's ratio

    r_s = seen_s / A_s      this step's amax over the amax its casts were scaled by

says how far the step's tensor outgrew its scale: r <= 1, nothing was cut; r = 1000, its
largest values were cut to a thousandth. It is a few ops on (S,) tensors on the device,
inside the roll: no host sync, and nothing read again from the activations.

- Counted: a site whose r_s passes its operand's factor (FACTORS) *saturated* this step. The
  count, the ratio of the site furthest past its factor and that site leave as device
  scalars with the step's other values (layers.py's `fp8_step_values`), read one step
  behind: metrics.jsonl, the step line, the run's summary.
- Guarded: after a step in which any site saturated, every site casts with the largest amax
  it has seen since (a peak hold) until HOLD_STEPS rolls pass with no site saturating; then
  each follows its last step alone again. A layer whose input spikes again is then not cut
  again, nor are the sites around it: a spike moves the others' amaxes too, down as well as
  up (a norm after it divides the gradients flowing back by what it multiplies), and a site
  whose amax dipped for one step would saturate at the next. A spike that does not come
  back leaves the scales too large for a while, which FP8's range absorbs (e4m3 spans about
  15 binades of normal values, e5m2 30).

Measured (bench/NOTES.md, "Saturation under delayed scaling"): healthy training kept the
inputs' ratios under 1.7 and the output gradients' under 50 (attention's q and k gradients
jump as it learns where to look), so the factors sit well above both and a healthy run trains
bit for bit as without the guard. A projection's input times 1000 at three steps two apart moved
the loss up to 2.2% away from the bf16 run with the same fault without the guard, 0.42% with
it (12 saturated site-steps against 4); once, 0.07% either way.

Just-in-time scaling for a guarded site (its own amax, as "tensorwise" takes it) would need an
amax pass that the host must decide to launch, which it learns of only by waiting for the
roll, and the SwiGLU kernels that write h only in FP8 (delayed_swiglu.py) have no h to take it
from. The guard changes only the amaxes the next casts read, which every path (our kernels,
the compiled layers, CUDA graphs) reads from the same buffer.
"""
import torch
import torch.distributed as dist

# r_s above which a site counts as saturated (and the guard holds every scale), by operand:
# a projection's input x (e4m3), or its output gradient dy (e5m2)
FACTORS = {"x": 4.0, "dy": 256.0}
HOLD_STEPS = 8          # rolls with no site saturating that end the hold (0: no guard)


class SaturationGuard:
    """The saturation state of a ledger's S sites, on the device: `factor` (S,) fp32, each
    site's threshold; `quiet` () fp32, the rolls since a site last saturated (HOLD_STEPS and
    over: no scale held). `last`: (saturated sites, the ratio of the site furthest past its
    factor (or nearest to it), that site's index), () device tensors of the last roll, zeros
    before any; `ratio`: that roll's r_s (S,)."""

    def __init__(self, factors, device):
        self.factor = torch.tensor(factors, dtype=torch.float32, device=device)
        zero = torch.zeros((), device=device)
        self.quiet = torch.full_like(zero, float("inf"))        # none saturated yet
        self.last, self.ratio = (zero, zero, zero), torch.zeros_like(self.factor)

    def next_amax(self, seen, scale_amax, calibrating: bool, stages=None):
        """(A_s for the next step (S,), `quiet` after this step, r_s (S,), saturated (S,)
        bool) from what the step saw (S,) and the amaxes it cast with, leaving the guard as it
        is. A site that saw nothing (only zeros, or no cast) keeps its amax, and a roll in
        which no site saw anything changes nothing; a NaN amax stays a NaN (a run that went
        NaN shows it) and counts as saturated. The calibrating step cast every tensor by its
        own amax: nothing saturated there. `stages`: the pipeline group, whose other stages
        hold the model's other sites: the hold is the whole model's, as on one process."""
        saw = seen != 0
        ratio = torch.zeros_like(seen) if calibrating else torch.where(saw, seen / scale_amax, 0)
        saturated = ~(ratio <= self.factor)
        anywhere = torch.stack([saturated.any(), saw.any()]).float()    # (any saturated, any saw)
        if stages is not None and dist.get_world_size(stages) > 1:
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=stages)
        quiet = torch.where(anywhere[0] > 0, 0, self.quiet + anywhere[1])
        held = torch.where(quiet < HOLD_STEPS, torch.maximum(seen, scale_amax), seen)
        return torch.where(saw, held, scale_amax), quiet, ratio, saturated

    def roll(self, seen, scale_amax, calibrating: bool, stages=None):
        """`next_amax`, kept: the guard moves on a step and `last` describes this one."""
        amax, quiet, ratio, saturated = self.next_amax(seen, scale_amax, calibrating, stages)
        self.quiet.copy_(quiet)
        where = (ratio / self.factor).argmax()    # the furthest past its factor; a NaN first
        # take, not ratio[where]: indexing by a tensor could read it on the host
        self.last, self.ratio = (saturated.sum(), ratio.take(where), where), ratio
        return amax
