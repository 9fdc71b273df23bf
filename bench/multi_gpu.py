"""picotron on several GPUs over NCCL, checked and timed in one call.

    python bench/multi_gpu.py [--gpus N] [--parts parity,throughput] [--out DIR]
    python bench/multi_gpu.py --cpu --gpus 4 --parts parity     # the same runs on gloo CPU ranks

Runs train.py through torchrun, as a user would, for every layout that fits in N GPUs (default:
all the machine has; layouts needing more are listed as skipped), and one GPU in the same
call. Nothing here depends on N: the same command runs on 1, 2 or 8 GPUs.

1. parity: the `debug` model on the embedded corpus, 20 steps, the same global batch of 8
   micro-batches in every layout (dp x gradient accumulation = 8), fp32 and bf16, each
   compared with one GPU step by step. fp32 must agree to 1e-5 relative. bf16 has no exact
   answer, so its tolerance is measured in the same call: the largest loss difference between
   two one-GPU runs that differ only in how the batch is split (8 x 2 sequences vs 4 x 4); a
   layout passes within twice that (at least 1e-3).
2. throughput: bf16, seq 2048, synthetic tokens, the default ("auto") fast path on GPUs: tokens/s/GPU (median of the steps after the 3rd), MFU = tokens/s/GPU x (6N +
   12 L C T) / 989.5e12, which is also picotron's formula (its utils.get_mfu: 6 x params +
   12 x layers x heads x head_dim x seq), peak memory per GPU, and the scaling efficiency:
   tokens/s/GPU over the one-GPU run of the same shape. dp=2 runs with the bucketed
   all-reduce overlapping backward and without (distributed.overlap_grad_reduce=false): the
   difference is the time the overlap hides. tp=2 runs on the 1.7B shape: 360M's 15 query and
   5 kv heads cannot be split over 2 ranks. ZeRO-3 (parameters sharded, each layer gathered
   around its use) runs on the 1.7B shape against ZeRO-1 on the same GPUs, at dp2 and at one
   GPU (`--only zero`): tokens/s/GPU and peak memory per GPU. dp2 also runs with the
   gradients reduced in bf16 (distributed.grad_reduce_dtype) and at ZeRO-1/2; tp2 with
   sequence parallelism and its collectives overlapped with the GEMMs
   (distributed.tp_comm_overlap); "13B dp2" runs the Llama-2-13B shape at ZeRO-1 and ZeRO-3
   (`--only 13B`). Each row prints memory_plan's estimate beside the measured peak.
Everything goes to stdout and DIR/multi_gpu.txt; each run's metrics stay under DIR/runs.
"""
import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import create_config  # noqa: E402

# (name, world size, create_config flags): the 2-GPU rows, then the 8-GPU ones
PARITY = [("dp2", 2, ["--dp", "2"]), ("tp2-sp", 2, ["--tp", "2", "--set",
                                                    "distributed.sequence_parallel=true"]),
          ("tp2-sp-overlap", 2, ["--tp", "2", "--set", "distributed.sequence_parallel=true",
                                 "--set", "distributed.tp_comm_overlap=true"]),
          ("pp2-1f1b", 2, ["--pp", "2", "--pp_engine", "1f1b"]),
          ("pp2-interleaved", 2, ["--pp", "2", "--pp_engine", "interleaved"]),
          ("cp2", 2, ["--cp", "2"]),
          ("dp2-zero1", 2, ["--dp", "2", "--zero_stage", "1"]),     # gathers under forward
          ("dp2-zero2", 2, ["--dp", "2", "--zero_stage", "2"]),
          ("dp2-zero3", 2, ["--dp", "2", "--zero_stage", "3"]),
          ("dp2-zero3-keep", 2, ["--dp", "2", "--zero_stage", "3", "--set",
                                 "distributed.zero3_keep_params=true"]),
          ("2x2x2x1", 8, ["--dp", "2", "--tp", "2", "--pp", "2", "--zero_stage", "1"]),
          ("2x1x2x2", 8, ["--dp", "2", "--pp", "2", "--cp", "2"]),
          ("1x2x2x2", 8, ["--tp", "2", "--pp", "2", "--cp", "2"]),
          ("8x1x1x1", 8, ["--dp", "8", "--zero_stage", "1"])]
