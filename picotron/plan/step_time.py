"""The time of one optimizer step of a layout, predicted from the config and a hardware
profile (picotron/plan/hardware/): its throughput, its MFU, its memory (the memory plan's
estimate) and the step's time split into compute, exposed communication per axis and
pipeline idle.

    predict(config, profile, gpus_per_node) -> Prediction

How a step is put together, following this project's implementation:
1. One micro-batch through one layer on one rank (compute_time.py), plus what of its
   collectives is not hidden (comm_time.py): tensor parallelism's all-reduces (or, under
   sequence parallelism, all-gathers and reduce-scatters) block, but for the profile's
   `tp_exposed` share (a trainer that overlaps some) or, with tp_comm_overlap, for the GEMM
   time that hides their ring; ring attention's K/V pass beside each block's attention;
   ZeRO-3's layer gathers are prefetched behind the previous layer's compute.
2. Each virtual stage's forward and backward: its layers, plus the embedding on the first and
   the head and loss on the last (or the profile's trainer's split, stage_split.py), plus the
   host's fixed time a micro-batch (`micro_s`) and the stall the job's nodes bring
   (micro_batch_s), and on a stage that receives, a trainer's wait there (ddp_stall.py);
   the host's launches, and on a rank of a pipeline whose sends cross
   nodes its waits on each tensor-parallel collective (*_latency_pp_s), bound an eager
   layer's pass from below (not under CUDA graphs).
3. The pipeline, simulated from the engine's orders (pipeline_sim.py) with each send's time.
4. After each rank's last backward (step_tail.py): the gradients' reduction over cp x dp
   (ZeRO-1/2's a reduce-scatter) in buckets during that backward (what outlasts it is
   exposed, and the embedding's own bucket, completed last, always is), or a trainer's one
   all-reduce after it where it shards after reducing (zero1_reduce); a tied embedding's
   sum across the pipeline's ends; ZeRO-1/2's parameter all-gather, waited for block by
   block in the next forward where the trainer overlaps it; the optimizer's passes, and the
   host's AdamW for the share offloaded to it.
5. A layout predicted not to fit (the memory plan's, or its trainer's count) runs, where it
   runs at all, at the profile's over_memory_speed of that step: at the GPU's capacity the
   caching allocator frees its cache and retries (the part `memory_pressure`).
"""
import dataclasses
from collections.abc import Sequence

from picotron.plan.comm_time import BF16, Links, cp_layer_s, layout_groups, tp_layer_s
from picotron.plan.compute_time import ends_time, layer_time
from picotron.plan.ddp_stall import ddp_recv_stall_s, stalls_by_micro_batches
from picotron.plan.memory_activations import virtual_stages
from picotron.plan.memory_state import layer_params
from picotron.plan.predict_cache import (cached, cached_memory, compute_key, layout_key,
                                         memory_key)
from picotron.plan.pipeline_sim import Joined, TailEvents, simulate, simulate_async_batch
from picotron.plan.stage_split import stage_split
from picotron.plan.step_tail import rank_tails
from picotron.plan.trainer_memory import counts_nanotron, fit_of, memory_fit
from picotron.utils import flops_per_token

PARTS = ("compute", "tp", "cp", "pp", "dp", "pipeline_idle", "optimizer", "memory_pressure")


@dataclasses.dataclass
class Prediction:
    step_s: float            # one optimizer step, seconds
    tok_s_gpu: float         # tokens per second per GPU
    mfu: float               # model FLOPs (6N + 12*L*C*T a token) over the GPUs' bf16 peak
    mem_gib: float           # the memory plan's per-device estimate
    fits: bool               # the estimate fits the profile's GPU (less GPU_RESERVED)
    note: str                # why it does not fit; '' when it fits
    parts: dict              # seconds of the step on its busiest rank, by PARTS
    timeline: Sequence       # (pp_rank, kind, micro, chunk, start_s, end_s), kind in
                             # F, B, send, comm, idle; built when first read


