"""Which tokens of each sequence a context-parallel rank holds: the zigzag (head-tail) split.

Causal attention is lopsided: the last query of a sequence reads every key, the first reads one.
Cut the sequence into cp contiguous pieces and rank cp-1 does about cp times the attention work
of rank 0 (the ring waits for the slowest). Instead cut it into 2*cp chunks and give rank r the
chunks r and 2*cp-1-r, one early and one late: every rank then does the same work.

    seq_len 16, cp 2 -> 4 chunks of 4 tokens
        rank 0: chunks 0, 3 = positions  0- 3, 12-15
        rank 1: chunks 1, 2 = positions  4- 7,  8-11

The tokens move, so everything attached to a token moves with it: its true position (for RoPE)
and its target (the next token of the original sequence, already paired by `micro_batch`).
"""
import torch


def zigzag_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The positions (T/cp,) that cp rank `cp_rank` holds, in increasing order."""
    if cp_size == 1:                  # nothing to balance: every length, in order
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp_size={2 * cp_size}: the "
                         f"zigzag split gives each cp rank two equal chunks")
    chunk = seq_len // (2 * cp_size)
    early, late = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(early * chunk, (early + 1) * chunk),
                      torch.arange(late * chunk, (late + 1) * chunk)])


def shard_sequence(inputs, targets, cp_rank: int, cp_size: int):
    """This cp rank's (inputs, targets, position_ids), each (B, T/cp), from the full (B, T).

    With cp_size 1 it returns the inputs and targets unchanged and positions 0..T-1, so the
    training loop has one path for every layout."""
    B, T = inputs.shape
    # on the inputs' device: validation shards windows already on the GPU, and CPU positions
    # there would put RoPE's cos/sin on the CPU
    positions = zigzag_positions(T, cp_rank, cp_size).to(inputs.device)     # (T/cp,)
    return inputs[:, positions], targets[:, positions], positions.expand(B, -1)


def shard_along(x, dim: int, cp_rank: int, cp_size: int):
    """This rank's zigzag share of any tensor along its sequence dimension `dim`."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp_rank, cp_size).to(x.device))
