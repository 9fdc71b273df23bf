"""Every command a user can run answers `--help`: exit code 0, on a machine without a GPU,
writing nothing, and every option says what it does (a help text that is not empty).

The scripts run one after another in one process (tests/workers/show_help.py: each as
`python SCRIPT --help` would run it, its own folder first on sys.path), started from an empty
folder with an empty temporary folder, both of which must stay empty.

No command takes an abbreviated flag, and a flag it does not know (mistyped, abbreviated, or
another trainer's name for one of ours) is refused with the flags it most likely meant."""
import ast
import importlib
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT
from picotron.config.overrides import FLAG_ALIASES

ENTRY_POINTS = ["train.py", "create_config.py", "generate.py", "export_hf.py", "plot.py"]
WORKER = os.path.join(ROOT, "tests", "workers", "show_help.py")


def is_script(path: str) -> bool:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return 'if __name__ == "__main__":' in f.read()


def bench_files() -> list:
    return sorted(f"bench/{f}" for f in os.listdir(os.path.join(ROOT, "bench"))
                  if f.endswith(".py"))


def scripts() -> list:
    """The entry points and every bench script (each has a command line; a bench file
    without one is a library of the scripts: test_bench_libraries_are_used)."""
    return ENTRY_POINTS + [f for f in bench_files() if is_script(f)]


def test_bench_libraries_are_used():
    """A bench file with no command line holds what several scripts share; some bench script
    must import it, or it is dead code."""
    sources = {f: open(os.path.join(ROOT, f), encoding="utf-8").read() for f in bench_files()}
    for lib in (f for f in bench_files() if not is_script(f)):
        name = os.path.basename(lib)[:-len(".py")]
        users = [f for f, src in sources.items() if f != lib and is_script(f)
                 and (f"import {name}" in src or f"from {name} import" in src)]
        assert users, f"{lib} has no command line and no bench script imports it"


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict:
    """script -> what its `--help` did; every script also checked to leave no file behind."""
    cwd, tmp = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(CUDA_VISIBLE_DEVICES="", TMPDIR=str(tmp))
    proc = subprocess.run([sys.executable, WORKER] + [os.path.join(ROOT, s) for s in scripts()],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line[len("HELP "):]) for line in proc.stdout.splitlines()
               if line.startswith("HELP ")]
    assert len(results) == len(scripts()), proc.stdout[-3000:]
    # torch's compiler makes its cache folder in the temporary folder when it is imported
    # (torchinductor_<user>): torch's own, not written by a script
    left = sorted(os.listdir(cwd)) + sorted(f for f in os.listdir(tmp)
                                            if not f.startswith("torchinductor_"))
    assert not left, f"`--help` of some script wrote {left}"
    return {os.path.relpath(r["script"], ROOT): r for r in results}


@pytest.mark.parametrize("script", scripts())
def test_help_runs_and_documents_every_option(helps, script):
    r = helps[script]
    assert r["code"] == 0, f"`python {script} --help` failed ({r['code']}):\n{r['stderr'][-3000:]}"
    assert r["stdout"].startswith("usage:") and "Traceback" not in r["stderr"], (
        r["stdout"][-2000:], r["stderr"][-2000:])
    undocumented = [o["option"] for o in r["options"] if not (o["help"] or "").strip()]
    assert not undocumented, f"{script}: options without a help text: {undocumented}"


def parser_calls(path: str) -> list:
    """(line, whether allow_abbrev=False is given) of each ArgumentParser(...) in a file."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [(node.lineno, any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant)
                              and k.value.value is False for k in node.keywords))
            for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ArgumentParser"]


def test_no_command_takes_an_abbreviated_flag():
    """argparse takes `--seq 128` for `--seq_len 128` unless told not to; a flag added later
    would make such a command ambiguous, or change what it sets. Every parser of the
    repository's commands (the scripts, `python -m picotron.plan.memory_plan`) is told."""
    package = [os.path.relpath(os.path.join(d, f), ROOT)
               for d, _, names in os.walk(os.path.join(ROOT, "picotron")) for f in names
               if f.endswith(".py")]
    calls = {f: parser_calls(f) for f in scripts() + package}
    assert calls["picotron/plan/memory_plan.py"], "memory_plan's parser not found"
    allowing = [f"{f}:{line}" for f, found in calls.items() for line, refused in found
                if not refused]
    assert not allowing, f"ArgumentParser without allow_abbrev=False: {allowing}"