def cached_fit(config, profile, cache):
    """memory_fit(config, profile), kept in `cache`, from cached_memory's sums, or nanotron's
    own count under its trait (memory_key's knobs are all it reads)."""
    if counts_nanotron(config, profile):
        return cached(cache, ("nanotron fit",) + memory_key(config), memory_fit, config,
                      profile)

    def fit():
        sums = cached_memory(config, cache)
        return memory_fit(config, profile) if sums is None else fit_of(config, profile, sums)
    return cached(cache, ("fit",) + memory_key(config), fit)


def layer_pass(config, profile, links, groups, cache=None):
    """(forward, backward) seconds of one layer, one micro-batch, one rank, and the
    exposed tp, cp and ZeRO-3 communication inside each (dicts)."""
    d = config.distributed
    lt = cached(cache, compute_key(config), layer_time, config, profile)
    tokens = config.training.micro_batch_size * config.training.seq_length // d.cp_size
    # full recomputation runs the layer's forward again in backward (layer_time counts its
    # compute there): its collectives and its launches too
    rerun = config.training.activation_checkpointing == "full"
    gemm_b, attn_b = (lt.gemm_b - lt.gemm_f, lt.attn_b - lt.attn_f) if rerun else (lt.gemm_b,
                                                                                 lt.attn_b)
    tp = tp_layer_s(config, links, groups["tp"], tokens)
    if d.tp_comm_overlap:
        tp_f, tp_b = max(0.0, tp - lt.gemm_f), max(0.0, tp - gemm_b)
    else:
        tp_f = tp_b = tp * profile["tp_exposed"]
    cp_f, cp_b = cp_layer_s(config, links, groups["cp"], tokens)
    if d.cp_mode == "ring":               # each of the cp-1 steps beside a block's attention
        share = (d.cp_size - 1) / d.cp_size
        cp_f, cp_b = max(0.0, cp_f - lt.attn_f * share), max(0.0, cp_b - attn_b * share)
    if rerun:
        tp_b, cp_b = tp_b + tp_f, cp_b + cp_f
    compute_f = lt.gemm_f + lt.attn_f + lt.other_f
    compute_b = lt.gemm_b + lt.attn_b + lt.other_b
    z3_f = z3_b = 0.0
    if d.zero_stage == 3:                 # gathered ahead, behind the previous layer's work
        shard = layer_params(config.model, d.tp_size) * BF16
        gather = links.data_parallel.all_gather(shard, groups["cp_dp"])
        scatter = links.data_parallel.all_gather(shard * 2, groups["cp_dp"])   # fp32 grads
        z3_f = max(0.0, gather - compute_f)
        again = 0.0 if d.zero3_keep_params else gather
        z3_b = max(0.0, again + scatter - compute_b)
    exposed_f = {"compute": compute_f, "tp": tp_f, "cp": cp_f, "dp": z3_f}
    exposed_b = {"compute": compute_b, "tp": tp_b, "cp": cp_b, "dp": z3_b}
    # the host launches an eager layer's kernels one by one: its time bounds the pass from
    # below; CUDA graphs replay the captured layers with one launch
    launch = 0.0 if config.training.cuda_graphs is True else profile["launch_s"] * (
        profile["fp8_launch_factor"] if config.training.fp8 != "none" else 1.0)
    # on a pipeline's rank whose sends cross nodes the host also waits out each
    # tensor-parallel collective's ring steps at the profile's *_latency_pp_s (the GPU's work
    # runs meanwhile); a pipeline inside one node does not hold the host back
    wait = 0.0
    if d.pp_size > 1 and groups["pp"][2] > 1:
        wait = tp_layer_s(config, links.pipelined, groups["tp"], tokens) - tp
    passes_b = 2 if rerun else 1          # the backward's own, and the forward run again
    return (max(sum(exposed_f.values()), launch + wait),
            max(sum(exposed_b.values()), (1 + passes_b) * launch + passes_b * wait),
            exposed_f, exposed_b)


def micro_batch_s(config, profile, gpus_per_node: int) -> float:
    """The fixed seconds a micro-batch adds to each stage's forward and to its backward: the
    host's (`micro_s`) and the stall the job's nodes n bring, stall_s x the share of
    micro-batches that stall, (n/half)^s / (1 + (n/half)^s)."""
    nodes = max(1.0, config.world_size / gpus_per_node)
    x = (nodes / profile["stall_half_nodes"]) ** profile["stall_steepness"]
    return profile["micro_s"] + profile["stall_s"] * x / (1 + x)


