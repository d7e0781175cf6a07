"""K receives and K sends in flight at once between 2 ranks (a burst of posts, then the
waits), the best of 6 rounds on rank 0: what comparing each call's buffer with those of
the requests in flight costs (``GPURT_CHECK=0`` skips it).

    K=1000 gpurt launch -n 2 python benchmarks/p2p_burst.py
    K=1000 GPURT_CHECK=0 gpurt launch -n 2 python benchmarks/p2p_burst.py
"""

from __future__ import annotations

import os
import time

import numpy as np

import gpurt

c = gpurt.init()
if c.size != 2:
    raise SystemExit("run with 2 ranks")
peer = 1 - c.rank
K = int(os.environ.get("K", "300"))
bufs = np.zeros((2, K, 2))
best = 1e9
for _ in range(6):
    c.barrier()
    t = time.perf_counter()
    rs = [c.irecv(bufs[0, k], peer, tag=k) for k in range(K)]
    ss = [c.isend(bufs[1, k], peer, tag=k) for k in range(K)]
    for q in rs + ss:
        q.wait()
    best = min(best, time.perf_counter() - t)
if c.rank == 0:
    print(f"K {K} GPURT_CHECK={os.environ.get('GPURT_CHECK', '1')}: best "
          f"{best * 1e3:.1f} ms", flush=True)
c.close()
