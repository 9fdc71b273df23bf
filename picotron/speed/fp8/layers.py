"""apply_fp8: the decoder layers' projections (q/k/v/o, gate/up/down) swapped for subclasses
whose forward runs linear.py's FP8 GEMMs (`training.fp8` = "tensorwise" | "rowwise" |
"rowwise_bf16_dw").

Everything else keeps its class: the embedding, the output head, the norms, attention itself
(softmax needs the range FP8 lacks, and the head's logits feed the loss directly), so a run
differs from its bf16 twin only in the seven GEMM families that hold most of the FLOPs.

A class swap in place, as speed/kernels/swap.py does: the parameters stay the same tensors under the
same names, so an FP8 run's checkpoint is an ordinary checkpoint (it resumes in bf16, and a bf16
one in FP8). Each swapped module (and each fused q/k/v or gate/up block) gets an
Fp8WeightCache (weights.py): its weight's FP8 copies, cast once per optimizer step and
never saved (not under ZeRO-3, `_cache`).

    nn.Linear             -> Fp8Linear                 one process
    ColumnParallelLinear  -> Fp8ColumnParallelLinear   its O is sharded: dy's and W's scales
                                                       are all-reduced over the TP group
    RowParallelLinear     -> Fp8RowParallelLinear      its C_in is sharded: x's and W's scales
                                                       are all-reduced; then g as before
    TritonAttention, TritonMLP (model.kernels="triton") -> their FP8 subclasses (triton_layers.py):
                             the fused q/k/v and gate/up projections, one FP8 GEMM each

Applied after speed/kernels/swap.py (whose classes it must see) and before recompute.py.
Refused on CPU and on GPUs without FP8 tensor cores (config.features.fp8_problems, and
`check_fp8_device` when the run is built); what "auto" chose falls back to bf16 instead
(`settle_auto_fp8`, called by train.py once the GPU is set).
"""
import torch
import torch.nn as nn

from picotron.errors import ConfigError
from picotron.speed.fp8.linear import fp8_linear
from picotron.speed.fp8.delayed import GRADIENT, AmaxLedger
from picotron.speed.fp8.weights import Fp8WeightCache
from picotron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class Fp8Linear(nn.Linear):
    # set per module by apply_fp8; fp8_sites: (x's, dy's) fp8_delayed.Site, or None
    fp8_recipe, fp8_cache, fp8_sites = "tensorwise", None, None

    def forward(self, x):
        return fp8_linear(x, [self.weight], self.fp8_recipe, cache=self.fp8_cache,
                          sites=self.fp8_sites)                                 # (..., O)


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    fp8_recipe, fp8_group, fp8_cache, fp8_sites = "tensorwise", None, None, None

    def forward(self, x):
        return fp8_linear(x, [self.weight], self.fp8_recipe, out_group=self.fp8_group,
                          cache=self.fp8_cache, sites=self.fp8_sites)


class Fp8RowParallelLinear(RowParallelLinear):
    fp8_recipe, fp8_cache, fp8_sites = "tensorwise", None, None

    def forward(self, x):
        partial = fp8_linear(x, [self.weight], self.fp8_recipe, in_group=self.tp_group,
                             cache=self.fp8_cache, sites=self.fp8_sites)
        return self.reduce(partial)                  # g on the (B, T, O) partial product


FP8_LINEARS = {nn.Linear: Fp8Linear, ColumnParallelLinear: Fp8ColumnParallelLinear,
               RowParallelLinear: Fp8RowParallelLinear}


def check_fp8_device(config):
    """On a GPU, refuse one without FP8 tensor cores (compute capability below 8.9: Ada,
    Hopper and Blackwell have them) before any step runs, then try the recipe's GEMMs once on
    a tiny matrix: a torch or a GPU without them (row-scaled GEMMs came to Hopper first) is
    refused here, in one line, not in the middle of the first step. A recipe "auto" chose is
    not probed again: train.py's settle_auto_fp8 has (and it only chooses on sm89+)."""
    recipe = config.training.fp8
    if recipe == "none" or config.distributed.use_cpu or _chosen_by_auto(config):
        return
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if (major, minor) < (8, 9):
        raise ConfigError(f"training.fp8='{recipe}' needs FP8 tensor cores (compute "
                          f"capability 8.9 or later: L4/L40, H100/H200, B200), but {name} is "
                          f"{major}.{minor}; set training.fp8='none'")
    error = fp8_gemm_error(recipe)
    if error:
        fix = "'tensorwise' or 'none'" if recipe.startswith("rowwise") else "'none'"
        raise ConfigError(f"training.fp8='{recipe}' cannot run on {name} ({major}.{minor}) "
                          f"with torch {torch.__version__}: {error}; set training.fp8={fix}")


def settle_auto_fp8(config):
    """When training.fp8="auto" chose an FP8 recipe (config.resolve_auto) that this GPU's torch
    cannot run, train in bf16 instead of failing a run the user never asked FP8 of: set
    "none" (the run's first line then says so) and return the line to print; else None."""
    recipe = config.training.fp8
    if recipe == "none" or not _chosen_by_auto(config):
        return None                                   # bf16, or a recipe asked for by name
    error = fp8_gemm_error(recipe)
    if error is None:
        return None
    config.training.fp8 = config.auto_resolved["training.fp8"] = "none"
    return (f"training.fp8=auto: {torch.cuda.get_device_name()} with torch "
            f"{torch.__version__} cannot run '{recipe}' FP8 GEMMs ({error}); training in bf16. "
            f"Set training.fp8='none' to skip this check")


