"""Gradient buckets: flat gradient buffers whose reduction starts during backward.

Parameters are grouped into buckets of about `bucket_size_mb` (modules in reverse order of
definition, which is roughly the order backward produces their gradients: head first,
embedding last; bucket_layout.py). Each bucket owns two flat buffers, and every parameter
is a view into them:

    bucket.params  (numel,) in the parameter dtype    p.data      = params[offset : offset + n]
    bucket.grads   (numel,) fp32 (see below)          p.main_grad = grads[offset : offset + n]

(the gradient buffer exists from a step's first gradient until zero_grad() after the step).
The buffer is fp32 whenever anything is ever added into it: micro-batches, the average over
cp_dp ranks (in fp32, the default `grad_reduce_dtype`), partial sums over TP or PP
(`grad_sum_group`). Otherwise (one micro-batch, one cp_dp rank or a bf16 reduction) it
receives each gradient exactly once, in the parameter dtype, and an fp32 copy would hold no
more information: it then keeps the parameter dtype (half the bytes to copy, hold and read in
bf16); the optimizer computes in fp32 either way.

`distributed.grad_reduce_dtype` is the dtype of the cp_dp reduction on the wire. "float32"
(the default) sums in fp32. "bfloat16" moves half the bytes: when the buffer is bf16 (bf16
parameters, one micro-batch, no partial sums) it is reduced in place, with no fp32 copy at all;
otherwise (an fp32 buffer that accumulates micro-batches or partial sums; fp32 or fp16
parameters) the reduction casts the buffer to a bf16 communication buffer (`bucket.wire`),
reduces that and writes the result back into the buffer's dtype (ZeRO-2: reduce-scatters into
a bf16 shard, then converts the shard). fp32 parameters are not refused: the bytes on the wire
are the cost being cut (as PyTorch DDP's bf16 compression hook does for fp32 models), whatever
the weights' dtype. Numerically, each rank's gradient (already divided by cp_dp) is rounded to
bf16 once before the sum, and the sum itself is done in bf16 (NCCL's ring, like gloo, adds in
the wire dtype: one more rounding per addition), so the averaged gradient differs from the
fp32 path by about bf16's rounding (2^-8 relative per rounding), not by a systematic bias; the
optimizer still computes in fp32.
Partial sums over `grad_sum_group` stay in the buffer's dtype. At cp_dp = 1 nothing is reduced
and the setting changes nothing.

A hook after each parameter's gradient is accumulated adds it into `main_grad` (fp32, so bf16
and fp16 models accumulate micro-batches exactly; the step's first gradient is copied, which
spares zeroing the buffer) and frees `p.grad`. On the last micro-batch,
the moment a bucket's last gradient arrives, its reduction over the cp_dp group is launched
asynchronously, so communication overlaps the rest of backward (PyTorch DDP, Li et al. 2020).
`finish()` waits for what is still in flight.

ZeRO (Rajbhandari et al. 2020): with zero_stage >= 1 each bucket is cut into cp_dp equal shards
and rank r owns shard r, and the reduction is a reduce-scatter: each rank receives only the sum
of its own shard, the only part its optimizer reads (an all-reduce would also bring every
other shard's sum, twice the bytes: a ring all-reduce is a reduce-scatter then an
all-gather). Stage 1 copies that sum into its slice of the buffer, which lives until
zero_grad() as at stage 0 (the other slices keep this rank's own unreduced gradients, which
nothing reads); stage 2 keeps only the shard, and the full buffer is freed until the next
backward.

Buckets are homogeneous in what the optimizer and the norm need to know: weight decay or not,
sharded across TP or replicated (`local_slice`), counted in the grad norm or not
(`grad_norm_skip`), and whether other ranks hold partial gradients of the same weight that
must be summed first (`grad_sum_group`: norm weights under sequence parallelism, a tied
embedding split across pipeline stages).
"""
import contextlib
import weakref

import torch
import torch.distributed as dist

from picotron.comm import reduce_scatter_single
from picotron.data_parallel.bucket_layout import (Bucket, bucket_key, gradient_dtype,
                                                  gradient_order)
