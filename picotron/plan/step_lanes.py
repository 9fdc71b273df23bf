"""One layout's step as lanes, one per pipeline rank: the bars `python -m picotron.plan explain`
draws, read from step_time.predict's own timeline (the pipeline simulated from the schedules'
action lists by pipeline_sim.py, then each rank's work after its last backward), and each
rank's memory from the memory plan as the profile scales it (or the profile's trainer's own
count). Nothing here times anything again: a bar is an event of that timeline, or the gap
between two of them.

    step_lanes(config, profile, gpus_per_node) -> Lanes(prediction, bars, memory, v)

Each bar is Bar(rank, kind, start_s, end_s, micro, chunk) with kind one of KINDS:
    forward, backward  one micro-batch through one of the rank's chunks (its virtual stages)
    exposed            the part of that pass spent waiting on collectives the model does not
                       hide (tensor parallelism's, ring attention's, ZeRO-3's gathers), drawn
                       over the end of the pass it belongs to
    send               an activation (or its gradient) on its way to the neighbouring rank
    idle               a rank waiting: for its input, for the pipeline to drain, or for the
                       slowest rank to finish the step
    dp                 the gradient reduction left exposed after the last backward, and
                       ZeRO-1/2's parameter all-gather where nothing hides it
    optimizer          AdamW's passes over the rank's parameters
"""
from collections import namedtuple

from picotron.plan.comm_time import Links, layout_groups
from picotron.plan.memory_plan import rank_estimate
from picotron.plan.nanotron_memory import rank_need, rank_parts
from picotron.plan.stage_split import stage_split
from picotron.plan.step_time import layer_pass, predict
from picotron.plan.trainer_memory import counts_nanotron, held_and_device_of, scaled_need

KINDS = ("forward", "backward", "exposed", "send", "idle", "dp", "optimizer")
Bar = namedtuple("Bar", "rank kind start_s end_s micro chunk")
# a pipeline rank's memory plan: bytes held the whole step (weights, gradients, AdamW state)
# and at the step's peak on top of them (activations, or the step's temporaries)
RankMemory = namedtuple("RankMemory", "held_bytes peak_bytes device_bytes")
Lanes = namedtuple("Lanes", "prediction bars memory v")

# the simulated timeline's kinds as KINDS name them
SIMULATED = {"F": "forward", "B": "backward", "send": "send", "idle": "idle"}
# the collectives of one layer's pass that step_time.layer_pass reports beside its compute
LAYER_COLLECTIVES = ("tp", "cp", "dp")
EPS = 1e-12


def virtual_stages(config) -> int:
    d = config.distributed
    return d.pp_virtual_stages if d.pp_engine == "interleaved" and d.pp_size > 1 else 1


def exposed_per_pass(config, profile, gpus_per_node: int) -> dict:
    """(kind, virtual stage) -> seconds of that stage's forward or backward spent in exposed
    collectives: its layers times what step_time.layer_pass leaves exposed in one layer's pass
    (none where the host's launches, not the GPU, bound the pass)."""
    groups = layout_groups(config, profile, gpus_per_node)
    layer_f, layer_b, part_f, part_b = layer_pass(config, profile, Links(profile), groups)
    per_layer = {}
    for kind, total, parts in (("forward", layer_f, part_f), ("backward", layer_b, part_b)):
        waiting = sum(parts.get(k, 0.0) for k in LAYER_COLLECTIVES)
        per_layer[kind] = max(0.0, min(waiting, total - parts["compute"]))
    return {(kind, s): layers * per_layer[kind]
            for kind in per_layer for s, (layers, _, _) in enumerate(stage_split(config, profile))}


def rank_memory(config, profile=None) -> list:
    """RankMemory of every pipeline rank, from the memory plan's estimate of that rank, or
    for a profile whose trainer's memory is counted apart (trainer_memory.counts_nanotron)
    from that count: its held bytes, and what the rank's peak adds, the profile's factors
    applied, and its trainer's logits on the head's rank (the figure step_time's prediction
    judges the layout by: the busiest rank's)."""
    memory = []
    if profile is not None and counts_nanotron(config, profile):
        for r in range(config.distributed.pp_size):
            parts = rank_parts(config, profile, r)
            held, need = profile["mem_held_factor"] * parts.held, rank_need(parts, profile)
            memory.append(RankMemory(held, need - held, need))
        return memory
    pp = config.distributed.pp_size
    for r in range(pp):
        held, device = held_and_device_of(rank_estimate(config, r))
        if profile is not None:
            device = scaled_need(config, profile, held, device, head=r == pp - 1)
            held = profile["mem_held_factor"] * held
        memory.append(RankMemory(held, device - held, device))
    return memory


def step_bars(prediction, pp: int, exposed: dict) -> list:
    """The bars of `prediction.timeline` (step_time's events (pp_rank, kind, micro, chunk,
    start_s, end_s)): its pipeline events as they are, each pass's exposed collectives, each
    rank's step-end events (step_time lists a rank's gradient reduction, then its optimizer),
    and the idle gaps between the pipeline's end on a rank and the step's end."""
    bars, after = [], {r: [] for r in range(pp)}
    pipeline_end = [0.0] * pp
    for rank, kind, micro, chunk, start, end in prediction.timeline:
        if kind == "comm":
            after[rank].append((start, end))
            continue
        bars.append(Bar(rank, SIMULATED[kind], start, end, micro, chunk))
        pipeline_end[rank] = max(pipeline_end[rank], end)
        if kind in ("F", "B"):
            stage_exposed = exposed.get((SIMULATED[kind], chunk * pp + rank), 0.0)
            if stage_exposed > 0:
                bars.append(Bar(rank, "exposed", end - stage_exposed, end, micro, chunk))
    step_end = prediction.step_s
    for rank in range(pp):
        events = sorted(after[rank])
        start = min((s for s, _ in events), default=step_end)
        if start > pipeline_end[rank] + EPS:       # drained before the slowest rank
            bars.append(Bar(rank, "idle", pipeline_end[rank], start, -1, -1))
        for kind, (s, e) in zip(("dp", "optimizer"), events):
            if e > s + EPS:
                bars.append(Bar(rank, kind, s, e, -1, -1))
        finish = max((e for _, e in events), default=pipeline_end[rank])
        if step_end > finish + EPS:                # waiting for the slowest rank's step end
            bars.append(Bar(rank, "idle", finish, step_end, -1, -1))
    return bars


def step_lanes(config, profile, gpus_per_node: int = 8) -> Lanes:
    """The lanes of `config` (a Config the checks accepted, "auto" resolved) on `profile`'s
    machines with `gpus_per_node` GPUs a node (module docstring)."""
    prediction = predict(config, profile, gpus_per_node)
    exposed = exposed_per_pass(config, profile, gpus_per_node)
    bars = step_bars(prediction, config.distributed.pp_size, exposed)
    return Lanes(prediction, bars, rank_memory(config, profile), virtual_stages(config))


def busy_s(bars, rank: int) -> float:
    """Seconds rank `rank` computes forward and backward passes in `bars`."""
    return sum(b.end_s - b.start_s for b in bars
               if b.rank == rank and b.kind in ("forward", "backward"))
