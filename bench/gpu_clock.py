"""The GPU's SM clock and power draw while a benchmark row runs, from `nvidia-smi` sampling in
the background.

Why: an H200 at its 700 W limit lowers its clock, and every kernel slows with it, so GEMMs
run longer inside a training step than alone (measured: see bench/NOTES.md). A row's clock
says whether two rows ran under the same conditions.

    python bench/gpu_clock.py [--seconds 5] [--interval_ms 250]

samples the first visible GPU for a while and prints the medians (e.g. before a benchmark,
to see the clock an idle or busy GPU runs at); bench_speed.py samples each row this way.
"""
import argparse
import os
import statistics
import subprocess
import time


class ClockSampler:
    """start() ... stop() -> "SM <MHz> MHz <W> W" (medians of the samples), or "" when
    nvidia-smi is missing or says nothing usable."""

    def __init__(self, interval_ms: int = 250):
        self.interval_ms, self.proc = interval_ms, None

    def start(self):
        # the first visible GPU: this process's device 0
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def stop(self) -> str:
        if self.proc is None:
            return ""
        self.proc.terminate()
        try:
            out = self.proc.communicate(timeout=5)[0]
            samples = [[float(v) for v in line.split(",")] for line in out.splitlines()
                       if line.count(",") == 1]
        except (subprocess.TimeoutExpired, ValueError):
            return ""
        if not samples:
            return ""
        mhz, watts = (statistics.median(column) for column in zip(*samples))
        return f"SM {mhz:.0f} MHz {watts:.0f} W"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0,
                   help="how long to sample (default: 5)")
    p.add_argument("--interval_ms", type=int, default=250,
                   help="milliseconds between two samples (default: 250)")
    return p


def main():
    args = build_parser().parse_args()
    sampler = ClockSampler(args.interval_ms).start()
    time.sleep(args.seconds)
    print(sampler.stop() or "no reading: nvidia-smi is missing or reported nothing usable")


if __name__ == "__main__":
    main()
