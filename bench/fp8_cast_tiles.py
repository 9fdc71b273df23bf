"""The FP8 cast kernels' tiles, swept on the GPU: time and bandwidth of each kernel of
picotron/speed/fp8/cast.py for every tile, against the tile the module uses now.

    python bench/fp8_cast_tiles.py [--widths 2048,8192,16384] [--rows 32768] [--out DIR]

For each width K, on a bf16 (rows, K) operand as the FP8 linears meet them at micro-batch 16 x
seq 2048 (K = 2048: a projection's input at 1.7B; 8192: the down projection's; 16384: gate/up's
output gradient):
- tensor amax (`_amax`, one scale): reads x once;
- tensorwise cast writing q and q^T (`_cast`): reads x, writes two FP8 copies;
- rowwise amax + cast (`_rowwise`): reads x (twice, the second mostly from L2), writes q;
- column amax (`_amax` per column): reads x once;
- the same cast taking x's amax as it runs ("recording": delayed scaling's cast);
- with K = I, fp8_delayed_swiglu's kernels ("swiglu"): forward reads gu (N, 2I) and writes
  h_q, backward reads gu and dh and writes d(gu)_q, d(gu)_q^T and h^T_q.
Bandwidth counts the bytes each kernel must move once; "of floor" is that traffic at the
device's copy rate over the measured time. torch's own `x.abs().amax()` is printed beside the
amax as a yardstick. Prints one table per kernel and width, best first.
"""
import argparse
import itertools
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from norm_tiles import copy_rate  # noqa: E402  (the floor's yardstick)
from picotron.speed.fp8 import cast as fc  # noqa: E402
from picotron.speed.fp8 import delayed_swiglu as fds  # noqa: E402
from picotron.speed.fp8.delayed import SLOT_STRIDE, SLOTS  # noqa: E402

E4M3 = torch.float8_e4m3fn


def timed(fn):
    return do_bench(fn, warmup=10, rep=40)


