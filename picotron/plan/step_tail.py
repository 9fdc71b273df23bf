"""A pipeline rank's step after its last backward: the gradients' reduction over cp x dp, what
of it outlasts that backward, ZeRO-1/2's parameter all-gather, a tied embedding's sum across
the pipeline's two ends, and the optimizer's passes (step_time.py adds them to the simulated
pipeline's makespan).

    after_backward(config, profile, links, groups, rank, last_backward, first_forward)
        -> (dp exposed seconds, optimizer seconds)

The buckets reduce during the last backward, each as it completes (data_parallel/buckets.py;
nanotron's DDP hooks alike): what the backward hides is gone, and the bucket completed last
always follows it. That one holds the embedding's gradient, the last to come (its lookup's
backward ends the pass), and a parameter larger than a bucket fills one of its own.
"""
from picotron.plan.comm_time import BF16
from picotron.plan.compute_time import optimizer_s
from picotron.plan.predict_cache import cached, optimizer_key


def embedding_rows(config, rank) -> int:
    """The (V/tp, C) embedding's parameters on this pipeline rank (Params): the first rank's
    root is the table alone, the last's the head and the final norm; one rank holds both."""
    m, d = config.model, config.distributed
    table = -(-m.vocab_size // d.tp_size) * m.hidden_size
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
    table = -(-m.vocab_size // d.tp_size) * m.hidden_size
    ends = (2, 1, 2) if groups["pp"][2] > 1 else (2, 2, 1)
    return links.all_reduce(table * wire, ends)


def after_backward(config, profile, links, groups, rank, last_backward, first_forward,
                   cache=None):
    """(dp exposed, optimizer) seconds of one pipeline rank (its Params, rank_params) at the
    step's end."""
    d = config.distributed
    params = rank.total
    wire = 4 if d.grad_reduce_dtype == "float32" else 2
    shape = groups["cp_dp"]
    # the reduction (a reduce-scatter costs an all-gather's time) and the bytes it reduces
    # after the backward: ZeRO-3 reduces the layers' part inside their passes
    op, after, gather = links.all_reduce, params * wire, 0.0
    if d.zero_stage in (1, 2):            # a trainer may all-reduce what it then shards
        if profile.traits.get("zero1_reduce", "reduce_scatter") == "reduce_scatter":
            op = links.all_gather
        gather = links.all_gather(params * BF16, shape)
    elif d.zero_stage == 3:
        op, after = links.all_gather, rank.root * wire
    reduce = op(after, shape)
    if d.overlap_grad_reduce:
        # the embedding's gradient comes last (its lookup's backward ends the pass) and fills
        # a bucket of its own when larger than one: its reduction follows the backward
        last = max(d.bucket_size_mb * 2 ** 20, embedding_rows(config, rank) * wire)
        bucket = op(min(after, last), shape)
        reduce = max(min(bucket, reduce), reduce - last_backward)
    reduce += tied_sum_s(config, links, groups, rank)
    if gather and d.overlap_param_gather and profile.traits.get("zero1_gather_overlap"):
        gather = max(0.0, gather - first_forward)
    # the offloaded share of AdamW steps on the host after backward, with its copies, not
    # overlapped with the GPU's work (the offload plug-in steps it serially)
    shard = params / (d.dp_size * d.cp_size if d.zero_stage >= 1 else 1)
    host = d.offload_optim_frac * shard * profile["offload_s_per_param"]
    return reduce + gather, cached(cache, optimizer_key(config, params), optimizer_s, config,
                                   profile, params) + host
