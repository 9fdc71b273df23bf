"""ZeRO-3's layout: each layer's parameters as flat buffers cut into cp_dp shards, and the
initial values drawn straight into this rank's shards (picotron/data_parallel/zero3.py gathers
and frees them).

A unit is one decoder layer, or the root: whatever is not in a layer (embedding, final norm,
head). Its parameters are grouped by kind (`bucket_key`: weight decay or not, TP-sharded or
not, ...; the optimizer treats a bucket as one), in backward order (`gradient_order`: q, k, v
back to back, as the fused projections want them). Each group is one `ShardedBucket`:

    bucket.params  (numel,)        the whole flat buffer; every parameter is a view into it.
                                   Its storage is zero bytes except while the unit is in use.
    bucket.shard   (numel / N,)    this rank's shard: [start, start + shard_numel) of it,
                                   what AdamW updates; kept for good.

numel is padded to a multiple of N (the cp_dp size). The model is built on the meta device,
and building it never holds more than one whole parameter: `shard_model` draws one at a time
(`model.initial_values`, the same numbers as every other layout), keeps the part that falls in
this rank's shard, and frees the rest before the next.
"""
import torch

from picotron.data_parallel.bucket_layout import bucket_key, gradient_order
from picotron.model import initial_values, replace_parameters


class ShardedBucket:
    """Parameters of one kind in one unit: the whole flat buffer (freed when unused) and this
    rank's shard of it (kept). Built from the meta parameters `metas`; `members` are the real
    Parameters that replace them, views of the whole buffer."""

    def __init__(self, metas, dtype, device, shards: int, shard_index: int):
        self.metas = metas                                   # shapes only: no memory
        numel = sum(p.numel() for p in metas)
        self.numel = -(-numel // shards) * shards            # padded to a multiple of shards
        self.shard_numel = self.numel // shards
        self.start = shard_index * self.shard_numel          # this rank's shard in the buffer
        self.offsets = [sum(p.numel() for p in metas[:i]) for i in range(len(metas))]
        p0 = metas[0]
        self.weight_decay = p0.dim() >= 2
        self.tp_sharded = hasattr(p0, "local_slice")
        self.norm_skip = getattr(p0, "grad_norm_skip", False)
        self.sum_group = getattr(p0, "grad_sum_group", None)
        self.shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        # The whole buffer starts, and stays between uses, at zero bytes of storage: views of
        # it can be made all the same, and they follow the storage when it grows.
        self.params = torch.empty(0, dtype=dtype, device=device).set_(
            torch.UntypedStorage(0, device=device), 0, (self.numel,))
        self.members = []
        for meta, offset in zip(metas, self.offsets):
            param = torch.nn.Parameter(self.params[offset:offset + meta.numel()].view_as(meta))
            param.__dict__.update(vars(meta))       # what parallelism marked: slices, groups
            self.members.append(param)
        self.offset_of = {id(p): o for p, o in zip(self.members, self.offsets)}
        self.gather_target = torch.empty(0, dtype=dtype, device=device).set_(
            self.params.untyped_storage(), 0, (self.numel,))
        self.grads, self.written, self.grad_shard = None, set(), None

    def resize(self, allocated: bool):
        self.params.untyped_storage().resize_(
            self.numel * self.params.element_size() if allocated else 0)

    def draw(self, offset: int, value):
        """Copy the part of the initial value (whole, fp32) of the member at `offset` that
        falls in this rank's shard."""
        lo = max(offset, self.start)
        hi = min(offset + value.numel(), self.start + self.shard_numel)
        if lo < hi:
            flat = value.flatten()[lo - offset:hi - offset]
            self.shard[lo - self.start:hi - self.start] = flat.to(self.shard.dtype)


class Unit:
    """One decoder layer (or the root): its buckets and whether they are gathered."""

    def __init__(self, name: str, buckets: list):
        self.name, self.buckets = name, buckets
        self.state = "free"                  # free | gathering (all-gather in flight) | gathered
        self.works = []
        self.num_params = sum(len(b.members) for b in buckets)
        self.grads_seen = 0                  # gradients accumulated in this backward


def shard_model(model, config, device, shards: int, shard_index: int) -> list:
    """The model's units (layers in forward order, the root last), with every meta parameter
    replaced by a view of its bucket's whole buffer, and this rank's shards drawn."""
    dtype = getattr(torch, config.training.dtype)
    order = gradient_order(model)                        # backward order: q, k, v together
    layer_of = {id(p): key for key, layer in model.layers.items() for p in layer.parameters()}
    units = []
    for key in list(model.layers) + [None]:
        kinds = {}
        for p in order:
            if layer_of.get(id(p)) == key:
                kinds.setdefault(bucket_key(p), []).append(p)
        units.append(Unit("root" if key is None else key, [
            ShardedBucket(g, dtype, device, shards, shard_index) for g in kinds.values()]))
    slot, new = {}, {}               # meta parameter id -> (its bucket, offset), its replacement
    for u in units:
        for b in u.buckets:
            for meta, param, offset in zip(b.metas, b.members, b.offsets):
                slot[id(meta)], new[id(meta)] = (b, offset), param
    for p, value in initial_values(model, config.training.seed, config.model.initializer_range):
        bucket, offset = slot[id(p)]
        bucket.draw(offset, value)                       # one parameter alive at a time
    replace_parameters(model, new)
    return units
