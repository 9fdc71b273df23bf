"""Sharded layers: column- and row-parallel linears, the vocab-parallel embedding and head.

Shapes: B batch, T sequence, C hidden size, O/I a linear's output/input features, V vocabulary,
tp the tensor-parallel size; "local" is this rank's share. A linear's weight is (O, I).

Every sharded weight is declared with its full shape and the slice of it this rank holds
(`full_shape`, `local_slice`), so `model.materialize` draws the full tensor from the seed and
keeps the slice: each rank's shard is exactly a piece of the weights one process would have,
and checkpoints stay layout-free. Biases: the model has none (Llama, PaLM), so none here.

Megatron's MLP, column then row: Y = down(act(X W1) ...) with W1 split by columns (each rank
computes its own slice of the hidden features, no communication) and W2 split by rows (each
rank's product is a partial sum over its slice, summed by g). Attention is the same with
heads as the columns.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from picotron.tensor_parallel.comms import leave_tp


def shard_range(full: int, tp_rank: int, tp_size: int) -> tuple:
    """[start, stop) of this rank's share of `full` rows.

    Each rank owns ceil(full/tp) rows; when `full` is not divisible (a vocabulary of 250 over
    tp = 4 owns 63 each, padded to 252), the last shard is shorter: the rows past `full` are
    padding, which exists in no weight and is masked wherever it would show."""
    per_rank = -(-full // tp_size)
    start = min(tp_rank * per_rank, full)
    return start, min(start + per_rank, full)


def _sharded_param(full_shape, local_slice):
    """An uninitialised parameter holding `full[local_slice]` (on the current device: meta)."""
    local_shape = torch.empty(full_shape, device="meta")[local_slice].shape   # no memory
    param = nn.Parameter(torch.empty(local_shape))
    param.full_shape, param.local_slice = tuple(full_shape), tuple(local_slice)
    return param


class ColumnParallelLinear(nn.Module):
    """Y_local = X W_local^T: (B, T, I) -> (B, T, O/tp), the output features split over TP.

    No communication here: the input X must already be replicated on every TP rank, and its
    gradient must be summed over TP in backward (f). That f is applied once where the sharded
    block begins (on the norm's output, see tensor_parallel.py), not in each column layer: q, k
    and v read the same input, so one all-reduce of dL/dX serves all three, exactly as many as
    one fused QKV projection would need."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int, tp_size: int):
        super().__init__()
        start, stop = shard_range(out_features, tp_rank, tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.weight = _sharded_param((out_features, in_features), (slice(start, stop),))

    def forward(self, x):
        return F.linear(x, self.weight)                          # (B, T, O_local)


class RowParallelLinear(nn.Module):
    """Y = g(X_local W_local^T): (B, T, I/tp) -> (B, T, O), the input features split over TP.

    Each rank multiplies its slice of the features (its heads, its MLP columns) by the matching
    columns of W, giving a partial sum of Y; g all-reduces it (forward) and passes dL/dY
    through unchanged (backward). Under sequence parallelism g is a reduce-scatter along T
    instead, and the output is this rank's (B, T/tp, O) chunk of the sequence."""

    def __init__(self, in_features: int, out_features: int, tp_rank: int, tp_size: int,
                 tp_group, sequence_parallel: bool):
        super().__init__()
        start, stop = shard_range(in_features, tp_rank, tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = _sharded_param((out_features, in_features),
                                     (slice(None), slice(start, stop)))

    def forward(self, x):
        return self.reduce(F.linear(x, self.weight))   # g on the (B, T, O) partial product

    def reduce(self, partial):
        """g on this rank's partial product (B, T, O); a fused op that computes the product
        itself calls it too."""
        return leave_tp(partial, self.tp_group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """Token ids (B, T) -> (B, T, C), the rows of the (V, C) table split over TP.

    Each rank looks up the ids in its range [start, stop) and writes zeros for the others, so
    summing over TP (g) gives every token its row. Under sequence parallelism that sum is a
    reduce-scatter: the output is (B, T/tp, C), the first activations sharded along T."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int, tp_size: int,
                 tp_group, sequence_parallel: bool):
        super().__init__()
        self.start, self.stop = shard_range(num_embeddings, tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = _sharded_param((num_embeddings, embedding_dim),
                                     (slice(self.start, self.stop),))

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.stop)         # (B, T): another rank's row
        local_ids = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight)                # (B, T, C)
        rows = rows.masked_fill(outside[..., None], 0.0)          # no gradient to row 0 either
        return leave_tp(rows, self.tp_group, self.sequence_parallel)


class VocabParallelHead(ColumnParallelLinear):
    """The output head, column-parallel over the vocabulary: (B, T, C) -> logits (B, T, V_pad/tp).

    The logits stay sharded; `vocab_parallel_cross_entropy` computes the loss from the shards.
    Every rank returns ceil(V/tp) columns, column j of rank r being token r*ceil(V/tp) + j: a
    short last shard (V not divisible by tp) is padded with -inf logits, which get probability
    zero and gradient zero. With tied embeddings its weight is the embedding's shard itself
    (same rows, same rank)."""

    def __init__(self, in_features: int, vocab_size: int, tp_rank: int, tp_size: int):
        super().__init__(in_features, vocab_size, tp_rank, tp_size)
        self.per_rank = -(-vocab_size // tp_size)                # ceil(V / tp)

    def forward(self, x):
        logits = F.linear(x, self.weight)                        # (B, T, V_local)
        padding = self.per_rank - logits.shape[-1]               # > 0 on a short last shard
        if padding:
            logits = F.pad(logits, (0, padding), value=float("-inf"))
        return logits                                            # (B, T, ceil(V/tp))