def amax_rows(x, per_column: bool):
    """(ms, tile) for every _amax tile: (BLOCK_M, BLOCK_K, warps, programs per SM)."""
    N, K = x.shape
    sms = fc._sm_count(x.device)
    out = torch.zeros((K, 1) if per_column else (), dtype=torch.int32, device=x.device)
    rows = []
    for bm, bk, warps, per_sm in itertools.product((8, 16, 32, 64), (128, 256, 512),
                                                   (4, 8), (4, 8, 16, 32)):
        if not 2048 <= bm * bk <= 32768 or bk > K:
            continue
        col_blocks = triton.cdiv(K, bk)
        programs = max(1, min(triton.cdiv(N, bm), per_sm * sms // col_blocks))

        def run():
            fc._amax[(col_blocks, programs)](x, out, N, K, K, PER_COLUMN=per_column,
                                             BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
        rows.append((timed(run), (bm, bk, warps, per_sm)))
    return rows


def site_slots(device):
    """Where a delayed site's casts record their amax, as in training
    (picotron/speed/fp8/delayed.py)."""
    return torch.zeros((SLOTS, SLOT_STRIDE), dtype=torch.int32, device=device)


def cast_rows(x, record: bool = False):
    """(ms, tile) for every _cast tile; `record`: the amax taken as the cast runs (delayed
    scaling, picotron/speed/fp8/delayed.py)."""
    N, K = x.shape
    amax = x.abs().amax().float()
    bits = site_slots(x.device)
    q, qt = torch.empty((N, K), dtype=E4M3, device=x.device), torch.empty((K, N), dtype=E4M3,
                                                                        device=x.device)
    scale = torch.empty_like(amax)
    rows = []
    for bm, bk, warps in itertools.product((32, 64, 128), (32, 64, 128), (2, 4, 8)):
        def run():
            fc._cast[(triton.cdiv(N, bm), triton.cdiv(K, bk))](
                x, amax, q, qt, scale, bits, N, K, K, SCALING=fc.TENSOR, WRITE_Q=True,
                WRITE_QT=True, RECORD=record, SLOTS=SLOTS, SLOT_STRIDE=SLOT_STRIDE,
                EXACT_ROUND=False, FP8_MAX=448.0, MANTISSA=3,
                MIN_EXP=-6, BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
        rows.append((timed(run), (bm, bk, warps)))
    return rows


def rowwise_rows(x):
    N, K = x.shape
    q = torch.empty((N, K), dtype=E4M3, device=x.device)
    scale = torch.empty((N, 1), dtype=torch.float32, device=x.device)
    rows = []
    for bm, bk, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8)):
        if bm * bk > 16384 or bk > K:
            continue

        def run():
            fc._rowwise[(triton.cdiv(N, bm),)](x, q, scale, N, K, K, AMAX_ONLY=False,
                                               EXACT_ROUND=False, FP8_MAX=448.0, MANTISSA=3,
                                               MIN_EXP=-6,
                                               BLOCK_M=bm, BLOCK_K=bk, num_warps=warps)
        rows.append((timed(run), (bm, bk, warps)))
    return rows


def swiglu_rows(gu, backward: bool):
    """(ms, tile) for every tile of fp8_delayed_swiglu's forward or backward kernel, on gu
    (N, 2I) (and dh (N, I) backward), with the amaxes recorded as in training."""
    N, I = gu.shape[0], gu.shape[1] // 2
    dh = torch.randn(N, I, device=gu.device, dtype=gu.dtype)
    amax, bits = torch.ones((), device=gu.device), site_slots(gu.device)
    rows = []
    for bm, bk, warps in itertools.product((32, 64, 128), (32, 64, 128), (2, 4, 8)):
        if bm * bk // (32 * warps) > 64:            # more than 64 values a thread
            continue
        kernel = "backward" if backward else "forward"
        fds.TILES[kernel] = ((bm, bk, warps), fds.TILES[kernel][1])
        if backward:
            rows.append((timed(lambda: fds.swiglu_backward_fp8(dh, gu, amax, bits, amax)),
                         (bm, bk, warps)))
        else:
            rows.append((timed(lambda: fds.swiglu_fp8(gu, amax, bits)), (bm, bk, warps)))
    return rows


def report(emit, title, rows, nbytes, rate, now):
    floor_ms = nbytes / rate * 1e3
    emit(f"\n{title}: {nbytes / 1e6:.0f} MB moved, floor {floor_ms * 1e3:.1f} us "
         f"(now: {now})")
    for ms, tile in sorted(rows)[:6]:
        mark = " <- now" if tile == now else ""
        emit(f"  {str(tile):22s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
             f"{floor_ms / ms:4.0%} of floor{mark}")
    mine = [ms for ms, tile in rows if tile == now]
    if mine:
        emit(f"  now: {mine[0] * 1e3:.1f} us ({floor_ms / mine[0]:.0%} of floor)")


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="2048,8192,16384", help="widths K, comma-separated "
                   "(default: %(default)s)")
    p.add_argument("--kernels", default="amax,column,cast,rowwise,swiglu",
                   help="which sweeps, comma-separated (default: %(default)s)")
    p.add_argument("--rows", type=int, default=32768, help="rows N (default: 16 x 2048)")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder of the result tables (default: $OUT, else the current folder)")
    args = p.parse_args()
    kernels = args.kernels.split(",")
    lines = []

    def emit(text):
        print(text, flush=True)
        lines.append(text)
    rate = copy_rate()
    emit(f"copy rate {rate / 1e12:.2f} TB/s (read + write)")
    for K in map(int, args.widths.split(",")):
        x = torch.randn(args.rows, K, device="cuda", dtype=torch.bfloat16)
        nx = x.numel() * 2
        ms = timed(lambda: x.abs().amax())
        emit(f"\nK={K}: torch x.abs().amax() {ms * 1e3:.1f} us ({nx / ms / 1e9:.2f} TB/s)")
        amax_now = (*fc.TILES["amax"][0], fc.AMAX_PROGRAMS_PER_SM)
        if "amax" in kernels:
            report(emit, f"tensor amax K={K}", amax_rows(x, False), nx, rate, amax_now)
        if "column" in kernels:
            report(emit, f"column amax K={K}", amax_rows(x, True), nx, rate, amax_now)
        if "cast" in kernels:
            report(emit, f"tensorwise cast, q and q^T, K={K}", cast_rows(x), 2 * nx, rate,
                   fc.TILES["cast"][0])
        if "recording" in kernels:
            report(emit, f"tensorwise cast recording the amax, K={K}", cast_rows(x, True),
                   2 * nx, rate, fc.TILES["cast_recording"][0])
        if "rowwise" in kernels:
            report(emit, f"rowwise amax + cast K={K}", rowwise_rows(x), nx * 3 // 2, rate,
                   fc.TILES["rowwise"][0])
        if "swiglu" in kernels:     # K = I: reads gu (N, 2I), writes h_q (N, I)
            tiles = dict(fds.TILES)
            gu = torch.randn(args.rows, 2 * K, device="cuda", dtype=torch.bfloat16)
            report(emit, f"SwiGLU to FP8 h, I={K}", swiglu_rows(gu, False), nx * 5 // 2,
                   rate, tiles["forward"][0])
            # reads gu, dh (N, I); writes d(gu)_q, d(gu)_q^T (N, 2I each) and h^T_q (I, N)
            report(emit, f"SwiGLU backward to FP8, I={K}", swiglu_rows(gu, True),
                   nx * 11 // 2, rate, tiles["backward"][0])
            fds.TILES.update(tiles)
    with open(os.path.join(args.out, "fp8_cast_tiles.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
