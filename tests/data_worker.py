"""torchrun worker for tests/test_data.py: every rank builds the data (rank 0 tokenizes, the
others wait for its cache) and writes the windows its DP rank gets for the first steps.

    torchrun --nproc_per_node 2 tests/data_worker.py CONFIG STEPS OUT_DIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from picotron.config import load_config  # noqa: E402
from picotron.data.windows import build_train_val, micro_batch  # noqa: E402
from picotron.process_group_manager import ProcessGroupManager  # noqa: E402

config_path, steps, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
config = load_config(config_path, world_size=dist.get_world_size())
pgm = ProcessGroupManager.from_config(config)
data, _ = build_train_val(config, os.path.dirname(config_path))
per_step = []
for step in range(steps):
    windows = []
    for micro in range(config.training.gradient_accumulation_steps):
        inputs, targets = micro_batch(data, step, micro, config, pgm)
        windows += torch.cat([inputs, targets[:, -1:]], dim=1).tolist()   # (mbs, T+1)
    per_step.append(windows)
with open(os.path.join(out_dir, f"rank{pgm.global_rank}.json"), "w") as f:
    json.dump({"dp_rank": pgm.dp_rank, "steps": per_step}, f)
dist.destroy_process_group()
