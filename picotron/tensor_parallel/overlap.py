"""Sequence-parallel communication overlapped with the GEMMs (`distributed.tp_comm_overlap`).

Shapes: B batch, T sequence, t = T/tp one rank's chunk of it, C hidden, O/I a projection's
output/input features on this rank, r this rank, n = tp. "Chunk j" is tokens [j*t, (j+1)*t).

Under sequence parallelism (comms.py) a block starts with an all-gather along T and ends with
a reduce-scatter; both wait for their collective before the GEMM can start (or after it ends),
so the transfers run exposed. Cut along the sequence, each collective becomes n steps of a
ring, and every step's transfer can run while the GEMM of a chunk already at hand computes:

  ring all-gather + GEMM (column forward; row backward), y = gather(x) @ W^T:
      step s = 0 .. n-1: this rank holds chunk j = (r - s) mod n, (B, t, C).
          start: send chunk j to rank r+1, receive chunk j-1 from rank r-1   (if s < n-1)
          compute y[:, chunk j] = chunk j @ W^T        <- overlaps the transfer
          wait for the transfer
      Every rank ends with all n chunks: the gathered x (B, T, C) is written as they arrive.

  GEMM + ring reduce-scatter (row forward; column backward), y_r = sum_k (x_k @ W_k^T)[chunk r]:
      step s = 0 .. n-1: this rank works on chunk j = (r + 1 + s) mod n (the next rank's first).
          compute p = x[:, chunk j] @ W^T, this rank's partial (B, t, O)  <- overlaps the
                                                        transfer started at step s-1
          if s > 0: wait, p += the running sum of chunk j received from rank r+1
          if s < n-1: start: send p to rank r-1, receive chunk j+1's running sum from r+1
      At s = n-1, j = r and p holds the sum over all n ranks: this rank's output chunk.

Each step's send and receive are issued together (dist.batch_isend_irecv): two ranks that both
send first would deadlock on NCCL, and at n = 2 the next and the previous rank are the same.
On a GPU NCCL runs the transfers on its own stream; `wait` only makes the compute stream wait
for them, so the GEMM launched meanwhile on the compute stream overlaps the transfer. NCCL
starts a transfer only after the work queued before it, so each step costs the longer of its
transfer and its GEMM: with n = 2, one chunk's transfer hides behind the other chunk's GEMM.
On CPU (gloo) the same code is correct but nothing overlaps: the tests check the numbers, not
speed.

Left exposed: the embedding's reduce-scatter and the final norm's all-gather before the head
(no GEMM of ours to hide them behind). Speed plug-ins run their fused projections through
the same rings (`ring_column_linear`'s `stack`, `RowParallelLinear.reduce`).

Every GEMM writes straight into its rows of the output: for each sequence b, rows [j*t,
(j+1)*t) of y[b] are one contiguous (t, O) block, T*O elements after the previous sequence's,
so `torch.bmm(..., out=y[:, chunk j])` needs no copy of the product (a (B, t, O) result moved
into place would cost as much memory traffic as the transfer it hides).

Where the sums differ from the non-overlapped path: the ring adds the ranks' partials in ring
order, not in gloo's or NCCL's internal order, and the block's column projections (q, k, v;
gate, up) are one GEMM on their stacked weights, so dL/dx sums over all their outputs at once
instead of one projection after the other. In fp32 that moves outputs and gradients by a few
units in the last place (tests/test_tp_overlap.py measures it).

Memory: the column backward needs the gathered x for dW = dy^T x, so the ring writes every
chunk into one (B, T, C) tensor that forward saves: the same tensor the non-overlapped path
keeps (the all-gather's output, saved by the projections). The row backward gathers dy the
same way, for dW, as the non-overlapped path does. Nothing else is kept.

How it is entered (apply_comm_overlap, called by apply_tensor_parallel): the norms before a
block keep their sharded output (B, t, C) instead of all-gathering it, the attention and MLP
blocks become the subclasses below, whose column projections run as one ring on their stacked
weights, and the row projections (o, down) become RingRowParallelLinear. The PaLM-style
parallel block feeds one norm to both branches, so it runs two rings over the same x.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from picotron.comm import batch_isend_irecv
from picotron.model import MLP, Attention, apply_rope
from picotron.tensor_parallel.layers import RowParallelLinear


def _exchange(send, recv, group, step: int):
    """Start sending `send` to rank r+step of the ring and receiving `recv` from rank r-step
    (step +1 or -1); returns the work handles to wait on (gloo gives one per operation)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    to, source = (dist.get_global_rank(group, (rank + i) % n) for i in (step, -step))
    return batch_isend_irecv([dist.P2POp(dist.isend, send, to, group),
                                   dist.P2POp(dist.irecv, recv, source, group)])


