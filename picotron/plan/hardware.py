"""Hardware profiles as data: one JSON file per machine type in picotron/plan/hardware/, every
number beside its source (a datasheet, a measurement in bench/NOTES.md, or a fit: h200's by
bench/planner_h200.py to this project's one-GPU rows, playbook-h100's by bench/planner_fit.py
to the Ultra-Scale Playbook's runs), and the traits of the trainer whose runs it was fit to.
A profile of one's own machines is such a file anywhere, passed by its path (load_profile).

    {"name": "h200", "about": "...",
     "numbers": {"peak_bf16_flops": {"value": 989.5e12, "source": "datasheet: ..."}, ...},
     "traits": {"trainer": "picotron", "rank_order": ["dp", "pp", "cp", "tp"], ...}}

The numbers every profile gives (NUMBERS) are what step_time.py's model reads: the GPU's
peaks and how much of them a kernel of a given shape reaches, the links' bandwidths and
latencies inside a node and between nodes, the host's time per kernel launch, and, for a
profile fit to another trainer's runs, what that trainer adds: its host time a micro-batch
and a send, and its memory against the memory plan's count (this project's own profiles set
these to 0 and 1).
"""
import dataclasses
import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware")

NUMBERS = {
    "memory_gib": "GPU memory as torch reports it (GiB); the plan uses it less GPU_RESERVED",
    "peak_bf16_flops": "dense bf16 tensor-core peak, FLOP/s",
    "peak_fp8_flops": "dense FP8 tensor-core peak, FLOP/s",
    "gemm_eff": "share of the peak a large GEMM reaches",
    "gemm_half_dim": "a GEMM dimension at which its efficiency halves (skinny GEMMs are slow)",
    "fp8_gemm_eff": "share of the FP8 peak a large FP8 GEMM reaches",
    "attn_eff": "share of the bf16 peak attention reaches at long sequences",
    "attn_half_seq": "the sequence length at which attention's efficiency halves",
    "hbm_bytes_per_s": "HBM bandwidth a bandwidth-bound kernel reaches, B/s",
    "non_gemm_factor": "time of the passes outside GEMMs and attention over their bytes' floor",
    "launch_s": "host time per eager layer per pass (kernel launches, Python), overlapped by "
                "GPU work (none under CUDA graphs)",
    "fp8_launch_factor": "an eager FP8 layer's host time over a bf16 one's (its casts' and "
                         "scales' kernels)",
    "offload_s_per_param": "host AdamW and copies per parameter of the state offloaded to the "
                           "CPU, s",
    "intra_bytes_per_s": "a collective's bus bandwidth inside a node, per GPU, B/s",
    "intra_latency_s": "latency of one step of a collective inside a node, s",
    "inter_bytes_per_s": "a collective's bus bandwidth between nodes, per GPU, B/s",
    "inter_latency_s": "latency of one step of a layer's (tensor-parallel) collective between "
                       "nodes, s",
    "dp_latency_s": "latency of one step between nodes of the step's data-parallel collectives "
                    "(each gradient bucket's, ZeRO's gathers, a tied embedding's sum), s",
    "intra_latency_pp_s": "latency of one step of a tensor-parallel collective inside a node "
                          "on a rank of a pipeline across nodes (its sends in flight), s",
    "inter_latency_pp_s": "latency of one step of a tensor-parallel collective between nodes "
                          "on a rank of a pipeline across nodes (its sends in flight), s",
    "stall_s": "seconds a stalled micro-batch loses, each pipeline stage's forward and "
               "backward each",
    "stall_half_nodes": "the job's nodes at which half the micro-batches stall",
    "stall_steepness": "how steeply the share of stalled micro-batches grows with the job's "
                       "nodes n: (n/half)^s / (1 + (n/half)^s)",
    "tp_exposed": "share of tensor-parallel communication left on the critical path",
    "micro_s": "host time a micro-batch costs each pipeline stage, forward and backward each "
               "(the engine's Python, its blocking sends' hand-shakes), not hidden by GPU work",
    "mem_held_factor": "the trainer's memory held all step (weights, gradients, optimizer "
                       "state) over the memory plan's count of it (or the trainer's own count: "
                       "trait memory)",
    "mem_act_factor": "the trainer's activation and end-of-step memory over the memory plan's "
                      "(or the trainer's own count)",
    "mem_logit_bytes": "bytes a trainer without a fused loss keeps per logit of a micro-batch",
    "send_s": "a pipeline send's fixed time beyond its bytes and latency (a blocking send's "
              "hand-shakes)",
    "over_memory_speed": "share of the time model's speed a layout predicted not to fit runs "
                         "at, where it runs at all (the allocator frees and retries at the "
                         "GPU's capacity)",
    "mem_margin": "share of the usable memory a layout must leave free to be predicted to fit "
                  "(the trainer's memory is predicted only that well)",
    "mem_extra_gib": "what the trainer holds beyond both (allocator slack, workspaces), GiB",
}
TRAITS = {
    "trainer": "whose runs the numbers describe (picotron, nanotron)",
    "rank_order": "the grid's axes, outermost first (tp innermost: its group shares a node)",
    "zero1_gather_overlap": "ZeRO-1/2's parameter all-gather overlaps the next forward",
    "pp_split": "how its pipeline splits the blocks among ranks: 'compute_cost' (nanotron: "
                "by each block's FLOPs, stage_split.py); else this project's equal layers",
    "zero1_reduce": "how ZeRO-1/2 reduce the gradients: 'reduce_scatter' in buckets during "
                    "the backward (this project) or 'all_reduce' of the whole buffer after it "
                    "(nanotron, whose ZeRO runs without DDP's hooks: every rank gets all, keeps "
                    "its shard)",
    "bucket_bytes_per_param": "the bytes a parameter counts toward bucket_size_mb: 4 (this "
                              "project's fp32 gradient buffers, whatever the wire's dtype) or "
                              "2 (torch DDP's bucket_cap_mb counts the bf16 gradients' bytes: "
                              "nanotron's ZeRO-0)",
    "ddp_recv_stall": "the least micro-batches a step from which a ZeRO-0 pipeline with dp > 1 "
                      "(nanotron: under torch DDP) whose sends cross nodes waits stall_s on "
                      "each receive (ddp_stall.py); absent or 0: never",
    "memory": "'nanotron': the trainer's memory is nanotron's own count, rank by rank "
              "(nanotron_memory.py), scaled by the mem_ factors; else the memory plan's",
    "non_gemm_path": "whose passes the traffic count follows: 'picotron' (our Triton path)",
    "loss_path": "whose loss the head's traffic counts: 'nanotron' (its fp32 cross-entropy in "
                 "torch ops, 52 B a logit: traffic.nanotron_loss_terms); else this project's "
                 "Triton loss",
    "layout_defaults": "config keys ({'section.key': value}) the trainer ran every layout "
                       "with: score reads a row without that column as the trainer ran it, "
                       "as the fit read its runs (layouts.as_trainer_ran)",
    "measured": "the layout knobs' values the runs it was fit to had, {knob: [values]} by the "
                "search's short names; elsewhere its numbers are assumed, and the search and "
                "--auto_layout say so (unmeasured)",
    # said, not read: how the trainer differs from this one where a fitted number absorbs it
    "tp_overlap": "whether its tensor-parallel collectives overlap compute",
    "pp_sends": "how its pipeline sends meet",
    "zero": "how its ZeRO reduces gradients and gathers parameters",
    "loss": "how its loss holds the logits",
}


