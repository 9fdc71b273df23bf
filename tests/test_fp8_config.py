"""training.fp8's config and device checks: `none` swaps nothing, the config's refusals (CPU,
unknown recipe, dtype, sizes not multiples of 16), what "auto" picks, GPUs without FP8 GEMMs
refused by name or by the GEMM's own error, and which projections share a delayed site. The
FP8 math is tests/test_fp8.py's."""
import dataclasses

import pytest
import torch

from picotron.config import features as config_features
from picotron.config import ConfigError, config_from_dict
from picotron.model import Decoder
from picotron.speed.fp8 import layers as fp8_layers
from picotron.speed.fp8.layers import Fp8Linear, apply_fp8, check_fp8_device, settle_auto_fp8
from test_fp8 import fp8_config

def test_none_changes_nothing():
    model = Decoder(fp8_config().model)
    apply_fp8(model, fp8_config("none"))
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())


def refusal(**training):
    raw = {"distributed": {"use_cpu": training.pop("use_cpu", False)},
           "model": {"hidden_size": 128, "intermediate_size": 352},
           "training": {"dtype": "bfloat16", "fp8": "tensorwise", **training}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    return str(e.value)


def test_config_refusals():
    assert "distributed.use_cpu is true; set training.fp8='none'" in refusal(use_cpu=True)
    assert "one of ('auto', 'none', 'tensorwise', 'tensorwise_delayed', 'rowwise', " \
        "'rowwise_bf16_dw')" in refusal(fp8="e4m3")
    assert "set training.dtype='bfloat16'" in refusal(dtype="float16")
    message = refusal(seq_length=100, micro_batch_size=1)
    assert "multiples of 16" in message and "(tokens)=100" in message
    ok = config_from_dict({"distributed": {"use_cpu": False},
                           "training": {"dtype": "bfloat16", "fp8": "rowwise"}})
    assert ok.training.fp8 == "rowwise"
    # the delayed recipe runs under compile and ZeRO-3 (tests/test_fp8_delayed.py)
    for distributed, training in (({}, {"compile": True}), ({"zero_stage": 3, "dp_size": 2}, {})):
        ok = config_from_dict({"distributed": {"use_cpu": False, **distributed}, "training": {
            "dtype": "bfloat16", "fp8": "tensorwise_delayed", **training}})
        assert ok.training.fp8 == "tensorwise_delayed"


def test_auto_picks_fp8_where_it_was_measured_faster(monkeypatch):
    """From hidden_size 2048 on a GPU with FP8 tensor cores, at tp_size 1, when nothing in
    the config keeps FP8 from running; otherwise bf16 ("none"), never a refusal. Explicit
    values stay."""
    def auto(hidden=2048, tensor_cores=True, **sections):
        monkeypatch.setattr(config_features, "fp8_tensor_cores", lambda: tensor_cores)
        raw = {"model": {"hidden_size": hidden, "intermediate_size": 3 * hidden,
                         "num_attention_heads": 16, "num_key_value_heads": 4},
               "distributed": {"use_cpu": False, **sections.get("distributed", {})},
               "training": {"dtype": "bfloat16", **sections.get("training", {})}}
        config = config_from_dict(raw)
        assert config.auto_resolved.get("training.fp8", "kept") in (config.training.fp8, "kept")
        return config.training.fp8
    assert auto() == "tensorwise_delayed"
    assert auto(hidden=960) == "tensorwise_delayed"   # 360M's width, one GPU: under CUDA graphs
    assert auto(distributed={"zero_stage": 3, "dp_size": 2}) == "tensorwise_delayed"
    assert auto(training={"compile": True}) == "tensorwise_delayed"    # compiled too
    assert auto(hidden=960, training={"cuda_graphs": False}) == "none"   # eager: no gain
    assert auto(hidden=576) == "tensorwise_delayed"         # 135M's: the delayed recipe pays
    assert auto(hidden=512) == "none"                       # below it, not measured faster
    assert auto(hidden=960, training={"compile": True}) == "tensorwise_delayed"  # 360M
    assert auto(hidden=576, training={"compile": True}) == "none"   # compiled: not at 576
    assert auto(tensor_cores=False) == "none"               # an A100, or no GPU in sight
    assert auto(distributed={"use_cpu": True}) == "none"
    assert auto(training={"dtype": "float32"}) == "none"
    assert auto(training={"seq_length": 100, "micro_batch_size": 1}) == "none"  # not x16
    assert auto(distributed={"tp_size": 2}) == "none"      # not measured under tp yet
    assert auto(distributed={"tp_comm_overlap": True, "sequence_parallel": True}) == "none"
    assert auto(distributed={"dp_size": 2, "pp_size": 2}) == "tensorwise_delayed"
    assert auto(hidden=960, training={"fp8": "rowwise"}) == "rowwise"
    # what create_config writes
    assert config_from_dict({}, resolve=False).training.fp8 == "auto"


def test_gpus_without_fp8_are_refused(monkeypatch):
    """Below compute capability 8.9 by name; on a newer GPU whose torch cannot run the
    recipe's GEMMs, by the GEMM's own first error line (a tiny FP8 linear tried at build)."""
    config = fp8_config("rowwise")
    config.distributed.use_cpu = False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"A100 is 8.0; set training.fp8='none'$"):
        check_fp8_device(config)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L4")
    monkeypatch.setattr(fp8_layers, "fp8_gemm_error", lambda recipe: "no row-scaled GEMM here")
    with pytest.raises(ConfigError, match=r"L4 \(8.9\) with torch .*: no row-scaled GEMM here; "
                                          r"set training.fp8='tensorwise' or 'none'$"):
        check_fp8_device(config)
    monkeypatch.setattr(fp8_layers, "fp8_gemm_error", lambda recipe: None)
    check_fp8_device(config)


