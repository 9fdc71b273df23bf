"""A few hundred mutated configs of the tiny CPU setup: each must be refused cleanly at load
time, or train one step, or be refused cleanly while the run is set up. Any other exception,
a step that logs a non-finite loss, or a case that runs past its time fails the test, naming
the mutation.

A mutation changes one or two fields of the config file to a value from a pool (0, -1, NaN,
infinity, 1e300, 2^70, wrong types, strings, paths that do not exist, null), deletes a key or
a section, or adds an unknown key. Loading is checked here, in-process (cheap); the configs
that load train in tests/workers/fuzz_train.py, one process for many of them, which this test
kills and restarts when a case runs past CASE_TIMEOUT_S. The HUGE cases are sizes that are in
range but cannot fit in memory: the memory estimate must refuse them at set-up. The EDGES are
the ends of the ranges, which must train (or be refused cleanly) like any other value."""
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time

from launch import ROOT
from picotron.config import Config, ConfigError, MissingPackage, load_config

SEED, CASES = 20240601, 300
CASE_TIMEOUT_S = 30          # one tiny step takes well under a second; start-up ~10 s
ONE_STEP = "training.total_train_steps=1"
NAN, INF = float("nan"), float("inf")
# Out-of-range or small in-range numbers only: a valid but slow value (a million micro-batches
# per step) is not a defect, so it is not in the pool.
NUMBERS = [0, 1, 2, 3, 7, -1, 2 ** 31, 2 ** 63, 2 ** 70, 0.0, 0.5, 1.0, 1.5, 1e-9, -0.5, NAN,
           INF, -INF, 1e300]
STRINGS = ["", "abc", "auto", "byte", "none", "latest", "synthetic", "embedded", "float16",
           "bfloat16", "ulysses", "interleaved", "layernorm", "eager", "sdpa", "full",
           "selective", "chunked", "{tmp}/missing/dir", "{tmp}/a_file", "owner/name"]
OTHERS = [True, False, None, [], {}, [1, 2], ["training.seed"]]
BOOLS = [True, False]
# A valid option that is merely slow here is not given other values: compiling the layers
# takes minutes on a CPU.
SLOW_ON_CPU = {"training.compile"}
EDGES = [  # the ends of the ranges, cheap to train
    {"training.seq_length": 3}, {"training.seq_length": 1, "training.micro_batch_size": 1},
    {"model.hidden_size": 2, "model.num_attention_heads": 1, "model.num_key_value_heads": 1,
     "model.intermediate_size": 1},
    {"training.adam_beta1": 0.0, "training.adam_beta2": 0.0, "training.adam_eps": 1.0},
    {"training.learning_rate": 1.0, "training.weight_decay": 10.0, "training.warmup_steps": 0},
    {"model.rope_theta": 1.0000001, "model.rms_norm_eps": 1.0, "model.initializer_range": 1.0},
    {"training.dtype": "float16", "training.initial_loss_scale": 2.0 ** 32},
    {"training.dtype": "bfloat16", "training.master_weights": False},
    {"dataset.num_samples": 1}, {"dataset.name": "synthetic", "model.vocab_size": 2},
    {"distributed.bucket_size_mb": 1e-9, "distributed.offload_optim_frac": 1.0},
    {"training.fused_loss": "chunked", "training.loss_chunk_tokens": 1},
]
HUGE = [  # in range, but far beyond any machine's memory
    {"training.micro_batch_size": 65536, "training.seq_length": 64, "model.vocab_size": 65536},
    {"model.hidden_size": 2 ** 17},
    {"model.num_hidden_layers": 4096, "model.hidden_size": 8192},
    {"model.vocab_size": 2 ** 21, "training.micro_batch_size": 4096},
    {"model.intermediate_size": 2 ** 20, "model.hidden_size": 4096},
    {"model.max_position_embeddings": 2 ** 24, "training.seq_length": 2 ** 24},
]


def base_config() -> dict:
    """The tiny CPU setup, every section written out (as create_config.py writes)."""
    raw = Config().to_dict()
    raw["distributed"]["use_cpu"] = True
    raw["model"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64)
    raw["training"].update(dtype="float32", micro_batch_size=2, seq_length=16,
                           total_train_steps=1)
    raw["dataset"]["num_samples"] = 64
    return raw


