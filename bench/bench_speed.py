"""The speed benchmark: picotron's train.py path against Hugging Face loops, in one call.

    python bench/bench_speed.py [--shapes SmolLM-360M,SmolLM-1.7B] [--rows LABELS] [--out DIR]

For each shape, seq 2048, micro-batch 16, bf16 parameters, fused AdamW, no accumulation,
synthetic tokens (the same windows for every run), it times:
- ours: train.py's own build_training and train_step, as its loop calls them, with the fast
  options of each row ("ours auto": no option set, what a run gets on a GPU; "ours
  defaults": what "auto" picks for the kernels, loss and recomputation, with the layers
  eager (no CUDA graphs) and in bf16 (no FP8); "ours plain": the readable reference;
  "ours triton": model.kernels=triton, our kernels and fused projections; "ours liger":
  liger's kernels; both with liger's fused linear cross-entropy and the one-pass Triton
  AdamW; "our-loss": training.fused_loss=triton, ours, which never waits for the GPU;
  "graphs": training.cuda_graphs on top; "selective": training.activation_checkpointing=selective,
  which with our kernels recomputes the SwiGLU output; a label ending in " chunk1024" sets
  training.loss_chunk_tokens, one in " full-ckpt" (any row: "hf+liger full-ckpt", "ours auto
  full-ckpt") recomputes every layer in backward, one in " cat" concatenates the fused
  projections' weights each step instead of using them in place; "<row> fp8 tensorwise"
  runs that row with FP8 GEMMs, training.fp8). As in train.py, a step's loss is read once
  the next step is queued (picotron.utils.StepValues); the "item" row reads it at once, as HF does;
- hf: transformers' LlamaForCausalLM (SDPA), a plain loop: loss, backward, clip, AdamW
  (fused, bf16 moments on bf16 parameters);
- hf+liger: the same after `apply_liger_kernel_to_llama()` (RMSNorm, RoPE, SwiGLU, fused
  linear cross-entropy);
- floor: a step of the shape's matmuls and attention alone (bench/matmul_floor.py), the
  tokens/s no work outside cuBLAS and cuDNN can beat; "floor fp8": the same with the
  projections' GEMMs in FP8 as the default runs them, the floor of the FP8 path.
Each row runs in its own process (nothing left over from the row before; liger's patch of
the Llama module stays in its row). tokens/s is the median over the timed steps,
MFU = tokens/s x (6N + 12*L*C*T) / 989.5e12 (picotron/utils.py), peak memory is torch's
max_memory_allocated and "held" its max_memory_reserved (a CUDA graph's pool counts as
allocated only while it is captured, as reserved throughout), the SM clock and power
nvidia-smi's medians over the timed steps
(bench/gpu_clock.py: the GPU slows down at its power limit). --largest_batch LABELS then
searches those rows' largest micro-batch, with and without full checkpointing
(bench/largest_batch.py, which also runs alone). Output: stdout and DIR/bench_speed.txt.
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from picotron.config import config_from_dict  # noqa: E402
from picotron.data.windows import StepBatches, SyntheticData  # noqa: E402
from picotron.process_group_manager import ProcessGroupManager  # noqa: E402
from picotron.speed.fp8.layers import fp8_step_values  # noqa: E402
from picotron.utils import StepValues, count_params, flops_per_token  # noqa: E402
from bench_config import base_config, cached_materialize, shape_model  # noqa: E402,F401
from gpu_clock import ClockSampler  # noqa: E402
from matmul_floor import floor_runner  # noqa: E402

PEAK = 989.5e12
# label: (master_weights, kernels, fused_loss, compile, checkpointing, attn_implementation)
OURS = {"ours auto": (False, "auto", "auto", False, "auto", "sdpa"),
        "ours defaults": (False, "auto", "auto", False, "auto", "sdpa"),
        "ours defaults fp32-master": (True, "auto", "auto", False, "auto", "sdpa"),
        "ours plain": (False, "torch", "none", False, "none", "sdpa"),
        "ours liger": (False, "liger", "liger", False, "none", "sdpa"),
        "ours liger fp32-master": (True, "liger", "liger", False, "none", "sdpa"),
        "ours triton": (False, "triton", "liger", False, "none", "sdpa"),
        "ours triton fp32-master": (True, "triton", "liger", False, "none", "sdpa"),
        "ours triton our-loss": (False, "triton", "triton", False, "none", "sdpa"),
        "ours triton our-loss item": (False, "triton", "triton", False, "none", "sdpa"),
        "ours triton our-loss fp32-master": (True, "triton", "triton", False, "none", "sdpa"),
        "ours triton our-loss graphs": (False, "triton", "triton", False, "none", "sdpa"),
        "ours triton our-loss selective": (False, "triton", "triton", False, "selective", "sdpa"),
        "ours triton our-loss selective graphs": (False, "triton", "triton", False, "selective",
                                                  "sdpa"),
        "ours triton our-loss selective fp32-master": (True, "triton", "triton", False,
                                                       "selective", "sdpa"),
        "ours triton graphs": (False, "triton", "liger", False, "none", "sdpa"),
        "ours triton compile": (False, "triton", "liger", True, "none", "sdpa"),
        "ours triton full-ckpt": (False, "triton", "liger", False, "full", "sdpa"),
        "ours liger full-ckpt": (False, "liger", "liger", False, "full", "sdpa"),
        "ours compile+liger-loss": (False, "torch", "liger", True, "none", "sdpa"),
        "ours compile our-loss": (False, "torch", "triton", True, "none", "sdpa"),
        "ours compile our-loss selective": (False, "torch", "triton", True, "selective",
                                            "sdpa"),
        "ours chunked-loss selective": (False, "torch", "chunked", False, "selective", "sdpa")}
def ours_runner(shape, mbs, seq, master, kernels, fused_loss, compile_, ckpt, attn,
                graphs=False, read_now=False, chunk=0, fp8="none"):
    raw = base_config(shape, mbs, seq)
    raw["model"].update(kernels=kernels, attn_implementation=attn)
    raw["training"].update(master_weights=master, fused_loss=fused_loss, compile=compile_,
                           activation_checkpointing=ckpt, cuda_graphs=graphs,
                           loss_chunk_tokens=chunk, fp8=fp8)
    config = config_from_dict(raw, world_size=1)
    pgm, device = ProcessGroupManager(), torch.device("cuda")
    model, loss_fn, grads, optimizer = train.build_training(config, pgm, device)
    batches = StepBatches(SyntheticData(seq, config.model.vocab_size, 42), config, pgm, device)

    pending = []

    def step(i):        # the body of train.py's loop: queue step i, then read step i - 1
        loss = train.train_step(model, loss_fn, grads, batches, i, config, pgm, device, 1.0)
        grads.finish()
        optimizer.step(3e-4)
        grads.zero_grad()
        batches.prefetch(i + 1)
        if read_now:                    # the "item" rows: wait for this step's loss
            return loss.item()
        # with the roll and its saturation counts, as train.py's queue_step reads them
        pending.append(StepValues({"loss": loss, **fp8_step_values(model)}, device))
        return pending.pop(0).read()["loss"] if len(pending) == 2 else float("nan")
    return step, config


def hf_runner(shape, mbs, seq, liger, ckpt):
    from transformers import LlamaConfig, LlamaForCausalLM
    if liger:           # patches the Llama module: this process runs one row only
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    m = shape_model(shape, seq)
    cfg = LlamaConfig(**{k: v for k, v in m.items() if k != "name"},
                      attn_implementation="sdpa", use_cache=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if ckpt:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    data = SyntheticData(seq, m["vocab_size"], 42)

    def step(i):
        w = torch.stack([data.window(i * mbs + b) for b in range(mbs)]).cuda()
        # HF shifts the labels itself: labels = inputs, T-1 predictions per sequence
        loss = model(input_ids=w[:, :-1], labels=w[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step, None


def measure(make, warmup, steps, mbs, seq):
    """(tokens/s median, peak GB, last loss, SM clock and power over the timed steps, peak
    reserved GB), or a string naming the error."""
    torch.cuda.reset_peak_memory_stats()
    try:
        step, _ = make()
        times, clock = [], ClockSampler()
        for i in range(warmup + steps):
            clock = clock.start() if i == warmup else clock
            start = time.perf_counter()
            loss = step(i)                      # .item() waits for the device
            times.append(time.perf_counter() - start)
        result = (mbs * seq / statistics.median(times[warmup:]),
                  torch.cuda.max_memory_allocated() / 2 ** 30, loss, clock.stop(),
                  torch.cuda.max_memory_reserved() / 2 ** 30)
    except torch.OutOfMemoryError:
        result = "OOM"
    except Exception as e:      # one broken row must not end the call
        result = f"ERROR {type(e).__name__}: {str(e)[:200]}"
    step = None                 # free the model, its gradients and optimizer state
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def run_one(args, label, shape, mbs):
    """One row in a fresh process (no memory left over from the last row, no liger patch
    leaking into a plain HF row): (tokens/s, peak GB, loss) or a string naming the error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", label, "--shapes", shape,
           "--mbs", str(mbs), "--seq", str(args.seq), "--warmup", str(args.warmup),
           "--steps", str(args.steps)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return "TIMEOUT"
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not found:
        return f"CRASH rc={proc.returncode}: {proc.stderr.strip()[-300:]}"
    r = json.loads(found[-1][7:])
    return tuple(r) if isinstance(r, list) else r


