"""ZeRO-3 (Rajbhandari et al. 2020): the parameters are sharded too, not only the optimizer
state and the gradients. N = cp_dp_size ranks; each holds 1/N of every parameter.

The unit of sharding is one decoder layer, plus one "root" unit for whatever is not in a layer
(embedding, final norm, head). A unit's parameters lie in flat buffers, one per kind of
parameter, each cut into N equal shards (zero3_layout.py, which also draws the initial values
straight into the shards): rank r keeps shard r for good (`bucket.shard`, what AdamW updates);
the whole buffer (`bucket.params`, every parameter a view into it) exists only while the unit
is in use: its storage is resized to zero otherwise.

    forward of layer i     pre-hook:  all-gather layer i (waited), start layer i+1's gather
                           post-hook: free layer i
    backward of layer i    entry:     all-gather layer i again, start layer i-1's gather
                           each gradient, as it is accumulated: added into the bucket's buffer;
                           a bucket's last one: reduce-scatter the bucket (async, one in
                           flight at a time); the layer's last one: free layer i
    end of backward        finish():  wait for the reduce-scatters; free every unit

So at most two layers are whole at once (the one running, the next one's gather), plus the
root. `distributed.zero3_keep_params` skips both frees of a layer: it stays whole from its
first forward to finish(), one gather per layer and step instead of two per micro-batch, for
the memory of the unsharded parameters during the step (ZeRO-2's, less the optimizer).

The collectives, over the cp_dp group: all_gather (shard -> whole buffer) before each use,
reduce_scatter (whole gradient -> the sum of this rank's shard) after each backward. Nothing
else: the optimizer steps on the shards, and the next forward gathers the updated values.

Why these hooks. The forward uses module hooks (a pre-hook and a post-hook on each layer). The
entry of a layer's backward is an identity autograd Function applied to the layer's output
(`_GatherForBackward`): autograd runs its backward, which gathers, before any node inside the
layer, including the recomputed forward of activation checkpointing (which calls the layer's
forward directly, without hooks). A module's full-backward pre-hook fires at the same moment,
but through nodes torch wraps around every input and output; the Function is one node that
says what it does. The end of the layer's backward is the last of its parameters'
post-accumulate-grad hooks: autograd runs a parameter's gradient accumulation after every node
that uses the parameter, so nothing needs the values after that.

Why the whole buffer can be freed while autograd keeps views of it (a linear saves
`weight.t()`): the storage is shrunk to zero bytes and regrown in place (`untyped_storage()
.resize_`, as PyTorch's FSDP does), so every view, the saved ones too, sees the new values.
Gathers write through `gather_target`, another tensor over the same storage, so autograd's
version counter on the views never moves (it would otherwise report an in-place change).

The root unit is needed at both ends of the model and by a fused loss after the model returns:
it is gathered at the model's first forward and freed in finish(). With gradient accumulation
each micro-batch's gradient is reduce-scattered as soon as it is complete and added into the
fp32 shard accumulator (`bucket.grad_shard`): a whole fp32 gradient never outlives one layer's
backward, at the price of one reduce-scatter per micro-batch. A bucket whose gradient is first
summed with other ranks' partial gradients (`grad_sum_group`: norm weights under sequence
parallelism, a tied embedding split across pipeline stages) keeps its whole gradient until
finish(), where the sum happens, as in GradBuckets. For checkpoints, `full_parameters()`
gathers every unit for the duration of a save or a load.

`distributed.grad_reduce_dtype` works as in GradBuckets (buckets.py says what it changes
numerically). With "bfloat16", one micro-batch and no partial sums, the whole gradient buffer
and the shard keep the parameters' dtype and are reduce-scattered in place; otherwise the fp32
buffer is cast to a bf16 copy for the reduce-scatter, and the bf16 shard sum is added into
the fp32 shard accumulator.

The optimizer (DistributedAdamW, TritonAdamW) sees the same interface as GradBuckets: buckets,
`grad_shard`, `param_shard`, `all_gather_params` (here: free whatever is gathered, now stale).
"""
import contextlib
import weakref

import torch
import torch.distributed as dist

from picotron.comm import all_gather_single, reduce_scatter_single
from picotron.data_parallel.bucket_layout import gradient_dtype
from picotron.data_parallel.zero3_layout import shard_model


