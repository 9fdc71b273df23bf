"""One layout's step as a picture: `python -m picotron.plan explain CONFIG [--hardware PROFILE]
[--out FILE.png]`.

A lane per pipeline rank, time running right: each micro-batch's forward and backward (the
micro-batch's number on it; under the interleaved engine a darker shade for each later chunk),
the collectives each pass leaves exposed (hatched over its end), the sends to the neighbour (a
thin strip under the lane), the idle time, and after the last backward the exposed gradient
reduction and the optimizer. Beside each lane, that rank's memory from the memory plan (or a
profile's trainer's own count): what it holds the whole step and what its peak adds, against
the GPU's usable memory.

Every bar is an event of the step the planner predicts (step_lanes.py reads step_time.predict's
timeline, which pipeline_sim.py simulates from the schedules' own action lists), so the
picture is the prediction `search` ranks, not a second model. Needs matplotlib.
"""
import os

from picotron.config import load_config
from picotron.config.features import fp8_auto_choice
from picotron.plan.memory_plan import GPU_RESERVED
from picotron.plan.memory_state import GiB
from picotron.plan.report import layout_name
from picotron.plan.step_lanes import busy_s, step_lanes
from picotron.plan.trainer_memory import counts_nanotron

FORWARD = ("#9fc5e8", "#6fa8dc", "#3d85c6", "#0b5394")       # chunk 0, 1, 2, 3+
BACKWARD = ("#f9cb9c", "#f6b26b", "#e69138", "#b45f06")
COLORS = {"exposed": "#cc0000", "send": "#8e7cc3", "idle": "#f3f3f3", "dp": "#e06666",
          "optimizer": "#93c47d", "held": "#b4a7d6", "peak": "#ffd966"}
LEGEND = (("forward", "forward", FORWARD[0]), ("backward", "backward", BACKWARD[0]),
          ("exposed", "exposed collectives (tp, cp, ZeRO-3)", COLORS["exposed"]),
          ("send", "send to a neighbouring stage", COLORS["send"]),
          ("idle", "idle", COLORS["idle"]),
          ("dp", "gradient reduction, exposed (dp)", COLORS["dp"]),
          ("optimizer", "optimizer", COLORS["optimizer"]))          # (kind, label, colour)
# the bars drawn over others (exposed) or standing for nothing done (idle) are hatched
STYLES = {"exposed": {"hatch": "////", "edgecolor": "white", "alpha": 0.55},
          "idle": {"hatch": "..", "edgecolor": "#cccccc"}}
LANE, STRIP = 0.56, 0.12           # heights, in lanes: a rank's compute, its sends beneath


def config_for_profile(path: str, profile, overrides=()):
    """The config at `path` with its "auto" options resolved as on the profile's GPU, not this
    machine's: FP8 where the profile's GPU has FP8 tensor cores and the config would pick it."""
    config = load_config(path, overrides=overrides)
    if "training.fp8" in getattr(config, "auto_resolved", {}) and not config.distributed.use_cpu:
        config.training.fp8 = fp8_auto_choice(config, bool(profile.numbers.get("peak_fp8_flops")))
        config.auto_resolved["training.fp8"] = config.training.fp8
    return config


def layout_of(config) -> str:
    d, t = config.distributed, config.training
    name = layout_name({"dp": d.dp_size, "tp": d.tp_size, "pp": d.pp_size, "cp": d.cp_size,
                        "pp_engine": d.pp_engine, "interleave": d.pp_virtual_stages,
                        "cp_mode": d.cp_mode})
    micro = t.gradient_accumulation_steps
    return (f"{name}, {micro} micro-batch{'es' if micro > 1 else ''} of {t.micro_batch_size} x "
            f"{t.seq_length} tokens, ZeRO-{d.zero_stage}, recompute "
            f"{t.activation_checkpointing}, fp8 {t.fp8}")


def summary(config, profile, lanes) -> str:
    """The prediction in two lines: throughput, then the step's parts."""
    p, pp = lanes.prediction, config.distributed.pp_size
    computing = sum(busy_s(lanes.bars, r) for r in range(pp)) / (pp * p.step_s)
    parts = ", ".join(f"{name} {1e3 * s:,.0f} ms" for name, s in p.parts.items() if s > 0)
    return (f"{config.model.name}: {layout_of(config)}; {profile.name}\n"
            f"predicted step {p.step_s:.3f} s, {p.tok_s_gpu:,.0f} tok/s/GPU, MFU {p.mfu:.1%}, "
            f"{p.mem_gib:.1f} GiB/GPU; the ranks compute {computing:.0%} of it "
            f"(busiest rank: {parts})")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("explain draws with matplotlib: `pip install matplotlib`") from None
    matplotlib.use("Agg")                           # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def bar_color(bar) -> str:
    if bar.kind in ("forward", "backward"):
        shades = FORWARD if bar.kind == "forward" else BACKWARD
        return shades[min(max(bar.chunk, 0), len(shades) - 1)]
    return COLORS[bar.kind]


