"""A/B of ``shm_direct`` against the tuner's schedule, alternating inside one launch.

    mpiexec -n 2 python benchmarks/direct_ab.py allreduce 1M,4M,16M shared,numpy

For each size and buffer kind (``shared``: ``comm.empty`` arrays; ``numpy``: NumPy arrays,
reached through process_vm_readv/writev), ``--rounds`` rounds of: the call with
``shm_direct`` allowed from 1 byte, then with it off (the tuner's schedule) — or the
variants ``--variants`` names, in that order (``staged``: an allreduce staged through the
board's buffers, ``shm_staged``, where it fits GPURT_SHM_STAGE, by the compiled round;
``staged_py``: the same protocol in Python, DirectRun's phases; ``shm_direct`` then means
the path without staging; ``schedule``: the tuner's choice, the board up to its limit);
per variant
the median over iterations of the slowest rank's time.  Prints one line per (size,
buffers, variant): every round's median and the best, in µs, and the path that ran.
This is how ``shm_direct``'s default thresholds (GPURT_SHM_DIRECT*=auto) were chosen.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import gpurt
from gpurt.config import parse_bytes
from gpurt.transports import shm_direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("collective", choices=shm_direct.COLLS)
    ap.add_argument("sizes", help="S per call (nccl-tests S), comma-separated: 1M,4M,16M")
    ap.add_argument("memory", nargs="?", default="shared,numpy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="shm_direct,schedule",
                    help="comma-separated, of staged, staged_py, shm_direct, schedule")
    a = ap.parse_args()
    comm = gpurt.init()
    if comm._direct is None:
        raise SystemExit("shm_direct cannot run here (one rank, several nodes, or off)")
    p, coll = comm.size, a.collective
    res: dict = {}
    for S in [parse_bytes(s) for s in a.sizes.split(",")]:
        n = S // 4
        for mem in a.memory.split(","):
            alloc = comm.empty if mem == "shared" else np.empty
            x, y = alloc(n, np.float32), alloc(n, np.float32)
            xs, ys = alloc(n // p, np.float32), alloc(n // p, np.float32)
            x[:] = 1
            xs[:] = 1
            calls = {"allreduce": lambda: comm.allreduce(x, y),
                     "reduce": lambda: comm.reduce(x, y, root=0),
                     "reduce_scatter": lambda: comm.reduce_scatter(x, ys),
                     "allgather": lambda: comm.allgather(xs, y),
                     "alltoall": lambda: comm.alltoall(x, y),
                     "broadcast": lambda: comm.broadcast(y, 0)}
            call = calls[coll]
            for _ in range(a.rounds):
                for v in a.variants.split(","):
                    on = {"staged": (0, 0, 1), "staged_py": (0, 0, 1), "shm_direct": (1, 1, 0),
                          "schedule": (0, 0, 0)}[v]
                    comm._direct_min = {c: on for c in shm_direct.COLLS}
                    comm._fastplans.clear()     # the inline path's plans decided on them
                    if v == "staged_py":        # the plan without the compiled round
                        call()
                        for plan in comm._fastplans.values():
                            if hasattr(plan, "staged"):
                                plan.staged = None
                    its = max(3, min(40, (64 << 20) // max(S, 1)))
                    ts = []
                    for _ in range(its + 2):
                        comm.mpi.Barrier()
                        t0 = time.perf_counter()
                        call()
                        ts.append(time.perf_counter() - t0)
                    t = comm.mpi.allreduce(float(np.median(ts[2:])), op=MPI.MAX)
                    res.setdefault((S, mem, v), []).append(t)
                    res.setdefault((S, mem, v, "ran"), set()).add(comm.last_algorithm)
    if comm.rank == 0:
        for key in sorted(k for k in res if len(k) == 3):
            S, mem, v = key
            ts = res[key]
            print(f"{coll} {p} ranks {S >> 10:>8} KiB {mem:<6} {v:<10} "
                  + " ".join(f"{t * 1e6:8.0f}" for t in ts)
                  + f"   best {min(ts) * 1e6:8.0f} us  ran {','.join(sorted(res[key + ('ran',)]))}")
    comm.close()


if __name__ == "__main__":
    main()
