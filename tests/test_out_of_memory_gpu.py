"""A GPU that really runs out of memory (skipped without CUDA): train.py ends in the watchdog's
one line, naming the fixes, with no traceback from torch.

The config is SmolLM-360M's shape at micro-batch 16, whose estimate fits the GPU; the run is
capped (torch.cuda.set_per_process_memory_fraction, in the child before train.py starts) at
half its estimate, so the allocator refuses mid-build or in the first step, as on a smaller
GPU whose plan was short. tests/test_out_of_memory.py checks the same line on CPU, with the
error raised by hand.
"""
import subprocess
import sys

import pytest
import torch

import create_config
from launch import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CAPPED = """
import runpy, sys, torch
from picotron.config import load_config
from picotron.plan.memory_plan import estimate
need = estimate(load_config(sys.argv[1])).device_bytes
torch.cuda.set_per_process_memory_fraction(0.5 * need / torch.cuda.mem_get_info()[1])
sys.argv = ["train.py", "--config", sys.argv[1]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_gpu_out_of_memory_ends_in_one_line(tmp_path):
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "oom", "--model_name",
                               "SmolLM-360M", "--dataset_name", "synthetic", "--seq_len", "2048",
                               "--mbs", "16", "--total_train_steps", "3",
                               "--set", "training.warmup_steps=1"])
    proc = subprocess.run([sys.executable, "-c", CAPPED, path], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "the GPU ran out of memory" in errors[0], proc.stderr[-3000:]
    assert "these would fit with 10% to spare: " in errors[0], errors[0]
