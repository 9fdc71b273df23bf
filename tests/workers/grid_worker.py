"""Run on 8 gloo ranks: build the grid for several layouts and check every group for real.

Each group's members are found by an all_gather of global ranks inside that group, and the
neighbours by a ring exchange; rank 0 writes what it saw for every rank to argv[1]."""
import json
import sys

import torch
import torch.distributed as dist

from picotron.process_group_manager import ProcessGroupManager

LAYOUTS = [(2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 2), (8, 1, 1, 1), (1, 1, 1, 8), (1, 1, 4, 2)]


def main(out_path):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen = {}
    for dp, pp, cp, tp in LAYOUTS:
        pgm = ProcessGroupManager(dp=dp, pp=pp, cp=cp, tp=tp)
        mine = {"coords": [pgm.dp_rank, pgm.pp_rank, pgm.cp_rank, pgm.tp_rank], "repr": repr(pgm)}
        for axis in ("dp", "pp", "cp", "tp", "cp_dp"):
            group, size = getattr(pgm, f"{axis}_group"), len(getattr(pgm, f"{axis}_group_ranks"))
            members = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
            dist.all_gather(members, torch.tensor([rank]), group=group)
            mine[axis] = [int(m) for m in members]
        # Context ring: send my rank forward, receive from behind.
        recv = torch.zeros(1, dtype=torch.long)
        ops = [dist.P2POp(dist.isend, torch.tensor([rank]), pgm.cp_send_rank),
               dist.P2POp(dist.irecv, recv, pgm.cp_recv_rank)] if cp > 1 else []
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        mine["cp_from"] = int(recv) if cp > 1 else rank
        if pp > 1:      # the pipeline's two ends (the tied embedding's gradient sum)
            ends = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
            dist.all_gather(ends, torch.tensor([rank]), group=pgm.pp_ends_group)
            mine["pp_ends"] = [int(e) for e in ends]
        mine["pp_prev"], mine["pp_next"] = pgm.pp_prev_rank, pgm.pp_next_rank
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        seen["x".join(map(str, (dp, pp, cp, tp)))] = everyone
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
