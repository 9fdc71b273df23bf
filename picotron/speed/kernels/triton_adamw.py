"""AdamW in one Triton kernel per flat shard: unscale, clip, moments, update and cast in one pass.

`training.use_fused_adam` on a GPU. The readable reference is torch.optim.AdamW (foreach), which
picotron/data_parallel/optimizer.py uses everywhere else (CPU, offloaded shards); the test
(tests/test_triton_adamw.py) checks this kernel against it step by step.

Why our own: the optimizer runs on flat fp32 gradient shards (GradBuckets) and, by precision
regime, bf16 or fp32 weights and moments. With torch's fused AdamW each step took five passes
over every gradient: clip (x clip/scale, in place), cast fp32 -> parameter dtype, AdamW, and with
fp32 master weights a copy back into the bf16 parameters. Bytes per parameter, bf16 weights:

    torch: clip 8 + cast 6 + AdamW 14 (bf16 moments) = 28;  fp32 master: 8 + 0 + 24 + 6 = 38
    here:  grad 4 + moments 2x(2+2) + weight 2+2 = 16;      fp32 master: 4 + 16 + 8 + 2 = 30

The clip factor and the loss scale arrive as a device scalar, so the step needs no host sync;
a non-finite gradient norm sets `skip`, and the kernel then writes nothing (the step is skipped
on the device, as torch's fused optimizers do with `found_inf`). A skipped step must not count
either, or every later bias correction would use t + 1: so the step count t is a device tensor
too, advanced by (1 - skip), and the kernel computes the bias corrections from it.

Math (Loshchilov & Hutter 2019, torch's order), per element, in fp32:
    g = grad * grad_mul;  w = w * (1 - lr * wd)
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    w = w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(weight_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, scalars_ptr,
                  step_ptr, n, lr, beta1, beta2, log2_beta1: "fp64", log2_beta2: "fp64", eps,
                  decay, HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    grad_mul = tl.load(scalars_ptr)              # clip / loss scale
    skip = tl.load(scalars_ptr + 1)              # 1.0 when the norm is not finite
    mask = offsets < tl.where(skip == 0.0, n, 0)   # a skipped step touches nothing
    # Bias corrections from the device step count (this step included), in fp64 like torch's
    # host-side floats: 1 - b2^t cancels (0.05 at t = 1), where fp32 rounding (and the GPU's
    # approximate exp2) would reach ~1e-6 relative, the fp32 test's whole tolerance. A skip on
    # the very first step leaves t = 0: nothing is written, and max(t, 1) keeps these finite.
    t = tl.maximum(tl.load(step_ptr).to(tl.float64), 1.0)
    step_size = (lr / (1.0 - tl.exp2(t * log2_beta1))).to(tl.float32)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(t * log2_beta2)).to(tl.float32)
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * grad_mul
    source = master_ptr if HAS_MASTER else weight_ptr
    w = tl.load(source + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    w = w * (1.0 - lr * decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(exp_avg_ptr + offsets, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offsets, w, mask=mask)
    tl.store(weight_ptr + offsets, w.to(weight_ptr.dtype.element_ty), mask=mask)


BLOCK = 2048


def adamw_step(optimizer: torch.optim.AdamW, grads: dict, weights: dict, scalars):
    """One AdamW step of every tensor in `optimizer`'s groups, in place.

    optimizer: a torch AdamW used as the holder of groups (lr, betas, eps, weight_decay) and
        state (exp_avg, exp_avg_sq, step), in the layout torch uses, so checkpoints and
        `state_dict` work unchanged; its own step() is not called. "step" is a 0-dim fp32
        tensor on the tensor's device (as torch keeps it when fused or capturable).
    grads: {master: flat gradient (fp32)}; weights: {master: the parameter shard to write,
        when master is a separate fp32 copy}; scalars: fp32 (2,) on the device,
        [grad multiplier, skip flag]."""
    tensors = []
    for group in optimizer.param_groups:
        for master in group["params"]:
            state = optimizer.state[master]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
                state["exp_avg"] = torch.zeros_like(master)
                state["exp_avg_sq"] = torch.zeros_like(master)
            if state["step"].device != master.device:    # a checkpoint load left it on the CPU
                state["step"] = state["step"].to(master.device, torch.float32)
            tensors.append((group, master, state))
    # Each tensor's own count advances by 1 - skip (0 on a skipped step), on the device: no
    # sync. Before the kernels, on the same stream, so every block of every kernel reads this
    # step's t; one launch for all the counts. (A list of tensors, as torch's fused AdamW
    # passes found_inf: the overload taking one tensor reads it on the host, a sync.)
    counts = 1.0 - scalars[1]
    torch._foreach_add_([state["step"] for _, _, state in tensors], [counts] * len(tensors))
    for group, master, state in tensors:
        beta1, beta2 = group["betas"]
        weight = weights.get(master, master)
        n = master.numel()
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            weight, grads[master], state["exp_avg"], state["exp_avg_sq"], master, scalars,
            state["step"], n, group["lr"], beta1, beta2, math.log2(beta1), math.log2(beta2),
            group["eps"], group["weight_decay"],
            HAS_MASTER=weight is not master, BLOCK=BLOCK, num_warps=8)
