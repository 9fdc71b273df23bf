"""Which collectives gloo runs on CUDA tensors, with two ranks on one GPU (cuda:0).

    python bench/share_gpu_probe.py

distributed.share_gpu runs every rank on cuda:0 over gloo, and picotron/comm.py passes the
collectives gloo refuses on CUDA through host memory (its GLOO_NEEDS_HOST). This script finds
them on the GPU at hand: two processes forked from this one (which never touches CUDA), each
collective of the project in float32 and bfloat16, its result checked against the value it
must have. A case that crashes a process (a CUDA pointer handed to a host transport) or hangs
is recorded, and the next case runs on a fresh pair; so does the case after a refusal (gloo
can close the pair's connection when it refuses: on an H100 with torch 2.11 every case after
a refused send/recv failed with "Connection closed by peer"). Then the same collectives through
picotron/comm.py's host path. Prints one row per case and the set GLOO_NEEDS_HOST should be.
"""
import argparse
import datetime
import multiprocessing as mp
import os
import queue
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from picotron import comm  # noqa: E402

WORLD = 2
DEVICE = "cuda"     # --cpu: a dry run of this script on CPU tensors


def full(value, dtype, n=4):
    return torch.full((n,), float(value), device=DEVICE, dtype=dtype)


# name -> (collective of GLOO_NEEDS_HOST, fn(rank, dtype, host) -> (got, expected))
def _all_reduce(r, dt, host, op=dist.ReduceOp.SUM):
    t = full(r + 1, dt)
    dist.all_reduce(t, op=op)
    return t, full(3 if op == dist.ReduceOp.SUM else 2, dt)


def _all_reduce_async(r, dt, host):
    t = full(r + 1, dt)
    dist.all_reduce(t, async_op=True).wait()
    return t, full(3, dt)


def _broadcast(r, dt, host):
    t = full(r + 5, dt)
    dist.broadcast(t, src=0)
    return t, full(5, dt)


def _all_gather(r, dt, host):
    outs = [full(-1, dt) for _ in range(WORLD)]
    dist.all_gather(outs, full(r, dt))
    return torch.cat(outs), torch.cat([full(i, dt) for i in range(WORLD)])


def _all_gather_single(r, dt, host):
    out = full(-1, dt, 4 * WORLD)
    work = comm.all_gather_single(out, full(r, dt), async_op=True, through_host=host)
    work.wait()
    return out, torch.cat([full(i, dt) for i in range(WORLD)])


def _reduce_scatter_single(r, dt, host):
    x = torch.arange(4 * WORLD, device=DEVICE).to(dt) * (r + 1)
    out = full(-1, dt)
    comm.reduce_scatter_single(out, x, group=None, through_host=host)
    return out, (torch.arange(4 * WORLD, device=DEVICE).to(dt) * 3)[4 * r: 4 * r + 4]


def _all_to_all_single(r, dt, host):
    x = (10 * r + torch.arange(WORLD, device=DEVICE)).to(dt).repeat_interleave(2)
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, through_host=host)
    return out, (torch.arange(WORLD, device=DEVICE) * 10 + r).to(dt).repeat_interleave(2)


def _send_recv(r, dt, host):
    t = full(7 if r == 0 else -1, dt)
    if host:   # one send, one receive through the host path
        op = dist.P2POp(dist.isend if r == 0 else dist.irecv, t, 1 - r)
        for work in comm.batch_isend_irecv([op], through_host=True):
            work.wait()
    elif r == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    return t, full(7, dt)


def _batch_isend_irecv(r, dt, host):
    sent, got = full(r + 1, dt), full(-1, dt)
    ops = [dist.P2POp(dist.isend, sent, 1 - r), dist.P2POp(dist.irecv, got, 1 - r)]
    works = (comm.batch_isend_irecv(ops, through_host=True) if host
             else dist.batch_isend_irecv(ops))
    for work in works:
        work.wait()
    return got, full(2 - r, dt)


