"""Blocking ping-pong between ranks 0 and 1: the one-way time of a small message.

    gpurt launch -n 2 python benchmarks/pingpong.py            # gpurt send/recv
    gpurt launch -n 2 python benchmarks/pingpong.py --mpi      # mpi4py Send/Recv, same loop
    GPURT_NATIVE=0 gpurt launch -n 2 python benchmarks/pingpong.py   # without the quick path

Options: ``--bytes N`` (default 8), ``--iters N`` (default 20000).  Rank 0 prints
``one-way <us> us`` (the loop's time / iterations / 2, after 1000 warm-up round trips)."""

from __future__ import annotations

import argparse
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--mpi", action="store_true")
ap.add_argument("--bytes", type=int, default=8)
ap.add_argument("--iters", type=int, default=20000)
a = ap.parse_args()

x = np.zeros(a.bytes, np.uint8)
y = np.zeros(a.bytes, np.uint8)
if a.mpi:
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    rank = c.Get_rank()
    send, recv, name = c.Send, c.Recv, "mpi4py"
else:
    import gpurt
    c = gpurt.init()
    rank = c.rank
    send, recv, name = c.send, c.recv, "gpurt"


def loop(n: int) -> None:
    if rank == 0:
        for _ in range(n):
            send(x, 1)
            recv(y, 1)
    elif rank == 1:
        for _ in range(n):
            recv(y, 0)
            send(x, 0)


loop(1000)
t = time.perf_counter()
loop(a.iters)
dt = time.perf_counter() - t
if rank == 0:
    print(f"{name} {a.bytes} B one-way {dt / a.iters / 2 * 1e6:.2f} us", flush=True)
