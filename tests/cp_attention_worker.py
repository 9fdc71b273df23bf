"""Run on cp gloo ranks by tests/test_context_parallel.py (torchrun): context-parallel attention
against `eager_attention` on the whole sequence in one process.

Every rank draws the same full q, k, v and output gradient from one seed, computes the
reference on all of it, then runs the context-parallel attention on its zigzag share and
compares outputs and dQ/dK/dV with its share of the reference. It also counts the chunk pairs
each ring step computes (by wrapping the block kernels), for the balance test. Ulysses (the
all-to-all mode) is checked the same way. Each rank writes <out>/rank<r>.json.
"""
import argparse
import functools
import json
import os

import torch
import torch.distributed as dist

from picotron.context_parallel import kernels, ring_attention as ring_module
from picotron.context_parallel.ring_attention import ring_attention
from picotron.context_parallel.sharding import shard_along
from picotron.context_parallel.ulysses import ulysses_attention
from picotron.attention import eager_attention, sdpa_attention
from picotron.process_group_manager import ProcessGroupManager

B, D, CHUNK = 2, 8, 4          # batch, head dim, tokens per zigzag chunk (T = 2 * cp * CHUNK)


def cases(cp):
    """(name, query heads H, kv heads K, attention). Ulysses needs K divisible by cp."""
    ring = {fused: functools.partial(ring_attention, fused=fused) for fused in (False, True)}
    return [("gqa_reference", 4, 2, ring[False]), ("mqa_reference", 4, 1, ring[False]),
            ("mha_reference", 2, 2, ring[False]), ("gqa_fused", 4, 2, ring[True]),
            ("mqa_fused", 4, 1, ring[True]),
            ("ulysses_gqa_eager", 2 * cp, cp, functools.partial(ulysses_attention,
                                                                attention_fn=eager_attention)),
            ("ulysses_mha_sdpa", cp, cp, functools.partial(ulysses_attention,
                                                           attention_fn=sdpa_attention))]


def rel_err(a, b) -> float:
    """max |a - b| / max |b|: relative to the tensor's scale, not per element (near-zero
    elements have no meaningful relative error)."""
    return ((a - b).abs().max() / b.abs().max()).item()


def counting(kernel, counts, chunk):
    """Wrap a block kernel to add the chunk pairs it computes to counts[-1] (a diagonal block
    of n chunks is n(n+1)/2 pairs: the masked corner is not work)."""
    def wrapped(q, k, v, causal, *rest):
        nq, nk = q.shape[2] // chunk, k.shape[2] // chunk
        counts[-1] += nq * (nq + 1) // 2 if causal else nq * nk
        return kernel(q, k, v, causal, *rest)
    return wrapped


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    pgm = ProcessGroupManager(dp=1, pp=1, cp=cp, tp=1)
    T = 2 * cp * CHUNK
    result = {"cp_rank": pgm.cp_rank}
    counts = []
    for name in ("reference_block_forward", "fused_block_forward"):
        setattr(ring_module, name, counting(getattr(kernels, name), counts, CHUNK))
    for name, H, K, attention in cases(cp):
        g = torch.Generator().manual_seed(1234)
        q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (H, K, K))
        dout = torch.randn(B, H, T, D, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = eager_attention(*full)
        ref.backward(dout)
        local = [shard_along(t, 2, pgm.cp_rank, cp).requires_grad_() for t in (q, k, v)]
        counts.append(0)
        out = attention(*local, pgm=pgm)
        out.backward(shard_along(dout, 2, pgm.cp_rank, cp))
        errors = {"out": rel_err(out, shard_along(ref, 2, pgm.cp_rank, cp))}
        for tname, mine, theirs in zip(("dq", "dk", "dv"), local, full):
            errors[tname] = rel_err(mine.grad, shard_along(theirs.grad, 2, pgm.cp_rank, cp))
        result[name] = {"errors": errors, "chunk_pairs": counts[-1]}
    with open(os.path.join(args.out, f"rank{pgm.cp_rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
