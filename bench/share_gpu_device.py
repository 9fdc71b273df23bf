"""The whole share_gpu check in one device call, within 10 minutes:

    python bench/share_gpu_device.py [--out DIR]

1. bench/share_gpu_probe.py: which collectives gloo runs on CUDA tensors in this torch;
2. bench/share_gpu_parity.py: every layout against one process, bf16 and the GPU defaults;
3. every layout but the FP8 ones in fp32 (`--set training.dtype=float32`): the layouts'
   math without bf16's rounding (a correct layout matches one process to about 1e-6);
4. dp2 with FP8 alone and with CUDA graphs alone (the suite's dp2-graphs-fp8 row has both),
   the graphs with ZeRO-1 too and again with bf16 on the wire.

Each step writes DIR/raw/TAG.log as it runs (DIR: default $OUT), and the parity steps their
tables and per-step JSON (share_gpu_parity-TAG.md, share_gpu_steps-TAG.json); at the end
DIR/raw becomes DIR/share_gpu_device.tar.gz. Each step has its own time limit, so a hang
costs only its step. Exits 1 when any step fails.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
FP32_LAYOUTS = ("dp2,tp2,tp2-sp,pp2-1f1b,pp2-interleaved,cp2-ring,cp2-ulysses,dp2-zero1,"
                "dp2-zero2,dp2-zero3,dp2-offload,dp2xtp2,tp2xpp2,dp2xpp2xcp2")
# (tag, seconds, arguments): 580 s at most; the whole call took 166 s on an H100 (bench/NOTES.md)
STEPS = [("probe", 120, ["share_gpu_probe.py"]),
         ("bf16", 200, ["share_gpu_parity.py"]),
         ("fp32", 140, ["share_gpu_parity.py", "--only", FP32_LAYOUTS,
                        "--set", "training.dtype=float32"]),
         # dp2 with CUDA graphs and FP8 apart: which of the two moves the grad norm
         ("dp2-fp8", 40, ["share_gpu_parity.py", "--only", "dp2",
                          "--set", "training.fp8=tensorwise_delayed"]),
         ("dp2-graphs", 60, ["share_gpu_parity.py", "--only", "dp2,dp2-zero1",
                             "--set", "training.cuda_graphs=true"]),
         # the reductions' race under graphs was intermittent: a second run, bf16 on the wire
         ("dp2-graphs-bf16wire", 60, ["share_gpu_parity.py", "--only", "dp2,dp2-zero1",
                                      "--set", "training.cuda_graphs=true",
                                      "--set", "distributed.grad_reduce_dtype=bfloat16"])]


def run_step(tag: str, limit: int, args: list, out: str) -> int:
    """One step, its output printed and written to out/TAG.log as it comes; its exit code
    (124 when it ran past `limit` seconds)."""
    cmd = [sys.executable, "-u", os.path.join(BENCH, args[0])] + args[1:]
    if args[0] == "share_gpu_parity.py":
        cmd += ["--out", out, "--tag", tag, "--runs", f"/tmp/share_gpu_runs_{tag}"]
    print(f"== {' '.join(args)} (at most {limit} s)", flush=True)
    started = time.perf_counter()
    with open(os.path.join(out, f"{tag}.log"), "w") as f:
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
    raw = os.path.join(out, "raw")
    os.makedirs(raw, exist_ok=True)
    codes = [run_step(tag, limit, args, raw) for tag, limit, args in STEPS]
    # the device tool returns at most 8 files: one archive (raw/ stays if this is not reached)
    with tarfile.open(os.path.join(out, "share_gpu_device.tar.gz"), "w:gz") as tar:
        tar.add(raw, arcname="share_gpu_device")
    shutil.rmtree(raw)
    sys.exit(0 if not any(codes) else 1)


if __name__ == "__main__":
    main()