def stage_times(config, profile, layer_f, layer_b, cache=None, micro_s=None, recv_s=0.0):
    """forward_s[s], backward_s[s] of every virtual stage for one micro-batch; `micro_s`:
    micro_batch_s (the profile's micro_s alone when None); `recv_s`: ddp_recv_stall_s, the
    wait of each pass that receives from another stage."""
    d = config.distributed
    micro_s = profile["micro_s"] if micro_s is None else micro_s
    v = virtual_stages(config)
    split = cached(cache, ("stage split", d.pp_size, v), stage_split, config, profile)
    ends = cached(cache, ("ends",) + compute_key(config), ends_time, config, profile)
    (micro_f, micro_b), (embed_f, embed_b), (head_f, head_b) = (
        ends["micro"], ends["embed"], ends["head"])
    forward, backward = [], []
    for i, (layers, embed, head) in enumerate(split):
        f = layers * layer_f + micro_f + micro_s + (recv_s if i > 0 else 0.0)
        b = layers * layer_b + micro_b + micro_s + (recv_s if i < len(split) - 1 else 0.0)
        if embed:
            f, b = f + embed_f, b + embed_b
        if head:
            f, b = f + head_f, b + head_b
        forward.append(f)
        backward.append(b)
    return forward, backward, v


def predict(config, profile, gpus_per_node: int, cache=None) -> Prediction:
    """The predicted step of `config` (a Config the config's checks accepted) on `profile`'s
    machines with `gpus_per_node` GPUs a node (module docstring). `cache`: a dict that a
    search keeps for one profile and gpus_per_node, over configs that differ only in
    layout_key's values: the pieces that read fewer of them are computed once."""
    before = _before_pipeline(config, profile, gpus_per_node, cache)
    sim = cached(cache, before[0], simulate, *before[0][1:])
    return _after_pipeline(config, profile, before, sim, cache)


def predict_many(configs, profile, gpus_per_node: int, cache: dict, fits=None) -> list:
    """[predict(c, profile, gpus_per_node, cache) for c in configs], the pipeline
    simulations of one schedule run together (pipeline_sim.simulate_async_batch). `fits`:
    each config's cached_fit, where the caller has them."""
    befores = [_before_pipeline(c, profile, gpus_per_node, cache) for c in configs]
    batches = {}
    for before in befores:
        key = before[0]
        if key not in cache and key[-1] == "async" and key not in batches.get(key[1:5], {}):
            batches.setdefault(key[1:5], {})[key] = None
    for (engine, pp, micro, v), keys in batches.items():
        keys = list(keys)
        for i in range(0, len(keys), 256):          # (actions, 256) arrays at most
            chunk = keys[i:i + 256]
            sims = simulate_async_batch(engine, pp, micro, v, [k[5] for k in chunk],
                                        [k[6] for k in chunk], [k[7] for k in chunk])
            cache.update(zip(chunk, sims))
    return [_after_pipeline(c, profile, before, cached(cache, before[0], simulate,
                                                       *before[0][1:]), cache, fit)
            for c, before, fit in zip(configs, befores, fits or [None] * len(configs))]


def _stage_tuples(config, profile, layer_f, layer_b, cache, micro_s, recv_s):
    """stage_times with its two lists as tuples (the simulation's key holds them)."""
    forward, backward, v = stage_times(config, profile, layer_f, layer_b, cache, micro_s,
                                       recv_s)
    return tuple(forward), tuple(backward), v


def _before_pipeline(config, profile, gpus_per_node, cache):
    """(the simulation's key: ("sim", and simulate's arguments), the layer's exposed parts
    forward and backward, send, each rank's tail and the longest's (rank_tails), v)."""
    d, t = config.distributed, config.training
    key, reads, v = layout_key(config), compute_key(config), virtual_stages(config)
    part_f, part_b, forward, backward, send, tails = cached(
        cache, ("pipeline inputs", v, stalls_by_micro_batches(config, profile)) + key[:6]
        + reads, _pipeline_inputs, config, profile,
        gpus_per_node, cache, key, reads, v)
    engine = d.pp_engine if d.pp_size > 1 else "1f1b"
    mode = profile.traits.get("pp_mode", "async")
    return (("sim", engine, d.pp_size, t.gradient_accumulation_steps, v, forward, backward,
             send, mode), part_f, part_b, send, tails, v)


