"""comm.abort() from a watchdog thread unblocks the blocking call in flight, 2 ranks:
``mpiexec -n 2 python tests/abort_cases.py MODE``; each rank prints ``ABORT_CASE {json}``.

Rank 0 calls first; rank 1 comes late (once rank 0's call has ended: a marker file).
0.3 s into rank 0's call a watchdog thread calls ``comm.abort("watchdog: step hung")``
(NCCL's ncclCommAbort pattern).  Rank 0's call
must end at once with ``CommunicatorClosed`` ("interrupted"), not when rank 1 arrives or at
the deadline, and rank 1 must get ``PeerFailure`` naming rank 0 as soon as it calls — or,
where its call could end from what rank 0 had published before the abort (the board's
data, a folded message), in its next call.

- ``board``: a 64-byte allreduce (the board's compiled round, then BoardRun);
- ``direct``: a 4 MiB-per-rank allgather (shm_direct's compiled round, then DirectRun in
  its header phase);
- ``sharing``: the same, but rank 1 (on the Python round) arrives in time and is slow in
  its share (it waits until rank 0's abort is published, then 0.3 s): the abort comes
  once rank 0 has stored READY, and rank 0's caller must not have its output back while
  rank 1 may still write into it (nothing written after the call returned);
- ``net``: under ``MPIR_CVAR_NUM_CLIQUES=2`` (two "nodes"): a 64-byte allreduce across
  nodes (the agreement's exchange over tcp).
- ``request`` / ``request_close``: rank 0 waits on an ``iallgather`` Request (DirectRun,
  driven by ``Request.wait``) and is the slow one in its share, which writes into rank 1's
  output; the watchdog calls ``abort()`` / ``close()`` while that share runs (between
  its first piece's check and its stores).  Rank 1 must not have its output back while
  rank 0 may still write into it (rank 0 tells it only once its share has stopped), and
  rank 0's share stops at its next piece.
- ``request_waiting`` / ``request_waiting_close``: both ranks wait on Requests; rank 0's
  share is done (it waits for rank 1's FINISHED, between steps) and rank 1 is the slow one
  in its share, which stores into rank 0's output, when the watchdog calls ``abort()`` /
  ``close()``: rank 0's caller must have its output back only once rank 1 stopped.
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
from gpurt.transports import shm_direct  # noqa: E402


def main() -> int:
    mode = sys.argv[1]
    world, comm, r, p, _ = casekit.start()
    req = mode.startswith("request")
    slow = 1 if "waiting" in mode else 0    # (request modes) the rank slow in its share
    big = mode in ("direct", "sharing") or req
    n = 1 << 20 if big else 16
    x = np.full(n, r + 1, np.float32)
    y = np.zeros(p * n, np.float32)

    def call():
        if big:
            comm.allgather(x, out=y)
        else:
            y[:n] = x
            comm.allreduce(y[:n])
    call()                                   # warm-up (the compiled rounds on both)
    if req and r == slow:
        check = shm_direct.Access.stop_if_failed
        armed = []

        def slow_piece(acc):
            # the first piece of the watched share is slow (a large one, a descheduled
            # rank): the watchdog comes in after its check, before its stores — waited
            # for, then 0.3 s more (a rank told too early would have its output back
            # and see these stores)
            check(acc)
            if armed:
                armed.clear()
                casekit.until_stopped(acc)
                time.sleep(0.3)
        shm_direct.Access.stop_if_failed = slow_piece
    if req and (r == 0 or slow == 1):
        def call():                          # noqa: F811 - the watched call, by Request
            comm.iallgather(x, out=y).wait()
    if mode == "sharing" and r == 1:
        casekit.python_direct(comm)
        share = shm_direct._SHARES["allgather"]

        def slow(d):
            casekit.until_stopped(d.acc)     # rank 0's abort is published (it comes once
            time.sleep(0.3)                  # rank 0's READY is stored), then 0.3 s more
            return share(d)
        shm_direct._SHARES["allgather"] = slow
    res: dict = {"rank": r, "mode": mode}

    seq = comm._seq + 1                      # the call watched

    def watchdog():
        if mode == "sharing" or req:    # until rank 0's READY is stored (rank 1 may come in)
            bd = comm.board
            word = bd.ctrl[bd.me] + shm_direct._READY
            while bd.q[word] < 2 * seq:
                time.sleep(1e-4)
            if req:                     # and rank 1's: the slow rank is then in its share
                word = bd.ctrl[1 - bd.me] + shm_direct._READY
                while bd.q[word] < 2 * seq:
                    time.sleep(1e-4)
                if slow == 1:           # rank 0 has finished its share: between steps
                    word = bd.ctrl[bd.me] + shm_direct._FINISHED
                    while bd.q[word] < seq:
                        time.sleep(1e-4)
                time.sleep(0.1)
        else:
            time.sleep(0.3)
        if mode.endswith("close"):
            comm.close()
        else:
            comm.abort("watchdog: step hung")

    marker = world.bcast(f"/tmp/gpurt-abort-case-{os.getpid()}-{time.time_ns()}"
                         if r == 0 else None, root=0)
    world.Barrier()
    y[:] = 0
    if req and r == slow:
        armed.append(1)
    th = None
    if r == 0:
        th = threading.Thread(target=watchdog)
        th.start()
    elif mode != "sharing" and not req:
        # comes late: once rank 0's call has ended (a marker it writes), not after a fixed
        # second that a late watchdog thread could overrun (the call then completes)
        casekit.wait_for_file(marker)
    res["outcome"], res["seconds"] = casekit.outcome(call)
    if r == 0:
        with open(marker, "w"):
            pass
    if req:         # its output is its own again: the peer must not write into it
        y[:] = -1
        time.sleep(0.6)
        res["written_after"] = int(np.count_nonzero(y != -1))
    if r == 1 and res["outcome"] == "ok":
        # its call could end from what rank 0 had published before the abort (the board's
        # data, a folded message): the next one must fail, naming rank 0, at once
        res["next"], res["next_seconds"] = casekit.outcome(call)
    if th is not None:
        th.join()
    if th is not None and not req:
        y[:] = -1                            # the caller owns its output again
        time.sleep(0.6)
        res["written_after"] = int(np.count_nonzero(y != -1))
    print("ABORT_CASE " + json.dumps(res), flush=True)
    world.Barrier()
    if r == 0:
        os.unlink(marker)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
