"""What each optional feature of a run cannot be combined with, with the values involved and
the fix: CUDA graphs, FP8 GEMMs, tensor-parallel communication overlap, ZeRO-3.

checks.layout_errors calls these beside its checks of the layout itself; like that
module, this one imports nothing of the package.
"""
import dataclasses

FP8 = ("auto", "none", "tensorwise", "tensorwise_delayed", "rowwise",
       "rowwise_bf16_dw")                                               # training.fp8
# training.fp8="auto" picks FP8 from this hidden size up. Measured on one H200
# (bench/NOTES.md): SmolLM-1.7B (hidden 2048) 1.35x HF + Liger in FP8 against 1.02x in bf16,
# the Llama-3-8B shape 1.38x; but eager, SmolLM-360M (960) only broke even and 135M (576) ran at
# 0.62x of bf16: their GEMMs are too small to cover the host's time to launch the casts.
FP8_AUTO_MIN_HIDDEN = 2048
# ... and "tensorwise_delayed" (no amax pass) from this one up when the layers replay as CUDA
# graphs, which take the host's launches out of the step: at SmolLM-135M (576) 1.04x its bf16
# graphs (361.5k against 348.5k tok/s, and 355.6k against 340.3k in the convergence bench's
# runs; tensorwise there 1.0x, and 1.07x at 360M).
FP8_AUTO_MIN_HIDDEN_GRAPHS_DELAYED = 576
# ... and from this one up under training.compile, whose compiled layers fuse the casts with
# their neighbours: "tensorwise" at SmolLM-360M (960) 1.03x its compiled bf16 (178.9k and 178.7k
# against 172.3k-174.3k tok/s), 1.7B 1.28x, but 135M (576) 0.93x; compiled, the delayed recipe
# ran 1.00-1.04x tensorwise at 360M (median 1.02x) and 1.01x at 1.7B, at the same memory.
FP8_AUTO_MIN_HIDDEN_COMPILED = 960
# training.cuda_graphs="auto" captures the layers of one-GPU runs below this hidden size:
# SmolLM-360M and 135M as fast as eager (their 4-5% lower peak missed the graphs' pool after
# its capture: bench/NOTES.md), and FP8 pays at 360M under graphs only;
# SmolLM-1.7B ran 1.5% slower under graphs, so it stays eager.
GRAPHS_AUTO_MAX_HIDDEN = 2048


def cuda_graph_problems(d, t, m):
    """training.cuda_graphs captures the whole layer stack as one graph per direction
    (picotron/speed/cuda_graphs.py): nothing inside may talk to other ranks or the host."""
    fix = "; set training.cuda_graphs=false for this layout"
    inside = [f"distributed.{k}={getattr(d, k)}" for k in ("tp_size", "pp_size", "cp_size")
              if getattr(d, k) > 1]
    problems = []
    if d.use_cpu:
        problems.append("training.cuda_graphs needs CUDA GPUs, but distributed.use_cpu is true"
                        + fix)
    if inside:
        problems.append(f"training.cuda_graphs cannot capture {' and '.join(inside)}: their "
                        f"collectives and stage hand-offs run inside the layers" + fix)
    # our "selective" recomputes inside the MLP's own autograd function, which a graph
    # captures like any other; torch's checkpoint would rerun the forward inside backward
    ours = t.activation_checkpointing == "selective" and m.kernels == "triton"
    if t.activation_checkpointing != "none" and not ours:
        problems.append(f"training.cuda_graphs needs training.activation_checkpointing='none' "
                        f"(got '{t.activation_checkpointing}'), or 'selective' with "
                        f"model.kernels='triton': the graph already keeps every activation "
                        f"in its own memory pool")
    if t.compile:
        problems.append("training.cuda_graphs and training.compile are two ways to launch the "
                        "layers; choose one")
    return problems


def cuda_graphs_auto_choice(config) -> bool:
    """What training.cuda_graphs="auto" resolves to on a GPU run: true on one GPU (under data
    parallelism the graphs would delay the gradient reductions until after backward) for
    hidden_size < GRAPHS_AUTO_MAX_HIDDEN, when the rest of the config lets a graph hold the
    layers (cuda_graph_problems, not ZeRO-3) with kernels the GPU tests have captured (our
    Triton kernels or torch's, SDPA) or plain torch ops (the eager attention); liger's
    kernels and flash-attn have not run under graphs here (asked for by name, graphs still
    take them); else false."""
    d, t, m = config.distributed, config.training, config.model
    one_gpu = d.dp_size * d.tp_size * d.pp_size * d.cp_size == 1
    if not one_gpu or m.hidden_size >= GRAPHS_AUTO_MAX_HIDDEN or d.zero_stage == 3:
        return False
    flash = m.attn_implementation == "flash_attention_2" or (
        m.attn_implementation == "auto" and flash_attn_installed())
    if m.kernels not in ("triton", "torch") or flash:
        return False
    return not cuda_graph_problems(d, t, m)


def flash_attn_installed() -> bool:
    """Whether model.attn_implementation="auto" would take flash-attn (attention.py)."""
    import importlib.util
    return importlib.util.find_spec("flash_attn") is not None