class _GatherForBackward(torch.autograd.Function):
    """Identity on a layer's output; its backward, which autograd runs before any node of the
    layer's own backward, gathers the layer's parameters."""

    @staticmethod
    def forward(ctx, zero3, index: int, x):
        ctx.zero3, ctx.index = zero3, index
        return x.view_as(x)     # a Function returning its input unchanged must return a view

    @staticmethod
    def backward(ctx, grad):
        ctx.zero3().before_backward(ctx.index)
        return None, None, grad


class ShardedParams:
    """The model's parameters as cp_dp shards, gathered layer by layer (module docstring).
    Builds the parameters itself, on the meta-device model, drawing one at a time."""

    def __init__(self, model, pgm, config, device):
        d = config.distributed
        self.group, self.size = pgm.cp_dp_group, pgm.cp_dp_size
        self.shards, self.shard_index = self.size, pgm.cp_dp_rank
        self.keep, self.overlap = d.zero3_keep_params, d.overlap_grad_reduce
        self._sync, self.in_flight = False, None
        self.units = shard_model(model, config, device, self.shards, self.shard_index)
        self.buckets = [b for u in reversed(self.units) for b in u.buckets]
        # the whole buffer's and the shard accumulator's dtype: fp32, unless a bf16 reduction
        # of one micro-batch adds nothing into them (partial sums still do: gradient_dtype)
        self.wire_dtype = getattr(torch, d.grad_reduce_dtype)
        acc = config.training.gradient_accumulation_steps
        for b in self.buckets:
            b.grad_dtype = gradient_dtype(b.members, self.wire_dtype == torch.float32 or acc > 1)
        self.unit_of = {id(p): (u, b) for u in self.units for b in u.buckets for p in b.members}
        self._install_hooks(model)

    # ---- hooks -----------------------------------------------------------------------------
    def _install_hooks(self, model):
        # Hooks reach self through a weak reference (no cycle param -> hook -> self -> param,
        # which keeps the model alive: see GradBuckets).
        this = weakref.ref(self)
        model.register_forward_pre_hook(lambda m, args: this().wait(this().units[-1]))
        for i, layer in enumerate(model.layers.values()):
            layer.register_forward_pre_hook(lambda m, args, i=i: this().before_forward(i))
            layer.register_forward_hook(lambda m, args, out, i=i: this().after_forward(i, out))
        for u in self.units:
            for b in u.buckets:
                for p in b.members:
                    p.register_post_accumulate_grad_hook(lambda p: this()._on_grad_ready(p))

    def before_forward(self, i: int):
        self.wait(self.units[i])
        if i + 1 < len(self.units) - 1:                  # prefetch the next layer
            self.gather(self.units[i + 1])

    def after_forward(self, i: int, out):
        if not torch.is_grad_enabled():                  # validation: no backward follows
            self.free(self.units[i])
            return out
        if not self.keep:
            self.free(self.units[i])
        if not out.requires_grad:
            return out
        return _GatherForBackward.apply(weakref.ref(self), i, out)

    def before_backward(self, i: int):
        self.wait(self.units[i])
        if i > 0:                                        # prefetch the layer before
            self.gather(self.units[i - 1])

    # ---- gather and free -------------------------------------------------------------------
    def gather(self, unit):
        """Start gathering the unit's whole buffers (asynchronously); a no-op unless free."""
        if unit.state != "free":
            return
        with torch.no_grad():
            for b in unit.buckets:
                b.resize(True)
                if self.size == 1:
                    b.gather_target.copy_(b.shard)
                else:
                    unit.works.append(all_gather_single(b.gather_target, b.shard,
                                                        group=self.group, async_op=True))
        unit.state = "gathering"

    def wait(self, unit):
        """Make the unit's parameters usable: gather if free, wait if in flight."""
        self.gather(unit)
        for work in unit.works:
            work.wait()
        unit.works, unit.state = [], "gathered"

    def free(self, unit):
        if unit.state == "free":
            return
        self.wait(unit)                 # never free a buffer a gather is still writing
        for b in unit.buckets:
            b.resize(False)
        unit.state = "free"

    def free_all(self):
        for unit in self.units:
            self.free(unit)

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False):
        """Every parameter whole inside the block (a checkpoint save or load). With
        write_back, what the block wrote into the parameters becomes this rank's shards."""
        for unit in self.units:
            self.wait(unit)
        try:
            yield
            if write_back:
                with torch.no_grad():
                    for b in self.buckets:
                        b.shard.copy_(b.params[b.start:b.start + b.shard_numel])
        finally:
            self.free_all()

    # ---- gradients -------------------------------------------------------------------------
    @property
    def sync(self) -> bool:
        return self._sync

    @sync.setter
    def sync(self, value: bool):
        """Set by the loops before each backward, for GradBuckets; ZeRO-3 reduces every
        micro-batch's gradient as it completes (module docstring), so it changes nothing."""
        self._sync = value

    def _on_grad_ready(self, p):
        """p's gradient of this backward (its post-accumulate hook) goes into the bucket's
        whole gradient buffer; the bucket's last one starts its reduce-scatter, the unit's last
        one ends the unit's backward: its parameters are freed."""
        unit, b = self.unit_of[id(p)]
        if b.grads is None:
            b.grads = torch.empty(b.numel, dtype=b.grad_dtype, device=b.shard.device)
            b.grads[b.offsets[-1] + b.members[-1].numel():].zero_()      # the padding
        offset = b.offset_of[id(p)]
        view = b.grads[offset:offset + p.numel()].view_as(p)
        if id(p) in b.written:
            view.add_(p.grad)
        else:
            view.copy_(p.grad)
            b.written.add(id(p))
        p.grad = None
        if len(b.written) == len(b.members) and b.sum_group is None:
            self._reduce(b)
        unit.grads_seen += 1
        if unit.grads_seen == unit.num_params:           # the unit's backward is over
            unit.grads_seen = 0
            if unit is not self.units[-1] and not self.keep:
                self.free(unit)

    def _reduce(self, b):
        """Average the bucket's whole gradient over cp_dp into this rank's shard: a
        reduce-scatter, left in flight while backward goes on. One at a time: each one in
        flight keeps a bucket's whole gradient alive, so waiting for the previous one first
        bounds the gradients held to about two buckets."""
        grads, b.grads, b.written = b.grads, None, set()
        self._drain()
        if self.size == 1:
            self._accumulate(b, grads)
            return
        grads.div_(self.size)
        wire = grads.to(self.wire_dtype)            # `grads` itself when the dtypes agree
        out = torch.empty(b.shard_numel, dtype=self.wire_dtype, device=grads.device)
        work = reduce_scatter_single(out, wire, group=self.group, async_op=True)
        self.in_flight = (b, out, wire, work)
        if not self.overlap:
            self._drain()

    def _drain(self):
        """Wait for the reduce-scatter in flight; add its result into the shard accumulator."""
        if self.in_flight is None:
            return
        b, out, _, work = self.in_flight
        work.wait()
        self.in_flight = None
        self._accumulate(b, out)

    @staticmethod
    def _accumulate(b, shard_sum):
        if b.grad_shard is None:
            b.grad_shard = shard_sum.to(b.grad_dtype)       # itself when the dtypes agree
        else:
            b.grad_shard.add_(shard_sum)

    def finish(self):
        """After the last backward: reduce what is still whole (partial sums first), wait for
        every reduce-scatter, free every unit. Bucket order is the same on every rank."""
        for b in self.buckets:
            if b.grads is None:
                continue
            for p, offset in zip(b.members, b.offsets):      # members with no gradient
                if id(p) not in b.written:
                    b.grads[offset:offset + p.numel()].zero_()
            if b.sum_group is not None:
                dist.all_reduce(b.grads, group=b.sum_group)
            self._reduce(b)
        self._drain()
        for b in self.buckets:
            if b.grad_shard is None:                         # no gradient this step
                b.grad_shard = torch.zeros(b.shard_numel, dtype=torch.float32,
                                           device=b.shard.device)
        for unit in self.units:
            unit.grads_seen = 0
        self.free_all()

    def zero_grad(self):
        """After the step: the shard accumulators go (the next backward makes new ones)."""
        for b in self.buckets:
            b.grads, b.written, b.grad_shard = None, set(), None
        self._sync = False

    # ---- what the optimizer reads ----------------------------------------------------------
    def grad_shard(self, bucket):
        return bucket.grad_shard

    def param_shard(self, bucket):
        return bucket.shard

    def all_gather_params(self):
        """After the optimizer updated the shards: any gathered copy is stale, so free it; the
        next forward gathers the new values."""
        self.free_all()