CASES = {"all_reduce": ("all_reduce", _all_reduce),
         "all_reduce MAX": ("all_reduce", lambda r, dt, h: _all_reduce(r, dt, h,
                                                                       dist.ReduceOp.MAX)),
         "all_reduce async": ("all_reduce", _all_reduce_async),
         "broadcast": ("broadcast", _broadcast),
         "all_gather (list)": ("all_gather", _all_gather),
         "all_gather_single": ("all_gather_single", _all_gather_single),
         "reduce_scatter_single": ("reduce_scatter_single", _reduce_scatter_single),
         "all_to_all_single": ("all_to_all_single", _all_to_all_single),
         "send/recv": ("send/recv", _send_recv),
         "batch_isend_irecv": ("send/recv", _batch_isend_irecv)}
# on the host path: only the collectives comm.py wraps
HOST_CASES = ["all_gather_single", "reduce_scatter_single", "all_to_all_single", "send/recv",
              "batch_isend_irecv"]


def rank_main(rank, port, todo, results):
    """One rank: the cases of `todo` in order; puts ("start", key) before each, then
    ("done", key, verdict)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=20))
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    for key in todo:
        name, dtype, host = key
        results.put(("start", rank, key))
        try:
            got, want = CASES[name][1](rank, getattr(torch, dtype), host)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            verdict = "ok" if torch.equal(got.cpu(), want.cpu()) else (
                f"WRONG: {got.cpu().tolist()} != {want.cpu().tolist()}")
        except Exception as e:        # gloo's refusal: its first line
            verdict = "refused: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:110]
        results.put(("done", rank, key, verdict))
        if verdict != "ok":       # a refusal can leave the pair's connection closed
            break
    dist.destroy_process_group()
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(keys):
    """{key: verdict}; a pair that crashes or hangs ends its case, and a fresh pair runs on."""
    ctx, verdicts = mp.get_context("fork"), {}
    while len(verdicts) < len(keys):
        todo = [k for k in keys if k not in verdicts]
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, port, todo, results))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        current, seen = {}, {}
        while len(verdicts) < len(keys):
            try:
                msg = results.get(timeout=30)   # gloo's own timeout is 20 s
            except queue.Empty:
                msg = None
            if msg is None or any(p.exitcode not in (None, 0) for p in procs):
                key = current.get(0) or current.get(1) or todo[0]
                codes = [p.exitcode for p in procs]
                verdicts[key] = (f"crashed (exit codes {codes})" if msg is None or any(
                    c not in (None, 0) for c in codes) else "hung")
                break
            if msg[0] == "start":
                current[msg[1]] = msg[2]
            else:
                seen.setdefault(msg[2], []).append(msg[3])
                if len(seen[msg[2]]) == WORLD:
                    both = seen[msg[2]]
                    verdicts[msg[2]] = next((v for v in both if v != "ok"), "ok")
                    if verdicts[msg[2]] != "ok":
                        break         # the next case on a fresh pair
        for p in procs:
            p.kill()
            p.join()
    return verdicts


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description="Which collectives gloo runs on CUDA tensors "
                                     "with two ranks on cuda:0, and which need comm.py's host "
                                     "copy.", allow_abbrev=False)
    parser.add_argument("--cpu", action="store_true", help="a dry run on CPU tensors")
    if parser.parse_args().cpu:
        DEVICE = "cpu"
    keys = [(n, dt, False) for n in CASES for dt in ("float32", "bfloat16")]
    keys += [(n, dt, True) for n in HOST_CASES for dt in ("float32", "bfloat16")]
    verdicts = run_all(keys)
    # only now: CUDA used in this process before a fork is unusable in the forked ranks
    where = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU (dry run)"
    print(f"torch {torch.__version__}, {where}; {WORLD} gloo ranks on {DEVICE}", flush=True)
    print(f"{'collective':24s} {'dtype':9s} {'path':14s} result")
    for name, dtype, host in keys:
        path = "comm host copy" if host else f"gloo on {DEVICE}"
        print(f"{name:24s} {dtype:9s} {path:14s} {verdicts[(name, dtype, host)]}")
    refused = sorted({CASES[n][0] for n, dt, host in keys
                      if not host and verdicts[(n, dt, host)] != "ok"})
    print(f"GLOO_NEEDS_HOST should be {set(refused) or '{}'}; picotron/comm.py has "
          f"{set(comm.GLOO_NEEDS_HOST)}", flush=True)


if __name__ == "__main__":
    main()
