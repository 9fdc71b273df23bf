"""More than one machine: the SLURM script create_config writes, the check that keeps a
tensor-parallel group inside a node, and a two-"node" run on this host that trains like one
process.

The two nodes are two torchrun launchers (2 gloo processes each) meeting through a c10d
rendezvous on localhost, as two machines would at the first node's address."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from launch import ROOT, final_weights, free_port, launch, read_metrics, write_config
import create_config
from picotron.errors import ConfigError
from picotron.process_group_manager import check_nodes

SLURM = ["--slurm", "--partition", "gpu", "--time", "02:00:00", "--account", "proj1"]


# ---- the grid check -----------------------------------------------------------------------

def test_check_nodes_refuses_tp_across_nodes():
    with pytest.raises(ConfigError, match=r"tp_size=8 does not divide the 4 processes"):
        check_nodes(tp=8, cp=1, ranks_per_node=4, world_size=16)
    with pytest.raises(ConfigError, match=r"e\.g\. 2"):       # 3 does not divide 4: use 2
        check_nodes(tp=3, cp=1, ranks_per_node=4, world_size=12)


def test_check_nodes_warns_for_a_context_ring_across_nodes():
    warning = check_nodes(tp=2, cp=4, ranks_per_node=4, world_size=16)   # rings of 8 ranks
    assert warning.startswith("warning:") and "cp_size*tp_size = 4*2 = 8" in warning
    assert "\n" not in warning
    assert check_nodes(tp=2, cp=3, ranks_per_node=4, world_size=12)     # 6 does not divide 4


def test_check_nodes_accepts_layouts_that_fit():
    assert check_nodes(tp=4, cp=2, ranks_per_node=8, world_size=16) is None
    assert check_nodes(tp=8, cp=1, ranks_per_node=8, world_size=64) is None
    assert check_nodes(tp=1, cp=1, ranks_per_node=3, world_size=6) is None
    assert check_nodes(tp=8, cp=4, ranks_per_node=8, world_size=8) is None    # one node


# ---- the SLURM script ---------------------------------------------------------------------

def run_script(script: str, tmp_path, nodes: int) -> list:
    """Run slurm.sh under bash with stand-ins for srun and scontrol on PATH; returns the
    argument list srun received (the torchrun command), with SLURM's variables expanded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    (bin_dir / "srun").write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp_path}/srun.args\n")
    for f in ("scontrol", "srun"):
        os.chmod(bin_dir / f, 0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_NODELIST="gpu-node-[07-08]", SLURM_NNODES=str(nodes),
               SLURM_JOB_ID="4242")
    proc = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "srun.args").read_text().splitlines()


