"""One device call: does training work on a GPU, and how fast is the plain path?

    python bench/gpu_smoke.py [--out DIR] [--skip_throughput]

1. `debug` for 300 steps on the embedded corpus in bf16 (the CPU test's settings), with the
   readable torch kernels and with model.kernels=triton: the loss must fall below the
   corpus's byte unigram entropy minus 0.3 nats, as on CPU.
2. The bf16 GPU logits of the initial `debug` model (torch and triton kernels) against the
   fp32 CPU ones (same weights: they are drawn on the CPU from the seed), relative L2 error.
3. Throughput of train.py on the SmolLM-360M and SmolLM-1.7B shapes, seq 2048, micro-batch 16,
   bf16, synthetic data, the readable torch kernels with the chunked loss (no liger needed):
   tokens/s, MFU = tokens/s x (6N + 12*L*C*T) / 989.5e12, peak memory (median over the steps
   after the first 5). bench/bench_speed.py is the full comparison against Hugging Face.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from picotron.config import Config, ModelConfig  # noqa: E402
from picotron.speed.kernels.swap import apply_kernels  # noqa: E402
from picotron.data.windows import embedded_corpus_bytes  # noqa: E402
from picotron.attention import sdpa_attention  # noqa: E402
from picotron.model import Decoder, materialize  # noqa: E402
from picotron.config.presets import resolve_model  # noqa: E402


def run(out_dir, name, flags):
    cfg = subprocess.run([sys.executable, os.path.join(ROOT, "create_config.py"), "--out_dir",
                          out_dir, "--exp_name", name] + flags, capture_output=True, text=True,
                         check=True).stdout.strip()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "1", os.path.join(ROOT, "train.py"), "--config", cfg],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:])
        return None
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:   # null: not finite
        return [{**r, "loss": float("nan") if r["loss"] is None else r["loss"]}
                for r in map(json.loads, f) if "loss" in r]


def unigram_entropy():
    p = torch.bincount(embedded_corpus_bytes().long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return -(p * p.log()).sum().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder of the runs' "
                        "configs and metrics (default: $OUT, else a new temporary folder)")
    parser.add_argument("--skip_throughput", action="store_true",
                        help="run parts 1 and 2 only (learning, logits), not the throughput")
    args = parser.parse_args()
    args.out = args.out or tempfile.mkdtemp()
    work = tempfile.mkdtemp()
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    summary = []

    # 1. learning on the GPU, on the readable path and on our Triton one
    threshold = unigram_entropy() - 0.3
    for kernels in ("torch", "triton"):
        records = run(work, f"learn_{kernels}", [
            "--total_train_steps", "300", "--mbs", "4", "--seq_len", "128", "--learning_rate",
            "1e-3", "--set", "training.warmup_steps=20", "--set", "logging.log_frequency=50",
            "--set", f"model.kernels={kernels}"])
        if records is None:
            summary.append(f"debug 300 steps, kernels={kernels}: FAILED")
            continue
        final = sum(r["loss"] for r in records[-20:]) / 20
        summary.append(
            f"debug 300 steps bf16 GPU, kernels={kernels}: first loss {records[0]['loss']:.4f}, "
            f"mean of last 20 {final:.4f} (threshold {threshold:.4f}: "
            f"{'PASS' if final < threshold else 'FAIL'}), median step "
            f"{statistics.median(r['step_time_s'] for r in records) * 1e3:.1f} ms")

    # 2. bf16 GPU logits (torch and triton kernels) against the fp32 CPU reference
    logits = {}
    for device, dtype, kernels in (("cpu", torch.float32, "torch"),
                                   ("cuda", torch.bfloat16, "torch"),
                                   ("cuda", torch.bfloat16, "triton")):
        with torch.device("meta"):
            model = Decoder(ModelConfig(**resolve_model("debug")), sdpa_attention)
        materialize(model, 42, device, dtype)
        apply_kernels(model, Config(model=ModelConfig(kernels=kernels)))   # as train.py does
        ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits[device, kernels] = model(ids.to(device)).float().cpu()
    ref = logits["cpu", "torch"]
    for kernels in ("torch", "triton"):
        err = ((logits["cuda", kernels] - ref).norm() / ref.norm()).item()
        summary.append(f"bf16 GPU (kernels={kernels}) vs fp32 CPU logits, debug init: relative "
                       f"L2 error {err:.2e} ({'PASS' if err < 1e-2 else 'FAIL'} at 1e-2: bf16 "
                       f"has 8 mantissa bits, ~4e-3 per rounding)")

    # 3. throughput of the plain path
    if not args.skip_throughput:
        for shape in ("SmolLM-360M", "SmolLM-1.7B"):
            recs = run(work, shape, ["--model_name", shape, "--mbs", "16", "--seq_len", "2048",
                                     "--total_train_steps", "12", "--dataset_name", "synthetic",
                                     "--set", "training.fused_loss=chunked",
                                     "--set", "training.master_weights=false"])
            if recs is None:
                summary.append(f"{shape}: FAILED")
                continue
            steady = recs[5:]
            tps = statistics.median(r["tokens_per_s"] for r in steady)
            mfu = statistics.median(r["mfu"] for r in steady)
            summary.append(f"{shape} seq 2048 mbs 16 bf16, torch kernels + chunked loss, bf16 "
                           f"AdamW states: {tps:,.0f} tokens/s, "
                           f"MFU {100 * mfu:.1f}%, peak {max(r['peak_mem_gb'] for r in recs):.1f} GB")
    text = "\n".join(summary)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_smoke.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
