"""The bytes the passes outside the GEMMs and attention move: every read and write our kernels
make, counted from their loads and stores as they are written, by profile category and by
where in a step they happen. bench/traffic_floor.py prints them for one GPU as the step's
memory-traffic floor; step_time.py times them at a profile's bandwidth.

The path counted is what a run with no flag takes on an H100/H200 at large width: our Triton
kernels with fused q/k/v and gate/up projections, the Triton loss, "selective" recomputation
(the SwiGLU output recomputed in backward), delayed-scaled FP8 GEMMs, fp32 master weights and
AdamW moments for bf16 parameters, bf16 gradient buffers; CUDA graphs where "auto" takes them
(below hidden size 2048). bf16 GEMMs (training.fp8="none") and bf16 moments
(master_weights=false) are counted too, and for a profile of another trainer's runs its loss
(nanotron_loss_terms).

Symbols (each formula is a Python expression in them):
    N tokens a micro-batch (B*T)    C hidden size     D head dim      I MLP width
    W = C + 2*K*D, the fused q/k/v width (K key/value heads)         V vocabulary
    L layers    P parameters (a tied embedding once)
    R the norm backward's programs: 16 warps an SM in programs of its tile's warps
        (4 of 4 warps up to C = 4096, as triton_norms.py's tile), at most one a row block
    X = L*C*(W + C + 3*I), the projections' parameters: the weights cast to FP8 each step
Scopes: "layer" a layer's forward and backward of one micro-batch; "micro" once a micro-batch
(the RoPE tables); "embed" and "head" once a micro-batch on the stage holding the embedding or
the head and loss; "step" once an optimizer step per parameter (P) or per head (V*C).
Counted: the steady state (the first FP8 step calibrates), every pass a kernel makes over a
tensor from memory (the loss kernel's second read of a row may come from L2). Not counted: the
embedding backward's partial sums and scattered rows (10 bytes a distinct token and feature:
they depend on the tokens) and its index sort; what is a few bytes a token or a site outside
the kernels counted (the token count, the batches' copies to the GPU, the FP8 amaxes' roll).
"""
from picotron.utils import count_params

SMS = 132               # streaming multiprocessors of an H100 SXM or an H200


def traffic_terms(config, loss: str = "picotron") -> list:
    """(category, scope, formula) for every pass of the path in the module docstring. The
    comments say which kernel makes each pass and what it reads and writes (bf16: 2 bytes a
    value, fp32 4, FP8 1). `loss`: whose loss the head's passes are, "nanotron"
    (nanotron_loss_terms) or else ours."""
    t = config.training
    fp8 = t.fp8 != "none"
    terms = []

    def count(category, scope, formula):
        terms.append((category, scope, formula))

    # optimizer: the grad norm (_foreach_norm) reads every bf16 gradient (2 bytes); the AdamW
    # kernel (triton_adamw.py) reads it again (2) and, with fp32 masters, reads and writes
    # the master and both moments (24) and writes the bf16 weight (2): 30 bytes a parameter;
    # without them it reads and writes the bf16 weight and moments (12): 16.
    count("optimizer", "step", "2*P")
    count("optimizer", "step", "28*P" if t.master_weights else "14*P")
    # swiglu, per layer: the recomputing SwiGLU + down projection's two kernels. FP8
    # (fp8/delayed_swiglu.py): forward reads gu (N, 2I) bf16 and writes h_q (N, I) FP8;
    # backward reads dh (N, I) bf16 and gu, writes d(gu)_q, d(gu)_q^T (N, 2I) and h^T_q (I, N).
    # bf16 (speed/kernels/triton_swiglu.py): forward reads gu and writes h (N, I) bf16;
    # backward reads dh and gu, writes d(gu) over gu and h over dh.
    count("swiglu", "layer", "5*N*I + 11*N*I" if fp8 else "6*N*I + 12*N*I")
    # norms (triton_norms.py), per layer: the input norm forward reads x, writes y and an fp32
    # rstd a row (4NC + 4N); the MLP's add-norm reads x and attn, writes s and y (8NC + 4N).
    # Backward: the add-norm reads s, dy, ds and rstd, writes dx (8NC + 4N); the input norm
    # reads x, dy and rstd, writes dx (6NC + 4N); each writes R fp32 rows of partial weight
    # gradients (4RC). Then the final norm, forward and backward (10NC + 8N + 4RC).
    count("norms", "layer", "26*N*C + 16*N + 8*R*C")
    count("norms", "head", "10*N*C + 8*N + 4*R*C")
    # rope (triton_rope.py), per layer: forward reads the packed qkv (N, W) and cos, sin
    # (N, D) bf16 each, writes q, k, v (N, W); backward the same from dq, dk, dv to d(qkv)
    count("rope", "layer", "8*N*W + 8*N*D")
    if fp8:
        # fp8 casts (fp8/cast.py's _cast, delayed: no amax pass): each reads bf16 (N, K) and
        # writes q and q^T in FP8 (4 bytes a value): forward x of q/k/v, o and gate/up (K = C),
        # backward dy of down and o (C) and of q/k/v (W); gate/up's dy comes cast from the
        # SwiGLU backward. Per step, each projection weight (weights.py): an amax pass, then
        # a cast writing W_q and W^T_q (6 bytes a parameter).
        count("fp8 casts, amaxes", "layer", "20*N*C + 4*N*W")
        count("fp8 casts, amaxes", "step", "6*X")
    # loss (triton_loss.py): _cross_entropy_rows reads each row of logits (V bf16) twice
    # (logsumexp, then the gradient) and writes the gradient over it, with its target and
    # loss (12 bytes a row); backward's _scale reads and writes grad_hidden (N, C).
    if loss == "nanotron":
        terms += nanotron_loss_terms()
    else:
        count("loss", "head", "6*N*V + 12*N + 4*N*C")
    # adds (torch): per layer the forward's residual add x + mlp (reads 2, writes 1 (N, C)) and
    # in backward the sum of the layer input's two gradients (the input norm's and the
    # add-norm's); with a tied embedding, the sum of the head's and the embedding's (V, C).
    count("adds", "layer", "12*N*C")
    if config.model.tie_word_embeddings:
        count("adds", "step", "6*V*C")
    # copy/cat: each bf16 gradient copied into its bucket (data_parallel/buckets.py, 4 bytes a
    # parameter); the head's fp32 gradient to bf16 (speed/kernels/triton_loss.py, 6VC); the
    # RoPE tables (model.rope_cos_sin): positions to fp32 (12N), the angles' two halves
    # concatenated (6ND: D/2 and D/2 fp32 in, D out), cos and sin to bf16 (12ND)
    count("copy/cat", "step", "4*P + 6*V*C")
    count("copy/cat", "micro", "12*N + 18*N*D")
    if t.cuda_graphs is True:   # the graphed layers' static inputs x, cos, sin and their
        count("copy/cat", "micro", "8*N*C + 8*N*D")  # output's gradient, copied in (cuda_graphs.py)
    # reduction: each norm's R partial weight-gradient rows summed (dw.sum(0)), then made bf16
    count("reduction", "layer", "2*(4*R*C + 10*C)")
    count("reduction", "head", "4*R*C + 10*C")
    # elementwise (torch): zero fills of the loss's fp32 head gradient (4VC) and of the
    # embedding's bf16 gradient (2VC), the head gradient times 1 / count (8VC); the RoPE
    # tables: angles (4N + 2ND: D/2 fp32 a token), cos and sin in fp32 (8ND each)
    count("elementwise", "step", "14*V*C")
    count("elementwise", "micro", "4*N + 18*N*D")
    # embedding: forward gathers rows of the (V, C) table (reads ids 8N and rows, writes
    # (N, C)); backward reads dy (N, C)
    count("embedding", "embed", "6*N*C + 8*N")
    return terms


