"""`training.fp8="tensorwise_delayed"`: tensorwise FP8 whose activation scales come from the
previous optimizer step's amaxes, so that no cast waits for a pass over its own tensor.

Tensorwise ("current") scaling reads every activation twice before its GEMM: once for the amax,
once to cast it with the scale that amax gives. Delayed scaling casts with a scale known
before the tensor exists and takes the tensor's amax during that same cast, for the next step:

    step t, every cast at site s:   q = fp8(x * fp8_max / A_s)     A_s  fixed for the step
                                    seen_s = max(seen_s, amax(x))  taken while casting
    between steps t and t+1:        A_s = max of seen_s over every rank holding part of the
                                    operand or other micro-batches of the step; seen_s = 0

A site is one operand of one projection: its input x (one site for the projections that read
the same x, fp8_layers.READ_THE_INPUT), its output gradient dy, and, in the recomputing
SwiGLU + down projection (triton_layers.py), h. A value above A_s saturates at the
format's max instead of setting the scale (Transformer Engine's delayed scaling accepts the
same); bench/fp8_convergence.py is the check that training does not notice. The roll sees
it afterwards (seen_s over A_s), counts the sites where it went far, and then holds every
scale at its peak for a few steps (saturation.py).
The weights keep their exact per-step scales (weights.py): they are cast once a step.

The first step has no amaxes yet. It calibrates: every cast takes its own amax first, as
"tensorwise" does (so step 1 equals a "tensorwise" run's step 1), and records it too. Under
context parallelism that amax is all-reduced over the cp group (`whole_sequence`) before the
cast: one process takes it over the whole sequence, of which a rank holds a chunk.

Checkpoints: a save takes the amaxes the next roll would set (`rolled_amaxes`: the same
all-reduce, the ledger left as it is) and keeps them by site name in state.json, one set
for every layout, with the saturation guard's hold; a resume in any layout (`load_amaxes`)
casts its first step with them, as the run that went on does after its roll. A checkpoint
without them (or of a model with other sites: model.kernels changes the fused blocks)
resumes calibrating.

Layouts: the roll all-reduces `seen` (MAX) over the tensor-parallel group (an operand whose
features are sharded) and the data x context group (the step's other micro-batches), so every
layout computes the scales one process computes over the same global batch, and gradient
accumulation in one process equals data parallelism. The roll is one all-reduce per group of
a few bytes per site, once a step; under pipeline parallelism also one of two scalars over the
stages (the guard's hold is the whole model's) and an all-gather of four (`end_step`).

When the roll runs: at the end of each optimizer step, where train.py collects the step's
values (`end_step`: its saturation counts go out with them), and otherwise before the
model's first forward after the weights changed, which an optimizer step (and a checkpoint
load) does: the same signal the weight caches use (weights.py), read from one projection
weight in a forward pre-hook on the model.
Casts record only under autograd (validation's forwards do not move training's scales), and
a site that saw only zeros keeps its last amax.

CUDA graphs: the calibrating step runs eager and the capture waits for the first step after
it (cuda_graphs.py), so the graphs hold only the delayed casts; the amaxes live in two flat
buffers the graphs read and write in place.

training.compile: the buffers are made before the model's first forward, outside the compiled
layers, and each site keeps its own views of them (`Site.views`), which a layer's graph takes as
inputs and writes in place. Each layer compiles twice: for the calibrating step and for the
rest (`calibrating` is host state its graph is specialized on).
"""
import torch
import torch.distributed as dist

from picotron.speed.fp8 import saturation
from picotron.speed.fp8.saturation import FACTORS, SaturationGuard

# Each site's `seen` is SLOTS int32 places, SLOT_STRIDE apart (128 bytes: one cache line each),
# and a cast kernel's program maxes into the one its grid index picks, so that no address
# takes the atomics of tens of thousands of programs; the roll takes the max over them. (On
# an H200 at SmolLM-360M's sizes it measured no faster than one address: bench/NOTES.md.)
SLOTS, SLOT_STRIDE = 32, 32
# A site's name: its projection's (or fused block's) module name, then ".x" for its input
# (the SwiGLU's h is the down projection's; q/k/v's and gate/up's is their branch's, e.g.
# "layers.0.self_attn.x") or GRADIENT for its output gradient dy (layers.py).
GRADIENT = ".dy"


