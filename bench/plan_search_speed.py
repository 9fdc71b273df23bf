"""How long `python -m picotron.plan search` takes: the whole search (every layout the config
accepts judged, each scored by the step-time model, ranked) for one model on N GPUs, timed
end to end, with the count of layouts judged.

    python bench/plan_search_speed.py [--model_name SmolLM-1.7B] [--gpus 512] [--seq_len 2048]
                                      [--global_batch_tokens 4194304] [--hardware playbook-h100]
                                      [--repeats 1]

The search runs on the host (no GPU); its time grows with the layouts of N (divisors of N
cubed, times the micro-batch splits, ZeRO, recomputation, engines and FP8 recipes).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from picotron.plan.hardware import load_profile  # noqa: E402
from picotron.plan.search import search, search_raw  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name", default="SmolLM-1.7B", help="as search takes it")
    p.add_argument("--gpus", type=int, default=512, help="GPUs in all (default: 512)")
    p.add_argument("--gpus_per_node", type=int, default=8, help="(default: 8)")
    p.add_argument("--seq_len", type=int, default=2048, help="(default: 2048)")
    p.add_argument("--global_batch_tokens", type=int, default=4 * 1024 * 1024,
                   help="tokens a step (default: 4,194,304)")
    p.add_argument("--hardware", default="playbook-h100", help="(default: playbook-h100)")
    p.add_argument("--repeats", type=int, default=1, help="searches timed (default: 1)")
    args = p.parse_args(argv)
    profile = load_profile(args.hardware)
    raw = search_raw(args.model_name, args.seq_len)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = search(raw, args.gpus, args.global_batch_tokens, profile, args.gpus_per_node)
        times.append(time.perf_counter() - start)
    best = result.ranked[0].layout if result.ranked else None
    print(f"{args.model_name}, {args.gpus} GPUs, seq {args.seq_len}, "
          f"{args.global_batch_tokens:,} tokens a step, profile {profile.name}")
    print(f"{result.considered:,} layouts judged, {len(result.ranked):,} fit, "
          f"{sum(result.refused.values()):,} refused; search {min(times):.2f} s "
          f"(best of {len(times)})")
    print(f"fastest: {best}")


if __name__ == "__main__":
    main()
