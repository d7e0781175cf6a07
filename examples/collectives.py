"""Every gpurt collective once, on host (NumPy) arrays, with the results checked.

    mpiexec -n 4 python examples/collectives.py

Rank 0 prints what every rank got, in rank order, then a summary (and the tuner's reasoning
for a 1 MiB allreduce).  Exits non-zero if any result is wrong.
"""

from __future__ import annotations

import sys

import numpy as np

import gpurt


def main() -> int:
    comm = gpurt.init()
    r, p = comm.rank, comm.size
    wrong, lines = [], []

    def show(name: str, got, want) -> None:
        ok = np.array_equal(np.asarray(got), np.asarray(want))
        if not ok:
            wrong.append(name)
        lines.append(f"[rank {r}/{p} node {comm.node} local {comm.local_rank}] {name:<15} "
                     f"{np.asarray(got).tolist()}{'' if ok else '   WRONG, expected ' + str(want)}")

    x = np.arange(4, dtype=np.float32) + r                 # rank r holds [r, r+1, r+2, r+3]
    total = sum(np.arange(4, dtype=np.float32) + q for q in range(p))

    show("allreduce", comm.allreduce(x.copy()), total)
    show("allreduce max", comm.allreduce(x.copy(), op=gpurt.MAX), x + (p - 1 - r))
    show("reduce", comm.reduce(x.copy(), root=0), total if r == 0 else x)
    b = np.full(3, 42 if r == 0 else -1, dtype=np.int64)
    show("broadcast", comm.broadcast(b, root=0), [42, 42, 42])
    show("allgather", comm.allgather(np.array([r, r * 10], np.int32)),
         [[q, q * 10] for q in range(p)])
    rs = np.arange(2 * p, dtype=np.float64)                # same on every rank
    show("reduce_scatter", comm.reduce_scatter(rs), rs[2 * r:2 * r + 2] * p)
    a2a = np.array([100 * r + q for q in range(p)], np.int32)   # block q goes to rank q
    show("alltoall", comm.alltoall(a2a), [100 * q + r for q in range(p)])
    g = comm.gather(np.array([r * r], np.int16), root=p - 1)
    show("gather", g if r == p - 1 else [], [[q * q] for q in range(p)] if r == p - 1 else [])
    sc = np.arange(p * 2, dtype=np.uint8).reshape(p, 2) if r == 0 else None
    show("scatter", comm.scatter(sc, np.empty(2, np.uint8), root=0), [2 * r, 2 * r + 1])
    if p > 1:
        got = np.empty(2, np.float32)
        reqs = [comm.isend(np.array([r, -r], np.float32), (r + 1) % p),
                comm.irecv(got, (r - 1) % p)]
        for q in reqs:
            q.wait()
        left = (r - 1) % p
        show("send/recv ring", got, [left, -left])
    req = comm.iallreduce(np.ones(5, np.int32))
    show("iallreduce", req.wait(), np.full(5, p, np.int32))
    comm.barrier()

    bad = comm.mpi.allreduce(len(wrong))
    every = comm.mpi.gather(lines, 0)   # print in rank order, not interleaved
    if r == 0:
        for rank_lines in every:
            print("\n".join(rank_lines))
        print(f"\n{p} ranks on {comm.nnodes} node(s): "
              f"{'all collectives correct' if not bad else f'{bad} WRONG results'}")
        print(comm.explain("allreduce", 1 << 20))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
