"""What each pipeline rank does after its last backward: the gradients' reduction over cp x dp
(ZeRO-1/2's reduce-scatter) in buckets during that backward, what outlasts it exposed, or,
for a trainer that all-reduces what it then shards (zero1_reduce), one all-reduce after that
backward; a tied embedding's sum across the pipeline's two ends; ZeRO-1/2's parameter
all-gather, waited for block by block in the next forward where the trainer overlaps it; the
optimizer's passes, and the host's AdamW for the share offloaded to it (step_time.py adds
them to the simulated pipeline's makespan).

    rank_tails(config, profile, links, groups, forward, backward, v, cache)
        -> ([(dp exposed, optimizer) of each rank], the rank whose tail is the longest)

The buckets reduce during the last backward, each as it completes (data_parallel/buckets.py;
nanotron's DDP hooks alike): what the backward hides is gone, and the bucket completed last
always follows it. That one holds the embedding's gradient, the last to come (its lookup's
backward ends the pass), and a parameter larger than a bucket fills one of its own. Each
bucket is a collective of its own, so a gradient of many buckets pays its ring steps' latency
between nodes many times (a 1B model's fp32 gradient at tp 1: 205 buckets of 25 MB).

A rank's collectives and optimizer read only its parameters and the layout's grid, ZeRO, FP8
and CUDA graphs (rank_collectives, kept in a search's cache under those: cache None computes
them each time); what of them its backward and forward hide is a few comparisons with its
stage times (after_backward).
"""
import math

from picotron.plan.comm_time import BF16
from picotron.plan.compute_time import optimizer_s
from picotron.plan.memory_state import rank_params, table_params
from picotron.plan.predict_cache import cached, layout_key, optimizer_key


def embedding_rows(config, rank) -> int:
    """The (V/tp, C) embedding's parameters on this pipeline rank (Params): the first rank's
    root is the table alone, the last's the head and the final norm; one rank holds both."""
    m, d = config.model, config.distributed
    table = table_params(m, d.tp_size)
    return table if d.pp_size == 1 or rank.root == table else 0


def tied_sum_s(config, links, groups, rank) -> float:
    """A tied embedding under a pipeline: the first rank's embedding and the last rank's head
    are two copies of one (V/tp, C) table, whose gradients both trainers sum across the two
    ends after the last backward, outside the buckets' overlap (this project's
    `grads.finish()`, nanotron's sync_tied_weights_gradients on its fp32 buffers). The two
    ends share a node only when the whole pipeline group does."""
    m, d = config.model, config.distributed
    if not m.tie_word_embeddings or d.pp_size == 1 or rank.root == 0:
        return 0.0
    wire = 4 if d.grad_reduce_dtype == "float32" else 2
    table = table_params(m, d.tp_size)
    ends = (2, 1, 2) if groups["pp"][2] > 1 else (2, 2, 1)
    return links.all_reduce(table * wire, ends)


def rank_collectives(config, profile, links, groups, rank, cache=None) -> tuple:
    """(reduce, last bucket, tied, gather, gather overlapped, optimizer) seconds of one pipeline
    rank (its Params, rank_params) at the step's end, before its stage times hide any: the
    gradients' reduction, the last bucket's (None: the reduction waits for backward's end), the
    tied embedding's sum, the ZeRO-1/2 parameter gather, whether the next forward hides that
    gather, and the optimizer's step with the offloaded share's host time. Its collectives
    are `links`' data-parallel ones (their ring steps at the network's latency, dp_latency_s)."""
    d = config.distributed
    links = links.data_parallel
    params = rank.total
    wire = 4 if d.grad_reduce_dtype == "float32" else 2
    shape = groups["cp_dp"]
    # the reduction (a reduce-scatter costs an all-gather's time) and the bytes it reduces
    # after the backward: ZeRO-3 reduces the layers' part inside their passes
    op, after, gather = links.all_reduce, params * wire, 0.0
    in_buckets = d.overlap_grad_reduce
    if d.zero_stage in (1, 2):
        if profile.traits.get("zero1_reduce", "reduce_scatter") == "reduce_scatter":
            op = links.all_gather
        else:
            # a trainer that all-reduces what it then shards (nanotron: its ZeRO runs without
            # torch DDP's hooks) reduces the whole buffer at once after the last backward
            in_buckets = False
        gather = links.all_gather(params * BF16, shape)
    elif d.zero_stage == 3:
        op, after = links.all_gather, rank.root * wire
    reduce, bucket = op(after, shape), None
    if in_buckets:
        # a bucket's bytes on the wire: bucket_size_mb counts each parameter at the trainer's
        # bytes (this project's fp32 buffers: 4; torch DDP's bf16 gradients: 2)
        per_param = profile.traits.get("bucket_bytes_per_param", 4)
        size = d.bucket_size_mb * 2 ** 20 / per_param * wire
        # the embedding's gradient comes last (its lookup's backward ends the pass) and fills
        # a bucket of its own when larger than one: its reduction follows the backward
        bucket = op(min(after, max(size, embedding_rows(config, rank) * wire)), shape)
        # each bucket is a collective of its own: those after the first add their ring steps
        # between nodes (an all-reduce's 2 (k-1), a reduce-scatter's k-1)
        steps = (2 if op == links.all_reduce else 1) * (shape[2] - 1)
        reduce += max(0, math.ceil(after / size) - 1) * steps * links.l_out
    hidden = bool(gather and d.overlap_param_gather and profile.traits.get(
        "zero1_gather_overlap"))
    # the offloaded share of AdamW steps on the host after backward, with its copies, not
    # overlapped with the GPU's work (the offload plug-in steps it serially)
    shard = params / (d.dp_size * d.cp_size if d.zero_stage >= 1 else 1)
    host = d.offload_optim_frac * shard * profile["offload_s_per_param"]
    return (reduce, bucket, tied_sum_s(config, links, groups, rank), gather, hidden,
            cached(cache, optimizer_key(config, params), optimizer_s, config, profile, params)
            + host)


def after_backward(collectives: tuple, last_backward: float, first_forward: float) -> tuple:
    """(dp exposed, optimizer) seconds of one pipeline rank at the step's end, from its
    rank_collectives: its reduction's buckets run during its `last_backward` (seconds: its
    chunks' backward of the last micro-batch), the last bucket and the tied sum after it, the
    gather in its `first_forward` where the trainer overlaps it."""
    reduce, bucket, tied, gather, hidden, optimizer = collectives
    if bucket is not None:
        reduce = max(min(bucket, reduce), reduce - last_backward)
    if hidden:
        gather = max(0.0, gather - first_forward)
    return reduce + tied + gather, optimizer


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