def _mm_rows(a, b, out):
    """out[i] = a[i] @ b for each sequence i, as one batched GEMM: a (B, t, K), b (K, O), out
    (B, t, O). a and out may be row blocks of larger (B, T, .) tensors: each a[i], out[i] is
    contiguous and the batch stride is T rows, which a strided batched GEMM takes as it is
    (b is the same matrix for every i: batch stride 0)."""
    torch.bmm(a, b.expand(a.shape[0], *b.shape), out=out)


def ring_all_gather(local, group, on_chunk):
    """All-gather along T as a ring: calls on_chunk(j, chunk_j) for j = r, r-1, ..., each while
    the next chunk is on its way. local (B, t, ...) contiguous."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    chunk = local
    for s in range(n):
        works, arriving = [], None
        if s < n - 1:
            arriving = torch.empty_like(chunk)
            works = _exchange(chunk, arriving, group, +1)
        on_chunk((rank - s) % n, chunk)                  # the GEMM overlaps the transfer
        for work in works:
            work.wait()
        chunk = arriving


def ring_reduce_scatter(partial_of, group):
    """Reduce-scatter along T as a ring: partial_of(j) is this rank's (B, t, O) term of chunk j;
    returns chunk r of the sum over ranks. Each partial is computed while the previous step's
    running sum is on its way."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    works, sent, arriving = [], None, None
    for s in range(n):
        part = partial_of((rank + 1 + s) % n)            # overlaps the transfer of step s-1
        for work in works:
            work.wait()
        if arriving is not None:
            part += arriving                             # the sum over ranks r+1 .. r+s
        if s < n - 1:
            # `sent` holds the buffer in flight until it is waited on: never reused early
            sent, arriving = part, torch.empty_like(part)
            works = _exchange(sent, arriving, group, -1)
    return part


def gather_matmul(local, w_t, group):
    """(gather_T(local) @ w_t, gather_T(local)) by the ring: local (B, t, K), w_t (K, O) ->
    (B, T, O), (B, T, K)."""
    B, t, K = local.shape
    n = dist.get_world_size(group)
    y = local.new_empty(B, n * t, w_t.shape[1])
    gathered = local.new_empty(B, n * t, K)

    def on_chunk(j, chunk):
        rows = slice(j * t, (j + 1) * t)
        _mm_rows(chunk, w_t, y[:, rows])
        gathered[:, rows] = chunk                      # kept for the weight gradient
    ring_all_gather(local.contiguous(), group, on_chunk)
    return y, gathered


def matmul_reduce_scatter(full, w_t, group):
    """reduce_scatter_T(full @ w_t) by the ring: full (B, T, K), w_t (K, O) -> (B, t, O)."""
    full = full.contiguous()
    B, T, _ = full.shape
    t = T // dist.get_world_size(group)

    def partial_of(j):
        out = full.new_empty(B, t, w_t.shape[1])
        _mm_rows(full[:, j * t:(j + 1) * t], w_t, out)
        return out
    return ring_reduce_scatter(partial_of, group)


