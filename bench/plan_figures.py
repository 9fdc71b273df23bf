"""The planner's tables and pictures in README.md and docs/pipelines.md, made again from the
time model and the hardware profiles as they are now (run it after changing either):

    python bench/plan_figures.py [--only readme pipelines llama]

- readme     README's "Which layout?": `python -m picotron.plan search` for SmolLM-1.7B on 8
             GPUs, its fastest rows (a few minutes on a 2-core CPU: the search is exhaustive)
- pipelines  docs/pipelines.md: one layout of SmolLM-1.7B under AFAB, 1F1B and interleaved,
             each drawn by `python -m picotron.plan explain`, with a table of the three
- llama      docs/pipelines.md: Llama-3-8B on 64 GPUs: search's fastest rows, then the step of
             the top pick and of the fastest layout with pipeline stages, drawn by explain

Each page holds its generated text between `<!-- plan_figures:NAME -->` and
`<!-- /plan_figures:NAME -->`; the script replaces it there, with every command it ran written
above what the command printed, and writes the pictures to docs/images/.
"""
import argparse
import contextlib
import io
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import create_config                                                    # noqa: E402
from picotron.plan.__main__ import build_parser, run_search            # noqa: E402
from picotron.plan.explain import config_for_profile, explain           # noqa: E402
from picotron.plan.hardware import load_profile                         # noqa: E402
from picotron.plan.step_lanes import busy_s, step_lanes                 # noqa: E402

PROFILE = "playbook-h100"
# the pipelines page teaches this project's engine: drawn on its own profile (H200s, 8 a host),
# not on the profile fit to another trainer's host costs
PIPELINE_PROFILE = "h200"
SMOL_SEARCH = ("search --model_name SmolLM-1.7B --gpus 8 --seq_len 2048 "
               "--global_batch_tokens 1048576 --top 5").split()
LLAMA_SEARCH = ("search --model_name Llama-3-8B --gpus 64 --seq_len 4096 "
                "--global_batch_tokens 1048576 --top 5").split()
# the pipelines page's layout: 4 stages of SmolLM-1.7B's 24 layers, 8 micro-batches a step
PIPELINE_FLAGS = ("--model_name SmolLM-1.7B --dp 2 --pp 4 --mbs 2 --grad_acc_steps 8 "
                  "--seq_len 2048 --zero_stage 1").split()
IMAGES = os.path.join(ROOT, "docs", "images")
ENGINES = {"afab": [], "1f1b": [], "interleaved": ["distributed.pp_virtual_stages=2"]}


def search_text(argv) -> tuple:
    """(the command and its table, SearchResult) of `python -m picotron.plan` with argv; the
    last line, the search's own time, is left out (it is this machine's, not the model's)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = run_search(build_parser().parse_args(argv))
    lines = [line for line in out.getvalue().rstrip().splitlines()
             if not re.match(r"\(\S+ layouts judged in", line)]
    return "\n".join([f"$ python -m picotron.plan {' '.join(argv)}"] + lines), result


def write_config(tmp: str, name: str, flags: list) -> tuple:
    """(path, command) of the config create_config.py writes with `flags`."""
    argv = flags + ["--exp_name", name, "--skip_local_checks"]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        path = create_config.main(["--out_dir", tmp] + argv)
    return path, f"python create_config.py --out_dir tmp {' '.join(argv)}"


def draw(config_path: str, image: str, overrides=(), images: str = IMAGES,
         profile_name: str = PROFILE) -> tuple:
    """(explain's command, its summary, the lanes it drew) for one picture, written to
    `images` (the command names docs/images/, where the pages look)."""
    profile = load_profile(profile_name)
    out = os.path.join(images, image)
    _, summary = explain(config_path, profile, out, 8, overrides)
    lanes = step_lanes(config_for_profile(config_path, profile, overrides), profile, 8)
    sets = "".join(f" --set {o}" for o in overrides)
    name = os.path.basename(os.path.dirname(config_path))
    command = (f"python -m picotron.plan explain tmp/{name}/config.json --hardware {profile_name}"
               f"{sets} --out docs/images/{image}")
    return command, summary, lanes


def layout_flags(layout: dict) -> list:
    """create_config.py's flags for a layout of the search (search.LAYOUT_KEYS' names)."""
    flags = []
    for flag, knob in (("dp", "dp"), ("tp", "tp"), ("pp", "pp"), ("cp", "cp"), ("mbs", "mbs"),
                       ("grad_acc_steps", "grad_acc"), ("zero_stage", "zero")):
        flags += [f"--{flag}", str(layout[knob])]
    flags += ["--set", f"training.activation_checkpointing={layout['recompute']}",
              "--set", f"training.fp8={layout['fp8']}"]
    if layout["pp"] > 1:
        flags += ["--pp_engine", layout["pp_engine"]]
        if layout["pp_engine"] == "interleaved":
            flags += ["--set", f"distributed.pp_virtual_stages={layout['interleave']}"]
    if layout["cp"] > 1:
        flags += ["--set", f"distributed.cp_mode={layout['cp_mode']}"]
    return flags


def pipeline_idle(lanes, pp: int) -> float:
    """The share of the ranks' time, up to the last backward, in which they compute nothing."""
    end = max(b.end_s for b in lanes.bars if b.kind in ("forward", "backward"))
    return 1 - sum(busy_s(lanes.bars, r) for r in range(pp)) / (pp * end)


