"""generate.py's command line on a tiny checkpoint: what it samples, and the one clear error
it gives for input it cannot use (tests/test_hf_io.py checks the sampling options' ranges)."""
import os
import shutil

import pytest
import torch

import generate
from picotron.checkpoint.checkpoint import CheckpointError, checkpoint_to_read
from picotron.run.generate import load_for_inference, sample
from picotron.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from checkpoint_helpers import build, save_at, tiny_config, train_one
from tiny import documents, tiny_tokenizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    """A checkpoints folder holding a tiny run's checkpoints of steps 1 and 2 (never changed:
    a test that adds to it works on a copy)."""
    root = str(tmp_path_factory.mktemp("run") / "checkpoints")
    config = tiny_config()
    model, grads, opt = build(config)
    for step in (1, 2):
        train_one(model, grads, opt, step)
        save_at(model, opt, config, root, step)
    return root


def run_generate(args: list, capsys) -> tuple:
    """(exit code, stdout, stderr) of `python generate.py ARGS`."""
    try:
        generate.main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_prompt_of_bytes_that_are_not_utf8(checkpoints, tmp_path, capsys):
    """A shell's $'\\xff\\xfe' reaches Python as the surrogates U+DCFF U+DCFE: the byte
    tokenizer keeps the bytes typed, a Hugging Face one refuses the prompt by name."""
    root = checkpoints
    assert ByteTokenizer().encode("a\udcff\udcfe") == [97, 255, 254]
    with pytest.raises(TokenizerError, match="the lone surrogate '\\\\ud800' at character 1"):
        ByteTokenizer().encode("a\ud800")
    code, out, err = run_generate(["--checkpoint", root, "--prompt", "\udcff\udcfe",
                                   "--max_new_tokens", "2"], capsys)
    assert code == 0 and out, err
    hf = tiny_tokenizer(str(tmp_path / "tok"), documents(20), vocab_size=120)
    assert load_tokenizer(hf).encode("doc") != []
    code, out, err = run_generate(["--checkpoint", root, "--prompt", "\udcff\udcfe",
                                   "--tokenizer", hf, "--max_new_tokens", "2"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: the text to encode is not UTF-8: the bytes b'\\xff\\xfe' at "
                          "character 0; tokenizer"), err


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_like_greedy(checkpoints, temperature):
    """logits / 1e-40 overflow fp32 and made the softmax NaN; a tiny temperature is greedy."""
    model, _ = load_for_inference(checkpoint_to_read(checkpoints))
    prompt = torch.tensor([100, 101, 102])
    greedy = sample(model, prompt, 12, temperature=0)
    tiny = sample(model, prompt, 12, temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tiny, greedy)
    assert len(set(greedy[3:].tolist())) > 1        # the logits change from step to step


def test_sampling_past_the_trained_windows_is_warned_of_once(checkpoints, capsys):
    """The model read training.seq_length tokens at once in training (the tiny run's 256):
    reading more uses positions it never trained, which is said once; the context is still
    cropped at model.max_position_embeddings."""
    config = load_for_inference(checkpoint_to_read(checkpoints))[1]
    generate.warn_past_trained_windows(2, 255, config)          # reads 256 tokens at most
    assert capsys.readouterr().err == ""
    generate.warn_past_trained_windows(2, 5000, config)
    assert "read up to 2048 tokens, but it was trained on 256-token windows" in \
        capsys.readouterr().err
    code, out, err = run_generate(["--checkpoint", checkpoints, "--prompt", "a" * 255,
                                   "--max_new_tokens", "3", "--temperature", "0"], capsys)
    assert code == 0 and out, err
    assert err.count("warning:") == 1, err
    assert err.startswith("warning: the prompt (255 tokens) and --max_new_tokens 3 make the "
                          "model read up to 257 tokens, but it was trained on 256-token "
                          "windows (training.seq_length): positions past 256 were never "
                          "trained"), err


def test_an_unfinished_save_is_named_with_the_checkpoints_beside_it(checkpoints, tmp_path,
                                                                    capsys):
    """A save killed while writing leaves step_N.tmp (renamed to step_N only once whole):
    named as such, even when it already holds a state.json, with the checkpoint to give."""
    root = str(tmp_path / "checkpoints")
    shutil.copytree(checkpoints, root)
    unfinished = os.path.join(root, "step_000003.tmp")
    shutil.copytree(os.path.join(root, "step_000002"), unfinished)
    code, out, err = run_generate(["--checkpoint", unfinished, "--max_new_tokens", "2"],
                                  capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err == (f"error: '{unfinished}' is an unfinished save (its run was killed while "
                   f"writing it), not a checkpoint; give a complete checkpoint beside it "
                   f"instead: {os.path.join(root, 'step_000002')}, the newest of 2\n"), err
    assert checkpoint_to_read(root) == os.path.join(root, "step_000002")   # .tmp: not seen
    only = tmp_path / "only" / "checkpoints"
    shutil.copytree(unfinished, only / "step_000001.tmp")
    with pytest.raises(CheckpointError, match="no complete checkpoint beside it; resume"):
        checkpoint_to_read(str(only / "step_000001.tmp"))
    with pytest.raises(CheckpointError, match="holds no complete checkpoint, only unfinished "
                                              "saves \\(step_000001.tmp: their run was killed"):
        checkpoint_to_read(str(only))


def test_a_model_trained_on_bytes_samples_bytes_whatever_its_name():
    """SmolLM-135M's shape trained on the embedded corpus (or a file's byte range) saw byte
    tokens: generate and export take the byte tokenizer, not the hub tokenizer of the name."""
    from picotron.config import config_from_dict
    from picotron.data.tokenizer import tokenizer_source
    model = {"name": "SmolLM-135M", "vocab_size": 49152}      # a preset with a hub tokenizer
    on_bytes = config_from_dict({"model": model, "dataset": {"name": "embedded"}})
    assert tokenizer_source(on_bytes) == "byte"
    on_range = config_from_dict({"model": model, "dataset": {"name": __file__,
                                                             "byte_range": [0, 4000]}})
    assert tokenizer_source(on_range) == "byte"
    on_tokens = config_from_dict({"model": model, "dataset": {"name": "synthetic"}})
    assert tokenizer_source(on_tokens) == "HuggingFaceTB/SmolLM-135M"


@pytest.mark.parametrize("threads", [1, 2])
def test_samples_are_unchanged_by_flushed_denormals_and_the_thread_count(checkpoints, threads):
    """generate.py flushes denormals on a CPU and takes the thread policy's count: neither
    changes a sampled token (greedy, and drawn at temperature 0.8 with top-k)."""
    model, _ = load_for_inference(checkpoint_to_read(checkpoints))
    prompt = torch.tensor([100, 101, 102])
    before = torch.get_num_threads()

    def samples():
        return [sample(model, prompt, 24, temperature, 50, None,
                       torch.Generator().manual_seed(3)) for temperature in (0, 0.8)]
    try:
        torch.set_num_threads(1)
        torch.set_flush_denormal(False)
        reference = samples()
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        flushed = samples()
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)
    for a, b in zip(reference, flushed):
        assert torch.equal(a, b), (a, b)
    assert len(set(reference[1][3:].tolist())) > 1          # the sample is no constant
