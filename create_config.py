"""Write a run's config: `python create_config.py --out_dir tmp --exp_name NAME --dp 2 ...`.

Takes picotron's flags, plus `--set section.key=value` for any other key of the config
(repeatable; the value is read as JSON when it parses, else as a string). The config is built
and validated through picotron.config before anything is written, so a bad combination is
refused here, not at step 3 of a run. Prints the path of the written config.
"""
import argparse
import json
import os
import sys

from picotron.config import Config, ConfigError, config_from_dict
from picotron.presets import pretrained_weights, resolve_model

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out_dir", default="tmp", help="parent folder of the run directory")
    p.add_argument("--exp_name", default="debug", help="run directory name under --out_dir")
    for flag in ("dp", "tp", "pp", "cp", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "grad_acc_steps", "mbs", "seq_len", "total_train_steps",
                 "seed", "zero_stage"):
        p.add_argument(f"--{flag}", type=int)
    p.add_argument("--learning_rate", type=float)
    p.add_argument("--pp_engine", choices=("afab", "1f1b", "interleaved"))
    p.add_argument("--model_name", default="debug",
                   help="a preset in configs/presets (or the hub id it mirrors), a local "
                        "Hugging Face model directory, or a hub id")
    p.add_argument("--dataset_name", help="'embedded' (default), 'synthetic', or a dataset")
    p.add_argument("--subset_name")
    for flag in ("use_cpu", "use_wandb", "use_fused_adam"):
        p.add_argument(f"--{flag}", action="store_true", default=None)
    p.add_argument("--hf_token", help="used to read a gated hub config; never written")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set training.warmup_steps=10")
    return p.parse_args(argv)


def parse_override(item: str):
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"--set {item!r} must look like section.key=value, "
                          f"e.g. --set training.warmup_steps=10")
    path, text = item.split("=", 1)
    section, key = path.split(".", 1)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text                   # a bare string: --set dataset.name=synthetic
    return section, key, value


def build_config_dict(args) -> dict:
    raw = Config().to_dict()
    resolved = resolve_model(args.model_name, args.hf_token)
    raw["model"].update(resolved)
    if args.use_cpu:                   # fp32 on CPU: the precision parity tests rely on
        raw["training"]["dtype"] = "float32"
    for flag, (section, key) in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            raw[section][key] = value
    for item in args.set:
        section, key, value = parse_override(item)
        if section not in raw:
            raise ConfigError(f"--set {item!r}: unknown section '{section}'; valid sections: "
                              f"{', '.join(raw)}")
        raw[section][key] = value      # unknown keys are caught by config_from_dict
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
        raw = build_config_dict(args)
        # validates types and layout; "auto" options are written as such and resolved on
        # the machine that trains
        config = config_from_dict(raw, resolve=False)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    run_dir = os.path.join(args.out_dir, args.exp_name)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.json")
    config.save(path)
    print(path)
    return path


if __name__ == "__main__":
    main()