def draw_lanes(ax, lanes, pp: int) -> None:
    """The timeline axes: one lane per rank, rank 0 on top; x in milliseconds. Each bar is a
    Rectangle whose gid is 'rank:kind' (the tests read the drawn bars back)."""
    span = lanes.prediction.step_s
    for bar in lanes.bars:
        start, width = 1e3 * bar.start_s, 1e3 * (bar.end_s - bar.start_s)
        if bar.kind == "send":
            y, height = bar.rank + (LANE + STRIP) / 2, STRIP
        else:
            y, height = bar.rank, LANE
        style = STYLES.get(bar.kind, {"edgecolor": "white", "linewidth": 0.4})
        ax.barh(y, width, left=start, height=height, color=bar_color(bar),
                gid=f"{bar.rank}:{bar.kind}", **style)
        if bar.kind in ("forward", "backward") and bar.end_s - bar.start_s > 0.012 * span:
            ax.text(start + width / 2, y, str(bar.micro), ha="center", va="center",
                    fontsize=7)
    ax.axvline(1e3 * span, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(pp), [f"pp rank {r}" for r in range(pp)])
    ax.set_ylim(pp - 0.5 + STRIP, -0.5)
    ax.set_xlim(0, 1e3 * span * 1.01)
    ax.set_xlabel("time in the step (ms)")
    ax.grid(axis="x", alpha=0.3)


def draw_memory(ax, lanes, profile, pp: int, title: str = "memory plan") -> None:
    """Each rank's memory (step_lanes.rank_memory): held the whole step, plus what the step's
    peak adds, against the usable memory less the margin the profile's trainer must leave
    free (trainer_memory.need_fit's limit)."""
    usable = (profile["memory_gib"] * GiB - GPU_RESERVED) * (1 - profile["mem_margin"]) / GiB
    for r, m in enumerate(lanes.memory):
        held, peak = m.held_bytes / GiB, m.peak_bytes / GiB
        ax.barh(r, held, height=LANE, color=COLORS["held"], gid=f"{r}:held")
        ax.barh(r, peak, left=held, height=LANE, color=COLORS["peak"], gid=f"{r}:peak")
        ax.text(held + peak, r, f" {m.device_bytes / GiB:.1f}", va="center", fontsize=8)
    ax.axvline(usable, color="black", linewidth=0.8, linestyle="--")
    top = max([usable] + [m.device_bytes / GiB for m in lanes.memory])
    ax.set_xlim(0, top * 1.25)
    ax.set_ylim(pp - 0.5 + STRIP, -0.5)
    ax.set_yticks([])
    ax.set_xlabel(f"GiB per GPU ({usable:.0f} usable)")
    ax.set_title(title, fontsize=9)


def draw(config, profile, lanes, out: str) -> str:
    """Write the picture of `lanes` to `out` (a PNG, or what its extension names)."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    pp = config.distributed.pp_size
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(14, 1.9 + 0.55 * pp),
                                  gridspec_kw={"width_ratios": [6, 1]})
    draw_lanes(ax, lanes, pp)
    trainer = profile.traits.get("trainer", "picotron")
    if counts_nanotron(config, profile):
        title = f"{profile.traits['memory']}'s memory"
    else:       # another trainer's profile scales the plan (step_lanes.rank_memory)
        title = "memory plan" if trainer == "picotron" else f"memory plan, as {trainer}"
    draw_memory(mem, lanes, profile, pp, title)
    head, numbers = summary(config, profile, lanes).split("\n")
    ax.set_title(f"{head}\n{numbers.split(';')[0]}", fontsize=9, loc="left")
    drawn = {bar.kind for bar in lanes.bars}
    later = " (darker: a later chunk)" if lanes.v > 1 else ""
    handles = [Patch(facecolor=c, **STYLES.get(kind, {}),
                     label=label + (later if kind in ("forward", "backward") else ""))
               for kind, label, c in LEGEND if kind in drawn]
    handles += [Patch(color=COLORS["held"], label="memory held all step"),
                Patch(color=COLORS["peak"], label="memory at the peak")]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12 + 0.1 / pp, 1, 1))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise ValueError(f"cannot write --out {out!r} ({e.strerror}); choose a path in a "
                         f"folder you can write") from None
    finally:
        plt.close(fig)
    return out


def explain(config_path: str, profile, out: str = None, gpus_per_node: int = 8,
            overrides=()) -> tuple:
    """Draw the predicted step of the config at `config_path`; return (path written, the
    prediction's summary). `out` defaults to step.png beside the config."""
    _pyplot()                          # no matplotlib: say so before any work
    config = config_for_profile(config_path, profile, overrides)
    lanes = step_lanes(config, profile, gpus_per_node)
    out = out or os.path.join(os.path.dirname(os.path.abspath(config_path)), "step.png")
    return draw(config, profile, lanes, out), summary(config, profile, lanes)
