"""The dp x pp x cp x tp grid of ranks, and one process group per axis.

Ranks are laid out as `torch.arange(world).view(dp, pp, cp, tp)`: tp varies fastest, so the
ranks of one tensor-parallel group are neighbours (on one node, on NVLink), and dp varies
slowest. A rank's coordinates are its index in that 4-D array; the members of its group along
an axis are the ranks that differ from it only in that coordinate.

    world 8 = dp 2 x pp 2 x cp 1 x tp 2:
        rank:  0 1 2 3 4 5 6 7
        dp:    0 0 0 0 1 1 1 1
        pp:    0 0 1 1 0 0 1 1
        tp:    0 1 0 1 0 1 0 1
        tp groups [0,1] [2,3] ...   pp groups [0,2] [1,3] ...   dp groups [0,4] [1,5] ...

The pure functions below compute the grid with no process group at all (the tests check every
factorisation of 1..8 against them); `ProcessGroupManager` builds the real groups from them.

On several machines torchrun numbers each node's processes consecutively (node i holds ranks
[i*G, (i+1)*G) for G processes per node), so a group of consecutive ranks stays on one node
when its size divides G: `check_nodes` says which groups would cross the network.
"""
import datetime
import itertools
from typing import Optional

import torch
import torch.distributed as dist

from picotron.errors import ConfigError

AXES = ("dp", "pp", "cp", "tp")   # slowest to fastest


def grid(dp: int, pp: int, cp: int, tp: int) -> torch.Tensor:
    """(dp, pp, cp, tp) tensor of global ranks."""
    return torch.arange(dp * pp * cp * tp).view(dp, pp, cp, tp)


def coordinates(rank: int, dp: int, pp: int, cp: int, tp: int) -> dict:
    """This rank's index along each axis: {"dp": .., "pp": .., "cp": .., "tp": ..}."""
    coords = (grid(dp, pp, cp, tp) == rank).nonzero()[0].tolist()
    return dict(zip(AXES, coords))


def group_ranks(axes: tuple, dp: int, pp: int, cp: int, tp: int) -> list:
    """All groups along `axes` (e.g. ("tp",) or ("cp", "dp")), each a sorted list of ranks.

    A group holds the ranks that share every coordinate not in `axes`."""
    g = grid(dp, pp, cp, tp)
    kept = [a for a in AXES if a not in axes]
    # Move the group's axes last, then flatten them: each row is one group.
    order = [AXES.index(a) for a in kept] + [AXES.index(a) for a in AXES if a in axes]
    size = 1
    for a in axes:
        size *= g.shape[AXES.index(a)]
    rows = g.permute(order).reshape(-1, size)
    return [sorted(r) for r in rows.tolist()]


class ProcessGroupManager:
    """This rank's coordinates, its groups along every axis, and its neighbours.

    Attributes follow one pattern: `<axis>_rank`, `<axis>_size`, `<axis>_group`, and
    `<axis>_group_ranks` (the members, in global ranks), for axis in dp, pp, cp, tp and the
    combined cp_dp (gradients are averaged over it: both axes see different tokens). With
    pp > 1, `pp_ends_group` holds the first and last stage of this rank's pipeline (the tied
    embedding's two copies sum their gradients there).

    Sizes are keywords only, so a call cannot swap two axes: ProcessGroupManager(dp=2, tp=2),
    or `from_config(config)` in training. Without a process group it still computes every
    coordinate and member list (the groups are then None)."""

    def __init__(self, *, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, rank: int = None,
                 timeout: datetime.timedelta = None):
        world = dp * pp * cp * tp
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if dist.is_initialized() and dist.get_world_size() != world:
            raise ValueError(f"dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {world} but the process group "
                             f"has {dist.get_world_size()} ranks")
        self.global_rank, self.world_size = rank, world
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for axis, coord in coordinates(rank, dp, pp, cp, tp).items():
            setattr(self, f"{axis}_rank", coord)
            setattr(self, f"{axis}_size", sizes[axis])
        for name, axes in (("dp", ("dp",)), ("pp", ("pp",)), ("cp", ("cp",)), ("tp", ("tp",)),
                           ("cp_dp", ("cp", "dp"))):
            mine = None
            for ranks in group_ranks(axes, dp, pp, cp, tp):
                # new_group is collective: every rank creates every group, in the same order.
                # Its timeout does not follow init_process_group's: pass it (None: torch's).
                group = dist.new_group(ranks, timeout=timeout) if dist.is_initialized() else None
                if rank in ranks:
                    mine = (group, ranks)
            setattr(self, f"{name}_group", mine[0])
            setattr(self, f"{name}_group_ranks", mine[1])
        self.cp_dp_size = cp * dp
        self.cp_dp_rank = self.cp_dp_group_ranks.index(rank)
        # Pipeline neighbours (None at the ends) and the context ring (wraps around).
        pp_ranks, cp_ranks = self.pp_group_ranks, self.cp_group_ranks
        self.pp_is_first_stage = self.pp_rank == 0
        self.pp_is_last_stage = self.pp_rank == pp - 1
        self.pp_prev_rank = None if self.pp_is_first_stage else pp_ranks[self.pp_rank - 1]
        self.pp_next_rank = None if self.pp_is_last_stage else pp_ranks[self.pp_rank + 1]
        self.cp_send_rank = cp_ranks[(self.cp_rank + 1) % cp]
        self.cp_recv_rank = cp_ranks[(self.cp_rank - 1) % cp]
        # The pipeline's two ends. Created whenever pp > 1, tied embeddings or not: new_group
        # is collective, so the set of groups must not depend on anything but the grid.
        self.pp_ends_group, self.pp_ends_group_ranks = None, None
        if pp > 1:
            for ranks in group_ranks(("pp",), dp, pp, cp, tp):
                ends = [ranks[0], ranks[-1]]
                group = dist.new_group(ends, timeout=timeout) if dist.is_initialized() else None
                if rank in ranks:
                    self.pp_ends_group, self.pp_ends_group_ranks = group, ends

    @classmethod
    def from_config(cls, config, rank: int = None) -> "ProcessGroupManager":
        """The grid of `config.distributed`, its groups waiting up to `timeout_s` seconds."""
        d = config.distributed
        return cls(dp=d.dp_size, pp=d.pp_size, cp=d.cp_size, tp=d.tp_size, rank=rank,
                   timeout=datetime.timedelta(seconds=d.timeout_s))

    def __repr__(self) -> str:
        return (f"rank {self.global_rank}/{self.world_size}: dp {self.dp_rank}/{self.dp_size} "
                f"pp {self.pp_rank}/{self.pp_size} cp {self.cp_rank}/{self.cp_size} "
                f"tp {self.tp_rank}/{self.tp_size}")