def nanotron_loss_terms() -> list:
    """The head's loss passes of nanotron, per logit of the rank's (N, V) shard: its Llama
    casts the bf16 logits to fp32, then runs _ShardedCrossEntropy in torch ops. Forward: the
    cast (reads 2, writes 4), the max (reads 4), the max-shifted copy (reads and writes 4),
    exp in place (4 and 4), the sum (4), the softmax's division in place (4 and 4). Backward:
    the softmax times the loss's gradient in place (4 and 4), the cast's gradient back to
    bf16 (reads 4, writes 2). 52 bytes; its per-row passes over the targets are a few bytes a
    token against V logits, not counted."""
    return [("loss", "head", "52*N*V")]


def norm_programs(C: int, N: int) -> int:
    """R: the norm backward's programs, as triton_norms.py launches them on SMS SMs: a tile
    of 4K elements (rows of C padded to a power of two, at most 16 rows), 32 elements a
    thread, 16 warps an SM, at most one program a block of rows."""
    block_c = 1 << max(0, (C - 1).bit_length())
    rows = min(16, max(1, 4096 // block_c))
    warps = min(16, max(1, rows * block_c // (32 * 32)))
    return min(max(1, 16 // warps) * SMS, -(-N // rows))


def symbols(config, tokens: int = None) -> dict:
    """The symbols' values for `config` (module docstring); N is one micro-batch's tokens
    unless `tokens` gives it."""
    m, t = config.model, config.training
    D = m.hidden_size // m.num_attention_heads
    s = dict(N=tokens or t.micro_batch_size * t.seq_length, C=m.hidden_size, D=D,
             W=m.hidden_size + 2 * m.num_key_value_heads * D, I=m.intermediate_size,
             V=m.vocab_size, L=m.num_hidden_layers, P=count_params(m))
    s["R"] = norm_programs(s["C"], s["N"])
    s["X"] = s["L"] * s["C"] * (s["W"] + s["C"] + 3 * s["I"])
    return s


_COMPILED = {}          # formula -> its code, compiled once (a search evaluates each often)


def evaluate(formula: str, values: dict) -> float:
    code = _COMPILED.get(formula)
    if code is None:
        code = _COMPILED[formula] = compile(formula, "<traffic formula>", "eval")
    return eval(code, {"__builtins__": {}}, values)


def step_traffic(config) -> dict:
    """{category: (bytes of one optimizer step of one micro-batch on one GPU, formula)}: every
    scope once, the layers' L times."""
    values = symbols(config)
    joined = {}
    for category, scope, formula in traffic_terms(config):
        joined.setdefault(category, []).append(f"L*({formula})" if scope == "layer" else formula)
    return {category: (sum(evaluate(f, values) for f in formulas), " + ".join(formulas))
            for category, formulas in joined.items()}
