"""plot.py as a user meets it: where the picture goes without `--out` (beside the run when one
is plotted, in the current folder for several), and panels that say what the runs measured (a
run on CPU reports no MFU: no empty MFU panel, and its throughput is its processes', not GPUs').

The runs are metrics.jsonl files written here, as train.py writes them (a CPU run's mfu is
null); the figure is read where plot.py saves it."""
import json
import os

import pytest

import plot

Figure = pytest.importorskip("matplotlib.figure").Figure      # plot.py's one requirement


def write_run(folder, mfu) -> str:
    """A run directory of 3 steps; `mfu` None as a run on CPU logs it."""
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 5.0 - step, "tokens": 1024 * step,
                                "tokens_per_s": 900.0 + step, "mfu": mfu}) + "\n")
    return str(folder)


@pytest.fixture
def saved(monkeypatch) -> list:
    """(title, y label) of each panel of every figure plot.py saves."""
    figures, save = [], Figure.savefig

    def keep_panels(fig, *args, **kwargs):
        figures.append([(ax.get_title(), ax.get_ylabel()) for ax in fig.axes])
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep_panels)
    return figures


def test_one_run_is_drawn_beside_it(tmp_path, monkeypatch, capsys):
    run = write_run(tmp_path / "runs" / "debug", mfu=None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    beside = os.path.join(run, "metrics.png")
    assert plot.main([run]) == beside
    assert capsys.readouterr().out == beside + "\n"              # the path written, printed
    assert os.path.isfile(beside) and not os.listdir(elsewhere)
    os.remove(beside)                                      # a metrics.jsonl: beside it too
    assert plot.main([os.path.join(run, "metrics.jsonl")]) == beside
    assert os.path.isfile(beside)


def test_several_runs_are_drawn_in_the_current_folder_and_out_wins(tmp_path, monkeypatch,
                                                                  capsys):
    runs = [write_run(tmp_path / name, mfu=None) for name in ("dp2", "tp2")]
    monkeypatch.chdir(tmp_path)
    assert plot.main(runs) == "metrics.png"
    assert capsys.readouterr().out == "metrics.png\n" and os.path.isfile("metrics.png")
    out = str(tmp_path / "pictures" / "one.png")
    assert plot.main(runs[:1] + ["--out", out]) == out
    assert os.path.isfile(out) and not os.path.exists(os.path.join(runs[0], "metrics.png"))


@pytest.mark.parametrize("mfus,panels", [
    ([None], [("loss", "loss"), ("throughput", "tokens/s (all processes)")]),
    ([0.4], [("loss", "loss"), ("throughput", "tokens/s (all GPUs)"),
             ("model FLOPs utilization", "MFU (%)")]),
    ([None, 0.4], [("loss", "loss"), ("throughput", "tokens/s (all processes)"),
                   ("model FLOPs utilization", "MFU (%)")]),
])
def test_a_panel_no_run_has_numbers_for_is_left_out(tmp_path, saved, mfus, panels):
    """CPU runs: two panels, throughput over processes; with a GPU run, its MFU is drawn."""
    runs = [write_run(tmp_path / f"run{i}", mfu=mfu) for i, mfu in enumerate(mfus)]
    plot.main(runs + ["--out", str(tmp_path / "x.png")])
    assert saved == [panels]


def test_a_run_with_no_number_to_draw_is_refused(tmp_path):
    """Every loss and tokens/s null (a hand-made file): said, not an empty figure."""
    run = tmp_path / "nulls"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": null, "tokens": 8, '
                                       '"tokens_per_s": null}\n')
    with pytest.raises(plot.PlotError, match="nothing to draw"):
        plot.plot([str(run)], str(tmp_path / "x.png"))
    assert not os.path.exists(tmp_path / "x.png")
