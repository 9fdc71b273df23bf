"""Optional fast paths, each behind one config option, each with a readable PyTorch reference
that stays the default and the test oracle.

    liger.py      model.kernels = "liger": RMSNorm, RoPE, SwiGLU from liger-kernel (Triton)
    fused.py      model.kernels = "triton": our Triton kernels and fused projections
                  (triton_norms.py, triton_rope.py, triton_swiglu.py, fused_linear.py)
    triton_adamw.py  training.use_fused_adam on a GPU: AdamW in one pass per gradient shard
    loss.py       training.fused_loss: the head and the cross-entropy without full logits
    triton_loss.py  training.fused_loss = "triton": its Triton kernel, no host sync
    recompute.py  training.activation_checkpointing: none | full | selective, per layer
    cuda_graphs.py  training.cuda_graphs: the layers' forward and backward as CUDA graphs
"""