def readme_block(tmp: str) -> str:
    text, _ = search_text(SMOL_SEARCH)
    return f"```\n{text}\n```"


def pipelines_block(tmp: str, images: str = IMAGES) -> str:
    path, command = write_config(tmp, "smol-pp4", PIPELINE_FLAGS)
    commands, rows, pictures = [command], [], []
    pp, micro, v = 4, 8, 2
    for engine, extra in ENGINES.items():
        overrides = [f"distributed.pp_engine={engine}"] + extra
        explain_command, _, lanes = draw(path, f"pipeline-{engine}.png", overrides, images,
                                         PIPELINE_PROFILE)
        commands.append(explain_command)
        p = lanes.prediction
        chunks = v if engine == "interleaved" else 1
        bubble = (pp - 1) / (chunks * micro + pp - 1)
        peak = max(m.device_bytes for m in lanes.memory) / 2 ** 30
        rows.append(f"| {engine} | {1e3 * p.step_s:,.0f} ms | {p.tok_s_gpu:,.0f} | "
                    f"{pipeline_idle(lanes, pp):.1%} | {bubble:.1%} | {peak:.1f} GiB |")
        pictures.append(f"![{engine}: {pp} pipeline ranks, {micro} micro-batches]"
                        f"(images/pipeline-{engine}.png)")
    table = ["| engine | predicted step | tok/s/GPU | ranks idle in the pipeline | "
             "(p-1)/(v·m+p-1) | memory, largest rank |", "|---|---|---|---|---|---|"] + rows
    return "\n".join(["```bash"] + commands + ["```", ""] + table + [""]
                     + [f"{p}\n" for p in pictures]).rstrip()


def llama_block(tmp: str) -> str:
    text, result = search_text(LLAMA_SEARCH)
    top = result.ranked[0]
    # beside the top pick, the fastest layout on the other side of the pipeline question
    staged = top.layout["pp"] > 1
    other = next((s for s in result.ranked if (s.layout["pp"] > 1) != staged), None)
    what_other = ("The fastest layout without pipeline stages" if staged else
                  "The fastest layout with pipeline stages")
    lines = ["```", text, "```", ""]
    model = ["--model_name", "Llama-3-8B", "--seq_len", "4096"]
    for name, scored, what in (("llama8b-top", top, "The top pick"),
                               ("llama8b-other", other, what_other)):
        if scored is None:
            continue
        path, command = write_config(tmp, name, model + layout_flags(scored.layout))
        explain_command, summary, lanes = draw(path, f"plan-{name}.png")
        if abs(lanes.prediction.tok_s_gpu - scored.prediction.tok_s_gpu) > 1e-6 * max(
                1.0, scored.prediction.tok_s_gpu):
            sys.exit(f"error: explain predicts {lanes.prediction.tok_s_gpu:,.1f} tok/s/GPU for "
                     f"{name}, the search {scored.prediction.tok_s_gpu:,.1f}: the config "
                     f"written is not the search's layout")
        lines += [f"{what}, {summary.splitlines()[1].split(';')[0]}:", "", "```bash", command,
                  explain_command, "```", "", f"![{what}](images/plan-{name}.png)", ""]
    return "\n".join(lines).rstrip()


BLOCKS = {"readme": ("README.md", readme_block), "pipelines": ("docs/pipelines.md",
                                                                pipelines_block),
          "llama": ("docs/pipelines.md", llama_block)}


def block_of(content: str, name: str) -> tuple:
    """(before, the generated text, after) of a page's block `name`; None when it has none."""
    start, end = f"<!-- plan_figures:{name} -->\n", f"<!-- /plan_figures:{name} -->"
    if start not in content or end not in content:
        return None
    head, rest = content.split(start, 1)
    text, tail = rest.split(end, 1)
    return head + start, text.removesuffix("\n"), end + tail


def replace_block(page: str, name: str, text: str) -> None:
    path = os.path.join(ROOT, page)
    with open(path, encoding="utf-8") as f:
        parts = block_of(f.read(), name)
    if parts is None:
        sys.exit(f"error: {page} has no <!-- plan_figures:{name} --> ... <!-- /plan_figures:"
                 f"{name} --> block; add one where the figure goes")
    content = parts[0] + text + "\n" + parts[2]
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(BLOCKS), default=list(BLOCKS),
                   help="the blocks to make again (default: all)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            page, make = BLOCKS[name]
            replace_block(page, name, make(tmp))
            print(f"{page}: {name} written", flush=True)


if __name__ == "__main__":
    main()