class UnknownProfile(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    about: str
    numbers: dict          # name -> value
    sources: dict          # name -> where the value comes from
    traits: dict

    def __getitem__(self, key):
        return self.numbers[key]

    def with_numbers(self, **changes) -> "Profile":
        """The same profile with some numbers changed (a fit's trial values)."""
        unknown = [k for k in changes if k not in self.numbers]
        if unknown:
            raise KeyError(f"not numbers of profile {self.name}: {unknown}")
        return dataclasses.replace(self, numbers={**self.numbers, **changes})

    def with_traits(self, **changes) -> "Profile":
        """The same profile with some of its trainer's traits changed or added (a test's
        other trainer)."""
        return dataclasses.replace(self, traits={**self.traits, **changes})


def known_profiles() -> list:
    return sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".json"))


def load_profile(name: str) -> Profile:
    """The profile picotron/plan/hardware/NAME.json, or the profile file at the path `name`
    (one's own machines: a copy of a shipped profile, its numbers and their sources changed).
    A ValueError lists the known ones for an unknown name, and says what is wrong in a file
    (profile_problems)."""
    if name.endswith(".json") or os.sep in name or "/" in name:
        path = name
        if not os.path.isfile(path):
            raise UnknownProfile(f"no hardware profile file '{name}'; give a JSON file laid "
                                 f"out as picotron/plan/hardware/h200.json is, or a known "
                                 f"profile: {', '.join(known_profiles())}")
    else:
        path = os.path.join(HERE, f"{name}.json")
        if not os.path.isfile(path):
            raise UnknownProfile(f"unknown hardware profile '{name}'; known profiles: "
                                 f"{', '.join(known_profiles())}, or the path of a profile's "
                                 f"JSON file")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read hardware profile {path} ({e.strerror}); give a file "
                         f"you can read") from None
    except ValueError as e:
        raise ValueError(f"hardware profile {path} is not JSON ({e}); fix the file, laid out "
                         f"as picotron/plan/hardware/h200.json is") from None
    problems = profile_problems(data)
    if problems:
        raise ValueError(f"hardware profile {path}: {'; '.join(problems)}")
    numbers = data["numbers"]
    return Profile(os.path.splitext(os.path.basename(path))[0], data.get("about", ""),
                   {k: float(v["value"]) for k, v in numbers.items()},
                   {k: v["source"] for k, v in numbers.items()}, data.get("traits", {}))


