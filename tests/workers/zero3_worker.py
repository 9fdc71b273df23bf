"""Train several configs in one launch (as train_many.py), then measure what ZeRO-3 holds.

    torchrun --nproc_per_node N tests/workers/zero3_worker.py RESULT_JSON MEMORY_CONFIG \
        [CONFIG ...]

After the trainings, MEMORY_CONFIG (a zero_stage=3 config of this world size) is built and
trained for one step; each rank then counts the bytes of parameter storage it holds: every
storage the model's parameters point into, plus the shards the optimizer steps (which ZeRO-3
keeps outside the model), each storage once. It also records, at every layer's forward and
backward, how many layers were gathered. Rank r writes RESULT_JSON.r.
"""
import datetime
import json
import os
import sys

import torch.distributed as dist

import train
from picotron.data.windows import StepBatches, build_train_val


def held_parameter_bytes(model, grads) -> int:
    storages = {}
    tensors = list(model.parameters()) + [grads.param_shard(b) for b in grads.buckets]
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(storages.values())


def gathered_layers(grads) -> int:
    return sum(u.state != "free" for u in grads.units[:-1])       # the root unit left out


def measure(config_path: str) -> dict:
    config, pgm, device = train.setup(config_path)
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    peaks = []          # layers gathered (or being gathered) as each layer starts, both ways
    for name in ("before_forward", "before_backward"):
        def counted(i, original=getattr(grads, name)):
            original(i)
            peaks.append(gathered_layers(grads))
        setattr(grads, name, counted)
    data, _ = build_train_val(config, os.path.dirname(config_path))
    batches = StepBatches(data, config, pgm, device)
    values = train.queue_step(model, loss_fn, grads, optimizer, batches, 0, config, pgm, device)
    values.read()                   # the step has run
    model_numel = sum(p.numel() for p in model.parameters())
    return {"held_bytes": held_parameter_bytes(model, grads),
            "model_bytes": model_numel * 4,           # fp32: what one replica holds
            "buckets": len(grads.buckets), "shards": grads.shards,
            "gathered_after_step": gathered_layers(grads),
            "max_gathered_layers": max(peaks), "layers": len(model.layers)}


def main(result_path: str, memory_config: str, configs):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    for path in configs:
        try:
            train.main(["--config", path])
        except Exception as e:
            raise RuntimeError(f"training {path} failed: {e}") from e
    result = measure(memory_config)
    with open(f"{result_path}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