class Site:
    """One operand's place in its ledger: `scale_amax` the A_s its casts use this step,
    `seen` the int32 bits of the largest |value| cast there since the last roll (SLOTS places,
    any of which a cast may max into).

    `records`: False for a forward without autograd (`for_this_call`).
    `views`: (A_s () fp32, seen (SLOTS, SLOT_STRIDE) int32), this site's rows of the ledger's
    buffers, taken once they exist. training.compile needs them as tensors of their own: an
    index into the shared buffers would be a constant in each layer's graph (one compilation
    per layer), and a write through it would rewrite the whole buffer, undoing the other
    layers' records."""

    def __init__(self, ledger, index: int, name: str, records: bool = True, views=None):
        self.ledger, self.index, self.name, self.records = ledger, index, name, records
        self.views = views

    @property
    def calibrating(self) -> bool:
        return self.ledger.calibrating

    def whole_sequence(self, amax):
        """Calibrating: this rank's () fp32 `amax` made its micro-batch's, all-reduced (MAX, in
        place) over the ranks holding the sequence's other chunks (context parallelism)."""
        if self.ledger.sequence_split():
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.ledger.sequence_group)
        return amax

    def scale_amax(self, device):
        return self._views(device)[0]                                           # () fp32

    def record_into(self, device):
        """Where a cast maxes its amax in ((SLOTS, SLOT_STRIDE) int32 bits), or None where it
        must not record."""
        return self._views(device)[1] if self.records else None

    def _views(self, device):
        if self.views is None:      # a read-only copy made before the buffers (for_this_call)
            self.ledger.buffers(device)
            self.views = self.ledger.sites[self.index].views
        return self.views


def for_this_call(sites):
    """`sites` as an FP8 op called now should use them: read-only under no_grad (checked
    here, by the caller of the autograd function, inside which grad mode is always off)."""
    if sites is None or torch.is_grad_enabled():
        return sites
    return tuple(Site(s.ledger, s.index, s.name, records=False, views=s.views) for s in sites)


