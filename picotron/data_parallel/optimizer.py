"""AdamW over this rank's shards of the gradient buckets: ZeRO-1/2, CPU offload, loss scaling.

For each bucket the optimizer updates a "master" tensor that covers this rank's shard (the
whole bucket when zero_stage is 0):
- fp32 parameters: the master *is* the shard of the flat parameter buffer (no copy);
- bf16/fp16 parameters with `training.master_weights` (the safe default): an fp32 copy, so
  small updates are not rounded away; AdamW's moments are fp32 too;
- bf16 parameters without master weights (picotron's regime): the bf16 shard itself, with
  bf16 moments (half the optimizer memory, less precise);
- a bucket chosen for CPU offload (`distributed.offload_optim_frac` of the elements, like
  ColossalAI Gemini's `offload_optim_frac`): an fp32 master on the CPU, stepped there; its
  gradient goes down and the updated values come back each step.
After the step, ZeRO ranks all-gather the updated shards so every replica has every weight.

AdamW is elementwise, so running it on flat shards is the same math as on whole parameters.
The step: torch's foreach AdamW (the reference) on CPU, for offloaded shards, and with
`training.use_fused_adam` false; otherwise one Triton kernel per shard
(picotron/ops/triton_adamw.py) that also unscales, clips and writes the bf16 weights.
"""
import torch
import torch.distributed as dist

from picotron.comm import all_gather_single
from picotron.config import MissingPackage
from picotron.data_parallel.loss_scaler import DynamicLossScaler


def _triton_adamw():
    try:
        from picotron.ops.triton_adamw import adamw_step
    except ImportError as e:
        raise MissingPackage("training.use_fused_adam=true on a GPU (AdamW as one Triton "
                             "kernel)", "the triton package (`pip install triton`)",
                             "or set training.use_fused_adam=false", e) from None
    return adamw_step


