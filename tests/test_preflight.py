"""create_config.py refuses, before writing anything, a config whose data or tokenizer this
machine cannot find (picotron/run/preflight.py): a missing local path, files of two formats, a
text column the file does not have, a split a single file or a folder's file names do not
make, a tokenizer that does not load or does not fit the vocabulary, and a hub id that is
neither cached nor reachable. Each message names the option and the fix. The hub is never
contacted: whether it answers is set by each test."""
import os
import socket

import pytest

import create_config
from picotron.run import preflight
from tiny import documents, tiny_tokenizer, write_formats

OFFLINE = "HF_HUB_OFFLINE=1 is set"


@pytest.fixture(autouse=True)
def hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache, and a hub that cannot be reached (tests change either)."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    monkeypatch.setattr(preflight, "hub_offline", lambda: OFFLINE)


def create(tmp_path, *flags, name="written") -> str:
    return create_config.main(["--out_dir", str(tmp_path / "runs"), "--exp_name", name,
                               "--use_cpu", *flags])


def refused(tmp_path, capsys, *flags) -> str:
    """create_config's error message; it must exit with 2 and write no config."""
    with pytest.raises(SystemExit) as exit_:
        create(tmp_path, *flags, name="refused")
    assert exit_.value.code == 2
    assert not os.path.exists(tmp_path / "runs" / "refused")
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict:
    """The same 20 documents (columns text and id) in every format the loader reads."""
    return write_formats(documents(20), str(tmp_path_factory.mktemp("formats")))


def test_a_local_path_that_does_not_exist(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("./missing.jsonl", str(tmp_path / "missing"), "data/sub/corpus",
                 "corpus.parquet", "~/surely/not/here.txt", "shards/*.jsonl"):
        err = refused(tmp_path, capsys, "--dataset_name", name)
        assert f"dataset.name={name!r} (--dataset_name)" in err, err
        assert ("does not exist" in err or "matches no file" in err) and str(tmp_path) in err
    (tmp_path / "notes.xml").write_text("<a/>")
    err = refused(tmp_path, capsys, "--dataset_name", "notes.xml")
    assert "cannot read '.xml' files" in err and ".jsonl" in err
    # written anyway when asked: a config for another machine
    assert create(tmp_path, "--dataset_name", "./missing.jsonl", "--skip_local_checks")


def test_every_format_passes_with_its_columns_and_fails_without(tmp_path, capsys, formats):
    for fmt in ("txt", "jsonl", "json", "parquet", "arrow", "saved", "folder"):
        assert create(tmp_path, "--dataset_name", formats[fmt])
    csv_path = tmp_path / "docs.csv"
    csv_path.write_text("title,body\nA,alpha beta\n")
    assert create(tmp_path, "--dataset_name", str(csv_path), "--set", "dataset.text_column=body")
    cases = [(formats[f], "['text', 'id']") for f in ("jsonl", "json", "parquet", "arrow",
                                                      "saved")]
    cases += [(formats["txt"], "['text']"), (str(csv_path), "['title', 'body']")]
    for path, columns in cases:
        err = refused(tmp_path, capsys, "--dataset_name", path,
                      "--set", "dataset.text_column=content")
        assert "dataset.text_column='content'" in err and f"its columns are {columns}" in err, err
    glob = os.path.join(os.path.dirname(formats["jsonl"]), "*.jsonl")
    err = refused(tmp_path, capsys, "--dataset_name", glob, "--set", "dataset.text_column=x")
    assert "its columns are ['text', 'id']" in err


def test_a_file_holds_one_split(tmp_path, capsys, formats):
    err = refused(tmp_path, capsys, "--dataset_name", formats["jsonl"],
                  "--set", "dataset.split=validation", "--set", "dataset.val_split=test")
    assert "dataset.split='validation': a file or glob holds one split, 'train'" in err
    assert "dataset.val_split='test'" in err
    assert create(tmp_path, "--dataset_name", formats["jsonl"], "--set", "dataset.split=train")
    # validation on the training split: its windows would be trained on
    err = refused(tmp_path, capsys, "--dataset_name", formats["jsonl"],
                  "--set", "dataset.val_split=train")
    assert "dataset.val_split='train' is the training split" in err, err


def test_a_folder_has_the_splits_its_file_names_make(tmp_path, capsys, formats):
    """formats["folder"] holds train.jsonl and validation.jsonl; a folder of files whose names
    say no split holds 'train' only. The loader finds the same splits."""
    err = refused(tmp_path, capsys, "--dataset_name", formats["folder"],
                  "--set", "dataset.val_split=test")
    assert ("dataset.val_split='test': the folder " in err
            and "make the splits ['train', 'validation']" in err), err
    assert create(tmp_path, "--dataset_name", formats["folder"],
                  "--set", "dataset.val_split=validation")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "part-a.jsonl").write_text('{"text": "a document"}\n')
    err = refused(tmp_path, capsys, "--dataset_name", str(plain),
                  "--set", "dataset.split=validation")
    assert "dataset.split='validation'" in err and "make the splits ['train']" in err, err
    assert create(tmp_path, "--dataset_name", str(plain))


