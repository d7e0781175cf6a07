"""Run under ``mpiexec -disable-auto-cleanup -n 3``: rank 1 leaves (``exit``: os._exit;
``raise``: an unhandled exception, which gpurt's hook publishes) while ranks 0 and 2
poll a request's ``test()`` in a loop — an iallreduce on the board (``small``), a
large one (``large``: shm_direct or the schedule), or an irecv from rank 1 (``recv``).
Each survivor must meet PeerFailure(rank=1) within the liveness bound, as ``wait()``
would, not poll for ever.

    mpiexec -disable-auto-cleanup -n 3 python tests/poll_cases.py exit small|large|recv
    mpiexec -n 3 python tests/poll_cases.py raise small

Prints ``POLL {json}`` from ranks 0 and 2: the outcome and the seconds it took; with a
third argument, a folder, each also writes it to ``poll.<rank>.json`` there (the launcher
may join two ranks' output lines: a CI run saw rank 2's record glued to rank 0's), and
leaves only once the other survivor's record is there too (up to 30 s)."""

import json
import os
import sys
import time

import numpy as np

import gpurt

mode, call = sys.argv[1], sys.argv[2]
c = gpurt.init()
n = 1 << 20 if call == "large" else 1000
x = np.ones(n, np.float32)
c.allreduce(x)
if c.rank == 1:
    time.sleep(0.5)
    if mode == "raise":
        raise RuntimeError("boom on rank 1")
    os._exit(3)
req = c.irecv(np.empty(4, np.float32), 1) if call == "recv" else c.iallreduce(x)
t = time.monotonic()
rec = {"rank": c.rank}
try:
    while not req.test():
        if time.monotonic() - t > 20:
            rec["outcome"] = "still polling after 20 s"
            break
        time.sleep(0.001)
    else:
        rec["outcome"] = "completed"
except gpurt.PeerFailure as e:
    rec["outcome"] = f"PeerFailure(rank={e.rank}): {e}"
rec["seconds"] = time.monotonic() - t
print("POLL " + json.dumps(rec), flush=True)
if len(sys.argv) > 3:
    with open(os.path.join(sys.argv[3], f"poll.{c.rank}.json.tmp"), "w") as f:
        json.dump(rec, f)
    os.replace(os.path.join(sys.argv[3], f"poll.{c.rank}.json.tmp"),
               os.path.join(sys.argv[3], f"poll.{c.rank}.json"))
    # a survivor that leaves first (os._exit, no MPI_Finalize) may have the launcher end
    # the other before it wrote its record (a CI run lost rank 0's so): wait for both
    other = os.path.join(sys.argv[3], f"poll.{2 - c.rank}.json")
    t_end = time.monotonic() + 30
    while not os.path.exists(other) and time.monotonic() < t_end:
        time.sleep(0.01)
os._exit(0)
