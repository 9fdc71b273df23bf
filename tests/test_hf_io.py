"""Hugging Face round trips: a Llama written by transformers (single file, sharded, tied)
loads with equal logits and trains from its weights; our export loads back into transformers
with equal logits and equal greedy generations; sampling obeys top-k and stops at EOS."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from launch import ROOT, launch, read_metrics, write_config
from tiny import documents, one_process_group, tiny_llama, tiny_tokenizer
from picotron.checkpoint.checkpoint import CheckpointError, save_checkpoint
from picotron.config import Config, ConfigError, ModelConfig
from picotron.data.windows import DataError, build_data, micro_batch
from picotron.run.generate import filter_top_k, load_for_inference, sample
from picotron.checkpoint.hf_io import export_hf, load_hf_weights
from picotron.loss import causal_lm_loss
from picotron.model import Decoder, materialize
from picotron.config.presets import resolve_model
from picotron.process_group_manager import ProcessGroupManager


def our_model(cfg: ModelConfig, seed: int = 0):
    with torch.device("meta"):
        model = Decoder(cfg)
    return materialize(model, seed, torch.device("cpu"), torch.float32)


def hf_greedy(hf, prompt, n: int, eos: int) -> list:
    out = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                      max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0].tolist()


@pytest.mark.parametrize("shard,tie", [(None, False), ("40KB", False), (None, True)])
def test_transformers_llama_loads_with_equal_logits(tmp_path, shard, tie):
    hf = tiny_llama(str(tmp_path), tie=tie, shard=shard)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    cfg = ModelConfig(**resolve_model(str(tmp_path)))
    assert cfg.rope_theta == 5000.0 and cfg.tie_word_embeddings == tie
    model = our_model(cfg)
    x = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        random_init = model(x)
        load_hf_weights(model, str(tmp_path))
        ours, theirs = model(x), hf(x).logits
    assert (ours - theirs).abs().max() < 1e-5
    assert (random_init - theirs).abs().max() > 1e-2        # the weights really replaced init


def test_weights_that_do_not_fit_are_refused_before_any_change(tmp_path):
    tiny_llama(str(tmp_path))
    cfg = ModelConfig(**{**resolve_model(str(tmp_path)), "num_hidden_layers": 1})
    model = our_model(cfg)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"tensors the model lacks: model\.layers\.1\."):
        load_hf_weights(model, str(tmp_path))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no .safetensors weights"):
        load_hf_weights(model, str(tmp_path / "empty"))


@pytest.mark.parametrize("body, words", [
    ("nope", "cannot read .*config.json \\(JSONDecodeError"),
    ("[1, 2]", "holds a JSON list"),
    ('{"hidden_size": 64}', "missing vocab_size, intermediate_size, num_hidden_layers"),
    ('{"vocab_size": 300, "hidden_size": "64", "intermediate_size": 128, '
     '"num_hidden_layers": 2, "num_attention_heads": 4}', "hidden_size='64' \\(positive"),
])
def test_a_bad_model_config_json_is_named(tmp_path, body, words):
    (tmp_path / "config.json").write_text(body)
    with pytest.raises(ConfigError, match=words):
        resolve_model(str(tmp_path))


def test_hub_id_downloads_the_weights_or_names_the_fix(tmp_path, monkeypatch):
    """A hub id (not a local directory) goes through huggingface_hub.snapshot_download: asked
    for the safetensors and json files only, then loaded from the snapshot it returns. With
    the hub unreachable (offline mode, empty cache: the real library raises) the error names
    the id and the fixes, before the model is touched."""
    import huggingface_hub
    hf = tiny_llama(str(tmp_path / "snapshot"))
    model = our_model(ModelConfig(**resolve_model(str(tmp_path / "snapshot"))))
    asked = []
    real_download = huggingface_hub.snapshot_download

    def fake_download(repo_id, **kwargs):
        asked.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    load_hf_weights(model, "someone/tiny-llama")
    assert asked == [("someone/tiny-llama", {"allow_patterns": ["*.safetensors", "*.json"]})]
    x = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() < 1e-5
    monkeypatch.setattr(huggingface_hub, "snapshot_download", real_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError) as e:
        load_hf_weights(model, "someone/not-cached")
    assert "checkpoint.init_from='someone/not-cached'" in str(e.value)
    assert "pass a local directory" in str(e.value)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_train_from_hf_weights_export_and_generate(tmp_path):
    """--model_name a local transformers directory: the first step's loss is the Hugging Face
    model's loss on the first batch; the trained checkpoint exports back to transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    docs = documents(60)
    hf_dir = str(tmp_path / "hf")
    hf = tiny_llama(hf_dir)
    tiny_tokenizer(hf_dir, docs)
    src = str(tmp_path / "docs.jsonl")
    with open(src, "w") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    path = write_config(tmp_path, "ft", ["--model_name", hf_dir, "--dataset_name", src,
                                         "--mbs", "2", "--seq_len", "32",
                                         "--total_train_steps", "2",
                                         "--set", "checkpoint.save_frequency=2"])
    with open(path) as f:
        config_raw = json.load(f)
    assert config_raw["checkpoint"]["init_from"] == os.path.abspath(hf_dir)
    launch(path, 1)
    from picotron.config import load_config
    config = load_config(path)
    x, y = micro_batch(build_data(config), 0, 0, config, ProcessGroupManager())
    with torch.no_grad():
        expected = causal_lm_loss(hf(x).logits, y).item()
    assert abs(read_metrics(path)[0]["loss"] - expected) < 1e-5

    ckpt = os.path.join(os.path.dirname(path), "checkpoints", "step_000002")
    out = export_hf(ckpt, str(tmp_path / "export"))
    ours, _ = load_for_inference(ckpt)
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    tok, src_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(hf_dir)
    assert tok("alpha beta")["input_ids"] == src_tok("alpha beta")["input_ids"]
    prompt = torch.tensor(tok("doc 3: alpha", add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        assert (ours(prompt[None]) - back(prompt[None]).logits).abs().max() < 1e-5
    assert sample(ours, prompt, 12, temperature=0, eos_token_id=tok.eos_token_id).tolist() == \
        hf_greedy(back, prompt, 12, tok.eos_token_id)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--checkpoint",
                           os.path.dirname(ckpt), "--prompt", "doc 3: alpha",
                           "--max_new_tokens", "6", "--temperature", "0.8", "--top_k", "5"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]


def save_tiny_checkpoint(root, **model_fields) -> str:
    config = Config()
    config.model.hidden_size, config.model.intermediate_size = 32, 64
    config.model.num_hidden_layers = 2
    for k, v in model_fields.items():
        setattr(config.model, k, v)
    model = our_model(config.model, seed=3)
    return save_checkpoint(model, None, one_process_group(), config, str(root), 1,
                           {"tokens_seen": 0, "data": {}})


def test_a_run_on_fast_kernels_samples_on_a_cpu(tmp_path):
    """A checkpoint whose config says model.kernels='liger' (GPU only; liger is not even
    installed here) loads for sampling with the readable kernels: the same logits as the
    same weights saved under kernels='torch'."""
    plain = save_tiny_checkpoint(tmp_path / "plain")
    config = Config()
    config.model.hidden_size, config.model.intermediate_size = 32, 64
    config.model.num_hidden_layers = 2
    model = our_model(config.model, seed=3)
    config.model.kernels = "liger"                     # as a GPU run would have saved it
    fast = save_checkpoint(model, None, one_process_group(), config, str(tmp_path / "fast"), 1,
                           {"tokens_seen": 0, "data": {}})
    (a, _), (b, cfg) = load_for_inference(plain), load_for_inference(fast)
    assert cfg.model.kernels == "liger"                # the run's config is reported as is
    ids = torch.tensor([list(b"sample me")])
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_byte_level_export_loads_with_its_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True)
    out = export_hf(ckpt, str(tmp_path / "export"))
    tok = AutoTokenizer.from_pretrained(out)
    text = "def héllo():\n\treturn 0  # ok"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.eos_token_id == 0
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    ours, _ = load_for_inference(ckpt)
    prompt = torch.tensor(list(b"import os\n"))
    with torch.no_grad():
        assert (ours(prompt[None]) - back(prompt[None]).logits).abs().max() < 1e-5
    assert sample(ours, prompt, 16, temperature=0, eos_token_id=0).tolist() == \
        hf_greedy(back, prompt, 16, 0)
    # safetensors files get the mode of every other file (safetensors alone makes them 0600)
    modes = {f: os.stat(os.path.join(d, f)).st_mode & 0o777 for d in (out, ckpt)
             for f in os.listdir(d)}
    assert len(set(modes.values())) == 1, modes


