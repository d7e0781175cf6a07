"""Two threads of one rank using one communicator at once, 2 ranks:
``mpiexec -n 2 python tests/two_threads_cases.py MODE``; each rank prints
``TWO_THREADS {json}``.

Communicators are not thread-safe (one per thread, ``dup()``); what must not happen when
an application gets that wrong is two threads moving the same transports — a silent
wrong answer, or a hang.  Rank 0 starts the watched call in a worker thread; rank 1 comes
late (once the worker's call has ended: a marker file).  0.3 s after the worker is in it,
rank 0's main thread makes a call of its own on the same communicator: that call must
raise ``GpurtError`` ("two threads used this communicator at once") at once, the
worker's call must end with ``CommunicatorClosed`` ("interrupted") — not when rank 1
arrives — and rank 1 must get ``PeerFailure`` naming rank 0 in its
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

    marker = world.bcast(f"/tmp/gpurt-two-threads-{os.getpid()}-{time.time_ns()}"
                         if r == 0 else None, root=0)
    world.Barrier()
    th = None
    if r == 0:
        th = threading.Thread(target=in_worker, name="worker")
        th.start()
        t0 = time.monotonic()       # until the worker is in its call (cap 10 s), then 0.3 s
        while comm.engine.other_thread() != th.ident and time.monotonic() - t0 < 10:
            time.sleep(1e-4)
        time.sleep(0.3)
        res["outcome"], res["seconds"] = casekit.outcome(comm.barrier)
        th.join(30)
        with open(marker, "w"):
            pass
        res["worker"], res["worker_seconds"] = worker.get("outcome"), worker.get("seconds")
        res["worker_alive"] = th.is_alive()
        res["next"], _ = casekit.outcome(call)
    else:
        casekit.wait_for_file(marker)   # late: once rank 0's worker has ended its call
        res["outcome"], res["seconds"] = casekit.outcome(call)
        if res["outcome"] == "ok":
            res["next"], res["next_seconds"] = casekit.outcome(call)
    print("TWO_THREADS " + json.dumps(res), flush=True)
    world.Barrier()
    if r == 0:
        os.unlink(marker)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