def maker(label, shape, mbs, seq, ckpt=None):
    """A function that builds the row's step function (in this process, on the GPU) and
    returns it with the row's config (None for the rows that are not ours).
    ckpt: activation checkpointing other than the row's own ("full" or "none")."""
    if label.endswith(" cat"):            # fused weights concatenated each step, as before
        from picotron.speed.kernels import fused_linear
        fused_linear.stacked = lambda weights: torch.cat(weights, dim=0)
        label = label[:-len(" cat")]
    chunk, fp8 = 0, "none"
    if label.endswith(" full-ckpt") and label not in OURS:    # "hf+liger full-ckpt", ...
        label, ckpt = label[:-len(" full-ckpt")], "full"
    if " fp8 " in label:                  # "<row> fp8 tensorwise": that row with FP8 GEMMs
        label, fp8 = label.split(" fp8 ")
    if label.rpartition(" ")[2].startswith("chunk"):     # "<row> chunk1024": loss_chunk_tokens
        label, chunk = label.rpartition(" ")[0], int(label.rpartition(" chunk")[2])
    if label in ("floor", "floor fp8"):        # "floor fp8": the projections' GEMMs in FP8
        return lambda: floor_runner(config_from_dict(base_config(shape, mbs, seq)).model, mbs, seq,
                                    fp8=label == "floor fp8")
    if label.startswith("ours"):
        o = OURS[label]
        graphs = label.endswith("graphs") and (ckpt or o[4]) != "full"
        if label == "ours auto":                     # training.cuda_graphs and fp8 too
            graphs, fp8 = "auto", "auto"
        return lambda: ours_runner(shape, mbs, seq, *o[:4], ckpt or o[4], o[5], graphs,
                                   label.endswith(" item"), chunk, fp8)
    return lambda: hf_runner(shape, mbs, seq, label == "hf+liger", ckpt == "full")


