"""One decoder-only transformer: Llama by default, PaLM-style by options. Imports only torch.

Shapes use one legend: B batch, T sequence (this rank's share of it), C hidden size,
H query heads, K key/value heads, D head dim (C = H*D), V vocabulary.

Parallelism never appears here. It reaches the model only through its structure:
- projections are separate named `nn.Linear`s (q/k/v/o, gate/up/down) that tensor parallelism
  swaps for sharded ones; head counts are read off the projections' sizes at run time;
- layers live in a dict keyed by their global index ("0".."L-1"), so a pipeline stage keeps a
  subset and every parameter keeps a name that does not depend on the layout;
- `embed_tokens`, `norm` and `lm_head` may be None (pipeline stages without them);
- attention goes through `attention_fn(q, k, v, position_ids)`, which context parallelism
  replaces with ring attention.

Fast paths (`model.kernels`): the norms (alone, or with the residual add before them), the
q/k/v projection with RoPE and the MLP call their op through `self.kernels`, a namespace of
functions. The readable PyTorch versions below are the reference and the default; ops/liger.py
("liger") and ops/fused.py ("triton": fused projections, our Triton kernels) hold the same
functions, tested against the reference.
"""
import types
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from picotron.attention import sdpa_attention
from picotron.ops.recompute import checkpointed


def rms_norm(x, weight, eps: float):
    """x / rms(x) * w, computed in fp32 (as Llama and Hugging Face do), cast back."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def layer_norm(x, weight, eps: float):
    """LayerNorm with a gain and no bias (PaLM: "no biases in dense kernels or layer norms").
    F.layer_norm is already one fused kernel (fp32 statistics) on both kinds of fast path."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), None, eps).to(x.dtype)


def project_qkv(x, attn):
    """x (B, T, C) -> q (B, H, T, D), k and v (B, K, T, D), by the attention's projections.
    -1 heads: under tensor parallelism the projections hold this rank's heads only."""
    B, T, _ = x.shape
    return tuple(proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
                 for proj in (attn.q_proj, attn.k_proj, attn.v_proj))


def qkv_rope(x, attn, cos, sin):
    """The attention's inputs: q, k, v projected from x, RoPE applied to q and k."""
    q, k, v = project_qkv(x, attn)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def swiglu_in(x, mlp):
    """silu(gate(x)) * up(x), the SwiGLU activation (Shazeer 2020), (B, T, C) -> (B, T, I)."""
    return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)


def with_residual(norm_fn):
    """The residual form of a norm: (x, delta, w, eps) -> (h, norm(h)) with h = x + delta, the
    add that ends a layer's attention half and the norm that starts its MLP half."""
    def add_norm(x, delta, weight, eps: float):
        h = x + delta
        return h, norm_fn(h, weight, eps)
    return add_norm


TORCH_KERNELS = types.SimpleNamespace(
    rms_norm=rms_norm, layer_norm=layer_norm, add_rms_norm=with_residual(rms_norm),
    add_layer_norm=with_residual(layer_norm), qkv_rope=qkv_rope, swiglu_in=swiglu_in,
    mlp=lambda x, mlp: mlp.down_proj(swiglu_in(x, mlp)))


def resolve_kernels(name: str, recompute_swiglu: bool = False):
    """The op namespace for `model.kernels`: "torch" (the reference above), "liger" or
    "triton" (recompute_swiglu: its MLP recomputes the SwiGLU output in backward); the fast
    ones import their packages only when asked."""
    if name == "torch":
        return TORCH_KERNELS
    from picotron.ops import fused, liger
    return liger.liger_kernels() if name == "liger" else fused.triton_kernels(recompute_swiglu)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels=TORCH_KERNELS):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, delta=None):
        """norm(x); with `delta`, the residual form (x + delta, norm(x + delta)), one kernel
        on fast paths. Always called as a module: tensor parallelism hooks the norms."""
        if delta is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, delta, self.weight, self.eps)


