"""Hugging Face import (start from released Llama weights) and export (back to transformers);
PaLM-style models go both ways as transformers' CohereForCausalLM (hf_cohere.py).

Our parameter names are Hugging Face Llama names without the `model.` prefix
(`model.layers.3.mlp.up_proj.weight` <-> `layers.3.mlp.up_proj.weight`; `lm_head.weight` has
no prefix in either), and the math is the same (RMSNorm in fp32, RoPE on halves, SwiGLU), so
import and export are renames plus checks. A tied model holds one tensor,
`embed_tokens.weight`; transformers re-ties `lm_head` to it on load.
"""
import glob
import json
import os

import torch
import torch.distributed as dist

from picotron.checkpoint import hf_cohere
from picotron.checkpoint.verify import STATE_FILE
from picotron.checkpoint.export_dir import check_export_dir, export_staging
from picotron.checkpoint.shards import (CheckpointError, SharedCheckpointError, checkpoint_config,
                                        index_shards, load_full_weights, read_slice, slice_bounds)
from picotron.utils import readable_as_usual

IGNORED = ("rotary_emb.inv_freq",)     # buffers some old checkpoints carry; recomputed here


def hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def our_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _weight_files(directory: str) -> list:
    """The safetensors files of a Hugging Face model directory (single file or sharded)."""
    if any(glob.glob(os.path.join(directory, *inner, STATE_FILE)) for inner in
           ((), ("step_*",), ("*", "step_*"))):    # a checkpoint, its folder, its run
        raise SharedCheckpointError(
            f"'{directory}' is a picotron checkpoint, not a Hugging Face model: continue "
            f"that run with checkpoint.load_path, or export it (python export_hf.py "
            f"--checkpoint {directory} --out DIR) and give DIR to checkpoint.init_from")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"]
                           .values()})
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        return files
    bins = glob.glob(os.path.join(directory, "*.bin"))
    raise CheckpointError(f"{directory} has no .safetensors weights"
                          + (" (only PyTorch .bin files: load and re-save them with "
                             "`save_pretrained(..., safe_serialization=True)`)" if bins else ""))


def hf_model_dir(source: str) -> str:
    """A local directory holding `source`'s weights: itself, or a hub snapshot (downloaded by
    rank 0 first; the others then find it in the cache)."""
    if os.path.isdir(source):
        return source
    from huggingface_hub import snapshot_download
    first = not dist.is_initialized() or dist.get_rank() == 0
    path, error = None, None
    for turn in (True, False):
        if first == turn:
            try:
                path = snapshot_download(source, allow_patterns=["*.safetensors", "*.json"])
            except Exception as e:
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if dist.is_initialized():
            dist.barrier()
    if error:
        raise CheckpointError(f"checkpoint.init_from='{source}' is not a local directory and "
                              f"its weights could not be fetched from the hub ({error}); check "
                              f"the id and network, set HF_TOKEN for a gated model, or pass a "
                              f"local directory")
    return path


