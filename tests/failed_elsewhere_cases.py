"""A rank that fails while the others wait in a collective on a slow, healthy rank.
``mpiexec -n 5 python tests/failed_elsewhere_cases.py ring`` or ``mpiexec -n 3 python
tests/failed_elsewhere_cases.py done`` (both under ``GPURT_CHECK=0``: no agreement exchange,
which waits on every rank); each rank prints one ``ELSEWHERE {json}`` record.

- ``ring``: rank 2 calls ``abort()`` (no call in flight: it publishes the failure); rank 4
  sleeps 10 s before it calls; ranks 0, 1, 3 call a 1 MiB ring allreduce with
  ``timeout=4``.  A rank of the ring that waits only on the late rank 4 (rank 0 over tcp)
  used to time out blaming rank 4: at its deadline it names rank 2's failure instead.
  ``ring N``: an allreduce of N float32 instead (over verbs, 1 MiB is sent by rendezvous,
  which waits for the receiver: rank 0 then waits on rank 1 too, which relays rank 2's
  failure at once; with N = 5120 every ring message is eager, as on shm and tcp).
- ``done``: a 1 MiB binomial gather to rank 0, rank 1 1.5 s late; rank 2 delivers its
  block, returns, and then fails (abort()).  The gather completes on every rank, exact —
  the failure fails the next call, not one whose part the failed rank had done.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

import gpurt


def main() -> None:
    world = MPI.COMM_WORLD
    comm = gpurt.Communicator(world)
    r = comm.rank
    comm.allreduce(np.ones(4))
    world.Barrier()
    if sys.argv[1] == "done":
        done(world, comm, r)
        return
    x = np.ones(int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 18, np.float32)
    if r == 2:
        comm.abort("rank 2 gave up")
        out = "aborted"
    else:
        if r == 4:
            time.sleep(10)      # (past the others' 4 s deadline, with room for a slow one)
        t0 = time.monotonic()
        try:
            comm.allreduce(x, algo="ring", timeout=4)
            out = "done"
        except gpurt.GpurtError as e:
            out = (f"{type(e).__name__}(rank={getattr(e, 'rank', None)}) "
                   f"{time.monotonic() - t0:.1f}s: {e}")
    print("ELSEWHERE " + json.dumps({"rank": r, "out": out}), flush=True)
    world.Barrier()
    comm.close()


def done(world, comm, r: int) -> None:
    n = 1 << 17
    x = np.full(n, float(r + 1))
    out = np.zeros(n * comm.size) if r == 0 else None
    if r == 1:
        time.sleep(1.5)
    try:
        comm.gather(x, out, root=0, algo="binomial", timeout=20)
        want = np.repeat(np.arange(1.0, comm.size + 1), n)
        res = "exact" if r or np.array_equal(out, want) else "WRONG DATA"
    except gpurt.GpurtError as e:
        res = f"{type(e).__name__}: {e}"
    if r == 2:
        comm.abort("rank 2 failed after its last call")
    print("ELSEWHERE " + json.dumps({"rank": r, "out": res}), flush=True)
    world.Barrier()
    comm.close()


if __name__ == "__main__":
    main()
