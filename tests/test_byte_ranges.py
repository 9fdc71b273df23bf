"""A local file read as raw bytes (enwik8's setup): dataset.byte_range trains, val_byte_range
validates, nothing is split into lines or documents, no validation byte reaches a training
window; the palm-enwik8 recipe, scaled down, trains and reports bits per byte. A split of a
single stream (bytes, the embedded corpus, synthetic tokens) is refused, not ignored."""
import math
import random

import pytest

from launch import launch, read_metrics, write_config
from picotron.config import Config, ConfigError, config_from_dict
from picotron.data.windows import DataError, build_train_val
from picotron.data.validation import validation_line, validation_record

SEQ = 64


@pytest.fixture(scope="module")
def xml_file(tmp_path_factory) -> str:
    """~300 KB of wiki-dump-like XML: pages with ids, titles, text, newlines and entities."""
    rng = random.Random(0)
    words = ["the", "of", "and", "in", "a", "[[link]]", "&amp;", "{{cite}}", "é", "data"]
    pages, size, i = [], 0, 0
    while size < 300_000:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))
        page = (f"<page>\n  <id>{i}</id>\n  <title>Article {i}</title>\n  <text xml:space="
                f"\"preserve\">{text}\n\n== Section ==\n</text>\n</page>\n")
        pages.append(page)
        size, i = size + len(page.encode()), i + 1
    path = tmp_path_factory.mktemp("bytes") / "enwik-like.xml"
    path.write_bytes("".join(pages).encode())
    return str(path)


def config_for(path: str, train, val, val_samples: int) -> Config:
    c = Config()
    c.dataset.name, c.dataset.byte_range, c.dataset.val_byte_range = path, train, val
    c.dataset.val_samples, c.training.seq_length = val_samples, SEQ
    return c


def test_the_ranges_cut_the_file_into_windows_and_never_mix(xml_file):
    data = open(xml_file, "rb").read()
    n = SEQ + 1
    train_stop, val_start, val_stop = 270_000, 270_000, 285_000      # 90M/5M of 95M, scaled
    train, val = build_train_val(config_for(xml_file, [0, train_stop], [val_start, val_stop],
                                            10_000))
    assert train.num_windows == train_stop // n and val.num_windows == (val_stop - val_start) // n
    epoch = {bytes(train.window(i).tolist()) for i in range(train.num_windows)}
    # every training window is a cut of the bytes as they are (newlines included), in [0, stop)
    assert epoch == {data[j * n:(j + 1) * n] for j in range(train.num_windows)}
    held = [bytes(val.window(i).tolist()) for i in range(val.num_windows)]
    assert held == [data[val_start + j * n:val_start + (j + 1) * n]
                    for j in range(val.num_windows)]
    assert not epoch & set(held)
    # the ranges need not touch: validation may come first, bytes in between unused
    train, val = build_train_val(config_for(xml_file, [20_000, 290_000], [0, 10_000], 3))
    assert bytes(train.window(0).tolist()) in {data[20_000 + j * n:20_000 + (j + 1) * n]
                                               for j in range(train.num_windows)}
    assert bytes(val.window(2).tolist()) == data[2 * n:3 * n] and val.num_windows == 3
    # without val_byte_range, val_samples windows are carved off the end of the training range
    train, val = build_train_val(config_for(xml_file, [0, 100 * n], None, 4))
    assert train.num_windows == 96 and bytes(val.window(0).tolist()) == data[96 * n:97 * n]


def test_a_byte_range_edited_in_place_is_another_run_to_a_resume(tmp_path):
    """A resume compares the range's sha256, as it does a tokenized dataset's: same size,
    same windows, other bytes is another run (unless checkpoint.allow_changes says so). So
    does the embedded corpus, whose bytes are this Python's standard library."""
    from picotron.checkpoint.changes import run_changes
    from picotron.data.windows import data_state
    path = tmp_path / "bytes.txt"
    path.write_bytes(b"abcdefgh" * 1000)
    c = config_for(str(path), [0, 6000], [6000, 8000], 3)
    before = build_train_val(c)[0]
    assert build_train_val(c)[0].contents == before.contents
    path.write_bytes(b"abcdefgh" * 750 + b"hgfedcba" * 250)   # only the validation range:
    assert build_train_val(c)[0].contents == before.contents  # the training stream is as it was
    path.write_bytes(b"hgfedcba" * 1000)
    after = build_train_val(c)[0]
    assert after.num_windows == before.num_windows and after.contents != before.contents
    assert list(run_changes(c, c, before.num_windows, after.num_windows, before.contents,
                            after.contents)) == ["dataset.contents"]
    assert data_state(c, 1, after)["contents"] == after.contents     # what a checkpoint keeps
    c.dataset.val_byte_range = None                  # carved off the end: the same stream
    assert build_train_val(c)[0].contents == after.contents
    embedded = Config()
    assert len(build_train_val(embedded)[0].contents) == 64


