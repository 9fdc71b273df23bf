"""The CPU-testable fast paths against their references: the chunked linear +
cross-entropy loss, activation checkpointing, the config keys, and train.py with all of them.
(The liger-kernel paths need CUDA: tests/test_kernels_gpu.py.)"""
import json

import pytest
import torch

import create_config
import train
from tiny import import_triton
from picotron.config import ConfigError, ModelConfig, config_from_dict
from picotron.loss import IGNORE_INDEX, causal_lm_loss
from picotron.speed.loss import HeadInLoss, chunked_linear_cross_entropy
import picotron.speed.loss as loss_module
import picotron.speed.recompute as recompute_module
from speed_helpers import build_with_speed

TINY = dict(vocab_size=97, hidden_size=36, intermediate_size=70, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("rows", [7, 16, 1000])       # ragged chunks, even chunks, one chunk
def test_chunked_loss_matches_full_logits(rows):
    """fp32 on CPU: same sums in another order, so ~1e-6 relative; some targets ignored."""
    torch.manual_seed(0)
    h = torch.randn(40, 24, requires_grad=True)
    w = torch.randn(97, 24, requires_grad=True)
    t = torch.randint(0, 97, (40,))
    t[[3, 17]] = IGNORE_INDEX
    ref = torch.nn.functional.cross_entropy(h @ w.t(), t, ignore_index=IGNORE_INDEX)
    gh, gw = torch.autograd.grad(2.0 * ref, (h, w))   # upstream gradient != 1 is scaled
    loss = chunked_linear_cross_entropy(h, w, t, rows)
    ch, cw = torch.autograd.grad(2.0 * loss, (h, w))
    assert abs(loss.item() - ref.item()) < 1e-6 * ref.item()
    assert rel_err(ch, gh) < 1e-5 and rel_err(cw, gw) < 1e-5
    with torch.no_grad():                              # validation: no gradients computed
        assert abs(chunked_linear_cross_entropy(h, w, t, rows).item() - ref.item()) < 1e-5


def test_chunked_loss_bf16_is_as_close_as_the_reference():
    """bf16 hidden and head: both paths do a bf16 matmul then an fp32 softmax; the logits'
    gradient is rounded to bf16 before the two backward matmuls in both. So they differ by
    summation order only: well under bf16's 2^-8 = 4e-3 relative step."""
    torch.manual_seed(1)
    h = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (0.2 * torch.randn(200, 32)).bfloat16().requires_grad_()
    t = torch.randint(0, 200, (64,))
    ref = causal_lm_loss((h @ w.t())[None], t[None])
    gh, gw = torch.autograd.grad(ref, (h, w))
    loss = chunked_linear_cross_entropy(h, w, t, 16)
    ch, cw = torch.autograd.grad(loss, (h, w))
    assert abs(loss.item() - ref.item()) < 1e-5 * ref.item()
    assert rel_err(ch.float(), gh.float()) < 4e-3 and rel_err(cw.float(), gw.float()) < 4e-3


@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_fused_loss_in_fp16_keeps_small_gradients(impl):
    """fp16 with loss scaling: (softmax - onehot) / count is ~1e-7..1e-8 for most logits at
    V = 4096 and 2048 tokens, at or below fp16's smallest values, so a loss that divides by the
    count in forward (as liger does, and ours did) loses it before backward multiplies by the
    loss scale (here 2.5e-3 relative error against fp64, where the unfused fp16 loss has
    3.3e-4). Ours keep per-token gradients and divide in backward: within 2x of the unfused
    fp16 loss's error (3.3e-4 / 3.9e-4 measured)."""
    if impl == "triton":
        import_triton()
        from picotron.speed.kernels.triton_loss import triton_linear_cross_entropy as fused
    else:
        fused = chunked_linear_cross_entropy
    device = "cuda" if torch.cuda.is_available() and impl == "triton" else "cpu"
    torch.manual_seed(0)
    N, C, V, scale = 2048, 64, 4096, 1024.0
    h, w = torch.randn(N, C, device=device), 0.1 * torch.randn(V, C, device=device)
    t = torch.randint(0, V, (N,), device=device)

    def grads(fn, dtype):
        hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        (fn(hh, ww) * scale).backward()                 # as train_step with a loss scale
        return hh.grad.double() / scale, ww.grad.double() / scale

    def unfused(h, w):
        return causal_lm_loss((h @ w.t())[None], t[None])
    exact = grads(unfused, torch.float64)
    reference = grads(unfused, torch.float16)
    got = grads(lambda h, w: fused(h, w, t, 512), torch.float16)
    for g, r, e in zip(got, reference, exact):
        assert rel_err(g, e) < 2 * rel_err(r, e), (rel_err(g, e), rel_err(r, e))


def build(checkpointing="none", tied=True, checkpointed_layers=None, fused_loss="none",
          chunk_tokens=0):
    """The textbook model with the speed plug-ins the arguments ask for: (model, loss_fn)."""
    return build_with_speed(dict(TINY, tie_word_embeddings=tied), "torch", checkpointing,
                            checkpointed_layers, fused_loss, chunk_tokens)


def loss_and_grads(model, loss_fn):
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(4))
    model.zero_grad()
    loss = loss_fn(model(ids), tgt)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied, chunk_tokens", [(True, 0), (False, 0), (True, 7)])
