"""Every Triton kernel our speed plug-ins launch compiles for the H100/H200 (sm_90), checked on
a machine without a GPU.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), which executes their Python
and never compiles them: a kernel the GPU compiler refuses (a construct the interpreter
accepts, such as a Triton enum held in a variable) would pass every CPU test and fail on the
first GPU run. Here a one-layer model trains a step through the plug-ins (our kernels;
tensorwise and rowwise FP8, whose cast kernels rowwise_bf16_dw reuses; the Llama and PaLM
blocks; the fused loss and AdamW) while each launch is recorded, and then every recorded
kernel, with the argument types and constants it was launched with, is compiled by Triton for
sm_90 down to the cubin (Triton ships its own ptxas). Two things differ from a GPU run, on
purpose: EXACT_ROUND (the interpreter-only rounding) is compiled off, as the GPU runs it, and
the tiles are the small CPU ones.
"""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from tiny import import_triton
triton = import_triton()
if torch.cuda.is_available():   # there the GPU tests compile and run every kernel themselves
    pytest.skip("checks the GPU compilation from a machine without a GPU",
                allow_module_level=True)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from launch import ROOT  # noqa: E402
from picotron.loss import causal_lm_loss  # noqa: E402
from picotron.model import Decoder  # noqa: E402
from picotron.speed import apply_speed  # noqa: E402
from picotron.speed.fp8 import quantize as fp8_quantize
from picotron.speed.kernels import triton_loss
from picotron.speed.kernels.triton_adamw import adamw_step  # noqa: E402
from test_fp8 import fp8_config  # noqa: E402

POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5", torch.int32: "*i32",
           torch.int64: "*i64", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
           torch.bool: "*i1"}
OPTIONS = ("num_warps", "num_stages")


def scalar_type(value):
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    return "fp32"


@functools.cache
def kernel_params(fn):
    """The kernel's parameters as Triton sees them (name, is_constexpr, default): read once."""
    return JITFunction(fn).params


def launch_key(fn, args, kwargs):
    """(fn, signature, constants, options) of one launch, hashable: what Triton compiles."""
    params = kernel_params(fn)
    bound = dict(zip([p.name for p in params], args)) | kwargs
    signature, constants = {}, {}
    for p in params:
        value = bound.get(p.name, p.default)
        if p.is_constexpr or value is None:
            signature[p.name] = "constexpr"
            constants[p.name] = False if p.name == "EXACT_ROUND" else value
        else:
            signature[p.name] = (POINTER[value.dtype] if isinstance(value, torch.Tensor)
                                 else scalar_type(value))
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    return fn, *(tuple(sorted(d.items())) for d in (signature, constants, options))


@pytest.fixture
def launches(monkeypatch):
    """Every distinct kernel launch (launch_key) while the fixture is active; the launches run
    in the interpreter as usual."""
    seen = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen.add(launch_key(self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return seen


COMPILE = """
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failures = []
for module, name, signature, constants, options in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(module), name)
    try:
        triton.compile(ASTSource(kernel, dict(signature), dict(constants)),
                       target=GPUTarget("cuda", 90, 32), options=dict(options))
    except Exception as e:
        while e.__cause__ or e.__context__:     # the compiler's own error, not where it was
            e = e.__cause__ or e.__context__
        failures.append(f"{name} {dict(constants)}: {e!r}"[:500])
print(json.dumps(failures))
"""


def compile_for_h200(launches):
    """Compile every launch for sm_90 in a fresh process: in this one the interpreter has
    patched triton.language, and the modules' kernels are its wrappers. -> failures."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    todo = [(fn.__module__, fn.__name__, *key) for fn, *key in launches]
    proc = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(todo), env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def train_one_step(recipe, norm_type="rmsnorm"):
    """A bf16 tiny model with our kernels and "selective" (the recomputing SwiGLU): forward,
    backward through the FP8 plug-ins (`recipe`, or "none")."""
    config = fp8_config(recipe, kernels="triton")
    config.training.activation_checkpointing = "selective"
    config.model.num_hidden_layers = 1              # every layer launches the same kernels
    if norm_type == "layernorm":
        config.model.norm_type, config.model.parallel_residual = "layernorm", True
    torch.manual_seed(0)
    model, loss_fn = apply_speed(Decoder(config.model).to(torch.bfloat16), causal_lm_loss,
                                 config)
    ids = torch.randint(0, 64, (2, 16))
    for step in range(2 if recipe == "tensorwise_delayed" else 1):
        if step:            # the delayed casts, after the calibrating step
            model.fp8_ledger.roll()
        logits = model(ids[:, :-1])
        logits.float().logsumexp(-1).mean().backward()


def test_every_kernel_compiles_for_sm90(launches, monkeypatch):
    monkeypatch.setattr(fp8_quantize, "use_kernels", lambda t: True)   # as on a GPU
    for recipe in ("none", "tensorwise", "tensorwise_delayed", "rowwise"):  # rowwise_bf16_dw:
        # rowwise's kernels
        train_one_step(recipe)
    train_one_step("none", norm_type="layernorm")
    hidden = torch.randn(24, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(80, 64, dtype=torch.bfloat16, requires_grad=True)
    triton_loss.triton_linear_cross_entropy(hidden, weight, torch.randint(0, 80, (24,)),
                                            8).backward()
    for master in (True, False):
        shard = torch.randn(300, dtype=torch.bfloat16)
        weights = [shard.float()] if master else [shard]
        opt = torch.optim.AdamW(weights, lr=1e-3)
        adamw_step(opt, {weights[0]: torch.randn(300)}, {weights[0]: shard} if master else {},
                   torch.tensor([1.0, 0.0]))
    names = {fn.__name__ for fn, *_ in launches}
    assert {"_cast", "_amax", "_rowwise", "_swiglu_fwd_fp8", "_swiglu_bwd_fp8"} <= names \
        and len(names) >= 14, sorted(names)
    failures = compile_for_h200(launches)
    assert not failures, "\n".join(failures)
