"""`python -m picotron.plan search | score` (picotron/plan/__main__.py): score keeps every CSV
column and gives a refused row the config's reason, and a row past the memory its reason and
how it is timed; it reads a row without a setting as the profile's trainer ran it; bad input
ends in one line naming the fix (missing columns all named, a row that is not a layout, an
unknown profile, a model not found)."""
import csv
import os
import subprocess
import sys

import pytest

from picotron.errors import ConfigError
from picotron.plan.__main__ import build_parser, main, run_search
from picotron.plan.hardware import load_profile
from picotron.plan.layouts import LAYOUT_COLUMNS, config_for
from picotron.plan.score import PRED_COLUMNS
from picotron.plan.step_time import predict

CALIBRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                           "planner_data", "calibration.csv")

ROW = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
       "tied": 0, "seq": 64, "gpus": 4, "gpus_per_node": 8, "dp": 2, "tp": 2, "pp": 1, "cp": 1,
       "zero": 1, "mbs": 2, "grad_acc": 1}


def write_csv(path, rows, columns=None):
    columns = columns or list(rows[0])
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def one_error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_score_keeps_every_column_and_refused_rows_carry_the_configs_reason(tmp_path, capsys):
    refused = {**ROW, "tp": 3, "dp": 1, "gpus": 3, "note": "three"}     # 4 heads over tp 3
    rows = [{**ROW, "note": "first", "recompute": "full"}, refused]
    write_csv(tmp_path / "in.csv", rows, ["note"] + LAYOUT_COLUMNS + ["recompute"])
    main(["score", "--layouts", str(tmp_path / "in.csv"), "--hardware", "h200",
          "--out", str(tmp_path / "out.csv")])
    with open(tmp_path / "out.csv", newline="") as f:
        reader = csv.DictReader(f)
        out = list(reader)
    assert reader.fieldnames == ["note"] + LAYOUT_COLUMNS + ["recompute"] + list(PRED_COLUMNS)
    assert [r["note"] for r in out] == ["first", "three"]
    assert out[0]["recompute"] == "full" and out[0]["pred_fits"] == "1"
    assert float(out[0]["pred_tok_s_gpu"]) > 0 and float(out[0]["pred_mem_gib"]) > 0
    assert out[1]["pred_fits"] == "0" and out[1]["pred_tok_s_gpu"] == ""
    with pytest.raises(ConfigError) as error:
        config_for(refused)
    assert "num_attention_heads=4 is not divisible by tp_size=3" in out[1]["pred_note"]
    every = [line.strip()[2:] for line in str(error.value).splitlines()[1:]]
    assert out[1]["pred_note"] == "; ".join(every) and len(every) == 3


def test_a_row_past_the_memory_says_why_and_how_it_is_timed(tmp_path, capsys):
    # Llama-3-8B's shape on 32 GPUs of the playbook-h100 profile: dp4 tp2 pp4 mbs4 needs more
    # than an H100 (the Playbook ran it: 1,374 tokens/s, 77 GB); dp8 tp2 pp2 mbs1 fits
    big = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=14336, vocab=131072, tied=0,
               seq=4096, gpus=32, gpus_per_node=8, tp=2, cp=1, zero=1)
    rows = [dict(big, dp=4, pp=4, mbs=4, grad_acc=16), dict(big, dp=8, pp=2, mbs=1, grad_acc=32)]
    write_csv(tmp_path / "in.csv", rows)
    main(["score", "--layouts", str(tmp_path / "in.csv"), "--hardware", "playbook-h100",
          "--out", str(tmp_path / "out.csv")])
    with open(tmp_path / "out.csv", newline="") as f:
        past, fits = list(csv.DictReader(f))
    assert past["pred_fits"] == "0" and fits["pred_fits"] == "1" and fits["pred_note"] == ""
    assert "GiB per GPU" in past["pred_note"] and "over_memory_speed" in past["pred_note"]
    assert float(past["pred_tok_s_gpu"]) > 0


