"""Flight records a failing job leaves (tests/test_processes.py::test_flight_lines_up_*),
3 ranks; rank 1 is the odd one out in each case.

evicted  ranks 0 and 2 queue 8 iallreduces (calls #2-#9) that rank 1 never joins, then a
         blocking one times out: with GPURT_FLIGHT=4 the ring has pushed #2 out
wait     ranks 0 and 2 die of a Request.wait timeout (the request stays in flight: nothing
         poisoned the communicator, and the exit's close() used to record nothing)
p2p      rank 0 waits in recv from rank 1, which raises before sending
differ   rank 1 calls barrier where the others call allreduce (same call number)
closed   ranks 0 and 2 close() the communicator with an iallreduce not yet waited for (the
         records said "at exit" for an explicit close())
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import gpurt

mode = sys.argv[1]
g = gpurt.init()
g.allreduce(np.ones(10))                       # call #1, everywhere
if mode in ("evicted", "wait"):
    if g.rank == 1:
        time.sleep(8)          # elsewhere, past the others' deadline (they wait for it
        os._exit(0)            # in MPI_Finalize: a short sleep keeps the test short)
    elif mode == "evicted":
        reqs = [g.iallreduce(np.ones(10)) for _ in range(8)]
        g.allreduce(np.ones(10), timeout=2)
    else:
        g.iallreduce(np.ones(10)).wait(timeout=2)
elif mode == "p2p":
    if g.rank == 0:
        g.recv(np.empty(100), 1, tag=7)
    elif g.rank == 1:
        raise RuntimeError("rank 1 broke before sending")
elif mode == "differ":
    if g.rank == 1:
        g.barrier()
    else:
        g.allreduce(np.ones(10))
elif mode == "closed":
    if g.rank != 1:
        q = g.iallreduce(np.ones(10))
        g.close()
        try:
            q.wait()
        except gpurt.CommunicatorClosed:
            pass
        else:
            raise SystemExit("the request completed after close()")