def test_a_checkpoint_reads_after_the_folder_it_started_from_moved(tmp_path):
    """A fine-tune's checkpoint.init_from (the Hugging Face folder of its first weights) is
    not needed to sample or export: its weights are in the checkpoint."""
    config = Config()
    config.model.hidden_size, config.model.intermediate_size = 32, 64
    config.model.num_hidden_layers = 2
    config.checkpoint.init_from = str(tmp_path / "moved-away")
    model = our_model(config.model, seed=3)
    ckpt = save_checkpoint(model, None, one_process_group(), config, str(tmp_path / "ckpt"), 1,
                           {"tokens_seen": 0, "data": {}})
    ours, _ = load_for_inference(ckpt)
    assert torch.equal(ours.embed_tokens.weight, model.embed_tokens.weight)
    assert os.path.isdir(export_hf(ckpt, str(tmp_path / "export")))


def test_export_never_overwrites_other_files(tmp_path, capsys):
    """A run's own directory (its config.json) or a file as --out is refused, said once, with
    the files untouched; a new directory or an earlier export is written."""
    import export_hf as cli
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"model": {}}')
    for out, words in ((run, "holds files (config.json) but no picotron_export.json"),
                       (run / "config.json", "is a file"), ("", "directory is an empty string"),
                       (run / "config.json" / "sub", "is not a folder (a file")):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["--checkpoint", ckpt, "--out", str(out)])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and words in err and "Traceback" not in err, err
    assert os.listdir(run) == ["config.json"] and \
        (run / "config.json").read_text() == '{"model": {}}'
    out = export_hf(ckpt, str(tmp_path / "export"))
    assert export_hf(ckpt, out) == out                       # over an earlier export
    with pytest.raises(DataError, match="give --tokenizer a tokenizer id"):
        export_hf(ckpt, str(tmp_path / "untouched"), tokenizer=str(tmp_path / "nope"))
    assert not (tmp_path / "untouched").exists()             # nothing written before that
    small = save_tiny_checkpoint(tmp_path / "small", vocab_size=50)
    bpe = tiny_tokenizer(str(tmp_path / "bpe"), documents(20))      # 68 ids for 50 rows
    with pytest.raises(DataError, match="has 68 tokens, more than the model's 50; give "
                                        "--tokenizer the one the run trained with"):
        export_hf(small, str(tmp_path / "untouched"), tokenizer=bpe)
    assert not (tmp_path / "untouched").exists()


