"""How the parameters lie in gradient buckets (buckets.py reduces them): in which order they
enter (`gradient_order`: roughly the order backward produces their gradients), which may share
a bucket (`bucket_key`: the same weight decay, TP sharding, norm treatment and partial-sum
group), the gradient buffer's dtype (`gradient_dtype`), and `Bucket`, the two flat buffers
every member is a view into:

    bucket.params  (numel,) in the parameter dtype    p.data      = params[offset : offset + n]
    bucket.grads   (numel,) see gradient_dtype        p.main_grad = grads[offset : offset + n]

numel is padded to a multiple of the ZeRO shard count, so every rank's shard is equally long.
ZeRO-3's layout (zero3_layout.py) orders and groups its parameters by the same rules.
"""
import torch


class Bucket:
    def __init__(self, params, dtype, device, shards: int, grad_dtype):
        self.members = params
        numel = sum(p.numel() for p in params)
        self.numel = -(-numel // shards) * shards           # padded to a multiple of shards
        self.shard_numel = self.numel // shards
        self.params = torch.zeros(self.numel, dtype=dtype, device=device)
        self.grads = None                                    # allocated lazily, see grad_buffer
        self.grad_dtype = grad_dtype
        self.grad_shard = None                               # zero_stage 2: the owned sum
        self.wire, self.wire_shard = None, None              # what is reduced: see _launch
        self.ready, self.work, self.launched = 0, None, False
        p0 = params[0]
        self.weight_decay = p0.dim() >= 2
        self.tp_sharded = hasattr(p0, "local_slice")
        self.norm_skip = getattr(p0, "grad_norm_skip", False)
        self.sum_group = getattr(p0, "grad_sum_group", None)
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            self.params[offset:offset + p.numel()].copy_(p.data.flatten())
            p.data = self.params[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def grad_buffer(self):
        """The gradient buffer, (re)attached to every member as `main_grad`. Allocated
        uninitialised: each member's first gradient of the step is copied in, and a member
        with none is zeroed by GradBuckets.finish; only the padding is zeroed here."""
        if self.grads is None:
            self.grads = torch.empty(self.numel, dtype=self.grad_dtype,
                                     device=self.params.device)
            self.grads[self.offsets[-1] + self.members[-1].numel():].zero_()
            for p, offset in zip(self.members, self.offsets):
                p.main_grad = self.grads[offset:offset + p.numel()].view_as(p)
        return self.grads


def gradient_order(model):
    """The trainable parameters, modules last to first (roughly backward's order), each
    module's own parameters kept in their definition order, so that a module's weights lie
    back to back in a bucket (q, k, v; gate, up), as one flat weight would."""
    runs = []                       # (parent module name, its consecutive parameters)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parent = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
        if runs and runs[-1][0] == parent:
            runs[-1][1].append(p)
        else:
            runs.append((parent, [p]))
    return [p for _, run in reversed(runs) for p in run]


def bucket_key(p):
    return (p.dim() >= 2, hasattr(p, "local_slice"), getattr(p, "grad_norm_skip", False),
            getattr(p, "grad_sum_group", None))


def gradient_dtype(params, summed: bool):
    """fp32 when anything is added into the buffer in fp32 (micro-batches, or ranks with an
    fp32 reduction: `summed`; partial sums: a grad_sum_group); otherwise the parameters' own
    dtype, which loses nothing."""
    partial = getattr(params[0], "grad_sum_group", None) is not None   # same for the bucket
    return torch.float32 if summed or partial else params[0].dtype
