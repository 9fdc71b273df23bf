"""Typed run configuration: load from JSON, validate with clear errors, save.

One `Config` of six sections. Every key is a dataclass field, so an unknown key or a value
of the wrong type is refused at load time, and every impossible layout is refused before a
single process group exists. `create_config.py` writes through these same types, so what it
writes always loads.
"""
import copy
import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from typing import Optional

from picotron.config_checks import layout_errors   # the checks live beside, by idea


class ConfigError(ValueError):
    """A config that cannot run. The message names every problem and its fix."""


class MissingPackage(ImportError):
    """The config asks for an optional package (a fast path, a logger) that this machine
    cannot import. Raised when the run is built, before any step; the entry points print it
    without a traceback, as a ConfigError."""

    def __init__(self, option: str, package: str, fallback: str, error: Exception):
        super().__init__(f"{option} needs {package}, which cannot be imported here ({error}); "
                         f"{fallback}")


@dataclass
class DistributedConfig:
    dp_size: int = 1            # data parallel: replicas that split the global batch
    tp_size: int = 1            # tensor parallel: shards of every weight matrix (Megatron)
    pp_size: int = 1            # pipeline parallel: stages of consecutive layers
    cp_size: int = 1            # context parallel: shards of every sequence (ring attention)
    cp_mode: str = "ring"       # ring: K/V pass around the ring | ulysses: all-to-all over heads
    pp_engine: str = "1f1b"     # pipeline schedule: afab | 1f1b | interleaved
    pp_virtual_stages: int = 2  # interleaved only: model chunks per pp rank (Megatron's v)
    use_cpu: bool = False       # gloo on CPU processes instead of NCCL on GPUs
    zero_stage: int = 0         # 0: plain DP, 1: shard optimizer state, 2: and gradients
    bucket_size_mb: float = 25.0     # gradient bucket size for the overlapped all-reduce
    overlap_grad_reduce: bool = True  # start each bucket's reduction during backward (false:
                                      # all of them after backward; for measuring the overlap)
    offload_optim_frac: float = 0.0  # fraction of optimizer state kept and stepped on the CPU
    sequence_parallel: bool = False  # with tp: shard norms/residuals along T (Korthikanti 22)
    timeout_s: float = 300.0    # a collective or p2p transfer waiting longer fails the run


@dataclass
class ModelConfig:
    # Field names follow Hugging Face's LlamaConfig so a model's config.json maps 1:1.
    name: str = "debug"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # PaLM-style options (Chowdhery et al. 2022, section 2).
    parallel_residual: bool = False   # x + attn(norm(x)) + mlp(norm(x)) with one shared norm
    norm_type: str = "rmsnorm"        # rmsnorm | layernorm (LayerNorm without bias, as PaLM)
    # auto: flash-attn when installed and on GPU, else sdpa; eager: the plain softmax(QK^T)V.
    attn_implementation: str = "auto"
    # auto: "triton" on GPUs ("torch" with training.compile), "torch" on CPU | torch: the
    # readable PyTorch ops (reference) | liger: liger-kernel's Triton RMSNorm, RoPE and SwiGLU
    # (CUDA) | triton: our Triton kernels, fused q/k/v and gate/up projections (CUDA);
    # applied by picotron/speed/kernels.py
    kernels: str = "auto"


@dataclass
class TrainingConfig:
    seed: int = 42
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1          # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 10
    total_train_steps: int = 200
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    seq_length: int = 256
    max_grad_norm: float = 1.0         # 0 disables clipping (the norm is still logged)
    weight_decay: float = 0.1          # applied to matrices only, not norms
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    dtype: str = "bfloat16"            # float32 | bfloat16 | float16: parameters, activations
    master_weights: bool = True        # fp32 master weights and AdamW moments (bf16/fp16)
    initial_loss_scale: float = 65536.0  # float16 only: dynamic loss scaling
    loss_scale_window: int = 1000      # good steps before the loss scale doubles
    use_fused_adam: bool = True        # one-pass Triton AdamW on CUDA (ignored on CPU)
    val_frequency: int = 0             # steps between val_loss evaluations; 0: never
    # auto: "triton" on GPUs without tensor parallelism, else "none" | none: logits, then
    # cross-entropy (reference) | chunked: head + loss a chunk of tokens at a time, plain
    # PyTorch | liger: the same with liger-kernel | triton: the same with our Triton kernel,
    # no host sync (picotron/speed/loss.py)
    fused_loss: str = "auto"
    # tokens per chunk of the "chunked" and "triton" losses; 0: 4096 (loss.default_rows says
    # why). Larger chunks: more memory, fewer passes over the fp32 head-gradient accumulator
    loss_chunk_tokens: int = 0
    # auto: "selective" with model.kernels=triton, else "none" | none | full | selective
    # (picotron/speed/recompute.py; with kernels=triton, "selective" recomputes the SwiGLU
    # output in the MLP's backward)
    activation_checkpointing: str = "auto"
    # the layers that use it: the model's first N (layers 0..N-1, on whichever pipeline stage
    # holds them); null: all. The others keep every activation, so N trades memory for the
    # recomputation of N layers (Megatron's recompute_num_layers, counted over the model)
    activation_checkpointing_layers: Optional[int] = None
    compile: bool = False              # torch.compile each decoder layer
    cuda_graphs: bool = False          # replay the layers' forward/backward as CUDA graphs


