"""comm.close() from another thread while a blocking shm_direct call runs on the compiled
round (``_fastboard.direct``), 2 ranks: ``mpiexec -n 2 python tests/close_race_cases.py
MODE``.  Each rank prints one line ``CLOSE_RACE {json}``.

- ``before``: rank 0's round waits for rank 1's header (rank 1 comes late) when
  another thread closes 50 ms in: the round stops before READY, so no peer comes into rank 0's
  buffers — rank 0 raises ``CommunicatorClosed``, rank 1 ``PeerFailure`` naming the close,
  promptly, and nothing is written into rank 0's output after its call returned.
- ``before_fast``: the same, the close 0.5 ms into the round: the compiled round itself
  stops (D_CLOSED) or hands over to Python, which stops.  In both modes rank 1 comes in
  only once rank 0's close() has returned (a marker file tells it), so a loaded machine
  that delays the closing thread cannot let rank 1 complete the call first.
- ``after``: the close comes once rank 0 has stored READY (rank 1, in Python, waits
  before its share until rank 0's close is published, then 0.3 s): rank 0's call is
  interrupted (``CommunicatorClosed``), its error published once it has stopped writing,
  and its caller has the arrays back only after rank 1 stopped (``PeerFailure``); close()
  waits for that; nothing is written after the call returned either.
- ``fork``: a thread forks during a long compiled round; the child's ``FastBoard.close()``
  (the atexit hook's, too) must not wait for a round that runs only in its parent.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import casekit  # noqa: E402
from gpurt.transports import shm_direct  # noqa: E402


def main() -> int:
    mode = sys.argv[1]
    world, comm, r, p, _ = casekit.start()
    n = 1 << 20 if mode != "fork" else 16 << 20      # float32 per rank
    x = np.full(n, r + 1, np.float32)
    y = np.zeros(p * n, np.float32)
    comm.allgather(x, out=y)                           # warm-up: the compiled round on both
    res: dict = {"rank": r, "mode": mode}
    if mode == "fork":
        return fork_case(comm, x, y, res)
    entered = threading.Event()
    codes: list[int] = []
    if r == 0:
        codes = casekit.spy_compiled(comm, "direct")
        fast_direct = comm.board.fast.direct

        def direct(*a):
            entered.set()
            return fast_direct(*a)
        comm.board.fast.direct = direct
    else:
        casekit.python_direct(comm)                    # rank 1: DirectRun, slow in "after"
        if mode == "after":
            share = shm_direct._SHARES["allgather"]

            def slow(d):
                casekit.until_stopped(d.acc)     # rank 0's close is published, then
                time.sleep(0.3)                  # 0.3 s more: close() must wait for it
                return share(d)
            shm_direct._SHARES["allgather"] = slow
    closed: list[float] = []

    def closer():
        entered.wait()
        bd = comm.board
        if mode == "after":       # until rank 0's READY is stored (peers may come in)
            word = bd.ctrl[bd.me] + shm_direct._READY
            while bd.q[word] < 2 * (comm._seq):
                time.sleep(1e-4)
        else:
            time.sleep(0.0005 if mode == "before_fast" else 0.05)
        t = time.monotonic()
        comm.close()
        closed.append(time.monotonic() - t)
        with open(marker, "w"):
            pass

    marker = world.bcast(f"/tmp/gpurt-close-race-{os.getpid()}-{time.time_ns()}"
                         if r == 0 else None, root=0)
    world.Barrier()
    y[:] = 0
    th = None
    if r == 0:
        th = threading.Thread(target=closer)
        th.start()
    if r == 1 and mode.startswith("before"):
        t0 = time.monotonic()                  # until rank 0's close() returned (cap 15 s)
        while not os.path.exists(marker) and time.monotonic() - t0 < 15:
            time.sleep(0.0005)
    res["outcome"], res["seconds"] = casekit.outcome(lambda: comm.allgather(x, out=y))
    if res["outcome"] == "ok":
        res["exact"] = bool(all((y[k * n:(k + 1) * n] == k + 1).all() for k in range(p)))
    if th is not None:
        th.join()
        res["close_seconds"] = closed[0] if closed else None
        res["codes"] = codes
        y[:] = -1                       # the caller owns its output again
        time.sleep(0.6)
        res["written_after"] = int(np.count_nonzero(y != -1))
    print("CLOSE_RACE " + json.dumps(res), flush=True)
    world.Barrier()
    if r == 0 and os.path.exists(marker):
        os.unlink(marker)
    if not comm.closed:
        comm.close()
    return 0


def fork_case(comm, x, y, res) -> int:
    """A child forked (by another thread) while this rank's compiled round runs without the
    GIL (64 MiB blocks: tens of ms): its close() of the board returns at once."""
    r = comm.rank
    child: dict = {}
    entered = threading.Event()
    if r == 0:
        fast_direct = comm.board.fast.direct

        def direct(*a):
            entered.set()
            return fast_direct(*a)
        casekit.spy_compiled(comm, "direct")
        comm.board.fast.direct = direct

    def forker():
        entered.wait()
        time.sleep(0.005)
        pid = os.fork()
        if pid == 0:
            comm.board.fast.close()
            os._exit(0)
        t = time.monotonic()
        while time.monotonic() - t < 20:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                child["exit"] = os.waitstatus_to_exitcode(status)
                child["seconds"] = round(time.monotonic() - t, 3)
                return
            time.sleep(0.01)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        child["exit"] = "killed after 20 s"

    th = threading.Thread(target=forker) if r == 0 else None
    MPI.COMM_WORLD.Barrier()
    if th is not None:
        th.start()
    comm.allgather(x, out=y)
    if th is not None:
        th.join()
    res["child"] = child
    res["exact"] = bool((y.reshape(comm.size, -1)[1] == 2).all())
    print("CLOSE_RACE " + json.dumps(res), flush=True)
    MPI.COMM_WORLD.Barrier()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
