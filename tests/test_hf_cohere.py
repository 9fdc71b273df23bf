"""PaLM-style checkpoints export as transformers' CohereForCausalLM with the same logits and
greedy generations, and a CohereForCausalLM loads back (init_from) with the same logits."""
import json
import os

import pytest
import torch

from launch import launch, read_metrics, write_config
from test_hf_io import hf_greedy, our_model, save_tiny_checkpoint
from picotron.checkpoint.checkpoint import CheckpointError
from picotron.config import ConfigError, ModelConfig
from picotron.data.windows import build_data, micro_batch
from picotron.run.generate import load_for_inference, sample
from picotron.checkpoint.hf_cohere import from_cohere_rows, to_cohere_rows
from picotron.checkpoint.hf_io import export_hf, load_hf_weights
from picotron.loss import causal_lm_loss
from picotron.config.presets import resolve_model
from picotron.process_group_manager import ProcessGroupManager

PALM = {"parallel_residual": True, "norm_type": "layernorm", "rms_norm_eps": 1e-6,
        "num_attention_heads": 4}


@pytest.mark.parametrize("kv_heads,tie", [(1, True), (2, False)])
def test_palm_style_exports_as_cohere_with_equal_logits(tmp_path, kv_heads, tie):
    from transformers import AutoModelForCausalLM, AutoTokenizer, CohereForCausalLM
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", num_key_value_heads=kv_heads,
                                tie_word_embeddings=tie, rope_theta=500.0, **PALM)
    out = export_hf(ckpt, str(tmp_path / "export"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["logit_scale"] == 1.0 and config["layer_norm_eps"] == 1e-6
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert isinstance(back, CohereForCausalLM)
    assert back.config.use_qk_norm is False and back.config.tie_word_embeddings == tie
    ours, _ = load_for_inference(ckpt)
    tok = AutoTokenizer.from_pretrained(out)
    prompt = torch.tensor(tok("<page><title>enwik", add_special_tokens=False)["input_ids"])
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = back(x).logits
        assert (ours(x) - theirs).abs().max() < 1e-5
        assert theirs.std() > 1e-2                       # not a trivially equal pair
    assert sample(ours, prompt, 12, temperature=0, eos_token_id=0).tolist() == \
        hf_greedy(back, prompt, 12, 0)
    # Without the q/k row order, Cohere's interleaved RoPE would compute something else.
    raw = {n: t for n, t in back.state_dict().items()}
    for name in [n for n in raw if n.endswith(("q_proj.weight", "k_proj.weight"))]:
        raw[name] = from_cohere_rows(raw[name], 8)
    back.load_state_dict(raw)
    with torch.no_grad():
        assert (ours(x) - back(x).logits).abs().max() > 1e-3


def test_a_transformers_cohere_loads_with_equal_logits(tmp_path):
    from transformers import CohereConfig, CohereForCausalLM
    torch.manual_seed(0)
    hf = CohereForCausalLM(CohereConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
        layer_norm_eps=1e-5, logit_scale=1.0, rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1000.0},
        pad_token_id=None)).eval()
    with torch.no_grad():                 # LayerNorm gains away from 1, so they must load
        for n, p in hf.named_parameters():
            if "layernorm" in n or n == "model.norm.weight":
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig(**resolve_model(str(tmp_path)))
    assert (cfg.parallel_residual, cfg.norm_type, cfg.tie_word_embeddings) == \
        (True, "layernorm", True)
    assert cfg.num_key_value_heads == 1 and cfg.rope_theta == 1000.0
    model = our_model(cfg)
    load_hf_weights(model, str(tmp_path))
    x = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(x) - hf(x).logits).abs().max() < 1e-5
    # a Llama-style config does not take these weights silently
    llama = our_model(ModelConfig(**{**resolve_model(str(tmp_path)), "norm_type": "rmsnorm"}))
    with pytest.raises(CheckpointError, match="CohereForCausalLM"):
        load_hf_weights(llama, str(tmp_path))


def test_what_cohere_cannot_hold_is_refused(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", parallel_residual=True, norm_type="rmsnorm")
    with pytest.raises(CheckpointError, match="mixes the two blocks"):
        export_hf(ckpt, str(tmp_path / "export"))
    assert not os.path.exists(tmp_path / "export")
    os.makedirs(tmp_path / "released")
    with open(tmp_path / "released" / "config.json", "w") as f:
        json.dump({"model_type": "cohere", "vocab_size": 300, "hidden_size": 32,
                   "num_attention_heads": 4, "use_qk_norm": True}, f)   # logit_scale: 0.0625
    with pytest.raises(ConfigError, match=r"logit_scale=0\.0625.*use_qk_norm=True"):
        resolve_model(str(tmp_path / "released"))


def test_rows_of_whole_heads_convert_alone():
    """Tensor parallelism reads a slice of whole heads: converting the slice is slicing the
    converted tensor."""
    w = torch.randn(4 * 8, 5)
    cohere = to_cohere_rows(w, 8)
    assert torch.equal(from_cohere_rows(cohere, 8), w)
    assert torch.equal(from_cohere_rows(cohere[16:32], 8), w[16:32])
    assert torch.equal(cohere[0, :], w[0]) and torch.equal(cohere[1], w[4])   # x_0, x_{D/2}


def test_train_from_an_exported_palm_model(tmp_path):
    """Export -> --model_name the Cohere directory (init_from): the first step's loss is the
    Cohere model's loss on the first batch."""
    from transformers import AutoModelForCausalLM
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True, **PALM)
    out = export_hf(ckpt, str(tmp_path / "cohere"))
    path = write_config(tmp_path, "ft", ["--model_name", out, "--mbs", "2", "--seq_len", "32",
                                         "--total_train_steps", "1",
                                         "--set", "dataset.tokenizer=byte"])
    assert json.load(open(path))["checkpoint"]["init_from"] == os.path.abspath(out)
    launch(path, 1)
    from picotron.config import load_config
    config = load_config(path)
    assert config.model.parallel_residual and config.model.norm_type == "layernorm"
    x, y = micro_batch(build_data(config), 0, 0, config, ProcessGroupManager())
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        expected = causal_lm_loss(hf(x).logits, y).item()
    assert abs(read_metrics(path)[0]["loss"] - expected) < 1e-5