def mutate(raw: dict, rng: random.Random, tmp: str) -> list:
    """Apply one random mutation to `raw` in place; return its description."""
    section = rng.choice(sorted(raw))
    kind = rng.choices(["value", "delete key", "delete section", "section value",
                        "unknown key"], weights=[86, 5, 3, 3, 3])[0]
    if kind == "delete section":
        del raw[section]
        return [f"no '{section}' section"]
    if kind == "section value":
        raw[section] = rng.choice([None, [], "abc", 1])
        return [f"{section}={raw[section]!r}"]
    if not isinstance(raw[section], dict) or not raw[section]:
        return []
    key = rng.choice(sorted(k for k in raw[section] if f"{section}.{k}" not in SLOW_ON_CPU))
    if kind == "delete key":
        del raw[section][key]
        return [f"no '{section}.{key}'"]
    if kind == "unknown key":
        raw[section][key + "_x"] = 1
        return [f"{section}.{key}_x=1"]
    default = Config().to_dict()[section].get(key)
    same_type = (BOOLS if isinstance(default, bool) else STRINGS if isinstance(default, str)
                 else NUMBERS if isinstance(default, (int, float)) else OTHERS)
    pool = same_type if rng.random() < 0.75 else rng.choice([NUMBERS, STRINGS, OTHERS])
    value = rng.choice(pool)
    if isinstance(value, str):
        value = value.format(tmp=tmp)
    raw[section][key] = value
    return [f"{section}.{key}={value!r}"]


def set_fields(raw: dict, fields: dict) -> list:
    for key, value in fields.items():
        section, name = key.split(".")
        raw[section][name] = value
    return [f"{k}={v!r}" for k, v in fields.items()]


def write_cases(tmp: str) -> list:
    """[(mutations, config path)]: CASES random ones, then the EDGES, then the HUGE ones."""
    rng = random.Random(SEED)
    open(os.path.join(tmp, "a_file"), "w").close()
    cases = []
    for i in range(CASES + len(EDGES) + len(HUGE)):
        raw = base_config()
        if i < CASES:
            mutations = [m for _ in range(rng.choice([1, 1, 2])) for m in mutate(raw, rng, tmp)]
        else:
            mutations = set_fields(raw, (EDGES + HUGE)[i - CASES])
        run_dir = os.path.join(tmp, f"case{i:03d}")
        os.makedirs(run_dir)
        path = os.path.join(run_dir, "config.json")
        with open(path, "w") as f:
            json.dump(raw, f)          # NaN and Infinity as Python's json writes them
        cases.append((mutations, path))
    return cases


def loads(path: str) -> bool:
    """True when the config loads; False when it is refused cleanly. Anything else raises."""
    try:
        load_config(path, world_size=1, overrides=[ONE_STEP])
        return True
    except (ConfigError, MissingPackage):
        return False


def forward_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)                    # the end: the worker exited


def train_all(paths: list, cwd: str) -> dict:
    """{path: (outcome, detail)} from fuzz_train.py; a case that runs past CASE_TIMEOUT_S is
    "hang", and the worker is restarted on the cases after it."""
    results, remaining = {}, list(paths)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    while remaining:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "workers",
                                                              "fuzz_train.py"), *remaining],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=cwd)
        lines = queue.Queue()          # read by a thread, so that waiting can time out
        threading.Thread(target=forward_lines, args=(proc.stdout, lines), daemon=True).start()
        done, tail = 0, []
        deadline = time.monotonic() + CASE_TIMEOUT_S + 20          # + the start-up
        while done < len(remaining):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                results[remaining[done]] = ("hang", f"past {CASE_TIMEOUT_S} s")
                done += 1
                break
            if line is None:                                        # the worker died
                results[remaining[done]] = ("crash", "worker died:\n" + "".join(tail[-30:]))
                done += 1
                break
            tail.append(line)
            if line.startswith("FUZZ-START"):
                deadline = time.monotonic() + CASE_TIMEOUT_S
            elif line.startswith("FUZZ "):
                report = json.loads(line[5:])
                results[remaining[report["index"]]] = (report["outcome"], report["detail"])
                done, tail = report["index"] + 1, []
        proc.kill()
        proc.wait()
        remaining = remaining[done:]
    return results


def test_mutated_configs_are_refused_cleanly_or_train(tmp_path, monkeypatch):
    tmp = str(tmp_path)
    monkeypatch.chdir(tmp)             # relative paths in the mutations land in tmp_path
    start = time.monotonic()
    cases = write_cases(tmp)
    failures, to_train = [], []
    for mutations, path in cases:
        try:
            if loads(path):
                to_train.append(path)
        except Exception as e:         # not a clean refusal: a traceback at load time
            failures.append(f"{mutations}: load raised {type(e).__name__}: {e}")
    load_s = time.monotonic() - start
    results = train_all(to_train, tmp)
    described = {path: mutations for mutations, path in cases}
    outcomes = {}
    for path, (outcome, detail) in results.items():
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome not in ("trained", "refused"):
            failures.append(f"{described[path]}: {outcome}: {detail[-1500:]}")
    huge = {path for _, path in cases[CASES + len(EDGES):]}
    failures += [f"{described[p]}: trained, but it cannot fit in memory"
                 for p in huge if results.get(p, ("",))[0] == "trained"]
    summary = (f"{len(cases)} cases: {len(cases) - len(to_train)} refused at load "
               f"({load_s:.1f} s), then {outcomes} in {time.monotonic() - start:.0f} s")
    print(summary)
    assert not failures, summary + "\n" + "\n\n".join(failures)
    assert outcomes.get("trained", 0) >= 30, summary      # the fuzz reaches training
