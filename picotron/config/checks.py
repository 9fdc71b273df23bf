"""Every reason a config cannot run, each with the values involved and the fix.

Called by `config.config_from_dict` at load time, so an impossible layout is refused before a
single process group exists."""
from typing import Optional

from picotron.config.features import (cuda_graph_problems, fp8_problems, tp_overlap_problems,
                                      zero3_problems)

# The allowed values of the config's string options. They live here, not in config.py, so
# that this module imports nothing of the package but features.py (which imports
# nothing of it) and config.py can import it at the top.
# "auto" picks the fastest measured path for the machine when the run is built.
PP_ENGINES = ("afab", "1f1b", "interleaved")
CP_MODES = ("ring", "ulysses")
DTYPES = ("float32", "bfloat16", "float16")
NORM_TYPES = ("rmsnorm", "layernorm")
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "flash_attention_2", "eager")
KERNELS = ("auto", "torch", "liger", "triton")
FUSED_LOSSES = ("auto", "none", "chunked", "liger", "triton")
CHECKPOINTING = ("auto", "none", "full", "selective")
# the gradients' dtype on the wire (picotron/data_parallel/buckets.py); float16 is not
# offered: an unscaled gradient sum can leave its range, and bf16 moves as few bytes
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
# Settings a resume may change only when checkpoint.allow_changes lists them: each changes
# which samples the run trains on, or what its weights compute (picotron/checkpoint/changes.py).
# The model's shape is not among them: the weights would not fit.
RESUME_CHANGES = ("model.rope_theta", "model.rms_norm_eps", "training.seed",
                  "training.seq_length", "global_batch_size",
                  "dataset.name", "dataset.subset_name", "dataset.split", "dataset.text_column",
                  "dataset.tokenizer", "dataset.num_samples", "dataset.val_split",
                  "dataset.val_samples", "dataset.byte_range", "dataset.val_byte_range",
                  "dataset.num_windows", "dataset.contents")


def heartbeat_seconds(distributed) -> float:
    """distributed.heartbeat_s, or when unset min(60, timeout_s / 2)."""
    if distributed.heartbeat_s is not None:
        return distributed.heartbeat_s
    return min(60.0, distributed.timeout_s / 2)


