"""`python -m picotron.plan explain CONFIG` (picotron/plan/explain.py): it writes a picture of a
pp2 config's step whose lanes are the simulated pipeline (each lane's forward and backward time
is the simulation's, in the schedule's own order), with each rank's memory from the memory
plan; bad input (a missing config, an unknown profile, no matplotlib) ends in one line.

The drawn bars are read back from the figure explain saves (each Rectangle's gid names its
rank and kind); the simulation is run here again from the step-time model's stage times."""
import sys

import pytest

import create_config
from picotron.pipeline_parallel.schedules import schedule_orders
from picotron.plan.__main__ import main
from picotron.plan.comm_time import Links, layout_groups
from picotron.plan.explain import LEGEND, config_for_profile
from picotron.plan.hardware import load_profile
from picotron.plan.memory_plan import rank_estimate
from picotron.plan.memory_state import GiB
from picotron.plan.pipeline_sim import simulate
from picotron.plan.step_lanes import KINDS
from picotron.plan.step_time import layer_pass, predict, stage_times
from test_plan_cli import one_error_line

Figure = pytest.importorskip("matplotlib.figure").Figure      # explain's one requirement
ENGINES = {"afab": [], "1f1b": [], "interleaved": ["--set", "distributed.pp_virtual_stages=2"]}


@pytest.fixture
def pp2_config(tmp_path) -> str:
    """The debug model (4 layers) on pp 2 x dp 2, 4 micro-batches a step."""
    return create_config.main(["--out_dir", str(tmp_path), "--exp_name", "pp2", "--pp", "2",
                               "--dp", "2", "--grad_acc_steps", "4", "--mbs", "2"])


@pytest.fixture
def drawn(monkeypatch) -> list:
    """For each figure saved: {gid: [(x, width), ...]} of the timeline and of the memory axes."""
    figures, save = [], Figure.savefig

    def keep_bars(fig, *args, **kwargs):
        axes = []
        for ax in fig.axes[:2]:
            bars = {}
            for patch in ax.patches:
                if patch.get_gid():
                    bars.setdefault(patch.get_gid(), []).append(
                        (patch.get_x(), patch.get_width()))
            axes.append(bars)
        figures.append(axes)
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep_bars)
    return figures


def test_explain_writes_a_png_of_a_pp2_config(pp2_config, tmp_path, capsys):
    out = tmp_path / "pictures" / "step.png"
    main(["explain", pp2_config, "--hardware", "h200", "--out", str(out)])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "dp2 tp1 pp2 cp1 1f1b" in printed
    main(["explain", pp2_config, "--hardware", "h200"])            # beside the config
    assert (tmp_path / "pp2" / "step.png").is_file()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_lanes_are_the_simulated_pipeline(pp2_config, tmp_path, drawn, engine):
    argv = ["--set", f"distributed.pp_engine={engine}"] + ENGINES[engine]
    main(["explain", pp2_config, "--hardware", "h200", "--out", str(tmp_path / "s.png")]
         + argv)
    lanes, memory = drawn[-1]
    assert {gid.split(":")[1] for gid in lanes} <= set(KINDS) == {k for k, _, _ in LEGEND}
    profile = load_profile("h200")
    config = config_for_profile(pp2_config, profile, argv[1::2])
    d, micro = config.distributed, config.training.gradient_accumulation_steps
    layer_f, layer_b, _, _ = layer_pass(config, profile, Links(profile),
                                        layout_groups(config, profile, 8))
    forward, backward, v = stage_times(config, profile, layer_f, layer_b)
    assert v == (2 if engine == "interleaved" else 1)
    # a rank's compute does not depend on the send time: 0 here, the model's in explain
    sim = simulate(engine, d.pp_size, micro, v, forward, backward, 0.0)
    orders = schedule_orders(engine, d.pp_size, micro, v)
    prediction = predict(config, profile, 8)
    for rank in range(d.pp_size):
        passes = sorted((x, width, kind) for kind in ("forward", "backward")
                        for x, width in lanes[f"{rank}:{kind}"])
        assert len(passes) == len(orders[rank]) == 2 * micro * v
        busy_ms = sum(width for _, width, _ in passes)
        assert busy_ms == pytest.approx(1e3 * sim.busy_s[rank], rel=1e-9)
        assert [kind[0].upper() for _, _, kind in passes] == [a.kind for a in orders[rank]]
        ends = [x + width for bars in lanes.values() for x, width in bars]
        assert max(ends) == pytest.approx(1e3 * prediction.step_s, rel=1e-9)
        # beside the lane: the memory plan's estimate of that rank, held + peak
        gib = sum(width for key in ("held", "peak") for _, width in memory[f"{rank}:{key}"])
        assert gib == pytest.approx(rank_estimate(config, rank).device_bytes / GiB, rel=1e-9)


def test_a_missing_config_ends_in_one_line(tmp_path, capsys):
    err = one_error_line(capsys, ["explain", str(tmp_path / "nothing.json")])
    assert "does not exist" in err and "create_config.py" in err


def test_an_unknown_profile_lists_the_known_ones(pp2_config, capsys):
    err = one_error_line(capsys, ["explain", pp2_config, "--hardware", "h900"])
    assert "h900" in err and "h200" in err and "playbook-h100" in err


def test_without_matplotlib_it_says_how_to_install_it(pp2_config, tmp_path, monkeypatch,
                                                      capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # `import matplotlib` fails
    err = one_error_line(capsys, ["explain", pp2_config, "--out", str(tmp_path / "s.png")])
    assert "pip install matplotlib" in err and not (tmp_path / "s.png").exists()
