"""Run under ``mpiexec -disable-auto-cleanup -n 2`` with the **stand-in for a GPU**
(``GPURT_DEVICE_BACKEND=standin``, ``GPURT_STANDIN_DELAY_US=100000``; not a GPU): rank 1
posts a device allreduce whose input its slow stream is still producing (30 fills of
0.1 s), then dies (``os._exit``); rank 0's allreduce on its own stream meets
``PeerFailure``, and then its stream must still run what it queues there (a fill, read
back).  Before, rank 0's stream held a wait on rank 1's event, which never fired: the
fill never ran.  Rank 0 prints ``DEAD_PEER {json}``: {"outcome", "seconds", "after"}."""

from __future__ import annotations

import json
import os
import threading
import time

os.environ.setdefault("GPURT_DEVICE_BACKEND", "standin")

import numpy as np  # noqa: E402

import gpurt  # noqa: E402
from gpurt import device_standin as si  # noqa: E402

comm = gpurt.init()
r = comm.rank
s = si.Stream()
x = si.zeros(1000, np.float32, stream=s.ptr)
if r == 1:
    for _ in range(30):
        si.fill(x, 1.0)              # the input, produced slowly on the call's stream
    q = comm.iallreduce(x)
    t1 = time.monotonic()
    while time.monotonic() - t1 < 0.8:
        q.test()
        time.sleep(0.01)
    os._exit(3)
t0 = time.monotonic()
try:
    comm.allreduce(x, timeout=30)
    outcome = "completed"
except gpurt.PeerFailure as e:
    outcome = f"PeerFailure(rank={e.rank}): {e}"
except gpurt.GpurtError as e:
    outcome = f"{type(e).__name__}: {e}"
took = round(time.monotonic() - t0, 2)
y = si.zeros(10, np.float32, stream=s.ptr)
si.fill(y, 5.0)
got: dict = {}
th = threading.Thread(target=lambda: got.setdefault("v", y.get().tolist()), daemon=True)
th.start()
th.join(10)
after = "hung" if th.is_alive() else got["v"]
print("DEAD_PEER " + json.dumps({"outcome": outcome, "seconds": took, "after": after}),
      flush=True)
os._exit(0)
