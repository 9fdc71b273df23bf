"""What every bench row is built from: a preset's model section (`shape_model`, with "NAME@L"
for a preset's first L layers), the base config (`base_config`: bf16, fused AdamW, synthetic
tokens) and the weights (`cached_materialize`: drawn once per shape, then loaded). Used by
bench_speed.py and, through it, by the other benches.
"""
import os

import torch

from picotron.model import materialize
from picotron.config.presets import resolve_model

CACHE = "/tmp/picotron_bench_weights_{}.pt"


def cached_materialize(model, seed, device, dtype, std=0.02):
    """train.build_model's materialize, drawn once per shape and loaded afterwards (each row
    runs in its own process): the same weights, without 30 s of CPU sampling per 1.7B row."""
    path = CACHE.format(f"{model.cfg.name}-{model.cfg.num_hidden_layers}L")   # NAME@L too
    if not os.path.exists(path):
        materialize(model, seed, device, dtype, std)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        return model
    model.to_empty(device=device).to(dtype)
    model.load_state_dict(torch.load(path, map_location=device))
    return model


def shape_model(shape, seq=0):
    """A preset's model section; "NAME@L" keeps its first L decoder layers (a shape too large
    for one GPU, e.g. Llama-3-8B@8, measured per layer). `seq`: the sequence length the bench
    runs, which the model's positions are raised to (RoPE extends to any; the bench trains
    from scratch, so no pretrained length is exceeded)."""
    name, _, layers = shape.partition("@")
    model = resolve_model(name)
    if layers:
        model["num_hidden_layers"] = int(layers)
    model["max_position_embeddings"] = max(model.get("max_position_embeddings", 0), seq)
    return model


def base_config(shape, mbs, seq):
    return {"model": shape_model(shape, seq),
            "training": {"micro_batch_size": mbs, "seq_length": seq, "dtype": "bfloat16",
                         "use_fused_adam": True, "total_train_steps": 1000, "warmup_steps": 1},
            "dataset": {"name": "synthetic"}}
