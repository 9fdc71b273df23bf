"""The whole model with `model.kernels = "triton"` against the readable reference, in fp32.

On CPU the Triton kernels run in Triton's interpreter (tests/conftest.py), so CI checks the
wiring (fused q/k/v and gate/up projections, packed RoPE and SwiGLU, the norms) end to end on
Llama and on the PaLM-style options (LayerNorm, parallel residual, multi-query attention),
with head dims that are not powers of two, and each activation checkpointing mode ("selective"
is the MLP's SwiGLU output recomputed inside swiglu_linear). fp32 throughout: the same math in
another order, so the loss and every gradient agree to 1e-5 relative.
tests/test_kernels_gpu.py runs the bf16 version of this at 360M's widths on a GPU.
"""
import pytest
import torch

from tiny import import_triton
import_triton()
from picotron.config import ModelConfig  # noqa: E402
from picotron.loss import causal_lm_loss  # noqa: E402
from speed_helpers import build_with_speed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLAMA = dict(hidden_size=36, intermediate_size=52, num_attention_heads=6,
             num_key_value_heads=2)
PALM = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1,
            norm_type="layernorm", parallel_residual=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [LLAMA, PALM], ids=["llama", "palm"])
@pytest.mark.parametrize("checkpointing, layers", [("none", None), ("full", None),
                                                   ("selective", None), ("full", 1),
                                                   ("selective", 1)])
def test_triton_kernels_match_reference(shape, checkpointing, layers):
    """layers=1: training.activation_checkpointing_layers, only layer 0 of 2 checkpointed
    (with "selective", only its MLP recomputes the SwiGLU output)."""
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = {}
    for kernels, ckpt in (("torch", "none"), ("triton", checkpointing)):
        model, _ = build_with_speed(dict(vocab_size=97, num_hidden_layers=2,
                                         tie_word_embeddings=True, **shape), kernels, ckpt,
                                    layers if ckpt != "none" else None, device=DEVICE, seed=3)
        if kernels == "triton":
            recomputing = [model.layers[k].mlp.recompute_swiglu for k in ("0", "1")]
            assert recomputing == [ckpt == "selective", ckpt == "selective" and layers is None]
        loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        out[kernels] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert rel(out["triton"][0], out["torch"][0]) < 1e-5
    for name, g in out["torch"][1].items():
        assert g is not None and rel(out["triton"][1][name], g) < 1e-5, name


def test_recomputing_mlp_sums_tensor_parallel_partials():
    """With "selective", the MLP computes the down projection inside swiglu_linear rather than
    through down_proj's forward, so it must still call the row-parallel layer's `reduce` (the
    all-reduce or reduce-scatter of tensor parallelism). A `reduce` that doubles shows it."""
    from picotron.model import MLP
    from picotron.speed.kernels.triton_layers import TritonMLP

    class DoublingDown(torch.nn.Linear):
        def reduce(self, partial):
            return 2 * partial

    cfg = ModelConfig(**LLAMA)
    torch.manual_seed(0)
    mlps = {name: MLP(cfg).to(DEVICE) for name in ("keep", "recompute")}
    mlps["recompute"].load_state_dict(mlps["keep"].state_dict())
    for name, m in mlps.items():
        m.__class__ = TritonMLP          # as speed/kernels/swap.py swaps it
    mlps["recompute"].recompute_swiglu = True      # as speed/recompute.py's "selective" sets
    x = torch.randn(2, 5, cfg.hidden_size, device=DEVICE)
    plain = {name: m(x) for name, m in mlps.items()}
    assert rel(plain["recompute"], plain["keep"]) < 1e-6
    m = mlps["recompute"]
    down = DoublingDown(cfg.intermediate_size, cfg.hidden_size, bias=False, device=DEVICE)
    down.weight = m.down_proj.weight
    m.down_proj = down
    assert torch.equal(mlps["recompute"](x), 2 * plain["recompute"])
