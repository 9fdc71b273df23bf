"""Small local stand-ins for hub downloads: documents in every file format, a BPE tokenizer,
a Llama written by transformers, a one-process group for in-process checkpoint calls, and
triton where requirements.txt installs it."""
import json
import os
import platform

import torch
import torch.distributed as dist

from picotron.process_group_manager import ProcessGroupManager


def import_triton():
    """triton: a requirement on Linux x86_64 (requirements.txt), so a missing one there is a
    broken install and its tests fail; elsewhere (no wheel for it) they skip."""
    import pytest
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        import triton
        return triton
    return pytest.importorskip("triton")


def one_process_group() -> ProcessGroupManager:
    """A 1-rank gloo group in this process (checkpoint saving uses barriers)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return ProcessGroupManager()


def documents(n: int, length: int = None) -> list:
    """n distinct one-line documents; with `length`, each exactly that many UTF-8 bytes."""
    words = ["alpha", "beta", "gamma", "délta", "epsilon", "zeta", "ëta", "theta"]
    docs = []
    for i in range(n):
        text = f"doc {i}: " + " ".join(words[(i * 7 + j) % len(words)] for j in range(i % 5 + 3))
        if length is not None:
            text = (f"{i:04d}" + "abcdefghijklmnopqrstuvwxyz" * 4)[:length]
        docs.append(text)
    return docs


def write_formats(docs: list, root: str) -> dict:
    """The same documents as .txt, .jsonl, .json, .parquet, .arrow, a save_to_disk folder and
    a folder of train/validation .jsonl files; {format: path}."""
    import datasets
    import pyarrow as pa
    os.makedirs(root, exist_ok=True)
    paths = {k: os.path.join(root, f"docs.{k}") for k in ("txt", "jsonl", "json", "parquet",
                                                          "arrow")}
    with open(paths["txt"], "w") as f:
        f.write("\n".join(docs) + "\n")
    rows = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    for k in ("jsonl", "json"):
        with open(paths[k], "w") as f:
            f.write(rows)
    ds = datasets.Dataset.from_dict({"text": docs, "id": list(range(len(docs)))})
    ds.to_parquet(paths["parquet"])
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    with pa.OSFile(paths["arrow"], "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    paths["saved"] = os.path.join(root, "saved")
    ds.save_to_disk(paths["saved"])
    paths["folder"] = os.path.join(root, "folder")
    os.makedirs(paths["folder"])
    for split, part in (("train", docs), ("validation", docs[:4])):
        with open(os.path.join(paths["folder"], f"{split}.jsonl"), "w") as f:
            f.write("".join(json.dumps({"text": d}) + "\n" for d in part))
    return paths


def tiny_tokenizer(out_dir: str, docs: list, vocab_size: int = 300) -> str:
    """A BPE tokenizer trained on `docs`, saved as a Hugging Face tokenizer with EOS </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(docs * 3, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out_dir)
    return out_dir


def tiny_llama(out_dir: str, vocab_size: int = 300, tie: bool = False, shard: str = None,
               seed: int = 0):
    """A random LlamaForCausalLM written by transformers (sharded when `shard` is a size)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=5000.0,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():     # norms away from 1, so a norm that is not loaded shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out_dir, **kwargs)
    return model
