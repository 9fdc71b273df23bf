"""The memory-traffic floor of one training step, by profile category: the bytes our kernels
read and write per optimizer step, counted from their loads and stores as they are written,
and the time that takes at a given bandwidth.

    python bench/traffic_floor.py [--shapes SmolLM-360M,SmolLM-1.7B] [--mbs 16] [--seq 2048]
                                  [--bandwidth 4.0e12]

The categories are bench/profile_step.py's (the matmuls and attention are left out: they are
bound by FLOPs, bench/matmul_floor.py gives their floor). Next to a profile, a category near
its floor can only get faster by moving fewer bytes; one far above it has slack in its kernels.
The path counted is what a run with no flag takes on an H100/H200 at large width: our Triton
kernels with fused q/k/v and gate/up projections, the Triton loss, "selective" recomputation
(the SwiGLU output recomputed in backward), delayed-scaled FP8 GEMMs, fp32 master weights and
AdamW moments for bf16 parameters, bf16 gradient buffers (one micro-batch, one GPU); CUDA graphs
where "auto" takes them (below hidden size 2048). bf16 GEMMs (training.fp8="none") and bf16
moments (master_weights=false, as bench_speed.py's "ours auto" row runs) are counted too.

Symbols (each formula is a Python expression in them, evaluated as written and printed
without its '*'s):
    N tokens a micro-batch (B*T)    C hidden size     D head dim      I MLP width
    W = C + 2*K*D, the fused q/k/v width (K key/value heads)         V vocabulary
    L layers    P parameters (a tied embedding once)
    R the norm backward's programs: 16 warps an SM in programs of its tile's warps
        (triton_norms.py's _tile: 4 of 4 warps up to C = 4096), at most one a row block
    X = L*C*(W + C + 3*I), the projections' parameters: the weights cast to FP8 each step
Counted: the steady state (the first FP8 step calibrates), every pass a kernel makes over a
tensor from memory (the loss kernel's second read of a row may come from L2). Not counted: the
embedding backward's partial sums and scattered rows (10 bytes a distinct token and feature:
they depend on the tokens) and its index sort; what is a few bytes a token or a site outside
the kernels counted (the token count, the batches' copies to the GPU, the FP8 amaxes' roll).
"""
import argparse
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

from bench_config import base_config  # noqa: E402
from picotron.config import config_from_dict  # noqa: E402
from picotron.speed.kernels.triton_norms import _tile  # noqa: E402
from picotron.utils import count_params  # noqa: E402

BANDWIDTH = 4.0e12      # B/s: an H200's practical HBM rate (its copy kernels reach 4.1-4.2e12)
SMS = 132               # streaming multiprocessors of an H100 SXM or an H200


def no_flag_config(shape, mbs, seq):
    """A run with no flag on an H100/H200, on any machine: "auto" takes our kernels, loss and
    recomputation wherever the config says GPU; FP8, which "auto" takes only on a GPU with FP8
    tensor cores, is named. SDPA attention, as the bench rows run it."""
    raw = base_config(shape, mbs, seq)
    raw["model"]["attn_implementation"] = "sdpa"
    raw["training"]["fp8"] = "tensorwise_delayed"
    return config_from_dict(raw, world_size=1)


def off_path(config) -> list:
    """What in `config` differs from the path counted here ([] when nothing does)."""
    m, t, d = config.model, config.training, config.distributed
    counted = [("model.kernels", m.kernels, "triton"), ("model.norm_type", m.norm_type, "rmsnorm"),
               ("model.parallel_residual", m.parallel_residual, False),
               ("training.dtype", t.dtype, "bfloat16"),
               ("training.fused_loss", t.fused_loss, "triton"),
               ("training.activation_checkpointing", t.activation_checkpointing, "selective"),
               ("training.compile", t.compile, False),
               ("training.use_fused_adam", t.use_fused_adam, True),
               ("training.gradient_accumulation_steps", t.gradient_accumulation_steps, 1),
               ("dp*tp*pp*cp", d.dp_size * d.tp_size * d.pp_size * d.cp_size, 1)]
    problems = [f"{key}={value!r} (counted: {want!r})" for key, value, want in counted
                if value != want]
    if t.fp8 not in ("tensorwise_delayed", "none"):
        problems.append(f"training.fp8={t.fp8!r} (counted: 'tensorwise_delayed' or 'none')")
    recomputing = t.activation_checkpointing_layers
    if recomputing is not None and recomputing < m.num_hidden_layers:
        problems.append(f"training.activation_checkpointing_layers="
                        f"{t.activation_checkpointing_layers} (counted: every layer)")
    return problems