class AmaxLedger:
    """Every delayed site of a model (this rank's layers): their amaxes in two flat buffers,
    and the roll between steps (module docstring). `groups`: what the roll all-reduces over;
    `sequence_group`: the context-parallel group, which the calibrating casts' amaxes span."""

    def __init__(self, groups=(), sequence_group=None):
        self.names, self.sites, self.groups = [], [], [g for g in groups if g is not None]
        self.sequence_group = sequence_group
        self.scale_amax = self.seen = self.guard = None
        self.calibrating = True
        self.watched, self.version = None, None
        self.stage_names = None      # pipeline parallelism: every stage's names, gathered once

    def sequence_split(self) -> bool:
        """Whether other ranks hold chunks of this rank's sequences (context parallelism)."""
        group = self.sequence_group
        return group is not None and dist.get_world_size(group) > 1

    def site(self, name: str) -> Site:
        assert self.scale_amax is None, "sites are added before the first cast"
        self.names.append(name)
        self.sites.append(Site(self, len(self.names) - 1, name))
        return self.sites[-1]

    def buffers(self, device):
        """(scale_amax (S,) fp32, seen (S, SLOTS, SLOT_STRIDE) int32), made before the model's
        first forward (on its device), or the first cast's when there is no model; each site
        takes its views of them then. The saturation guard's state is made with them."""
        if self.scale_amax is None:
            self.guard = SaturationGuard([FACTORS["dy" if n.endswith(GRADIENT) else "x"]
                                          for n in self.names], device)
            self.scale_amax = torch.zeros(len(self.names), dtype=torch.float32, device=device)
            self.seen = torch.zeros((len(self.names), SLOTS, SLOT_STRIDE), dtype=torch.int32,
                                    device=device)
            for site in self.sites:
                site.views = self.scale_amax[site.index], self.seen[site.index]
        return self.scale_amax, self.seen

    def watch(self, model, projection):
        """Roll before the first forward of `model` after `projection`'s weight changed
        (module docstring). The module, not the tensor: the gradient buckets move the weight
        into a flat buffer after this."""
        self.watched = projection
        model.register_forward_pre_hook(lambda module, args: self.before_forward())

    def before_forward(self):
        self.buffers(self.watched.weight.device)        # outside any compiled layer
        version = self.watched.weight._version
        if self.version is not None and version != self.version:
            self.roll()
        self.version = version

    def end_step(self, pp_group=None) -> dict:
        """The roll, at the end of an optimizer step, skipped or not (the next forward then
        finds it done), and what it found: {"fp8_saturated_sites", "fp8_worst_ratio",
        "fp8_worst_site": () device tensors (saturation.py), "fp8_sites": the site names}.
        Under pipeline parallelism (`pp_group`, collective), every stage's sites."""
        if self.seen is None:
            return {}
        self.roll(pp_group)
        self.version = self.watched.weight._version if self.watched is not None else None
        count, worst, where = self.guard.last
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            return self._every_stage(count, worst, where, pp_group)
        return {"fp8_saturated_sites": count, "fp8_worst_ratio": worst,
                "fp8_worst_site": where, "fp8_sites": tuple(self.names)}

    def _every_stage(self, count, worst, where, pp_group) -> dict:
        """This roll's saturation over every stage of the pipeline, the same on each: the
        counts summed, and the site furthest past its factor of all, an index into every
        stage's names in stage order. One all-gather of four scalars a step, on the device;
        the names are gathered once (host objects)."""
        if self.stage_names is None:
            names = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(names, tuple(self.names), group=pp_group)
            offsets = [sum(len(n) for n in names[:k]) for k in range(len(names))]
            self.stage_names = (sum(names, ()), torch.tensor(
                offsets, dtype=torch.float32, device=self.scale_amax.device))
        past = worst / self.guard.factor.take(where)     # how far past its site's factor
        mine = torch.stack([count.float(), worst, where.float(), past])          # (4,)
        stages = [torch.empty_like(mine) for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather(stages, mine, group=pp_group)
        count, worst, where, past = torch.stack(stages).unbind(1)    # (stages,) each
        names, offsets = self.stage_names
        stage = past.argmax()                    # a NaN first; take: no read on the host
        return {"fp8_saturated_sites": count.sum(), "fp8_worst_ratio": worst.take(stage),
                "fp8_worst_site": where.take(stage) + offsets.take(stage), "fp8_sites": names}

    def roll(self, pp_group=None):
        """A_s = the global max of what site s saw this step (while the guard holds the
        scales, the largest since: saturation.py, which holds every stage's with `pp_group`);
        seen = 0; calibration over."""
        if self.seen is None:
            return                                          # nothing was cast yet
        self.scale_amax.copy_(self.guard.roll(self._global_seen(), self.scale_amax,
                                              self.calibrating, pp_group))
        self.seen.zero_()
        self.calibrating = False

    def _next_scale_amax(self):
        """(S,) fp32: what the roll sets A_s to, leaving the ledger as it is (collective)."""
        return self.guard.next_amax(self._global_seen(), self.scale_amax, self.calibrating)[0]

    def _global_seen(self):
        """(S,) fp32: the global max of what each site saw this step, all-reduced over the
        ledger's groups (collective); 0 where it saw only zeros."""
        seen = self.seen_amaxes().view(torch.float32)
        for group in self.groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
        return seen

    def seen_amaxes(self):
        """(S,) int32: each site's largest |value| since the last roll, as fp32 bits (the max
        over its slots; the bits order as the floats do, a NaN above all)."""
        return self.seen.view(len(self.names), -1).amax(dim=1)

    def state(self) -> dict:
        """{site name: A_s} as floats (what a report or a test reads)."""
        if self.scale_amax is None:
            return {}
        return dict(zip(self.names, self.scale_amax.tolist()))

    def rolled_amaxes(self) -> dict:
        """{site name: A_s} as the next roll will set them, leaving this ledger as it is: what
        a checkpoint keeps (module docstring). Collective over the ledger's groups, as the
        roll is; {} before any cast."""
        if self.seen is None:
            return {}
        return dict(zip(self.names, self._next_scale_amax().tolist()))

    def rolls_since_saturation(self):
        """The guard's rolls since a site last saturated, capped at HOLD_STEPS (from there on
        no scale is held, whatever the count), for a checkpoint; None before any cast."""
        if self.guard is None:
            return None
        return int(min(self.guard.quiet.item(), saturation.HOLD_STEPS))   # as set now

    def load_amaxes(self, amaxes: dict, device, dy_ratio: float = 1.0, rolls=None) -> bool:
        """Take a checkpoint's `rolled_amaxes` (saved by any layout: the names are the
        layers', the values maxima over the step) if it holds every site of this ledger, in
        place (CUDA graphs read these buffers); the next step casts with them, as the saved
        run's would have. Else this run calibrates afresh. `dy_ratio`: this layout's output
        gradients over the saving one's (dp x cp over theirs: each rank's loss is the mean
        over its own tokens, the weight gradients then averaged), applied to the gradient
        sites; a power of two moves no FP8 value. `rolls`: the saved guard's
        `rolls_since_saturation` (None: no hold), so a resume within a hold holds on."""
        if not self.names or any(name not in amaxes for name in self.names):
            return False
        scale_amax, seen = self.buffers(device)
        scale_amax.copy_(torch.tensor(
            [amaxes[n] * (dy_ratio if n.endswith(GRADIENT) else 1.0) for n in self.names],
            dtype=torch.float32))
        seen.zero_()
        self.guard.quiet.fill_(float("inf") if rolls is None else rolls)
        self.calibrating = False
        return True
