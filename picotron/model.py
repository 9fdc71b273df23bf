"""One decoder-only transformer: Llama by default, PaLM-style by options.

Shapes use one legend: B batch, T sequence (this rank's share of it), C hidden size,
H query heads, K key/value heads, D head dim (C = H*D), I MLP width, V vocabulary.

A layer is two residual branches, x = x + attn(norm(x)) then x = x + mlp(norm(x)) (Llama),
or one, x = x + attn(norm(x)) + mlp(norm(x)) with a single norm (PaLM's parallel block).

Parallelism never appears here. It reaches the model only through its structure:
- projections are separate named `nn.Linear`s (q/k/v/o, gate/up/down) that tensor parallelism
  swaps for sharded ones; head counts are read off the projections' sizes at run time;
- layers live in a dict keyed by their global index ("0".."L-1"), so a pipeline stage keeps a
  subset and every parameter keeps a name that does not depend on the layout;
- `embed_tokens`, `norm` and `lm_head` may be None (pipeline stages without them);
- attention goes through `attention_fn(q, k, v)`, which context parallelism replaces with
  ring attention or Ulysses (`distributed.cp_mode`).
"""
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from picotron.attention import sdpa_attention


def rms_norm(x, weight, eps: float):
    """x / rms(x) * w, with the statistics in fp32 (as Llama and Hugging Face do)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def layer_norm(x, weight, eps: float):
    """LayerNorm with a gain and no bias (PaLM has no biases in its dense layers or its norms),
    computed in fp32."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(RMSNorm):          # the same gain parameter; a mean-centred norm
    def forward(self, x):
        return layer_norm(x, self.weight, self.eps)


NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}


def rope_cos_sin(position_ids, head_dim: int, theta: float, dtype):
    """cos, sin of shape (B, T, D) for rotary embeddings (Su et al. 2021), computed in fp32.

    position_ids (B, T) are the tokens' true positions, which need not be 0..T-1: under
    context parallelism a rank holds two distant chunks of the sequence."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.float32) / head_dim))   # (D/2,)
    freqs = position_ids.float()[..., None] * inv_freq                          # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                      # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate pairs (x_i, x_{i+D/2}) by position-dependent angles. x: (B, H, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, cfg, attention_fn):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_dim = cfg.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.attention_fn = attention_fn

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism the projections hold this rank's heads only
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)      # (B, K, T, D)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)      # (B, K, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attention_fn(q, k, v)                                      # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))            # (B, T, C)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)), (B, T, C) -> (B, T, I) -> (B, T, C)."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, attention_fn):
        super().__init__()
        norm = NORMS[cfg.norm_type]
        self.parallel_residual = cfg.parallel_residual
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, attention_fn)
        # PaLM's parallel block feeds one normalised input to both branches.
        self.post_attention_layernorm = (None if cfg.parallel_residual
                                         else norm(cfg.hidden_size, cfg.rms_norm_eps))
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        h = self.input_layernorm(x)
        if self.parallel_residual:
            return x + self.self_attn(h, cos, sin) + self.mlp(h)
        x = x + self.self_attn(h, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); on a middle pipeline stage, hidden (B, T, C) in
    and out."""

    def __init__(self, cfg, attention_fn=sdpa_attention):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, attention_fn)
                                     for i in range(cfg.num_hidden_layers)})
        self.norm = NORMS[cfg.norm_type](cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:     # one weight; named once, as "embed_tokens.weight"
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x, position_ids=None, layers=None):
        """`layers`: keys of the layers to run, default all held here. A pipeline rank holding
        several chunks (interleaved schedule) runs one per call: token ids go through the
        embedding, hidden states do not; the norm and head run after the model's last layer."""
        keys = list(self.layers) if layers is None else layers
        if self.embed_tokens is not None and not torch.is_floating_point(x):
            x = self.embed_tokens(x)                                       # (B, T, C)
        B, T, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=x.device).expand(B, T)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.cfg.rope_theta, x.dtype)
        x = self.run_layers(keys, x, cos, sin)
        if str(self.cfg.num_hidden_layers - 1) not in keys:     # not the end of the model yet
            return x                                            # (B, T, C) to the next stage
        if self.norm is not None:       # held with the last layer, by the last stage
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)                                            # (B, T, V)
        return x

    def run_layers(self, keys, x, cos, sin):
        """The layers named by `keys`, in order: (B, T, C) -> (B, T, C). A method of its own
        so that a plug-in (CUDA graphs, picotron/speed) can replace the layer loop on the
        instance; the model runs its layers through nothing else."""
        for key in keys:
            x = self.layers[key](x, cos, sin)
        return x


def param_seed(seed: int, name: str) -> int:
    """Each full parameter has its own stream, from the run's seed and its layout-free name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def init_full_tensor(name: str, shape, is_norm: bool, seed: int, std: float):
    """The full (unsharded) initial value of one parameter, drawn on the CPU in fp32 so that
    every layout and every device starts from the same numbers."""
    if is_norm:
        return torch.ones(shape)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)


def initial_values(model: nn.Module, seed: int, std: float = 0.02):
    """Yield (parameter, its initial value) one parameter at a time, the value fp32 on the CPU.

    A parameter that holds a slice of a larger tensor (tensor parallelism) carries
    `param.full_shape` and `param.local_slice` (a tuple of slices): the full tensor is drawn,
    and the value is this rank's slice; the rest is freed before the next parameter. A
    parameter that carries `tied_name` (the last pipeline stage's copy of a tied embedding) is
    drawn under that name, so it starts equal to the original."""
    for name, p in model.named_parameters():            # tied weights appear once
        module = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        full_shape = getattr(p, "full_shape", p.shape)
        value = init_full_tensor(getattr(p, "tied_name", name), full_shape,
                                 isinstance(module, tuple(NORMS.values())), seed, std)
        yield p, value[getattr(p, "local_slice", ())]


def materialize(model: nn.Module, seed: int, device, dtype, std: float = 0.02) -> nn.Module:
    """Replace every meta parameter by its initial value (`initial_values`), one at a time."""
    new = {}
    for p, value in initial_values(model, seed, std):
        param = nn.Parameter(value.to(device=device, dtype=dtype))
        param.__dict__.update(vars(p))       # what parallelism marked on it: slices, groups
        new[id(p)] = param
    return replace_parameters(model, new)


def replace_parameters(model: nn.Module, new: dict) -> nn.Module:
    """Swap each parameter p for new[id(p)] in every module that holds it (both ends of a tie)."""
    for module in model.modules():
        for pname, p in module._parameters.items():
            if p is not None and id(p) in new:
                module._parameters[pname] = new[id(p)]
    return model