BAD_SAMPLING = [("--top_k", "-1", "--top_k -1 must be a finite number >= 0"),
                ("--temperature", "-0.5", "--temperature -0.5 must be"),
                ("--temperature", "nan", "--temperature nan must be"),
                ("--max_new_tokens", "-3", "--max_new_tokens -3 must be"),
                ("--device", "foo", "--device 'foo' is not a device"),
                ("--device", "meta", "--device meta: generate.py runs on cpu or cuda")]
if not torch.cuda.is_available():        # where a GPU is visible, cuda:0 is a good device
    BAD_SAMPLING.append(("--device", "cuda:0", "needs a CUDA GPU, and none is visible"))


@pytest.mark.parametrize("flag,value,words", BAD_SAMPLING)
def test_generate_refuses_bad_sampling_options(capsys, flag, value, words):
    import generate as cli
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--checkpoint", "unused", flag, value])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and words in err, err


class FixedLogits(nn.Module):
    """A stand-in model whose next-token logits are always `logits` (V,)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, x):
        return self.logits.expand(x.shape[0], x.shape[1], -1)


def test_sampling_keeps_top_k_and_stops_at_eos():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    assert torch.isinf(filter_top_k(logits, 2)).tolist() == [[True, False, True, False, True]]
    model = FixedLogits(torch.tensor([0.0, 0.5, 0.4, 0.3, 0.2]))
    g = torch.Generator().manual_seed(0)
    draws = sample(model, torch.tensor([4]), 200, temperature=2.0, top_k=3, generator=g)
    assert set(draws[1:].tolist()) == {1, 2, 3}                # only the 3 likeliest
    again = sample(model, torch.tensor([4]), 200, 2.0, 3, generator=torch.Generator()
                   .manual_seed(0))
    assert torch.equal(draws, again)                           # the seed fixes the sample
    assert sample(model, torch.tensor([4]), 50, temperature=0, eos_token_id=1).tolist() == \
        [4, 1]                                                 # greedy hits EOS and stops
