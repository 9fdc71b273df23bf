"""The process grid: coordinates and groups against the documented formula, then for real."""
import itertools
import json
import os

import pytest

from launch import ROOT, launch_script
from picotron.config import Config
from picotron.process_group_manager import ProcessGroupManager, factorisations
from workers.grid_worker import LAYOUTS

AXES = ("dp", "pp", "cp", "tp")


def formula_rank(c, sizes):
    """The documented layout: rank = ((dp * PP + pp) * CP + cp) * TP + tp (tp fastest)."""
    return ((c["dp"] * sizes["pp"] + c["pp"]) * sizes["cp"] + c["cp"]) * sizes["tp"] + c["tp"]


def expected_members(c, sizes, axes):
    """Ranks that agree with c on every axis not in `axes`."""
    ranges = [range(sizes[a]) if a in axes else [c[a]] for a in AXES]
    return sorted(formula_rank(dict(zip(AXES, combo)), sizes)
                  for combo in itertools.product(*ranges))


def test_every_factorisation_of_1_to_8_matches_the_formula():
    checked = 0
    for world in range(1, 9):
        for dp, pp, cp, tp in factorisations(world):
            sizes = dict(dp=dp, pp=pp, cp=cp, tp=tp)
            for coords in itertools.product(range(dp), range(pp), range(cp), range(tp)):
                c = dict(zip(AXES, coords))
                rank = formula_rank(c, sizes)
                pgm = ProcessGroupManager(dp=dp, pp=pp, cp=cp, tp=tp, rank=rank)
                assert [pgm.dp_rank, pgm.pp_rank, pgm.cp_rank, pgm.tp_rank] == list(coords)
                for name, axes in (("dp", ("dp",)), ("pp", ("pp",)), ("cp", ("cp",)),
                                   ("tp", ("tp",)), ("cp_dp", ("cp", "dp"))):
                    assert getattr(pgm, f"{name}_group_ranks") == expected_members(c, sizes, axes)
                prev_ = None if c["pp"] == 0 else formula_rank({**c, "pp": c["pp"] - 1}, sizes)
                next_ = None if c["pp"] == pp - 1 else formula_rank({**c, "pp": c["pp"] + 1}, sizes)
                assert (pgm.pp_prev_rank, pgm.pp_next_rank) == (prev_, next_)
                ends = [formula_rank({**c, "pp": p}, sizes) for p in (0, pp - 1)]
                assert pgm.pp_ends_group_ranks == (ends if pp > 1 else None)
                assert pgm.cp_send_rank == formula_rank({**c, "cp": (c["cp"] + 1) % cp}, sizes)
                assert pgm.cp_recv_rank == formula_rank({**c, "cp": (c["cp"] - 1) % cp}, sizes)
                assert f"dp {c['dp']}/{dp} pp {c['pp']}/{pp} cp {c['cp']}/{cp} tp {c['tp']}/{tp}" \
                    in repr(pgm)
                checked += 1
    assert checked == sum(w * len(list(factorisations(w))) for w in range(1, 9))


def test_groups_are_built_for_real_on_8_gloo_ranks(tmp_path):
    out = tmp_path / "grid.json"
    launch_script(os.path.join(ROOT, "tests", "workers", "grid_worker.py"), 8, [out], 300)
    seen = json.loads(out.read_text())
    for dp, pp, cp, tp in LAYOUTS:
        sizes = dict(dp=dp, pp=pp, cp=cp, tp=tp)
        for rank, got in enumerate(seen["x".join(map(str, (dp, pp, cp, tp)))]):
            c = dict(zip(AXES, got["coords"]))
            assert formula_rank(c, sizes) == rank
            for name, axes in (("dp", ("dp",)), ("pp", ("pp",)), ("cp", ("cp",)),
                               ("tp", ("tp",)), ("cp_dp", ("cp", "dp"))):
                assert sorted(got[name]) == expected_members(c, sizes, axes), (name, rank)
            assert got["cp_from"] == formula_rank({**c, "cp": (c["cp"] - 1) % cp}, sizes)
            if pp > 1:
                ends = [formula_rank({**c, "pp": p}, sizes) for p in (0, pp - 1)]
                assert got["pp_ends"] == ends, rank
            assert got["repr"].startswith(f"rank {rank}/8:")


def test_sizes_are_keywords_only():
    """Four positional ints are too easy to swap (dp and tp are both "2" in most layouts)."""
    with pytest.raises(TypeError):
        ProcessGroupManager(2, 1, 1, 2, rank=0)
    pgm = ProcessGroupManager(tp=2, rank=1)        # unnamed axes have size 1
    assert (pgm.dp_size, pgm.pp_size, pgm.cp_size, pgm.tp_size, pgm.tp_rank) == (1, 1, 1, 2, 1)


def test_from_config_reads_the_layout():
    config = Config()
    d = config.distributed
    d.dp_size, d.pp_size, d.cp_size, d.tp_size = 2, 2, 1, 2
    pgm = ProcessGroupManager.from_config(config, rank=5)        # dp 1, pp 0, tp 1
    assert (pgm.dp_size, pgm.pp_size, pgm.cp_size, pgm.tp_size) == (2, 2, 1, 2)
    assert (pgm.dp_rank, pgm.pp_rank, pgm.cp_rank, pgm.tp_rank) == (1, 0, 0, 1)
    assert pgm.pp_ends_group_ranks == [5, 7]
