"""A ring exchange loop: every rank posts ``irecv`` from its left neighbour, ``isend`` to
its right one, then waits for both — the mean time of one round over many, as a halo
exchange sees it (``gpurt bench sendrecv`` reports the median of per-round maxima, which
on oversubscribed nodes mostly measures scheduling).

    gpurt launch -n 4 python benchmarks/sendrecv_loop.py --bytes 131072
    gpurt launch -n 4 python benchmarks/sendrecv_loop.py --bytes 131072 --mpi   # mpi4py

Options: ``--bytes N`` (default 65536), ``--iters N`` (default 1000).  Rank 0 prints the
slowest rank's mean time per round (after 50 untimed rounds and a barrier)."""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

ap = argparse.ArgumentParser()
ap.add_argument("--mpi", action="store_true")
ap.add_argument("--bytes", type=int, default=65536)
ap.add_argument("--iters", type=int, default=1000)
a = ap.parse_args()

world = MPI.COMM_WORLD
x = np.ones(a.bytes // 4, np.float32)
y = np.empty_like(x)
if a.mpi:
    c = world
    rank, size, name = c.Get_rank(), c.Get_size(), "mpi4py"

    def rnd() -> None:
        q = c.Irecv(y, (rank - 1) % size)
        s = c.Isend(x, (rank + 1) % size)
        s.Wait()
        q.Wait()
else:
    import gpurt
    c = gpurt.init()
    rank, size, name = c.rank, c.size, "gpurt"

    def rnd() -> None:
        q = c.irecv(y, (rank - 1) % size)
        s = c.isend(x, (rank + 1) % size)
        s.wait()
        q.wait()

for _ in range(50):
    rnd()
world.Barrier()
t = time.perf_counter()
for _ in range(a.iters):
    rnd()
dt = world.gather(time.perf_counter() - t, 0)
if rank == 0:
    print(f"{name} {size} ranks {a.bytes} B round {max(dt) / a.iters * 1e6:.1f} us", flush=True)
if not a.mpi:
    c.close()
