"""Data: every local format loads to the same stream, DP ranks split each epoch exactly
(on gloo, tokenized once), the order is fixed by the seed, and a resume continues it."""
import collections
import json
import os

import pytest
import torch

from launch import ROOT, launch_script, write_config
from tiny import documents, tiny_tokenizer, write_formats
from picotron.config import Config
from picotron.data.windows import (DataError, StepBatches, SyntheticData, build_data,
                                   build_train_val, data_state, micro_batch)
from picotron.process_group_manager import ProcessGroupManager

SEQ = 32
ONE_PROCESS = ProcessGroupManager()       # dp 1: a step's whole batch


def config_for(name: str, **training) -> Config:
    c = Config()
    c.dataset.name, c.training.seq_length = name, SEQ
    for k, v in training.items():
        setattr(c.training, k, v)
    return c


def step_windows(data, config, step: int) -> list:
    """Every window of a step's global batch, in global-index order (one process, dp=1)."""
    out = []
    for micro in range(config.training.gradient_accumulation_steps):
        x, y = micro_batch(data, step, micro, config, ONE_PROCESS)
        out += torch.cat([x, y[:, -1:]], dim=1).tolist()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_formats(documents(40), str(tmp_path_factory.mktemp("formats")))


def test_every_local_format_loads_the_same_stream_with_eos_between_documents(files):
    docs = documents(40)
    expected = torch.tensor([b for d in docs for b in list(d.encode()) + [0]])   # byte EOS 0
    for fmt in ("txt", "jsonl", "json", "parquet", "arrow", "saved", "folder"):
        data = build_data(config_for(files[fmt]))
        assert torch.equal(data.tokens.long(), expected), fmt
        assert data.num_windows == len(expected) // (SEQ + 1)


def test_hf_tokenizer_puts_its_eos_after_each_document(files, tmp_path):
    from transformers import AutoTokenizer
    docs = documents(40)
    path = tiny_tokenizer(str(tmp_path / "tok"), docs)
    c = config_for(files["jsonl"])
    c.dataset.tokenizer, c.model.vocab_size = path, 300
    tok = AutoTokenizer.from_pretrained(path)
    expected = [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] +
                [tok.eos_token_id]]
    assert build_data(c).tokens.tolist() == expected
    c.model.vocab_size = len(tok) - 1
    with pytest.raises(DataError, match=f"model.vocab_size={len(tok) - 1}"):
        build_data(c)


def test_validation_is_held_out_or_read_from_its_split(files):
    c = config_for(files["jsonl"])
    c.dataset.val_samples = 3
    train, val = build_train_val(c)
    n = train.num_windows
    held = {tuple(val.window(i).tolist()) for i in range(3)}
    seen = {tuple(train.window(i).tolist()) for i in range(n)}
    assert len(held) == 3 and not held & seen                 # carved off, never trained on
    assert n + 3 == len(train.tokens) // (SEQ + 1)
    c = config_for(files["folder"])
    c.dataset.val_split, c.dataset.val_samples = "validation", 2
    train, val = build_train_val(c)
    first_docs = torch.tensor([b for d in documents(4) for b in list(d.encode()) + [0]])
    assert torch.equal(val.window(0), first_docs[:SEQ + 1].long())


def test_bad_dataset_settings_name_the_problem(files, tmp_path):
    with pytest.raises(DataError, match="nothing exists there"):
        build_data(config_for(str(tmp_path / "missing.jsonl")))
    c = config_for(files["jsonl"])
    c.dataset.text_column = "body"
    with pytest.raises(DataError, match=r"no column 'body'.*\['text', 'id'\]"):
        build_data(c)
    c = config_for(files["folder"])
    c.dataset.split = "test"
    with pytest.raises(DataError, match=r"no split 'test'.*'train', 'validation'"):
        build_data(c)
    c = config_for(files["jsonl"])
    c.dataset.val_samples = 10_000
    with pytest.raises(DataError, match="val_samples=10000"):
        build_train_val(c)


