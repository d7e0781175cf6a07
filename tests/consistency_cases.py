"""Every rank of an allreduce holds the same bits (tests/test_processes.py::
test_allreduce_leaves_every_rank_the_same_bits): where the op's result depends on the
operands' order in NumPy — complex multiply (SIMD, FMA), the MIN/MAX of +0.0 and -0.0 —
an algorithm in which two ranks combine the same partials must combine them in the same
order.  Every allreduce algorithm (forced) and the tuner's own choice, in and out of
place; rank 0 prints ``ok N`` or what differed."""

from __future__ import annotations

import zlib

import numpy as np

import gpurt
from gpurt.algorithms import REGISTRY

comm = gpurt.init()
r, p = comm.rank, comm.size
bad, count = [], 0
rng = np.random.default_rng([r, 11])
n = 4099
cases = [
    ("complex64 PROD", gpurt.PROD,
     ((1 + rng.standard_normal(n) / 10) + 1j * rng.standard_normal(n) / 10)
     .astype(np.complex64)),
    ("float64 MIN of +-0.0", gpurt.MIN, np.where(rng.integers(0, 2, n) == 1, 0.0, -0.0)),
    ("float64 MAX of +-0.0", gpurt.MAX, np.where(rng.integers(0, 2, n) == 1, 0.0, -0.0)),
    ("float32 SUM", gpurt.SUM, rng.standard_normal(n).astype(np.float32)),
]
for algo in [None, *REGISTRY["allreduce"]]:
    for what, op, x in cases:
        for inplace in (True, False):
            kw = {"algo": algo} if algo else {}
            if inplace:
                got = x.copy()
                comm.allreduce(got, op=op, **kw)
            else:
                got = np.empty_like(x)
                comm.allreduce(x, got, op=op, **kw)
            crcs = comm.mpi.allgather(zlib.crc32(got.tobytes()))
            count += 1
            if len(set(crcs)) != 1:
                bad.append(f"{what} algo={algo or 'default'} ({comm.last_algorithm}) "
                           f"{'in' if inplace else 'out of'} place: crc32 per rank {crcs}")
if r == 0:
    print(f"ok {count}" if not bad else "DIFFER\n" + "\n".join(bad), flush=True)
