"""The gradient buffers' dtype (picotron/data_parallel/buckets.py): fp32 whenever something is
added into them, the parameter dtype when each gradient arrives exactly once, which must train
bit for bit like fp32 buffers (an fp32 copy of a bf16 gradient holds the same value, and the
optimizer computes in fp32 either way)."""
import json

import torch

import create_config
import train
from launch import final_weights
from picotron.data_parallel import buckets

TINY = ["--use_cpu", "--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--num_hidden_layers", "2", "--seq_len", "32", "--mbs", "2", "--total_train_steps", "4",
        "--set", "training.warmup_steps=1", "--set", "checkpoint.save_frequency=4",
        "--learning_rate", "1e-3", "--set", "training.dtype=bfloat16"]


def run(tmp_path, name, extra=()):
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", name, *TINY, *extra])
    seen = []
    real = buckets.gradient_dtype

    def spy(params, summed):
        seen.append(real(params, summed))
        return seen[-1]
    buckets.gradient_dtype = spy
    try:
        train.main(["--config", path])
    finally:
        buckets.gradient_dtype = real
    records = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    return set(seen), records, final_weights(path)


def test_bf16_buffers_when_nothing_is_summed_train_like_fp32(tmp_path, monkeypatch):
    dtypes, records, weights = run(tmp_path, "native")
    assert dtypes == {torch.bfloat16}
    monkeypatch.setattr(buckets, "gradient_dtype", lambda params, summed: torch.float32)
    _, ref_records, ref_weights = run(tmp_path, "fp32")
    assert [r["loss"] for r in records] == [r["loss"] for r in ref_records]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in ref_records]
    assert records[-1]["loss"] < records[0]["loss"]
    assert weights.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        assert torch.equal(weights[key], value), key


def test_fp32_buffers_when_micro_batches_are_summed(tmp_path):
    dtypes, _, _ = run(tmp_path, "acc", ["--grad_acc_steps", "2"])
    assert dtypes == {torch.float32}


def test_buckets_lay_fused_projection_weights_back_to_back(tmp_path):
    """GradBuckets keeps each module's parameters in definition order (buckets.gradient_order),
    so the fused projections find q, k, v and gate, up adjacent and use them in place."""
    from picotron.data_parallel import GradBuckets
    from picotron.speed.kernels.fused_linear import stacked
    path = create_config.main(["--out_dir", str(tmp_path), "--exp_name", "layout", *TINY])
    config, pgm, device = train.setup(path)
    model = train.build_model(config, pgm, device)
    grads = GradBuckets(model, pgm, config)
    for layer in model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        for ws in ([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                   [mlp.gate_proj.weight, mlp.up_proj.weight]):
            assert stacked(ws).data_ptr() == ws[0].data_ptr()
    # still roughly backward's order: modules last to first
    order = [id(p) for p in buckets.gradient_order(model)]
    last, first = model.layers["1"], model.layers["0"]
    assert order[0] == id(model.norm.weight) and order[-1] == id(model.embed_tokens.weight)
    rank = {name: order.index(id(p)) for name, p in (
        ("last mlp", last.mlp.gate_proj.weight), ("last attn", last.self_attn.q_proj.weight),
        ("first mlp", first.mlp.down_proj.weight))}
    assert rank["last mlp"] < rank["last attn"] < rank["first mlp"], rank
    assert sum(len(b.members) for b in grads.buckets) == len(order)
