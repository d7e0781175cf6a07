"""Run under mpiexec: a failure on one rank must become an error on every rank, quickly,
even when the failing rank catches its exception and carries on (no exit, no EOF).

    mpiexec -n N python tests/spread_check.py mismatch|abort OUTDIR

mismatch: the last rank calls allreduce with one element more than the others;
abort:    rank 1 calls comm.abort() while the others wait in an allreduce.
Every rank writes OUTDIR/rank-R.json {"error": type, "message", "seconds"} — seconds from
the call to the exception — then sleeps 3 s before exiting (so that no rank learns of the
failure from a closed connection or an exited process).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import gpurt


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    comm = gpurt.init()
    r, p = comm.rank, comm.size
    comm.allreduce(np.ones(4, np.float32))          # connected and warm
    comm.mpi.Barrier()
    res = {"error": None, "message": "", "seconds": None}
    t0 = time.monotonic()
    try:
        if mode == "mismatch":
            n = 100_001 if r == p - 1 else 100_000
            comm.allreduce(np.ones(n, np.float32), timeout=30)
        elif mode == "abort":
            if r == 1:
                time.sleep(0.3)
                comm.abort("giving up on purpose")
                raise gpurt.CommunicatorClosed("aborted here")
            comm.allreduce(np.ones(1000, np.float32), timeout=30)
    except gpurt.GpurtError as e:
        res = {"error": type(e).__name__, "message": str(e),
               "seconds": time.monotonic() - t0}
    with open(os.path.join(out, f"rank-{r}.json"), "w") as f:
        json.dump(res, f)
    time.sleep(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