LLAMA_13B = ["--set", "model.num_hidden_layers=40", "--set", "model.hidden_size=5120",
             "--set", "model.intermediate_size=13824", "--set", "model.num_attention_heads=40",
             "--set", "model.num_key_value_heads=40",
             "--set", "training.activation_checkpointing=full",
             "--set", "training.master_weights=true"]     # fp32 master and moments
# (name, world size, model, micro-batch, seq, flags); world 1 rows are the baselines
THROUGHPUT = [
    ("360M 1 GPU", 1, "SmolLM-360M", 16, 2048, []),
    ("360M dp2 overlap", 2, "SmolLM-360M", 16, 2048, ["--dp", "2"]),
    ("360M dp2 no overlap", 2, "SmolLM-360M", 16, 2048,
     ["--dp", "2", "--set", "distributed.overlap_grad_reduce=false"]),
    # the gradients on the wire in bf16 (half the bytes; numbers within bf16's rounding), and
    # ZeRO-1/2, whose updated shards are all-gathered under the next forward
    ("360M dp2 bf16 reduce", 2, "SmolLM-360M", 16, 2048,
     ["--dp", "2", "--set", "distributed.grad_reduce_dtype=bfloat16"]),
    ("360M dp2 zero1", 2, "SmolLM-360M", 16, 2048, ["--dp", "2", "--zero_stage", "1"]),
    ("360M dp2 zero2", 2, "SmolLM-360M", 16, 2048, ["--dp", "2", "--zero_stage", "2"]),
    # 360M's 15 query / 5 kv heads do not split over tp=2 (the config refuses it): tp2 on 1.7B
    ("1.7B 1 GPU", 1, "SmolLM-1.7B", 16, 2048, []),
    ("1.7B tp2", 2, "SmolLM-1.7B", 16, 2048, ["--tp", "2"]),
    # sequence parallelism, then its all-gathers / reduce-scatters overlapped with the GEMMs
    ("1.7B tp2 sp", 2, "SmolLM-1.7B", 16, 2048,
     ["--tp", "2", "--set", "distributed.sequence_parallel=true"]),
    ("1.7B tp2 overlap", 2, "SmolLM-1.7B", 16, 2048,
     ["--tp", "2", "--set", "distributed.sequence_parallel=true",
      "--set", "distributed.tp_comm_overlap=true"]),
    # ZeRO-3 (parameters sharded, gathered layer by layer) against ZeRO-1 on the same GPUs;
    # at one GPU ZeRO-3 shards nothing: its row shows what the gathers and fp32 shards cost
    ("1.7B 1 GPU zero1", 1, "SmolLM-1.7B", 16, 2048, ["--zero_stage", "1"]),
    ("1.7B 1 GPU zero3", 1, "SmolLM-1.7B", 16, 2048, ["--zero_stage", "3"]),
    ("1.7B dp2 zero1", 2, "SmolLM-1.7B", 16, 2048, ["--dp", "2", "--zero_stage", "1"]),
    ("1.7B dp2 zero3", 2, "SmolLM-1.7B", 16, 2048, ["--dp", "2", "--zero_stage", "3"]),
    ("1.7B dp2 zero3 keep", 2, "SmolLM-1.7B", 16, 2048,
     ["--dp", "2", "--zero_stage", "3", "--set", "distributed.zero3_keep_params=true"]),
    # A model ZeRO-1 cannot hold at dp2 (the Llama-2-13B shape, full recomputation): the
    # estimate says ~146 GiB a GPU at ZeRO-1 and ~114 at ZeRO-3; the peak is measured beside it
    ("13B dp2 zero1", 2, "Llama-2-7B", 1, 4096, ["--dp", "2", "--zero_stage", "1"] + LLAMA_13B),
    ("13B dp2 zero3", 2, "Llama-2-7B", 1, 4096, ["--dp", "2", "--zero_stage", "3"] + LLAMA_13B),
    ("1.7B dp8 zero0", 8, "SmolLM-1.7B", 16, 2048, ["--dp", "8"]),
    ("1.7B dp8 zero1", 8, "SmolLM-1.7B", 16, 2048, ["--dp", "8", "--zero_stage", "1"]),
    ("1.7B dp4 tp2", 8, "SmolLM-1.7B", 16, 2048, ["--dp", "4", "--tp", "2"]),
    ("7B tp8", 8, "Llama-2-7B", 8, 2048, ["--tp", "8"]),
    ("7B dp2 tp2 pp2", 8, "Llama-2-7B", 4, 2048,
     ["--dp", "2", "--tp", "2", "--pp", "2", "--grad_acc_steps", "4"]),
    ("1.7B seq 32k cp8", 8, "SmolLM-1.7B", 1, 32768,
     ["--cp", "8", "--set", "model.max_position_embeddings=32768"]),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args, name, world, flags, timeout=900):
    """create_config.py + torchrun train.py; the run's metrics records, or an error string."""
    out = os.path.join(args.out, "runs")
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)   # an earlier call's run
    try:
        with contextlib.redirect_stdout(io.StringIO()):      # it prints the config's path
            path = create_config.main(["--out_dir", out, "--exp_name", name]
                                      + (["--use_cpu"] if args.cpu else []) + flags)
    except SystemExit:
        return "config refused (see the message above)"
    from picotron.config import load_config
    from picotron.plan.memory_plan import GiB, estimate
    estimate_gb = estimate(load_config(path, world)).device_bytes / GiB   # per GPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_port", str(free_port()), os.path.join(ROOT, "train.py"), "--config", path]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"TIMEOUT after {timeout} s"
    if proc.returncode != 0:       # the ranks' own error lines, not torchrun's summary
        with open(os.path.join(args.out, f"{name}.stderr.txt"), "w") as f:
            f.write(proc.stderr)                  # the whole story, next to multi_gpu.txt
        errors = [ln for ln in proc.stderr.splitlines()
                  if re.match(r"(\[rank\d+\]: )?[\w.]*(Error|Exception)\b", ln)
                  or ln.startswith("error")]
        return f"FAILED rc={proc.returncode} (estimate {estimate_gb:.1f} GiB/GPU): " + (
            "\n".join(dict.fromkeys(errors)) or proc.stderr.strip()[-600:])
    with open(os.path.join(os.path.dirname(path), "metrics.jsonl")) as f:   # null: not finite
        return [{**r, "loss": math.nan if r["loss"] is None else r["loss"],
                 "estimate_gb": estimate_gb}
                for r in map(json.loads, f) if "loss" in r]


