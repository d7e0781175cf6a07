"""A rank that fails while the others wait in a collective on a slow, healthy rank: they
learn of the failure at once, not at their deadline blaming the slow one.
``mpiexec -n 5 python tests/failed_elsewhere_cases.py [ALGO]``; each rank prints one
``ELSEWHERE {json}`` record.

Rank 2 calls ``abort()`` (no call in flight: it publishes the failure); rank 4 sleeps 6 s
before it calls; ranks 0, 1, 3 call a 1 MiB ring allreduce with ``timeout=4``.  Under
``GPURT_CHECK=0`` (no agreement exchange, which waits on every rank) rank 0 of the ring
waits only on rank 4, its left neighbour: it used to time out blaming rank 4.
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
    x = np.ones(1 << 18, np.float32)
    if r == 2:
        comm.abort("rank 2 gave up")
        out = "aborted"
    else:
        if r == 4:
            time.sleep(6)
        t0 = time.monotonic()
        try:
            comm.allreduce(x, algo=sys.argv[1] if len(sys.argv) > 1 else None, timeout=4)
            out = "done"
        except gpurt.GpurtError as e:
            out = (f"{type(e).__name__}(rank={getattr(e, 'rank', None)}) "
                   f"{time.monotonic() - t0:.1f}s: {e}")
    print("ELSEWHERE " + json.dumps({"rank": r, "out": out}), flush=True)
    world.Barrier()
    comm.close()


if __name__ == "__main__":
    main()
