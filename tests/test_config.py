"""Bad configs are refused at load time with one message that names the values and the fix."""
import json
import os
import subprocess
import sys

import pytest

import create_config
from launch import ROOT
from picotron.attention import resolve_attention, sdpa_attention
from picotron.config import (Config, ConfigError, MissingPackage, config_from_dict, load_config,
                             resolve_auto)

BAD_FLAGS = [  # (flags, words the message must contain)
    (["--tp", "3"], ["num_attention_heads=8", "tp_size=3"]),
    (["--tp", "8"], ["num_key_value_heads=4", "tp_size=8"]),
    (["--pp", "8"], ["num_hidden_layers=4", "pp_size=8"]),
    (["--cp", "3", "--seq_len", "64"], ["seq_length=64", "2*cp_size=6"]),
    (["--num_attention_heads", "6"], ["num_attention_heads=6", "num_key_value_heads=4"]),
    (["--set", "training.learnin_rate=0.1"], ["training.learnin_rate", "learning_rate"]),
    (["--set", "training.micro_batch_size=\"8\""], ["training.micro_batch_size", "int"]),
    (["--set", "trainin.seed=1"], ["unknown section 'trainin'"]),
    (["--set", "model.tie_word_embeddings=yes"], ["must be true or false, got 'yes'"]),
    (["--set", "distributed.pp_engine=gpipe"], ["pp_engine='gpipe'", "1f1b"]),
    (["--set", "model.norm_type=batchnorm"], ["norm_type='batchnorm'"]),
    (["--set", "training.dtype=float64"], ["dtype='float64'"]),
    (["--set", "seed"], ["section.key=value"]),
    (["--model_name", "no/such-model-anywhere"], ["not a preset", "no/such-model-anywhere"]),
    (["--model_name", "smollm-360m"], ["did you mean 'SmolLM-360M'", "case-sensitive"]),
    (["--model_name", "SmolLM-36OM"], ["could not be fetched", "did you mean 'SmolLM-360M'"]),
    (["--set", "model.attn_implementation=flash_attention_2"], ["flash_attention_2",
                                                                "use_cpu", "'sdpa'"]),
    (["--seq_len", "4096"], ["seq_length=4096 > model.max_position_embeddings=2048",
                             "shorten the sequence, or raise model.max_position_embeddings"]),
]


@pytest.mark.parametrize("flags,words", BAD_FLAGS)
def test_create_config_refuses_before_writing(tmp_path, capsys, monkeypatch, flags, words):
    # an unknown hub id: the hub unreachable at once (offline mode), not after the client's
    # five retries with backoff (~23 s) on a machine without its network
    from huggingface_hub import constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as exit_info:
        create_config.main(["--out_dir", str(tmp_path), "--exp_name", "bad", "--use_cpu"] + flags)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    for word in words:
        assert word in message, (word, message)
    assert "Traceback" not in message
    blamed = [line.split("valid keys:")[0] for line in message.splitlines()]
    assert not any("='auto'" in line for line in blamed), message   # "auto" is never at fault
    assert not (tmp_path / "bad").exists()


def test_all_problems_reported_at_once():
    raw = Config().to_dict()
    raw["distributed"].update(tp_size=3, pp_size=9)
    raw["training"]["seqq"] = 1
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    text = str(e.value)
    assert "tp_size=3" in text and "pp_size=9" in text and "training.seqq" in text


def test_cuda_graphs_refuses_what_a_graph_cannot_hold():
    raw = Config().to_dict()
    raw["distributed"].update(tp_size=2, cp_size=2, use_cpu=True)
    raw["training"].update(cuda_graphs=True, activation_checkpointing="full", compile=True)
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    text = str(e.value)
    for words in ("needs CUDA GPUs", "distributed.tp_size=2 and distributed.cp_size=2",
                  "activation_checkpointing='none'", "choose one"):
        assert words in text, (words, text)
    raw = Config().to_dict()
    raw["distributed"].update(dp_size=2)    # reductions run after the backward graph: fine
    raw["training"].update(cuda_graphs=True)
    config_from_dict(raw)
    # our selective recomputes inside an autograd function (tests/test_cuda_graphs_gpu.py);
    # the torch kernels' selective is torch's checkpoint: refused
    raw["model"]["kernels"] = "triton"
    raw["training"]["activation_checkpointing"] = "selective"
    config_from_dict(raw)
    raw["model"]["kernels"] = "torch"
    with pytest.raises(ConfigError, match="or 'selective' with model.kernels='triton'"):
        config_from_dict(raw)


def test_world_size_mismatch_names_every_factor():
    raw = Config().to_dict()
    raw["distributed"].update(dp_size=2, tp_size=2, pp_size=2)
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw, world_size=4)
    assert "2*2*2*1 = 8" in str(e.value) and "--nproc_per_node 8" in str(e.value)
    assert "but 4 processes were launched" in str(e.value)
    with pytest.raises(ConfigError, match="but 1 process was launched"):
        config_from_dict(raw, world_size=1)