from picotron.data_parallel.param_gather import ParamGather


class GradBuckets:
    def __init__(self, model, pgm, config):
        d = config.distributed
        self.pgm, self.zero_stage, self.overlap = pgm, d.zero_stage, d.overlap_grad_reduce
        self.group, self.size = pgm.cp_dp_group, pgm.cp_dp_size
        self.wire_dtype = getattr(torch, d.grad_reduce_dtype)      # the reduction's dtype
        self.shards = self.size if d.zero_stage >= 1 else 1
        self.shard_index = pgm.cp_dp_rank if d.zero_stage >= 1 else 0
        params = [p for p in model.parameters() if p.requires_grad]
        self._check_replicas_identical(params)
        limit = d.bucket_size_mb * 2 ** 20 / 4                 # fp32 gradient elements
        groups, current = [], {}
        for p in gradient_order(model):
            key = bucket_key(p)
            current.setdefault(key, []).append(p)
            if sum(q.numel() for q in current[key]) >= limit:
                groups.append(current.pop(key))
        groups += list(current.values())
        # a bf16 reduction adds nothing into the buffer itself: it is cast (or is bf16)
        summed = config.training.gradient_accumulation_steps > 1 or (
            self.size > 1 and self.wire_dtype == torch.float32)
        self.buckets = [Bucket(g, params[0].dtype, params[0].device, self.shards,
                               gradient_dtype(g, summed)) for g in groups]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.members}
        # ZeRO >= 1: the updated shards gathered again, each block waiting for its own
        self.gather = ParamGather(model, self.buckets, self.bucket_of, self.group,
                                  self.shard_index, d.overlap_param_gather
                                  ) if self.shards > 1 else None
        # per step: fresh (params whose main_grad is not yet written), launch_log (bucket
        # index, gradients ready so far: overlap evidence), _ready_total, _sync
        self.zero_grad()
        # The hook reaches self through a weak reference. A bound method made the cycle
        # param -> hook -> self -> param, which Python's gc did not collect (torch 2.11 and
        # 2.13): the model, its gradients and these buffers stayed on the GPU after a run
        # for the life of the process (a notebook, a benchmark's next configuration).
        this = weakref.ref(self)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: this()._on_grad_ready(p))

    def _check_replicas_identical(self, params):
        """Initial weights are identical across cp_dp by construction (drawn from the seed);
        check it once, cheaply, so a broken init can never train silently apart."""
        if self.size == 1:
            return
        # every tensor of a collective on the parameters' device: NCCL takes a CPU output
        # buffer as a device pointer (an illegal memory access on the GPU, garbage here)
        checksum = torch.stack([p.detach().double().sum() for p in params])
        gathered = [torch.zeros_like(checksum) for _ in range(self.size)]
        dist.all_gather(gathered, checksum, group=self.group)
        if any(not torch.equal(g, checksum) for g in gathered):
            raise RuntimeError("initial weights differ across data-parallel replicas")

    @property
    def sync(self) -> bool:
        return self._sync

    @sync.setter
    def sync(self, value: bool):
        """Set before each micro-batch's backward: True on the last one, so buckets reduce as
        they fill. Left False, nothing reduces during backward and finish() does it all
        (correct, just without overlap): so does distributed.overlap_grad_reduce=false."""
        self._sync = value and self.overlap
        for b in self.buckets:
            b.ready = 0

    def zero_grad(self):
        """Free the gradient buffers until the next backward (as PyTorch's set_to_none), so
        they do not sit through the next forward, where the activations peak: 4 bytes per
        parameter less at the peak. Nothing is zeroed: each parameter's first gradient of the
        next step is copied into a new buffer (_on_grad_ready), finish() zeroes the rest."""
        self.fresh = {id(p) for b in self.buckets for p in b.members}
        for b in self.buckets:
            b.grads, b.grad_shard, b.wire, b.wire_shard = None, None, None, None
            for p in b.members:
                p.main_grad = None
            b.ready, b.work, b.launched = 0, None, False
        self.launch_log, self._ready_total, self._sync = [], 0, False

    def _on_grad_ready(self, p):
        bucket = self.bucket_of[id(p)]
        bucket.grad_buffer()
        if id(p) in self.fresh:          # first gradient this step: copy (no zeroing pass)
            p.main_grad.copy_(p.grad)
            self.fresh.discard(id(p))
        else:
            p.main_grad.add_(p.grad)     # fp32 accumulation across micro-batches
        p.grad = None
        self._ready_total += 1
        bucket.ready += 1
        # A bucket whose sum over `sum_group` must come first waits for finish(): a blocking
        # sum inside one pipeline stage's backward would stall the stage it pairs with.
        if self.sync and bucket.ready == len(bucket.members) and bucket.sum_group is None:
            self._launch(bucket)

    def _launch(self, bucket):
        """Start the bucket's reduction: an average over cp_dp (each rank's loss is the mean
        over its share of the tokens, so the mean of the gradients is the global gradient).
        What goes on the wire, `bucket.wire`, is the buffer itself when it already has
        grad_reduce_dtype, else a copy cast to it, written back by finish()."""
        self.launch_log.append((self.buckets.index(bucket), self._ready_total))
        bucket.launched = True
        grads = bucket.grad_buffer()
        if bucket.sum_group is not None:     # partial gradients of one weight: add them first
            dist.all_reduce(grads, group=bucket.sum_group)
        if self.size == 1:
            return
        grads.div_(self.size)
        bucket.wire = grads.to(self.wire_dtype)     # `grads` itself when the dtypes agree
        if self.zero_stage >= 1:
            bucket.wire_shard = torch.empty(bucket.shard_numel, dtype=self.wire_dtype,
                                            device=grads.device)
            bucket.work = reduce_scatter_single(bucket.wire_shard, bucket.wire,
                                                group=self.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.wire, group=self.group, async_op=True)

    def finish(self):
        """Wait for every reduction. Buckets whose reduction never started (gradient
        accumulation without sync, or a parameter that got no gradient) start now, in bucket
        order, which is the same on every rank. A parameter gather that no forward waited for
        is waited for here, before the optimizer writes the shards again."""
        if self.gather is not None:
            self.gather.wait()
        for b in self.buckets:
            if not b.launched:
                for p in b.members:
                    if id(p) in self.fresh:     # no gradient this step: it contributes zero
                        b.grad_buffer()
                        p.main_grad.zero_()
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if self.zero_stage == 2 and self.size > 1:
                # in the buffer's dtype (fp32 when it accumulates): a no-op when they agree
                b.grad_shard = b.wire_shard.to(b.grads.dtype)
                b.grads = None           # only the owned shard survives until the next step
                for p in b.members:
                    p.main_grad = None
            elif b.wire_shard is not None:           # ZeRO-1: the sum into the owned slice
                start = self.shard_index * b.shard_numel
                b.grads[start:start + b.shard_numel].copy_(b.wire_shard)
            elif b.wire is not None and b.wire is not b.grads:
                b.grads.copy_(b.wire)    # the bf16 sum back into the fp32 buffer
            b.wire, b.wire_shard = None, None

    def grad_shard(self, bucket):
        """This rank's share of the bucket's averaged gradient."""
        if self.zero_stage == 2 and self.size > 1:
            return bucket.grad_shard
        start = self.shard_index * bucket.shard_numel
        return bucket.grad_buffer()[start:start + bucket.shard_numel]

    def param_shard(self, bucket):
        start = self.shard_index * bucket.shard_numel
        return bucket.params[start:start + bucket.shard_numel]

    def full_parameters(self, write_back: bool = False):
        """Every parameter is whole here once the last step's gathers are in (ZeRO-3's
        ShardedParams gathers them for a checkpoint's save or load inside this block)."""
        if self.gather is not None:
            self.gather.wait()
        return contextlib.nullcontext()

    def all_gather_params(self):
        """After each rank updated its shard: every rank gets every shard (ZeRO >= 1),
        waited for block by block in the next forward (param_gather.py)."""
        if self.gather is not None:
            self.gather.start()
