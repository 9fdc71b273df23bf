"""How long `python -m picotron.plan search` takes over every layout of N GPUs: the layouts
judged by the config, the ones that fit, the seconds the search took and the processes that
shared it, the CPU seconds this process spent on it, and the machine's load average when it
started (other processes share its cores).

    python bench/plan_search_speed.py [--model_name Llama-3-8B] [--gpus 512] [--seq_len 4096]
        [--global_batch_tokens 1048576] [--hardware playbook-h100] [--processes 1|2]

The goal is under 10 s for 512 GPUs on a 2-core CPU; bench/NOTES.md has the measured times.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron.plan.hardware import load_profile
from picotron.plan.search import search, search_raw


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name", default="Llama-3-8B", help="the model (default: Llama-3-8B)")
    p.add_argument("--gpus", type=int, default=512, help="GPUs in all (default: 512)")
    p.add_argument("--seq_len", type=int, default=4096, help="tokens a sequence (default: 4096)")
    p.add_argument("--global_batch_tokens", type=int, default=2 ** 20,
                   help="tokens a step (default: 1048576)")
    p.add_argument("--hardware", default="playbook-h100", help="profile (default: playbook-h100)")
    p.add_argument("--processes", type=int, choices=(1, 2),
                   help="1, or 2: the search shared with a forked process (default: as the "
                        "command does, 2 where there are two cores)")
    args = p.parse_args()
    profile = load_profile(args.hardware)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    raw = search_raw(args.model_name, args.seq_len)
    cpu = time.process_time()
    result = search(raw, args.gpus, args.global_batch_tokens, profile, processes=args.processes)
    cpu = time.process_time() - cpu
    print(f"{args.model_name}, {args.gpus} GPUs, seq {args.seq_len}, "
          f"{args.global_batch_tokens:,} tokens: {result.considered:,} layouts judged, "
          f"{len(result.ranked):,} fit; {result.seconds:.1f} s in all, {result.processes} "
          f"process{'es' if result.processes > 1 else ''}, {cpu:.1f} CPU s in this one; "
          f"load average before: {load}")

if __name__ == "__main__":
    main()
