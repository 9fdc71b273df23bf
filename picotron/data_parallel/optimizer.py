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

AdamW is elementwise, so running it on flat shards is the same math as on whole parameters:
torch's foreach AdamW, one optimizer for the shards on the device and one for those on the
CPU. A step: the global gradient norm, a skip if it is not finite (fp16 overflow), the clip
and unscale factor, `update` (AdamW), then the ZeRO all-gather. A faster update can replace
`update` and `step` in a subclass; this class is the reference it is tested against.
"""
import torch
import torch.distributed as dist

from picotron.comm import all_gather_single
from picotron.data_parallel.loss_scaler import DynamicLossScaler


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
            if offload:     # a copy: .float().cpu() of an fp32 CPU shard would be itself
                master = shard.detach().to("cpu", torch.float32, copy=True)
            elif shard.dtype != torch.float32 and t.master_weights:
                master = shard.detach().float().clone()
            else:
                master = shard                         # update the parameters in place
            self.masters.insert(0, master)
            self.offloaded.insert(0, offload)
        self.optimizers = []            # [on the device, on the CPU], those that have shards
        self.offload_optimizer = None   # the one that steps the CPU-offloaded masters
        for on_cpu in (False, True):
            mine = [(b, m) for b, m, o in zip(grads.buckets, self.masters, self.offloaded)
                    if o == on_cpu]
            if not mine:
                continue
            groups = [{"params": [m for b, m in mine if b.weight_decay],
                       "weight_decay": t.weight_decay},
                      {"params": [m for b, m in mine if not b.weight_decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            self.optimizers.append(torch.optim.AdamW(
                groups, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                foreach=True))
            if on_cpu:
                self.offload_optimizer = self.optimizers[-1]

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
            if shards:
                sq[i] = self.sum_of_squares(shards)
        pgm = self.pgm
        if self.grads.shards > 1:
            dist.all_reduce(sq, group=pgm.cp_dp_group)
        if pgm.tp_size > 1:
            dist.all_reduce(sq[0:1], group=pgm.tp_group)
        total = sq.sum()
        if pgm.pp_size > 1:
            dist.all_reduce(total, group=pgm.pp_group)
        return total.sqrt()

    def sum_of_squares(self, shards):
        """The sum over the shards of sum(g^2), in fp32 (a 0-dim tensor). torch.sum adds
        pairwise; torch's CPU norms add one by one and lose 1e-5 relative over 3M elements,
        which the parity tests would see."""
        return sum(g.float().pow(2).sum() for g in shards)

    def clip_factor(self, norm):
        """The factor that brings the gradient norm down to training.max_grad_norm (at most 1;
        1 when clipping is off), a device scalar."""
        max_norm = self.config.training.max_grad_norm
        if max_norm <= 0:
            return torch.ones_like(norm)
        return torch.clamp(max_norm / (norm + 1e-6), max=1.0)

    def step(self, lr: float):
        """Unscale, clip to training.max_grad_norm, step, share the updated shards.

        Returns (grad norm, skipped). With fp16 loss scaling a non-finite norm (some rank
        overflowed: the norm is reduced over every axis, so all ranks agree) skips the step;
        reading the norm here makes the host wait for the device, once a step."""
        scale = self.scaler.scale
        norm = self.global_grad_norm() / scale
        if not torch.isfinite(norm).item():
            self.scaler.update(overflow=True)
            return norm, True
        self.scaler.update(overflow=False)
        self.update(lr, self.clip_factor(norm) / scale)
        self.grads.all_gather_params()
        self.weights_changed()
        return norm, False

    def weights_changed(self):
        """Bump every parameter's version counter, as an in-place op on it would. The update
        wrote the flat buffers the parameters are views of, whose counters are not the
        parameters' own (`p.data = view` keeps p's), and whatever is keyed on a parameter's
        version (a cache of its cast copies, as the FP8 plug-in keeps) must see the step."""
        torch.autograd.graph.increment_version([p for b in self.grads.buckets
                                                for p in b.members])

    def update(self, lr: float, grad_mul):
        """AdamW on every master, its gradient being this rank's gradient shard times
        `grad_mul` (clip / loss scale, a device scalar)."""
        self.torch_update(lr, grad_mul, self.optimizers)

    def torch_update(self, lr: float, grad_mul, optimizers):
        """torch's AdamW on the masters that `optimizers` hold: their gradients scaled in fp32,
        the step, then each updated master copied into the parameters it stands for."""
        mine = {id(m) for opt in optimizers for group in opt.param_groups
                for m in group["params"]}
        members = [(b, master, shard) for b, master, shard in
                   zip(self.grads.buckets, self.masters, self.param_shards) if id(master) in mine]
        for b, master, _ in members:
            g = self.grads.grad_shard(b)
            g = g.float() if g.dtype != torch.float32 else g     # scaled in place if fp32
            master.grad = g.mul_(grad_mul).to(device=master.device, dtype=master.dtype)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        for _, master, shard in members:
            master.grad = None
            if master is not shard:
                shard.copy_(master, non_blocking=True)

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
            def piece(value_of):                 # value_of(p): a tensor shaped like p
                flat = torch.zeros(b.numel, dtype=torch.float32, device=b.params.device)
                for p, offset in zip(b.members, b.offsets):
                    flat[offset:offset + p.numel()] = value_of(p).flatten()
                return flat[start:start + b.shard_numel].to(master.device, master.dtype)
            with torch.no_grad():
                if master is not shard:
                    # no saved master (fp32 weights): the loaded parameters are the master
                    # (read whole: ZeRO-3 gathers them for the load)
                    has = all("master" in state.get(p, {}) for p in b.members)
                    master.copy_(piece(lambda p: state[p]["master"] if has else p))
            if all("exp_avg" in state.get(p, {}) for p in b.members):
                fused = opt.defaults.get("fused")
                # torch's AdamW keeps `step` on the CPU unless fused (or capturable)
                opt.state[master] = {
                    "step": torch.tensor(float(state["step"]), dtype=torch.float32,
                                         device=master.device if fused else "cpu"),
                    "exp_avg": piece(lambda p: state[p]["exp_avg"]),
                    "exp_avg_sq": piece(lambda p: state[p]["exp_avg_sq"])}

    def _optimizer_of(self, master):
        return next(o for o in self.optimizers
                    if any(m is master for g in o.param_groups for m in g["params"]))

    def _gather(self, bucket, local):
        if self.grads.shards == 1:
            return local
        full = torch.empty(bucket.numel, dtype=local.dtype, device=local.device)
        all_gather_single(full, local.contiguous(), group=self.pgm.cp_dp_group)
        return full