def symbols(config) -> dict:
    """The symbols' values for `config` (module docstring)."""
    m, t = config.model, config.training
    D = m.hidden_size // m.num_attention_heads
    s = dict(N=t.micro_batch_size * t.seq_length, C=m.hidden_size, D=D,
             W=m.hidden_size + 2 * m.num_key_value_heads * D, I=m.intermediate_size,
             V=m.vocab_size, L=m.num_hidden_layers, P=count_params(m))
    _, rows, warps = _tile(m.hidden_size, backward=True)     # as triton_norms._programs
    s["R"] = min(max(1, 16 // warps) * SMS, -(-s["N"] // rows))
    s["X"] = s["L"] * s["C"] * (s["W"] + s["C"] + 3 * s["I"])
    return s


def traffic_floor(config) -> dict:
    """{profile category: (bytes per optimizer step, formula)} for the path in the module
    docstring; a ValueError names what of `config` is not that path. The comments below say
    which kernel makes each pass and what it reads and writes (bf16: 2 bytes a value, fp32 4,
    FP8 1)."""
    problems = off_path(config)
    if problems:
        raise ValueError("the traffic floor counts another path: " + "; ".join(problems))
    t = config.training
    fp8 = t.fp8 == "tensorwise_delayed"
    terms = defaultdict(list)

    def count(category, formula):
        terms[category].append(formula)

    # optimizer: the grad norm (_foreach_norm) reads every bf16 gradient (2 bytes); the AdamW
    # kernel (triton_adamw.py) reads it again (2) and, with fp32 masters, reads and writes
    # the master and both moments (24) and writes the bf16 weight (2): 30 bytes a parameter;
    # without them it reads and writes the bf16 weight and moments (12): 16.
    count("optimizer", "2*P")
    count("optimizer", "28*P" if t.master_weights else "14*P")
    # swiglu, per layer: the recomputing SwiGLU + down projection's two kernels. FP8
    # (fp8/delayed_swiglu.py): forward reads gu (N, 2I) bf16 and writes h_q (N, I) FP8;
    # backward reads dh (N, I) bf16 and gu, writes d(gu)_q, d(gu)_q^T (N, 2I) and h^T_q (I, N).
    # bf16 (speed/kernels/triton_swiglu.py): forward reads gu and writes h (N, I) bf16;
    # backward reads dh and gu, writes d(gu) over gu and h over dh.
    count("swiglu", "L*(5*N*I + 11*N*I)" if fp8 else "L*(6*N*I + 12*N*I)")
    # norms (triton_norms.py), per layer: the input norm forward reads x, writes y and an fp32
    # rstd a row (4NC + 4N); the MLP's add-norm reads x and attn, writes s and y (8NC + 4N).
    # Backward: the add-norm reads s, dy, ds and rstd, writes dx (8NC + 4N); the input norm
    # reads x, dy and rstd, writes dx (6NC + 4N); each writes R fp32 rows of partial weight
    # gradients (4RC). Then the final norm, forward and backward (10NC + 8N + 4RC).
    count("norms", "L*(26*N*C + 16*N + 8*R*C) + 10*N*C + 8*N + 4*R*C")
    # rope (triton_rope.py), per layer: forward reads the packed qkv (N, W) and cos, sin
    # (N, D) bf16 each, writes q, k, v (N, W); backward the same from dq, dk, dv to d(qkv)
    count("rope", "L*(8*N*W + 8*N*D)")
    if fp8:
        # fp8 casts (fp8/cast.py's _cast, delayed: no amax pass): each reads bf16 (N, K) and
        # writes q and q^T in FP8 (4 bytes a value): forward x of q/k/v, o and gate/up (K = C),
        # backward dy of down and o (C) and of q/k/v (W); gate/up's dy comes cast from the
        # SwiGLU backward. Per step, each projection weight (weights.py): an amax pass, then
        # a cast writing W_q and W^T_q (6 bytes a parameter).
        count("fp8 casts, amaxes", "L*(20*N*C + 4*N*W) + 6*X")
    # loss (triton_loss.py): _cross_entropy_rows reads each row of logits (V bf16) twice
    # (logsumexp, then the gradient) and writes the gradient over it, with its target and
    # loss (12 bytes a row); backward's _scale reads and writes grad_hidden (N, C).
    count("loss", "6*N*V + 12*N + 4*N*C")
    # adds (torch): per layer the forward's residual add x + mlp (reads 2, writes 1 (N, C)) and
    # in backward the sum of the layer input's two gradients (the input norm's and the
    # add-norm's); with a tied embedding, the sum of the head's and the embedding's (V, C).
    count("adds", "12*L*N*C")
    if config.model.tie_word_embeddings:
        count("adds", "6*V*C")
    # copy/cat: each bf16 gradient copied into its bucket (data_parallel/buckets.py, 4 bytes a
    # parameter); the head's fp32 gradient to bf16 (speed/kernels/triton_loss.py, 6VC); the
    # RoPE tables (model.rope_cos_sin): positions to fp32 (12N), the angles' two halves
    # concatenated (6ND: D/2 and D/2 fp32 in, D out), cos and sin to bf16 (12ND)
    count("copy/cat", "4*P + 6*V*C + 12*N + 18*N*D")
    if t.cuda_graphs is True:   # the graphed layers' static inputs x, cos, sin and their
        count("copy/cat", "8*N*C + 8*N*D")  # output's gradient, copied in (cuda_graphs.py)
    # reduction: each norm's R partial weight-gradient rows summed (dw.sum(0)), then made bf16
    count("reduction", "(2*L + 1)*(4*R*C + 10*C)")
    # elementwise (torch): zero fills of the loss's fp32 head gradient (4VC) and of the
    # embedding's bf16 gradient (2VC), the head gradient times 1 / count (8VC); the RoPE
    # tables: angles (4N + 2ND: D/2 fp32 a token), cos and sin in fp32 (8ND each)
    count("elementwise", "14*V*C + 4*N + 18*N*D")
    # embedding: forward gathers rows of the (V, C) table (reads ids 8N and rows, writes
    # (N, C)); backward reads dy (N, C)
    count("embedding", "6*N*C + 8*N")
    values = symbols(config)
    floors = {}
    for category, formulas in terms.items():
        formula = " + ".join(formulas)
        floors[category] = (eval(formula, {"__builtins__": {}}, values),
                            formula.replace("*", ""))
    return floors


def main():
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="SmolLM-360M,SmolLM-1.7B",
                   help="model presets, comma-separated; NAME@L keeps L layers "
                        "(default: %(default)s)")
    p.add_argument("--mbs", type=int, default=16, help="micro-batch size (default: 16)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    p.add_argument("--bandwidth", type=float, default=BANDWIDTH,
                   help="bytes per second the floor's time assumes (default: %(default).2g)")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        config = no_flag_config(shape, args.mbs, args.seq)
        t, s = config.training, symbols(config)
        print(f"\n== {shape}, mbs {args.mbs}, seq {args.seq}: fp8 {t.fp8}, master weights "
              f"{t.master_weights}, CUDA graphs {t.cuda_graphs}, at {args.bandwidth:.3g} B/s")
        print("   " + "  ".join(f"{k}={v:,}" for k, v in s.items()))
        print(f"{'category':20s} {'GB/step':>8s} {'ms':>7s}  formula (bytes)")
        floors = traffic_floor(config)
        for category, (nbytes, formula) in floors.items():
            print(f"{category:20s} {nbytes / 1e9:8.2f} {nbytes / args.bandwidth * 1e3:7.2f}  "
                  f"{formula}")
        total = sum(nbytes for nbytes, _ in floors.values())
        print(f"{'total':20s} {total / 1e9:8.2f} {total / args.bandwidth * 1e3:7.2f}")


if __name__ == "__main__":
    main()
