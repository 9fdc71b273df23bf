"""The README's quick start, run line by line exactly as the README prints it.

A new user copies these lines in order: install and train (`... && python train.py`, which
trains the debug preset into tmp/debug), sample, export to Hugging Face, load the export in
transformers, fine-tune the export, resume the first run. Each line must work after the ones
before it, on a CPU machine with no network, and the first training must log every metric and
learn more than byte frequencies. The `pip install` commands before the first line's last
`&&` are the environment this suite already runs in, so they are the part not run here. The
GPU example's config and the memory plan the README runs on it are run too (the training
itself needs GPUs).

The commands run in a fresh folder that holds links to the repository's scripts and package,
so their relative paths (`tmp/debug/...`) resolve as they would in a clone.
"""
import dataclasses
import math
import os
import re
import shlex
import subprocess
import sys

import torch
from safetensors import safe_open

from launch import ROOT, read_metrics
from picotron.config import load_config
from picotron.data.windows import embedded_corpus_bytes
from picotron.utils import lr_at

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
               "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gb", "step_time_s"}

LINKED = ("create_config.py", "train.py", "generate.py", "export_hf.py", "picotron", "configs")


def readme_section(heading: str) -> str:
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return readme.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def bash_blocks(section: str) -> list:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def quick_start_commands() -> list:
    """The training command after the install (the first block's last `&&`), then the lines
    of the next-steps block (the one that starts by sampling)."""
    blocks = bash_blocks(readme_section("Quick start"))
    *install, train = blocks[0].split(" && ")
    assert "\n" not in blocks[0] and install, blocks[0]
    assert all(part.startswith("pip install ") for part in install), install
    next_steps = next(b for b in blocks if b.startswith("python generate.py"))
    return [train] + [line for line in next_steps.splitlines() if line.strip()]


