"""What a run leaves for a person to look at: metrics.jsonl in strict JSON, the same numbers
as TensorBoard scalars (`logging.tensorboard`), and plot.py's picture of one or more runs.

One real run (4 steps on CPU, synthetic tokens, validation every 2 steps) is trained in this
process and shared by the tests; a second, fake run is written through MetricsLog with the
values a real run rarely shows (a NaN loss, an infinite gradient norm, an MFU)."""
import json
import math
import os
import shutil
import sys

import numpy as np
import pytest

import create_config
import plot
import train
from picotron.config import Config, MissingPackage
from picotron.run.metrics_log import MetricsLog, finite_or_null


def strict_records(path) -> list:
    """Every line of a metrics.jsonl, parsed by a reader that refuses NaN and Infinity."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f if line.strip()]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    path = create_config.main([
        "--out_dir", str(root), "--exp_name", "real", "--use_cpu", "--total_train_steps", "4",
        "--mbs", "2", "--seq_len", "32", "--dataset_name", "synthetic",
        "--set", "training.val_frequency=2", "--set", "dataset.val_samples=4",
        "--set", "logging.tensorboard=true"])
    train.main(["--config", path])
    return os.path.dirname(path)


@pytest.fixture
def fake_gpu_run(tmp_path):
    """A run dir with 3 steps (step 2 non-finite) and one validation, as a GPU run logs."""
    config = Config()
    config.logging.tensorboard = True
    log = MetricsLog(str(tmp_path / "gpu" / "metrics.jsonl"), True, config)
    for step, loss, norm in ((1, 5.0, 1.0), (2, math.nan, math.inf), (3, 4.0, 0.5)):
        log.write({"step": step, "loss": loss, "lr": 1e-3, "grad_norm": norm,
                   "tokens": 1024 * step, "tokens_per_s": 5e4 + step, "mfu": 0.4 + step / 100,
                   "skipped": not math.isfinite(norm)})
    log.write({"step": 3, "val_loss": 4.5})
    return str(tmp_path / "gpu")


def test_metrics_are_strict_json_with_null_for_non_finite(real_run, fake_gpu_run):
    records = strict_records(os.path.join(real_run, "metrics.jsonl"))
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    fake = strict_records(os.path.join(fake_gpu_run, "metrics.jsonl"))
    assert fake[1]["loss"] is None and fake[1]["grad_norm"] is None and fake[1]["skipped"]
    assert fake[0]["loss"] == 5.0 and fake[2]["grad_norm"] == 0.5
    # at any depth, so that no record can make the strict writer raise mid-run
    assert finite_or_null({"a": [1.0, math.inf], "b": {"c": -math.inf, "d": math.nan}}) == {
        "a": [1.0, None], "b": {"c": None, "d": None}}


def tensorboard_scalars(run_dir) -> dict:
    """{tag: {step: value}} read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("which", ["real", "fake"])
def test_tensorboard_holds_every_number_of_metrics_jsonl(real_run, fake_gpu_run, which):
    """Every number of the file is a scalar of the same name at the same step (float32, as
    TensorBoard stores it); a null of the file (not finite, or not measured) is either a
    non-finite scalar or none at all. Nothing else is in the event files."""
    run_dir = real_run if which == "real" else fake_gpu_run
    scalars = tensorboard_scalars(run_dir)
    numbers, nulls = {}, set()
    for record in strict_records(os.path.join(run_dir, "metrics.jsonl")):
        for name, value in record.items():
            if value is None:
                nulls.add((name, record["step"]))
            elif name != "step" and not isinstance(value, (bool, str)):
                numbers.setdefault(name, {})[record["step"]] = value
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= set(numbers)
    for name, by_step in numbers.items():
        for step, value in by_step.items():
            assert scalars[name][step] == np.float32(value), (name, step, value)
    for name, by_step in scalars.items():
        for step, got in by_step.items():
            assert step in numbers.get(name, {}) or (
                (name, step) in nulls and not math.isfinite(got)), (name, step, got)
    if which == "fake":                  # the NaN loss and infinite norm reached TensorBoard
        assert math.isnan(scalars["loss"][2]) and math.isinf(scalars["grad_norm"][2])
        assert "mfu" in scalars


def test_a_resume_replaces_the_steps_it_writes_again_in_both(tmp_path):
    """A run resumed at step 2 keeps steps 1-2 and writes 3-5 anew: metrics.jsonl drops the
    old 3-4, and TensorBoard hides them (purge_step), so neither shows two values for a step."""
    config = Config()
    config.logging.tensorboard = True
    path = str(tmp_path / "metrics.jsonl")
    first = MetricsLog(path, True, config)
    for step in range(1, 5):
        first.write({"step": step, "loss": float(step)})
    first.tensorboard.close()
    resumed = MetricsLog(path, True, config, keep_until_step=2)
    for step in range(3, 6):
        resumed.write({"step": step, "loss": 10.0 + step})
    expected = {1: 1.0, 2: 2.0, 3: 13.0, 4: 14.0, 5: 15.0}
    assert {r["step"]: r["loss"] for r in strict_records(path)} == expected
    assert tensorboard_scalars(str(tmp_path))["loss"] == expected


