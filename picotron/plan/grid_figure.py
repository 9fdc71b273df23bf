"""A picture of the grid: which rank holds which coordinates, and what each group is.

    python -m picotron.plan.grid_figure --dp 4 --tp 2 --pp 2 --out docs/images/grid-dp4-tp2-pp2.svg

Everything drawn comes from the grid's own pure functions (`coordinates`, `group_ranks` in
picotron/process_group_manager.py), so the figure is the layout the run builds: a rank's box
sits at its coordinates (a row per data-parallel replica, a column block per pipeline stage
and context shard, tensor-parallel neighbours side by side) and shows the global rank the grid
gives it. The SVG is written by hand, byte for byte the same on every machine, so a test can
regenerate it and fail when the grid's numbering changes and the committed figure did not.
"""
import argparse
from xml.sax.saxutils import escape

from picotron.config.overrides import parse_flags
from picotron.process_group_manager import AXES, coordinates, group_ranks

# pixels: a rank's box, the gap between blocks, the edges, the row labels
BOX_W, BOX_H, GAP, MARGIN, LABEL = 112, 46, 40, 20, 90
COLORS = {"tp": "#d9ead3", "pp": "#c9daf8", "cp": "#fce5cd", "dp": "#ead1dc"}
MEANING = {"tp": "tensor parallel: shards of every weight matrix; two all-reduces per layer",
           "pp": "pipeline: consecutive stages; activations forward, gradients back",
           "cp": "context parallel: shards of every sequence; K/V passed around the ring",
           "dp": "data parallel: replicas of the same shards; gradients averaged each step"}


def rank_boxes(sizes: dict) -> dict:
    """rank -> (x, y) of its box: row = dp replica; column = (pp stage, cp shard, tp shard)."""
    boxes = {}
    for rank in range(sizes["dp"] * sizes["pp"] * sizes["cp"] * sizes["tp"]):
        c = coordinates(rank, **sizes)
        block = c["pp"] * sizes["cp"] + c["cp"]                 # one block of tp boxes
        x = MARGIN + LABEL + block * (sizes["tp"] * BOX_W + GAP) + c["tp"] * BOX_W
        y = MARGIN + 40 + c["dp"] * (BOX_H + GAP)
        boxes[rank] = (x, y, c)
    return boxes


def text(x, y, s, size=12, anchor="start", weight="normal") -> str:
    return (f'<text x="{x}" y="{y}" font-family="monospace" font-size="{size}" '
            f'text-anchor="{anchor}" font-weight="{weight}">{escape(s)}</text>')


def group_lines(sizes: dict) -> list:
    """One legend line per axis with more than one rank along it: its groups, from the grid."""
    lines = []
    for axis in AXES[::-1]:                                       # tp first: the closest
        if sizes[axis] == 1:
            continue
        groups = " ".join("[" + ",".join(map(str, g)) + "]"
                          for g in group_ranks((axis,), **sizes))
        lines.append((axis, f"{axis} groups ({MEANING[axis]}):", groups))
    return lines


def figure(dp: int, tp: int, pp: int, cp: int = 1) -> str:
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    world = dp * pp * cp * tp
    boxes = rank_boxes(sizes)
    blocks = pp * cp
    width = max(2 * MARGIN + LABEL + blocks * (tp * BOX_W + GAP) - GAP, 760)
    grid_bottom = MARGIN + 40 + dp * (BOX_H + GAP)
    legend = group_lines(sizes)
    height = grid_bottom + 20 + 40 * len(legend) + MARGIN
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           text(MARGIN, MARGIN + 12, f"{world} ranks = dp {dp} x pp {pp} x cp {cp} x tp {tp}: "
                f"arange({world}).view(dp, pp, cp, tp), tp fastest", 14, weight="bold")]
    for block in range(blocks):                                   # column titles
        x = MARGIN + LABEL + block * (tp * BOX_W + GAP) + tp * BOX_W / 2
        title = f"pp stage {block // cp}" + (f", cp shard {block % cp}" if cp > 1 else "")
        out.append(text(x, MARGIN + 32, title, 12, "middle", "bold"))
    for rank, (x, y, c) in boxes.items():
        if c["pp"] == 0 and c["cp"] == 0 and c["tp"] == 0:       # the row: one dp replica
            out.append(f'<rect x="{MARGIN}" y="{y - 3}" width="{LABEL - 12}" '
                       f'height="{BOX_H + 6}" rx="6" fill="{COLORS["dp"]}"/>')
            out.append(text(MARGIN + (LABEL - 12) / 2, y + 28, f"replica {c['dp']}", 12,
                            "middle"))
        if c["tp"] == tp - 1 and c["pp"] < pp - 1 and c["cp"] == cp - 1:   # to the next stage
            x0, xm = x + BOX_W + 4, y + BOX_H / 2
            out.append(f'<path d="M {x0} {xm} L {x0 + GAP - 10} {xm} M {x0 + GAP - 16} '
                       f'{xm - 5} L {x0 + GAP - 10} {xm} L {x0 + GAP - 16} {xm + 5}" '
                       f'stroke="#3c78d8" stroke-width="2" fill="none"/>')
        if c["tp"] == 0 and tp > 1:                               # the tp group's frame
            out.append(f'<rect x="{x - 3}" y="{y - 3}" width="{tp * BOX_W + 6}" '
                       f'height="{BOX_H + 6}" rx="6" fill="{COLORS["tp"]}"/>')
        out.append(f'<rect x="{x + 2}" y="{y}" width="{BOX_W - 4}" height="{BOX_H}" rx="4" '
                   f'fill="white" stroke="#555"/>')
        out.append(text(x + BOX_W / 2, y + 18, f"rank {rank}", 13, "middle", "bold"))
        out.append(text(x + BOX_W / 2, y + 36, f"dp{c['dp']} pp{c['pp']} cp{c['cp']} "
                        f"tp{c['tp']}", 10, "middle"))
    for i, (axis, title, groups) in enumerate(legend):
        y = grid_bottom + 20 + 40 * i
        out.append(f'<rect x="{MARGIN}" y="{y}" width="14" height="14" '
                   f'fill="{COLORS[axis]}" stroke="#555"/>')
        out.append(text(MARGIN + 22, y + 12, title, 12))
        out.append(text(MARGIN + 22, y + 28, groups, 11))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Draw the dp x pp x cp x tp grid as an SVG: "
                                     "every rank's coordinates and every group.",
                                     allow_abbrev=False)
    for axis in ("dp", "tp", "pp", "cp"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size (default 1)")
    parser.add_argument("--out", required=True, help="the SVG file to write")
    args = parse_flags(parser, argv)
    if min(args.dp, args.tp, args.pp, args.cp) < 1:
        parser.error("every size must be 1 or more")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(figure(args.dp, args.tp, args.pp, args.cp))
    print(args.out)


if __name__ == "__main__":
    main()