def test_written_config_round_trips(tmp_path):
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "ok", "--dp", "2",
                               "--tp", "2", "--pp", "2", "--use_cpu", "--hf_token", "SECRET",
                               "--set", "training.warmup_steps=3",
                               "--set", "dataset.name=synthetic"])
    config = load_config(path, world_size=8)
    assert (config.distributed.dp_size, config.distributed.tp_size) == (2, 2)
    assert config.training.warmup_steps == 3 and config.dataset.name == "synthetic"
    assert config.training.dtype == "float32"          # --use_cpu implies fp32
    assert "SECRET" not in open(path).read()


def test_hub_id_of_a_preset_resolves_offline(tmp_path):
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "smol",
                               "--model_name", "HuggingFaceTB/SmolLM-1.7B",
                               "--num_hidden_layers", "15", "--dp", "8", "--mbs", "4",
                               "--grad_acc_steps", "32", "--seq_len", "1024"])
    m = json.load(open(path))["model"]
    assert (m["hidden_size"], m["num_hidden_layers"], m["vocab_size"]) == (2048, 15, 49152)


def test_an_unreachable_hub_is_said_in_one_line_without_the_clients_retries(
        tmp_path, capsys, unreachable_hub):
    # a hub id neither preset nor cached: one request, no backoff between retries (the
    # client's download waits 1+2+4+8+8 s, a warning line a try)
    with pytest.raises(SystemExit) as exit_info:
        create_config.main(["--out_dir", str(tmp_path), "--model_name", "someone/nothing"])
    assert exit_info.value.code == 2 and unreachable_hub == []
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "could not be fetched from the Hugging Face hub" in err and "network" in err


def test_local_hf_directory_resolves(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=300, rope_theta=1e4,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", rope_scaling=None)))
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "loc",
                               "--model_name", str(d)])
    m = json.load(open(path))["model"]
    assert (m["vocab_size"], m["num_key_value_heads"], m["tie_word_embeddings"]) == (300, 2, True)
    (d / "config.json").write_text(json.dumps(dict(model_type="llama", hidden_size=64,
                                                   hidden_act="gelu", num_attention_heads=4)))
    with pytest.raises(SystemExit):
        create_config.main(["--out_dir", str(tmp_path), "--exp_name", "gelu",
                            "--model_name", str(d)])


