"""The collectives the axes call by name, in one place: the single-tensor ones under one name
across torch versions, and the path through host memory for the process groups that cannot
take CUDA tensors.

torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single (the old names warn); torch before 2.13 has only the old ones. Both
take (output, input, group=..., async_op=...).

Several ranks on one GPU (distributed.share_gpu) run over gloo, since NCCL refuses two ranks
on one device. Gloo takes CUDA tensors for some collectives itself (it copies them through
host memory inside) and refuses the others; GLOO_NEEDS_HOST names those, as
bench/share_gpu_probe.py found them on a GPU (torch 2.11). For them the functions below copy
the CUDA tensors to host memory, run the collective there, and copy the results back: at
once, or at `wait()` for an asynchronous call. NCCL groups and CPU tensors go straight to
torch. `through_host=True` forces the host path (the tests run it on CPU tensors).

    forward and backward alike: these are plain collectives, with no autograd of their own
"""
import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)

# The collectives gloo (torch 2.11) refuses on CUDA tensors: bench/share_gpu_probe.py on an
# H100 (bench/NOTES.md): send/recv and batch_isend_irecv, whose TCP transport is handed the
# CUDA pointer itself ("Bad address"); the rest it copies through host memory inside
GLOO_NEEDS_HOST = frozenset({"send/recv"})


def needs_host(collective: str, tensor: torch.Tensor, group) -> bool:
    """Whether `collective` on `tensor` must go through host memory: a CUDA tensor, a gloo
    group, and a collective gloo refuses on CUDA."""
    return (tensor.is_cuda and collective in GLOO_NEEDS_HOST
            and dist.get_backend(group) == "gloo")


class HostWork:
    """The handle of a collective run on host copies: `wait()` waits for it, then copies the
    results into the device tensors they stand for. Each copy happens once."""

    def __init__(self, work, copies: list, host_inputs: list):
        self.work, self.copies = work, copies       # copies: [(device tensor, host tensor)]
        self.host_inputs = host_inputs              # alive until the collective is done

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        for device_tensor, host_tensor in self.copies:
            device_tensor.copy_(host_tensor)
        self.copies, self.host_inputs = [], []
        return True


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="cpu").copy_(tensor)


def _on_host(collective, out, inp, group, async_op, through_host, **kwargs):
    """Run `collective(out, inp, ...)`: directly, or on host copies when needs_host says so
    (or through_host forces it)."""
    fn = {"all_gather_single": _all_gather_single,
          "reduce_scatter_single": _reduce_scatter_single,
          "all_to_all_single": dist.all_to_all_single}[collective]
    if through_host is None:
        through_host = needs_host(collective, inp, group)
    if not through_host:
        return fn(out, inp, group=group, async_op=async_op, **kwargs)
    host_out, host_in = torch.empty_like(out, device="cpu"), _host_copy(inp)
    work = HostWork(fn(host_out, host_in, group=group, async_op=async_op, **kwargs),
                    [(out, host_out)], [host_in])
    if async_op:
        return work
    work.wait()
    return None


def all_gather_single(out, inp, group=None, async_op=False, through_host=None):
    """out (n * numel) = the inputs of the n ranks, in rank order."""
    return _on_host("all_gather_single", out, inp, group, async_op, through_host)


def reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False,
                          through_host=None):
    """out = this rank's 1/n of the element-wise `op` of the n ranks' inputs."""
    return _on_host("reduce_scatter_single", out, inp, group, async_op, through_host, op=op)


def all_to_all_single(out, inp, group=None, async_op=False, through_host=None):
    """Piece i of this rank's input (dim 0 split in n) becomes piece `rank` of rank i's out."""
    return _on_host("all_to_all_single", out, inp, group, async_op, through_host)


def batch_isend_irecv(ops: list, through_host=None) -> list:
    """dist.batch_isend_irecv(ops); the handles to wait on (on the host path one per op, as
    gloo gives them: a receive's handle fills its device buffer when waited on)."""
    if not ops:
        return []
    if through_host is None:
        through_host = needs_host("send/recv", ops[0].tensor, ops[0].group)
    if not through_host:
        return dist.batch_isend_irecv(ops)
    works = []
    for op in ops:
        sending = op.op is dist.isend
        host = _host_copy(op.tensor) if sending else torch.empty_like(op.tensor, device="cpu")
        peer = {"group_dst" if sending else "group_src": op.group_peer}
        works.append(HostWork(op.op(host, group=op.group, tag=op.tag, **peer),
                              [] if sending else [(op.tensor, host)], [host]))
    return works