def test_a_write_that_fails_warns_once_and_training_goes_on(tmp_path, capsys):
    """A run directory deleted mid-run (or a full disk): one warning per output, no traceback
    (tensorboard's writer thread included), the later records dropped; a resume over the gap
    says which steps have no record."""
    config = Config()
    config.logging.tensorboard = True
    run = tmp_path / "run"
    run.mkdir()
    path = str(run / "metrics.jsonl")
    log = MetricsLog(path, True, config)
    log.write({"step": 1, "loss": 1.0})
    shutil.rmtree(run)
    for step in (2, 3, 4):
        log.write({"step": step, "loss": float(step)})
    err = capsys.readouterr().err
    assert err.count("warning: cannot write") == 2 and "Traceback" not in err, err
    assert f"{path} at step 2" in err and "tensorboard at step 2" in err
    run.mkdir()
    with open(path, "w") as f:
        f.writelines(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 5, 6))
    MetricsLog(path, True, Config(), keep_until_step=8)
    assert "holds no record of steps 2-4, 7-8" in capsys.readouterr().err


def test_tensorboard_missing_is_named_with_its_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)    # not importable
    config = Config()
    config.logging.tensorboard = True
    with pytest.raises(MissingPackage, match=r"logging.tensorboard=true needs tensorboard "
                                             r"\(`pip install tensorboard`\).*set it to false"):
        MetricsLog(str(tmp_path / "metrics.jsonl"), True, config)
    MetricsLog(str(tmp_path / "metrics.jsonl"), True, Config())        # off: not imported
    assert not os.path.exists(tmp_path / "tensorboard")
    # train.py says so before it builds anything (minutes for a large model)
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "tb", "--use_cpu",
                               "--set", "logging.tensorboard=true"])
    monkeypatch.setattr(train, "build_training", lambda *a: pytest.fail("built first"))
    with pytest.raises(MissingPackage, match="logging.tensorboard=true needs tensorboard"):
        train.main(["--config", path])


def test_plot_draws_two_runs_at_the_asked_size(real_run, fake_gpu_run, tmp_path, capsys):
    from matplotlib.image import imread
    out = str(tmp_path / "pictures" / "both.png")
    assert plot.main([real_run, os.path.join(fake_gpu_run, "metrics.jsonl"), "--out", out,
                      "--size", "900x300"]) == out
    assert capsys.readouterr().out.strip() == out
    pixels = imread(out)
    assert pixels.shape[:2] == (300, 900)
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 50                 # lines, text and legends, not a blank canvas
    assert plot.labels_of([real_run, fake_gpu_run]) == ["real", "gpu"]


def test_plot_refuses_what_it_cannot_draw(tmp_path, monkeypatch, capsys, fake_gpu_run):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [([str(empty)], "has no metrics.jsonl"),
             ([str(tmp_path / "nowhere")], "is not a directory"),
             ([fake_gpu_run, "--size", "big"], "must be WIDTHxHEIGHT")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            plot.main(argv + ["--out", str(tmp_path / "x.png")])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv
    (empty / "metrics.jsonl").write_text('{"step": 2, "val_loss": 3.0}\n')
    with pytest.raises(plot.PlotError, match="no training step yet"):
        plot.plot([str(empty)], str(tmp_path / "x.png"))
    (empty / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    with pytest.raises(plot.PlotError, match="step records without tokens, tokens_per_s"):
        plot.plot([str(empty)], str(tmp_path / "x.png"))
    (empty / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0\n{"step": 2}\n')
    with pytest.raises(plot.PlotError, match=r"metrics.jsonl:1 is not JSON"):
        plot.plot([str(empty)], str(tmp_path / "x.png"))
    for line, message in (('[1, 2]', "is a JSON list"), ('{"step": 1, "loss": "low", '
                          '"tokens": 1, "tokens_per_s": 1}', "loss must be numbers, got 'low'")):
        (empty / "metrics.jsonl").write_text(line + "\n")
        with pytest.raises(plot.PlotError, match=message):
            plot.plot([str(empty)], str(tmp_path / "x.png"))
    for out, message in (("x.nope", "cannot write '.nope' files"), ("", "is a folder")):
        with pytest.raises(plot.PlotError, match=message):
            plot.plot([fake_gpu_run], str(tmp_path / out))
    assert plot.plot([fake_gpu_run], str(tmp_path / "bare")) == str(tmp_path / "bare.png")
    assert os.path.isfile(tmp_path / "bare.png")            # the path printed is the file's
    monkeypatch.setitem(sys.modules, "matplotlib", None)               # not installed
    with pytest.raises(plot.PlotError, match=r"`pip install matplotlib`"):
        plot.plot([fake_gpu_run], str(tmp_path / "x.png"))
    assert not os.path.exists(tmp_path / "x.png")


def test_plot_drops_a_half_written_last_line_and_names_what_is_no_metrics(fake_gpu_run,
                                                                          tmp_path, capsys):
    """A run killed (or still) writing leaves half a last line: dropped with a warning, as
    train.py's resume does. A file that is not text, or a record without a step, is refused
    by name, never with a traceback."""
    metrics = os.path.join(fake_gpu_run, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 4, "loss": 3.')
    out = str(tmp_path / "x.png")
    assert plot.main([fake_gpu_run, "--out", out]) == out
    assert capsys.readouterr().err == (f"warning: {metrics}:5: dropped the last line, which "
                                       f"is not whole JSON (a run killed while writing it, "
                                       f"or still writing)\n")
    assert [r["step"] for r in plot.read_metrics(fake_gpu_run)[0]] == [1, 2, 3]
    for body, words in ((b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not text"),
                        (b'{"step": 1, "loss": 3.0, "tokens": 1, "tokens_per_s": 1}\n'
                         b'{"val_loss": 2.5}\n', ':2: a record without "step"')):
        with open(metrics, "wb") as f:
            f.write(body)
        with pytest.raises(SystemExit) as exit_:
            plot.main([fake_gpu_run, "--out", out])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err and "Traceback" not in err, err
