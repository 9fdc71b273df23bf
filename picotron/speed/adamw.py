"""build_optimizer: the readable DistributedAdamW, or on a GPU with `training.use_fused_adam` its
subclass TritonAdamW, whose update is one Triton kernel per flat shard
(speed/kernels/triton_adamw.py) that also unscales, clips, and writes the bf16 parameters, and whose
step never makes the host wait.

What the subclass changes, and why:
- `update`: torch's foreach AdamW takes five passes over every gradient (clip in place, cast,
  AdamW, copy the fp32 master back into the bf16 weights); the kernel takes one.
- `sum_of_squares` (the gradient norm's): torch's blocked fp32 norms, with no squared copy.
- `step`: the reference reads the gradient norm on the host to skip a non-finite step. Here
  the skip flag goes to the kernel as a device scalar, which then writes nothing, so nothing
  waits. fp16 loss scaling (the scaler must see an overflow) and CPU offload (its AdamW runs on
  the host anyway) keep the reference's step, with the kernel as the update.
tests/test_triton_adamw.py checks the kernel against torch's AdamW, step by step.
"""
import torch

from picotron.config import MissingPackage
from picotron.data_parallel import DistributedAdamW


class TritonAdamW(DistributedAdamW):
    def __init__(self, grads, pgm, config):
        super().__init__(grads, pgm, config)
        try:     # now, so that a missing package stops the build, not the first step
            from picotron.speed.kernels.triton_adamw import adamw_step
        except ImportError as e:
            raise MissingPackage("training.use_fused_adam=true on a GPU (AdamW as one Triton "
                                 "kernel)", "the triton package (`pip install triton`)",
                                 "or set training.use_fused_adam=false", e) from None
        self.adamw_step = adamw_step
        self.device_optimizer = next((o for o in self.optimizers
                                      if o is not self.offload_optimizer), None)

    def step(self, lr: float):
        if self.scaler.enabled or self.offload_optimizer is not None:
            return super().step(lr)
        norm = self.global_grad_norm()
        finite = torch.isfinite(norm)
        self._update(lr, torch.stack([self.clip_factor(norm), (~finite).float()]))
        self.grads.all_gather_params()
        self.weights_changed()
        return norm, ~finite            # skipped: a device bool, read when the step is logged

    def sum_of_squares(self, shards):
        """The gradient norm's squares as blocked fp32 sums on the GPU, with no squared copy
        of each shard (the reference's pow(2) allocates one)."""
        return torch.stack(torch._foreach_norm(shards, dtype=torch.float32)).square().sum()

    def update(self, lr: float, grad_mul):
        """The reference's step (fp16, offload) calls this once it knows the step is finite:
        torch's AdamW on the CPU-offloaded masters, the kernel on the others."""
        if self.offload_optimizer is not None:
            self.torch_update(lr, grad_mul, [self.offload_optimizer])
        self._update(lr, torch.stack([grad_mul, torch.zeros_like(grad_mul)]))

    def _update(self, lr: float, scalars):
        """The kernel on every master on the device. scalars: fp32 (2,) on the device,
        [gradient multiplier (clip / loss scale), skip flag]."""
        if self.device_optimizer is None:
            return
        grads, writes = {}, {}
        for b, master, shard, offload in zip(self.grads.buckets, self.masters,
                                             self.param_shards, self.offloaded):
            if not offload:
                grads[master] = self.grads.grad_shard(b)      # unscaled: the kernel multiplies
                if master is not shard:
                    writes[master] = shard                    # the bf16 weights it stands for
        for group in self.device_optimizer.param_groups:
            group["lr"] = lr
        self.adamw_step(self.device_optimizer, grads, writes, scalars)


def build_optimizer(grads, pgm, config, device):
    """TritonAdamW on a GPU with training.use_fused_adam, else the reference."""
    if config.training.use_fused_adam and device.type == "cuda":
        return TritonAdamW(grads, pgm, config)
    return DistributedAdamW(grads, pgm, config)
