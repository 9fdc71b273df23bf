"""Point-to-point transfers between pipeline ranks, that cannot deadlock.

Two ranks that each send before receiving wait for each other forever on NCCL (a send blocks
until it is received). So every transfer of one exchange, sends and receives, is issued at once
with `batch_isend_irecv` (one NCCL group), and every returned handle is waited on: on gloo the
batch gives one handle per operation, and a handle not waited on leaves its buffer in flight.

Shapes and dtypes are agreed, not assumed: both sides compute the shape of a message from the
config, `(mbs, seq_len / cp [/ tp with SP], hidden)` in the training dtype, and a sender
whose tensor differs stops with a clear error instead of corrupting the receiver's buffer.
"""
import torch
import torch.distributed as dist

from picotron.comm import batch_isend_irecv


def message_spec(config, pgm) -> tuple:
    """(shape, dtype) of every activation and gradient sent between stages: (B, T, C), T this
    rank's share of the sequence (over cp, and over tp under sequence parallelism)."""
    t, sp = config.training, config.distributed.sequence_parallel
    T = t.seq_length // pgm.cp_size // (pgm.tp_size if sp else 1)
    return (t.micro_batch_size, T, config.model.hidden_size), getattr(torch, t.dtype)


def exchange(sends: list, recvs: list, group) -> None:
    """sends: [(tensor, peer)], recvs: [(buffer, peer)], peers as global ranks. Returns when
    every transfer has completed (the buffers are filled). Forward and backward: no autograd."""
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), peer, group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, buffer, peer, group) for buffer, peer in recvs]
    if ops:
        for work in batch_isend_irecv(ops):
            work.wait()


def check_spec(tensor, spec, what: str) -> None:
    shape, dtype = spec
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise RuntimeError(f"pipeline {what} has shape {tuple(tensor.shape)} and dtype "
                           f"{tensor.dtype}, but the stages agreed on {shape} {dtype} "
                           f"(micro_batch_size, this rank's share of seq_length, hidden_size; "
                           f"training.dtype)")