def test_bad_ranges_are_refused_with_the_fix(xml_file):
    def problems(**dataset) -> str:
        with pytest.raises(ConfigError) as e:
            config_from_dict({"dataset": {"name": xml_file, **dataset}})
        return str(e.value)
    assert "overlaps dataset.byte_range" in problems(byte_range=[0, 1000],
                                                     val_byte_range=[900, 2000])
    assert "0 <= start < stop" in problems(byte_range=[10, 10])
    assert "0 <= start < stop" in problems(byte_range=[0, 1.5])
    assert "without dataset.byte_range" in problems(val_byte_range=[0, 10])
    assert "needs dataset.tokenizer" in problems(byte_range=[0, 1000], tokenizer="gpt2")
    with pytest.raises(DataError, match=r"ends past the end of .* lower its stop"):
        build_train_val(config_for(xml_file, [0, 10 ** 9], None, 0))
    with pytest.raises(DataError, match="fewer than one window"):
        build_train_val(config_for(xml_file, [0, 10_000], [10_000, 10_010], 2))
    with pytest.raises(DataError, match="is not a file"):
        build_train_val(config_for(xml_file + ".missing", [0, 10_000], None, 0))


def test_the_palm_enwik8_recipe_scaled_down_trains_and_reports_bits_per_byte(xml_file,
                                                                             tmp_path):
    """docs/data.md's palm-enwik8 command with the model, file and ranges made small."""
    path = write_config(tmp_path, "palm-enwik8", [
        "--model_name", "palm-enwik8", "--dataset_name", xml_file, "--seq_len", str(SEQ),
        "--mbs", "4", "--grad_acc_steps", "2", "--learning_rate", "2e-4",
        "--total_train_steps", "4", "--num_hidden_layers", "2",
        "--set", "model.hidden_size=64", "--set", "model.intermediate_size=256",
        "--set", "dataset.byte_range=[0,270000]", "--set", "dataset.val_byte_range=[270000,"
        "285000]", "--set", "dataset.val_samples=16", "--set", "training.val_frequency=2",
        "--set", "training.max_grad_norm=0.5", "--set", "training.weight_decay=0"])
    out = launch(path, 1).stdout
    rows = read_metrics(path)
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r for r in rows if "val_loss" in r]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert [r["step"] for r in vals] == [2, 4]
    for r in vals:
        assert math.isclose(r["val_bits_per_byte"], r["val_loss"] / math.log(2), rel_tol=1e-12)
        assert f"val loss {r['val_loss']:.4f} | {r['val_bits_per_byte']:.4f} bits per byte" in out
    assert vals[0]["val_loss"] < math.log(256) + 0.5          # a byte-level model's scale
    last = vals[-1]                                            # and in the run's summary
    assert (f"val loss {last['val_loss']:.4f} ({last['val_bits_per_byte']:.4f} bits per byte)"
            in out.splitlines()[-1])


def test_bits_per_byte_only_when_tokens_are_bytes(xml_file, tmp_path):
    from tiny import documents, tiny_tokenizer
    byte_range = config_for(xml_file, [0, 1000], None, 0)
    record = validation_record(7, 0.7, byte_range)
    assert record == {"step": 7, "val_loss": 0.7, "val_bits_per_byte": 0.7 / math.log(2)}
    assert validation_line(record) == "step     7 | val loss 0.7000 | 1.0099 bits per byte"
    embedded, synthetic, bpe = Config(), Config(), Config()
    synthetic.dataset.name = "synthetic"
    bpe.dataset.name, bpe.model.vocab_size = xml_file, 300
    bpe.dataset.tokenizer = tiny_tokenizer(str(tmp_path / "tok"), documents(20))
    assert "val_bits_per_byte" in validation_record(1, 1.0, embedded)
    for config in (synthetic, bpe):
        record = validation_record(1, 1.0, config)
        assert "val_bits_per_byte" not in record
        assert validation_line(record) == "step     1 | val loss 1.0000"


@pytest.mark.parametrize("dataset", [{"split": "nope"}, {"name": "synthetic", "val_split": "v"},
                                     {"name": "f.txt", "byte_range": [0, 100], "split": "x"}])
def test_a_split_of_a_single_stream_is_refused_not_ignored(dataset):
    """The embedded corpus, synthetic tokens and a file's byte range have no splits."""
    raw = Config().to_dict()
    raw["dataset"].update(dataset)
    with pytest.raises(ConfigError, match="one stream with no splits: remove it"):
        config_from_dict(raw)
    raw["dataset"].update(split="train", val_split=None)
    config_from_dict(raw)
