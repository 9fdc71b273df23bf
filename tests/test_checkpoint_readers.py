"""generate.py and export_hf.py read only verified checkpoints, as a resume does
(tests/test_checkpoint_integrity.py checks the verification itself)."""
import os

import pytest

from picotron.checkpoint.checkpoint import CheckpointError
from checkpoint_helpers import rewrite_state
from test_checkpoint_integrity import flip, saved  # noqa: F401  (saved: the fixture)


def test_generate_and_export_read_only_verified_checkpoints(saved, tmp_path, capsys):
    """A step directory named to generate.py / export_hf.py is checked like a resume's: a
    damaged file refuses it by name; a checkpoints folder gives its latest valid one."""
    import export_hf
    import generate
    from picotron.checkpoint.checkpoint import checkpoint_to_read
    _, root = saved
    step3 = os.path.join(root, "step_000003")
    assert checkpoint_to_read(step3) == os.path.abspath(step3)
    flip(os.path.join(step3, "weights-pp0-tp0.safetensors"))
    for main, extra in ((generate.main, ["--max_new_tokens", "2"]),
                        (export_hf.main, ["--out", str(tmp_path / "hf")])):
        with pytest.raises(SystemExit) as e:
            main(["--checkpoint", step3, *extra])
        assert e.value.code == 2
        assert "weights-pp0-tp0.safetensors: does not match" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    assert checkpoint_to_read(root) == os.path.join(root, "step_000002")   # 3 is skipped
    with pytest.raises(CheckpointError, match="is a run directory, not a checkpoint; give its "
                                              "checkpoints folder"):
        checkpoint_to_read(str(tmp_path))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint .* nor a folder of them"):
        checkpoint_to_read(str(tmp_path / "nothing"))


def test_a_moved_tokenizer_is_named_with_the_flag_that_replaces_it(saved, tmp_path, capsys):
    """A run's dataset.tokenizer folder that moved: generate and export say to give
    --tokenizer (a saved checkpoint's settings cannot be set), and --tokenizer works."""
    import export_hf
    import generate
    _, root = saved
    step3 = os.path.join(root, "step_000003")
    rewrite_state(step3, lambda s: s["config"]["dataset"].update(     # a tokenized dataset's
        name=str(tmp_path / "docs.jsonl"), tokenizer=str(tmp_path / "moved")))   # run
    for main, extra in ((generate.main, ["--max_new_tokens", "2"]),
                        (export_hf.main, ["--out", str(tmp_path / "hf")])):
        with pytest.raises(SystemExit):
            main(["--checkpoint", step3, *extra])
        err = capsys.readouterr().err
        assert "moved': nothing exists there" in err, err
        assert "give --tokenizer a tokenizer id" in err, err
        main(["--checkpoint", step3, *extra, "--tokenizer", "byte"])
    assert os.path.isfile(tmp_path / "hf" / "tokenizer.json")


def test_a_folder_of_checkpoints_as_load_path_says_to_name_one(saved, tmp_path):
    """generate and export take a checkpoints folder (its latest); a resume names its
    checkpoint, so it is told how, not that the folder is damaged."""
    from picotron.checkpoint.checkpoint import find_checkpoint
    _, root = saved
    with pytest.raises(CheckpointError, match="is a folder of checkpoints \\(3 of them\\); "
                                              "name one of them \\(e.g. .*step_000003\\)"):
        find_checkpoint(root, str(tmp_path / "checkpoints"), str(tmp_path))
