"""`python -m picotron.plan search | score | explain`: which layout for N GPUs, before running.

    search   --model_name NAME --gpus N [--gpus_per_node 8] --seq_len T
             --global_batch_tokens B --hardware PROFILE [--out ALL.csv]: every layout the
             config accepts, scored; the fastest ten, then the refused ones counted by
             reason (ALL.csv: every one that fits, as score's rows)
    score    --layouts IN.csv --hardware PROFILE --out OUT.csv: a prediction per row
    explain  CONFIG [--hardware PROFILE] [--out FILE.png]: one config's predicted step as a
             picture, a lane per pipeline rank, each rank's memory beside it

Bad input (a model that is not found, an unknown profile, a CSV without some columns, a row
that is not a layout, a config that does not load, no matplotlib for explain) ends in one
line naming the fix, with exit code 2.
"""
import argparse
import os
import sys

from picotron.config.overrides import parse_flags
from picotron.errors import ConfigError

DEFAULT_PROFILE = "playbook-h100"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m picotron.plan", description=__doc__,
                                allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="search|score|explain")
    hardware = {"default": DEFAULT_PROFILE,
                "help": f"the hardware profile, a file of picotron/plan/hardware/ (h200, "
                        f"playbook-h100; default: {DEFAULT_PROFILE}), or the path of one's "
                        f"own, a copy of one of them with other numbers"}
    s = commands.add_parser("search", allow_abbrev=False, help="rank every layout of N GPUs")
    s.add_argument("--model_name", required=True,
                   help="a preset in configs/presets, a local Hugging Face model directory or "
                        "a hub id, as create_config.py takes it")
    s.add_argument("--gpus", type=int, required=True, help="GPUs in all (dp*tp*pp*cp)")
    s.add_argument("--gpus_per_node", type=int, default=8,
                   help="GPUs per node: groups wider than it cross the slower links "
                        "(default: 8)")
    s.add_argument("--seq_len", type=int, required=True, help="tokens per sequence")
    s.add_argument("--global_batch_tokens", type=int, required=True,
                   help="tokens per optimizer step, over every micro-batch and replica")
    s.add_argument("--hardware", **hardware)
    s.add_argument("--top", type=int, default=10, help="layouts shown (default: 10)")
    s.add_argument("--out", help="also write every layout that fits, fastest first, to this "
                                 "CSV in score's columns with the predictions (score reads "
                                 "it back, under another profile too)")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="set a config key for every layout, as create_config.py's --set "
                        "(e.g. distributed.sequence_parallel=true); a layout knob set so "
                        "(distributed.tp_size=2, training.fp8=none, ...) stays fixed and the "
                        "search varies the rest (one set to auto is the search's to choose)")
    c = commands.add_parser("score", allow_abbrev=False, help="predict a table of layouts")
    c.add_argument("--layouts", required=True, help="IN.csv, a layout per row")
    c.add_argument("--hardware", **hardware)
    c.add_argument("--out", required=True, help="OUT.csv: IN.csv plus the predictions")
    e = commands.add_parser("explain", allow_abbrev=False,
                            help="draw one config's predicted step")
    e.add_argument("config", help="a config.json (create_config.py writes one)")
    e.add_argument("--hardware", **hardware)
    e.add_argument("--gpus_per_node", type=int, default=8,
                   help="GPUs per node: groups wider than it cross the slower links "
                        "(default: 8)")
    e.add_argument("--out", help="the picture to write, a PNG unless its extension names "
                                 "another format (default: step.png beside the config)")
    e.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="change a key of the config before drawing it, e.g. "
                        "distributed.pp_engine=afab")
    return p


def run_search(args):
    """Print the search's heading and report; return its SearchResult (for bench scripts)."""
    from picotron.plan.hardware import load_profile
    from picotron.plan.judge import knobs_set
    from picotron.plan.report import gpus_said, search_report
    from picotron.plan.search import search, search_raw
    profile = load_profile(args.hardware)
    raw = search_raw(args.model_name, args.seq_len, args.set)
    fixed = knobs_set(raw, args.set)
    result = search(raw, args.gpus, args.global_batch_tokens, profile, args.gpus_per_node,
                    fixed=fixed)
    if not result.considered:       # no grid of --gpus has the fixed sizes
        from picotron.plan.auto_layout import nothing_fits
        raise ConfigError(nothing_fits(args.gpus, fixed, result))
    kept = "".join(f", {knob} {value}" for knob, value in fixed.items())
    print(f"{args.model_name} on {gpus_said(args.gpus)} ({args.gpus_per_node} per node, profile "
          f"{profile.name}), seq {args.seq_len}, {args.global_batch_tokens:,} tokens a step"
          f"{kept}")
    print(search_report(result, args.top, profile))
    if args.out:
        from picotron.plan.score import search_rows, write_table
        write_table(args.out, *search_rows(result, profile, args.gpus_per_node))
        print(f"wrote {args.out}: {len(result.ranked):,} layouts")
    return result


def run_score(args) -> None:
    from picotron.plan.hardware import load_profile
    from picotron.plan.score import score
    n = score(args.layouts, load_profile(args.hardware), args.out)
    print(f"wrote {args.out}: {n:,} rows scored")


def run_explain(args) -> None:
    from picotron.plan.explain import explain
    from picotron.plan.hardware import load_profile
    path, text = explain(args.config, load_profile(args.hardware), args.out,
                         args.gpus_per_node, args.set)
    print(text)
    print(f"wrote {path}")


def main(argv=None) -> None:
    args = parse_flags(build_parser(), argv)
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch_tokens", "top"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"error: --{name} must be at least 1, got {value}", file=sys.stderr)
            sys.exit(2)
    try:
        {"search": run_search, "score": run_score,
         "explain": run_explain}[args.command](args)
        sys.stdout.flush()          # here, so that a reader gone early is caught below
    except (ConfigError, ValueError) as e:     # an unknown profile is a ValueError
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:         # `search ... | head`: the reader had what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # exit's flush


if __name__ == "__main__":
    main()