def test_model_with_fused_loss_matches_reference(tied, chunk_tokens, monkeypatch):
    """The head applied inside the loss (tied: the embedding gets both gradients); with
    training.loss_chunk_tokens = 7, 60 tokens go in 9 chunks, the last one short."""
    ref_loss, ref = loss_and_grads(*build(tied=tied))
    rows = []
    chunked = loss_module.chunked_linear_cross_entropy
    monkeypatch.setattr(loss_module, "chunked_linear_cross_entropy",
                        lambda *a: rows.append(a[3]) or chunked(*a))
    model, loss_fn = build(tied=tied, fused_loss="chunked", chunk_tokens=chunk_tokens)
    assert isinstance(model.lm_head, HeadInLoss)         # the model now ends at the hidden
    assert model.lm_head.weight is (model.embed_tokens.weight if tied else
                                    model.lm_head.weight)
    loss, got = loss_and_grads(model, loss_fn)
    assert rows == [chunk_tokens or loss_module.default_rows(60)]
    assert got.keys() == ref.keys()                      # same parameter names
    assert abs(loss - ref_loss) < 1e-6 * ref_loss
    for name in ref:
        assert rel_err(got[name], ref[name]) < 1e-5, name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_is_exact(mode):
    """Recomputation reruns the same kernels on the same inputs: bitwise equal on CPU."""
    ref_loss, ref = loss_and_grads(*build())
    loss, got = loss_and_grads(*build(mode))
    assert loss == ref_loss
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_selective_recomputes_pointwise_ops_but_no_matmul():
    """Ops run over forward + backward, counted at the dispatcher: "selective" runs the norms'
    rsqrt twice (recomputed) but no extra matmul; "full" reruns the matmuls too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {"mm": 0, "rsqrt": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in self.n:
                self.n[name] += 1
            return func(*args, **(kwargs or {}))

    def counts(mode):
        (model, _), ids = build(mode), torch.randint(0, 97, (2, 16))
        with Count() as c:
            causal_lm_loss(model(ids), ids).backward()
        return c.n
    none, selective, full = counts("none"), counts("selective"), counts("full")
    # full stops recomputing once backward has what it needs: 6 of the 7 matmuls per layer
    # (down_proj's output is not needed); each layer's 2 norms run again in both modes.
    L = TINY["num_hidden_layers"]
    assert selective["mm"] == none["mm"] and full["mm"] == none["mm"] + 6 * L
    assert selective["rsqrt"] == full["rsqrt"] == none["rsqrt"] + 2 * L


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_the_first_layers_only(mode, monkeypatch):
    """training.activation_checkpointing_layers = N: the first N layers go through torch's
    checkpoint (recompute.checkpointed), the others run plainly; the gradients stay bitwise
    the reference's for every N."""
    wrapped = []
    checkpointed = recompute_module.checkpointed
    monkeypatch.setattr(recompute_module, "checkpointed",
                        lambda forward, *a: wrapped.append(forward.__self__)
                        or checkpointed(forward, *a))
    ref_loss, ref = loss_and_grads(*build())
    for n in range(TINY["num_hidden_layers"] + 1):
        model, loss_fn = build(mode, checkpointed_layers=n)
        wrapped.clear()
        loss, got = loss_and_grads(model, loss_fn)
        assert wrapped == [model.layers[str(i)] for i in range(n)]
        assert loss == ref_loss and all(torch.equal(got[k], ref[k]) for k in ref)


