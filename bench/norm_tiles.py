"""The Triton norms' tile choice, swept on the GPU: time and bandwidth of every (rows per program,
warps, programs per SM) against the heuristic `_tile` in picotron/speed/kernels/triton_norms.py.

    python bench/norm_tiles.py [--widths 960,2048] [--rows 32768] [--out DIR]

For each width C: the RMSNorm forward and backward, bf16 rows, fp32 statistics, as the model
calls them at micro-batch 16 x seq 2048. Bandwidth counts the bytes each kernel must move (x,
y, dy, dx once each; the per-row statistics and weight partials are negligible), so "of floor"
= that traffic at the device's copy rate over the measured time. Prints one table per kernel,
best first.
"""
import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron.speed.kernels import triton_norms as tn  # noqa: E402


def copy_rate(nbytes=2 ** 31):
    """Device-to-device copy rate (bytes read + written per second): the floor's yardstick."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (do_bench(lambda: b.copy_(a)) * 1e-3)


def sweep(N, C, rate, emit):
    dev, dt = torch.device("cuda"), torch.bfloat16
    x, dy = (torch.randn(N, C, device=dev, dtype=dt) for _ in range(2))
    w = torch.randn(C, device=dev, dtype=dt)
    y, dx = (torch.empty_like(x) for _ in range(2))
    rstd = torch.ones(N, device=dev, dtype=torch.float32)
    BLOCK_C = triton.next_power_of_2(C)
    now, now_bwd = tn._tile(C), tn._tile(C, backward=True)
    row_bytes = C * x.element_size()
    rows = []
    for bm in (1, 2, 4, 8, 16):
        for nw in (1, 2, 4, 8, 16):
            if bm * BLOCK_C // (32 * nw) < 1 or bm * BLOCK_C // (32 * nw) > 64:
                continue                # under one element or over 64 per thread per tensor

            def fwd():
                tn._norm_fwd[(triton.cdiv(N, bm),)](
                    x, w, y, rstd, rstd, N, C, C, 1e-5, RMS=True, BLOCK_M=bm,
                    BLOCK_C=BLOCK_C, num_warps=nw)
            ms = do_bench(fwd)
            rows.append((ms, bm, nw, "-"))
    report(emit, f"forward C={C}", rows, 2 * N * row_bytes, rate, now)   # x in, y out
    rows = []
    for bm in (1, 2, 4, 8, 16):
        for nw in (2, 4, 8, 16):
            per_thread = bm * BLOCK_C // (32 * nw)
            if per_thread < 2 or per_thread > 32:
                continue
            for per_sm in (1, 2, 4, 8):
                programs = min(per_sm * tn._sm_count(dev), triton.cdiv(N, bm))
                dw = torch.empty(programs, C, device=dev, dtype=torch.float32)

                def bwd():
                    tn._norm_bwd[(programs,)](
                        x, w, dy, dx, dw, rstd, rstd, N, C, C, C, RMS=True, BLOCK_M=bm,
                        BLOCK_C=BLOCK_C, num_warps=nw)
                ms = do_bench(bwd)
                rows.append((ms, bm, nw, per_sm))
    report(emit, f"backward C={C}", rows, 3 * N * row_bytes, rate, now_bwd)   # x, dy in, dx out


def report(emit, title, rows, nbytes, rate, now):
    floor_ms = nbytes / rate * 1e3
    emit(f"\n{title}: {nbytes / 1e6:.0f} MB moved, floor {floor_ms * 1e3:.1f} us "
         f"(heuristic: BLOCK_M {now[1]}, {now[2]} warps)")
    for ms, bm, nw, per_sm in sorted(rows)[:8]:
        mark = " <- heuristic" if (bm, nw) == now[1:] else ""
        emit(f"  BLOCK_M {bm:2d}  warps {nw:2d}  per SM {per_sm}  {ms * 1e3:7.1f} us  "
             f"{nbytes / ms / 1e9:5.2f} TB/s  {floor_ms / ms:4.0%} of floor{mark}")
    mine = [r for r in rows if (r[1], r[2]) == now[1:]]
    if mine:
        ms = min(mine)[0]
        emit(f"  heuristic best: {ms * 1e3:.1f} us ({floor_ms / ms:.0%} of floor)")


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="960,2048", help="hidden sizes C to sweep, "
                   "comma-separated (default: 960,2048: SmolLM-360M and 1.7B)")
    p.add_argument("--rows", type=int, default=32768,
                   help="rows (tokens) per call (default: 32768 = 16 x 2048)")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder of the result tables (default: $OUT, else the current folder)")
    args = p.parse_args()
    lines = []

    def emit(text):
        print(text, flush=True)
        lines.append(text)
    rate = copy_rate()
    emit(f"copy rate {rate / 1e12:.2f} TB/s (read + write)")
    for C in map(int, args.widths.split(",")):
        sweep(args.rows, C, rate, emit)
    with open(os.path.join(args.out, "norm_tiles.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
