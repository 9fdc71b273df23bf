"""export_hf.py writes only picotron's own folders (picotron/checkpoint/export_dir.py): a downloaded
model is refused and left byte for byte; an earlier export is replaced whole (its stale files gone,
a person's added files kept) and loads in transformers; a failed export leaves it whole; a killed
export's staging folder is removed by a later one."""
import json
import os
import time

import pytest
import torch

from checkpoint_helpers import build, save_at, tiny_config
from picotron.checkpoint.export_dir import MARKER, STAGING_PREFIX, STALE_STAGING_S, ExportError
from picotron.run.generate import load_for_inference
from picotron.checkpoint.hf_io import export_hf

DOWNLOADED = {"config.json": '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}',
              "model-00001-of-00002.safetensors": "first shard",
              "model-00002-of-00002.safetensors": "second shard",
              "model.safetensors.index.json": '{"weight_map": {}}',
              "tokenizer.model": "sentencepiece", "README.md": "# the base model"}


def checkpoint(root, seed: int) -> str:
    config = tiny_config()
    model, _, _ = build(config, seed)
    return save_at(model, None, config, str(root), 1)


def snapshot(folder) -> dict:
    """{name: bytes} of every file under `folder`, however deep."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(folder) for f in names}


def loads_as(out: str, ckpt: str) -> None:
    """`out` loads in transformers with the logits of checkpoint `ckpt`."""
    from transformers import AutoModelForCausalLM
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    ours, _ = load_for_inference(ckpt)
    ids = torch.tensor([list(b"export me")])
    with torch.no_grad():
        assert (ours(ids) - back(ids).logits).abs().max() < 1e-5


def test_a_downloaded_model_folder_is_refused_and_left_as_it_was(tmp_path, capsys):
    import export_hf as cli
    ckpt = checkpoint(tmp_path / "ckpt", seed=1)
    base = tmp_path / "base"
    base.mkdir()
    for name, text in DOWNLOADED.items():
        (base / name).write_text(text)
    before = snapshot(base)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--checkpoint", ckpt, "--out", str(base)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    assert f"'{base}' holds files (" in err and "but no picotron_export.json" in err, err
    assert f"give a new or empty --out, e.g. --out '{base}-hf'" in err, err
    assert snapshot(base) == before and sorted(os.listdir(base)) == sorted(DOWNLOADED)


def test_re_export_replaces_the_earlier_export_and_keeps_added_files(tmp_path):
    old, new = checkpoint(tmp_path / "old", seed=1), checkpoint(tmp_path / "new", seed=2)
    out = export_hf(old, str(tmp_path / "hf"))
    written = sorted(os.listdir(out))
    assert MARKER in written and "model.safetensors" in written
    # As if the earlier export had also written shards and an index (a larger model), which
    # this one does not: left behind, transformers would load the folder as another model.
    stale = ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    for name in stale:
        (tmp_path / "hf" / name).write_text("from the earlier export")
    with open(os.path.join(out, MARKER)) as f:
        marker = json.load(f)
    marker["files"] += stale
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump(marker, f)
    (tmp_path / "hf" / "NOTES.md").write_text("a person's notes")       # not the export's
    assert export_hf(new, out) == out
    assert sorted(os.listdir(out)) == sorted(written + ["NOTES.md"])
    assert (tmp_path / "hf" / "NOTES.md").read_text() == "a person's notes"
    loads_as(out, new)


def test_a_file_someone_added_is_never_replaced(tmp_path):
    """A file the new export writes but the earlier one did not list was put there by
    someone: the export is refused, the folder unchanged."""
    ckpt = checkpoint(tmp_path / "ckpt", seed=1)
    out = export_hf(ckpt, str(tmp_path / "hf"))
    with open(os.path.join(out, MARKER)) as f:
        marker = json.load(f)
    marker["files"].remove("generation_config.json")
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump(marker, f)
    before = snapshot(out)
    with pytest.raises(ExportError, match="would replace generation_config.json in .*which "
                                          "the earlier export there did not write"):
        export_hf(ckpt, out)
    assert snapshot(out) == before


def test_an_export_that_fails_midway_leaves_the_earlier_one_whole(tmp_path, monkeypatch,
                                                                  capsys):
    import safetensors.torch
    old, new = checkpoint(tmp_path / "old", seed=1), checkpoint(tmp_path / "new", seed=2)
    out = export_hf(old, str(tmp_path / "hf"))
    before = snapshot(out)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_hf(new, out)
    assert snapshot(out) == before                    # and no staging folder left behind
    import export_hf as cli
    with pytest.raises(SystemExit) as stopped:        # the script says so in one line
        cli.main(["--checkpoint", new, "--out", out])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err, err
    assert "No space left on device); any earlier export there is as it was" in err, err
    monkeypatch.undo()
    loads_as(out, old)


def test_a_killed_exports_staging_folder_is_removed_after_a_day(tmp_path):
    """A staging folder outlives an export only when the export was killed (SIGKILL, out of
    memory): a later export into the folder removes it once it is a day old."""
    ckpt = checkpoint(tmp_path / "ckpt", seed=1)
    out = export_hf(ckpt, str(tmp_path / "hf"))
    old, recent = (os.path.join(out, STAGING_PREFIX + name) for name in ("old", "recent"))
    for folder in (old, recent):
        os.makedirs(folder)
    os.utime(old, (0, time.time() - STALE_STAGING_S - 60))
    export_hf(ckpt, out)
    assert not os.path.exists(old) and os.path.isdir(recent)  # maybe an export under way
