"""model.py against Hugging Face's Llama and against the PaLM-style formulas written out here."""
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
import transformers

from picotron.attention import eager_attention, flash_attention, sdpa_attention
from picotron.config import ModelConfig
from picotron.loss import causal_lm_loss
from picotron.model import Decoder, materialize

# Odd sizes on purpose: 7 query heads of dim 6 over 1 kv head would hide a GQA indexing bug
# that 4 over 2 can also hide; 3 kv heads of 2 query heads each do not.
TINY = dict(vocab_size=97, hidden_size=36, intermediate_size=70, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64,
            rope_theta=5000.0, rms_norm_eps=1e-6)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def build_pair(tied: bool, kv_heads: int):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**{**TINY, "num_key_value_heads": kv_heads},
                                      tie_word_embeddings=tied, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_cfg).float()
    with torch.no_grad():            # HF inits norms to 1: perturb so the gains are tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    ours = Decoder(ModelConfig(**{**TINY, "num_key_value_heads": kv_heads},
                               tie_word_embeddings=tied), attention_fn=sdpa_attention)
    hf_state = hf.state_dict()
    if tied:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    missing = ours.load_state_dict({k.removeprefix("model."): v for k, v in hf_state.items()},
                                   strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return hf, ours


@pytest.mark.parametrize("tied,kv_heads", [(False, 3), (True, 3), (False, 1), (True, 6)])
def test_matches_hf_llama_logits_and_grads(tied, kv_heads):
    hf, ours = build_pair(tied, kv_heads)
    ids = torch.randint(0, TINY["vocab_size"], (2, 29))
    targets = torch.randint(0, TINY["vocab_size"], (2, 29))
    hf_logits = hf(ids).logits
    our_logits = ours(ids)
    assert rel_err(our_logits, hf_logits) < 1e-5
    F.cross_entropy(hf_logits.flatten(0, 1), targets.flatten()).backward()
    causal_lm_loss(our_logits, targets).backward()
    hf_grads = {k.removeprefix("model."): p.grad for k, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, hf_grads[name]) < 1e-5, name


def test_attention_implementations_agree():
    q = torch.randn(2, 6, 17, 8)
    k, v = torch.randn(2, 2, 17, 8), torch.randn(2, 2, 17, 8)
    assert rel_err(sdpa_attention(q, k, v), eager_attention(q, k, v)) < 1e-5


def test_flash_attention_wrapper_hands_over_its_layout(monkeypatch):
    """No flash-attn build runs here (nor on the device): what is ours is the wrapper, which
    must hand flash_attn_func (B, T, H, D) tensors, causal, and turn its output back to
    (B, H, T, D). A stand-in flash_attn that checks its inputs' layout and computes with the
    reference shows that; T (17) differs from H (6) and K (2), so a transpose missed either
    way fails on shapes or values."""
    def flash_attn_func(q, k, v, causal=False):
        assert causal and q.shape == (2, 17, 6, 8) and k.shape == v.shape == (2, 17, 2, 8)
        out = eager_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)                                      # (B, T, H, D)
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_func=flash_attn_func))
    q = torch.randn(2, 6, 17, 8)
    k, v = torch.randn(2, 2, 17, 8), torch.randn(2, 2, 17, 8)
    assert rel_err(flash_attention(q, k, v), eager_attention(q, k, v)) < 1e-6


def palm_reference(params, ids, cfg):
    """PaLM-style block from the formulas: y = x + Attn(LN(x)) + MLP(LN(x)), LayerNorm without
    bias, one shared kv head, SwiGLU, RoPE, logits through the (tied) embedding matrix."""
    H, C = cfg.num_attention_heads, cfg.hidden_size
    D = C // H
    B, T = ids.shape
    x = params["embed_tokens.weight"][ids]
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)            # (T, D)

    def rope(t):                                                 # t (B, heads, T, D)
        return t * ang.cos() + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * ang.sin()

    def ln(t, w):
        mu, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        return (t - mu) / torch.sqrt(var + cfg.rms_norm_eps) * w

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_hidden_layers):
        p = {k.split(f"layers.{i}.", 1)[1]: v for k, v in params.items()
             if k.startswith(f"layers.{i}.")}
        h = ln(x, p["input_layernorm.weight"])
        q = rope((h @ p["self_attn.q_proj.weight"].T).view(B, T, H, D).transpose(1, 2))
        k = rope((h @ p["self_attn.k_proj.weight"].T).view(B, T, 1, D).transpose(1, 2))
        v = (h @ p["self_attn.v_proj.weight"].T).view(B, T, 1, D).transpose(1, 2)
        s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~causal, float("-inf"))
        att = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        gate, up = h @ p["mlp.gate_proj.weight"].T, h @ p["mlp.up_proj.weight"].T
        mlp = (gate * torch.sigmoid(gate) * up) @ p["mlp.down_proj.weight"].T
        x = x + att @ p["self_attn.o_proj.weight"].T + mlp
    return ln(x, params["norm.weight"]) @ params["embed_tokens.weight"].T


