"""A SLURM batch script for a config: `python create_config.py ... --slurm --nodes 2
--gpus_per_node 8 --partition gpu --time 12:00:00` writes `slurm.sh` next to `config.json`.

The script asks SLURM for one task per node (`--ntasks-per-node=1`): `srun` starts one
torchrun on every node, and each torchrun starts one training process per GPU. The torchruns
find each other through a c10d rendezvous at the allocation's first node (`scontrol show
hostnames` lists the nodes in order), keyed by the job id; torchrun then numbers the
processes node by node, G consecutive ranks per node. So the allocation must hold exactly the
config's world size (nodes x gpus_per_node = dp*tp*pp*cp), and a tensor-parallel group must
fit in a node (gpus_per_node % tp == 0, `check_nodes`): both are refused here, before a job
waits in the queue only to fail at start-up.
"""
import os
import re
import shlex

from picotron.errors import ConfigError
from picotron.process_group_manager import check_nodes

# picotron/run/slurm.py -> the repository root, where train.py lives
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# SLURM's time limits: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")      # a partition or account: one word, no quoting
FLAGS = ("nodes", "gpus_per_node", "partition", "time", "account", "cpus_per_task",
         "rdzv_port")


def add_slurm_flags(parser) -> None:
    """create_config.py's `--slurm` and the allocation it describes."""
    parser.add_argument("--slurm", action="store_true",
                        help="also write OUT_DIR/EXP_NAME/slurm.sh, a batch script for "
                             "`sbatch` running the config on --nodes nodes")
    parser.add_argument("--nodes", type=int,
                        help="with --slurm: nodes to allocate (x --gpus_per_node must equal "
                             "dp*tp*pp*cp)")
    parser.add_argument("--gpus_per_node", type=int,
                        help="with --slurm: GPUs (training processes) per node; tp must "
                             "divide it")
    parser.add_argument("--partition", help="with --slurm: the SLURM partition (queue)")
    parser.add_argument("--time", help="with --slurm: the job's time limit, e.g. 12:00:00 or "
                                       "2-00:00:00")
    parser.add_argument("--account", help="with --slurm: the account charged (optional)")
    parser.add_argument("--cpus_per_task", type=int,
                        help="with --slurm: CPU cores per node's task (default: 8 per GPU)")
    parser.add_argument("--rdzv_port", type=int, default=29500,
                        help="with --slurm: the rendezvous port on the first node; it must be "
                             "free and reachable from the other nodes (default: 29500)")


def slurm_problems(args, world_size: int, tp: int, cp: int) -> list:
    """Every reason the `--slurm` flags cannot describe this config's allocation. Also
    refuses the allocation flags without `--slurm` (they would be silently ignored)."""
    given = [f"--{f}" for f in FLAGS if f != "rdzv_port" and getattr(args, f) is not None]
    if not args.slurm:
        return [f"{', '.join(given)} apply only with --slurm; add --slurm"] if given else []
    missing = [f"--{f}" for f in ("nodes", "gpus_per_node", "partition", "time")
               if getattr(args, f) is None]
    if missing:
        return [f"--slurm needs {', '.join(missing)}"]
    problems = [f"--{f} must be at least 1, got {getattr(args, f)}"
                for f in ("nodes", "gpus_per_node", "cpus_per_task")
                if getattr(args, f) is not None and getattr(args, f) < 1]
    run_dir = os.path.abspath(os.path.join(args.out_dir, args.exp_name))
    if any(c.isspace() for c in run_dir):       # #SBATCH lines are split at white space
        problems.append(f"the run folder {run_dir!r} holds white space, which the script's "
                        f"#SBATCH --job-name/--output lines cannot carry; choose --out_dir "
                        f"and --exp_name without spaces")
    if not 1 <= args.rdzv_port <= 65535:
        problems.append(f"--rdzv_port must be a port (1-65535), got {args.rdzv_port}")
    if not TIME.match(args.time):
        problems.append(f"--time {args.time!r} is not a SLURM time limit; write minutes, "
                        f"HH:MM:SS or D-HH:MM:SS, e.g. 12:00:00")
    for flag in ("partition", "account"):
        value = getattr(args, flag)
        if value is not None and not NAME.match(value):
            problems.append(f"--{flag} {value!r} must be one word (letters, digits, _ . , + -)")
    if problems:
        return problems
    if args.nodes * args.gpus_per_node != world_size:
        return [f"--nodes {args.nodes} x --gpus_per_node {args.gpus_per_node} = "
                f"{args.nodes * args.gpus_per_node} processes, but the config's dp*tp*pp*cp = "
                f"{world_size}; change --nodes/--gpus_per_node or the layout so they match"]
    try:
        check_nodes(tp, cp, args.gpus_per_node, world_size)   # the warning: train.py says it
    except ConfigError as e:
        return [str(e)]
    return []


def slurm_script(args, config_path: str, job_name: str, use_gpus: bool = True) -> str:
    """The batch script's text. Paths are absolute: the job starts wherever sbatch was run."""
    config_path = os.path.abspath(config_path)
    run_dir = os.path.dirname(config_path)
    cpus = args.cpus_per_task or 8 * args.gpus_per_node
    sbatch = [f"--job-name={job_name}", f"--nodes={args.nodes}", "--ntasks-per-node=1"]
    sbatch += [f"--gpus-per-node={args.gpus_per_node}"] * use_gpus
    sbatch += [f"--cpus-per-task={cpus}", f"--partition={args.partition}",
               f"--time={args.time}"]
    sbatch += [f"--account={args.account}"] * (args.account is not None)
    sbatch += [f"--output={os.path.join(run_dir, 'slurm-%j.out')}"]
    lines = ["#!/bin/bash"] + [f"#SBATCH {s}" for s in sbatch] + [
        "#",
        "# One task per node: srun starts one torchrun on each node, which starts "
        f"{args.gpus_per_node} training",
        "# processes; they meet at the first node of the allocation (c10d rendezvous) and",
        "# torchrun numbers them node by node. Every node must see this folder, the config",
        "# and the data at the same paths (a shared filesystem).",
        "# Several network interfaces: pick the one between nodes, e.g.",
        "# export NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0",
        "# To diagnose a hang or a slow start: export NCCL_DEBUG=WARN (or INFO)",
        "set -eu",
        f"cd {shlex.quote(ROOT)}",
        'HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"PORT={args.rdzv_port}",
        f'srun torchrun --nnodes "$SLURM_NNODES" --nproc_per_node {args.gpus_per_node} '
        f'--rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$HOST:$PORT" '
        f"train.py --config {shlex.quote(config_path)}",
    ]
    return "\n".join(lines) + "\n"


def write_slurm_script(args, config_path: str, job_name: str, use_gpus: bool = True) -> str:
    """Write slurm.sh next to the config (executable); returns its path."""
    path = os.path.join(os.path.dirname(os.path.abspath(config_path)), "slurm.sh")
    with open(path, "w") as f:
        f.write(slurm_script(args, config_path, job_name, use_gpus))
    os.chmod(path, 0o755)
    return path
