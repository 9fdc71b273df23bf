"""What `python -m picotron.plan search` prints: the fastest layouts as a table, each step split
into compute, exposed communication per axis and pipeline idle, then the refusals counted by
reason (search.py counts them by report.reason, the message with its numbers masked, and
widens the memory's estimate of each reason); and the one-line name of a layout that
create_config.py's --auto_layout prints.
A row whose layout the profile's runs never had (hardware.unmeasured) is marked "*": its time
rests on the profile's assumed numbers there.
"""
import functools
import re

from picotron.plan.hardware import unmeasured

# the step's parts the table shows, by the names step_time.Prediction.parts gives them
PARTS = ("compute", "dp", "tp", "pp", "cp", "pipeline_idle")
HEADER = ("#", "layout", "mbs x acc", "zero", "recompute", "fp8", "tok/s/GPU", "MFU",
          "GiB/GPU", "step s", "compute", "dp", "tp", "pp", "cp", "idle")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
DECIMAL = re.compile(r"\d+\.\d+")


@functools.lru_cache(maxsize=65536)
def reason(message: str) -> str:
    """A refusal's message with its numbers masked, so that layouts refused by one rule count
    together ('tp_size=16' and 'tp_size=32' alike)."""
    return NUMBER.sub("N", message)


def widen(spans: dict, key: str, message: str) -> None:
    """Stretch the reason's [least, greatest] of its first decimal number (a memory refusal's
    estimate) to this message's; only the first, searched for alone, keeps a search of a few
    hundred thousand layouts as fast."""
    found = DECIMAL.search(message)
    if found is None:
        return
    value, span = float(found.group()), spans.get(key)
    if span is None:
        spans[key] = [value, value]
    elif value < span[0]:
        span[0] = value
    elif value > span[1]:
        span[1] = value


def spanned(example: str, span) -> str:
    """The example message with its first decimal number shown as the range it took over the
    reason's layouts ('needs an estimated 70.1-184.4 GiB per GPU'), where it varied."""
    found = DECIMAL.search(example)
    if not span or found is None or span[0] == span[1]:
        return example
    places = len(found.group().split(".")[1])
    return (example[:found.start()] + f"{span[0]:.{places}f}-{span[1]:.{places}f}"
            + example[found.end():])


def layout_name(layout: dict) -> str:
    """'dp8 tp2 pp4 cp1' plus the engine where pp > 1 and the cp_mode where cp > 1."""
    name = " ".join(f"{axis}{layout[axis]}" for axis in ("dp", "tp", "pp", "cp"))
    if layout["pp"] > 1:
        engine = layout["pp_engine"]
        name += f" {engine}" + (f":{layout['interleave']}" if engine == "interleaved" else "")
    if layout["cp"] > 1:
        name += f" {layout['cp_mode']}"
    return name


def describe(layout: dict) -> str:
    """The whole layout in one line, as create_config.py's flags would give it."""
    return (f"{layout_name(layout)}, mbs {layout['mbs']} x grad_acc {layout['grad_acc']}, "
            f"ZeRO-{layout['zero']}, recompute {layout['recompute']}, fp8 {layout['fp8']}")


def row(rank: int, scored, marked: bool = False) -> tuple:
    layout, p = scored.layout, scored.prediction
    parts = [p.parts.get(name, 0.0) for name in PARTS]
    return ((f"{rank}*" if marked else str(rank), layout_name(layout),
             f"{layout['mbs']} x {layout['grad_acc']}",
             str(layout["zero"]), layout["recompute"], layout["fp8"], f"{p.tok_s_gpu:,.0f}",
             f"{100 * p.mfu:.1f}%", f"{p.mem_gib:.1f}", f"{p.step_s:.3f}")
            + tuple(f"{1e3 * s:,.0f}ms" if s else "-" for s in parts))


def table(rows: list) -> str:
    """Columns padded to their widest cell, the first two left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def gpus_said(n: int) -> str:
    """"1 GPU", "8 GPUs"."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def search_report(result, top: int = 10, profile=None) -> str:
    """The top `top` layouts (marked where `profile`'s runs never had them), then what was
    refused and why (each reason with its first message, the memory's estimate in it as
    its range over the reason's layouts), then how long the search took."""
    lines = []
    fits = len(result.ranked)
    refused = sum(result.refused.values())
    if result.ranked:
        shown = result.ranked[:top]
        beyond = [unmeasured(profile, s.layout) if profile else [] for s in shown]
        lines.append(table([HEADER] + [row(i + 1, s, bool(b))
                                       for i, (s, b) in enumerate(zip(shown, beyond))]))
        lines.append("(step parts: compute, exposed communication of each axis, pipeline idle)")
        if any(beyond):
            lines.append(unmeasured_line(profile, [k for b in beyond for k in b]))
            lines.append(fastest_measured_line(result.ranked, profile))
    else:
        lines.append("no layout fits")
    lines.append(f"\n{fits:,} layouts fit; {refused:,} refused:")
    for key, count in result.refused.most_common():
        lines.append(f"  {count:>9,}  {spanned(result.examples[key], result.spans.get(key))}")
    lines.append(f"({result.considered:,} layouts judged in {result.seconds:.1f} s)")
    return "\n".join(lines)


def unmeasured_line(profile, pairs: list, lead: str = "* ") -> str:
    """The footnote of the rows marked "*": each knob once, with its values in the rows."""
    values = {}
    for knob, value in pairs:
        values.setdefault(knob, []).append(str(value))
    said = "; ".join(f"{knob} {', '.join(dict.fromkeys(v))}" for knob, v in values.items())
    return (f"{lead}{said}: beyond the runs the {profile.name} profile was fit to; its time "
            f"there rests on assumed numbers")


def fastest_measured_line(ranked: list, profile) -> str:
    """The fastest layout all of whose knobs the profile's runs had, and its rank."""
    rank, best = next(((i + 1, s) for i, s in enumerate(ranked)
                       if not unmeasured(profile, s.layout)), (0, None))
    if best is None:
        return f"no layout that fits is within the runs the {profile.name} profile was fit to"
    return (f"fastest within them: #{rank}, {describe(best.layout)}: "
            f"{best.prediction.tok_s_gpu:,.0f} tok/s/GPU")


def runner_up_line(best, second) -> str:
    """How much the runner-up loses to the best, in tok/s/GPU."""
    a, b = best.prediction.tok_s_gpu, second.prediction.tok_s_gpu
    loss = 100 * (1 - b / a) if a else 0.0
    return (f"runner-up: {describe(second.layout)}: {b:,.0f} tok/s/GPU, {loss:.1f}% slower "
            f"than the best ({a:,.0f})")