def test_files_of_two_formats_are_refused_together(tmp_path, capsys):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("plain text\n")
    (mixed / "b.jsonl").write_text('{"text": "json text"}\n')
    for name in (str(mixed), str(mixed / "*")):
        err = refused(tmp_path, capsys, "--dataset_name", name)
        assert "holds data files of 2 formats (json: b.jsonl; text: a.txt)" in err, err
    assert create(tmp_path, "--dataset_name", str(mixed / "*.jsonl"))


def test_a_column_only_some_rows_hold_is_a_column(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"other": "x"}\n{"text": "a document", "other": "y"}\n')
    assert create(tmp_path, "--dataset_name", str(rows))
    # a byte-order mark before the first row: read as the loader reads it
    rows.write_bytes(b"\xef\xbb\xbf" + rows.read_bytes())
    assert create(tmp_path, "--dataset_name", str(rows))


def test_bytes_must_fit_the_vocabulary(tmp_path, capsys, formats):
    err = refused(tmp_path, capsys, "--dataset_name", formats["jsonl"],
                  "--set", "model.vocab_size=128")
    assert "byte-level tokenizer has 256 tokens but model.vocab_size=128" in err, err


def test_a_saved_dataset_dict_knows_its_splits_and_columns(tmp_path, capsys):
    import datasets
    folder = str(tmp_path / "dict")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["a", "b"]}),
                          "test": datasets.Dataset.from_dict({"body": ["c"]})}
                         ).save_to_disk(folder)
    err = refused(tmp_path, capsys, "--dataset_name", folder, "--set", "dataset.split=dev")
    assert "dataset.split='dev'" in err and "['train', 'test']" in err
    err = refused(tmp_path, capsys, "--dataset_name", folder)
    assert "dataset.text_column='text'" in err and "['body']" in err
    assert create(tmp_path, "--dataset_name", folder, "--set", "dataset.text_column=body",
                  "--set", "dataset.val_split=test")


def test_a_local_tokenizer_must_load_and_fit_the_vocabulary(tmp_path, capsys, formats):
    from transformers import AutoTokenizer
    tok = tiny_tokenizer(str(tmp_path / "tok"), documents(20), vocab_size=300)
    size = len(AutoTokenizer.from_pretrained(tok))
    flags = ["--dataset_name", formats["jsonl"], "--set", f"dataset.tokenizer={tok}"]
    err = refused(tmp_path, capsys, *flags, "--set", f"model.vocab_size={size - 1}")
    assert f"dataset.tokenizer={tok!r}" in err
    assert f"has {size} tokens but model.vocab_size={size - 1}" in err
    assert f"--set model.vocab_size={size}" in err
    assert create(tmp_path, *flags, "--set", f"model.vocab_size={size}")
    (tmp_path / "not_a_tokenizer").mkdir()
    err = refused(tmp_path, capsys, "--dataset_name", formats["jsonl"],
                  "--set", f"dataset.tokenizer={tmp_path / 'not_a_tokenizer'}")
    assert "could not load a tokenizer from the local path" in err


