"""What bench_fp8.py times FP8 against, and on: one decoder layer's projections as operands
(`layer_gemms`), the FP8 GEMMs alone on operands quantized beforehand (`gemms_alone`: the
ceiling the casts are measured from), and the casts as they were before our kernels
(`PreviousCasts`: fp8_quantize's reference, torch.compile'd or op by op).
"""
import torch

from picotron.speed.fp8 import linear as fp8, quantize as fp8_quantize


def layer_gemms(model_cfg, tokens):
    """[(name, x (N, C_in) bf16, [weights])]: one layer's projections as they run fused."""
    C, I = model_cfg.hidden_size, model_cfg.intermediate_size
    kv = model_cfg.num_key_value_heads * C // model_cfg.num_attention_heads

    def w(o, i):
        return (torch.randn(o, i, device="cuda") * i ** -0.5).bfloat16().requires_grad_()
    x_c = torch.randn(tokens, C, device="cuda").bfloat16().requires_grad_()
    x_i = torch.randn(tokens, I, device="cuda").bfloat16().requires_grad_()
    return [("q/k/v", x_c, [w(C, C), w(kv, C), w(kv, C)]), ("o", x_c, [w(C, C)]),
            ("gate/up", x_c, [w(I, C), w(I, C)]), ("down", x_i, [w(C, I)])]


def gemms_alone(x, weights, recipe):
    """The three FP8 GEMMs of fp8_linear on operands quantized once, beforehand (dW in bf16
    under rowwise_bf16_dw)."""
    r = fp8.recipe_of(recipe)
    scaling, grad = ("row", fp8.E4M3) if r.rowwise else ("tensor", fp8.E5M2)
    w, x = torch.cat(weights).detach(), x.detach()
    dy = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

    def q(t, fmt, along_rows=True):
        if along_rows:
            return fp8.quantize(t, fmt, scaling)[::2]
        return fp8.quantize(t, fmt, "column" if r.rowwise else "tensor", rows=False,
                            transposed=True)[1:]
    pairs = [(q(x, fp8.E4M3), q(w, fp8.E4M3)), (q(dy, grad), q(w, fp8.E4M3, False))]
    if not r.bf16_dw:
        pairs.append((q(dy, grad, False), q(x, fp8.E4M3, False)))

    def run():
        for (p, ps), (b, bs) in pairs:
            fp8.scaled_mm(p, ps, b, bs, torch.bfloat16)
        if r.bf16_dw:
            torch.mm(dy.t(), x)
    return run


class PreviousCasts:
    """`with PreviousCasts():` the casts as before our kernels: the reference, torch.compile'd
    for any shape (`compile=True`, once per process) or op by op, and no weight cache."""
    compiled = {}

    def __init__(self, compile: bool):
        self.compile = compile

    def __enter__(self):
        self.saved = (fp8_quantize.use_kernels, fp8_quantize.reference,
                      fp8_quantize.reference_amax)
        reference, reference_amax = self.saved[1:]
        if self.compile:
            if not self.compiled:
                self.compiled.update(reference=torch.compile(reference, dynamic=True),
                                     amax=torch.compile(reference_amax, dynamic=True))
            reference, reference_amax = self.compiled["reference"], self.compiled["amax"]
        fp8_quantize.use_kernels = lambda x: False
        fp8_quantize.reference, fp8_quantize.reference_amax = reference, reference_amax
        return self

    def __exit__(self, *exc):
        (fp8_quantize.use_kernels, fp8_quantize.reference,
         fp8_quantize.reference_amax) = self.saved
