"""Checkpoints on 4 gloo ranks (tp=2 x pp=2), in one launch (tests/workers/checkpoint_ranks.py):
a run saving in the background writes the same files as one saving synchronously, and resuming
it continues the same run; a damaged file, whichever rank would read it and whichever rank
hashes it, is refused by every rank together with its name, and `latest` falls back on every
rank to the same checkpoint."""
import json
import os

import pytest
import torch

from checkpoint_helpers import content_of, same_content
from launch import ROOT, final_weights, launch_script, read_metrics, write_config
from workers.checkpoint_ranks import CASES

TINY = ["--num_hidden_layers", "2", "--seq_len", "32", "--set", "model.hidden_size=32",
        "--set", "model.intermediate_size=64", "--set", "model.num_attention_heads=4",
        "--set", "model.num_key_value_heads=2", "--set", "training.warmup_steps=2",
        "--tp", "2", "--pp", "2", "--mbs", "2", "--grad_acc_steps", "2",
        "--total_train_steps", "4", "--dataset_name", "synthetic",
        "--set", "checkpoint.save_frequency=2"]


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    async_run = write_config(root, "async", TINY + ["--set", "checkpoint.async_save=true"])
    sync_run = write_config(root, "sync", TINY)
    step2 = os.path.join(os.path.dirname(async_run), "checkpoints", "step_000002")
    resumed = write_config(root, "resumed", TINY + ["--set", "checkpoint.async_save=true",
                                                    "--set", f"checkpoint.load_path={step2}"])
    out = root / "out"
    os.makedirs(out)
    launch_script(os.path.join(ROOT, "tests", "workers", "checkpoint_ranks.py"), 4,
                  [out, async_run, sync_run, resumed], timeout=900)
    results = [json.load(open(out / f"result-rank{r}.json")) for r in range(4)]
    return async_run, sync_run, resumed, results


def test_async_saves_write_what_sync_saves_write_and_resume_exactly(ranks_run):
    async_run, sync_run, resumed, _ = ranks_run
    for step in ("step_000002", "step_000004"):
        a, s = (content_of(os.path.join(os.path.dirname(run), "checkpoints", step))
                for run in (async_run, sync_run))
        assert len(a) == 13                  # 4 weights, 4 optimizer, 4 RNG files, state.json
        assert a["state.json"]["config"]["checkpoint"].pop("async_save") is True
        assert s["state.json"]["config"]["checkpoint"].pop("async_save") is False
        assert same_content(a, s)
    straight = {r["step"]: r["loss"] for r in read_metrics(async_run) if "loss" in r}
    again = {r["step"]: r["loss"] for r in read_metrics(resumed) if "loss" in r}
    assert sorted(again) == [3, 4] and all(again[k] == straight[k] for k in again)
    wa, wr = final_weights(async_run), final_weights(resumed)
    assert sorted(wa) == sorted(wr) and all(torch.equal(wa[n], wr[n]) for n in wa)


@pytest.mark.parametrize("case", CASES)
def test_every_rank_refuses_a_damaged_file_together(ranks_run, case):
    said = [r[case] for r in ranks_run[3]]
    assert len(set(said)) == 1, said                   # the same on every rank
    if case.startswith("latest"):
        assert said[0] == "loaded step_000002"
    else:
        assert case.split()[0] in said[0] and "step_000004" in said[0], said[0]