BAD_FILES = {   # file name, its bytes, what the error says
    "empty": ("empty.jsonl", b"", "empty.jsonl is empty: no rows could be read"),
    "empty text": ("empty.txt", b"", "empty.txt is empty: no rows could be read"),
    "not utf-8": ("latin.txt", "caf\u00e9\n".encode("latin-1"), "latin.txt is not UTF-8"),
    "broken json": ("broken.jsonl", b'{"text": "a"}\n{"text": \n',
                    "broken.jsonl line 2 is not JSON"),
    # past the first rows that a first look reads: found after the loader failed
    "broken late": ("late.jsonl", b'{"text": "a"}\n' * 150 + b"not json\n",
                    "late.jsonl line 151 is not JSON"),
    "numbers": ("numbers.jsonl", b'{"text": 5}\n{"text": 7}\n', "holds int64, not text"),
    "some numbers": ("mixed.jsonl", b'{"text": "a"}\n{"text": 5}\n',
                     "holds text in some rows but int 5 in row 2; make every row's 'text' a "
                     "string"),
    "nulls": ("nulls.jsonl", b'{"text": null}\n{"text": null}\n', "null in every row"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_local_file_is_named_with_what_is_wrong_in_it(tmp_path, case, capfd):
    name, body, reason = BAD_FILES[case]
    (tmp_path / name).write_bytes(body)
    with pytest.raises(DataError) as e:
        build_data(config_for(str(tmp_path / name)))
    assert reason in str(e.value), str(e.value)
    assert "give an existing local path" not in str(e.value)    # the file does exist
    assert "Error" not in str(e.value)           # no library's class name: plain words
    assert "Failed to load JSON" not in capfd.readouterr().err   # one message, not two


def test_rows_without_text_are_counted_once(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    text = "one document, long enough for a window of tokens"
    rows.write_text(json.dumps({"text": text}) + '\n{"body": "x"}\n{"text": null}\n'
                    '{"text": ""}\n')
    assert len(build_data(config_for(str(rows))).tokens) == len(text) + 1
    out = capsys.readouterr().out
    assert ("tokenized 4 documents of " in out and "(3 of them without text: missing, null or "
            "empty, left out)" in out), out


def test_a_folder_that_is_no_dataset_says_why_in_plain_words(tmp_path):
    folder = tmp_path / "schema"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "a document"}\n')
    (folder / "b.jsonl").write_text('{"text": "another", "id": 1}\n')
    for name in (str(folder), str(folder / "*.jsonl")):
        with pytest.raises(DataError, match=r"b.jsonl has columns that a.jsonl, the first file "
                                            r"read, lacks \(id; a.jsonl has text\)"):
            build_data(config_for(name))
    # the other column past the rows a first look reads: found after the loader failed
    (folder / "b.jsonl").write_text('{"text": "x"}\n' * 150 + '{"text": "y", "id": 1}\n')
    with pytest.raises(DataError, match=r"b.jsonl has columns that a.jsonl, the first file read, "
                                        r"lacks \(id; a.jsonl has text\)"):
        build_data(config_for(str(folder)))
    (folder / "a.jsonl").unlink()
    (folder / "b.jsonl").unlink()
    with pytest.raises(DataError, match="holds no data files \\(it is empty\\)"):
        build_data(config_for(str(folder)))
    (folder / "README.md").write_text("# a corpus\n")
    with pytest.raises(DataError, match="holds no data files \\(it holds only README.md\\)"):
        build_data(config_for(str(folder)))
    # a folder's configurations are its README's (one, 'default', here): another is named
    (folder / "a.jsonl").write_text('{"text": "a document"}\n' * 40)
    config = config_for(str(folder))
    config.dataset.subset_name = "foo"
    with pytest.raises(DataError, match="dataset.subset_name names no configuration of it "
                                        ".*'foo'.*set dataset.subset_name to one of those"):
        build_data(config)


def test_a_folder_and_a_glob_over_it_are_not_the_same_data(tmp_path):
    """A folder's files are split by name, a glob reads them all as 'train': the token cache
    keeps them apart (else the folder's test split would be trained on)."""
    docs = documents(40)
    folder = tmp_path / "splits"
    folder.mkdir()
    for name, part in (("train.jsonl", docs[:30]), ("test.jsonl", docs[30:])):
        (folder / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    everything = build_data(config_for(str(folder / "*"))).tokens
    train_only = build_data(config_for(str(folder))).tokens
    assert len(train_only) == sum(len(d.encode()) + 1 for d in docs[:30])
    assert len(everything) == sum(len(d.encode()) + 1 for d in docs)
    (folder / "notes.txt").write_text("a text file among json lines\n")
    with pytest.raises(DataError, match="holds data files of 2 formats"):
        build_data(config_for(str(folder)))


def test_a_file_edited_in_place_is_another_run_to_a_resume(tmp_path):
    """Same size, same number of windows, other tokens: the stream's sha256 tells them apart
    (a rewrite of the same text does not)."""
    import time
    from picotron.checkpoint.changes import run_changes
    path = tmp_path / "docs.txt"
    path.write_text("alpha beta gamma\n" * 200)
    c = config_for(str(path))
    before = build_data(c)
    time.sleep(0.01)                               # another modification time: a cache miss
    path.write_text("alpha beta gamma\n" * 200)
    assert build_data(c).contents == before.contents
    path.write_text("gamma beta alpha\n" * 200)
    after = build_data(c)
    assert after.num_windows == before.num_windows and after.contents != before.contents
    assert list(run_changes(c, c, before.num_windows, after.num_windows, before.contents,
                            after.contents)) == ["dataset.contents"]
    assert data_state(c, 1, after)["contents"] == after.contents     # what a checkpoint keeps


def test_subset_name_on_local_files_is_said_to_be_ignored(files, capsys):
    c = config_for(files["jsonl"])
    c.dataset.subset_name = "en"
    build_data(c)
    assert "dataset.subset_name='en' is ignored" in capsys.readouterr().err


def test_the_seed_fixes_the_order_and_each_epoch_reshuffles(files):
    a, b = build_data(config_for(files["jsonl"])), build_data(config_for(files["jsonl"]))
    n = a.num_windows
    order = [a.window(i).tolist() for i in range(2 * n)]
    assert order == [b.window(i).tolist() for i in range(2 * n)]
    assert order[:n] != order[n:] and sorted(order[:n]) == sorted(order[n:])
    other = build_data(config_for(files["jsonl"], seed=7))
    assert [other.window(i).tolist() for i in range(n)] != order[:n]


def test_resume_from_a_saved_data_position_yields_the_next_windows(files):
    c = config_for(files["jsonl"], micro_batch_size=3, gradient_accumulation_steps=2)
    data = build_data(c)                           # G = 6 does not divide the epoch: the
    steps = 2 * data.num_windows // 6 + 1          # boundary falls inside a step
    straight = [step_windows(data, c, s) for s in range(steps)]
    stop = steps // 2
    state = json.loads(json.dumps(data_state(c, stop, data)))      # as stored in state.json
    fresh = build_data(c)                                          # a new process
    assert state["next_sample"] == stop * 6 and state["num_windows"] == fresh.num_windows
    assert [step_windows(fresh, c, s) for s in range(stop, steps)] == straight[stop:]
    # a changed batch or dataset is refused at resume: tests/test_checkpoint_integrity.py


def test_dp2_on_gloo_splits_each_epoch_exactly_and_tokenizes_once(tmp_path):
    """40 documents of 32 bytes: with EOS each is one window, so windows are documents."""
    docs = documents(40, length=SEQ)
    os.makedirs(tmp_path / "src")
    src = str(tmp_path / "src" / "docs.jsonl")
    with open(src, "w") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    path = write_config(tmp_path, "dp2", ["--dp", "2", "--mbs", "2", "--grad_acc_steps", "2",
                                          "--seq_len", str(SEQ), "--dataset_name", src])
    steps = 10                                      # G = 8: two epochs of 5 steps
    proc = launch_script(os.path.join(ROOT, "tests", "data_worker.py"), 2,
                         [path, str(steps), str(tmp_path)], timeout=300)
    assert (proc.stdout + proc.stderr).count("tokenized 40 documents") == 1
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    windows = {bytes(w[:-1]).decode(): None for w in ranks[0]["steps"][0]}   # sanity: docs
    assert set(windows) <= set(docs)
    for epoch in range(2):
        seen = collections.Counter()
        for r in ranks:
            for s in range(5 * epoch, 5 * epoch + 5):
                seen.update(bytes(w[:-1]).decode() for w in r["steps"][s])
        assert seen == collections.Counter(docs), epoch        # each once, none duplicated
    # The same global batches as one process with the same global batch size (dp=1).
    ref = config_for(src, micro_batch_size=2, gradient_accumulation_steps=4)
    ref_data = build_data(ref)
    for s in range(steps):
        both = ranks[0]["steps"][s] + ranks[1]["steps"][s]
        assert sorted(both) == sorted(step_windows(ref_data, ref, s)), s
        assert not {tuple(w) for w in ranks[0]["steps"][s]} & {tuple(w) for w in
                                                               ranks[1]["steps"][s]}


def test_step_batches_are_the_layouts_share_prefetched_or_not():
    """StepBatches.get gives the DP rank's samples and the CP rank's zigzag tokens and
    positions of the full micro-batch; a prefetched step gives the same values."""
    config = config_for("synthetic", micro_batch_size=2, gradient_accumulation_steps=2)
    config.distributed.dp_size, config.distributed.cp_size = 2, 2
    data = SyntheticData(SEQ, 50, 7)
    pgm = collections.namedtuple("Grid", "dp_rank dp_size cp_rank cp_size")
    for dp_rank in range(2):
        full, full_targets = micro_batch(data, 3, 1, config, pgm(dp_rank, 2, 0, 1))  # (2, SEQ)
        for cp_rank in range(2):
            batches = StepBatches(data, config, pgm(dp_rank, 2, cp_rank, 2), torch.device("cpu"))
            inputs, targets, positions = batches.get(3, 1)
            assert inputs.shape == targets.shape == positions.shape == (2, SEQ // 2)
            assert torch.equal(inputs, full.gather(1, positions))           # tokens at positions
            assert torch.equal(targets, full_targets.gather(1, positions))
            half = SEQ // 4          # zigzag: chunks cp_rank and 3 - cp_rank of 4
            assert positions[0].tolist() == list(range(cp_rank * half, (cp_rank + 1) * half)) \
                + list(range((3 - cp_rank) * half, (4 - cp_rank) * half))
            batches.prefetch(3)
            assert all(torch.equal(a, b) for a, b in zip(batches.get(3, 1), (inputs, targets,
                                                                                  positions)))
            assert batches.get(4, 0)[0].shape == (2, SEQ // 2)        # not prefetched: built