def test_config_checks_name_the_new_keys():
    for key, bad in (("model.kernels", "cuda"), ("training.fused_loss", "yes"),
                     ("training.activation_checkpointing", "some")):
        section, name = key.split(".")
        with pytest.raises(ConfigError, match=key):
            config_from_dict({section: {name: bad}})
    with pytest.raises(ConfigError, match="CUDA GPUs only"):
        config_from_dict({"model": {"kernels": "liger"}, "distributed": {"use_cpu": True}})
    for loss in ("liger", "triton"):     # each key's own CPU value is the fix
        with pytest.raises(ConfigError, match="CPU use training.fused_loss='none' or 'chunk"):
            config_from_dict({"training": {"fused_loss": loss}, "distributed": {"use_cpu": True}})
    with pytest.raises(ConfigError, match="CUDA GPUs only.*on CPU use model.kernels='torch'$"):
        config_from_dict({"model": {"kernels": "triton"}, "distributed": {"use_cpu": True}})
    with pytest.raises(ConfigError, match="liger rounds it to fp16 before the loss scale"):
        config_from_dict({"training": {"fused_loss": "liger", "dtype": "float16",
                                       "master_weights": True}})
    for loss in ("chunked", "triton"):     # ours keep per-token gradients (next test)
        config_from_dict({"training": {"fused_loss": loss, "dtype": "float16",
                                       "master_weights": True}})
    with pytest.raises(ConfigError, match="loss_chunk_tokens=-1 must be >= 0"):
        config_from_dict({"training": {"fused_loss": "chunked", "loss_chunk_tokens": -1}})
    with pytest.raises(ConfigError, match="sizes the chunks of training.fused_loss"):
        config_from_dict({"training": {"fused_loss": "none", "loss_chunk_tokens": 4096}})
    with pytest.raises(ConfigError, match="recomputation would be wrong"):
        config_from_dict({"model": {"kernels": "liger"},
                          "training": {"activation_checkpointing": "selective"}})
    for n in (-1, 4):
        with pytest.raises(ConfigError, match=f"activation_checkpointing_layers={n} must be "
                                              f"between 0 and model.num_hidden_layers=3"):
            config_from_dict({"model": TINY, "training": {
                "activation_checkpointing": "full", "activation_checkpointing_layers": n}})
    with pytest.raises(ConfigError, match="which is 'none'; set it to 'full' or 'selective'"):
        config_from_dict({"training": {"activation_checkpointing_layers": 2},
                          "distributed": {"use_cpu": True}})    # "auto" is "none" on CPU
    # ours recompute inside their own autograd function (triton_swiglu.swiglu_linear)
    config_from_dict({"model": {"kernels": "triton"},
                      "training": {"activation_checkpointing": "selective"}})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-3)])
def test_train_with_fast_paths_matches_reference(tmp_path, dtype, tol):
    """train.py on CPU: chunked loss + selective checkpointing + validation give the same
    losses as the reference path. fp32: ~1e-6 from the loss's summation order. fp16 (loss
    scale 65536, so the loss's backward gets grad_output = 65536): the same up to fp16's
    rounding in another order, 2^-11 = 5e-4 per op."""
    losses = {}
    for name, extra in (("ref", []), ("fast", ["--set", "training.fused_loss=chunked", "--set",
                                               "training.activation_checkpointing=selective"])):
        path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", name, "--use_cpu",
                                   "--total_train_steps", "4", "--mbs", "2", "--seq_len", "32",
                                   "--set", "training.val_frequency=2", "--set",
                                   "dataset.val_samples=2", "--set", f"training.dtype={dtype}"]
                                  + extra)
        train.main(["--config", path])
        records = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        losses[name] = [r.get("loss", r.get("val_loss")) for r in records]
        assert not any(r.get("skipped") for r in records)
    assert len(losses["fast"]) == len(losses["ref"]) == 6
    for a, b in zip(losses["fast"], losses["ref"]):
        assert abs(a - b) < tol * b, (losses["fast"], losses["ref"])


def test_matmul_floor_runs_the_matmuls_of_a_step_and_nothing_else(monkeypatch):
    """bench_speed's "floor" row (bench/matmul_floor.py) claims to be a training step's
    matmuls and attention alone. For a tied model its matmul FLOPs must be exactly the 6N of
    the MFU formula less the norms' weights (forward, input and weight gradient of every
    projection and of the head), with SDPA run forward and backward once per layer; the
    loss's 4096-token chunking is exercised by 3 uneven chunks (7 + 7 + 6 rows)."""
    import os
    import sys
    from torch.utils.flop_counter import FlopCounterMode
    from picotron.utils import count_params
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import matmul_floor
    cfg = ModelConfig(**TINY, tie_word_embeddings=True)
    calls = []
    sdpa = matmul_floor.F.scaled_dot_product_attention
    monkeypatch.setattr(matmul_floor.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(a[0].shape) or sdpa(*a, **k))
    step, _ = matmul_floor.floor_runner(cfg, 2, 10, device="cpu", chunk=7)
    with FlopCounterMode(display=False) as counter:
        step(0)
    matmuls = sum(v for op, v in counter.get_flop_counts()["Global"].items()
                  if str(op) in ("aten.mm", "aten.addmm"))
    norms = cfg.num_hidden_layers * 2 * cfg.hidden_size + cfg.hidden_size
    assert matmuls == 6 * (count_params(cfg) - norms) * 2 * 10
    assert calls == [(2, 6, 10, 6)] * cfg.num_hidden_layers          # (B, H, T, D) each layer


def test_first_line_says_what_auto_chose(tmp_path, capsys):
    """A run's first line after the config is read names what each "auto" option resolved to
    (on CPU: the reference)."""
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "auto", "--use_cpu",
                               "--total_train_steps", "1", "--mbs", "1", "--seq_len", "16"])
    assert json.load(open(path))["model"]["kernels"] == "auto"      # written as asked
    capsys.readouterr()
    train.main(["--config", path])
    read, first = capsys.readouterr().out.splitlines()[:2]
    assert read.startswith("config read"), read
    assert first == ("auto on cpu: model.kernels=torch, training.fused_loss=none, "
                     "training.activation_checkpointing=none, training.cuda_graphs=false, "
                     "training.fp8=none"), first
