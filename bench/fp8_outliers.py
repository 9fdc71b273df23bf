"""What each FP8 recipe does to the numbers when the activations hold an outlier: the error of
one linear's y = x W^T, dx and dW against fp32, measured on every element but the outliers.

    python bench/fp8_outliers.py [--tokens 4096] [--width 1024] [--scales 1e3,1e4,1e5]

The recipes share their formats; they differ in where a scale comes from. A tensorwise scale
maps the largest magnitude of the whole tensor onto e4m3's max (448), so one value `scale`
times louder than the rest pushes every other value down by that factor, towards e4m3's
subnormals (below 2^-6) and zero (below 2^-9): e4m3 spans ~3e4 between its max and its
smallest normal. A rowwise scale is per row along each GEMM's K,
so an outlier costs precision only in its own row (for dW, whose K runs over tokens, in its own
column of x^T); rowwise_bf16_dw computes dW in bf16, no FP8 at all. Cases: no outlier; one
token `scale` times louder (a row of x); one channel `scale` times louder (a column of x, the
outlier features of large models). x, W and dy are bf16, as in training; the reference is fp32
on the same bf16 values. Runs anywhere: on CPU the math is the GPU's (torch's FP8 formats and
`_scaled_mm`), only slower.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron.speed.fp8.linear import fp8_linear  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_bf16_dw")   # tensorwise_delayed: see below


def relative_error(got, exact, keep):
    """||got - exact|| / ||exact|| over the elements the boolean mask `keep` selects (fp64)."""
    got, exact = got.double()[keep], exact.double()[keep]
    return ((got - exact).norm() / exact.norm()).item()


def errors(recipe, x, w, dy, rows, cols):
    """(y, dx, dW) relative errors of fp8_linear under `recipe`, the outlier rows of x (and of
    y and dx) and its outlier columns (and dW's) left out."""
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xs, [ws], recipe)
    y.backward(dy)
    every_out = torch.ones(w.shape[0], dtype=torch.bool)
    x, w, dy = x.float(), w.float(), dy.float()
    return (relative_error(y, x @ w.t(), rows[:, None] & every_out[None, :]),
            relative_error(xs.grad, dy @ w, rows[:, None] & cols[None, :]),
            relative_error(ws.grad, dy.t() @ x, every_out[:, None] & cols[None, :]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--tokens", type=int, default=4096, help="rows of x (default: 4096)")
    p.add_argument("--width", type=int, default=1024, help="C_in = C_out (default: 1024)")
    p.add_argument("--scales", default="1e3,1e4,1e5",
                   help="outlier factors, comma-separated (default: 1e3,1e4,1e5)")
    args = p.parse_args()
    torch.manual_seed(0)
    n, c = args.tokens, args.width
    x, dy = torch.randn(n, c).bfloat16(), torch.randn(n, c).bfloat16()
    w = (torch.randn(c, c) * c ** -0.5).bfloat16()
    every = torch.ones(n, dtype=torch.bool), torch.ones(c, dtype=torch.bool)
    rows, cols = every[0].clone(), every[1].clone()
    rows[7] = cols[7] = False
    cases = {"none": (x, *every)}
    for scale in [float(v) for v in args.scales.split(",")]:
        token, channel = x.clone(), x.clone()
        token[7] *= scale
        channel[:, 7] *= scale
        cases[f"token x{scale:g}"] = (token, rows, every[1])
        cases[f"channel x{scale:g}"] = (channel, every[0], cols)
    print(f"x ({n}, {c}), W ({c}, {c}), bf16; relative error against fp32 on every element but "
          f"the outliers'")
    print(f"{'case':<16} {'recipe':<16} {'y':>9} {'dx':>9} {'dW':>9}")
    for case, (xc, r, k) in cases.items():
        for recipe in RECIPES:
            e = errors(recipe, xc, w, dy, r, k)
            print(f"{case:<16} {recipe:<16} " + " ".join(f"{v:9.2e}" for v in e))
    # tensorwise_delayed scales by the previous step's amax: with no outlier then, a step that
    # brings one saturates it at e4m3's max (the others keep their scale); with one before, it
    # is the tensorwise row above. Its first step is a tensorwise step.


if __name__ == "__main__":
    main()