def run_train(config_path, pythonpath=ROOT):
    env = dict(os.environ, PYTHONPATH=pythonpath)
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config",
                           str(config_path)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_train_refuses_bad_configs_with_exit_code(tmp_path):
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "dp2", "--dp", "2",
                               "--use_cpu"])
    proc = run_train(path)          # one process, but the layout needs two
    assert proc.returncode == 2
    assert "--nproc_per_node 2" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    proc = run_train(bad)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr
    proc = run_train(tmp_path / "missing.json")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    # an optional package the config asks for and this machine lacks (a wandb that cannot be
    # imported comes first on the path): named with its fix before any step, no traceback
    blocker = tmp_path / "no_wandb"
    blocker.mkdir()
    (blocker / "wandb.py").write_text("raise ImportError('blocked by the test')\n")
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "wandb", "--use_cpu",
                               "--set", "logging.use_wandb=true"])
    proc = run_train(path, pythonpath=f"{blocker}{os.pathsep}{ROOT}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "logging.use_wandb=true needs wandb" in proc.stderr and "or set it to false" in \
        proc.stderr and "Traceback" not in proc.stderr


def test_missing_fast_path_packages_are_named_with_their_fix(monkeypatch):
    """flash-attn asked for by name is checked when the attention is resolved (the run is
    built), not at the first forward; 'auto' falls back to SDPA without it."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)      # not importable, here or not
    with pytest.raises(MissingPackage, match="flash_attention_2.*flash-attn.*'sdpa'"):
        resolve_attention("flash_attention_2", "cuda")
    assert resolve_attention("auto", "cuda") is sdpa_attention


def test_the_config_reference_lists_every_key():
    reference = open(os.path.join(ROOT, "docs", "config.md")).read()
    for section, values in Config().to_dict().items():
        for key in values:
            assert f"| `{section}.{key}` |" in reference, f"{section}.{key} missing from docs"


def test_auto_resolves_to_the_fast_path_on_gpus_and_the_reference_on_cpu():
    """model.kernels, training.fused_loss and training.activation_checkpointing default to
    "auto", resolved at load from the layout; an explicit value is never touched."""
    def chosen(**sections):
        c = config_from_dict(sections)
        return (c.model.kernels, c.training.fused_loss, c.training.activation_checkpointing)
    assert chosen() == ("triton", "triton", "selective")                     # a GPU run
    assert chosen(distributed={"use_cpu": True}) == ("torch", "none", "none")
    # under tensor parallelism the head is vocab-parallel: its own loss, no fused one
    assert chosen(distributed={"tp_size": 2}) == ("triton", "none", "selective")
    # with the compiler, the readable ops for it to fuse; torch's checkpoint is not chosen
    assert chosen(training={"compile": True}) == ("torch", "triton", "none")
    assert chosen(model={"kernels": "torch"}) == ("torch", "triton", "none")
    assert chosen(training={"fused_loss": "chunked", "activation_checkpointing": "full"}) == (
        "triton", "chunked", "full")
    c = config_from_dict({"distributed": {"use_cpu": True}})
    record = {"model.kernels": "torch", "training.fused_loss": "none",
              "training.activation_checkpointing": "none", "training.cuda_graphs": False,
              "training.fp8": "none"}
    assert c.auto_resolved == record
    resolve_auto(c)                   # apply_speed resolves again: nothing left, record kept
    assert c.auto_resolved == record
    kept = config_from_dict({}, resolve=False)          # what create_config.py writes
    assert (kept.model.kernels, kept.training.fused_loss,
            kept.training.activation_checkpointing) == ("auto", "auto", "auto")


def test_cuda_graphs_auto_captures_one_gpu_runs_of_small_models(monkeypatch):
    """training.cuda_graphs="auto": on for one GPU below hidden_size 2048 when a graph can
    hold the layers; off under any parallel axis, for wider models, on CPU, where the config
    rules graphs out (then no refusal: "auto" never refuses), and with kernels no GPU test
    has captured (liger's, flash-attn). Explicit values stay;
    anything but true, false and "auto" is refused by name."""
    def graphs(**sections):
        return config_from_dict(sections).training.cuda_graphs
    wide = {"hidden_size": 2048, "intermediate_size": 4096, "num_attention_heads": 16,
            "num_key_value_heads": 4}
    assert graphs() is True
    assert graphs(model=wide) is False                      # 1.7B: measured slower
    assert graphs(distributed={"use_cpu": True}) is False
    for axis in ("dp_size", "tp_size", "pp_size", "cp_size"):
        assert graphs(distributed={axis: 2}) is False, axis
    assert graphs(training={"compile": True}) is False
    assert graphs(training={"activation_checkpointing": "full"}) is False
    assert graphs(model={"kernels": "torch"}, training={"activation_checkpointing":
                                                        "selective"}) is False
    assert graphs(distributed={"zero_stage": 3}) is False
    assert graphs(model={"kernels": "liger"}) is False      # not captured by the GPU tests
    assert graphs(model={"attn_implementation": "flash_attention_2"}) is False
    assert graphs(model={"attn_implementation": "sdpa"}) is True
    assert graphs(model=wide, training={"cuda_graphs": True}) is True
    assert graphs(training={"cuda_graphs": False}) is False
    assert config_from_dict({}, resolve=False).training.cuda_graphs == "auto"
    from picotron.config import features as config_features   # "auto" attention: flash-attn there
    monkeypatch.setattr(config_features, "flash_attn_installed", lambda: True)
    assert graphs() is False and graphs(model={"attn_implementation": "sdpa"}) is True
    with pytest.raises(ConfigError, match=r"training.cuda_graphs='on' must be true, false or "
                                          r"'auto'"):
        config_from_dict({"training": {"cuda_graphs": "on"}})


def test_a_fused_loss_under_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError, match="training.fused_loss='chunked' applies the whole "
                                          "output head on one rank"):
        config_from_dict({"distributed": {"tp_size": 2, "use_cpu": True},
                          "training": {"fused_loss": "chunked"}})


def test_a_home_relative_path_is_the_home_folder(tmp_path, monkeypatch, capsys):
    """bash leaves '~' alone after '=' (`--out_dir=~/x`, `--set logging.run_dir=~/x`): such a
    path is the home folder's, not a folder named '~' in the working directory; an --out_dir
    that cannot hold a folder is refused before anything is written."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    path = create_config.main(["--out_dir=~/configs", "--exp_name", "x", "--use_cpu",
                               "--set", "logging.run_dir=~/runs/x"])
    assert path == str(tmp_path / "home" / "configs" / "x" / "config.json")
    assert load_config(path).logging.run_dir == str(tmp_path / "home" / "runs" / "x")
    assert json.load(open(path))["logging"]["run_dir"] == "~/runs/x"    # for any machine
    # a checkpoint saved with the '~' unexpanded resumes under the expanded path
    from picotron.checkpoint.changes import run_changes
    saved = config_from_dict({"dataset": {"name": "~/corpus.jsonl"}})
    now = config_from_dict({"dataset": {"name": str(tmp_path / "home" / "corpus.jsonl")}})
    assert run_changes(saved, now, None, None) == {}
    (tmp_path / "home" / "tok").mkdir()                     # checked where it will be read
    config_from_dict({"dataset": {"name": "synthetic", "tokenizer": "~/tok"}})
    assert not (tmp_path / "~").exists()
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as stopped:
        create_config.main(["--out_dir", str(tmp_path / "afile"), "--exp_name", "x"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "cannot write the config to" in err and \
        "is not a folder" in err and "Traceback" not in err, err
