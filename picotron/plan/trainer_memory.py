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
from picotron.plan.memory_plan import GPU_RESERVED, has_auto, rank_estimate
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
    return fit_of(config, profile, rank_sums(config))


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


def rank_sums(config) -> list:
    """[(held, device bytes)] of the memory plan's estimate of each pipeline rank, the last
    pipeline rank's last. "auto" options count as what they resolve to, on a copy."""
    if has_auto(config):
        config = copy.deepcopy(config)
        resolve_auto(config)
    return [held_and_device_of(rank_estimate(config, r))
            for r in range(config.distributed.pp_size)]


def held_and_device_of(e) -> tuple:
    """(held, device bytes) of one rank's Estimate."""
    return sum(r.bytes for r in e.rows if r.when == "held"), e.device_bytes


def held_and_device(config) -> tuple:
    """(held, device bytes) of the busiest rank of rank_sums."""
    return max(rank_sums(config), key=lambda sums: sums[1])


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
