"""Worker for test_tensor_parallel.py: every sharded layer against its unsharded version.

Run by torchrun on tp gloo ranks. Every rank builds the same full inputs, weights and upstream
gradients from one seed, runs the plain layer on them (the reference) and the sharded layer on
its shards, and checks outputs and input/weight gradients against the reference's matching
slices. A mismatch raises, so the launch fails with the message."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron.loss import causal_lm_loss, vocab_parallel_cross_entropy  # noqa: E402
from picotron.tensor_parallel.comms import copy_to_tp, gather_from_sequence  # noqa: E402
from picotron.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,  # noqa: E402
                                             VocabParallelEmbedding, VocabParallelHead)

B, T, C, O, V = 2, 8, 16, 12, 13        # V = 13 is not divisible by tp = 2 or 4: padded
TOL = dict(rtol=1e-5, atol=1e-6)         # fp32; only the order of the sums differs


def close(name, actual, expected):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{name}: {m}")


def leaf(t):
    return t.clone().requires_grad_(True)


def load_shard(layer, full):
    """Give the sharded layer its slice of the full weight, as materialize does."""
    with torch.no_grad():
        layer.weight.copy_(full[layer.weight.local_slice])
    return full[layer.weight.local_slice]


def main():
    dist.init_process_group("gloo")
    rank, tp, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    torch.manual_seed(0)                          # the same full tensors on every rank
    x, dy = torch.randn(B, T, C), torch.randn(B, T, O)
    chunk = slice(rank * T // tp, (rank + 1) * T // tp)      # this rank's T/tp tokens (SP)

    # Column-parallel: f then X W_local^T; output is the reference's slice of features.
    w = torch.randn(O, C)
    for sp in (False, True):
        ref_x, ref_w = leaf(x), leaf(w)
        ref_y = F.linear(ref_x, ref_w)
        ref_y.backward(dy)
        col = ColumnParallelLinear(C, O, rank, tp)
        cols = col.weight.local_slice[0]
        load_shard(col, w)
        x_in = leaf(x[:, chunk] if sp else x)
        y = col(gather_from_sequence(x_in, group) if sp else copy_to_tp(x_in, group))
        y.backward(dy[..., cols])
        close(f"column sp={sp} output", y, ref_y[..., cols].detach())
        close(f"column sp={sp} dL/dx", x_in.grad, ref_x.grad[:, chunk] if sp else ref_x.grad)
        close(f"column sp={sp} dL/dW", col.weight.grad, ref_w.grad[cols])

    # Row-parallel: X_local W_local^T then g (all-reduce, or reduce-scatter along T under SP).
    w = torch.randn(C, O)
    x_wide = torch.randn(B, T, O)
    for sp in (False, True):
        ref_x, ref_w = leaf(x_wide), leaf(w)
        ref_y = F.linear(ref_x, ref_w)
        ref_y.backward(x)                                  # upstream grad (B, T, C)
        dy_row = x
        row = RowParallelLinear(O, C, rank, tp, group, sp)
        feats = row.weight.local_slice[1]
        load_shard(row, w)
        x_in = leaf(x_wide[..., feats])
        y = row(x_in)
        y.backward(dy_row[:, chunk] if sp else dy_row)
        close(f"row sp={sp} output", y, (ref_y[:, chunk] if sp else ref_y).detach())
        close(f"row sp={sp} dL/dx", x_in.grad, ref_x.grad[..., feats])
        close(f"row sp={sp} dL/dW", row.weight.grad, ref_w.grad[:, feats])

    # Vocab-parallel embedding (V padded to a multiple of tp).
    table = torch.randn(V, C)
    ids = torch.randint(0, V, (B, T))
    for sp in (False, True):
        ref_w = leaf(table)
        ref_y = F.embedding(ids, ref_w)
        ref_y.backward(x)
        emb = VocabParallelEmbedding(V, C, rank, tp, group, sp)
        rows = emb.weight.local_slice[0]
        load_shard(emb, table)
        y = emb(ids)
        y.backward(x[:, chunk] if sp else x)
        close(f"embedding sp={sp} output", y, (ref_y[:, chunk] if sp else ref_y).detach())
        close(f"embedding sp={sp} dL/dW", emb.weight.grad, ref_w.grad[rows])

    # Vocab-parallel head + cross-entropy against the plain head + causal_lm_loss, with some
    # targets ignored (-100) in the second round.
    head_w = torch.randn(V, C)
    targets = torch.randint(0, V, (B, T))
    for ignore in (False, True):
        tgt = targets.masked_fill(torch.arange(T) % 3 == 0, -100) if ignore else targets
        ref_x, ref_w = leaf(x), leaf(head_w)
        ref_loss = causal_lm_loss(F.linear(ref_x, ref_w), tgt)
        ref_loss.backward()
        head = VocabParallelHead(C, V, rank, tp)
        rows = head.weight.local_slice[0]
        load_shard(head, head_w)
        x_in = leaf(x)
        logits = head(copy_to_tp(x_in, group))                      # (B, T, ceil(V/tp))
        per_rank = -(-V // tp)
        assert logits.shape == (B, T, per_rank), logits.shape
        n_real = rows.stop - rows.start
        assert torch.isneginf(logits[..., n_real:]).all(), "padding logits must be -inf"
        close(f"head logits ignore={ignore}", logits[..., :n_real],
              F.linear(x, head_w)[..., rows])
        loss = vocab_parallel_cross_entropy(logits, tgt, group)
        loss.backward()
        close(f"vocab-parallel loss ignore={ignore}", loss, ref_loss.detach())
        close(f"vocab-parallel loss ignore={ignore} dL/dx", x_in.grad, ref_x.grad)
        close(f"vocab-parallel loss ignore={ignore} dL/dW", head.weight.grad, ref_w.grad[rows])
    if rank == 0:
        print(f"all layer checks passed on tp={tp}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
