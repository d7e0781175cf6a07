"""Run inside a Soft-RoCE guest under ``mpiexec -disable-auto-cleanup -n P`` with
``GPURT_TRANSPORTS=verbs``: a failure in the middle of a stream of allreduces, and what
every surviving rank raises.

    mpiexec -disable-auto-cleanup -n P sh -c 'trap true USR1; python3 \
        tests/rdma/verbs_failures.py qp_error|kill OUTDIR'

(hydra's proxy SIGKILLs the whole job when one of its children dies of a signal: each rank
runs under ``sh``, which outlives a killed Python and exits normally; the same trick as
``tests/tcp_failures.py``.)

* ``qp_error``: before call 3, rank 1 moves its queue pair to rank 0 into the error state
  (what an HCA does on a fatal transport error).  Rank 1 sees its work requests flushed
  (``IBV_WC_WR_FLUSH_ERR``) and raises ``TransportError``; rank 0 sees its writes go
  unanswered (``IBV_WC_RETRY_EXC_ERR``) or rank 1's published error, and raises too.
* ``kill``: before call 3, rank 1 SIGKILLs itself; every other rank raises
  ``PeerFailure(rank=1)`` (its heartbeats stop, or its queue pair is gone).

Every rank that returns writes ``OUTDIR/rankR``, one line ``VERBS_FAIL {json}``: rank,
case, exception type, message, the rank the error blames, seconds from the start of the
failing call; then waits (at most 15 s) for the other survivors' files before it closes,
so no survivor sees another leave before it has seen the failure itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

import gpurt


def main() -> int:
    case, outdir = sys.argv[1], sys.argv[2]
    comm = gpurt.init()
    r = comm.rank
    x = np.ones(1 << 18, np.float32)          # 1 MiB: rendezvous writes
    rec = {"rank": r, "case": case, "exc": "", "text": "", "blame": -1, "seconds": 0.0,
           "calls": 0}
    t0 = time.monotonic()
    try:
        for i in range(20):
            if i == 3 and r == 1:
                if case == "qp_error":
                    vt = next(t for t in comm._transports if t.name == "verbs")
                    vt.inject_qp_error(0)
                elif case == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            x[:] = 1
            y = comm.allreduce(x, timeout=60)          # in place
            if not (y == comm.size).all():
                rec["exc"] = "WrongResult"
                break
            rec["calls"] = i + 1
    except Exception as e:  # noqa: BLE001 - the point: what is raised, and when
        rec.update(exc=type(e).__name__, text=str(e)[:600], blame=getattr(e, "rank", -1))
    rec["seconds"] = round(time.monotonic() - t0, 2)
    tmp = os.path.join(outdir, f"rank{r}.tmp")
    with open(tmp, "w") as f:
        f.write("VERBS_FAIL " + json.dumps(rec) + "\n")
    os.replace(tmp, os.path.join(outdir, f"rank{r}"))
    survivors = [q for q in range(comm.size) if not (case == "kill" and q == 1)]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(outdir, f"rank{q}")) for q in survivors):
        time.sleep(0.05)
    try:
        comm.close()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
