"""Every command a user can run answers `--help`: exit code 0, on a machine without a GPU,
writing nothing, and every option says what it does (a help text that is not empty).

The scripts run one after another in one process (tests/workers/show_help.py: each as
`python SCRIPT --help` would run it, its own folder first on sys.path), started from an empty
folder with an empty temporary folder, both of which must stay empty."""
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT

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
