"""FP8 training (`training.fp8`): the decoder's projection GEMMs in 8-bit floats, with bf16 in
and out; everything else (embedding, head, norms, attention) keeps its dtype.

Reading order (each file needs only the ones before it; linear.py's docstring is the
introduction: the two formats, what a scale is, the three GEMMs of a linear):
    cast.py             the casts as our own Triton kernels (amax, scale, rounding)
    quantize.py         one operand to FP8 with its scales: the torch reference, or cast.py
    weights.py          a weight cast once per optimizer step instead of at every use
    saturation.py       the delayed scales' check at each step: saturation counted, guarded
    delayed.py          "tensorwise_delayed": the previous step's amaxes as this step's scales
    linear.py           a linear's three GEMMs in FP8, tensorwise or rowwise scales
    fused.py            the casts written by the SwiGLU kernels that produce the operands
    delayed_swiglu.py   the SwiGLU kernels writing only FP8 under delayed scales
    triton_layers.py    the fused q/k/v and gate/up projections as one FP8 GEMM each
    layers.py           `apply_fp8`: the decoder projections swapped for FP8 subclasses;
                        `fp8_step_values`, what a step's record says of them
"""