def max_rel_diff(a, b):
    """The largest relative loss difference; NaN when a loss was not finite (a FAIL)."""
    diffs = [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b)]
    return max(diffs) if all(map(math.isfinite, diffs)) else math.nan


def devices(args, n: int) -> str:
    """'2 GPUs', or '2 CPU ranks' with --cpu: what a run needs or ran on."""
    return f"{n} {'CPU rank' if args.cpu else 'GPU'}{'s' if n != 1 else ''}"


def parity(args, emit):
    base = ["--model_name", "debug", "--total_train_steps", "20", "--seq_len", "64",
            "--set", "training.warmup_steps=2", "--set", "checkpoint.save_frequency=0",
            "--set", "checkpoint.save_final=false"]
    for dtype in args.dtypes.split(","):
        flags = base + ["--set", f"training.dtype={dtype}"]
        ref = train(args, f"ref-{dtype}", 1, flags + ["--mbs", "2", "--grad_acc_steps", "8"])
        if isinstance(ref, str):
            emit(f"parity {dtype}: reference on {devices(args, 1)}: {ref}")
            continue
        tol = 1e-5
        if dtype == "bfloat16":         # the noise of bf16 itself: another split of the batch
            other = train(args, "ref-bf16-4x4", 1, flags + ["--mbs", "4",
                                                            "--grad_acc_steps", "4"])
            noise = max_rel_diff(other, ref) if not isinstance(other, str) else float("nan")
            tol = max(2 * noise, 1e-3)
            emit(f"parity bf16: one GPU, 8x2 vs 4x4 split: max rel loss diff {noise:.2e} "
                 f"-> tolerance {tol:.2e}")
        for name, world, layout in PARITY:
            if world > args.gpus:
                emit(f"parity {dtype} {name:16s} skipped: needs {devices(args, world)}")
                continue
            dp = int(layout[layout.index("--dp") + 1]) if "--dp" in layout else 1
            run = train(args, f"{name}-{dtype}", world, flags + layout + [
                "--mbs", "2", "--grad_acc_steps", str(8 // dp)])
            if isinstance(run, str):
                emit(f"parity {dtype} {name:16s} {run}")
                continue
            diff = max_rel_diff(run, ref)
            emit(f"parity {dtype} {name:16s} 20 steps, max rel loss diff {diff:.2e} "
                 f"(tolerance {tol:.0e}): {'PASS' if diff <= tol else 'FAIL'}")


def throughput(args, emit):
    # the fast path is the default on GPUs ("auto": our kernels, our fused loss where the
    # layout has no tensor parallelism, selective recomputation); --fused_loss overrides it
    fast = ([] if args.fused_loss == "auto"
            else ["--set", f"training.fused_loss={args.fused_loss}"])
    per_gpu_1 = {}
    for name, world, model, mbs, seq, layout in THROUGHPUT:
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        if world > args.gpus:
            emit(f"{name:22s} skipped: needs {devices(args, world)}")
            continue
        if args.cpu:        # a dry run of the code path: the debug model, short sequences
            model, mbs, seq = "debug", 2, 64
        flags = ["--model_name", model, "--mbs", str(mbs), "--seq_len", str(seq),
                 "--dataset_name", "synthetic", "--total_train_steps", str(args.steps),
                 "--set", "training.dtype=bfloat16", "--set", "training.master_weights=false",
                 "--set", "training.fp8=none",      # the bf16 tables: auto picks FP8 at 1.7B
                 "--set", "training.cuda_graphs=false",    # and graphs on one GPU at 360M
                 "--set", "checkpoint.save_frequency=0",
                 "--set", "checkpoint.save_final=false"] + fast + layout
        run = train(args, name.replace(" ", "_"), world, flags)
        if isinstance(run, str):
            emit(f"{name:22s} {run}")
            continue
        steady = run[3:] or run
        tps = statistics.median(r["tokens_per_s_per_gpu"] for r in steady)
        mfu = statistics.median(r["mfu"] or 0.0 for r in steady)
        peak = max(r["peak_mem_gb"] for r in steady)
        if world == 1 and not layout:      # the plain one-GPU row is the baseline
            per_gpu_1[model] = tps
        scaling = tps / per_gpu_1[model] if model in per_gpu_1 else float("nan")
        per = "rank" if args.cpu else "GPU"
        emit(f"{name:22s} {devices(args, world)}  {tps:>9,.0f} tok/s/{per}  MFU "
             f"{100 * mfu:5.1f}%  peak {peak:6.1f} GB/{per} (estimate "
             f"{steady[0]['estimate_gb']:.1f} GiB)  scaling efficiency {scaling:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use, or CPU ranks with "
                   "--cpu; layouts that need more are skipped (default: every GPU of the "
                   "machine; 2 with --cpu)")
    p.add_argument("--parts", default="parity,throughput",
                   help="parity, throughput or both, comma-separated (default: both)")
    p.add_argument("--steps", type=int, default=10,
                   help="throughput: steps per run (default: 10)")
    p.add_argument("--fused_loss", default="auto", help="throughput: training.fused_loss "
                   "(auto: the default; refused with tp > 1 unless none or auto)")
    p.add_argument("--cpu", action="store_true", help="gloo CPU ranks instead of GPUs (a "
                   "dry run of the same code: the debug model, short sequences)")
    p.add_argument("--only", default="",
                   help="throughput: only the rows whose name contains one of these "
                   "comma-separated strings, e.g. 1.7B or '360M 1 GPU,360M dp2'")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="parity: training.dtype values, comma-separated (default: %(default)s)")
    p.add_argument("--out", default=os.environ.get("OUT", "multi_gpu_out"), help="folder of "
                   "multi_gpu.txt and the runs (default: $OUT, else multi_gpu_out)")
    args = p.parse_args()
    if args.gpus is None:
        import torch
        args.gpus = torch.cuda.device_count() if not args.cpu else 2
    shutil.rmtree(os.path.join(args.out, "runs"), ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    lines = []

    def emit(text):
        print(text, flush=True)
        lines.append(text)
    emit(f"{devices(args, args.gpus)}; parts: {args.parts}")
    for part in args.parts.split(","):
        {"parity": parity, "throughput": throughput}[part](args, emit)
    with open(os.path.join(args.out, "multi_gpu.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