class DistributedAdamW:
    def __init__(self, grads, pgm, config):
        t, d = config.training, config.distributed
        self.grads, self.pgm, self.config = grads, pgm, config
        self.scaler = DynamicLossScaler(t.dtype == "float16", t.initial_loss_scale,
                                        t.loss_scale_window)
        budget = d.offload_optim_frac * sum(b.shard_numel for b in grads.buckets)
        self.masters, self.offloaded = [], []
        self.param_shards = [grads.param_shard(b) for b in grads.buckets]   # views, kept once
        for b, shard in reversed(list(zip(grads.buckets, self.param_shards))):
            # (reversed: the embedding-side buckets are offloaded first)
            offload = budget > 0
            budget -= b.shard_numel if offload else 0
            if offload:
                master = shard.detach().float().cpu()
            elif shard.dtype != torch.float32 and t.master_weights:
                master = shard.detach().float().clone()
            else:
                master = shard                         # update the parameters in place
            self.masters.insert(0, master)
            self.offloaded.insert(0, offload)
        self.optimizers, self.triton = [], False
        for on_cpu in (False, True):
            mine = [(b, m) for b, m, o in zip(grads.buckets, self.masters, self.offloaded)
                    if o == on_cpu]
            if not mine:
                continue
            groups = [{"params": [m for b, m in mine if b.weight_decay],
                       "weight_decay": t.weight_decay},
                      {"params": [m for b, m in mine if not b.weight_decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            # On a GPU with use_fused_adam, picotron/ops/triton_adamw.py steps these tensors
            # (this AdamW then only holds groups and state); otherwise torch's foreach AdamW.
            self.triton = t.use_fused_adam and mine[0][1].device.type == "cuda" or self.triton
            self.optimizers.append(torch.optim.AdamW(
                groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                foreach=True))
        # resolved now, so a missing triton stops the build, not the first step
        self.adamw_step = _triton_adamw() if self.triton else None

    def global_grad_norm(self):
        """L2 norm of the whole model's gradient, from this rank's shards.

        Squares are summed: over cp_dp when the shards are disjoint (ZeRO), over TP for
        TP-sharded buckets only (a replicated norm gain counts once), and over PP stages.
        Buckets marked `norm_skip` (the second copy of a tied weight) are left out."""
        device = self.grads.buckets[0].params.device
        sq = torch.zeros(2, dtype=torch.float32, device=device)    # [tp-sharded, replicated]
        for i, tp_sharded in enumerate((True, False)):
            shards = [self.grads.grad_shard(b) for b in self.grads.buckets
                      if not b.norm_skip and b.tp_sharded == tp_sharded]
            if shards and device.type == "cuda":    # blocked fp32 sums, no squared copy
                sq[i] = torch.stack(torch._foreach_norm(shards, dtype=torch.float32)
                                    ).square().sum()
            elif shards:     # CPU: torch.sum's pairwise sum; the CPU norms accumulate one by
                # one and lose 1e-5 relative over 3M elements, which the parity tests see
                sq[i] = sum(g.float().pow(2).sum() for g in shards)
        pgm = self.pgm
        if self.grads.shards > 1:
            dist.all_reduce(sq, group=pgm.cp_dp_group)
        if pgm.tp_size > 1:
            dist.all_reduce(sq[0:1], group=pgm.tp_group)
        total = sq.sum()
        if pgm.pp_size > 1:
            dist.all_reduce(total, group=pgm.pp_group)
        return total.sqrt()

    def step(self, lr: float):
        """Unscale, clip to training.max_grad_norm, step, share the updated shards.

        Returns (grad norm, skipped). With fp16 loss scaling a non-finite norm (some rank
        overflowed: the norm is reduced over every axis, so all ranks agree) skips the step.
        On the Triton path without loss scaling, `skipped` is a device bool: nothing here waits
        for the norm, and the kernel itself skips a non-finite step."""
        scale = self.scaler.scale
        norm = self.global_grad_norm() / scale
        finite = torch.isfinite(norm)
        skipped = ~finite                          # a device bool on the Triton path
        if self.scaler.enabled or not self.triton:
            # The host decides (a sync): fp16's scaler needs to know, and the torch path cannot
            # skip on the device. The Triton path skips on the device and never waits here.
            if not finite.item():
                self.scaler.update(overflow=True)
                return norm, True
            self.scaler.update(overflow=False)
            skipped = False
        max_norm = self.config.training.max_grad_norm
        clip = (torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm > 0
                else torch.ones_like(norm))
        scalars = torch.stack([clip / scale, (~finite).float()])   # read by the Triton kernel
        on_device, writes = {}, {}
        for b, master, shard, offload in zip(self.grads.buckets, self.masters,
                                             self.param_shards, self.offloaded):
            g = self.grads.grad_shard(b)
            if self.triton and not offload:
                on_device[master] = g                 # unscaled: the kernel multiplies
                if master is not shard:
                    writes[master] = shard
            else:
                g = g.float() if g.dtype != torch.float32 else g   # scaled in fp32
                master.grad = g.mul_(scalars[0]).to(device=master.device, dtype=master.dtype)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            if self.triton and opt is self.optimizers[0]:
                self.adamw_step(opt, on_device, writes, scalars)
            else:
                opt.step()
        for master, shard, offload in zip(self.masters, self.param_shards, self.offloaded):
            master.grad = None
            if master is not shard and not (self.triton and not offload):
                shard.copy_(master, non_blocking=True)
        self.grads.all_gather_params()
        return norm, skipped

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: moments plus master copies."""
        total = sum(m.numel() * m.element_size() for m, s in zip(self.masters, self.param_shards)
                    if m is not s)
        for opt in self.optimizers:
            for state in opt.state.values():
                total += sum(v.numel() * v.element_size() for v in state.values()
                             if torch.is_tensor(v) and v.dim() > 0)
        return total

    # ---- checkpoints: state keyed by parameter name, independent of buckets and ZeRO ------
    def _keys(self, master, shard):
        return ["exp_avg", "exp_avg_sq"] + (["master"] if master is not shard else [])

    def param_state(self) -> dict:
        """{param: {key: tensor shaped like the param}} for this rank's (TP-local) parameters,
        with key in exp_avg, exp_avg_sq and, with separate master weights, master; plus
        {"step": n}. Collective over cp_dp under ZeRO (the shards are gathered)."""
        out = {"step": 0}
        for b, master, shard in zip(self.grads.buckets, self.masters, self.param_shards):
            state = self._optimizer_of(master).state.get(master)
            if not state:
                continue
            out["step"] = int(state["step"])
            for key in self._keys(master, shard):
                local = (master if key == "master" else state[key]).detach()
                local = local.to(device=b.params.device, dtype=torch.float32)
                full = self._gather(b, local)
                for p, offset in zip(b.members, b.offsets):
                    out.setdefault(p, {})[key] = full[offset:offset + p.numel()].view_as(p)
        return out

    def load_param_state(self, state: dict) -> None:
        """Inverse of param_state, after the weights were loaded into the parameters. Masters
        missing from `state` (a checkpoint of fp32 weights) are taken from the parameters."""
        for b, master, shard in zip(self.grads.buckets, self.masters, self.param_shards):
            opt = self._optimizer_of(master)
            start = self.grads.shard_index * b.shard_numel
            def piece(key):
                flat = torch.zeros(b.numel, dtype=torch.float32, device=b.params.device)
                for p, offset in zip(b.members, b.offsets):
                    flat[offset:offset + p.numel()] = state[p][key].flatten()
                return flat[start:start + b.shard_numel].to(master.device, master.dtype)
            with torch.no_grad():
                if master is not shard:
                    has = all("master" in state.get(p, {}) for p in b.members)
                    master.copy_(piece("master") if has else shard)
            if all("exp_avg" in state.get(p, {}) for p in b.members):
                fused = opt.defaults.get("fused")
                opt.state[master] = {
                    "step": torch.tensor(float(state["step"]), dtype=torch.float32,
                                         device=master.device if fused else "cpu"),
                    "exp_avg": piece("exp_avg"), "exp_avg_sq": piece("exp_avg_sq")}

    def _optimizer_of(self, master):
        return next(o for o in self.optimizers
                    if any(m is master for g in o.param_groups for m in g["params"]))

    def _gather(self, bucket, local):
        if self.grads.shards == 1:
            return local
        full = torch.empty(bucket.numel, dtype=local.dtype, device=local.device)
        all_gather_single(full, local.contiguous(), group=self.pgm.cp_dp_group)
        return full
