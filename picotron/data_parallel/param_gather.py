"""ZeRO-1/2: the updated parameter shards shared again, overlapped with the next forward.

After the optimizer step, rank r holds the new values of shard r of every bucket only
(`GradBuckets.param_shard`), and every rank needs every shard before it uses a parameter:

    all_gather(bucket.params (numel,), this rank's shard (numel / N,))    one per bucket

Waiting for all of them right after the step leaves them exposed (at 360M dp2: 0.72 GB of
bf16, ~3 ms of a ~190 ms step, measured by bench/dp_overlap.py). Instead each bucket's
all-gather is started at once, asynchronously, in the order the next forward uses them, and a
forward pre-hook on each block waits only for the buckets holding that block's parameters:
layer 0 waits for its own gather while the gathers of layers 1, 2, ... still run beside its
compute (on GPUs NCCL runs on its own stream; `work.wait()` makes the compute stream wait for
that one gather, not for the ones launched after it).

Blocks are the members of the model's layer containers (the children of every ModuleDict or
ModuleList: the decoder layers); a parameter outside every block (embedding, final norm, head)
is waited for by a pre-hook on the whole model, before anything runs, so its buckets are
launched first. A plug-in that reads a block's weights must do so inside that block's forward
(ours do). Anything that reads parameters outside a forward calls `wait()` first:
GradBuckets.finish (before the next optimizer step writes the shards) and full_parameters (a
checkpoint's save or load). With distributed.overlap_param_gather=false, or `overlap` set
to False by a plug-in that runs the layers without their hooks, `start` waits at once.
"""
import torch.nn as nn

from picotron.comm import all_gather_single


def blocks(model):
    """The children of every ModuleDict / ModuleList (the decoder layers), in order."""
    found = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleDict, nn.ModuleList)):
            found.extend(module.children())
    return found


class ParamGather:
    def __init__(self, model, buckets, bucket_of, group, shard_index: int, overlap: bool):
        self.buckets, self.group, self.shard_index = buckets, group, shard_index
        self.overlap = overlap
        self.pending = {}          # bucket index -> (async work, the shard it sends)
        self.launch_order = []     # bucket indices, first used first (root's, then blocks')
        self.wait_log = []         # this step's waits, bucket indices in order (tests)
        index = {id(b): i for i, b in enumerate(buckets)}

        def bucket_ids(params):
            ids = []
            for p in params:
                i = index[id(bucket_of[id(p)])] if id(p) in bucket_of else None
                if i is not None and i not in ids:
                    ids.append(i)
            return ids
        in_blocks = set()
        per_block = []
        for block in blocks(model):
            params = list(block.parameters())
            in_blocks.update(id(p) for p in params)
            per_block.append((block, bucket_ids(params)))
        root = bucket_ids([p for p in model.parameters() if id(p) not in in_blocks])
        order = list(root)
        for _, ids in per_block:
            order += [i for i in ids if i not in order]
        order += [i for i in range(len(buckets)) if i not in order]   # none expected
        self.launch_order = order
        if not overlap:
            return
        model.register_forward_pre_hook(lambda m, args, ids=root: self.wait(ids))
        for block, ids in per_block:
            block.register_forward_pre_hook(lambda m, args, ids=ids: self.wait(ids))

    def start(self):
        """Launch every bucket's all-gather of the updated shards, first-used first."""
        self.wait_log = []                              # one step's, not the run's
        for i in self.launch_order:
            bucket = self.buckets[i]
            start = self.shard_index * bucket.shard_numel   # the output overwrites the input
            shard = bucket.params[start:start + bucket.shard_numel].clone()
            work = all_gather_single(bucket.params, shard, group=self.group, async_op=True)
            self.pending[i] = (work, shard)
        if not self.overlap:
            self.wait()

    def wait(self, ids=None):
        """Wait for the gathers of buckets `ids` (all pending ones when None)."""
        for i in list(self.pending) if ids is None else ids:
            if i in self.pending:
                work, _ = self.pending.pop(i)
                work.wait()
                self.wait_log.append(i)