def test_score_reads_the_playbooks_runs_as_nanotron_ran_them(tmp_path, capsys):
    # the Playbook's rows at tp 2-8, with the layout columns alone: nanotron ran its tensor
    # parallelism in REDUCE_SCATTER mode, sequence parallelism (playbook-h100's trait
    # layout_defaults), as the calibration report reads them; this project's default is off
    with open(CALIBRATION, newline="") as f:
        runs = [r for r in csv.DictReader(f) if int(r["tp"]) in (2, 4, 8)]
    rows = runs[::len(runs) // 12][:12]
    assert {r["model"] for r in rows} == {"1B", "8B"}
    profile = load_profile("playbook-h100")
    told = {"off": "false", "blank": ""}          # a blank cell sets nothing
    scored = {}
    for name in ("plain", "off", "blank"):
        table = [dict(r, **{"distributed.sequence_parallel": told.get(name)}) for r in rows]
        write_csv(tmp_path / f"{name}.csv", table,
                  LAYOUT_COLUMNS + (["distributed.sequence_parallel"] if name in told else []))
        main(["score", "--layouts", str(tmp_path / f"{name}.csv"), "--hardware",
              "playbook-h100", "--out", str(tmp_path / f"{name}_out.csv")])
        with open(tmp_path / f"{name}_out.csv", newline="") as f:
            scored[name] = list(csv.DictReader(f))
    for row, plain, off, blank in zip(rows, scored["plain"], scored["off"], scored["blank"]):
        for out, parallel in ((plain, True), (blank, True), (off, False)):   # a cell given wins
            want = predict(config_for(dict(row, **{"distributed.sequence_parallel": parallel})),
                           profile, 8)
            assert float(out["pred_tok_s_gpu"]) == pytest.approx(want.tok_s_gpu, abs=0.06)
            assert float(out["pred_mem_gib"]) == pytest.approx(want.mem_gib, rel=1e-3)
        # unsharded norms and residuals: more memory on every one of these rows
        assert float(off["pred_mem_gib"]) > float(plain["pred_mem_gib"])


def test_a_csv_missing_columns_names_them_all(tmp_path, capsys):
    columns = [c for c in LAYOUT_COLUMNS if c not in ("tp", "grad_acc")]
    write_csv(tmp_path / "in.csv", [ROW], columns)
    err = one_error_line(capsys, ["score", "--layouts", str(tmp_path / "in.csv"),
                                  "--out", str(tmp_path / "out.csv")])
    assert "tp, grad_acc" in err and not (tmp_path / "out.csv").exists()


def test_a_row_that_is_not_a_layout(tmp_path, capsys):
    write_csv(tmp_path / "in.csv", [ROW, {**ROW, "mbs": "two"}])
    err = one_error_line(capsys, ["score", "--layouts", str(tmp_path / "in.csv"),
                                  "--out", str(tmp_path / "out.csv")])
    assert "line 3 is not a layout" in err and "'mbs'" in err


def test_tied_reads_one_and_zero_or_true_and_false(tmp_path, capsys):
    rows = [{**ROW, "tied": tied} for tied in (1, "true", "TRUE", 0, "false")]
    write_csv(tmp_path / "in.csv", rows)
    main(["score", "--layouts", str(tmp_path / "in.csv"), "--hardware", "h200",
          "--out", str(tmp_path / "out.csv")])
    with open(tmp_path / "out.csv", newline="") as f:
        memory = [r["pred_mem_gib"] for r in csv.DictReader(f)]
    assert memory[0] == memory[1] == memory[2] != memory[3] == memory[4]
    write_csv(tmp_path / "in.csv", [ROW, {**ROW, "tied": "yes"}])
    err = one_error_line(capsys, ["score", "--layouts", str(tmp_path / "in.csv"),
                                  "--out", str(tmp_path / "out.csv")])
    assert "line 3 is not a layout" in err and "'tied'" in err


def test_a_row_whose_batch_contradicts_itself_is_not_scored(tmp_path, capsys):
    # gbs (sequences a step), where a table states it, must be dp x mbs x grad_acc (2 x 2 x 1)
    rows = [{**ROW, "gbs": 4}, {**ROW, "gbs": 256}, {**ROW, "gbs": ""}]
    write_csv(tmp_path / "in.csv", rows)
    main(["score", "--layouts", str(tmp_path / "in.csv"), "--hardware", "h200",
          "--out", str(tmp_path / "out.csv")])
    with open(tmp_path / "out.csv", newline="") as f:
        agrees, contradicts, blank = list(csv.DictReader(f))
    assert agrees["pred_fits"] == blank["pred_fits"] == "1" and agrees["pred_note"] == ""
    assert contradicts["pred_fits"] == "0" and contradicts["pred_tok_s_gpu"] == ""
    assert "dp x mbs x grad_acc = 4 sequences, gbs = 256" in contradicts["pred_note"]


def test_an_unknown_profile_lists_the_known_ones(tmp_path, capsys):
    write_csv(tmp_path / "in.csv", [ROW])
    err = one_error_line(capsys, ["score", "--layouts", str(tmp_path / "in.csv"),
                                  "--hardware", "h900", "--out", str(tmp_path / "o.csv")])
    assert "h900" in err and "h200" in err and "playbook-h100" in err


def test_a_model_name_not_found(capsys):
    err = one_error_line(capsys, ["search", "--model_name", "smollm-135m", "--gpus", "2",
                                  "--seq_len", "64", "--global_batch_tokens", "256"])
    assert "did you mean 'SmolLM-135M'" in err


def test_search_prints_the_table_and_the_refusals(capsys):
    main(["search", "--model_name", "debug", "--gpus", "4", "--seq_len", "64",
          "--global_batch_tokens", "512", "--hardware", "h200", "--top", "3"])
    out = capsys.readouterr().out
    assert "tok/s/GPU" in out and "\n1* " in out and "\n3* " in out and "\n4" not in out
    assert "layouts fit;" in out and "refused" in out
    # h200's runs are one GPU's: every layout of 4 is beyond them, and the report says so
    assert "\n* " in out and "h200 profile was fit to" in out


SEARCH_4 = ["search", "--model_name", "debug", "--gpus", "4", "--seq_len", "64",
            "--global_batch_tokens", "512", "--hardware", "h200"]


def test_a_layout_knob_given_by_set_stays_fixed_and_one_set_to_auto_is_searched(capsys):
    every = run_search(build_parser().parse_args(SEARCH_4))
    fixed = run_search(build_parser().parse_args(SEARCH_4 + [
        "--set", "distributed.tp_size=2", "--set", "training.fp8=none",
        "--set", "training.activation_checkpointing=auto"]))
    assert "tokens a step, tp 2, fp8 none\n" in capsys.readouterr().out

    def rows(ranked):
        return sorted(repr((s.layout, s.prediction.tok_s_gpu, s.prediction.mem_gib))
                      for s in ranked)
    # exactly the unfixed search's layouts with those values, every recomputation among them
    want = [s for s in every.ranked if s.layout["tp"] == 2 and s.layout["fp8"] == "none"]
    assert want and rows(fixed.ranked) == rows(want)
    assert len({s.layout["recompute"] for s in fixed.ranked}) == 3


def test_fixed_sizes_that_no_grid_of_the_gpus_has_end_in_one_line(capsys):
    err = one_error_line(capsys, SEARCH_4 + ["--set", "distributed.tp_size=3"])
    assert "no layout of 4 GPUs has tp=3" in err and "divide" in err


def test_a_searchs_csv_scores_back_to_its_predictions(tmp_path, capsys):
    # under playbook-h100, whose trait layout_defaults reads a row without the column
    # distributed.sequence_parallel as nanotron ran it (on): the search's own value (off,
    # this project's default) must travel in the file, with every other setting it searched
    found, scored = str(tmp_path / "all.csv"), str(tmp_path / "again.csv")
    argv = SEARCH_4[:-1] + ["playbook-h100", "--set", "distributed.grad_reduce_dtype=bfloat16"]
    result = run_search(build_parser().parse_args(argv + ["--out", found]))
    main(["score", "--layouts", found, "--hardware", "playbook-h100", "--out", scored])
    with open(found) as f:
        rows = list(csv.DictReader(f))
    with open(scored) as f:
        again = list(csv.DictReader(f))
    assert len(rows) == len(result.ranked) > 100 and len(again) == len(rows)
    assert {row["distributed.sequence_parallel"] for row in rows} == {"false"}
    assert {row["distributed.grad_reduce_dtype"] for row in rows} == {"bfloat16"}
    assert {(row["tp"], row["pp_engine"]) for row in rows} >= {("2", "1f1b"), ("1", "afab")}
    for row, back, s in zip(rows, again, result.ranked):
        assert float(row["pred_tok_s_gpu"]) == round(s.prediction.tok_s_gpu, 1)
        assert [back[c] for c in PRED_COLUMNS] == [row[c] for c in PRED_COLUMNS]


@pytest.mark.parametrize("command", ["search", "score"])
def test_an_out_path_that_cannot_be_written_ends_in_one_line(tmp_path, capsys, command):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = str(blocker / "x.csv")                 # a folder inside a file
    if command == "search":
        argv = SEARCH_4 + ["--out", out]
    else:
        layouts = str(tmp_path / "in.csv")
        write_csv(layouts, [ROW])
        argv = ["score", "--layouts", layouts, "--hardware", "h200", "--out", out]
    err = one_error_line(capsys, argv)
    assert "cannot write --out" in err and "choose a path" in err


def test_a_reader_that_stops_early_gets_no_traceback():
    # `search ... | head`: 2,000 rows are far more than a pipe holds, so the search writes
    # into a pipe already closed
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "picotron.plan"] + SEARCH_4[:3] + [
        "--gpus", "8", "--seq_len", "64", "--global_batch_tokens", "4096", "--top", "2000"],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"debug on 8 GPUs")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and err == "", err