ABBREVIATED = [  # (module, its other arguments, an abbreviated flag, the flag it abbreviates)
    ("create_config", ["128"], "--seq", "--seq_len"),
    ("train", ["--config", "x.json", "training.seed=1"], "--se", "--set"),
    ("generate", ["--checkpoint", "x", "0.5"], "--temp", "--temperature"),
    ("export_hf", ["--checkpoint", "x", "y"], "--ou", "--out"),
    ("plot", ["x", "900x300"], "--si", "--size"),
    ("picotron.plan.memory_plan", [], "--hel", "--help"),
]


@pytest.mark.parametrize("module,argv,typed,meant", ABBREVIATED)
def test_an_abbreviation_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys, module,
                                                   argv, typed, meant):
    """One line naming the flag, and where the others are; exit code 2, as argparse refuses."""
    monkeypatch.chdir(tmp_path)                  # whatever a script would write lands here
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv[:-1] + [typed] + argv[-1:])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    said = f"unknown flag {typed} (did you mean {meant}?)"
    hint = "" if "--help" in said else "; --help lists every flag"
    assert err.rstrip().endswith(f"error: {said}{hint}"), err


UNKNOWN = [  # (module, command line, the error line's end: the flags it names)
    ("create_config", ["--seq_length", "128"], "unknown flag --seq_length (did you mean "
                                               "--seq_len?)"),
    ("create_config", ["--lr", "1e-3"], "unknown flag --lr (did you mean --learning_rate?)"),
    ("create_config", ["--steps", "9"], "unknown flag --steps (did you mean "
                                        "--total_train_steps?)"),
    ("create_config", ["--max_steps=9"], "unknown flag --max_steps (did you mean "
                                         "--total_train_steps?)"),
    ("create_config", ["--batch_size", "4"], "unknown flag --batch_size (did you mean --mbs?)"),
    ("create_config", ["--gradient_accumulation_steps", "4"],
     "unknown flag --gradient_accumulation_steps (did you mean --grad_acc_steps?)"),
    ("create_config", ["--dp_size", "2"], "unknown flag --dp_size (did you mean --dp?)"),
    ("create_config", ["--num_hiden_layers", "2"], "unknown flag --num_hiden_layers (did you "
                                                   "mean --num_hidden_layers?)"),
    # a config key without a flag of its own: --set of it, with the value typed
    ("create_config", ["--warmup_steps", "10"], "unknown flag --warmup_steps (did you mean "
                                                "--set training.warmup_steps=10?)"),
    ("train", ["--config", "x.json", "--lr", "1e-3"], "unknown flag --lr (did you mean --set "
                                                      "training.learning_rate=1e-3?)"),
    ("train", ["--conf", "x.json"], "unknown flag --conf (did you mean --config?)"),
    ("generate", ["--checkpoint", "x", "--max_tokens", "5"], "unknown flag --max_tokens (did "
                                                            "you mean --max_new_tokens?)"),
    ("create_config", ["--lr", "1", "--zzz"], "unknown flags --lr (did you mean "
                                             "--learning_rate?), --zzz; --help lists every flag"),
]


@pytest.mark.parametrize("module,argv,said", UNKNOWN)
def test_an_unknown_flag_is_refused_naming_the_flags_meant(tmp_path, monkeypatch, capsys,
                                                          module, argv, said):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    hint = "" if "--help" in said else "; --help lists every flag"
    assert err.rstrip().endswith(f"error: {said}{hint}"), err


def test_a_mistyped_flag_on_the_command_line(tmp_path):
    """As a user meets it: one line naming the flag, exit code 2, no traceback."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "create_config.py"),
                           "--seq_length", "128"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc
    assert proc.stderr == ("create_config.py: error: unknown flag --seq_length (did you mean "
                           "--seq_len?); --help lists every flag\n"), proc.stderr
    assert "Traceback" not in proc.stderr and not os.listdir(tmp_path)


def test_every_common_name_stands_for_a_flag(helps):
    """The table of other trainers' flag names names flags that the entry points have."""
    flags = {option[2:] for script in ENTRY_POINTS for o in helps[script]["options"]
             for option in o["option"].split("/") if option.startswith("--")}
    assert not set(FLAG_ALIASES.values()) - flags
