"""Run on a 2-node virtual cluster: allreduces until the test cuts the network link.

    mpiexec ... python tests/partition_check.py OUTDIR

Every rank connects (tcp between the nodes), writes OUTDIR/started-R, then runs 1 MiB
allreduces in a loop with a 60 s deadline per call.  The test takes a node's link down;
each rank records how the loop ended — {"error", "message", "seconds" since the first
call that failed to complete, "calls"} — in OUTDIR/rank-R.json and leaves with
``os._exit`` (MPI's own finalisation would wait for the partitioned peer).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import gpurt


def main() -> None:
    out = sys.argv[1]
    comm = gpurt.init()
    x = np.ones(1 << 18, np.float32)
    comm.allreduce(x)
    open(os.path.join(out, f"started-{comm.rank}"), "w").close()
    calls, res = 0, {"error": None}
    while True:
        t0 = time.monotonic()
        try:
            comm.allreduce(x, timeout=60)
            calls += 1
        except gpurt.GpurtError as e:
            res = {"error": type(e).__name__, "message": str(e),
                   "seconds": time.monotonic() - t0, "calls": calls}
            break
    with open(os.path.join(out, f"rank-{comm.rank}.json"), "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
