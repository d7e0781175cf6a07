"""Two threads of one rank using one communicator at once, 2 ranks:
``mpiexec -n 2 python tests/two_threads_cases.py MODE``; each rank prints
``TWO_THREADS {json}``.

Communicators are not thread-safe (one per thread, ``dup()``); what must not happen when
an application gets that wrong is two threads moving the same transports — a silent
wrong answer, or a hang.  Rank 0 starts the watched call in a worker thread; rank 1 comes
1 s late.  0.3 s into it, rank 0's main thread makes a call of its own on the same
communicator: that call must raise ``GpurtError`` ("two threads used this communicator at
once") at once, the worker's call must end with ``CommunicatorClosed`` ("interrupted")
— not when rank 1 arrives — and rank 1 must get ``PeerFailure`` naming rank 0 in its
call or, where that could end from what rank 0 had published before (the board's data, a
folded message), in its next one.

- ``board``: a 64-byte allreduce (the board's compiled round);
- ``direct``: a 4 MiB-per-rank allgather (shm_direct);
- ``request``: the worker waits on an ``iallgather`` Request (4 MiB per rank);
- ``net``: under ``MPIR_CVAR_NUM_CLIQUES=2``: a 64-byte allreduce across nodes (tcp).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import casekit  # noqa: E402


def main() -> int:
    mode = sys.argv[1]
    world, comm, r, p, _ = casekit.start()
    big = mode in ("direct", "request")
    n = 1 << 20 if big else 16
    x = np.full(n, r + 1, np.float32)
    y = np.zeros(p * n, np.float32)

    def call():
        if mode == "request":
            comm.iallgather(x, out=y).wait()
        elif big:
            comm.allgather(x, out=y)
        else:
            y[:n] = x
            comm.allreduce(y[:n])
    call()                                   # warm-up (the compiled rounds on both)
    res: dict = {"rank": r, "mode": mode}
    worker: dict = {}

    def in_worker():
        worker["outcome"], worker["seconds"] = casekit.outcome(call)

    world.Barrier()
    th = None
    if r == 0:
        th = threading.Thread(target=in_worker, name="worker")
        th.start()
        time.sleep(0.3)
        res["outcome"], res["seconds"] = casekit.outcome(comm.barrier)
        th.join(30)
        res["worker"], res["worker_seconds"] = worker.get("outcome"), worker.get("seconds")
        res["worker_alive"] = th.is_alive()
        res["next"], _ = casekit.outcome(call)
    else:
        time.sleep(1.0)
        res["outcome"], res["seconds"] = casekit.outcome(call)
        if res["outcome"] == "ok":
            res["next"], res["next_seconds"] = casekit.outcome(call)
    print("TWO_THREADS " + json.dumps(res), flush=True)
    world.Barrier()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
