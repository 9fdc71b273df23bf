"""Where a multi-rank start's time goes, rank by rank: imports (process start to train.py
imported), set-up (config, process groups, checks), torch._dynamo's import (which torch makes
itself, at the first meta-device nn.Embedding or torch.optim optimizer: counted apart so that
"model" is the build alone), the model's build (train.py's build_training: skeleton, axes,
weights, buckets, optimizer) and the data (token cache and windows), each the seconds the
phase took on that rank; rank 0 prints min / median / max over
the ranks, and the wall time from the first rank's start to every rank ready.

    torchrun --nproc_per_node 16 bench/start_phases.py \\
        --config tmp/start16/config.json
(the config from `python create_config.py --out_dir tmp --exp_name start16 --use_cpu --dp 4
--tp 2 --pp 2`)."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from picotron.utils import process_age  # noqa: E402

IMPORTED_AT = process_age()      # before train.py's imports: the interpreter and site
started = time.perf_counter()
import train  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from picotron.data.windows import build_train_val  # noqa: E402
IMPORTS_S = (IMPORTED_AT or 0.0) + time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config", required=True, help="the run's config.json (its world size "
                                                   "must be the launch's)")
    config_path = p.parse_args().config
    phases = {"imports": IMPORTS_S}
    mark = time.perf_counter()
    for name, step in [("set-up", lambda: train.setup(config_path)),
                       ("dynamo", lambda: __import__("torch._dynamo")),
                       ("model", lambda: train.build_training(*setup_out)),
                       ("data", lambda: build_train_val(setup_out[0], os.path.dirname(
                           os.path.abspath(config_path))))]:
        out = step()
        if name == "set-up":
            setup_out = out
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now
    # when this rank was ready, on the host's clock (every rank is on this host)
    ready = torch.tensor([time.time(), time.time() - (process_age() or 0.0)], dtype=torch.float64)
    table = [torch.zeros(len(phases), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(table, torch.tensor(list(phases.values()), dtype=torch.float64))
    times = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(times, ready)
    if dist.get_rank() == 0:
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        print(f"{dist.get_world_size()} ranks, {torch.get_num_threads()} threads each, load "
              f"{load}; seconds per rank: min / median / max")
        for i, name in enumerate(phases):
            column = [row[i].item() for row in table]
            print(f"  {name:7s} {min(column):6.1f} {statistics.median(column):6.1f} "
                  f"{max(column):6.1f}")
        first_start = min(t[1].item() for t in times)
        print(f"  all ready {max(t[0].item() for t in times) - first_start:.1f}s after the "
              f"first rank started")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
