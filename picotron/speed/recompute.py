"""apply_activation_checkpointing: what each decoder layer keeps for backward
(`training.activation_checkpointing`, on the model's first `activation_checkpointing_layers`
layers, all by default).

Backward needs tensors saved by forward; at seq 2048 they, not the weights, fill the GPU.
- "full" (Chen et al. 2016): keep only each layer's input (B, T, C); backward re-runs the
  layer's forward first. Costs one extra forward, about a third more compute.
- "selective" (after Korthikanti et al. 2022): keep what is expensive to recompute, the
  outputs of the matmuls and of the attention kernel (with its log-sum-exp), and recompute
  what is cheap: norms, RoPE, SwiGLU, residual adds, casts: memory-bound passes of a few
  microseconds each. Megatron's selective recomputes the attention core because its
  (T, T) scores are the largest tensor; a fused attention kernel never stores them, so here
  the cheap pointwise ops are what is left to drop. Costs a few percent of time and saves
  the norms' fp32 and bf16 outputs, RoPE's rotated q/k and SwiGLU's silu and product.
  With model.kernels="triton" the norms, RoPE and SwiGLU are our own autograd functions,
  which already keep only their inputs; what is left to drop is the SwiGLU output that the
  down projection keeps. There "selective" does not use torch's checkpoint at all: the MLP runs
  swiglu_linear (speed/kernels/triton_swiglu.py), which recomputes that output inside its own
  backward (`TritonMLP.recompute_swiglu`). Under distributed.tp_comm_overlap with
  model.kernels="torch", torch's checkpoint keeps the outputs of mm, not of the ring's batched GEMMs
  (tensor_parallel/overlap.py), so backward recomputes the rings' GEMMs and transfers
  (correct, slower).
Both use PyTorch's non-reentrant checkpoint, which recomputes the same kernels on the same
inputs, so losses and gradients are bitwise those of "none" (tests/test_speed.py).

Applied by replacing a layer's `forward` on the instance with one that runs the class's
forward under torch's checkpoint: names, parameters and hooks stay, and the model never
hears of it. Apply it after speed/kernels/swap.py, whose class swap it must see.
"""
from functools import partial

import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

aten = torch.ops.aten
# Saved by "selective": matrix products and fused attention (every backend's op name).
_SAVED_OPS = {aten.mm.default, aten.addmm.default, aten._scaled_mm.default}   # FP8: fp8/linear.py
for _name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
    if hasattr(aten, _name):
        _SAVED_OPS.add(getattr(aten, _name).default)


def _selective_policy(ctx, op, *args, **kwargs):
    return (CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def checkpointed(layer, mode: str, *inputs):
    """layer(*inputs), keeping for backward what `mode` ("full" or "selective") says.
    Without autograd (validation) nothing is kept anyway: the layer just runs."""
    if not torch.is_grad_enabled():
        return layer(*inputs)
    if mode == "full":
        return checkpoint(layer, *inputs, use_reentrant=False)
    if mode == "selective":
        return checkpoint(layer, *inputs, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts,
                                             _selective_policy))
    raise ValueError(f"activation checkpointing mode '{mode}' is not none/full/selective")


def apply_activation_checkpointing(model, config):
    """Checkpoint the model's first N layers this rank holds (N = activation_checkpointing_layers,
    all when null), in place."""
    t = config.training
    mode, n = t.activation_checkpointing, t.activation_checkpointing_layers
    if mode == "none":
        return model
    for key, layer in model.layers.items():
        if n is not None and int(key) >= n:
            continue
        if mode == "selective" and hasattr(layer.mlp, "recompute_swiglu"):   # TritonMLP
            layer.mlp.recompute_swiglu = True
            continue
        # the class's forward, bound to this layer, run under checkpoint by the instance's
        layer.forward = partial(checkpointed, type(layer).forward.__get__(layer), mode)
    return model
