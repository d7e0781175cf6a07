"""Run under ``mpiexec -disable-auto-cleanup -n 3``: the last rank leaves while the others
wait for it in a ``split`` or ``dup`` (MPI exchanges gpurt cannot time out).

    python tests/split_wait_cases.py LEAVE WHAT DIR

LEAVE: how rank 2 leaves, half a second after the others entered ``WHAT`` (split | dup):
``raise`` (an unhandled exception: the hook publishes it, then the process waits in
MPI_Finalize for the others), ``exit`` (os._exit, as a kill would end it: hydra takes a
job down once a rank dies of a signal), ``close`` (it closes the communicator, then
lives on without splitting it) or ``stop`` (SIGSTOP; run with GPURT_PEER_STOPPED=2).
Before, ranks 0 and 1 waited in MPI for ever.  Each of them writes ``rank<r>``: one
JSON record {"rank", "outcome", "blamed", "seconds"}."""

import json
import os
import signal
import sys
import time

import numpy as np

import gpurt

leave, what, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
c = gpurt.init()
c.allreduce(np.ones(4, np.float32))
if c.rank == c.size - 1:
    time.sleep(0.5)
    if leave == "raise":
        raise RuntimeError("rank 2 gives up")
    if leave == "close":
        c.close()
        time.sleep(30)      # (rank 0 ends it once the others have reported)
    if leave == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(3)

t = time.monotonic()
try:
    new = c.split(0) if what == "split" else c.dup()
    outcome, blamed = f"completed: {new}", None
except Exception as e:  # noqa: BLE001 - the record says what it was
    outcome, blamed = f"{type(e).__name__}: {e}", getattr(e, "rank", None)
rec = {"rank": c.rank, "outcome": outcome, "blamed": blamed,
       "seconds": time.monotonic() - t}
with open(os.path.join(outdir, f"rank{c.rank}"), "w") as f:
    json.dump(rec, f)
if c.rank == 0 and leave != "exit":
    # (rank 2 waits in MPI_Finalize, sleeps or is stopped: ended once every survivor has
    # written)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(outdir, f"rank{r}")) for r in range(c.size - 1)):
        time.sleep(0.05)
    os.kill(c.pids[c.size - 1], signal.SIGKILL)
os._exit(0)
