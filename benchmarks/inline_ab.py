"""Blocking collectives inline against the general path, alternating inside one launch.

    MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n 2 python benchmarks/inline_ab.py \
        [allreduce|broadcast|barrier|reduce|allgather|reduce_scatter|alltoall|gather|
         scatter]
        [8,4K,64K,1M] [blocks]

Across nodes (no shm board) a blocking collective on NumPy arrays runs inline
(``Communicator._inline``, ``_inline_to``); ``comm.iallreduce(...).wait()``
(and so on) is the general path (a ``Request`` through the engine's queue) with the same
plan, agreement and schedule.  Each
size's calls run in blocks that alternate between the two (the order turning every
block); a block's time is the slowest rank's mean per call, and the medians over blocks are
printed with their ratio (> 1: the inline path is faster).  Results are checked exactly.
On one node the board's own inline path is measured instead (its plan says so).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

import gpurt


def _bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def main() -> int:
    args = sys.argv[1:]
    coll = args.pop(0) if args and args[0][:1].isalpha() else "allreduce"
    sizes = [_bytes(s) for s in (args[0] if args else "8,4K,64K,1M").split(",")]
    blocks = int(args[1]) if len(args) > 1 else 8
    if coll == "barrier":
        sizes = [0]
    c = gpurt.init()
    world = MPI.COMM_WORLD
    p, r = c.size, c.rank
    lines = []
    for nb in sizes:
        n = max(1, nb // 4)
        x = np.full(n, r + 1, np.float32)
        o = np.empty_like(x)
        if coll == "allreduce":
            want = np.float32(p * (p + 1) // 2)
            calls = {"inline": lambda: c.allreduce(x, o),
                     "general": lambda: c.iallreduce(x, o).wait()}
        elif coll == "broadcast":      # root 0's x (1) everywhere; o is x here
            o, want = x, np.float32(1)
            calls = {"inline": lambda: c.broadcast(x, 0),
                     "general": lambda: c.ibroadcast(x, 0).wait()}
        elif coll == "barrier":
            o, want = x, np.float32(r + 1)
            calls = {"inline": lambda: c.barrier(), "general": lambda: c.ibarrier().wait()}
        elif coll == "reduce":     # into o on root 0; elsewhere o stays as filled (0)
            want = np.float32(p * (p + 1) // 2 if r == 0 else 0)
            calls = {"inline": lambda: c.reduce(x, o, root=0),
                     "general": lambda: c.ireduce(x, o, root=0).wait()}
        elif coll in ("allgather", "gather"):   # S = the gathered whole: x is S / p
            x = np.full(max(1, n // p), 1, np.float32)
            o = np.empty(x.size * p, np.float32)
            want = np.float32(1 if coll == "allgather" or r == 0 else 0)
            if coll == "allgather":
                calls = {"inline": lambda: c.allgather(x, o),
                         "general": lambda: c.iallgather(x, o).wait()}
            else:
                oo = o if r == 0 else None
                calls = {"inline": lambda: c.gather(x, oo, root=0),
                         "general": lambda: c.igather(x, oo, root=0).wait()}
        elif coll in ("reduce_scatter", "alltoall"):     # x is S
            x = np.full(max(p, n // p * p), r + 1, np.float32)
            if coll == "reduce_scatter":
                o = np.empty(x.size // p, np.float32)
                want = np.float32(p * (p + 1) // 2)
                calls = {"inline": lambda: c.reduce_scatter(x, o),
                         "general": lambda: c.ireduce_scatter(x, o).wait()}
            else:
                o, want = np.empty_like(x), None
                calls = {"inline": lambda: c.alltoall(x, o),
                         "general": lambda: c.ialltoall(x, o).wait()}
        elif coll == "scatter":     # S = the root's whole x; rank r gets block r (r + 1)
            xs = np.repeat(np.arange(1, p + 1, dtype=np.float32), max(1, n // p))
            xr = xs if r == 0 else None
            o = np.empty(xs.size // p, np.float32)
            want = np.float32(r + 1)
            calls = {"inline": lambda: c.scatter(xr, o, root=0),
                     "general": lambda: c.iscatter(xr, o, root=0).wait()}
        else:
            raise SystemExit(f"inline_ab.py: {coll}: not one of this script's collectives")
        iters = max(20, min(400, int(2e7 // max(nb, 4096))))
        for f in calls.values():
            for _ in range(10):
                f()
        times: dict[str, list[float]] = {k: [] for k in calls}
        names = list(calls)
        algo = {}
        for b in range(blocks):
            for k in (names if b % 2 == 0 else names[::-1]):
                f = calls[k]
                if coll in ("allreduce", "reduce", "gather", "allgather", "reduce_scatter",
                            "scatter"):
                    o.fill(0)
                c.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    f()
                dt = (time.perf_counter() - t0) / iters
                algo[k] = c.last_algorithm
                ok = (o.reshape(p, -1) == np.arange(1, p + 1, dtype=np.float32)[:, None]
                      ).all() if coll == "alltoall" else (o == want).all()
                if not ok:
                    raise SystemExit(f"rank {r}: {k} {coll} of {nb} B gave a wrong result")
                times[k].append(world.allreduce(dt, op=MPI.MAX))
        med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
        lines.append(f"{nb:>10} B  inline {med['inline']:9.1f} us  general {med['general']:9.1f}"
                     f" us  x{med['general'] / med['inline']:.2f}  ({algo['inline']})")
    if r == 0:
        print(f"# blocking {coll} inline vs i{coll}().wait(): {p} ranks, "
              f"{c.nnodes} node(s), {blocks} alternating blocks per size, medians")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
