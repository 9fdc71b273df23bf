"""The planner's figures on the pages are the time model's as it is: docs/pipelines.md's
AFAB / 1F1B / interleaved block is made again here (its pictures into a temporary folder) and
must equal the page's; when the model or a profile changes, `python bench/plan_figures.py`
makes every block again. The searches behind README's table and the Llama-3-8B block take
minutes, so for those the page is held to the command it shows: the search printed above the
table is the script's, and every picture named exists."""
import os
import re
import sys

import pytest

from launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import plan_figures                                                      # noqa: E402

STALE = "stale: run `python bench/plan_figures.py --only {}` and commit what it writes"


def page_block(page: str, name: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        parts = plan_figures.block_of(f.read(), name)
    assert parts is not None, f"{page} has no plan_figures:{name} block"
    return parts[1]


def test_the_pipelines_block_is_the_models(tmp_path):
    pytest.importorskip("matplotlib")                  # explain draws the block's pictures
    made = plan_figures.pipelines_block(str(tmp_path / "configs"), str(tmp_path))
    assert page_block("docs/pipelines.md", "pipelines") == made, STALE.format("pipelines")
    for engine in plan_figures.ENGINES:
        assert (tmp_path / f"pipeline-{engine}.png").is_file()


def test_the_search_blocks_show_the_scripts_commands_and_their_pictures():
    for page, name, argv in (("README.md", "readme", plan_figures.SMOL_SEARCH),
                             ("docs/pipelines.md", "llama", plan_figures.LLAMA_SEARCH)):
        block = page_block(page, name)
        command = f"$ python -m picotron.plan {' '.join(argv)}"
        assert block.startswith(f"```\n{command}\n"), STALE.format(name)
        # a row beyond the knob values the profile's runs had is marked '*'
        assert re.search(r"\n1\*? +dp\d+ tp\d+ pp\d+ cp\d+", block), f"{page}: no top row"
        folder = os.path.dirname(os.path.join(ROOT, page))
        for image in re.findall(r"\]\((images/[^)]+\.png)\)", block):
            assert os.path.isfile(os.path.join(folder, image)), f"{page}: {image} is missing"