def option(argv: list, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_slurm_script_matches_the_config(tmp_path, capsys):
    out = tmp_path / "configs"
    path = create_config.main(["--out_dir", str(out), "--exp_name", "two-nodes", "--dp", "4",
                               "--tp", "2", "--pp", "2", "--nodes", "2", "--gpus_per_node", "8"]
                              + SLURM)
    script = os.path.join(os.path.dirname(path), "slurm.sh")
    assert "sbatch " + script in capsys.readouterr().err
    assert subprocess.run(["bash", "-n", script]).returncode == 0      # the syntax parses
    text = open(script).read()
    sbatch = dict(line[len("#SBATCH --"):].split("=", 1) for line in text.splitlines()
                  if line.startswith("#SBATCH --"))
    assert sbatch == {"job-name": "two-nodes", "nodes": "2", "ntasks-per-node": "1",
                      "gpus-per-node": "8", "cpus-per-task": "64", "partition": "gpu",
                      "time": "02:00:00", "account": "proj1",
                      "output": os.path.join(os.path.abspath(os.path.dirname(path)),
                                             "slurm-%j.out")}
    argv = run_script(script, tmp_path, nodes=int(sbatch["nodes"]))
    assert argv[0] == "torchrun" and argv[-3:-1] == ["train.py", "--config"]
    config = json.load(open(path))["distributed"]
    world = config["dp_size"] * config["tp_size"] * config["pp_size"] * config["cp_size"]
    assert int(option(argv, "--nnodes")) * int(option(argv, "--nproc_per_node")) == world == 16
    assert option(argv, "--rdzv_backend") == "c10d" and option(argv, "--rdzv_id") == "4242"
    assert option(argv, "--rdzv_endpoint") == "gpu-node-07:29500"    # the first node
    assert os.path.isabs(argv[-1]) and os.path.samefile(argv[-1], path)
    assert f"cd {ROOT}" in text.splitlines()           # train.py is found from any folder


@pytest.mark.parametrize("flags, message", [
    (["--dp", "4", "--nodes", "2", "--gpus_per_node", "4"] + SLURM,
     "--nodes 2 x --gpus_per_node 4 = 8 processes, but the config's dp*tp*pp*cp = 4"),
    (["--dp", "2", "--tp", "4", "--nodes", "4", "--gpus_per_node", "2"] + SLURM,
     "tp_size=4 does not divide the 2 processes (GPUs) per node"),
    (["--dp", "2", "--nodes", "2", "--gpus_per_node", "1"],
     "--nodes, --gpus_per_node apply only with --slurm"),
    (["--dp", "2", "--slurm", "--nodes", "2"], "--slurm needs --gpus_per_node, --partition, "
                                                "--time"),
    (["--dp", "4", "--nodes", "1", "--gpus_per_node", "4", "--exp_name", "my run"] + SLURM,
     "holds white space, which the script's #SBATCH --job-name/--output lines cannot carry"),
])
def test_create_config_refuses_an_allocation_that_does_not_fit(tmp_path, capsys, flags,
                                                               message):
    with pytest.raises(SystemExit) as exit_:
        create_config.main(["--out_dir", str(tmp_path), "--exp_name", "bad"] + flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad")          # nothing written


# ---- two nodes on one host ----------------------------------------------------------------

# A small model and 3 steps of a global batch of 4 sequences: dp2 x tp2 on two "nodes" of two
# processes (one tp group per node), against one process accumulating 2 micro-batches of 2.
TINY = ["--set", "model.hidden_size=64", "--set", "model.intermediate_size=160",
        "--num_hidden_layers", "2", "--seq_len", "32", "--learning_rate", "1e-3",
        "--set", "training.warmup_steps=1", "--set", "training.adam_eps=1e-6",
        "--total_train_steps", "3", "--seed", "7",
        "--set", "distributed.timeout_s=120", "--mbs", "2"]


LAUNCHERS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
             "train.py": [sys.executable, os.path.join(ROOT, "train.py")]}


def launch_nodes(config_path: str, timeout: int = 240, launcher: str = "torchrun") -> list:
    """Start the two nodes' launchers (torchrun, or train.py's own launch flags), wait for
    both; returns their (returncode, output).
    Their output goes to files (a launcher printing stack traces into a pipe nobody reads
    yet would block); a launcher still running at the timeout is killed with its workers."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    logs = [os.path.join(os.path.dirname(config_path), f"node{node}.log") for node in (0, 1)]
    procs = []
    for node, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                LAUNCHERS[launcher] + [
                    "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}",
                    "--rdzv_id", "test"] + ([os.path.join(ROOT, "train.py")]
                                            if launcher == "torchrun" else [])
                + ["--config", config_path],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"node{i}.log:\n{open(log).read()[-3000:]}" for i, log in enumerate(logs))
        raise AssertionError(f"the two launchers did not end within {timeout} s\n{tails}")
    finally:
        for p in procs:                 # a launcher still running (a timeout): end its group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(code, open(log).read()) for code, log in zip(codes, logs)]


def test_two_nodes_train_like_one_process(tmp_path):
    two = write_config(tmp_path, "two-nodes", TINY + ["--dp", "2", "--tp", "2",
                                                       "--grad_acc_steps", "1"])
    ref = write_config(tmp_path, "one-process", TINY + ["--grad_acc_steps", "2"])
    results = launch_nodes(two)
    for node, (code, output) in enumerate(results):
        assert code == 0, f"node {node} exited {code}:\n{output[-4000:]}"
    # Rank 0 (the one that logs) is on whichever launcher joined the rendezvous first: c10d
    # ignores --node_rank (torchrun says so; started the other way round, the launcher given
    # --node_rank 1 held rank 0). Exactly one of them logged the run.
    logged = [bool(re.search(r"step +3/3 \| loss", output)) for _, output in results]
    assert sorted(logged) == [False, True], [o[-2000:] for _, o in results]
    print(f"rank 0 ran under the launcher given --node_rank {logged.index(True)}")
    launch(ref, 1)
    run, one = ([r for r in read_metrics(p) if "loss" in r] for p in (two, ref))
    assert [r["step"] for r in run] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(run, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]
    # the final checkpoints, written by the two nodes' ranks: a wrong average over dp or a
    # stale tp shard moves a weight by ~1e-3 (one step at lr 1e-3) and the loss far less
    w_two, w_one = final_weights(two), final_weights(ref)
    assert w_two.keys() == w_one.keys()
    for key in w_one:
        torch.testing.assert_close(w_two[key], w_one[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_train_refuses_a_tp_group_across_nodes(tmp_path, launcher):
    """tp 4 over two nodes of 2 processes: train.py refuses it at start-up (LOCAL_WORLD_SIZE 2
    < WORLD_SIZE 4). Rank 0 says it; the first rank of the other node says it too and fails,
    so that node's launcher ends at once instead of waiting for the failed one. train.py's
    own launch ends both nodes with the workers' status 2 and nothing of the launcher's."""
    path = write_config(tmp_path, "tp4", TINY + ["--tp", "4", "--grad_acc_steps", "2"])
    started = time.monotonic()
    results = launch_nodes(path, timeout=120, launcher=launcher)
    assert time.monotonic() - started < 90            # no launcher waits out a barrier
    said = "tp_size=4 does not divide the 2 processes (GPUs) per node"
    assert all(code != 0 and said in output for code, output in results), results
    if launcher == "train.py":
        assert all(code == 2 and "Traceback" not in output and "torch/distributed" not in output
                   for code, output in results), results
    by_rank_0 = [f"error: {said}" in output for _, output in results]
    assert sorted(by_rank_0) == [False, True]
    assert "error (rank 2): " + said in results[by_rank_0.index(False)][1]
    assert not os.path.exists(os.path.join(os.path.dirname(path), "metrics.jsonl"))