def profile_problems(data) -> list:
    """What keeps a profile file's dict from being a profile: its `numbers` (each NUMBERS
    name, each a {"value": a number, "source": where it comes from}) and its `traits` (each
    one of TRAITS); a name that is not one of them is most likely a misspelt one."""
    numbers = data.get("numbers") if isinstance(data, dict) else None
    if not isinstance(numbers, dict):
        return ['no "numbers" object: {"numbers": {"gemm_eff": {"value": 0.7, "source": '
                '"..."}, ...}}']
    problems = []
    missing = [k for k in NUMBERS if k not in numbers]
    if missing:
        problems.append(f"missing numbers {', '.join(missing)}")
    unknown = [k for k in numbers if k not in NUMBERS]
    if unknown:
        problems.append(f"unknown numbers {', '.join(unknown)} (the numbers are: "
                        f"{', '.join(NUMBERS)})")
    for key, entry in numbers.items():
        value = entry.get("value") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f'{key} needs a "value" that is a number, got {entry!r}')
        elif not (isinstance(entry.get("source"), str) and entry["source"].strip()):
            problems.append(f'{key} has no "source" (a datasheet, a measurement or a fit)')
    traits = data.get("traits", {})
    if not isinstance(traits, dict):
        problems.append(f'"traits" must be an object, got {traits!r}')
    else:
        odd = [k for k in traits if k not in TRAITS]
        if odd:
            problems.append(f"unknown traits {', '.join(odd)} (the traits are: "
                            f"{', '.join(TRAITS)})")
    return problems


def unmeasured(profile: Profile, layout: dict) -> list:
    """The layout's (knob, value) pairs the profile's runs never had (("zero", 3)), by its trait
    measured; a knob that does not act (pp_engine at pp 1, cp_mode at cp 1, interleave but
    for the interleaved engine) is not judged."""
    idle = {"pp_engine": layout.get("pp", 1) == 1, "cp_mode": layout.get("cp", 1) == 1,
            "interleave": layout.get("pp_engine") != "interleaved"}
    measured = profile.traits.get("measured", {})
    return [(knob, layout[knob]) for knob, values in measured.items()
            if knob in layout and not idle.get(knob) and layout[knob] not in values]


def describe(profile: Profile) -> str:
    """Every number of the profile with what it means and its source."""
    lines = [f"{profile.name}: {profile.about}"]
    for key, value in profile.numbers.items():
        lines.append(f"  {key:18s} {value:<12.6g} {NUMBERS.get(key, '')}"
                     f"\n  {'':18s} source: {profile.sources[key]}")
    lines += [f"  trait {k}: {v}" for k, v in profile.traits.items()]
    return "\n".join(lines)
