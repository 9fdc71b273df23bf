"""The compute of one micro-batch on one rank, per layer and outside the layers, and of the
optimizer step: each GEMM from its FLOPs at an efficiency that depends on its shape,
attention from its FLOPs at an efficiency that grows with the sequence, and every other pass
from the bytes it moves (traffic.py) at the profile's bandwidth.

Shapes, one rank (legend: n tokens of the rank's micro-batch = B*T/cp, C hidden, I MLP
width, W = C + 2*K*D the q/k/v width, V vocabulary, tp the tensor-parallel shards):
    forward  q/k/v (n, C) x (C, W/tp)   o (n, C/tp) x (C/tp, C)
             gate/up (n, C) x (C, 2I/tp)   down (n, I/tp) x (I/tp, C)   head (n, C) x (C, V/tp)
    backward each (M, K) x (K, N) GEMM twice: the input's gradient (M, N) x (N, K) and the
             weight's (K, M) x (M, N)
A GEMM of sizes M, N, K reaches gemm_eff * g(M) g(N) g(K) of the peak, g(x) = x / (x + h),
h = gemm_half_dim: a skinny GEMM (one small side) is slow however large the others.
"""
from collections import namedtuple

from picotron.plan.traffic import evaluate, symbols, traffic_terms

# seconds of one micro-batch through one layer on one rank, by what does the work
LayerTime = namedtuple("LayerTime", "gemm_f attn_f other_f gemm_b attn_b other_b")
# the categories whose tensors sequence parallelism shards over tp (the norms' and adds'
# (n, C) activations); without it every tp rank holds them whole
SEQUENCE_SHARDED = ("norms", "adds", "reduction")


def _shape_eff(x, half):
    return x / (x + half)


def gemm_s(M, N, K, profile, fp8=False) -> float:
    """One (M, K) x (K, N) GEMM's seconds at its shape's efficiency."""
    peak, eff = ((profile["peak_fp8_flops"], profile["fp8_gemm_eff"]) if fp8 else
                 (profile["peak_bf16_flops"], profile["gemm_eff"]))
    h = profile["gemm_half_dim"]
    return 2 * M * N * K / (peak * eff * _shape_eff(M, h) * _shape_eff(N, h) * _shape_eff(K, h))


def forward_backward_gemm_s(M, N, K, profile, fp8=False):
    """(forward, backward) seconds of one projection: y = x W, then dx and dW."""
    return (gemm_s(M, N, K, profile, fp8),
            gemm_s(M, K, N, profile, fp8) + gemm_s(K, N, M, profile, fp8))


