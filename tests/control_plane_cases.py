"""Threads meeting a communicator's control plane (its creation, ``split``, ``dup``):
``mpiexec -n N python tests/control_plane_cases.py MODE``; each rank prints
``CONTROL {json}``.

A bug hunt found these made MPI collectives on one MPI communicator from two threads at
once: MPICH aborted ("Message truncated"), or ``split(0)`` gave size-1 communicators with
no error, or ``init()`` gave each thread its own world communicator and a later call on
one of them hung; and a ``close()`` from another thread freed the MPI handle under a
``split``, whose peer then stayed in MPI for ever.

- ``init``: two threads call ``gpurt.init()`` at once: both get the same communicator;
- ``dup`` / ``split``: two threads call ``comm.dup()`` / ``comm.split(0)`` at once: the
  exchanges go one after the other, and each thread gets a working communicator of every
  rank;
- ``wait_split``: rank 0's second thread waits on an ``irecv`` of the communicator while
  its main thread splits it; rank 1 splits, then sends: both complete (a review found
  the split refused as "two threads" on rank 0 alone, and rank 1 left in MPI for ever);
- ``close_dup`` / ``close_split``: rank 0's main thread is in ``dup()`` / ``split(0)``
  waiting for the others (they come 2 s later) when another thread closes the
  communicator: ``close()`` returns at once, the call raises ``CommunicatorClosed`` once
  the exchange is over (its peers are in it: they must not be left in MPI), and the
  others' new communicator fails their first call in it with ``PeerFailure`` naming
  rank 0;
- ``signal_split``: the same with the ``close()`` made by a signal handler (SIGALRM) on
  the splitting thread itself;
- ``abort_dup`` / ``abort_split``: the same with a watchdog's ``abort()`` (1 s in), the
  last rank coming 3 s late and any other rank in time: rank 0's call leaves the
  exchange with ``CommunicatorClosed`` at once (it stayed in MPI for ever), the ranks
  waiting in it leave with ``PeerFailure`` naming rank 0, and the late one raises that
  before it posts anything;
- ``late_dup`` / ``late_split`` (run with GPURT_TIMEOUT=2): after a ring of messages
  from a worker thread, the last rank comes 5 s late: the others raise ``CollectiveTimeout`` past the deadline (or ``PeerFailure``
  where another's came first), the late one ``PeerFailure`` before posting anything.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

import gpurt


def outcome(f) -> str:
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - the record says what it was
        return f"{type(e).__name__}: {e}"


def main() -> int:
    mode = sys.argv[1]
    rec: dict = {}
    if mode == "init":
        got: dict = {}
        ts = [threading.Thread(target=lambda k=k: got.__setitem__(k, gpurt.init()))
              for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        comm = got.get(0)
        rec["rank"] = comm.rank
        rec["same"] = got.get(0) is got.get(1) is gpurt.init()
        x = np.full(3, comm.rank + 1.0)
        comm.allreduce(x, timeout=20)
        rec["sum"] = float(x[0])
        comm.close()
    elif mode in ("dup", "split"):
        comm = gpurt.init()
        rec["rank"] = comm.rank
        res: dict = {}

        def make(k: int) -> None:
            def f():
                c = comm.dup() if mode == "dup" else comm.split(0, key=comm.rank)
                x = np.full(3, c.rank + 1.0)
                c.allreduce(x, timeout=20)
                out = f"ok size={c.size} rank={c.rank} sum={x[0]:g}"
                c.close()
                return out
            res[k] = outcome(f)

        ts = [threading.Thread(target=make, args=(k,)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        rec["alive"] = any(t.is_alive() for t in ts)
        rec["outcomes"] = sorted(res.values())
        comm.close()
    elif mode == "wait_split":
        comm = gpurt.init()
        c = comm.dup()
        rec["rank"] = r = c.rank
        if r == 0:
            buf = np.zeros(4)
            q = c.irecv(buf, 1, tag=7)
            got: dict = {}
            th = threading.Thread(target=lambda: got.__setitem__(
                "w", outcome(lambda: f"ok {q.wait(timeout=20)[0]:g}")))
            th.start()
            time.sleep(0.3)
            rec["call"] = outcome(lambda: f"ok size={c.split(0).size}")
            th.join(30)
            rec["waiter"] = got.get("w")
        else:
            time.sleep(1.0)
            rec["call"] = outcome(lambda: f"ok size={c.split(0).size}")
            if r == 1:      # (rank 0 receives one message: a third rank's send raced
                c.send(np.full(4, 5.0), 0, tag=7)   # rank 0's close, PeerFailure)
        c.barrier()         # (then close: no rank's call meets a peer's close)
        c.close()
        comm.close()
    elif mode in ("abort_dup", "abort_split", "late_dup", "late_split"):
        how, what = mode.split("_", 1)
        comm = gpurt.init()
        c = comm.dup()
        rec["rank"] = r = c.rank
        if how == "late":
            # (the communicator last used by another thread, one at a time as is legal:
            # the watch read nothing there, and the late rank posted after the others
            # had left on their deadline — then waited in MPI for ever; a review)
            def ring() -> None:
                b = np.empty(1 << 20)          # (not the quick path: the engine)
                q = c.isend(np.full(1 << 20, 1.0 * r), (r + 1) % c.size, tag=5)
                c.recv(b, (r - 1) % c.size, tag=5, timeout=20)
                q.wait(timeout=20)
            th = threading.Thread(target=ring)
            th.start()
            th.join(30)
        if r == 0 and how == "abort":
            th = threading.Thread(target=lambda: (time.sleep(1.0),
                                                  c.abort("watchdog: the step hung")))
            th.start()
        elif r == c.size - 1:
            time.sleep(3.0 if how == "abort" else 5.0)
        t = time.monotonic()
        rec["call"] = outcome(lambda: str(c.dup() if what == "dup" else c.split(0)))
        rec["call_seconds"] = time.monotonic() - t
        if r == 0 and how == "abort":
            th.join(30)
        c.close()
        comm.close()
    else:       # close_dup, close_split, signal_split
        how, what = mode.split("_", 1)
        comm = gpurt.init()
        c = comm.dup()
        rec["rank"] = r = c.rank
        if r == 0:
            closed = []

            def close() -> None:
                t = time.monotonic()
                c.close()
                closed.append(time.monotonic() - t)

            if how == "signal":
                import signal
                signal.signal(signal.SIGALRM, lambda *_: close())
                signal.setitimer(signal.ITIMER_REAL, 1.0)
                th = None
            else:
                th = threading.Thread(target=lambda: (time.sleep(1.0), close()))
                th.start()
            t = time.monotonic()
            rec["call"] = outcome(lambda: str(c.dup() if what == "dup" else c.split(0)))
            rec["call_seconds"] = time.monotonic() - t
            if th is not None:
                th.join(30)
            rec["close_seconds"] = closed[0] if closed else None
        else:
            time.sleep(3.0)
            new = c.dup() if what == "dup" else c.split(0)
            x = np.ones(3)
            t = time.monotonic()
            rec["next"] = outcome(lambda: str(new.allreduce(x, timeout=20)))
            rec["next_seconds"] = time.monotonic() - t
            new.close()
            c.close()
        comm.close()
    print("CONTROL " + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
