"""Run under mpiexec: the last rank rejects its call as invalid input (a strided ``out``)
while the other ranks are still two calls behind (both ranks' earlier calls were rejected
too, so the last rank waited on nobody), then sleeps (``sleep``) or leaves (``exit``).
Its header cannot go out at once: on the board its buffer is still the one a slower peer
reads; across nodes the calls before it must finish first.  Each other rank must raise
CollectiveMismatchError naming the rejection within seconds — not wait for its deadline
(60 s) nor take the exit for a PeerFailure.

    mpiexec -n N python tests/rejected_cases.py sleep|exit COUNT

Prints ``REJECTED {json}`` per rank: its outcome and how long its call took."""

import json
import sys
import time

import numpy as np

import gpurt

c = gpurt.init()
r, p = c.rank, c.size
mode, n = sys.argv[1], int(sys.argv[2])
for _ in range(2):
    try:
        c.allreduce(np.ones(4), stream=1)       # host arrays: rejected on every rank
    except ValueError:
        pass
rec = {"rank": r}
if r != p - 1:
    time.sleep(1.0)
    t = time.monotonic()
    try:
        c.allreduce(np.ones(n), np.empty(n), timeout=60)
        rec["outcome"] = "ok"
    except gpurt.GpurtError as e:
        rec["outcome"] = f"{type(e).__name__}: {e}"
    rec["seconds"] = time.monotonic() - t
else:
    try:
        c.allreduce(np.ones(n), np.empty(2 * n)[::2])
        rec["outcome"] = "ok"
    except ValueError as e:
        rec["outcome"] = f"ValueError: {e}"
print("REJECTED " + json.dumps(rec), flush=True)
if r == p - 1 and mode == "sleep":
    time.sleep(6)