def test_hub_ids_offline_must_be_cached(tmp_path, capsys, formats, monkeypatch):
    err = refused(tmp_path, capsys, "--dataset_name", "someone/corpus")
    assert "dataset.name='someone/corpus' (--dataset_name) is no local path" in err
    assert OFFLINE in err and "load it once with a network" in err
    err = refused(tmp_path, capsys, "--dataset_name", formats["jsonl"],
                  "--set", "dataset.tokenizer=someone/tok", "--set", "model.vocab_size=300")
    assert "dataset.tokenizer='someone/tok' is a Hugging Face hub id" in err and OFFLINE in err
    # the model's own tokenizer: a preset mirroring a hub model
    err = refused(tmp_path, capsys, "--dataset_name", formats["jsonl"],
                  "--model_name", "SmolLM-135M")
    assert "the model's tokenizer 'HuggingFaceTB/SmolLM-135M' (from --model_name" in err
    # weights to start from, whatever the dataset
    err = refused(tmp_path, capsys, "--set", "checkpoint.init_from=someone/llama")
    assert ("checkpoint.init_from='someone/llama' (the weights to start from) is a Hugging "
            "Face hub id that is not in this machine's cache") in err
    # cached: the hub's cache for both, or the datasets library's prepared copy
    os.makedirs(tmp_path / "hub_cache" / "datasets--someone--corpus" / "snapshots")
    os.makedirs(tmp_path / "hub_cache" / "models--someone--tok" / "snapshots")
    os.makedirs(tmp_path / "datasets_cache" / "other___corpus")
    for name in ("someone/corpus", "other/corpus"):
        assert create(tmp_path, "--dataset_name", name, "--set", "dataset.tokenizer=someone/tok",
                      "--set", "model.vocab_size=300")
    # with a network, hub ids are left to the loader
    monkeypatch.setattr(preflight, "hub_offline", lambda: None)
    assert create(tmp_path, "--dataset_name", "nobody/corpus", "--model_name", "SmolLM-135M")


def test_a_byte_range_needs_its_bytes(tmp_path, capsys):
    raw = tmp_path / "enwik.bin"
    raw.write_bytes(bytes(range(256)) * 4)                         # 1024 bytes
    flags = ["--dataset_name", str(raw), "--set", "dataset.byte_range=[0,1000]"]
    assert create(tmp_path, *flags)
    err = refused(tmp_path, capsys, *flags, "--set", "dataset.val_byte_range=[1000,2000]")
    assert "dataset.val_byte_range=[1000, 2000] ends past the end" in err and "1,024" in err
    err = refused(tmp_path, capsys, "--dataset_name", str(tmp_path / "none.bin"),
                  "--set", "dataset.byte_range=[0,10]")
    assert "there is no file there" in err


def test_offline_is_an_environment_switch_or_a_silent_host(monkeypatch):
    monkeypatch.undo()                  # the real hub_offline, not the fixture's stand-in
    calls = []

    def connect(address, timeout):
        calls.append(address)
        raise OSError("no route")
    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert preflight.hub_offline() == "HF_HUB_OFFLINE=1 is set" and not calls
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    assert "does not answer" in preflight.hub_offline() and calls[0][1] == 443

    class Connection:
        def close(self):
            pass
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: Connection())
    assert preflight.hub_offline() is None


