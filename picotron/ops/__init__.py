"""Optional fast paths, each behind one config option, each with a readable PyTorch reference
that stays the default and the test oracle.

    liger.py      model.kernels = "liger": RMSNorm, RoPE, SwiGLU from liger-kernel (Triton)
    loss.py       training.fused_loss: the head and the cross-entropy without full logits
    recompute.py  training.activation_checkpointing: none | full | selective, per layer
"""
