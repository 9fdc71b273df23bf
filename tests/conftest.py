import os
import sys

import pytest
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


@pytest.fixture(autouse=True)
def no_leftover_process_group():
    """Tests that call checkpoint or training code in-process open a one-rank group; close it
    so the next test (or an in-process train.main) starts from a clean slate."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