@dataclass
class DatasetConfig:
    # "embedded": text of this Python's standard library, byte-level (needs no download).
    # "synthetic": random tokens drawn from the seed and the sample index.
    # Anything else: a Hugging Face dataset id or a local path (directory, or text / json /
    # jsonl / parquet / arrow files), tokenized once (picotron/tokenized_data.py).
    name: str = "embedded"
    subset_name: Optional[str] = None
    split: str = "train"
    text_column: str = "text"
    num_samples: Optional[int] = None  # rows (documents) kept; windows for "embedded"
    num_proc: int = 1                  # processes that tokenize (datasets.map)
    tokenizer: Optional[str] = None    # None: the model's tokenizer, "byte": byte-level
    val_split: Optional[str] = None    # held-out split; None: carve val_samples off the end
    val_samples: int = 0               # validation windows (seq_length+1 tokens); 0: none


@dataclass
class CheckpointConfig:
    save_dir: str = "checkpoints"      # relative paths are resolved against the run dir
    save_frequency: int = 0            # steps between checkpoints (and the last); 0: never
    keep_last: int = 0                 # checkpoints kept, oldest deleted first; 0: keep all
    load_path: Optional[str] = None    # resume: a checkpoint directory or "latest"
    init_from: Optional[str] = None    # Hugging Face weights (dir or hub id) to start from


@dataclass
class LoggingConfig:
    run_dir: Optional[str] = None      # default: the folder holding the config file
    log_frequency: int = 1
    use_wandb: bool = False
    project_name: str = "picotron"
    run_name: Optional[str] = None


@dataclass
class Config:
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def world_size(self) -> int:
        d = self.distributed
        return d.dp_size * d.tp_size * d.pp_size * d.cp_size

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step, summed over micro-batches and DP replicas."""
        t = self.training
        return t.micro_batch_size * t.gradient_accumulation_steps * self.distributed.dp_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def _type_ok(value, hint) -> bool:
    if typing.get_origin(hint) is typing.Union:          # Optional[X]
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:                                      # JSON writes 1e-4 or 3 alike
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) is typing.Union:
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return "null" if hint is type(None) else hint.__name__


def _build_section(cls, raw, section: str, errors: list):
    if not isinstance(raw, dict):
        errors.append(f"'{section}' must be a JSON object, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in hints:
            near = difflib.get_close_matches(key, hints, n=1)
            hint = f" (did you mean '{section}.{near[0]}'?)" if near else ""
            errors.append(f"unknown key '{section}.{key}'{hint}; valid keys: {', '.join(hints)}")
        elif not _type_ok(value, hints[key]):
            errors.append(f"'{section}.{key}' must be {_type_name(hints[key])}, "
                          f"got {value!r} ({type(value).__name__})")
        else:
            kwargs[key] = float(value) if hints[key] is float else value
    return cls(**kwargs)


def config_from_dict(raw: dict, world_size: Optional[int] = None,
                     resolve: bool = True) -> Config:
    """Build and validate a Config; raise one ConfigError listing every problem. Its "auto"
    options are resolved (resolve_auto) unless `resolve` is false (create_config.py writes
    them as "auto"); the checks always see them resolved."""
    errors = []
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a JSON object, got {type(raw).__name__}")
    sections = {f.name: f.type for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    built = {}
    for key, value in raw.items():
        if key not in sections:
            errors.append(f"unknown section '{key}'; valid sections: {', '.join(sections)}")
        else:
            built[key] = _build_section(hints[key], value, key, errors)
    config = Config(**built)
    resolved = copy.deepcopy(config)
    if not errors:
        resolve_auto(resolved)
    errors += layout_errors(resolved, world_size)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return resolved if resolve else config


def resolve_auto(config: Config) -> None:
    """Replace each "auto" speed option by the fastest measured path that fits the layout
    (bench/NOTES.md has the measurements); on CPU, by the readable reference. What was chosen
    is recorded in `config.auto_resolved`, for the run's first line (a second call, finding
    nothing left to choose, keeps that record).

    On a GPU: our Triton kernels with "selective" recomputation (the SwiGLU output recomputed
    inside the MLP: the speed of no recomputation at a fraction of the memory) and the Triton
    fused loss, except that under tensor parallelism the loss is the vocab-parallel one (it
    never gathers the logits either), and that with training.compile the compiler gets the
    readable ops to fuse."""
    m, t = config.model, config.training
    gpu = not config.distributed.use_cpu
    chosen = {}
    if m.kernels == "auto":
        m.kernels = chosen["model.kernels"] = "triton" if gpu and not t.compile else "torch"
    if t.fused_loss == "auto":
        fits = gpu and config.distributed.tp_size == 1
        t.fused_loss = chosen["training.fused_loss"] = "triton" if fits else "none"
    if t.activation_checkpointing == "auto":
        ours = gpu and m.kernels == "triton"
        t.activation_checkpointing = chosen["training.activation_checkpointing"] = (
            "selective" if ours else "none")
    config.auto_resolved = {**getattr(config, "auto_resolved", {}), **chosen}


def load_config(path: str, world_size: Optional[int] = None) -> Config:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist; write one with "
                          f"`python create_config.py --out_dir tmp --exp_name NAME`") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid JSON: {e}") from None
    return config_from_dict(raw, world_size)