class _RingColumn(torch.autograd.Function):
    """y = gather_T(x) @ cat(weights)^T, x (B, t, C) -> y (B, T, sum O_i): the column
    projections of one block as one ring all-gather + GEMM. Backward: dx = the ring GEMM +
    reduce-scatter of dy @ W, dW = dy^T gather_T(x) (one GEMM over all T, as without overlap),
    handed back to each weight as its rows."""

    @staticmethod
    def forward(ctx, x, group, stack, *weights):
        w = stack(weights)                                            # (O, C)
        y, gathered = gather_matmul(x, w.t(), group)
        ctx.save_for_backward(gathered, *weights)
        ctx.group, ctx.stack = group, stack
        return y

    @staticmethod
    def backward(ctx, dy):                                            # (B, T, O)
        gathered, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        w = ctx.stack(weights)
        dx = matmul_reduce_scatter(dy, w, ctx.group)                  # (B, t, C)
        dw = dy.reshape(-1, dy.shape[-1]).t() @ gathered.reshape(-1, gathered.shape[-1])
        return (dx, None, None, *dw.split([wi.shape[0] for wi in weights], dim=0))


class _RingRow(torch.autograd.Function):
    """y = reduce_scatter_T(x @ W^T), x (B, T, I) -> y (B, t, O): the row projection's GEMM
    and ring reduce-scatter. Backward: dx = gather_T(dy) @ W by the ring all-gather + GEMM,
    dW = gather_T(dy)^T x."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return matmul_reduce_scatter(x, weight.t(), group)

    @staticmethod
    def backward(ctx, dy):                                            # (B, t, O)
        x, weight = ctx.saved_tensors
        dx, dy_full = gather_matmul(dy.contiguous(), weight, ctx.group)   # (B, T, I), (B, T, O)
        dw = dy_full.reshape(-1, dy_full.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, dw, None


def ring_column_linear(x, weights, group, stack=torch.cat):
    """gather_T(x) @ cat(weights)^T with the gather overlapped: x (B, t, C) -> (B, T, sum O_i).
    `stack` concatenates the weights (O_i, C) along dim 0 (a plug-in may pass one that
    returns a view when they lie back to back in memory)."""
    return _RingColumn.apply(x, group, stack, *weights)


class RingRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose GEMM and reduce-scatter along T run as one ring. `reduce` (for a
    fused op that computes the product itself) stays the plain reduce-scatter."""

    def forward(self, x):                                 # (B, T, I/tp) -> (B, t, O)
        return _RingRow.apply(x, self.weight, self.tp_group)


class OverlapAttention(Attention):
    """Attention whose input is this rank's chunk (B, t, C): q, k and v come out of one ring
    all-gather + GEMM, for all T tokens; the rest is model.Attention's forward."""
    tp_group = None                                       # set by apply_comm_overlap

    def project(self, x, weights):
        return ring_column_linear(x, weights, self.tp_group)

    def forward(self, x, cos, sin):
        weights = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        qkv = self.project(x, weights)                    # (B, T, (H + 2K) * D / tp)
        B, T, _ = qkv.shape
        q, k, v = (p.view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in qkv.split([w.shape[0] for w in weights], dim=-1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attention_fn(q, k, v)                  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))           # (B, t, C)


class OverlapMLP(MLP):
    """SwiGLU whose input is this rank's chunk (B, t, C): gate and up in one ring."""
    tp_group = None
    project = OverlapAttention.project

    def forward(self, x):
        gate, up = self.project(x, [self.gate_proj.weight, self.up_proj.weight]).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)          # (B, T, I/tp) -> (B, t, C)


def apply_comm_overlap(model, tp_group):
    """In place: every decoder layer's blocks and row projections as their ring versions
    (apply_tensor_parallel has left the norms before them un-gathered)."""
    for layer in model.layers.values():
        for block, ring_class in ((layer.self_attn, OverlapAttention), (layer.mlp, OverlapMLP)):
            assert type(block) in (Attention, MLP), f"unexpected block {type(block).__name__}"
            block.__class__, block.tp_group = ring_class, tp_group
        for row in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert type(row) is RowParallelLinear, f"unexpected {type(row).__name__}"
            row.__class__ = RingRowParallelLinear
    return model
