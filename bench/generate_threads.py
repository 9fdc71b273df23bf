"""Why generate.py's linears took ~13 ms a call on a 2-core CPU with another program busy:
the time of one `linear` of the debug model's shape and of a 20-token sample, by intra-op
thread count, flushed denormals or not, with one core kept busy (`yes > /dev/null`) or not.

    python bench/generate_threads.py [--checkpoint tmp/debug/checkpoints]

Without --checkpoint the debug model is drawn at random (its weights hold no denormals); with
one, the trained weights are sampled and their share of denormal numbers printed. Each
figure is the median of 5 repeats; /proc/loadavg's 1-minute figure is printed with each."""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from picotron.attention import eager_attention  # noqa: E402
from picotron.config.sections import ModelConfig  # noqa: E402
from picotron.model import Decoder  # noqa: E402
from picotron.run.generate import load_for_inference, sample  # noqa: E402


def load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def timed(fn, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--checkpoint", help="a step_* folder or checkpoints folder to sample from "
                                        "(default: the debug model drawn at random)")
    args = p.parse_args()
    if args.checkpoint:
        from picotron.checkpoint.checkpoint import checkpoint_to_read
        model = load_for_inference(checkpoint_to_read(args.checkpoint))[0]
    else:
        torch.manual_seed(0)
        model = Decoder(ModelConfig(), eager_attention).eval()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    tiny = ((weights != 0) & (weights.abs() < torch.finfo(torch.float32).tiny)).float().mean()
    print(f"denormal weights: {tiny.item():.2e} of {weights.numel():,}")
    c = model.config if hasattr(model, "config") else ModelConfig()
    x = torch.randn(1, 100, c.hidden_size)
    w = torch.randn(c.intermediate_size, c.hidden_size)
    prompt = torch.tensor([10])
    for busy in (False, True):
        other = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if busy else None
        try:
            for threads in (1, 2):
                for flush in (False, True):
                    torch.set_num_threads(threads)
                    torch.set_flush_denormal(flush)
                    first = timed(lambda: torch.nn.functional.linear(x, w), repeats=1)
                    linear = timed(lambda: [torch.nn.functional.linear(x, w) for _ in range(100)])
                    tokens = timed(lambda: sample(model, prompt, 20, 0.8, 50, None,
                                                  torch.Generator().manual_seed(0)), repeats=3)
                    print(f"{'one core busy' if busy else 'no yes      '} threads {threads} "
                          f"flush {'on ' if flush else 'off'}: linear {linear * 10:.3f} ms "
                          f"(first call {first * 1000:.2f} ms), 20 tokens {tokens:.2f} s "
                          f"(load {load()})", flush=True)
        finally:
            if other is not None:
                other.kill()
                other.wait()


if __name__ == "__main__":
    main()