def _chosen_by_auto(config) -> bool:
    """Whether training.fp8 holds what "auto" resolved to (config.resolve_auto's record)."""
    return getattr(config, "auto_resolved", {}).get("training.fp8") == config.training.fp8


def fp8_gemm_error(recipe: str):
    """The first line of the error a tiny FP8 linear of `recipe` raises on this GPU, forward
    and backward, or None when it runs."""
    x, w = (torch.ones(16, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    try:
        fp8_linear(x, [w], recipe).sum().backward()
    except RuntimeError as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


# The projections of a branch that read its input (model.py's Attention and MLP): under
# "tensorwise_delayed" they share one x site, `{branch}.x`, as the fused q/k/v and gate/up of
# model.kernels="triton" do (in a parallel-residual layer, both branches share `self_attn.x`).
# Their amaxes are the same numbers either way (one tensor), but sites of their own would be
# different graph inputs to training.compile: it could not merge their casts of x into one,
# and kept each cast of x^T for backward (3 x C bytes a token a layer more than "tensorwise",
# whose casts it merges).
READ_THE_INPUT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def fp8_branch_classes(kernels: str) -> dict:
    """{fast attention / MLP class: its FP8 subclass}: the fused projections of
    model.kernels="triton" call their weights directly, not through the linears' forward."""
    if kernels != "triton":
        return {}       # torch and liger call each projection module: the linears are enough
    from picotron.speed.fp8.triton_layers import FP8_CLASSES
    return FP8_CLASSES


def apply_fp8(model, config, tp_group=None, dp_group=None, cp_group=None):
    """Swap, in place, the projections of every decoder layer this rank holds for their FP8
    subclasses (`training.fp8`; nothing when "none"). `tp_group`: the tensor-parallel group the
    sharded projections' scales are all-reduced over; under "tensorwise_delayed" the amaxes
    are also all-reduced over `dp_group` (the data x context group) between steps, the first
    step's over `cp_group` (the context-parallel one) at each cast, and the model gets
    `fp8_ledger`, their fp8_delayed.AmaxLedger."""
    recipe = config.training.fp8
    if recipe == "none":
        return model
    check_fp8_device(config)
    branches = fp8_branch_classes(config.model.kernels)
    ledger = (AmaxLedger([tp_group, dp_group], sequence_group=cp_group)
              if recipe == "tensorwise_delayed" else None)
    for key, layer in model.layers.items():
        layer_input = None     # a parallel-residual layer's: its MLP reads what attention reads
        for branch_name, branch in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            name = f"layers.{key}.{branch_name}"
            fast = branches.get(type(branch))
            input_site = layer_input   # the delayed site of the branch's input, once made
            if fast is not None:
                branch.__class__ = fast
                branch.fp8_recipe, branch.fp8_group = recipe, _sharded_group(branch, tp_group)
                branch.fp8_cache = _cache(config)            # its fused q/k/v or gate/up
                branch.fp8_sites = _sites(ledger, name)
                input_site = branch.fp8_sites and branch.fp8_sites[0]
            for child, projection in branch.named_children():
                fp8 = FP8_LINEARS.get(type(projection))
                if fp8 is None:
                    continue
                assert getattr(projection, "bias", None) is None, "FP8 linears have no bias"
                projection.__class__ = fp8
                projection.fp8_recipe, projection.fp8_cache = recipe, _cache(config)
                if ledger is not None and child in READ_THE_INPUT and input_site is None:
                    input_site = ledger.site(f"{name}.x")
                projection.fp8_sites = _sites(ledger, f"{name}.{child}",
                                              input_site if child in READ_THE_INPUT else None)
                if fp8 is Fp8ColumnParallelLinear:
                    projection.fp8_group = tp_group
            if layer.parallel_residual:
                layer_input = input_site
    if ledger is not None and ledger.names:
        model.fp8_ledger = ledger
        ledger.watch(model, next(m for m in model.modules()
                                 if getattr(m, "fp8_sites", None) and hasattr(m, "weight")))
    return model


def fp8_step_values(model, pp_group=None) -> dict:
    """What train.py's queue_step adds to the step's values under "tensorwise_delayed": the
    roll, now, and the saturation it found ({"fp8_saturated_sites", "fp8_worst_ratio",
    "fp8_worst_site": () device tensors, read with the loss one step behind; "fp8_sites": the
    names the site index stands for}; delayed.py's `end_step`); {} without delayed FP8. Under
    pipeline parallelism (`pp_group`: every stage calls it at the end of its step), every
    stage's layers, so the logging rank (the last stage) can say which saturated."""
    ledger = getattr(model, "fp8_ledger", None)
    return {} if ledger is None else ledger.end_step(pp_group)


def _sites(ledger, name, x_site=None):
    """(x's, dy's) delayed-scaling sites of the projection (or fused block) `name`, or None
    when the recipe is not delayed. `x_site`: the site of an input it shares (READ_THE_INPUT),
    or None for one of its own."""
    if ledger is None:
        return None
    return x_site or ledger.site(f"{name}.x"), ledger.site(f"{name}{GRADIENT}")


def _cache(config):
    """A new Fp8WeightCache, or None under ZeRO-3: it keeps only the layer in use gathered,
    and a cache would keep every layer's weights whole in FP8 (2 bytes a parameter), so
    there the weights are cast at each use."""
    return Fp8WeightCache() if config.distributed.zero_stage < 3 else None


def _sharded_group(branch, tp_group):
    """The group an attention / MLP block's column-parallel projections are sharded over."""
    return tp_group if any(isinstance(p, ColumnParallelLinear) for p in branch.children()) \
        else None
