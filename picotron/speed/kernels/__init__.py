"""Fused kernels (`model.kernels`, `training.fused_loss`, `training.use_fused_adam`): each a
Triton kernel (or liger-kernel's) behind a subclass of the textbook module it replaces, and each
tested against that module's formula.

Reading order (each file needs only the ones before it):
    triton_norms.py    RMSNorm and bias-free LayerNorm, forward and backward
    triton_rope.py     RoPE straight out of the fused q/k/v projection
    triton_swiglu.py   SwiGLU on the packed gate/up projection (and its recomputing variant)
    fused_linear.py    one matmul for several projections of one input: q/k/v, gate/up
    triton_layers.py   the model's norms, attention and MLP as subclasses running the above
    liger_layers.py    the same three from liger-kernel
    swap.py            `apply_kernels`: the class swap, in place, after the build
    triton_loss.py     the output head and the cross-entropy a chunk of tokens at a time
    triton_adamw.py    AdamW in one pass per flat shard
"""