def local_sizes(config) -> dict:
    """The rank's n (tokens of a micro-batch), and its shards of W and I."""
    m, d, t = config.model, config.distributed, config.training
    s = symbols(config)
    return dict(n=t.micro_batch_size * t.seq_length // d.cp_size, C=s["C"],
                W=s["W"] // d.tp_size, I=s["I"] // d.tp_size, V=-(-s["V"] // d.tp_size),
                D=s["D"], heads=m.num_attention_heads // d.tp_size)


def attention_s(config, profile):
    """(forward, backward) seconds of one layer's attention on one rank: causal, so half of
    the 4*T*T*D FLOPs a sequence and head of the full square; backward 2.5x forward (flash
    attention's recomputation); efficiency grows with the length each kernel sees (T/cp)."""
    d, t = config.distributed, config.training
    z = local_sizes(config)
    T = t.seq_length
    flops = 4 * t.micro_batch_size * T * T * z["D"] * z["heads"] * 0.5 / d.cp_size
    block = T / d.cp_size
    eff = profile["attn_eff"] * block / (block + profile["attn_half_seq"])
    forward = flops / (profile["peak_bf16_flops"] * eff)
    return forward, 2.5 * forward


def _bytes_by_scope(config, profile) -> dict:
    """{scope: bytes of one micro-batch (one step for "step") on one rank}: the traffic
    counts at the rank's local sizes (tp-sharded widths, cp-sharded tokens, and the (n, C)
    tensors sharded over tp only under sequence parallelism), with the loss of the
    profile's trainer (trait loss_path)."""
    d = config.distributed
    values = symbols(config, tokens=local_sizes(config)["n"])
    values.update(W=values["W"] / d.tp_size, I=values["I"] / d.tp_size,
                  V=values["V"] / d.tp_size, X=values["X"] / d.tp_size)
    sharded = dict(values, N=values["N"] / d.tp_size)
    seq_parallel = d.sequence_parallel and d.tp_size > 1
    out = {}
    for category, scope, formula in traffic_terms(config,
                                                  profile.traits.get("loss_path", "picotron")):
        if scope == "step":
            continue                       # optimizer_s counts them per rank's parameters
        use = sharded if seq_parallel and category in SEQUENCE_SHARDED else values
        out[scope] = out.get(scope, 0.0) + evaluate(formula, use)
    return out


def layer_time(config, profile) -> LayerTime:
    """One micro-batch through one layer on one rank, forward and backward. Recomputation:
    "full" runs the layer's forward again in backward; "selective" recomputes the SwiGLU
    (counted in its traffic). FP8 GEMMs for the projections when training.fp8 is on."""
    t = config.training
    z = local_sizes(config)
    fp8 = t.fp8 != "none"
    n, C = z["n"], z["C"]
    # (M, N, K) of q/k/v, o, gate/up and down (module docstring)
    projections = [(n, z["W"], C), (n, C, C // config.distributed.tp_size),
                   (n, 2 * z["I"], C), (n, C, z["I"])]
    gemm_f = gemm_b = 0.0
    for M, N, K in projections:
        f, b = forward_backward_gemm_s(M, N, K, profile, fp8)
        gemm_f, gemm_b = gemm_f + f, gemm_b + b
    attn_f, attn_b = attention_s(config, profile)
    # the traffic counts a layer's forward and backward together: split them 1:2, as the
    # backward reads and writes about twice the forward's tensors
    other = _bytes_by_scope(config, profile).get("layer", 0.0) * profile["non_gemm_factor"] \
        / profile["hbm_bytes_per_s"]
    other_f, other_b = other / 3, 2 * other / 3
    if t.activation_checkpointing == "full":
        gemm_b, attn_b, other_b = gemm_b + gemm_f, attn_b + attn_f, other_b + other_f
    return LayerTime(gemm_f, attn_f, other_f, gemm_b, attn_b, other_b)


def ends_time(config, profile) -> dict:
    """Seconds of one micro-batch outside the layers on one rank: "embed" (the first stage),
    "head" (the last: the head's GEMMs in bf16, the loss, the final norm), "micro" (every
    stage: the RoPE tables); each (forward, backward)."""
    z = local_sizes(config)
    scopes = _bytes_by_scope(config, profile)
    rate = profile["hbm_bytes_per_s"] / profile["non_gemm_factor"]
    head_f, head_b = forward_backward_gemm_s(z["n"], z["V"], z["C"], profile)
    loss = scopes.get("head", 0.0) / rate
    return {"embed": (scopes.get("embed", 0.0) / rate / 3, 2 * scopes.get("embed", 0.0) / rate / 3),
            "head": (head_f + loss / 2, head_b + loss / 2),
            "micro": (scopes.get("micro", 0.0) / rate / 2, scopes.get("micro", 0.0) / rate / 2)}


def optimizer_s(config, profile, params: float) -> float:
    """The optimizer step on one rank holding `params` parameters (its ZeRO shard's share
    stepped): the gradient norm and AdamW's passes, the copies into buckets, the FP8 weight
    casts (traffic.py's "step" terms, per parameter)."""
    d = config.distributed
    values = dict(symbols(config), P=params, X=params, V=0, C=0)
    total = 0.0
    for category, scope, formula in traffic_terms(config):
        if scope != "step":
            continue
        shard = d.dp_size * d.cp_size if category == "optimizer" and d.zero_stage >= 1 else 1
        total += evaluate(formula, values) / shard
    return total * profile["non_gemm_factor"] / profile["hbm_bytes_per_s"]