def load_hf_weights(model, source: str) -> None:
    """Overwrite the model's parameters with the Hugging Face checkpoint at `source` (a local
    directory or hub id); each rank reads only its own slice (`local_slice`). Every tensor is
    checked against the model before any parameter is written; `model.weights_from` then says
    where they came from (train.py prints it before the first step)."""
    from picotron.model import Decoder
    directory = hf_model_dir(source)
    cohere = _model_type(directory) == "cohere"
    if cohere and not hf_cohere.is_palm_style(model.cfg):
        raise SharedCheckpointError(
            f"'{source}' is a CohereForCausalLM (the PaLM-style block), but this config has "
            f"parallel_residual={model.cfg.parallel_residual}, norm_type="
            f"{model.cfg.norm_type!r}; create the config with --model_name pointing at it")
    files = _weight_files(directory)
    index = {our_name(k): v for k, v in index_shards(files).items()
             if not k.endswith(IGNORED)}
    with torch.device("meta"):     # every name of the whole model, whatever this rank holds
        full = dict(Decoder(model.cfg).named_parameters())
    problems = [f"'{hf_name(n)}' missing" for n in full if n not in index]
    problems += [f"'{hf_name(n)}' has shape {index[n][0][2]}, the model wants "
                 f"{list(p.shape)}" for n, p in full.items()
                 if n in index and list(index[n][0][2]) != list(p.shape)]
    tied_head = model.cfg.tie_word_embeddings and "lm_head.weight" in index
    extra = [hf_name(n) for n in index if n not in full and not (tied_head and n.startswith(
        "lm_head."))]
    if extra:
        problems.append(f"tensors the model lacks: {', '.join(extra[:6])}"
                        f"{' ...' if len(extra) > 6 else ''}")
    if problems:
        raise SharedCheckpointError(
            f"the Hugging Face weights in '{source}' do not fit model.* of this config: "
            f"{'; '.join(problems)}. The model section must match the checkpoint's config.json "
            f"(create the config with --model_name pointing at it, without changing layer or "
            f"size flags), or set checkpoint.init_from to null to train from scratch")
    # A pipeline stage's copy of a tied embedding reads the embedding (`tied_name`).
    values = {n: read_slice(index, getattr(p, "tied_name", n), slice_bounds(p))
              for n, p in model.named_parameters()}
    if cohere:                          # its RoPE pairs other rows (hf_cohere.py)
        head_dim = model.cfg.hidden_size // model.cfg.num_attention_heads
        values = {n: hf_cohere.from_cohere_rows(v, head_dim)
                  if hf_cohere.is_rope_rotated(n) else v for n, v in values.items()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(values[n])
    # for the run's first lines: every tensor of the whole model (`full`), each rank its slices
    model.weights_from = (f"loaded from Hugging Face folder {directory} ({len(full)} tensors"
                          + ("" if directory == source else f"; {source} on the hub") + ")")


def _model_type(directory: str) -> str:
    try:
        with open(os.path.join(directory, "config.json")) as f:
            return json.load(f).get("model_type", "llama")
    except (OSError, ValueError):
        return "llama"


def hf_config(model: dict, dtype: str, bos, eos) -> dict:
    """config.json of the equivalent LlamaForCausalLM (rope_theta written in both the classic
    and the transformers >= 5 `rope_parameters` form)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings", "initializer_range")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **{k: model[k] for k in keys}, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "head_dim": model["hidden_size"] // model["num_attention_heads"],
            "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
            "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype, "use_cache": True}


def export_hf(checkpoint_dir: str, out_dir: str, tokenizer: str = None) -> str:
    """Write `out_dir` so that `AutoModelForCausalLM.from_pretrained(out_dir)` and
    `AutoTokenizer.from_pretrained(out_dir)` load the checkpoint's model and tokenizer.
    Refused (ExportError) where it would overwrite other files; over an earlier export it
    removes what that one wrote and this one does not (picotron/checkpoint/export_dir.py)."""
    from picotron.data.tokenizer import check_fits, load_tokenizer, tokenizer_source
    check_export_dir(out_dir)
    config = checkpoint_config(checkpoint_dir)
    m = config.model
    hf_cohere.check_exportable(m)          # Llama, or PaLM-style as CohereForCausalLM
    weights = load_full_weights(checkpoint_dir)
    if hf_cohere.is_palm_style(m):
        weights = hf_cohere.cohere_weights(weights, m.hidden_size // m.num_attention_heads)
    source = tokenizer or tokenizer_source(config, "give --tokenizer")
    # loaded before anything is written: a tokenizer that cannot be loaded leaves no folder
    loaded = load_tokenizer(source, "give --tokenizer")
    check_fits(loaded, m.vocab_size)
    tok = None if source == "byte" else loaded.tok
    with export_staging(out_dir) as staging:
        _write_export(staging, config, weights, tok)
    return out_dir


def _write_export(folder: str, config, weights: dict, tok) -> None:
    """The export's files: the tokenizer's (`tok` None: byte-level), model.safetensors,
    config.json and generation_config.json."""
    from safetensors.torch import save_file

    from picotron.data.tokenizer import save_byte_tokenizer
    m = config.model
    if tok is None:
        save_byte_tokenizer(folder)
        bos, eos = None, 0
    else:
        tok.save_pretrained(folder)
        bos, eos = tok.bos_token_id, tok.eos_token_id
    dtype = str(next(iter(weights.values())).dtype).replace("torch.", "")
    save_file({hf_name(n): t.contiguous() for n, t in weights.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    readable_as_usual(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        write_config = hf_cohere.cohere_config if hf_cohere.is_palm_style(m) else hf_config
        json.dump(write_config(config.to_dict()["model"], dtype, bos, eos), f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos}, f, indent=2)
