"""The whole share_gpu check in one device call, within 10 minutes:

    python bench/share_gpu_device.py [--out DIR]

1. bench/share_gpu_probe.py: which collectives gloo runs on CUDA tensors in this torch;
2. bench/share_gpu_parity.py: every layout against one process, bf16 and the GPU defaults;
3. the same for the tensor-parallel layouts in fp32 (`--set training.dtype=float32`): whether
   a bf16 difference is rounding (then fp32 matches to about 1e-6) or the layout's math.

Each step's output goes to DIR (default $OUT) as it runs: probe.txt, parity.log,
parity-fp32.log, and the parity script's tables and per-step JSON; each step has its own
time limit, so a hang costs only its step. Exits 1 when any step fails.
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
FP32_LAYOUTS = "tp2,tp2-sp,dp2xtp2,tp2xpp2"
# (log name, seconds, arguments): the bf16 suite ran 16 layouts in 60 s on an H200
STEPS = [("probe.txt", 200, ["share_gpu_probe.py"]),
         ("parity.log", 240, ["share_gpu_parity.py"]),
         ("parity-fp32.log", 120, ["share_gpu_parity.py", "--only", FP32_LAYOUTS, "--set",
                                   "training.dtype=float32", "--tag", "fp32", "--runs",
                                   "/tmp/share_gpu_runs_fp32"])]


def run_step(log: str, limit: int, args: list, out: str) -> int:
    """One step, its output printed and written to out/log as it comes; its exit code
    (124 when it ran past `limit` seconds)."""
    cmd = [sys.executable, "-u", os.path.join(BENCH, args[0])] + args[1:]
    if args[0] == "share_gpu_parity.py":
        cmd += ["--out", out]
    print(f"== {' '.join(args)} (at most {limit} s)", flush=True)
    started = time.perf_counter()
    with open(os.path.join(out, log), "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        timer = threading.Timer(limit, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()                  # stops a step that hangs, silent or not
        for line in proc.stdout:
            print(line, end="", flush=True)
            f.write(line)
            f.flush()
        code = proc.wait()
        code = 124 if not timer.is_alive() and code == -signal.SIGKILL else code
        timer.cancel()
    print(f"== exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
    return code


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "share_gpu_out"),
                   help="folder of the logs and tables (default: $OUT, else share_gpu_out)")
    out = p.parse_args().out
    os.makedirs(out, exist_ok=True)
    codes = [run_step(log, limit, args, out) for log, limit, args in STEPS]
    sys.exit(0 if not any(codes) else 1)


if __name__ == "__main__":
    main()
