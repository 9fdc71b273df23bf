"""What each pipeline rank does after its last backward: the gradients' reduction over cp x dp
(ZeRO-1/2's reduce-scatter, or the all-reduce of a trainer that shards after it:
zero1_reduce), in buckets during that backward, what outlasts it exposed; ZeRO-1/2's
parameter all-gather, waited for block by block in the next forward where the trainer
overlaps it; the optimizer's passes, and the host's AdamW for the share offloaded to it.

    rank_tails(config, profile, links, groups, forward, backward, v, cache)
        -> ([(dp exposed, optimizer) of each rank], the rank whose tail is the longest)

A rank's collectives and optimizer read only its parameters and the layout's grid, ZeRO, FP8
and CUDA graphs (rank_collectives, kept in a search's cache under those: cache None computes
them each time); what of them its backward and forward hide is a few comparisons with its
stage times (after_backward).
"""
from picotron.plan.comm_time import BF16
from picotron.plan.compute_time import optimizer_s
from picotron.plan.memory_state import rank_params
from picotron.plan.predict_cache import cached, layout_key, optimizer_key


def rank_collectives(config, profile, links, groups, rank, cache=None) -> tuple:
    """(reduce, bucket, gather, gather overlapped, optimizer) seconds of one pipeline rank (its
    Params, rank_params) at the step's end, before its stage times hide any: the gradients'
    reduction, one bucket's all-reduce (None: the reduction waits for backward's end), the
    ZeRO-1/2 parameter gather, whether the next forward hides that gather, and the
    optimizer's step with the offloaded share's host time."""
    d = config.distributed
    params = rank.total
    wire = 4 if d.grad_reduce_dtype == "float32" else 2
    shape = groups["cp_dp"]
    if d.zero_stage == 0:
        reduce, gather = links.all_reduce(params * wire, shape), 0.0
    elif d.zero_stage in (1, 2):          # a trainer may all-reduce what it then shards
        reduce_scatter = profile.traits.get("zero1_reduce", "reduce_scatter") == "reduce_scatter"
        reduce = (links.all_gather if reduce_scatter else links.all_reduce)(params * wire, shape)
        gather = links.all_gather(params * BF16, shape)
    else:                                 # ZeRO-3: the layers' part is inside their passes
        root = rank.root
        reduce, gather = links.all_gather(root * wire, shape), 0.0
    bucket = None
    if d.overlap_grad_reduce:
        bucket = links.all_reduce(min(params * wire, d.bucket_size_mb * 2 ** 20), shape)
    hidden = bool(gather and d.overlap_param_gather and profile.traits.get(
        "zero1_gather_overlap"))
    # the offloaded share of AdamW steps on the host after backward, with its copies, not
    # overlapped with the GPU's work (the offload plug-in steps it serially)
    shard = params / (d.dp_size * d.cp_size if d.zero_stage >= 1 else 1)
    host = d.offload_optim_frac * shard * profile["offload_s_per_param"]
    return reduce, bucket, gather, hidden, cached(cache, optimizer_key(config, params),
                                                  optimizer_s, config, profile, params) + host


def after_backward(collectives: tuple, last_backward: float, first_forward: float) -> tuple:
    """(dp exposed, optimizer) seconds of one pipeline rank at the step's end, from its
    rank_collectives: its reduction's buckets run during its `last_backward` (seconds: its
    chunks' backward of the last micro-batch), the gather in its `first_forward` where the
    trainer overlaps it."""
    reduce, bucket, gather, hidden, optimizer = collectives
    if bucket is not None:
        reduce = max(min(bucket, reduce), reduce - last_backward)
    if hidden:
        gather = max(0.0, gather - first_forward)
    return reduce + gather, optimizer


def rank_tails(config, profile, links, groups, forward, backward, v, cache):
    """([(dp exposed, optimizer) of each pipeline rank after its last backward], the rank
    whose tail is the longest)."""
    pp, k = config.distributed.pp_size, layout_key(config)
    ranks = cached(cache, ("rank params", v) + k[:4],
                   lambda: [rank_params(config, r) for r in range(pp)])
    # what rank_collectives reads of layout_key beside the rank's Params: the grid (its
    # cp x dp group), ZeRO, and FP8 and CUDA graphs (optimizer_key's)
    reads = k[:4] + (k[5], k[9], k[14])
    # each rank's chunks' backward and forward of one micro-batch (one chunk: its stage's)
    if v == 1:
        last_backward, first_forward = backward, forward
    else:
        last_backward = [sum(backward[r::pp]) for r in range(pp)]
        first_forward = [sum(forward[r::pp]) for r in range(pp)]
    tails, before, tail = [], None, None
    for inputs in zip(ranks, last_backward, first_forward):
        if inputs != before:            # the middle ranks are alike: computed once
            rank, last, first = before = inputs
            collectives = cached(cache, ("collectives", rank) + reads, rank_collectives, config,
                                 profile, links, groups, rank, cache)
            tail = after_backward(collectives, last, first)
        tails.append(tail)
    longest = [sum(tail) for tail in tails]
    return tails, longest.index(max(longest))
