"""The activations a rank keeps for backward, from the config's sizes alone: per layer, per
micro-batch in flight, and the loss (memory_plan.py adds weights, gradients and AdamW state).

Legend: b bytes per element of training.dtype; N tokens of one micro-batch on this rank
(micro_batch_size x seq_length / cp); C hidden, I MLP width, H query heads, K kv heads, D head
dim, T sequence on this rank, V vocabulary (V/tp per rank); s = tp under sequence parallelism,
else 1 (the norms and the residual stream then hold N/s tokens).

What one layer keeps for backward, bytes per token (tests/test_memory_plan.py counts the saved
tensors of the torch path on CPU against these; the fast kernels' autograd functions, in
speed/, save what their comments list):
  model.kernels triton or liger (norms keep x and an fp32 rstd; the fused projections their x):
    each norm     (C b + 4) / s, +4/s for LayerNorm's mean; + C b, its output (the projections'
                  input, gathered to all T under sequence parallelism)
    attention     (2C + 2KD) b / tp + 4H / tp: q, k, v, the output, the fp32 log-sum-exp
    MLP           3I b / tp: packed gate|up (2I), the SwiGLU output (I); "selective" with
                  triton recomputes the SwiGLU output in backward: 2I b / tp
  model.kernels torch (model.py's formulas):
    each norm     RMSNorm (4C + C b + 4) / s: fp32 x, x / rms(x), rstd; LayerNorm (4C + 8) / s;
                  + C b, its output
    attention     SDPA (and flash-attn) as above; eager: (12C + 4HT + C b) / tp, fp32 q, and
                  k and v repeated to H heads, the (T, T) probabilities of each head, the output
                  copy; plus the (T, T) bool mask of the layer
    MLP           4I b / tp: gate, silu(gate), up, their product
    "selective"   what its policy (speed/recompute.py) keeps: the layer input C b / s, the
                  outputs of every matmul and of attention, (2C + 2KD + 2I) b / tp + 4H / tp
                  for q, k, v, attention, gate, up, and 2C b for o and down (partial sums)
  "full"          C b / s: the layer input only; backward recomputes one layer at a time
PaLM's parallel block has one norm, whose output both branches share. torch.compile is counted
as the torch path (an upper bound: the compiler keeps less).
"""
from collections import namedtuple

# One line of the estimate: bytes alive at moment `when` (memory_plan.py lists the moments).
Row = namedtuple("Row", "name bytes when formula")

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2 ** 30


def virtual_stages(config) -> int:
    d = config.distributed
    return d.pp_virtual_stages if d.pp_engine == "interleaved" and d.pp_size > 1 else 1


def rank_layer_spans(config, pp_rank: int) -> list:
    """[(first layer, count)] of each of this pipeline rank's chunks: stage.py's balanced
    split (the first L % S virtual stages one layer longer), computed, not listed, so that an
    absurd num_hidden_layers costs nothing."""
    pp, v = config.distributed.pp_size, virtual_stages(config)
    base, extra = divmod(config.model.num_hidden_layers, pp * v)
    spans = []
    for chunk in range(v):
        stage = chunk * pp + pp_rank
        spans.append((stage * base + min(stage, extra), base + (stage < extra)))
    return spans


def in_flight(config, pp_rank: int) -> int:
    """Micro-batches (chunk-micro-batches when interleaved) whose activations this rank holds
    at once: schedules.py's peak_alive in closed form. One without a pipeline (each
    micro-batch's backward runs before the next forward); afab: all m; 1f1b and interleaved:
    the warm-up forwards plus one, at most all of them (the interleaved engine warms up twice
    1F1B's transfers, at one chunk a rank too: its order fills each round trip with forwards)."""
    d, m = config.distributed, config.training.gradient_accumulation_steps
    if d.pp_size == 1:
        return 1
    if d.pp_engine == "afab":
        return m
    v = virtual_stages(config)
    trips = 2 if d.pp_engine == "interleaved" else 1
    warmup = (d.pp_size - pp_rank - 1) * trips + (v - 1) * d.pp_size
    return min(warmup + 1, m * v)


def norm_bytes(config, fused: bool) -> float:
    """Bytes per token one norm keeps: its part over N/s tokens, and its output over N."""
    m, b, s = config.model, BYTES[config.training.dtype], _sp(config)
    C, layernorm = m.hidden_size, m.norm_type == "layernorm"
    if fused:
        own = C * b + (8 if layernorm else 4)
    else:
        own = 4 * C + 8 if layernorm else 4 * C + C * b + 4
    return own / s + C * b


