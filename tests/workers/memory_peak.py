"""The resident-memory peak of two real training steps on CPU, for tests/test_memory_plan.py.

    python tests/workers/memory_peak.py CONFIG_JSON [CONFIG_JSON ...]

For each config (the raw JSON dict), one after the other: train.py's build_training, then two
queue_steps (the second has AdamW's moments), and one line "PEAK <bytes>": the growth of the
process's resident-set high-water mark (VmHWM) over the run, the mark being
reset to the current resident set before each (Linux's clear_refs). Honest only with
glibc's mmap threshold fixed low (MALLOC_MMAP_THRESHOLD_, set by the test): every tensor of
more than 64 KiB is then its own mapping, returned to the system when freed, so the resident
set follows the live tensors instead of a heap that keeps freed pages, and nothing of one
config is left resident for the next. A tiny training of each config runs first, so the
libraries' code and thread pools its steps touch are resident before the first mark is read.
"""
import gc
import json
import sys

import torch
import torch.distributed as dist

import train
from picotron.config import config_from_dict
from picotron.data.windows import StepBatches, SyntheticData
from picotron.process_group_manager import ProcessGroupManager


def two_steps(raw: dict):
    config = config_from_dict(raw, world_size=1)
    pgm, device = ProcessGroupManager.from_config(config), torch.device("cpu")
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    data = SyntheticData(config.training.seq_length, config.model.vocab_size, 42)
    batches = StepBatches(data, config, pgm, device)
    for step in range(2):
        train.queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm, device)


def high_water_bytes() -> int:
    """The resident-set high-water mark VmHWM, which clear_refs resets (getrusage's ru_maxrss
    is the process's lifetime peak: clear_refs leaves it, so it hid a config's peak behind an
    earlier, larger one)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024                                  # kB


def reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                # "5": the peak resident set becomes the current one


def main(raw_jsons):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for raw_json in raw_jsons:      # each config's code paths (dtype, loss, ...) at tiny sizes
        warm_up = json.loads(raw_json)
        warm_up["model"] = {**warm_up["model"], "hidden_size": 32, "intermediate_size": 64,
                            "vocab_size": 64, "num_hidden_layers": 1}
        warm_up["training"] = {**warm_up["training"], "micro_batch_size": 1, "seq_length": 16}
        two_steps(warm_up)
    for raw_json in raw_jsons:
        gc.collect()
        reset_high_water()
        before = high_water_bytes()
        two_steps(json.loads(raw_json))
        print(f"PEAK {high_water_bytes() - before}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
