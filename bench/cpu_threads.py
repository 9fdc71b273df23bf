"""The quick start's step time under CPU thread policies, on an idle machine and with one core
kept busy by another program (`yes > /dev/null`, as a laptop's browser or IDE does).

    python bench/cpu_threads.py --procs 1 --candidates 1 2 2P --repeats 2 --steps 10

For each repeat, each machine state (idle, busy) and each candidate in turn (interleaved, so
that other load on the machine falls on all of them alike): train the debug preset (`python
train.py`'s config; on 2 processes dp 2, on 16 dp 8 x tp 2, the same global batch) for
--steps steps, and print the median step time of the steps after the first two
(metrics.jsonl's step_time_s) with /proc/loadavg's 1-minute figure before the run. A candidate is a thread count per process (distributed.cpu_threads)
under OMP_WAIT_POLICY=ACTIVE (OpenMP's threads spin at a barrier, libgomp's default), or with
a P (`2P`) under OMP_WAIT_POLICY=PASSIVE (they sleep there)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the preset's global batch (8 sequences of 256 tokens) on 1, 2 and 16 processes
LAYOUTS = {1: [], 2: ["--dp", "2", "--mbs", "4"], 16: ["--dp", "8", "--tp", "2", "--mbs", "1"]}


def step_time(procs: int, threads: int, passive: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, os.path.join(ROOT, "create_config.py"), "--out_dir", out,
                        "--exp_name", "t", "--use_cpu", *LAYOUTS[procs], "--total_train_steps",
                        str(steps), "--set", "checkpoint.save_final=false"],
                       check=True, capture_output=True)
        config = os.path.join(out, "t", "config.json")
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE" if passive else "ACTIVE")
        launch = ["--nproc_per_node", str(procs)] if procs > 1 else []
        subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *launch, "--config",
                        config, "--set", f"distributed.cpu_threads={threads}"],
                       check=True, capture_output=True, env=env, cwd=ROOT)
        with open(os.path.join(out, "t", "metrics.jsonl")) as f:
            times = [json.loads(line)["step_time_s"] for line in f if '"loss"' in line]
    return statistics.median(times[2:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--procs", type=int, default=1, choices=sorted(LAYOUTS),
                   help="CPU processes training together (default 1)")
    p.add_argument("--candidates", nargs="+", default=["1", "2", "2P"],
                   help="thread counts per process; a P after one: OMP_WAIT_POLICY=PASSIVE, "
                        "else ACTIVE (default: 1 2 2P)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over states and candidates")
    p.add_argument("--steps", type=int, default=12, help="steps per run (median of 3..steps)")
    p.add_argument("--states", nargs="+", default=["idle", "busy"],
                   help="idle, and busy: one core kept busy by `yes` (default both)")
    args = p.parse_args()
    candidates = [(int(c.rstrip("P")), c.endswith("P")) for c in args.candidates]
    for repeat in range(args.repeats):
        for state in args.states:
            busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if state == "busy" else None
            try:
                for threads, passive in candidates:
                    with open("/proc/loadavg") as f:
                        load = f.read().split()[0]
                    ms = 1000 * step_time(args.procs, threads, passive, args.steps)
                    print(f"procs {args.procs} threads {threads}{' PASSIVE' if passive else ''} "
                          f"{state} repeat {repeat}: {ms:.0f} ms/step (load {load} before)",
                          flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()


if __name__ == "__main__":
    main()