def layer_bytes(config, mode: str) -> float:
    """Bytes per token one layer keeps for backward under `mode` (none, selective, full): the
    formulas of the table above."""
    m, t, d = config.model, config.training, config.distributed
    b, tp, s = BYTES[t.dtype], d.tp_size, _sp(config)
    C, I, H = m.hidden_size, m.intermediate_size, m.num_attention_heads
    KD = m.num_key_value_heads * (C // H)                   # k and v widths
    fused = m.kernels in ("triton", "liger")
    if mode == "full":                                      # the layer input (B, T/s, C)
        return C * b / s
    if mode == "selective" and not fused:   # input; q, k, v, attention, gate, up; o, down
        return C * b / s + (2 * C + 2 * KD + 2 * I) * b / tp + 4 * H / tp + 2 * C * b
    norms = (1 if m.parallel_residual else 2) * norm_bytes(config, fused)
    if _eager(config):          # fp32 q, k, v (B, H, T, D), probabilities (B, H, T, T), output
        attention = (12 * C + 4 * H * _tokens_t(config) + C * b) / tp
    else:                       # q, k, v, output (B, T, H|K, D), log-sum-exp (B, H, T) fp32
        attention = (2 * C + 2 * KD) * b / tp + 4 * H / tp
    if not fused:               # gate, silu(gate), up, product: (B, T, I) each
        mlp = 4 * I
    else:                       # gate|up (B, T, 2I) and, unless recomputed, the SwiGLU output
        mlp = 2 * I if mode == "selective" else 3 * I
    return norms + attention + mlp * b / tp


def layer_stack_bytes(config, pp_rank: int, N: int):
    """(bytes, description) the layers of one micro-batch keep on this rank, over all its
    chunks, with the first activation_checkpointing_layers layers of the model in its mode."""
    return _stack_bytes(config, rank_layer_spans(config, pp_rank), N)


def _spans_key(config, spans) -> tuple:
    """What the layers' bytes read of a rank's chunks (first layer, count): the counts, and
    the first layers only where a count of checkpointed layers makes them matter."""
    if config.training.activation_checkpointing_layers is not None:
        return tuple(spans)
    return tuple(count for _, count in spans)


def _stack_bytes(config, spans: tuple, N: int):
    """layer_stack_bytes of the chunks' (first layer, count) `spans`."""
    t, T = config.training, _tokens_t(config)
    mode, n_ckpt = t.activation_checkpointing, t.activation_checkpointing_layers
    mask = T * T if _eager(config) else 0           # eager's (T, T) bool mask, per layer
    total, parts = 0.0, []
    for first, count in spans:
        if mode == "none":
            ckpt = 0
        elif n_ckpt is None:
            ckpt = count
        else:                                       # the model's layers 0..n_ckpt-1 only
            ckpt = max(0, min(count, n_ckpt - first))
        per_token = ckpt * layer_bytes(config, mode) + (count - ckpt) * layer_bytes(config,
                                                                                   "none")
        total += N * per_token + count * mask
        parts.append(" + ".join(f"{n} {how}" for n, how in ((ckpt, mode), (count - ckpt, "none"))
                                if n))
    return total, ", ".join(parts)


def activation_rows(config, pp_rank: int, shared: dict = None, described: bool = True) -> list:
    """This rank's activation rows: its layers times its micro-batches in flight, the rope
    tables, the pipeline's hand-offs, on the last stage the final norm and the loss of every
    micro-batch in flight, and the larger of one loss and one layer's backward. `shared`: a
    dict kept over the ranks of one config, for what they compute alike (the layers' bytes,
    the loss's, one layer's backward, the rows of ranks alike in what they read), or over
    configs that differ only in grad_acc and pp_engine at one v (their ranks' micro-batches
    in flight, in the rows' key). `described` False leaves the rows' formulas '' (a search
    sums the bytes of thousands and shows none)."""
    m, t, d = config.model, config.training, config.distributed
    b, v, C = BYTES[t.dtype], virtual_stages(config), m.hidden_size
    N = t.micro_batch_size * _tokens_t(config)
    shared = {} if shared is None else shared
    units = in_flight(config, pp_rank)          # micro-batches through one chunk
    spans, last = rank_layer_spans(config, pp_rank), pp_rank == d.pp_size - 1
    # what the rows read of the rank: ranks alike in it have the same rows
    layers = ("stack", _spans_key(config, spans))
    alike = ("rows", units, layers, last, described)
    if alike in shared:
        return shared[alike]
    if layers not in shared:
        shared[layers] = _stack_bytes(config, spans, N)
    stack, layout = shared[layers]
    rows = [Row("activations", units * stack / v, "forward",
                f"{units} micro-batch(es) in flight x N={N:,} tokens x per-layer bytes "
                f"(memory_activations.py) of layers [{layout}] / {v} chunk(s)" if described
                else ""),
            Row("rope tables and token ids", units * N * (2 * _head_dim(m) * b + 16), "forward",
                f"{units} x N x (cos, sin: 2 x D x {b} B + 16 B ids)" if described else "")]
    if d.pp_size > 1:          # each chunk output kept until its backward; one of each in transit
        outputs = units - (-(-units // v) if last else 0)
        rows.append(Row("pipeline hand-offs", (outputs + 2) * N * C * b, "forward",
                        f"({outputs} chunk outputs kept + an activation and a gradient in "
                        f"transit) x N x C x {b} B" if described else ""))
    if last and "loss" not in shared:
        shared["loss"] = loss_bytes(config, N)
    loss_kept, loss_peak, loss_formula = shared["loss"] if last else (0, 0, "none here")
    if last:                   # the last chunk's micro-batches in flight, each with its loss
        ends = -(-units // v)
        fused = m.kernels in ("triton", "liger")
        rows.append(Row("final norm", ends * N * norm_bytes(config, fused), "forward",
                        f"{ends} x N x one norm's bytes per token" if described else ""))
        if ends > 1:
            rows.append(Row("losses of the other micro-batches in flight",
                            (ends - 1) * loss_kept, "forward",
                            f"{ends - 1} x what one loss keeps for backward" if described
                            else ""))
    if "backward" not in shared:
        shared["backward"] = layer_backward_bytes(config, N)
    backward, backward_formula = shared["backward"]
    rows.append(Row("loss or one layer's backward, the larger", max(loss_peak, backward),
                    "forward", f"max(loss {loss_peak / GiB:.2f} GiB: {loss_formula}; "
                    f"backward {backward / GiB:.2f} GiB: {backward_formula})" if described
                    else ""))
    shared[alike] = rows
    return rows


def loss_bytes(config, N: int):
    """(bytes kept for backward, bytes at its peak, formula) of the loss of N tokens."""
    m, t = config.model, config.training
    b, C = BYTES[t.dtype], m.hidden_size
    V = -(-m.vocab_size // config.distributed.tp_size)
    if t.fused_loss == "none":
        # kept: fp32 log-probabilities (N, V/tp); backward adds their gradient and the logits'
        return 4 * N * V, 12 * N * V, f"12 x N x V/tp, V/tp = {V:,}"
    rows = min(N, t.loss_chunk_tokens or 4096)
    cast = 0 if b == 4 else b                 # a cast to b is a copy unless b is fp32
    kept = N * C * b + 4 * V * C              # hidden-state gradient, fp32 head gradient
    if t.fused_loss == "chunked":   # a chunk's fp32 logits, its gradient in fp32, then in b
        chunk = rows * V * (8 + cast)
        back = N * C * (4 + 4 * (b != 4) + cast) + V * C * (4 + cast)
    else:                           # triton, liger: one (rows, V) buffer in b
        chunk = rows * V * b
        back = N * C * b + V * C * (4 + cast)
    # backward: the stored gradients times grad_output / count, as new tensors, cast back to b
    return kept, kept + max(chunk, back), (f"N C b + 4 V C + max(chunk of {rows} tokens "
                                           f"{chunk / GiB:.2f} GiB, backward copies "
                                           f"{back / GiB:.2f} GiB)")


def layer_backward_bytes(config, N: int):
    """(bytes, formula) of one layer's backward on top of what the layers keep: the gradient of
    its output (C b) and of the MLP's SwiGLU output (I b / tp; the torch path also holds those
    of gate and up, 2I b / tp; our SwiGLU writes them over gate|up); under "full" also the
    layer's activations, recomputed."""
    m, t, d = config.model, config.training, config.distributed
    b, widths = BYTES[t.dtype], 1 if m.kernels in ("triton", "liger") else 3
    grads = N * (m.hidden_size + widths * m.intermediate_size / d.tp_size) * b
    formula = f"N x (C + {widths}I/tp) x b"
    if t.activation_checkpointing != "full":
        return grads, formula
    return grads + N * layer_bytes(config, "none"), formula + " + one layer recomputed"


def _head_dim(m) -> int:
    return m.hidden_size // m.num_attention_heads


def _sp(config) -> int:
    d = config.distributed
    return d.tp_size if d.sequence_parallel and d.tp_size > 1 else 1


def _tokens_t(config) -> int:
    return config.training.seq_length // config.distributed.cp_size


def _eager(config) -> bool:
    return config.model.attn_implementation == "eager" and config.distributed.cp_size == 1
