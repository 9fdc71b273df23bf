"""The course's picture of the grid (docs/images/grid-dp4-tp2-pp2.svg, README's 16-rank
example) is drawn from the grid's own functions: the committed file is exactly what the
script writes today, so a change to the grid's numbering that leaves the figure behind fails
here until `python -m picotron.plan.grid_figure --dp 4 --tp 2 --pp 2 --out ...` is run."""
import os
import re

import torch

from launch import ROOT
import picotron.process_group_manager as pgm
from picotron.plan import grid_figure

FIGURE = os.path.join(ROOT, "docs", "images", "grid-dp4-tp2-pp2.svg")


def boxes_of(svg: str) -> dict:
    """rank -> 'dpD ppP cpC tpT', as the figure labels each box."""
    found = re.findall(r">rank (\d+)</text>\n<text [^>]*>(dp\d+ pp\d+ cp\d+ tp\d+)</text>", svg)
    return {int(r): coords for r, coords in found}


def test_the_committed_figure_is_what_the_script_draws():
    with open(FIGURE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == grid_figure.figure(dp=4, tp=2, pp=2), (
        "docs/images/grid-dp4-tp2-pp2.svg is stale: run python -m picotron.plan.grid_figure "
        "--dp 4 --tp 2 --pp 2 --out docs/images/grid-dp4-tp2-pp2.svg")


def test_every_box_and_group_is_the_grids():
    svg = grid_figure.figure(dp=4, tp=2, pp=2)
    boxes = boxes_of(svg)
    assert sorted(boxes) == list(range(16))
    for rank, label in boxes.items():
        c = pgm.coordinates(rank, dp=4, pp=2, cp=1, tp=2)
        assert label == f"dp{c['dp']} pp{c['pp']} cp{c['cp']} tp{c['tp']}"
    for axis in ("tp", "pp", "dp"):
        groups = " ".join("[" + ",".join(map(str, g)) + "]"
                          for g in pgm.group_ranks((axis,), dp=4, pp=2, cp=1, tp=2))
        assert f">{groups}</text>" in svg, axis


def test_a_new_numbering_of_the_grid_changes_the_figure(monkeypatch):
    """If the grid put dp fastest instead of tp, the figure drawn would differ from the
    committed one, so the first test would fail until it is regenerated."""
    before = grid_figure.figure(dp=4, tp=2, pp=2)

    def dp_fastest(dp, pp, cp, tp):
        return torch.arange(dp * pp * cp * tp).view(tp, cp, pp, dp).permute(3, 2, 1, 0)

    monkeypatch.setattr(pgm, "grid", dp_fastest)
    after = grid_figure.figure(dp=4, tp=2, pp=2)
    assert after != before
    assert boxes_of(after)[1] == "dp1 pp0 cp0 tp0"


def test_the_command_writes_the_file(tmp_path, capsys):
    out = tmp_path / "grid.svg"
    grid_figure.main(["--dp", "2", "--cp", "2", "--tp", "2", "--out", str(out)])
    svg = out.read_text()
    assert "8 ranks = dp 2 x pp 1 x cp 2 x tp 2" in svg and "cp groups" in svg
    assert capsys.readouterr().out.strip() == str(out)
