"""The whole model with `model.kernels = "triton"` against the readable reference, in fp32.

On CPU the Triton kernels run in Triton's interpreter (tests/conftest.py), so CI checks the
wiring (fused q/k/v and gate/up projections, packed RoPE and SwiGLU, the norms) end to end on
Llama and on the PaLM-style options (LayerNorm, parallel residual, multi-query attention),
with head dims that are not powers of two. fp32 throughout: the same math in another order,
so the loss and every gradient agree to 1e-5 relative. tests/test_kernels_gpu.py runs the
bf16 version of this at 360M's widths on a GPU.
"""
import pytest
import torch

pytest.importorskip("triton")
from picotron.config import ModelConfig  # noqa: E402
from picotron.attention import sdpa_attention  # noqa: E402
from picotron.model import Decoder, causal_lm_loss, materialize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLAMA = dict(hidden_size=36, intermediate_size=52, num_attention_heads=6,
             num_key_value_heads=2)
PALM = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=1,
            norm_type="layernorm", parallel_residual=True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [LLAMA, PALM], ids=["llama", "palm"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_triton_kernels_match_reference(shape, checkpointing):
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = {}
    for kernels, ckpt in (("torch", "none"), ("triton", checkpointing)):
        cfg = ModelConfig(vocab_size=97, num_hidden_layers=2, tie_word_embeddings=True,
                          kernels=kernels, **shape)
        with torch.device("meta"):
            model = Decoder(cfg, sdpa_attention, ckpt)
        materialize(model, 3, DEVICE, torch.float32)
        loss = causal_lm_loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        out[kernels] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert rel(out["triton"][0], out["torch"][0]) < 1e-5
    for name, g in out["torch"][1].items():
        assert g is not None and rel(out["triton"][1][name], g) < 1e-5, name
