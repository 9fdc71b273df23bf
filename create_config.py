"""Write a run's config: `python create_config.py --out_dir tmp --exp_name NAME --dp 2 ...`.

Takes picotron's flags, plus `--set section.key=value` for any other key of the config
(repeatable; the value is read as JSON when it parses, else as a string; a key given twice, by
a flag and a `--set` or by two `--set`, takes the last, with a warning). The config is built
and validated through picotron.config before anything is written, so a bad combination is
refused here, not at step 3 of a run. Prints the path of the written config. With `--slurm
--nodes N --gpus_per_node G --partition P --time T` it also writes `slurm.sh` beside it, a
batch script for several nodes (picotron/run/slurm.py). With `--auto_layout --gpus N
--global_batch_tokens B` the planner chooses every layout knob not given, and prints the
choice and the runner-up (picotron/plan/auto_layout.py).
"""
import argparse
import json
import os
import sys

from picotron.checkpoint.checkpoint import existing_run
from picotron.config import Config, ConfigError, config_from_dict
from picotron.config.checks import config_warnings
from picotron.config.ranges import unwritable
from picotron.config.overrides import apply_overrides, parse_flags, repeated_keys
from picotron.plan.auto_layout import add_auto_layout_flags, auto_layout_problems, choose_layout
from picotron.run.preflight import local_problems
from picotron.config.presets import pretrained_weights, resolve_model
from picotron.run.slurm import add_slurm_flags, slurm_problems, write_slurm_script

# flag -> (section, key): picotron's spelling on the left, the config's names on the right.
FLAG_KEYS = {
    "dp": ("distributed", "dp_size"), "tp": ("distributed", "tp_size"),
    "pp": ("distributed", "pp_size"), "cp": ("distributed", "cp_size"),
    "pp_engine": ("distributed", "pp_engine"), "use_cpu": ("distributed", "use_cpu"),
    "zero_stage": ("distributed", "zero_stage"),
    "num_hidden_layers": ("model", "num_hidden_layers"),
    "num_attention_heads": ("model", "num_attention_heads"),
    "num_key_value_heads": ("model", "num_key_value_heads"),
    "grad_acc_steps": ("training", "gradient_accumulation_steps"),
    "mbs": ("training", "micro_batch_size"), "seq_len": ("training", "seq_length"),
    "total_train_steps": ("training", "total_train_steps"),
    "learning_rate": ("training", "learning_rate"), "seed": ("training", "seed"),
    "use_fused_adam": ("training", "use_fused_adam"),
    "dataset_name": ("dataset", "name"), "subset_name": ("dataset", "subset_name"),
    "use_wandb": ("logging", "use_wandb"),
}


# flag -> what it sets; --help adds the config key and its default.
FLAG_HELP = {
    "dp": "data-parallel replicas, each training on its share of every global batch",
    "tp": "tensor-parallel shards of every weight matrix (must divide the attention and "
          "key/value heads)",
    "pp": "pipeline stages of consecutive layers",
    "cp": "context-parallel shards of every sequence (ring attention, or Ulysses)",
    "pp_engine": "pipeline schedule with --pp > 1",
    "zero_stage": "0: plain data parallelism; 1: shard AdamW's state over the dp ranks; "
                  "2: and the gradients; 3: and the parameters",
    "num_hidden_layers": "decoder layers L",
    "num_attention_heads": "query heads H",
    "num_key_value_heads": "key/value heads K (1: multi-query attention)",
    "grad_acc_steps": "micro-batches accumulated per optimizer step",
    "mbs": "sequences per micro-batch on each data-parallel rank",
    "seq_len": "tokens per sequence",
    "total_train_steps": "optimizer steps to train",
    "learning_rate": "peak learning rate, reached after the warm-up, then cosine decay",
    "seed": "seeds the weights, the data order and synthetic tokens",
    "dataset_name": "'embedded' (this Python's standard library as bytes: no download), "
                    "'synthetic' (random tokens), a local file, glob or directory (txt, json, "
                    "jsonl, parquet, arrow, csv) or a Hugging Face dataset id",
    "subset_name": "the dataset's configuration name, e.g. sample-10BT",
    "use_cpu": "train on CPU processes over gloo instead of GPUs over NCCL; also writes "
               "training.dtype=float32",
    "use_wandb": "also log every step to Weights & Biases (needs `pip install wandb`)",
    "use_fused_adam": "AdamW as one Triton kernel on GPUs (already on: the flag is "
                      "picotron's spelling)",
}


