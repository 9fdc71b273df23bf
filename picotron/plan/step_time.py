"""The time of one optimizer step of a layout, predicted from the config and a hardware
profile (picotron/plan/hardware/): its throughput, its MFU, its memory (the memory plan's
estimate) and the step's time split into compute, exposed communication per axis and
pipeline idle.

    predict(config, profile, gpus_per_node) -> Prediction
"""
import dataclasses

from picotron.plan.memory_plan import GPU_RESERVED, estimate
from picotron.plan.memory_state import GiB
from picotron.utils import flops_per_token


@dataclasses.dataclass
class Prediction:
    step_s: float            # one optimizer step, seconds
    tok_s_gpu: float         # tokens per second per GPU
    mfu: float               # model FLOPs (6N + 12*L*C*T a token) over the GPUs' bf16 peak
    mem_gib: float           # the memory plan's per-device estimate
    fits: bool               # the estimate fits the profile's GPU (less GPU_RESERVED)
    note: str                # why it does not fit; '' when it fits
    parts: dict              # seconds of the step: compute, dp, tp, pp, cp, pipeline_idle, ...
    timeline: list           # (pp_rank, kind, micro, chunk, start_s, end_s), kind in
                             # F, B, send, comm, idle


def memory_fit(config, profile):
    """(mem_gib, fits, note) from the memory plan's estimate against the profile's GPU."""
    need = estimate(config).device_bytes
    usable = profile["memory_gib"] * GiB - GPU_RESERVED
    if need <= usable:
        return need / GiB, True, ""
    return need / GiB, False, (f"needs an estimated {need / GiB:.1f} GiB per GPU, the GPU has "
                               f"{usable / GiB:.1f} GiB usable")


def predict(config, profile, gpus_per_node: int) -> Prediction:
    """A first, crude model: every FLOP at the profile's GEMM efficiency, the pipeline's
    bubble as (pp - 1) / (m + pp - 1)."""
    d, t = config.distributed, config.training
    tokens = config.global_batch_size * t.seq_length
    flops = flops_per_token(config.model, t.seq_length) * tokens
    compute = flops / (config.world_size * profile["peak_bf16_flops"] * profile["gemm_eff"])
    m = t.gradient_accumulation_steps
    idle = compute * (d.pp_size - 1) / m
    step = compute + idle
    mem, fits, note = memory_fit(config, profile)
    tok = tokens / step / config.world_size
    return Prediction(step, tok, tok * flops / tokens / profile["peak_bf16_flops"], mem, fits,
                      note, {"compute": compute, "dp": 0.0, "tp": 0.0, "pp": 0.0, "cp": 0.0,
                             "pipeline_idle": idle, "optimizer": 0.0}, [])
