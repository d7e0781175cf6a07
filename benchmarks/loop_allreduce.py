"""Mean time of a blocking allreduce in a loop, and the CPU time each call costs a rank —
the steadier measure beside ``gpurt bench``'s per-iteration p50 where ranks outnumber the
cores (docs/performance.md, "Several nodes on one machine").

    MPIR_CVAR_NUM_CLIQUES=2 gpurt launch -n 4 python benchmarks/loop_allreduce.py --count 1024

Options: ``--count N`` float32 elements (default 1024), ``--iters N`` (default 3000).
Rank 0 prints the slowest rank's mean µs per call, every rank's CPU µs per call, and the
algorithm the last call used (after 50 untimed calls and a barrier)."""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

import gpurt

ap = argparse.ArgumentParser()
ap.add_argument("--count", type=int, default=1024)
ap.add_argument("--iters", type=int, default=3000)
a = ap.parse_args()

c = gpurt.init()
x = np.ones(a.count, np.float32)
out = np.empty_like(x)
for _ in range(50):
    c.allreduce(x, out=out)
assert np.all(out == c.size), out[:4]
c.mpi.Barrier()
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
for _ in range(a.iters):
    c.allreduce(x, out=out)
wall = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
walls = c.mpi.gather(wall, 0)
cpus = c.mpi.gather(cpu, 0)
if c.rank == 0:
    print(f"{c.size} ranks on {c.nnodes} node(s), {a.count * 4} B: "
          f"{max(walls) / a.iters * 1e6:.1f} us a call (slowest rank), CPU "
          + " ".join(f"{v / a.iters * 1e6:.0f}" for v in cpus)
          + f" us a call per rank, {c.last_algorithm}", flush=True)
c.close()
