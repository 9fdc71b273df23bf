"""Run train.py's main for several configs in one launch, one after the other.

    torchrun --nproc_per_node 8 tests/workers/train_many.py CONFIG [CONFIG ...]

(the tests start it with tests/launch.py's launch_many, on forked ranks). Every config needs
the launch's world size. The process group is made once and kept: each training builds its
own grid, model, data and optimizer from its config, exactly as a fresh `torchrun train.py
--config CONFIG` would, without paying a launch per config on the 2-core CI machine. A
training that fails stops the launch (its error names the config); the ones before it have
written their metrics and checkpoints.
"""
import datetime
import sys

import torch.distributed as dist

import train


def main(configs):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    for path in configs:
        try:
            train.main(["--config", path])
        except Exception as e:
            raise RuntimeError(f"training {path} failed: {e}") from e
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