def child(args):
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    train.materialize = cached_materialize
    make = maker(args.one, args.shapes, args.mbs, args.seq)
    print("RESULT " + json.dumps(measure(make, args.warmup, args.steps, args.mbs, args.seq)))


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="SmolLM-360M,SmolLM-1.7B", help="presets (%(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per row (default: 6)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all rows, alternating; "
                   "the ratio is the median of the rounds' ratios (default: 1)")
    p.add_argument("--rows", default="", help="comma-separated labels to time (default: all: "
                   f"{', '.join(OURS)}, hf, hf+liger; floor and floor fp8 when asked)")
    p.add_argument("--largest_batch", default="", help="comma-separated labels: also search "
                   "their largest micro-batch, with and without checkpointing")
    p.add_argument("--deadline_s", type=float, default=1e9, help="start no row after N s")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder of bench_speed.txt (default: $OUT, else the current folder)")
    p.add_argument("--one", help=argparse.SUPPRESS)      # child: run this one row
    args = p.parse_args()
    if args.one:
        return child(args)
    deadline = time.time() + args.deadline_s
    lines = [f"torch {torch.__version__}, seq {args.seq}, mbs {args.mbs}, bf16 params, "
             f"fused AdamW, each row in its own process"]

    def emit(text):
        print(text, flush=True)
        lines.append(text)
    for shape in args.shapes.split(","):
        mcfg = config_from_dict(base_config(shape, args.mbs, args.seq)).model
        fpt = flops_per_token(mcfg, args.seq)
        emit(f"\n== {shape}: N = {count_params(mcfg) / 1e6:.1f}M, {fpt / 1e9:.3f} GFLOP/token")
        labels = ([x for x in args.rows.split(",") if x] if args.rows
                  else list(OURS) + ["hf", "hf+liger"])
        runs = {label: [] for label in labels}      # label -> one result per round
        for round_ in range(args.repeats):          # rows alternate: drift hits all alike
            for label in labels:
                if time.time() > deadline:
                    emit(f"{label:38s} skipped (deadline)")
                    continue
                t0 = time.perf_counter()
                r = run_one(args, label, shape, args.mbs)
                if isinstance(r, str):
                    emit(f"{label:38s} {r}")
                    continue
                runs[label].append(r)
                emit(f"{label:38s} {r[0]:>9,.0f} tok/s  MFU {100 * r[0] * fpt / PEAK:5.1f}%  "
                     f"peak {r[1]:6.1f} GB  held {r[4]:6.1f} GB  loss {r[2]:.3f}  {r[3]}  "
                     f"({time.perf_counter() - t0:.0f} s)")
        ref = runs.get("hf+liger")
        for label, rs in runs.items():
            if not (ref and rs and len(rs) == len(ref)):
                continue
            ratios = sorted(r[0] / h[0] for r, h in zip(rs, ref))   # within each round
            spread = f" (rounds: {', '.join(f'{x:.3f}' for x in ratios)})" if len(rs) > 1 else ""
            emit(f"  {label:36s} {statistics.median(ratios):.2f}x HF+Liger tokens/s{spread}, "
                 f"{max(r[1] for r in rs) / max(h[1] for h in ref):.2f}x its peak memory, "
                 f"{max(r[4] for r in rs) / max(h[4] for h in ref):.2f}x its held")
    if args.largest_batch:          # after every shape's table: the costly part
        import largest_batch
        emit("")
        largest_batch.report(args.shapes, args.largest_batch, args.seq, 256, emit)
    with open(os.path.join(args.out, "bench_speed.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
