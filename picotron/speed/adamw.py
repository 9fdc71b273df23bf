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
- CPU offload (`torch_update`): the host masters are stepped by torch's fused CPU AdamW, one
  vectorised pass per tensor where foreach makes a pass per op (bench/offload_adamw.py times
  both); the same math, within an ulp. The shards cross PCIe through pinned buffers allocated
  once, in the parameters' dtype (the reference sends fp32 up and makes an fp32 copy on the GPU
  to send down, both through pageable memory, which the driver stages and waits for).
tests/test_triton_adamw.py checks the kernel against torch's AdamW, step by step, and this class
against the reference.
"""
import torch

from picotron.config import MissingPackage
from picotron.data_parallel import DistributedAdamW


def fused_like(opt):
    """torch's fused AdamW over `opt`'s masters, with its hyper-parameters group by group.
    Built before the first step: there is no state to carry over."""
    assert not opt.state, "replace the optimizer before it steps"
    keys = ("lr", "betas", "eps", "weight_decay")
    groups = [{"params": g["params"], **{k: g[k] for k in keys}} for g in opt.param_groups]
    return torch.optim.AdamW(groups, **{k: opt.defaults[k] for k in keys}, fused=True)


def host_views(buckets_masters, dtype_of, pin: bool) -> dict:
    """{master: (S,) view} into one host tensor per dtype (`dtype_of(bucket)`) holding every
    shard: the pinned allocator rounds each allocation up to a power of two, which one tensor
    pays once where a tensor per bucket (S of a few million) would pay it every time."""
    views = {}
    for dtype in {dtype_of(b) for b, _ in buckets_masters}:
        mine = [(b, m) for b, m in buckets_masters if dtype_of(b) == dtype]
        flat = torch.empty(sum(b.shard_numel for b, _ in mine), dtype=dtype, pin_memory=pin)
        views.update(zip([m for _, m in mine], flat.split([b.shard_numel for b, _ in mine])))
    return views


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
        if self.offload_optimizer is not None:
            # in both places: checkpoints find a master's optimizer through self.optimizers
            fused = fused_like(self.offload_optimizer)
            self.optimizers[self.optimizers.index(self.offload_optimizer)] = fused
            self.offload_optimizer = fused
            self.on_gpu = grads.buckets[0].params.device.type == "cuda"
            self.grad_mul_host = torch.empty((), dtype=torch.float32, pin_memory=self.on_gpu)
            self.staging = self.host_buffers(pin=self.on_gpu)

    def host_buffers(self, pin: bool):
        """{master: (grad, grad32, weights)} for each offloaded master, host tensors of its
        shard's S elements: `grad` in the gradient buffer's dtype and `weights` in the
        parameters', pinned on a GPU (so the copies are asynchronous DMA with no staging copy by
        the driver), and `grad32`, the fp32 gradient AdamW reads (`grad` itself when fp32; never
        crosses PCIe, so not pinned). On a CPU run they are plain tensors and the copies through
        them ordinary ones: the same path, which the CPU tests then exercise."""
        mine = [(b, m) for b, m, offload in zip(self.grads.buckets, self.masters, self.offloaded)
                if offload]
        grads = host_views(mine, lambda b: b.grad_dtype, pin)
        weights = host_views(mine, lambda b: b.params.dtype, pin)
        out = {}
        for b, master in mine:
            grad = grads[master]
            grad32 = grad if grad.dtype == torch.float32 else \
                torch.empty(b.shard_numel, dtype=torch.float32)
            out[master] = (grad, grad32, weights[master])
        return out

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

    def torch_update(self, lr: float, grad_mul, optimizers):
        """The reference's torch_update for the offloaded masters, through the host buffers:
        each gradient shard (S,) comes down in its own dtype and is scaled in fp32 here (an
        fp32 multiply is the same IEEE operation on the host as on the device, so AdamW sees the
        reference's gradient bit for bit); the fused AdamW steps; each updated master is cast to
        the parameters' dtype here (round to nearest even, as the device's cast) and goes up."""
        assert optimizers == [self.offload_optimizer], "only the offloaded masters step here"
        mine = [(b, m, s) for b, m, s, offload in zip(self.grads.buckets, self.masters,
                                                      self.param_shards, self.offloaded) if offload]
        # down: every copy queued, then one wait (the shards are the reduced gradients of
        # this stream's backward; queued after it, they read them finished)
        for b, master, _ in mine:
            self.staging[master][0].copy_(self.grads.grad_shard(b), non_blocking=True)
        self.grad_mul_host.copy_(grad_mul, non_blocking=True)
        if self.on_gpu:
            torch.cuda.current_stream().synchronize()
        for _, master, _ in mine:
            grad, grad32, _ = self.staging[master]
            if grad32 is not grad:
                grad32.copy_(grad)
            master.grad = grad32.mul_(self.grad_mul_host)
        for group in self.offload_optimizer.param_groups:
            group["lr"] = lr
        self.offload_optimizer.step()
        # up: the last step's copies read these same `weights` buffers; they were queued on
        # this stream before this step's downloads, so the wait above saw them done
        for _, master, shard in mine:
            master.grad = None
            weights = self.staging[master][2]
            weights.copy_(master)
            shard.copy_(weights, non_blocking=True)

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