def test_what_auto_chose_falls_back_to_bf16_where_torch_cannot_run_it(monkeypatch):
    """An FP8 recipe that "auto" chose and this GPU's torch cannot run: bf16, said in one line
    (and on the run's first line); one the user asked for is left to check_fp8_device."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L4")
    monkeypatch.setattr(fp8_layers, "fp8_gemm_error", lambda recipe: "no FP8 GEMM here")
    config = fp8_config("tensorwise")
    config.auto_resolved = {"training.fp8": "tensorwise"}
    line = settle_auto_fp8(config)
    assert line.startswith("training.fp8=auto: NVIDIA L4 with torch ") and \
        "cannot run 'tensorwise' FP8 GEMMs (no FP8 GEMM here); training in bf16" in line
    assert config.training.fp8 == config.auto_resolved["training.fp8"] == "none"
    model = apply_fp8(Decoder(config.model), config)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    asked = fp8_config("tensorwise")                  # no auto record: the user's choice
    assert settle_auto_fp8(asked) is None and asked.training.fp8 == "tensorwise"
    monkeypatch.setattr(fp8_layers, "fp8_gemm_error", lambda recipe: None)
    runs = fp8_config("tensorwise")
    runs.auto_resolved = {"training.fp8": "tensorwise"}
    assert settle_auto_fp8(runs) is None and runs.training.fp8 == "tensorwise"
    monkeypatch.setattr(fp8_layers, "fp8_gemm_error", lambda recipe: pytest.fail("probed"))
    bf16 = fp8_config("none")               # what auto picks below hidden_size 2048: no probe
    bf16.auto_resolved = {"training.fp8": "none"}
    assert settle_auto_fp8(bf16) is None and bf16.training.fp8 == "none"


@pytest.mark.parametrize("parallel_residual", [False, True], ids=["llama", "palm"])
def test_delayed_sites_one_per_input(parallel_residual):
    """tensorwise_delayed: the projections that read one tensor share its x site (their
    amaxes are equal, and one graph input lets training.compile merge their casts): q/k/v
    and gate/up, all five in a parallel-residual layer; o and down read their own inputs,
    and every projection's dy is its own."""
    config = fp8_config("tensorwise_delayed")
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, parallel_residual=parallel_residual))
    model = apply_fp8(Decoder(config.model), config)
    for key, layer in model.layers.items():
        attn, mlp = layer.self_attn, layer.mlp
        x = {name: proj.fp8_sites[0] for name, proj in (
            ("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
            ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj))}
        assert x["q"] is x["k"] is x["v"] and x["gate"] is x["up"]
        assert x["q"].name == f"layers.{key}.self_attn.x"
        assert (x["gate"] is x["q"]) == parallel_residual
        assert x["o"].name == f"layers.{key}.self_attn.o_proj.x"
        assert len({id(site) for site in x.values()}) == (3 if parallel_residual else 4)
    used = {id(site) for m in model.modules() for site in (getattr(m, "fp8_sites", None) or ())}
    names = model.fp8_ledger.names
    assert len(set(names)) == len(names) == len(used)     # every site named once, none unused