def layout_errors(config, world_size: Optional[int] = None) -> list:
    """Every reason this config cannot run, each with the values involved and a fix.

    `config` is a `picotron.config.Config`; it is only read through its sections'
    attributes, so this module does not import config.py (which imports it). Every number is
    already in its range (picotron/config/ranges.py): these checks divide and compare them."""
    d, m, t = config.distributed, config.model, config.training
    errors = []
    if world_size is not None and config.world_size != world_size:
        errors.append(
            f"dp_size*tp_size*pp_size*cp_size = {d.dp_size}*{d.tp_size}*{d.pp_size}*{d.cp_size}"
            f" = {config.world_size}, but {world_size} "
            f"{'process was' if world_size == 1 else 'processes were'} launched; launch with "
            f"--nproc_per_node {config.world_size} (train.py's or torchrun's) or change the sizes")
    if d.pp_engine not in PP_ENGINES:
        errors.append(f"distributed.pp_engine='{d.pp_engine}' must be one of {PP_ENGINES}")
    if d.zero_stage not in (0, 1, 2, 3):
        errors.append(f"distributed.zero_stage={d.zero_stage} must be 0, 1, 2 or 3")
    elif d.zero_stage == 3:
        errors += zero3_problems(config)
    elif d.zero3_keep_params:
        errors.append(f"distributed.zero3_keep_params applies to zero_stage=3 only (got "
                      f"zero_stage={d.zero_stage}); drop it or set zero_stage=3")
    if d.heartbeat_s is not None and d.heartbeat_s * 1.25 >= d.timeout_s:
        errors.append(f"distributed.heartbeat_s={d.heartbeat_s:g} would name a frozen rank "
                      f"only after up to {d.heartbeat_s * 1.25:g} s (heartbeat_s plus one beat), "
                      f"not before distributed.timeout_s={d.timeout_s:g} fails the collectives "
                      f"waiting for it: set heartbeat_s below timeout_s / 1.25 = "
                      f"{d.timeout_s / 1.25:g}, or leave it unset (min(60, timeout_s / 2))")
    if 0 < t.divergence_factor <= 1:
        errors.append(f"training.divergence_factor={t.divergence_factor:g} would stop any run "
                      f"whose loss is not at its best: use a factor above 1 (e.g. 3, the "
                      f"default) or 0 (never stop)")
    if d.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        errors.append(f"distributed.grad_reduce_dtype='{d.grad_reduce_dtype}' must be one of "
                      f"{GRAD_REDUCE_DTYPES}: the dtype in which the gradients are summed over "
                      f"the cp*dp ranks; 'float32' (the default) or 'bfloat16' (half the bytes, "
                      f"each rank's gradient rounded to bf16 once)")
    if m.hidden_size % m.num_attention_heads:
        errors.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                      f"num_attention_heads={m.num_attention_heads}")
    elif (m.hidden_size // m.num_attention_heads) % 2:
        errors.append(f"head_dim = hidden_size/num_attention_heads = "
                      f"{m.hidden_size // m.num_attention_heads} must be even for RoPE")
    if m.num_attention_heads % m.num_key_value_heads:
        errors.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                      f"num_key_value_heads={m.num_key_value_heads}: each kv head serves a "
                      f"whole group of query heads")
    if m.num_attention_heads % d.tp_size:
        errors.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                      f"tp_size={d.tp_size}; pick a tp_size that divides it")
    if m.num_key_value_heads % d.tp_size:
        errors.append(f"model.num_key_value_heads={m.num_key_value_heads} is not divisible by "
                      f"tp_size={d.tp_size}: each TP rank holds whole kv heads (they are not "
                      f"replicated across ranks); pick a tp_size that divides it"
                      + (", or more kv heads (--num_key_value_heads; 1 is multi-query "
                         "attention, as the PaLM presets use)" if m.num_key_value_heads == 1
                         else ""))
    per_rank = -(-m.vocab_size // d.tp_size)          # vocab rows per TP rank, padded
    if (d.tp_size - 1) * per_rank >= m.vocab_size:
        errors.append(f"model.vocab_size={m.vocab_size} split over tp_size={d.tp_size} "
                      f"({per_rank} rows each) leaves the last TP rank no rows; lower tp_size")
    if d.sequence_parallel and d.tp_size > 1 and t.seq_length % (d.cp_size * d.tp_size):
        errors.append(f"distributed.sequence_parallel: training.seq_length={t.seq_length} is "
                      f"not divisible by cp_size*tp_size={d.cp_size * d.tp_size}: each TP rank "
                      f"holds an equal chunk of its sequence; use a multiple of it")
    if m.intermediate_size % d.tp_size:
        errors.append(f"model.intermediate_size={m.intermediate_size} is not divisible by "
                      f"tp_size={d.tp_size}")
    if d.tp_comm_overlap:
        errors += tp_overlap_problems(config)
    if m.num_hidden_layers < d.pp_size:
        errors.append(f"model.num_hidden_layers={m.num_hidden_layers} < pp_size={d.pp_size}: "
                      f"every pipeline stage needs at least one layer; lower pp_size")
    errors += pipeline_errors(config)
    if d.cp_size > 1 and t.seq_length % (2 * d.cp_size):
        errors.append(f"training.seq_length={t.seq_length} is not divisible by 2*cp_size="
                      f"{2 * d.cp_size}: the load-balanced causal split gives each cp rank two "
                      f"equal chunks; use a multiple of {2 * d.cp_size}")
    if d.cp_mode not in CP_MODES:
        errors.append(f"distributed.cp_mode='{d.cp_mode}' must be one of {CP_MODES}")
    elif d.cp_mode == "ulysses" and d.cp_size > 1:
        for name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(m, name)
            if heads % (d.tp_size * d.cp_size):
                errors.append(f"distributed.cp_mode='ulysses' splits each rank's heads over cp: "
                              f"model.{name}={heads} is not divisible by tp_size*cp_size="
                              f"{d.tp_size}*{d.cp_size}; use cp_mode='ring' or other sizes")
    if t.seq_length > m.max_position_embeddings:
        errors.append(f"training.seq_length={t.seq_length} > model.max_position_embeddings="
                      f"{m.max_position_embeddings} (the longest sequence the model is built "
                      f"for); shorten the sequence, or raise model.max_position_embeddings "
                      f"(RoPE extends to it; a pretrained model was trained only up to its own)")
    if m.norm_type not in NORM_TYPES:
        errors.append(f"model.norm_type='{m.norm_type}' must be one of {NORM_TYPES}")
    if m.attn_implementation not in ATTN_IMPLEMENTATIONS:
        errors.append(f"model.attn_implementation='{m.attn_implementation}' must be one of "
                      f"{ATTN_IMPLEMENTATIONS}")
    for key, value, allowed in (("model.kernels", m.kernels, KERNELS),
                                ("training.fused_loss", t.fused_loss, FUSED_LOSSES),
                                ("training.activation_checkpointing",
                                 t.activation_checkpointing, CHECKPOINTING)):
        if value not in allowed:
            errors.append(f"{key}='{value}' must be one of {allowed}")
    gpu_only = [f"{k}='{v}'" for k, v in (("model.kernels", m.kernels),
                                           ("training.fused_loss", t.fused_loss))
                if v in ("liger", "triton")]
    n = t.activation_checkpointing_layers
    if n is not None and not 0 <= n <= m.num_hidden_layers:
        errors.append(f"training.activation_checkpointing_layers={n} must be between 0 and "
                      f"model.num_hidden_layers={m.num_hidden_layers}, or null for all layers")
    elif n is not None and t.activation_checkpointing == "none":
        errors.append(f"training.activation_checkpointing_layers={n} picks the layers that "
                      f"use training.activation_checkpointing, which is 'none'; set it to "
                      f"'full' or 'selective', or drop activation_checkpointing_layers")
    if m.kernels == "liger" and t.activation_checkpointing == "selective":
        errors.append("training.activation_checkpointing='selective' keeps the matmul outputs "
                      "by op name, and model.kernels='liger' runs its own autograd functions "
                      "(liger rotates q and k in place inside those outputs), so the "
                      "recomputation would be wrong; use 'full', or model.kernels='triton' "
                      "(whose 'selective' recomputes the SwiGLU output) or 'torch'")
    if d.share_gpu and d.use_cpu:
        errors.append("distributed.share_gpu puts every rank on one CUDA GPU, but "
                      "distributed.use_cpu is true; drop one of them")
    if m.attn_implementation == "flash_attention_2" and d.use_cpu:
        errors.append("model.attn_implementation='flash_attention_2' runs flash-attn's CUDA "
                      "kernels, but distributed.use_cpu is true; use 'sdpa' or 'auto'")
    if gpu_only and d.use_cpu:
        on_cpu = {"model.kernels": "'torch'", "training.fused_loss": "'none' or 'chunked'"}
        errors.append(f"{' and '.join(gpu_only)} runs Triton kernels on CUDA GPUs only, "
                      f"but distributed.use_cpu is true; on CPU use "
                      + "; ".join(f"{k}={on_cpu[k]}" for k in
                                  (g.split("=")[0] for g in gpu_only)))
    if t.cuda_graphs not in (True, False, "auto"):
        errors.append(f"training.cuda_graphs={t.cuda_graphs!r} must be true, false or 'auto'")
    elif t.cuda_graphs is True:         # "auto" is left only when other errors stopped it
        errors += cuda_graph_problems(d, t, m)
    if t.fp8 not in ("none", "auto"):  # "auto" never refuses; left only when errors stopped it
        errors += fp8_problems(config)
    if t.dtype not in DTYPES:
        errors.append(f"training.dtype='{t.dtype}' must be one of {DTYPES}")
    if t.loss_chunk_tokens and t.fused_loss not in ("chunked", "triton"):
        errors.append(f"training.loss_chunk_tokens={t.loss_chunk_tokens} sizes the chunks of "
                      f"training.fused_loss 'chunked' and 'triton', not '{t.fused_loss}'; "
                      f"set it to 0 or pick one of those losses")
    if t.dtype == "float16" and not t.master_weights:
        errors.append("training.dtype='float16' needs training.master_weights=true: fp16 "
                      "weights cannot absorb small updates, and loss scaling unscales into them")
    if t.fused_loss not in ("none", "auto") and d.tp_size > 1:
        errors.append(f"training.fused_loss='{t.fused_loss}' applies the whole output head on "
                      f"one rank, but tp_size={d.tp_size} shards the head over the vocabulary "
                      f"and its vocab-parallel loss never gathers the logits either; set "
                      f"training.fused_loss='none' (or 'auto')")
    if t.dtype == "float16" and t.fused_loss == "liger" and d.tp_size == 1:
        # liger stores d loss / d logits, (softmax - onehot) / tokens, in the model dtype
        # during forward, before backward multiplies in the loss scale: in fp16 the small ones
        # (~1e-9 for a 49k vocabulary and 32k tokens) underflow. Ours keep it per token and
        # divide in backward (picotron/speed/loss.py).
        errors.append("training.fused_loss='liger' with training.dtype='float16' would lose "
                      "part of the logits' gradient (liger rounds it to fp16 before the loss "
                      "scale applies); use training.fused_loss='triton' or 'chunked', or "
                      "training.dtype='bfloat16'")
    if t.val_frequency > 0 and config.dataset.val_samples == 0:
        errors.append(f"training.val_frequency={t.val_frequency} but dataset.val_samples=0: "
                      f"set dataset.val_samples to the number of held-out windows")
    errors += split_errors(config.dataset)
    unknown = [c for c in config.checkpoint.allow_changes if c not in RESUME_CHANGES]
    if unknown:
        errors.append(f"checkpoint.allow_changes names {unknown}, which a resume cannot "
                      f"accept; it takes a list of: {', '.join(RESUME_CHANGES)}")
    return errors


def split_errors(ds) -> list:
    """A split names part of a dataset; the embedded corpus, a file's byte range and synthetic
    tokens are one stream each, so a split there would be ignored: refused instead."""
    source = ("dataset.byte_range" if ds.byte_range is not None else
              f"dataset.name='{ds.name}'" if ds.name in ("embedded", "synthetic") else None)
    held_out = "dataset.val_byte_range" if ds.byte_range is not None else "dataset.val_samples"
    return [f"{key}={value!r} means nothing for {source}, one stream with no splits: remove "
            f"it (held-out windows come from {held_out})"
            for key, value in (("dataset.split", ds.split), ("dataset.val_split", ds.val_split))
            if source and value not in (None, "train")]


def pipeline_errors(config) -> list:
    """afab and 1f1b take any number of micro-batches (fewer than pp_size: correct, slow);
    interleaved sends them round in groups of pp_size through pp_size*v equal layer chunks."""
    d, m, acc = config.distributed, config.model, config.training.gradient_accumulation_steps
    pp, v = d.pp_size, d.pp_virtual_stages
    errors = []
    if pp > 1 and d.pp_engine == "interleaved" and acc % pp:
        errors.append(f"pp_engine=interleaved needs training.gradient_accumulation_steps to be "
                      f"a multiple of pp_size={pp} (at least {pp}), got {acc}")
    elif pp > 1 and d.pp_engine == "interleaved" and m.num_hidden_layers % (pp * v):
        errors.append(f"pp_engine=interleaved cuts model.num_hidden_layers={m.num_hidden_layers}"
                      f" into pp_size*pp_virtual_stages = {pp}*{v} equal chunks, which does not "
                      f"divide it; change one of the three")
    return errors


def config_warnings(config) -> list:
    """Settings that run but are likely mistakes, each with what will happen and the fix
    (create_config.py and a run's first lines say them; nothing refuses them)."""
    t, warnings = config.training, []
    if t.warmup_steps >= t.total_train_steps:
        warnings.append(f"training.warmup_steps={t.warmup_steps} is not below training."
                        f"total_train_steps={t.total_train_steps}: the learning rate is still "
                        f"warming up at the last step and never reaches training.learning_rate"
                        f"; lower warmup_steps (e.g. --set training.warmup_steps="
                        f"{max(1, t.total_train_steps // 10)})")
    return warnings