def _pipeline_inputs(config, profile, gpus_per_node, cache, key, reads, v):
    """What the pipeline's simulation and its ranks' tails read of a layout, all but its
    engine and grad_acc, of which only whether it reaches the profile's ddp_recv_stall (the
    keys: layout_key, compute_key, v, stalls_by_micro_batches): (the layer's exposed parts
    forward and backward, stage times forward and backward, send, rank_tails)."""
    d, t = config.distributed, config.training
    links = cached(cache, ("links",), Links, profile)
    groups = cached(cache, ("groups",) + key[:4], layout_groups, config, profile, gpus_per_node)
    layer_f, layer_b, part_f, part_b = cached(
        cache, ("layer",) + key[:6] + reads, layer_pass, config, profile, links, groups, cache)
    # the job's nodes: the grid's GPUs over gpus_per_node, the search's gpus_per_node alike
    micro_s = cached(cache, ("micro_s",) + key[:4], micro_batch_s, config, profile,
                     gpus_per_node)
    recv_s = ddp_recv_stall_s(config, profile, groups["pp"][2] > 1)
    # stage_times reads the layer's times, pp and v, compute_time's ends, micro_s and recv_s
    forward, backward, _ = cached(cache, ("stages", layer_f, layer_b, d.pp_size, v, micro_s,
                                          recv_s) + reads, _stage_tuples, config, profile,
                                  layer_f, layer_b, cache, micro_s, recv_s)
    send = 0.0
    if d.pp_size > 1:
        tokens = t.micro_batch_size * t.seq_length // d.cp_size
        act = tokens * config.model.hidden_size * BF16
        act /= d.tp_size if d.sequence_parallel else 1
        send = links.send(act, across_nodes=groups["pp"][2] > 1) + profile["send_s"]
    tails = rank_tails(config, profile, links, groups, forward, backward, v, cache)
    return part_f, part_b, forward, backward, send, tails


def _after_pipeline(config, profile, before, sim, cache, fit=None) -> Prediction:
    """The step from the simulated pipeline: each rank's tail, the parts, the memory (`fit`:
    its cached_fit, where known)."""
    d, t = config.distributed, config.training
    _, part_f, part_b, send, (tails, tail), v = before
    micro = t.gradient_accumulation_steps
    step = sim.makespan_s + sum(tails[tail])
    mem, fits, note = fit or (memory_fit(config, profile) if cache is None else
                              cached_fit(config, profile, cache))
    busiest = sim.busy_s.index(max(sim.busy_s))             # the first of the busiest
    layers_on = cached(cache, ("stage split", d.pp_size, v), stage_split, config,
                       profile)[busiest][0]
    # the busiest rank's layers' exposed communication, by axis
    tp, cp, dp = (micro * v * layers_on * (part_f[name] + part_b[name])
                  for name in ("tp", "cp", "dp"))
    idle = sim.makespan_s - sim.busy_s[busiest]
    pp = min(idle, 2 * (d.pp_size - 1) * send)
    # a layout predicted not to fit runs, where it runs at all, at the GPU's capacity: the
    # caching allocator frees its cache and retries, at the profile's over_memory_speed
    pressure = 0.0 if fits else step * (1 / profile["over_memory_speed"] - 1)
    parts = dict(zip(PARTS, (sim.busy_s[busiest] - tp - cp - dp, tp, cp, pp, dp + tails[tail][0],
                             idle - pp, tails[tail][1], pressure)))
    step += pressure
    tok = config.global_batch_size * t.seq_length / step / config.world_size
    flops = cached(cache, ("flops per token",), flops_per_token, config.model, t.seq_length)
    mfu = tok * flops / profile["peak_bf16_flops"]
    return Prediction(float(step), float(tok), float(mfu), mem, fits, note,
                      {k: float(x) for k, x in parts.items()},
                      Joined(sim.timeline, TailEvents(sim.makespan_s, tails)))
