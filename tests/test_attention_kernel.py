"""The run's first lines name the kernel that runs attention. SDPA chooses among its kernels at
each call (by device, dtype, head size, sequence length and layout), so the name comes from
asking SDPA with the run's shape (picotron/run/report.py's sdpa_kernel); each case here checks
that name against the aten op torch's profiler sees when the model's attention function runs.
On a GPU (skipped on CPU; run on the device with `python -m pytest tests/test_attention_kernel.py`)
the same at SmolLM-1.7B's heads for sequences of 2048 to 32768 tokens."""
import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel as allowed_kernels
from torch.profiler import profile

from picotron.attention import sdpa_attention
from picotron.config import config_from_dict
from picotron.run.report import describe_attention, sdpa_kernel

# the aten op each of SDPA's kernels runs as
OPS = {"flash": ("_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu"),
       "math": ("_scaled_dot_product_attention_math",),
       "memory-efficient": ("_scaled_dot_product_efficient_attention",),
       "cuDNN": ("_scaled_dot_product_cudnn_attention",)}


def ran(heads, kv_heads, seq, head_dim, dtype, device) -> set:
    """The SDPA kernel ops that one call of the model's attention runs in training: q, k and v
    need gradients and are laid out as the model lays them out (a (B, T, N, D) projection
    viewed as (B, N, T, D))."""
    def projected(n):
        return torch.randn(1, seq, n, head_dim, dtype=dtype, device=device,
                           requires_grad=True).transpose(1, 2)
    q, k, v = projected(heads), projected(kv_heads), projected(kv_heads)
    with profile() as prof:
        sdpa_attention(q, k, v)
    names = {e.name.removeprefix("aten::") for e in prof.events()}
    return {kernel for kernel, ops in OPS.items() if names & set(ops)}


@pytest.mark.parametrize("allowed", [None, [SDPBackend.MATH]], ids=["any", "math only"])
def test_the_named_kernel_is_the_one_that_runs_on_cpu(allowed):
    shape = (4, 2, 64, 32, torch.float32, torch.device("cpu"))
    every = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    with allowed_kernels(allowed or every):
        named = sdpa_kernel(*shape)
        assert {named} == ran(*shape)
    assert named == ("math" if allowed else "flash")


def cp_config(cp_mode: str, attn: str = "auto"):
    return config_from_dict({"model": {"attn_implementation": attn},
                             "distributed": {"cp_size": 2, "cp_mode": cp_mode, "use_cpu": True},
                             "training": {"seq_length": 64}}, world_size=2)


def test_context_parallel_names_its_own_attention():
    cpu = torch.device("cpu")
    assert describe_attention(cp_config("ring"), cpu) == (
        "ring attention over 2 ranks, SDPA's CPU flash kernel per block")
    assert describe_attention(cp_config("ring", "eager"), cpu) == (
        "ring attention over 2 ranks, eager kernel per block")
    assert describe_attention(cp_config("ulysses"), cpu) == (
        "Ulysses over 2 ranks around SDPA's flash kernel")
    assert describe_attention(cp_config("ulysses", "eager"), cpu) == (
        "Ulysses over 2 ranks around eager (the reference)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: run on the device")
@pytest.mark.parametrize("seq", [2048, 8192, 32768])
def test_the_named_kernel_is_the_one_that_runs_on_a_gpu(seq):
    shape = (32, 32, seq, 64, torch.bfloat16, torch.device("cuda"))   # SmolLM-1.7B's heads
    named = sdpa_kernel(*shape)
    assert {named} == ran(*shape), named


def test_a_torch_without_the_choice_function_still_starts(monkeypatch):
    """The choice is asked of a private function of torch's: where it is gone or refuses,
    the line says SDPA without naming a kernel, and the run goes on."""
    def refuses(*args, **kwargs):
        raise RuntimeError("no such choice")
    monkeypatch.setattr(torch, "_fused_sdp_choice", refuses)
    config = config_from_dict({"distributed": {"use_cpu": True}}, world_size=1)
    assert describe_attention(config, torch.device("cpu")) == "SDPA (its kernel not known here)"