def device_and_backend(distributed, local_rank: int) -> tuple:
    """(this rank's device, the process group's backend): gloo on CPU processes
    (distributed.use_cpu); NCCL with one GPU per rank, the rank's LOCAL_RANK-th; with
    distributed.share_gpu every rank on cuda:0 over gloo, since NCCL refuses two ranks on one
    device (picotron/comm.py passes what gloo cannot take on CUDA through host memory)."""
    if distributed.use_cpu:
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise ConfigError("distributed.use_cpu is false but no CUDA GPU is visible; "
                          "run on a GPU machine or recreate the config with --use_cpu")
    if distributed.share_gpu:
        return torch.device("cuda", 0), "gloo"
    return torch.device("cuda", local_rank), "nccl"


def check_nodes(tp: int, cp: int, ranks_per_node: int, world_size: int) -> Optional[str]:
    """Refuse a tensor-parallel group that would span two nodes; warn about a context ring that
    would. Returns the warning (one line) or None.

    A tp group is tp consecutive ranks and talks twice per layer, forward and backward
    (Megatron's all-reduces): over the network instead of NVLink it would stall every layer,
    so it must sit inside a node, i.e. tp divides the processes per node. A cp ring spans
    cp*tp consecutive ranks (cp varies next after tp) and passes key/value blocks once per
    attention step: across nodes it is slower but correct. One node (ranks_per_node >=
    world_size) has nothing to check."""
    if ranks_per_node >= world_size:
        return None
    if ranks_per_node % tp:
        fits = [t for t in range(1, ranks_per_node + 1) if ranks_per_node % t == 0 and t < tp]
        raise ConfigError(
            f"tp_size={tp} does not divide the {ranks_per_node} processes (GPUs) per node, so a "
            f"tensor-parallel group would span two nodes and all-reduce over the network in "
            f"every layer; use a tp_size that divides {ranks_per_node} (e.g. {fits[-1]}, with "
            f"dp/pp/cp taking the rest), or put a multiple of {tp} GPUs on each node (torchrun's "
            f"--nproc_per_node, create_config's --gpus_per_node)")
    if cp > 1 and ranks_per_node % (cp * tp):
        return (f"warning: a context-parallel ring (cp_size*tp_size = {cp}*{tp} = {cp * tp} "
                f"consecutive ranks) spans more than one node of {ranks_per_node} processes: "
                f"ring attention will pass its blocks over the network (correct, but slower)")
    return None


def factorisations(world: int):
    """Every (dp, pp, cp, tp) whose product is `world` (used by tests and create_config)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for dp, pp, cp in itertools.product(divisors, repeat=3):
        if world % (dp * pp * cp) == 0:
            yield dp, pp, cp, world // (dp * pp * cp)
