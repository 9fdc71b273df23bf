"""What a checkpoint save costs the training loop, synchronous against `checkpoint.async_save`.

    python bench/checkpoint_save.py [--model_name SmolLM-360M] [--seq_len 2048] [--mbs 8]
                                    [--steps 40] [--every 10] [--out DIR] [--cpu]

One process (one GPU), the train.py path (build_training, queue_step) on synthetic data, a
save every `--every` steps into a temporary folder, once with each saver. Each step is timed
to the end of its GPU work (a synchronize, the same in both rows). Per row:
- blocked_s: how long `save()` holds the training loop (sync: the whole save; async: the
  snapshot, i.e. the gathers and the copies to pinned host memory);
- write_s: from the save to the checkpoint being complete on disk (async: the background
  writer, seen from the loop, so to the step boundary after it finished);
- step_s: the median step time of the steps while a writer runs, and of the others: what
  the background thread (file writes, sha256, the GIL) costs the steps it overlaps;
- the checkpoint's size. `--cpu` runs the `debug` model on the CPU, to try the script.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import create_config  # noqa: E402
import train  # noqa: E402
from picotron.checkpoint.async_save import CheckpointSaver  # noqa: E402
from picotron.data.windows import StepBatches, build_train_val, data_state  # noqa: E402


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(config_path: str, asynchronous: bool, steps: int, every: int) -> dict:
    config, pgm, device = train.setup(config_path)
    run_dir = os.path.dirname(config_path)
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    data, _ = build_train_val(config, run_dir)
    batches = StepBatches(data, config, pgm, device)
    saver = CheckpointSaver(asynchronous)
    root = os.path.join(run_dir, "checkpoints")
    step_s, busy, blocked, writes, started = [], [], [], [], None
    for step in range(steps):
        writing = saver.thread is not None and saver.thread.is_alive()
        t0 = time.perf_counter()
        train.queue_step(model, loss_fn, grads, optimizer, batches, step, config, pgm, device)
        sync_device(device)
        (busy if writing else step_s).append(time.perf_counter() - t0)
        if started is not None and not (saver.thread and saver.thread.is_alive()):
            writes.append(time.perf_counter() - started)
            started = None
        if (step + 1) % every == 0:
            if started is not None:               # still writing: the save below waits
                saver.wait()
                writes.append(time.perf_counter() - started)
            t0 = time.perf_counter()
            saver.save(model, optimizer, pgm, config, root, step + 1, {
                "tokens_seen": (step + 1) * config.global_batch_size * config.training.seq_length,
                "data": data_state(config, step + 1, data), "accepted_changes": []})
            blocked.append(time.perf_counter() - t0)
            started = None if not asynchronous else t0
            if not asynchronous:
                writes.append(blocked[-1])
    saver.wait()
    if started is not None:
        writes.append(time.perf_counter() - started)
    last = sorted(d for d in os.listdir(root) if d.startswith("step_"))[-1]
    size = sum(os.path.getsize(os.path.join(root, last, f))
               for f in os.listdir(os.path.join(root, last)))
    median = lambda xs: round(statistics.median(xs), 4) if xs else None    # noqa: E731
    return {"saver": "async" if asynchronous else "sync", "saves": len(blocked),
            "blocked_s": median(blocked), "write_s": median(writes),
            "step_s_while_writing": median(busy), "step_s_otherwise": median(step_s[2:]),
            "checkpoint_gb": round(size / 1e9, 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name", default="SmolLM-360M",
                        help="model preset (default: %(default)s)")
    parser.add_argument("--seq_len", type=int, default=2048, help="sequence length (default: 2048)")
    parser.add_argument("--mbs", type=int, default=8, help="micro-batch size (default: 8)")
    parser.add_argument("--steps", type=int, default=40,
                        help="training steps per saver (default: 40)")
    parser.add_argument("--every", type=int, default=10,
                        help="steps between two saves (default: 10)")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="where to write checkpoint_save.json (default: print only)")
    parser.add_argument("--cpu", action="store_true", help="the debug model on the CPU")
    args = parser.parse_args()
    flags = ["--model_name", "debug" if args.cpu else args.model_name, "--seq_len",
             str(64 if args.cpu else args.seq_len), "--mbs", str(2 if args.cpu else args.mbs),
             "--dataset_name", "synthetic", "--total_train_steps", str(args.steps)]
    flags += ["--use_cpu"] if args.cpu else []
    work = tempfile.mkdtemp(prefix="checkpoint_save_")
    rows = []
    try:
        for asynchronous in (False, True):
            name = "async" if asynchronous else "sync"
            path = create_config.main(["--out_dir", work, "--exp_name", name] + flags)
            rows.append(measure(path, asynchronous, args.steps, args.every))
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(os.path.join(work, name, "checkpoints"), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "checkpoint_save.json"), "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
