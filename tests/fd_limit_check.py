"""Run under ``mpiexec -n N`` with a low open-file limit (``ulimit -n``): the tcp transport
raises the soft limit up to the hard one for its sockets, or every rank raises
``ResourceError`` before any socket is opened.  Prints one ``FDS {json}`` record per rank."""

from __future__ import annotations

import json
import resource

import numpy as np

import gpurt

before = resource.getrlimit(resource.RLIMIT_NOFILE)
from mpi4py import MPI  # noqa: E402 - (the limit as the job started it, above)

rank = MPI.COMM_WORLD.Get_rank()
rec = {"rank": rank, "before": list(before)}
try:
    comm = gpurt.init()
except gpurt.GpurtError as e:
    rec["error"] = [type(e).__name__, str(e)]
else:
    p = comm.size
    y = comm.allreduce(np.arange(100003, dtype=np.float64) + rank)
    rec["exact"] = bool((y == np.arange(100003) * p + p * (p - 1) / 2).all())
    rec["transports"] = sorted(set(comm.transport_of.values()))
    comm.close()
rec["after"] = list(resource.getrlimit(resource.RLIMIT_NOFILE))
print("FDS " + json.dumps(rec), flush=True)