def flag_help(flag: str) -> str:
    section, key = FLAG_KEYS[flag]
    default = ("the --model_name's" if section == "model"
               else json.dumps(getattr(getattr(Config(), section), key)))
    return f"{FLAG_HELP[flag]} [{section}.{key}; default: {default}]"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", type=os.path.expanduser, default="tmp",
                   help="parent folder of the run directory (default: tmp)")
    p.add_argument("--exp_name", default="debug",
                   help="the run directory's name: the config is written to "
                        "OUT_DIR/EXP_NAME/config.json, and the run's outputs go next to it "
                        "(default: debug)")
    for flag in ("dp", "tp", "pp", "cp", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "grad_acc_steps", "mbs", "seq_len", "total_train_steps",
                 "seed", "zero_stage"):
        p.add_argument(f"--{flag}", type=int, help=flag_help(flag))
    p.add_argument("--learning_rate", type=float, help=flag_help("learning_rate"))
    p.add_argument("--pp_engine", choices=("afab", "1f1b", "interleaved"),
                   help=flag_help("pp_engine"))
    p.add_argument("--model_name", default="debug",
                   help="a preset in configs/presets (debug, debug-palm, SmolLM-135M, ...; "
                        "or the hub id it mirrors, which then needs no network), a local "
                        "Hugging Face model directory (its weights are loaded when it has "
                        "them), or a hub id (default: debug)")
    p.add_argument("--dataset_name", help=flag_help("dataset_name"))
    p.add_argument("--subset_name", help=flag_help("subset_name"))
    for flag in ("use_cpu", "use_wandb", "use_fused_adam"):
        p.add_argument(f"--{flag}", action="store_true", default=None, help=flag_help(flag))
    p.add_argument("--hf_token",
                   help="Hugging Face token to read a gated model's config, e.g. $HF_TOKEN; "
                        "used here, never written into the config")
    p.add_argument("--skip_local_checks", action="store_true",
                   help="write the config without checking that this machine has its dataset "
                        "and tokenizer (for a config written here to run on another machine)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="set any config key (repeatable; docs/config.md lists "
                        "them), the value read as JSON when it parses (a text key takes a "
                        "number as typed: logging.run_name=2024), e.g. --set "
                        "training.warmup_steps=10 --set dataset.tokenizer=gpt2")
    add_slurm_flags(p)                 # --slurm --nodes --gpus_per_node ... (picotron/run/slurm.py)
    add_auto_layout_flags(p)           # --auto_layout --gpus --global_batch_tokens --hardware
    return p


def parse_args(argv=None):
    return parse_flags(build_parser(), argv)


def flags_given(args) -> list:
    """(flag, section, key, value) for each flag of FLAG_KEYS given: a flag not given is None."""
    return [(flag, section, key, getattr(args, flag)) for flag, (section, key)
            in FLAG_KEYS.items() if getattr(args, flag) is not None]


def build_config_dict(args) -> dict:
    raw = Config().to_dict()
    resolved = resolve_model(args.model_name, args.hf_token)
    raw["model"].update(resolved)
    if args.use_cpu:                   # fp32 on CPU: the precision parity tests rely on
        raw["training"]["dtype"] = "float32"
    for _, section, key, value in flags_given(args):
        raw[section][key] = value
    apply_overrides(raw, args.set)     # an unknown key: refused, naming the key meant
    # A Hugging Face checkpoint as --model_name: start from its weights, unless a flag changed
    # the architecture (then its weights cannot fit: train from scratch, and say so).
    weights = pretrained_weights(args.model_name)
    if weights and raw["checkpoint"]["init_from"] is None:
        changed = [f"{k}={raw['model'][k]}" for k, v in resolved.items() if raw["model"][k] != v]
        if not changed:
            raw["checkpoint"]["init_from"] = weights
        else:
            print(f"note: {', '.join(changed)} differs from {args.model_name}, so its weights "
                  f"are not loaded (random init)", file=sys.stderr)
    return raw


def main(argv=None) -> str:
    args = parse_args(argv)
    try:
        problems = auto_layout_problems(args)
        if problems:
            raise ConfigError(problems[0])
        raw = build_config_dict(args)
        if args.auto_layout:           # the planner's fastest layout, the given knobs kept
            raw = choose_layout(args, raw)
        # validates types and layout; "auto" options are written as such and resolved on
        # the machine that trains
        config = config_from_dict(raw, resolve=False)
        problems = [] if args.skip_local_checks else local_problems(config)
        if problems:
            raise ConfigError("this machine cannot find what the run will read (a config "
                              "for another machine: --skip_local_checks):\n  - "
                              + "\n  - ".join(problems))
        d = config.distributed
        # --gpus_per_node also tells --auto_layout's planner the node size, without --slurm
        slurm_args = (argparse.Namespace(**{**vars(args), "gpus_per_node": None})
                      if args.auto_layout and not args.slurm else args)
        problems = slurm_problems(slurm_args, config.world_size, d.tp_size, d.cp_size)
        if problems:
            raise ConfigError("the SLURM allocation does not fit the config:\n  - "
                              + "\n  - ".join(problems))
        if args.exp_name in ("", ".", "..") or "/" in args.exp_name or os.sep in args.exp_name:
            raise ConfigError(f"--exp_name '{args.exp_name}' must name one folder inside "
                              f"--out_dir (no '/', not '.' or '..'), e.g. --exp_name debug")
        run_dir = os.path.join(args.out_dir, args.exp_name)
        if unwritable(run_dir):
            raise ConfigError(f"cannot write the config to '{run_dir}': {unwritable(run_dir)}")
        outputs = os.path.expanduser(config.logging.run_dir or run_dir)
        held = existing_run(outputs, os.path.join(outputs, config.checkpoint.save_dir))
        if held:      # their config.json is what a resume checks the checkpoints against
            raise ConfigError(f"'{outputs}' already holds a run ({held}); write the new "
                              f"config to another --exp_name, or resume that run with its own "
                              f"config.json and train.py --set section.key=value")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    typed = {f"{section}.{key}": f"--{flag}" if value is True else f"--{flag} {value}"
             for flag, section, key, value in flags_given(args)}     # as the warning names them
    for warning in repeated_keys(args.set, typed) + config_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.json")
    config.save(path)
    if args.slurm:
        script = write_slurm_script(args, path, args.exp_name, not config.distributed.use_cpu)
        print(f"wrote {script}: submit it with `sbatch {script}`", file=sys.stderr)
    print(path)
    return path


def debug_config(out_dir: str = "tmp") -> str:
    """What `python train.py` with no --config trains: `out_dir/debug/config.json`, written as
    `python create_config.py --out_dir tmp --exp_name debug [--use_cpu]` writes it (on CPU
    when this machine has no GPU) unless it is already there, in which case it is used as is."""
    path = os.path.join(out_dir, "debug", "config.json")
    if os.path.exists(path):
        return path
    import torch       # only here: the rest of this script runs without it
    cpu = [] if torch.cuda.is_available() else ["--use_cpu"]
    return main(["--out_dir", out_dir, "--exp_name", "debug"] + cpu)


if __name__ == "__main__":
    main()
