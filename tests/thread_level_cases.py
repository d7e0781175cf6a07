"""Run under ``mpiexec -n 2``: two threads making communicators at once where MPI runs
below MPI_THREAD_MULTIPLE (``sys.argv[1]``: mpi4py's thread level).

Thread A of each rank dups ``base0`` — rank 1's only after 1 s, so rank 0's thread A
waits inside its dup's MPI exchange meanwhile; at 0.3 s thread B of each rank dups
``base1``.  Below MULTIPLE, rank 0's thread B is refused with a clear GpurtError before
any MPI call (two threads' MPI calls at once crashed MPICH, mixed up its messages or hung
both ranks), which poisons ``base1``; rank 1's thread B, already in ``base1``'s exchange,
gets PeerFailure from rank 0 at once.  Thread A's dup completes on both ranks, and the
main thread then makes and uses a communicator: MPI is intact.  At MULTIPLE every dup
completes.  Prints ``RESULT {json}`` (outcome and seconds per thread, by "rank")."""

import json
import sys
import threading
import time

import mpi4py

mpi4py.rc.thread_level = sys.argv[1]
from mpi4py import MPI  # noqa: E402

import numpy as np  # noqa: E402

import gpurt  # noqa: E402

c = gpurt.init()
base0, base1 = c.dup(), c.dup()
out = {}


def dup_and_use(name, base, delay):
    time.sleep(delay)
    t = time.monotonic()
    try:
        d = base.dup()
        x = np.full(3, c.rank + 1.0)
        d.allreduce(x, timeout=20)
        d.close()
        out[name] = ("ok" if (x == 3.0).all() else f"wrong {x}", time.monotonic() - t)
    except Exception as e:  # noqa: BLE001 - the record says what it was
        out[name] = (f"{type(e).__name__}: {e}", time.monotonic() - t)


ts = [threading.Thread(target=dup_and_use, args=("A", base0, 1.0 if c.rank == 1 else 0.0)),
      threading.Thread(target=dup_and_use, args=("B", base1, 0.3))]
for t in ts:
    t.start()
for t in ts:
    t.join()
e = c.dup()                     # the main thread, alone: MPI is intact
y = np.full(2, 1.0)
e.allreduce(y, timeout=20)
out["after"] = ("ok" if (y == 2.0).all() else f"wrong {y}", 0.0)
out["level"] = (MPI.Query_thread(), 0.0)
out["rank"] = c.rank
print("RESULT " + json.dumps(out), flush=True)
