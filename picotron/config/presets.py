"""`--model_name` -> the fields of the config's `model` section.

Tried in this order: a preset shipped in configs/presets/ (by its name, or by the hub id it
mirrors, so `HuggingFaceTB/SmolLM-1.7B` works offline), a local directory holding a Hugging
Face `config.json`, then the Hugging Face hub.
"""
import difflib
import glob
import json
import os

from picotron.config import ConfigError, ModelConfig

# picotron/config/presets.py -> the repository root, which holds configs/
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET_DIR = os.path.join(REPO_ROOT, "configs", "presets")
# Hugging Face config keys whose values change the math in ways this model does not implement.
UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
               "rope_scaling": None, "attention_dropout": 0.0}


# The sizes a config.json must give: no default stands in for them.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")


def presets() -> dict:
    """{preset name: {"hub_id": str or None, "model": {...}}} for every shipped preset."""
    out = {}
    for path in sorted(glob.glob(os.path.join(PRESET_DIR, "*.json"))):
        with open(path) as f:
            out[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
    return out


def model_fields_from_hf(hf: dict, source: str) -> dict:
    """Pick ModelConfig's fields out of a Hugging Face LlamaConfig dict; refuse what we can't
    compute exactly (the message names the key and its value)."""
    problems = [f"{k}={hf[k]!r} (supported: {v!r})" for k, v in UNSUPPORTED.items()
                if k in hf and hf[k] != v and not (k == "attention_dropout" and hf[k] == 0)]
    cohere = hf.get("model_type") == "cohere"       # the PaLM-style block (checkpoint/hf_cohere.py)
    if cohere:
        problems += [f"{k}={hf.get(k, default)!r} (supported: {v!r})" for k, v, default in
                     (("logit_scale", 1.0, 0.0625), ("use_qk_norm", False, False))
                     if hf.get(k, default) != v]
    elif hf.get("model_type", "llama") not in ("llama", "mistral", "qwen2", "smollm3"):
        problems.append(f"model_type={hf.get('model_type')!r} (supported: a Llama-family model, "
                        f"or 'cohere' for the PaLM-style block)")
    rope = hf.get("rope_parameters") or {}      # transformers >= 5 nests rope_theta here
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type={rope['rope_type']!r} (supported: "
                        f"'default')")
    if problems:
        raise ConfigError(f"{source} describes a model this framework cannot run exactly: "
                          + "; ".join(problems))
    missing = [k for k in REQUIRED if k not in hf]
    bad = [f"{k}={hf[k]!r}" for k in REQUIRED + ("num_key_value_heads",) if k in hf and (
        isinstance(hf[k], bool) or not isinstance(hf[k], int) or hf[k] < 1)]
    if missing or bad:       # HF's defaults are not ours: a missing size is not guessed
        raise ConfigError(f"{source} does not describe a model's shape: "
                          + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                      + ([f"{', '.join(bad)} (positive integers)"] if bad
                                         else []))
                          + "; give a complete Hugging Face config.json")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise ConfigError(f"{source} describes a model this framework cannot run exactly: "
                          f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads")
    fields = {k: hf[k] for k in ModelConfig.__dataclass_fields__ if k in hf and k != "name"}
    if "rope_theta" in rope:
        fields["rope_theta"] = float(rope["rope_theta"])
    fields.setdefault("num_key_value_heads", hf.get("num_attention_heads"))
    if cohere:       # one shared LayerNorm, parallel branches; transformers ties by default
        fields.update(parallel_residual=True, norm_type="layernorm",
                      rms_norm_eps=hf.get("layer_norm_eps", 1e-5),
                      tie_word_embeddings=hf.get("tie_word_embeddings", True))
    return {k: v for k, v in fields.items() if v is not None}


def resolve_model(name: str, hf_token: str = None) -> dict:
    """The model section's fields for `name` (preset, local directory, or hub id)."""
    for preset, spec in presets().items():
        if name in (preset, spec.get("hub_id")):
            return {"name": name, **spec["model"]}
    if os.path.isdir(name):
        path = os.path.join(name, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--model_name {name} is a directory without a config.json; "
                              f"point it at a Hugging Face model directory")
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--model_name {name}: cannot read {path} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); point it at a "
                              f"Hugging Face model directory with a valid config.json"
                              ) from None
        if not isinstance(hf, dict):
            raise ConfigError(f"--model_name {name}: {path} holds a JSON "
                              f"{type(hf).__name__}, not a model's config object")
        return {"name": name, **model_fields_from_hf(hf, path)}
    near = near_preset(name)
    if near in presets() and near.lower() == name.lower():      # other capitals: no hub call
        raise ConfigError(f"--model_name '{name}' is not a preset; did you mean '{near}'? "
                          f"(names are case-sensitive)")
    try:
        hf = hub_config(name, hf_token)
    except Exception as e:   # offline, unknown id, gated model: say which and what to do
        guess = f"did you mean '{near}'? " if near else ""
        raise ConfigError(
            f"--model_name '{name}' is not a preset ({', '.join(presets())}), not a local "
            f"directory, and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {guess}check "
            f"the name, your network, or pass --hf_token for a gated model") from None
    return {"name": name, **model_fields_from_hf(hf, f"hub config of {name}")}


def ask_hub(repo_id: str, token: str = None) -> None:
    """One request to the Hugging Face hub for `repo_id`'s metadata, which raises the client's
    error at once where the hub cannot serve it (unreachable, offline mode, unknown id). Asked
    before a download of a repository that is not in the cache: the client's downloads retry
    a failed request five times with backoff (about 23 s a file offline), each try a warning
    line of its own."""
    import logging

    from huggingface_hub import model_info
    client_log = logging.getLogger("huggingface_hub")
    level = client_log.level
    client_log.setLevel(logging.ERROR)      # its failed request's warning line
    try:
        model_info(repo_id, token=token)
    finally:
        client_log.setLevel(level)


def cached_or_hub(load, repo_id: str, token: str = None):
    """`load(**kwargs)` (a transformers from_pretrained of `repo_id`) from the local cache if
    it is there, else downloaded once the hub has answered for it (ask_hub): the one way a
    config or a tokenizer comes from the hub."""
    try:
        return load(local_files_only=True)
    except Exception:        # not in the cache: ask the hub
        pass
    ask_hub(repo_id, token)
    return load()


def hub_config(name: str, hf_token: str = None) -> dict:
    """The hub's config.json of `name` as a dict (cached_or_hub)."""
    from transformers import AutoConfig

    def load(**cache):
        return AutoConfig.from_pretrained(name, token=hf_token, **cache)
    return cached_or_hub(load, name, hf_token).to_dict()


def near_preset(name: str):
    """The preset name or hub id closest to `name` (a typo's likely meaning), or None."""
    names = [n for preset, spec in presets().items() for n in (preset, spec.get("hub_id")) if n]
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), by_lower, n=1, cutoff=0.8)
    return by_lower[close[0]] if close else None


def pretrained_weights(name: str):
    """`name` when it holds weights to start from (a local Hugging Face directory with
    safetensors files, or a hub id that is not a shipped preset), else None."""
    if any(name in (p, spec.get("hub_id")) for p, spec in presets().items()):
        return None
    if os.path.isdir(name):
        has = glob.glob(os.path.join(name, "*.safetensors"))
        return os.path.abspath(name) if has else None
    return name
