"""The fields of the run configuration, one dataclass per section, each with its default
and what it means.

picotron/config/config.py assembles them into `Config`, loads and validates a file; this module is
the reference of every key (docs/config.md is generated from it and help.json).
"""
from dataclasses import dataclass, field
from typing import Optional, Union

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
    share_gpu: bool = False     # every rank on cuda:0 over gloo: layouts checked on one GPU
                                # against one process (slow: tokens/s and MFU mean nothing)
    zero_stage: int = 0         # 0: plain DP, 1: shard optimizer state, 2: and gradients,
                                # 3: and parameters (gathered layer by layer, zero3.py)
    zero3_keep_params: bool = False  # ZeRO-3: keep a layer gathered from its forward to the
                                     # end of the step (no second gather before backward)
    bucket_size_mb: float = 25.0     # gradient bucket size for the overlapped all-reduce
    overlap_grad_reduce: bool = True  # start each bucket's reduction during backward (false:
                                      # all of them after backward; for measuring the overlap)
    overlap_param_gather: bool = True  # ZeRO-1/2: each block waits for its own parameters'
                                       # all-gather in the next forward (false: all at once)
    grad_reduce_dtype: str = "float32"  # the gradients' dtype on the wire (their cp_dp sum):
                                        # float32 | bfloat16 (half the bytes, rounded once)
    offload_optim_frac: float = 0.0  # fraction of optimizer state kept and stepped on the CPU
    sequence_parallel: bool = False  # with tp: shard norms/residuals along T (Korthikanti 22)
    tp_comm_overlap: bool = False    # with sequence_parallel: each block's all-gather and
                                     # reduce-scatter as rings overlapped with its GEMMs
    timeout_s: float = 300.0    # a collective or p2p transfer waiting longer fails the run
    # a rank silent this long is dead or frozen: every other rank stops, naming it
    # (picotron/run/watchdog.py); None: min(60, timeout_s / 2); below timeout_s / 1.25
    heartbeat_s: Optional[float] = None
    # with use_cpu: intra-op threads per process; None: cores // processes on this machine
    # (picotron/utils.py's cpu_threads)
    cpu_threads: Optional[int] = None


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
    # applied by picotron/speed/kernels/swap.py
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
    # the run stops (with a message, no checkpoint) after this many steps in a row skipped
    # for a non-finite gradient; 0: never. fp16's first steps may skip a few while the loss
    # scale finds its level (one halving per skip from 2^16)
    max_skipped_steps: int = 25
    # the run stops (with a message naming the last checkpoint before it) when the loss stays
    # above divergence_factor x its best for divergence_steps steps in a row; factor 0: never
    divergence_factor: float = 3.0
    divergence_steps: int = 20
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
    # true | false | auto: replay the decoder layers' forward and backward as CUDA graphs
    # (picotron/speed/cuda_graphs.py). "auto": on for one-GPU runs below hidden_size 2048
    # whose config allows them (features.cuda_graphs_auto_choice), else off
    cuda_graphs: Union[bool, str] = "auto"
    # auto | none | tensorwise | tensorwise_delayed | rowwise | rowwise_bf16_dw: the decoder
    # layers' projection GEMMs in FP8, one scale per tensor (current, or from the previous
    # step's amaxes: speed/fp8/delayed.py) or per row, the last with the weight-gradient GEMM
    # in bf16 (picotron/speed/fp8/linear.py); GPUs with FP8 tensor cores (sm89+) only. "auto":
    # tensorwise_delayed where FP8 measured faster (features.fp8_auto_choice), else none
    fp8: str = "auto"


@dataclass
class DatasetConfig:
    # "embedded": text of this Python's standard library, byte-level (needs no download).
    # "synthetic": random tokens drawn from the seed and the sample index.
    # Anything else: a Hugging Face dataset id or a local path (directory, or text / json /
    # jsonl / parquet / arrow files), tokenized once (picotron/data/tokenized.py).
    name: str = "embedded"
    subset_name: Optional[str] = None
    split: str = "train"
    text_column: str = "text"
    num_samples: Optional[int] = None  # rows (documents) kept; windows for "embedded" and
                                       # byte ranges
    num_proc: int = 1                  # processes that tokenize (datasets.map)
    tokenizer: Optional[str] = None    # None: the model's tokenizer, "byte": byte-level
    val_split: Optional[str] = None    # held-out split; None: carve val_samples off the end
    val_samples: int = 0               # validation windows (seq_length+1 tokens); 0: none
    # a local file read as raw bytes, one stream (token = byte value, no documents: enwik8):
    # [start, stop) of the file trains, val_byte_range's bytes validate (picotron/data/windows.py)
    byte_range: Optional[list] = None
    val_byte_range: Optional[list] = None
    # the token cache shared by runs (picotron/data/token_cache.py); null: the user's cache folder
    # ($XDG_CACHE_HOME or ~/.cache, then picotron/tokenized); relative: from the run dir
    cache_dir: Optional[str] = None
    # the cache's size cap: writing an entry removes the least recently used ones past it
    # (never one used in the last hour: a starting run may be about to read it); 0: no cap
    cache_max_gb: float = 100.0

    @property
    def raw_bytes(self) -> bool:
        """Read as bytes, never tokenized: the embedded corpus or a file's byte range."""
        return self.name == "embedded" or self.byte_range is not None


@dataclass
class CheckpointConfig:
    save_dir: str = "checkpoints"      # relative paths are resolved against the run dir
    save_frequency: int = 0            # steps between checkpoints (and the last); 0: none
    save_final: bool = True            # the last step is saved even when save_frequency is 0
    save_on_sigterm: bool = True       # SIGTERM (a scheduler's notice): save, then exit 143
    keep_last: int = 0                 # checkpoints kept, oldest deleted first; 0: keep all
    load_path: Optional[str] = None    # resume: a checkpoint directory or "latest"
    init_from: Optional[str] = None    # Hugging Face weights (dir or hub id) to start from
    # resume: settings that may differ from the checkpoint's although they change the run
    # (names in checks.RESUME_CHANGES, e.g. ["training.seed"]); recorded in its state
    allow_changes: list = field(default_factory=list)
    async_save: bool = False           # write checkpoint files in a background thread


@dataclass
class LoggingConfig:
    run_dir: Optional[str] = None      # default: the folder holding the config file
    log_frequency: int = 1
    use_wandb: bool = False
    tensorboard: bool = False          # also write scalars to <run dir>/tensorboard/
    project_name: str = "picotron"
    run_name: Optional[str] = None