def test_palm_style_matches_formulas():
    cfg = ModelConfig(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True,
                      parallel_residual=True, norm_type="layernorm")
    with torch.device("meta"):
        model = Decoder(cfg, attention_fn=eager_attention)
    materialize(model, seed=3, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and not any("post_attention" in n for n in names)
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    params64 = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    ref = palm_reference(params64, ids, cfg)
    out = model(ids)
    assert rel_err(out.double(), ref) < 1e-5
    targets = torch.randint(0, cfg.vocab_size, (2, 23))
    causal_lm_loss(out, targets).backward()
    F.cross_entropy(ref.flatten(0, 1), targets.flatten()).backward()
    for name, p in model.named_parameters():
        assert rel_err(p.grad.double(), params64[name].grad) < 1e-5, name


def test_init_is_layout_independent():
    """A rank holding rows [a, b) of a weight gets exactly those rows of the full tensor."""
    cfg = ModelConfig(**TINY)
    with torch.device("meta"):
        full, sliced = Decoder(cfg), Decoder(cfg)
    p = sliced.layers["1"].mlp.gate_proj.weight
    p.full_shape, p.local_slice = p.shape, (slice(35, 70),)
    materialize(full, seed=7, device="cpu", dtype=torch.float32)
    materialize(sliced, seed=7, device="cpu", dtype=torch.float32)
    got = sliced.layers["1"].mlp.gate_proj.weight
    assert got.shape == (35, TINY["hidden_size"]) and got.full_shape == (70, TINY["hidden_size"])
    assert torch.equal(got, full.layers["1"].mlp.gate_proj.weight[35:70])
    # Different parameters get different streams; the same seed gives the same weights.
    assert not torch.equal(full.layers["0"].mlp.gate_proj.weight,
                           full.layers["1"].mlp.gate_proj.weight)
    with torch.device("meta"):
        again = Decoder(cfg)
    materialize(again, seed=7, device="cpu", dtype=torch.float32)
    for (n, a), (_, b) in zip(full.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


def test_tied_weights_stay_tied_after_materialize():
    cfg = ModelConfig(**TINY, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Decoder(cfg)
    materialize(model, seed=0, device="cpu", dtype=torch.float32)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.embed_tokens.weight.device.type == "cpu"


def test_cuda_graph_routing_runs_the_stack_in_training_only(monkeypatch):
    """CPU check of training.cuda_graphs' wiring (the capture itself needs a GPU:
    tests/test_cuda_graphs_gpu.py): with make_graphed_callables standing in as the identity,
    a training forward of the captured shape goes through the one LayerStack call and gives
    the eager loss and gradients exactly; eval, no-grad and other shapes run the eager layers."""
    from picotron.config import Config
    from picotron.speed import cuda_graphs
    config = Config()
    config.model = ModelConfig(**TINY)
    config.training.micro_batch_size, config.training.seq_length = 2, 11
    model = materialize(Decoder(config.model, sdpa_attention), 0, "cpu", torch.float32)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))

    def loss_and_grads():
        model.zero_grad()
        loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]
    eager = loss_and_grads()
    calls = []
    monkeypatch.setattr(torch.cuda, "make_graphed_callables",
                        lambda stack, args: calls.append(args) or stack)
    cuda_graphs.capture_layers(model, config, "cpu", None)        # no gradient buckets here
    stack_calls = []
    original = cuda_graphs.LayerStack.forward
    monkeypatch.setattr(cuda_graphs.LayerStack, "forward",
                        lambda self, *a: stack_calls.append(a[0].shape) or original(self, *a))
    graphed = loss_and_grads()
    assert len(calls) == 1 and [tuple(a.shape) for a in calls[0][:1]] == [(2, 11, 36)]
    assert stack_calls == [(2, 11, 36)]
    assert torch.equal(graphed[0], eager[0])
    assert all(torch.equal(g, e) for g, e in zip(graphed[1], eager[1]))
    model.eval()
    model(ids[:, :-1])                                  # eval: eager layers
    model.train()
    with torch.no_grad():
        model(ids[:, :-1])                              # no autograd: eager layers
    model(ids[:, :-2])                                  # another length: eager layers
    assert stack_calls == [(2, 11, 36)]