def run_line(line: str, cwd: str) -> str:
    argv = shlex.split(line)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "torchrun":          # the torchrun of this interpreter's environment
        argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]
    env = {**os.environ, "PYTHONPATH": cwd, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"`{line}` failed (rc {done.returncode}):\n{done.stderr[-3000:]}"
    return done.stdout


def losses(stdout: str) -> list:
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", stdout)]


def unigram_entropy(tokens) -> float:
    """Cross-entropy (nats) of the best model that ignores context: the byte frequencies."""
    p = torch.bincount(tokens.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return -(p * p.log()).sum().item()


def check_metrics_and_learning(config_path):
    """The first run's 200 steps of `debug` on the stdlib corpus logged every metric the README
    lists, and learned. Threshold: the mean loss of the last 20 steps must be 0.3 nats below
    the corpus's byte unigram entropy (about 3.3 nats; ln 256 = 5.55 at the start). Beating
    the unigram entropy is only possible by using the context, so this cannot pass by learning
    byte frequencies alone (it ends near 2.2)."""
    records = [r for r in read_metrics(config_path) if r["step"] <= 200]   # not the resume's
    assert [r["step"] for r in records] == list(range(1, 201))
    assert all(METRIC_KEYS <= set(r) for r in records)
    assert abs(records[0]["loss"] - math.log(256)) < 0.2        # uniform-ish start
    threshold = unigram_entropy(embedded_corpus_bytes()) - 0.3
    final = sum(r["loss"] for r in records[-20:]) / 20
    assert final < threshold, (final, threshold)
    assert records[-1]["tokens"] == 200 * 8 * 256
    assert all(r["mfu"] is None for r in records)                # CPU: no peak rate


def test_quick_start_runs_as_printed(tmp_path):
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    commands = quick_start_commands()
    assert commands[0] == "python train.py", commands[0]
    out = [run_line(line, str(tmp_path)) for line in commands]
    train, generate, export, load, create_ft, fine_tune, resumed = out
    assert train.splitlines()[0] == "tmp/debug/config.json", train[:500]   # written, then run
    assert "step   200/200" in train and "done: 200 steps" in train, train[-2000:]
    assert "checkpoint" in train.splitlines()[-1] and "step_000200" in train.splitlines()[-1]
    first = losses(train)
    assert first[-1] < first[0] - 1.0, "the quick start does not learn"
    check_metrics_and_learning(str(tmp_path / "tmp" / "debug" / "config.json"))
    assert generate.startswith("def ") and len(generate) > 10, generate
    assert "LlamaForCausalLM" in load, load
    # The fine-tune starts from the exported weights: its first loss is the trained model's,
    # far below the first loss of the run from scratch.
    assert losses(fine_tune)[0] < first[0] - 1.0, (losses(fine_tune)[:3], first[:3])
    assert "resumed at step 200" in resumed and "step   220/220" in resumed, resumed[-2000:]
    assert "done: 20 steps (200 -> 220)" in resumed
    check_start_lines(os.path.realpath(tmp_path), train, fine_tune, resumed)


def check_start_lines(root, train, fine_tune, resumed):
    """Each run says where its weights came from, and the resume that stretches the schedule
    to 220 steps says which lr step 201 gets under each schedule (lr_at's, not copied), in
    the line the README shows."""
    debug = load_config(os.path.join(root, "tmp", "debug", "config.json")).training
    assert f"\nweights: random init (seed {debug.seed})\n" in train, train[:3000]
    hf = os.path.join(root, "tmp", "debug-hf")
    with safe_open(os.path.join(hf, "model.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    assert f"\nweights: loaded from Hugging Face folder {hf} ({tensors} tensors)\n" in fine_tune
    step_200 = os.path.join(root, "tmp", "debug", "checkpoints", "step_000200")
    assert (f"\nweights: loaded from checkpoint {step_200} (step 200, {tensors} tensors)\n"
            in resumed), resumed[:3000]
    longer = dataclasses.replace(debug, total_train_steps=220)
    said = (f"resumed at step 200 from latest; the schedule changes: lr at step 201 would be "
            f"{lr_at(201, debug):.2e} under the checkpoint's (200 steps), is "
            f"{lr_at(201, longer):.2e} under this config (220 steps)")
    assert said in resumed.splitlines(), resumed[:3000]
    assert said in readme_section("Quick start").splitlines()


def test_ci_runs_the_readme_test_command_in_a_fresh_environment():
    """CI proves what a user's new machine does: `.ci/run` runs README's test command
    verbatim, inside a virtual environment it has just made, so pip resolves every dependency
    to its newest release instead of keeping older ones this machine already holds."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("Run the tests", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).strip()
    script = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8")
              if line.strip() and not line.startswith("#")]
    assert script[-1] == command, (script[-1], command)
    made = next(i for i, line in enumerate(script) if line.startswith("python -m venv "))
    entered = next(i for i, line in enumerate(script) if line.startswith("source "))
    assert made < entered < len(script) - 1, script


def test_the_gpu_example_writes_its_config_and_the_plan_reads_it(tmp_path):
    """The quick start's GPU block writes its config here too (only its training needs the
    GPUs), and "Which layout?"'s memory plan runs on that config as printed."""
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    gpu = next(b for b in bash_blocks(readme_section("Quick start")) if "--nproc_per_node" in b)
    create, launch = gpu.splitlines()
    assert run_line(create, str(tmp_path)).strip() == "tmp/smol/config.json"
    config = load_config(str(tmp_path / "tmp" / "smol" / "config.json"))
    assert launch == ("python train.py --nproc_per_node 8 --config tmp/smol/config.json")
    assert config.world_size == 8 and not config.distributed.use_cpu
    plan = bash_blocks(readme_section("Which layout?"))[0]
    assert plan.endswith(" tmp/smol/config.json"), plan
    printed = run_line(plan, str(tmp_path))
    assert "GiB  per device" in printed, printed
