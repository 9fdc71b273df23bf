import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter on machines without a GPU (CI): slow, so
    # their tests use small inputs, but every kernel's indexing and math is checked there.
    # Set before any @triton.jit runs (kernels are wrapped for the interpreter at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The shared token cache (and Hugging Face's caches) go to the user's cache folder, found
# through XDG_CACHE_HOME: the tests (and the runs they launch) get a folder of their own.
# Removed when the session ends: left behind, one per session, they fill a machine that runs
# the suite all day.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="picotron-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def pytest_terminal_summary(terminalreporter):
    """The versions this run tested, beside its summary (pytest -q prints no header):
    requirements.txt gives lower bounds, so a fresh machine gets the newest release of each."""
    from importlib.metadata import PackageNotFoundError, version
    found = []
    for package in ("torch", "triton", "transformers", "datasets", "safetensors", "pytest",
                    "matplotlib", "tensorboard"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} absent")
    terminalreporter.write_line("tested with: " + ", ".join(found))


@pytest.fixture(autouse=True)
def no_leftover_process_group():
    """Tests that call checkpoint or training code in-process open a one-rank group; close it
    so the next test (or an in-process train.main) starts from a clean slate."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def unreachable_hub(monkeypatch):
    """A Hugging Face hub that refuses every connection at once (offline mode off); returns the
    list of the seconds anything slept, to show that nothing waited to retry."""
    import time

    from huggingface_hub import constants, hf_api
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")     # nothing listens
    monkeypatch.setattr(hf_api.api, "endpoint", "http://127.0.0.1:9")
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    return waits
