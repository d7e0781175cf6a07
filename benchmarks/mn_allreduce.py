"""One rank of the multi-node allreduce benchmark (``benchmarks/multinode.py`` runs it
across a virtual cluster; any multi-node ``mpiexec`` works too).

    mpiexec ... python benchmarks/mn_allreduce.py --lib gpurt|mpi [--algo auto|ring|...]
                                                  [--bytes 64M] [--iters 5] [--warmup 1]

Out of place, float32, every rank's input ``rank + 1``: each result is checked exactly
(``p(p+1)/2``).  Every iteration starts after an MPI barrier and its time is the slowest
rank's.  Local rank 0 of every node reads the node's network byte counters (every
interface but ``lo``, ``/sys/class/net/*/statistics``) around the timed loop, so the report
says how many bytes really crossed each node's link per iteration.  Rank 0 prints one
line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI


def _bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def link_counters() -> tuple[int, int]:
    tx = rx = 0
    base = "/sys/class/net"
    for ifname in os.listdir(base):
        if ifname == "lo":
            continue
        try:
            with open(f"{base}/{ifname}/statistics/tx_bytes") as f:
                tx += int(f.read())
            with open(f"{base}/{ifname}/statistics/rx_bytes") as f:
                rx += int(f.read())
        except OSError:
            pass
    return tx, rx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", choices=("gpurt", "mpi"), default="gpurt")
    ap.add_argument("--algo", default="auto")
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    n = _bytes(a.bytes) // 4
    x = np.full(n, rank + 1, np.float32)
    out = np.empty_like(x)
    want = np.float32(p * (p + 1) // 2)
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    comm = None
    explain = algorithm = ""
    if a.lib == "gpurt":
        import gpurt
        comm = gpurt.init()
        algo = None if a.algo == "auto" else a.algo

        def run() -> None:
            comm.allreduce(x, out, algo=algo)
        explain = comm.explain("allreduce", n * 4)
    else:
        def run() -> None:
            world.Allreduce(x, out, op=MPI.SUM)
    wrong = 0
    for _ in range(a.warmup):
        run()
    world.Barrier()
    c0 = link_counters() if node.Get_rank() == 0 else (0, 0)
    times = []
    for _ in range(a.iters):
        world.Barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        wrong += int(np.count_nonzero(out != want))
        out[:] = 0
    world.Barrier()
    c1 = link_counters() if node.Get_rank() == 0 else (0, 0)
    if comm is not None:
        algorithm = comm.last_algorithm
    slowest = np.zeros(len(times))
    world.Reduce(np.array(times), slowest, op=MPI.MAX, root=0)
    wrong = world.reduce(wrong, op=MPI.SUM, root=0)
    links = world.gather((socket.gethostname(), c1[0] - c0[0], c1[1] - c0[1])
                         if node.Get_rank() == 0 else None, 0)
    nnodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
    if rank == 0:
        t = sorted(slowest.tolist())
        print("RESULT " + json.dumps({
            "lib": a.lib, "algo": a.algo, "algorithm": algorithm, "ranks": p,
            "nodes": nnodes, "bytes": n * 4, "iters": a.iters, "times": slowest.tolist(),
            "median_s": t[len(t) // 2], "min_s": t[0], "wrong": wrong,
            "links": [l for l in links if l is not None], "explain": explain}), flush=True)
    if comm is not None:
        comm.close()
    return 1 if rank == 0 and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
