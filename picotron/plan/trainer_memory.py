"""A profile's memory of a layout against its GPU: the memory plan's estimate
(memory_plan.py), for a profile fit to another trainer's runs scaled by the profile's factors,
with the logits that trainer keeps and the margin it must leave free; for a profile whose
trait memory = "nanotron", that trainer's own count rank by rank (nanotron_memory.py), its
parts scaled by the same factors.

    memory_fit(config, profile) -> (mem_gib, fits, note)
    fit_of(config, profile, ranks): the same from the estimate's (held, device) of its ranks

The logits a trainer's loss keeps (mem_logit_bytes) are the head's: they count on the last
pipeline rank only, as nanotron's count has them.
"""
import copy
import math

from picotron.config import resolve_auto
from picotron.plan.memory_activations import virtual_stages
from picotron.plan.memory_plan import GPU_RESERVED, device_bytes, has_auto, rank_estimate
from picotron.plan.memory_state import GiB
from picotron.plan.nanotron_memory import busiest_need


def memory_fit(config, profile):
    """(mem_gib, fits, note) from the memory plan's estimate against the profile's GPU. For a
    profile of another trainer, its memory is the plan's held part and the rest scaled by the
    profile's factors, plus the logits a trainer without a fused loss keeps (mem_logit_bytes
    a logit of the micro-batch's (n, V/tp)) and its extra (1, 1, 0, 0 for this project).
    Under the trait memory = "nanotron", the busiest rank of nanotron's own count."""
    if counts_nanotron(config, profile):
        need, rank = busiest_need(config, profile)
        return need_fit(need, profile, f" on pipeline rank {rank}")
    return fit_of(config, profile, rank_sums(config, profile))


def counts_nanotron(config, profile) -> bool:
    """Whether the profile's trainer is nanotron, whose memory nanotron_memory.py counts: its
    Llama as its runs had it, ZeRO 0 or 1, its AFAB or 1F1B engine, without CP, FP8,
    recomputation or offload ("auto", this project's choice, is none there); a layout that
    asks for what nanotron does not do keeps the plan's rule, scaled by the same factors."""
    t, d = config.training, config.distributed
    return (profile.traits.get("memory") == "nanotron" and d.cp_size == 1
            and d.zero_stage <= 1 and d.pp_engine in ("1f1b", "afab")
            and not d.offload_optim_frac and t.fp8 in ("none", "auto")
            and t.activation_checkpointing in ("none", "auto"))


def rank_sums(config, profile) -> list:
    """[(held, device bytes)] of the memory plan's estimate of each pipeline rank, as the
    profile's trainer holds them (grads_held_apart): the ranks that can be the busiest, the
    last pipeline rank's last. "auto" options count as what they resolve to, on a copy."""
    if has_auto(config):
        config = copy.deepcopy(config)
        resolve_auto(config)
    if grads_held_apart(config, profile):
        return grads_held_memory(config)
    return [held_and_device_of(rank_estimate(config, r))
            for r in range(config.distributed.pp_size)]


def held_and_device_of(e) -> tuple:
    """(held, device bytes) of one rank's Estimate."""
    return sum(r.bytes for r in e.rows if r.when == "held"), e.device_bytes


def held_and_device(config, profile) -> tuple:
    """(held, device bytes) of the busiest rank of rank_sums."""
    return max(rank_sums(config, profile), key=lambda sums: sums[1])


def grads_held_apart(config, profile) -> bool:
    """Whether the profile's trainer holds its gradient buffers all step (the trait
    grads_held: nanotron's fp32 accumulator) where this project's plan frees them between
    steps (one micro-batch a step: no accumulation to carry)."""
    return (bool(profile.traits.get("grads_held"))
            and config.training.gradient_accumulation_steps == 1)


def grads_held_memory(config) -> list:
    """rank_sums with the gradient buffers held, the plan's rule otherwise
    (memory_plan.rank_estimate), of a config with no "auto" left."""
    graphs, pp, ranks_sums = config.training.cuda_graphs is True, config.distributed.pp_size, []
    # at one micro-batch every rank holds one in flight: the ranks differ only by their ends
    # and by a layer more or less, so the first two and the last two stand for all
    ranks = range(pp) if virtual_stages(config) > 1 else sorted({0, 1, pp - 2, pp - 1} & set(
        range(pp)))
    for r in ranks:
        sums = {}
        for row in rank_estimate(config, r).rows:
            when = "held" if row.name in ("gradient buffers", "gradient shards") else row.when
            sums[when] = sums.get(when, 0) + row.bytes
        held, forward, step = (sums.get(w, 0) for w in ("held", "forward", "step"))
        ranks_sums.append((held, device_bytes(held, forward, step, graphs)))
    return ranks_sums


def logit_count(config) -> int:
    """The logits of one micro-batch on one rank: its (n, V/tp), n = mbs x seq / cp."""
    t, d = config.training, config.distributed
    return t.micro_batch_size * t.seq_length // d.cp_size * -(-config.model.vocab_size //
                                                                d.tp_size)


def scaled_need(config, profile, held, device_bytes, head: bool) -> float:
    """The bytes a profile's trainer needs on a rank of the plan's (held, device bytes): its
    factors and extra applied, and on the head's rank its loss's logits."""
    logits = profile["mem_logit_bytes"] * logit_count(config) if head else 0.0
    return (profile["mem_held_factor"] * held + profile["mem_act_factor"] * (
        device_bytes - held) + logits + profile["mem_extra_gib"] * GiB)


def fit_of(config, profile, ranks):
    """memory_fit from rank_sums' [(held, device bytes)], the last the head's rank."""
    return need_fit(max(scaled_need(config, profile, held, device, i == len(ranks) - 1)
                        for i, (held, device) in enumerate(ranks)), profile)


def need_fit(need, profile, where: str = ""):
    """(mem_gib, fits, note) of `need` bytes against the profile's usable memory."""
    # a trainer whose memory the profile predicts only within some error must leave
    # mem_margin of the GPU free to be predicted to fit (0 for this project's own plan)
    usable = (profile["memory_gib"] * GiB - GPU_RESERVED) * (1 - profile["mem_margin"])
    if need <= usable:
        return need / GiB, True, ""
    # to a tenth of a GiB, the need rounded up and the room down: the note never reads as a
    # layout refused for needing what the GPU has
    return need / GiB, False, (
        f"needs an estimated {math.ceil(need / GiB * 10) / 10:.1f} GiB per GPU{where}, the "
        f"{profile.name} GPU has {math.floor(usable / GiB * 10) / 10:.1f} GiB usable")
