"""The config reference (docs/config.md) is generated from the typed config: the page in the
repository is exactly what the generator writes, and a key without a help line stops the
generator with a message naming the key."""
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT
from picotron.config import reference


def test_the_page_is_what_the_generator_writes():
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        page = f.read()
    assert page == reference.page(), f"docs/config.md is stale: run {reference.COMMAND}"


def test_the_command_the_page_names_writes_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "picotron.config.reference"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference.page()
    assert reference.COMMAND in done.stdout


def test_a_key_without_help_is_refused(monkeypatch):
    help_text = reference.load_help()
    del help_text["training.seed"]
    help_text["training.sede"] = "a misspelt key"
    monkeypatch.setattr(reference, "load_help", lambda: help_text)
    with pytest.raises(SystemExit, match=r"missing: training\.seed; not a key: training\.sede"):
        reference.page()


def test_an_empty_help_line_is_refused(monkeypatch):
    help_text = {**reference.load_help(), "logging.run_name": "  "}
    monkeypatch.setattr(reference, "load_help", lambda: help_text)
    with pytest.raises(SystemExit, match=r"missing: logging\.run_name;"):
        reference.page()


def test_every_help_line_is_one_line():
    with open(reference.HELP_FILE, encoding="utf-8") as f:
        help_text = json.load(f)
    assert all("\n" not in line and "|" not in line.replace("\\|", "") for line in
               help_text.values())
