"""Worker for test_fp8.py: FP8 column- and row-parallel linears on tp gloo ranks against one
rank's FP8 linear on the full tensors, every recipe, with and without sequence parallelism.

Every rank builds the same full inputs, weights and upstream gradients from one seed; one
half of each sharded dimension is 8x larger than the other, so a rank's local amax differs
from the full tensor's. With the scales all-reduced over TP, each shard is quantized exactly as
one rank quantizes the full tensor: outputs and gradients match to fp32 summation order. The
control runs the row-parallel layer with local scales and must NOT match. A mismatch raises."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from picotron.speed.fp8.linear import fp8_linear  # noqa: E402
from picotron.speed.fp8.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear  # noqa: E402
from picotron.speed.fp8.weights import Fp8WeightCache  # noqa: E402
from picotron.tensor_parallel.comms import (copy_to_tp, gather_from_sequence,  # noqa: E402
                                            reduce_from_tp)

B, T, C, O = 2, 16, 32, 48
RTOL = 1e-5      # fp32 accumulation: only the order of the sums differs, as in bf16 parity


def close(name, actual, expected):
    """Within fp32 rounding of the tensor's largest value: sums that cancel to near zero keep
    the absolute error of their largest terms."""
    atol = RTOL * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol,
                               msg=lambda m: f"{name}: {m}")


def leaf(t):
    return t.clone().requires_grad_(True)


def uneven(*shape, dim):
    """randn with the second half along `dim` 8x larger: the two shards' amaxes differ."""
    t = torch.randn(*shape)
    t.narrow(dim, shape[dim] // 2, shape[dim] - shape[dim] // 2).mul_(8.0)
    return t


def one_rank(x, w, dy, recipe):
    """Output and gradients of the FP8 linear on the full tensors, no group: the reference."""
    x, w = leaf(x), leaf(w)
    y = fp8_linear(x, [w], recipe)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def sharded(layer, full_w, x_in, dy_local):
    with torch.no_grad():
        layer.weight.copy_(full_w[layer.weight.local_slice])
    y = layer(x_in)
    y.backward(dy_local)
    return y.detach(), layer.weight.grad


def main():
    dist.init_process_group("gloo")
    rank, tp, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    torch.manual_seed(0)                                     # the same full tensors everywhere
    chunk = slice(rank * T // tp, (rank + 1) * T // tp)      # this rank's tokens under SP
    x, w_col, dy_col = torch.randn(B, T, C), uneven(O, C, dim=0), uneven(B, T, O, dim=2)
    x_wide, w_row, dy_row = uneven(B, T, O, dim=2), uneven(C, O, dim=1), torch.randn(B, T, C)
    for recipe in ("tensorwise", "rowwise", "rowwise_bf16_dw"):
        for sp in (False, True):
            tag = f"{recipe} sp={sp}"
            # column-parallel: O sharded; x enters through f (or the SP all-gather)
            ref_y, ref_dx, ref_dw = one_rank(x, w_col, dy_col, recipe)
            col = Fp8ColumnParallelLinear(C, O, rank, tp)
            col.fp8_recipe, col.fp8_group, col.fp8_cache = recipe, group, Fp8WeightCache()
            cols = col.weight.local_slice[0]
            x_in = leaf(x[:, chunk] if sp else x)
            entered = gather_from_sequence(x_in, group) if sp else copy_to_tp(x_in, group)
            y, dw = sharded(col, w_col, entered, dy_col[..., cols])
            close(f"column {tag} output", y, ref_y[..., cols])
            close(f"column {tag} dL/dx", x_in.grad, ref_dx[:, chunk] if sp else ref_dx)
            close(f"column {tag} dL/dW", dw, ref_dw[cols])
            # row-parallel: C_in sharded; the partial products summed by g
            ref_y, ref_dx, ref_dw = one_rank(x_wide, w_row, dy_row, recipe)
            row = Fp8RowParallelLinear(O, C, rank, tp, group, sp)
            row.fp8_recipe, row.fp8_cache = recipe, Fp8WeightCache()     # all-reduced on a miss
            feats = row.weight.local_slice[1]
            x_in = leaf(x_wide[..., feats])
            y, dw = sharded(row, w_row, x_in, dy_row[:, chunk] if sp else dy_row)
            close(f"row {tag} output", y, ref_y[:, chunk] if sp else ref_y)
            close(f"row {tag} dL/dx", x_in.grad, ref_dx[..., feats])
            close(f"row {tag} dL/dW", dw, ref_dw[:, feats])
        # the control: local scales (no group) miss one rank by 10x what close() allows
        local = reduce_from_tp(fp8_linear(x_wide[..., feats], [w_row[:, feats]], recipe), group)
        gap = ((local - ref_y).abs().max() / ref_y.abs().max()).item()
        assert gap > 10 * RTOL, f"{recipe}: local scales matched one rank ({gap:.2g})"
    if rank == 0:
        print(f"FP8 tensor-parallel layers match one rank on tp={tp}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
