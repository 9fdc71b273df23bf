"""create_config.py's `--auto_layout`: the planner picks the layout. Every layout knob the user
gave (--dp --tp --pp --cp --mbs --grad_acc_steps --zero_stage --pp_engine, or a `--set` of a
layout key such as training.activation_checkpointing) stays as given; the search
(search.py) varies the others over everything the config accepts for --gpus GPUs and a global
batch of --global_batch_tokens, and the fastest predicted layout is written. It prints the
choice, the runner-up and how much slower it is, and the fastest layout of another grid where
the runner-up shares the winner's.

    python create_config.py --auto_layout --gpus 64 --model_name Llama-3-8B --seq_len 4096 \\
        --global_batch_tokens 1048576 --pp 4 --exp_name llama-8b
"""
import sys

from picotron.config import ConfigError
from picotron.plan.judge import LAYOUT_KEYS, knobs_set
from picotron.plan.report import (describe, fastest_measured_line, gpus_said, runner_up_line,
                                  spanned, unmeasured_line)
from picotron.plan.search import search

# create_config.py's flag -> the search's name of the knob it sets
FLAG_KNOBS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "mbs": "mbs",
              "grad_acc_steps": "grad_acc", "zero_stage": "zero", "pp_engine": "pp_engine"}
ONE_GPU_PROFILE, MANY_GPU_PROFILE = "h200", "playbook-h100"
GRID = ("dp", "tp", "pp", "cp")


def add_auto_layout_flags(parser) -> None:
    parser.add_argument("--auto_layout", action="store_true",
                        help="let the planner choose every layout knob not given (dp, tp, pp, "
                             "cp, micro-batch and accumulation, ZeRO, recomputation, FP8, the "
                             "pipeline engine) for the fastest predicted step on --gpus GPUs; "
                             "prints the choice and the runner-up")
    parser.add_argument("--gpus", type=int,
                        help="with --auto_layout: GPUs in all, dp*tp*pp*cp (default with "
                             "--slurm: --nodes x --gpus_per_node)")
    parser.add_argument("--global_batch_tokens", type=int,
                        help="with --auto_layout: tokens per optimizer step (default: "
                             "dp*mbs*grad_acc_steps*seq_len when those flags are all given)")
    parser.add_argument("--hardware",
                        help=f"with --auto_layout: the hardware profile the planner predicts "
                             f"for, a file of picotron/plan/hardware/ (default: "
                             f"{ONE_GPU_PROFILE}, one H200, for --gpus 1; {MANY_GPU_PROFILE}, "
                             f"nodes of 8 H100s, for more) or the path of one's own")


def auto_layout_problems(args) -> list:
    """The --auto_layout flags given without it (they would be silently ignored)."""
    given = [f"--{f}" for f in ("gpus", "global_batch_tokens", "hardware")
             if getattr(args, f) is not None]
    if given and not args.auto_layout:
        return [f"{', '.join(given)} apply only with --auto_layout; add --auto_layout, or "
                f"give the sizes with --dp --tp --pp --cp"]
    return []


def fixed_knobs(args, raw: dict) -> dict:
    """The layout knobs the user gave, by flag or by `--set`, with their values in `raw`."""
    fixed = {knob: getattr(args, flag) for flag, knob in FLAG_KNOBS.items()
             if getattr(args, flag) is not None}
    return {**fixed, **knobs_set(raw, args.set)}


def planned_gpus(args) -> int:
    gpus = args.gpus
    if gpus is None and args.slurm and args.nodes and args.gpus_per_node:
        gpus = args.nodes * args.gpus_per_node
    if gpus is None:
        raise ConfigError("--auto_layout needs --gpus N, the number of GPUs to lay the model "
                          "out on (or --slurm --nodes N --gpus_per_node G)")
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {gpus}")
    return gpus


def batch_tokens(args, fixed: dict, seq_len: int) -> int:
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens < 1:
            raise ConfigError(f"--global_batch_tokens must be at least 1, got "
                              f"{args.global_batch_tokens}")
        return args.global_batch_tokens
    if all(k in fixed for k in ("dp", "mbs", "grad_acc")):
        return fixed["dp"] * fixed["mbs"] * fixed["grad_acc"] * seq_len
    raise ConfigError(f"--auto_layout needs --global_batch_tokens B, the tokens of one "
                      f"optimizer step (a multiple of --seq_len {seq_len}), e.g. "
                      f"--global_batch_tokens {seq_len * 256}")


def nothing_fits(gpus: int, fixed: dict, result) -> str:
    given = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "no fixed knob"
    if result.refused:
        key, count = result.refused.most_common(1)[0]
        return (f"no layout of {gpus_said(gpus)} fits with {given}: {count:,} of "
                f"{sum(result.refused.values()):,} refused because "
                f"{' '.join(spanned(result.examples[key], result.spans.get(key)).split())}; "
                f"free a knob or change it")
    sizes = [k for k in GRID if k in fixed]
    return (f"no layout of {gpus_said(gpus)} has {given}: the sizes dp*tp*pp*cp must multiply to "
            f"--gpus {gpus}; give sizes that divide it, or fewer of {', '.join(sizes)}")


def choose_layout(args, raw: dict) -> dict:
    """`raw` (create_config's config dict) with the fastest predicted layout's knobs set;
    prints the choice and the runner-up to stderr. A ConfigError when nothing fits."""
    from picotron.plan.hardware import load_profile, unmeasured
    gpus = planned_gpus(args)
    gpus_per_node = args.gpus_per_node or 8
    profile_name = args.hardware or (ONE_GPU_PROFILE if gpus == 1 else MANY_GPU_PROFILE)
    try:
        profile = load_profile(profile_name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    fixed = fixed_knobs(args, raw)
    seq = raw["training"]["seq_length"]
    tokens = batch_tokens(args, fixed, seq)
    result = search(raw, gpus, tokens, profile, gpus_per_node, fixed=fixed)
    if not result.ranked:
        raise ConfigError(nothing_fits(gpus, fixed, result))
    best = result.ranked[0]
    for knob, value in best.layout.items():
        section, key = LAYOUT_KEYS[knob]
        raw[section][key] = value
    p = best.prediction
    print(f"auto_layout: {gpus_said(gpus)} ({gpus_per_node} per node, profile {profile.name}), seq "
          f"{seq}, {tokens:,} tokens a step: {len(result.ranked):,} layouts fit "
          f"({result.considered:,} judged in {result.seconds:.1f} s)", file=sys.stderr)
    print(f"chosen: {describe(best.layout)}: {p.tok_s_gpu:,.0f} tok/s/GPU, MFU {p.mfu:.1%}, "
          f"{p.mem_gib:.1f} GiB/GPU", file=sys.stderr)
    beyond = unmeasured(profile, best.layout)
    if beyond:
        print(unmeasured_line(profile, beyond, lead="note: "), file=sys.stderr)
        print(fastest_measured_line(result.ranked, profile), file=sys.stderr)
    if len(result.ranked) > 1:
        print(runner_up_line(best, result.ranked[1]), file=sys.stderr)
        grid = [best.layout[k] for k in GRID]
        other = next((s for s in result.ranked if [s.layout[k] for k in GRID] != grid), None)
        if other is not None and other is not result.ranked[1]:
            print(f"fastest other grid, {runner_up_line(best, other).split(': ', 1)[1]}",
                  file=sys.stderr)
    return raw