class LayerNorm(RMSNorm):          # the same gain parameter; a mean-centred norm
    def forward(self, x, delta=None):
        if delta is None:
            return self.kernels.layer_norm(x, self.weight, self.eps)
        return self.kernels.add_layer_norm(x, delta, self.weight, self.eps)


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
    def __init__(self, cfg, attention_fn, kernels=TORCH_KERNELS):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_dim = cfg.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.attention_fn, self.kernels = attention_fn, kernels

    def forward(self, x, cos, sin, position_ids):
        B, T, _ = x.shape
        q, k, v = self.kernels.qkv_rope(x, self, cos, sin)       # (B, H|K, T, D), q k rotated
        out = self.attention_fn(q, k, v, position_ids)                      # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))          # (B, T, C)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg, kernels=TORCH_KERNELS):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels = kernels

    def forward(self, x):
        return self.kernels.mlp(x, self)           # down(silu(gate(x)) * up(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, attention_fn, kernels=TORCH_KERNELS):
        super().__init__()
        norm = NORMS[cfg.norm_type]
        self.parallel_residual = cfg.parallel_residual
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, attention_fn, kernels)
        # PaLM's parallel block feeds one normalised input to both branches.
        self.post_attention_layernorm = (None if cfg.parallel_residual
                                         else norm(cfg.hidden_size, cfg.rms_norm_eps, kernels))
        self.mlp = MLP(cfg, kernels)

    def forward(self, x, delta, cos, sin, position_ids):
        """The residual stream arrives as x + delta, the last add of the layer before left
        undone (delta None for the first layer), and leaves the same way: each add is done by
        the norm that reads its sum (one kernel on fast paths, model.with_residual here)."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm(x, delta)       # x + delta, n1(x + delta)
        if self.parallel_residual:                      # x + attn(n(x)) + mlp(n(x))
            return x, self.self_attn(h, cos, sin, position_ids) + self.mlp(h)
        # x + attn(n1(x)), then + mlp(n2(.)): the first add is done by n2, the second by the
        # next layer's n1 (or the final norm)
        x, h = self.post_attention_layernorm(x, self.self_attn(h, cos, sin, position_ids))
        return x, self.mlp(h)


class Decoder(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); on a middle pipeline stage, hidden (B, T, C) in
    and out. `head=False` stops after the final norm: the loss then applies the head itself
    (picotron/ops/loss.py), so the (B, T, V) logits never exist at once.

    `checkpointing` (training.activation_checkpointing) is what each of the model's first
    `checkpointed_layers` layers (all by default) keeps for backward, the others keeping
    everything: "none" everything; "full" only its input, the layer is recomputed in
    backward; "selective" the outputs of its matmuls and attention, the cheap ops are
    recomputed (picotron/ops/recompute.py); with our Triton kernels that is done inside the
    MLP, not by torch's checkpoint (the SwiGLU output, picotron/ops/triton_swiglu.py)."""

    def __init__(self, cfg, attention_fn=sdpa_attention, checkpointing: str = "none",
                 checkpointed_layers=None):
        super().__init__()
        ours = checkpointing == "selective" and cfg.kernels == "triton"
        n = cfg.num_hidden_layers if checkpointed_layers is None else checkpointed_layers
        self.cfg, self.checkpointing = cfg, "none" if ours else checkpointing
        # the keys of the layers that run under torch's checkpoint (recompute.checkpointed)
        self.checkpointed = {str(i) for i in range(n) if self.checkpointing != "none"}
        kernels, recomputing = resolve_kernels(cfg.kernels), resolve_kernels(cfg.kernels, ours)
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, attention_fn,
                                                          recomputing if i < n else kernels)
                                     for i in range(cfg.num_hidden_layers)})
        self.norm = NORMS[cfg.norm_type](cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:     # one weight; named once, as "embed_tokens.weight"
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x, position_ids=None, layers=None, head: bool = True):
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
        x, delta = self.run_layers(keys, x, cos, sin, position_ids)
        if str(self.cfg.num_hidden_layers - 1) not in keys:     # not the end of the model yet
            return x if delta is None else x + delta    # one tensor to the next stage
        if self.norm is not None:       # held with the last layer, by the last stage
            x = self.norm(x) if delta is None else self.norm(x, delta)[1]
        if self.lm_head is not None and head:
            x = self.lm_head(x)                                            # (B, T, V)
        return x

    def run_layers(self, keys, x, cos, sin, position_ids):
        """The layers named by `keys`, in order: (B, T, C) -> the residual stream as (x, delta)
        (delta None after no layer). training.cuda_graphs replaces this method on the
        instance by one that replays a captured graph (picotron/ops/cuda_graphs.py)."""
        delta = None                        # the residual stream is x + delta (see the layer)
        for key in keys:
            layer = self.layers[key]
            if key not in self.checkpointed or not torch.is_grad_enabled():
                x, delta = layer(x, delta, cos, sin, position_ids)
                continue
            if self.checkpointing == "full" and delta is not None:
                x, delta = x + delta, None      # "full" keeps one (B, T, C) input, not two
            x, delta = checkpointed(layer, self.checkpointing, x, delta, cos, sin, position_ids)
        return x, delta


def causal_lm_loss(logits, targets):
    """Mean cross-entropy over all tokens, in fp32. logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


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


def materialize(model: nn.Module, seed: int, device, dtype, std: float = 0.02) -> nn.Module:
    """Replace every meta parameter by its initial value, one parameter at a time.

    A parameter that holds a slice of a larger tensor (tensor parallelism) carries
    `param.full_shape` and `param.local_slice` (a tuple of slices): the full tensor is drawn,
    this rank keeps its slice, and the rest is freed before the next parameter. A parameter
    that carries `tied_name` (the last pipeline stage's copy of a tied embedding) is drawn
    under that name, so it starts equal to the original."""
    new = {}
    for name, p in model.named_parameters():            # tied weights appear once
        module = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        full_shape = getattr(p, "full_shape", p.shape)
        value = init_full_tensor(getattr(p, "tied_name", name), full_shape,
                                 isinstance(module, tuple(NORMS.values())), seed, std)
        value = value[getattr(p, "local_slice", ())]
        param = nn.Parameter(value.to(device=device, dtype=dtype))
        param.__dict__.update(vars(p))       # what parallelism marked on it: slices, groups
        new[id(p)] = param
    for module in model.modules():                      # swap in place, both ends of a tie
        for pname, p in module._parameters.items():
            if p is not None and id(p) in new:
                module._parameters[pname] = new[id(p)]
    return model