def fp8_problems(config) -> list:
    """training.fp8 (picotron/speed/fp8/linear.py) runs torch._scaled_mm on FP8 tensor cores, whose
    GEMMs want every reduction and output size a multiple of 16; the GPU's generation is
    checked when the run is built (speed.fp8.layers.check_fp8_device)."""
    d, m, t = config.distributed, config.model, config.training
    if t.fp8 not in FP8:
        return [f"training.fp8='{t.fp8}' must be one of {FP8}"]
    problems = []
    if d.use_cpu:
        problems.append(f"training.fp8='{t.fp8}' runs FP8 GEMMs on GPUs with FP8 tensor cores "
                        f"(sm89+), but distributed.use_cpu is true; set training.fp8='none'")
    elif t.dtype != "bfloat16":
        problems.append(f"training.fp8='{t.fp8}' computes in FP8 and returns bf16 (the "
                        f"row-scaled GEMM has no other output), but training.dtype="
                        f"'{t.dtype}'; set training.dtype='bfloat16'")
    head_dim = m.hidden_size // m.num_attention_heads
    tokens = t.micro_batch_size * t.seq_length // d.cp_size
    sizes = {"hidden_size": m.hidden_size, "hidden_size/tp_size": m.hidden_size // d.tp_size,
             "num_key_value_heads*head_dim/tp_size": m.num_key_value_heads * head_dim
             // d.tp_size, "intermediate_size/tp_size": m.intermediate_size // d.tp_size,
             "micro_batch_size*seq_length/cp_size (tokens)": tokens}
    odd = [f"{name}={value}" for name, value in sizes.items() if value % 16]
    if odd:
        problems.append(f"training.fp8 needs the projections' sizes on each rank to be "
                        f"multiples of 16 (FP8 GEMMs), but {', '.join(odd)}; change them or "
                        f"set training.fp8='none'")
    return problems


def fp8_tensor_cores() -> bool:
    """Whether this process sees a GPU with FP8 tensor cores (sm89+: Ada, Hopper and later)."""
    import torch                  # here only: the config modules import nothing heavy at load
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def fp8_auto_choice(config, tensor_cores=None) -> str:
    """What training.fp8="auto" resolves to on a GPU run: FP8 where it measured faster
    (FP8 tensor cores, tp_size 1, and the rest of the config lets FP8 run: no fp8_problems,
    no tp_comm_overlap): "tensorwise_delayed", 1-6% faster than "tensorwise" and as close
    to bf16 in the convergence bench (bench/NOTES.md), from hidden_size FP8_AUTO_MIN_HIDDEN
    eager, FP8_AUTO_MIN_HIDDEN_GRAPHS_DELAYED when the layers replay as CUDA graphs and
    FP8_AUTO_MIN_HIDDEN_COMPILED under training.compile; else "none". Under tensor
    parallelism each cast's amax is all-reduced over the TP group and the GEMMs are 1/tp the
    size: not yet measured on GPUs, so not chosen for the user. `tensor_cores`: whether the GPU
    has FP8 tensor cores, when it is not this process's (None: ask this process's)."""
    d, t = config.distributed, config.training
    if d.tp_size > 1 or d.tp_comm_overlap:
        return "none"
    if not (fp8_tensor_cores() if tensor_cores is None else tensor_cores):
        return "none"
    recipe = "tensorwise_delayed"
    if fp8_problems(dataclasses.replace(config, training=dataclasses.replace(t, fp8=recipe))):
        return "none"
    smallest = (FP8_AUTO_MIN_HIDDEN_COMPILED if t.compile else
                FP8_AUTO_MIN_HIDDEN_GRAPHS_DELAYED if t.cuda_graphs is True else
                FP8_AUTO_MIN_HIDDEN)
    return recipe if config.model.hidden_size >= smallest else "none"


def tp_overlap_problems(config) -> list:
    """distributed.tp_comm_overlap (picotron/tensor_parallel/overlap.py) cuts sequence
    parallelism's collectives into rings along T. At tp_size 1 it does nothing, like
    sequence_parallel itself, so one config serves every layout."""
    d, m, t = config.distributed, config.model, config.training
    problems = []
    if not d.sequence_parallel:
        problems.append("distributed.tp_comm_overlap overlaps sequence parallelism's all-gather "
                        "and reduce-scatter along T with the GEMMs, but sequence_parallel is "
                        "false; set sequence_parallel=true or tp_comm_overlap=false")
    if m.kernels == "liger":
        problems.append("distributed.tp_comm_overlap runs the blocks' projections as its own "
                        "ring GEMMs, which model.kernels='liger' lacks; use 'triton' or 'torch'")
    if t.fp8 != "none":
        problems.append(f"distributed.tp_comm_overlap's ring GEMMs run in the model dtype: "
                        f"training.fp8='{t.fp8}' would not apply to them; set "
                        f"training.fp8='none' or tp_comm_overlap=false")
    return problems


def zero3_problems(config) -> list:
    """zero_stage=3 gathers each layer's parameters in a forward pre-hook and frees them after
    (picotron/data_parallel/zero3.py): what cannot run that way."""
    t = config.training
    problems = []
    if t.cuda_graphs is True:
        problems.append("distributed.zero_stage=3 gathers and frees each layer's parameters "
                        "around its forward and backward, which training.cuda_graphs would "
                        "freeze into a graph; set training.cuda_graphs=false or zero_stage <= 2")
    if t.compile:
        problems.append("distributed.zero_stage=3 runs collectives in each layer's forward "
                        "hooks, which training.compile would trace; set training.compile=false "
                        "or zero_stage <= 2")
    return problems
