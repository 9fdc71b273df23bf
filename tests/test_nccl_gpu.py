"""Every 2-rank layout over NCCL on real GPUs equals one GPU (fp32, 1e-5 relative loss).

The gloo CPU tests (test_4d.py and the per-axis ones) prove the algorithms; this proves the
same code on NCCL, where a collective reads and writes device pointers: a CPU tensor handed
to NCCL is an illegal memory access there and silently works on gloo (the data-parallel
replica check did exactly that until a 2-GPU run found it). Skipped below 2 GPUs (CI has
none): run on a 2-GPU machine with `python -m pytest tests/test_nccl_gpu.py`. It drives
bench/multi_gpu.py's parity part, the same torchrun train.py runs a user makes.
"""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def test_every_two_gpu_layout_trains_like_one_gpu_over_nccl(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "multi_gpu.py"),
                           "--gpus", "2", "--parts", "parity", "--dtypes", "float32",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("parity float32 ")]
    ran = [ln for ln in rows if "skipped" not in ln]
    # dp2, tp2 with sequence parallelism without and with its collectives overlapped with
    # the GEMMs, pp2 1f1b and interleaved, cp2, dp2 at ZeRO-1 and 2 (parameter all-gathers
    # waited layer by layer in the next forward) and at ZeRO-3 (the GPU defaults: Triton
    # kernels, fused loss, TritonAdamW over the shards), with and without keeping the
    # parameters from forward to backward
    assert len(ran) == 10 and all(ln.endswith("PASS") for ln in ran), proc.stdout
