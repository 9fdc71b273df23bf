"""On the fast path a training step never makes the host wait for the GPU (skipped without CUDA).

Why it matters: any wait (`.item()`, a blocking copy, `torch.equal`) drains the queue of
launched kernels, and the GPU then idles while the host launches the next ones. train.py's
loop body is run here as train.py runs it (model.kernels=triton, training.fused_loss=triton,
the one-pass Triton AdamW, StepBatches' prefetch, StepValues for the logged scalars; it is
train.queue_step itself) under torch's sync debug mode "error", which raises on every
synchronizing CUDA call. The values are read afterwards.
"""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import create_config  # noqa: E402
import train  # noqa: E402
from picotron.data.windows import StepBatches, build_train_val  # noqa: E402
from picotron.utils import StepValues  # noqa: E402


@pytest.mark.parametrize("fused_loss", ["triton", "chunked", "none"])
def test_a_training_step_never_waits_for_the_gpu(tmp_path, monkeypatch, fused_loss):
    path = create_config.main([
        "--out_dir", str(tmp_path), "--exp_name", "sync", "--mbs", "4", "--seq_len", "128",
        "--total_train_steps", "10", "--use_fused_adam", "--set", "model.kernels=triton",
        "--set", f"training.fused_loss={fused_loss}", "--set", "training.dtype=bfloat16",
        "--set", "training.master_weights=false"])
    config, pgm, device = train.setup(path)
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    batches = StepBatches(build_train_val(config, str(tmp_path))[0], config, pgm, device)

    queued = {}

    class Kept(StepValues):      # also keeps the device tensors, to check what read() returns
        def __init__(self, values, device):
            queued.update(values)
            super().__init__(values, device)
    monkeypatch.setattr(train, "StepValues", Kept)

    def step(i):                 # train.py's loop body, up to the values it logs
        return train.queue_step(model, loss_fn, grads, optimizer, batches, i, config, pgm,
                                device)
    for i in range(2):           # compile the Triton kernels, fill the allocator's cache
        step(i).read()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        values = step(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = values.read()
    assert got["step"] == 3 and got["loss"] == queued["loss"].item() and got["skipped"] == 0.0
    assert 0 < got["grad_norm"] < float("inf")