def test_files_with_different_columns_are_refused(tmp_path, capsys):
    """`datasets` casts every file to the first one's columns: a later file with another
    column fails a minute into train.py with a CastError that names neither file. A column
    only the first file holds, an empty shard, or split files whose first (train) file has
    more columns load, and pass."""
    schema = tmp_path / "schema"
    schema.mkdir()
    (schema / "a.jsonl").write_text('{"text": "a document"}\n')
    (schema / "b.jsonl").write_text('{"text": "another", "id": 1}\n')
    for name in (str(schema), str(schema / "*.jsonl")):
        err = refused(tmp_path, capsys, "--dataset_name", name)
        assert ("b.jsonl has columns that a.jsonl, the first file read, lacks (id; a.jsonl "
                "has text): the dataset takes the first file's columns") in err, err
    # a tokenizer's folder given as the data: its .json files are no rows of one table
    tok = tiny_tokenizer(str(tmp_path / "tok"), documents(20))
    err = refused(tmp_path, capsys, "--dataset_name", tok)
    assert "tokenizer_config.json has columns that tokenizer.json, the first file" in err, err
    (schema / "b.jsonl").write_text('{"text": "another"}\n')
    assert create(tmp_path, "--dataset_name", str(schema))
    (schema / "a.jsonl").write_text('{"text": "a document", "id": 0}\n')     # first: more
    (schema / "b2.jsonl").write_text("")                                      # an empty shard
    assert create(tmp_path, "--dataset_name", str(schema))
    splits = tmp_path / "splits"
    splits.mkdir()
    (splits / "train.jsonl").write_text('{"text": "a", "label": 1}\n')
    (splits / "validation.jsonl").write_text('{"text": "b"}\n')
    assert create(tmp_path, "--dataset_name", str(splits), "--set", "dataset.val_split="
                  "validation")
    (splits / "validation.jsonl").write_text('{"text": "b", "source": "web"}\n')
    err = refused(tmp_path, capsys, "--dataset_name", str(splits))
    assert "validation.jsonl has columns that train.jsonl, the first file read, lacks" in err
    # one odd file among many: named beside the first of the others
    for i in range(5):
        (schema / f"c{i}.jsonl").write_text('{"text": "more"}\n')
    (schema / "d.jsonl").write_text('{"body": "odd"}\n')
    err = refused(tmp_path, capsys, "--dataset_name", str(schema))
    assert "d.jsonl has columns that a.jsonl, the first file read, lacks (body" in err, err


def test_data_with_no_rows_or_a_broken_first_line_is_refused(tmp_path, capsys):
    empty, readme = tmp_path / "empty", tmp_path / "readme"
    empty.mkdir()
    readme.mkdir()
    (readme / "README.md").write_text("# a corpus\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\nnot json\n')
    for name, says in ((empty, "holds no data files (it is empty)"),
                       (readme, "holds no data files (it holds only README.md)"),
                       (tmp_path / "empty.txt", "empty.txt is empty: no rows could be read"),
                       (tmp_path / "broken.jsonl", "broken.jsonl line 2 is not JSON")):
        err = refused(tmp_path, capsys, "--dataset_name", str(name))
        assert f"dataset.name={str(name)!r} (--dataset_name): {says}" in err, err


def test_a_text_column_holding_numbers_is_refused(tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a document"}\n{"text": 5}\n')
    err = refused(tmp_path, capsys, "--dataset_name", str(mixed))
    assert ("dataset.text_column='text': row 2 of mixed.jsonl holds int 5 in column 'text', "
            "not text; make every row's 'text' a string") in err, err


def test_a_tokenizer_id_the_hub_cannot_serve_fails_at_once(unreachable_hub, capfd):
    # not cached, hub unreachable: one request, then the one error (the client's download
    # would retry each file five times with backoff, about 49 s for a tokenizer, and print a
    # warning line a try)
    from picotron.data.tokenizer import TokenizerError, load_tokenizer
    with pytest.raises(TokenizerError, match="could not load a tokenizer from the Hugging Face "
                                             "hub id 'someone/nothing'"):
        load_tokenizer("someone/nothing")
    assert unreachable_hub == [] and capfd.readouterr().err == ""
