"""Latency of a small allreduce in a tight loop, and of its parts (docs/performance.md,
"Small allreduce"): the public call in place and out of place (with the compiled check of
x and out, ``_fastboard.plain``, and with the Python check it replaces), the inline board
path (``_board_go``), the compiled board round alone (``fast.run``), and mpi4py's
``Allreduce`` of the same array.

    gpurt launch -n 2 benchmarks/small_latency.py [COUNT]
"""

import sys
import time

import numpy as np

import gpurt
from gpurt.ops import Op

c = gpurt.init()
x = np.ones(int(sys.argv[1]) if len(sys.argv) > 1 else 2, np.float32)
N = 100_000


def bench(f, name):
    for _ in range(2000):
        f()
    c.mpi.Barrier()
    t = time.perf_counter()
    for _ in range(N):
        f()
    dt = (time.perf_counter() - t) / N * 1e6
    if c.rank == 0:
        print(f"{name:30s} {dt:.2f} us", flush=True)


bench(lambda: c.allreduce(x), "allreduce")
y = np.empty_like(x)
bench(lambda: c.allreduce(x, y), "allreduce(x, out)")
plain, gpurt.comm._PLAIN = gpurt.comm._PLAIN, None
bench(lambda: c.allreduce(x, y), "allreduce(x, out), Python check")
gpurt.comm._PLAIN = plain
fp = c._inline_plan("allreduce", x.dtype, x.size, Op.SUM, 0, None)
if c.board is not None and type(fp) is tuple and fp[5] is not None:
    bench(lambda: c._board_go("allreduce", fp, x, x, 0, x.size, None), "_board_go")
    bd, cplan = c.board, fp[5]

    def raw():
        c._seq += 1
        s = c._seq
        b = s & 1
        bd.fast.run(cplan, s, bd.last_use[b], x, x)
        bd.last_use[b] = s

    bench(raw, "fast.run")
bench(lambda: c.mpi.Allreduce(x, y), "mpi4py Allreduce")
