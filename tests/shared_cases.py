"""Run under ``mpiexec -n N``: collectives on node-shared arrays (``comm.empty`` /
``comm.zeros``, gpurt/sharedmem.py) — the shm transport reads a peer's shared array
through a mapping of it (memcpy, reductions in place) and a helping sender writes into a
shared destination the same way.  Exact data in every case:

* every collective with shared inputs and outputs, with shared inputs and NumPy outputs
  and the other way round, at sizes around the single-copy threshold (128 KiB), the
  cooperative copy's (1 MiB) and the streaming-copy one, from every root;
* a view that starts inside a shared array (offset in the mapping), in place;
* arrays allocated and freed in a loop: the peers' mappings of freed arrays are
  dropped (bounded), no file descriptor is left behind;
* that the mapping path was really taken (the peers' mapping tables are not empty), or,
  with ``GPURT_SHM_SHARED=0``, that it was not.

Prints ``ok ... on N ranks`` on rank 0; exits non-zero on a failure.
"""

from __future__ import annotations

import gc
import os

import numpy as np

import casekit
from gpurt import sharedmem

world, comm, r, p, chk = casekit.start()
bad, expect = chk.bad, chk.expect
off_expected = os.environ.get("GPURT_SHM_SHARED") == "0"


def vals(n: int, k: int, seed: int) -> np.ndarray:
    """Rank k's exact int-valued float64 data (sums of p of them stay exact)."""
    return ((np.arange(n, dtype=np.int64) * 7 + k * 1000003 + seed * 31) % 65521).astype(np.float64)


SH = comm.empty
NP = np.empty
KiB, MiB = 1 << 10, 1 << 20
sizes = [128 * KiB // 8 - 1, 128 * KiB // 8, MiB // 8 + 3, 9 * MiB // 8 + 5]   # elements
combos = [("shared->shared", SH, SH), ("shared->numpy", SH, NP), ("numpy->shared", NP, SH)]

for seed, n in enumerate(sizes):
    for name, ain, aout in combos:
        tag = f"{name} n={n}"
        # allreduce (into out, and in place)
        x = ain(n, np.float64)
        x[:] = vals(n, r, seed)
        want = sum(vals(n, k, seed) for k in range(p))
        y = aout(n, np.float64)
        comm.allreduce(x, out=y)
        expect(f"allreduce {tag}", y, want)
        comm.allreduce(x)
        expect(f"allreduce in place {tag}", x, want)
        # allgather
        x[:] = vals(n, r, seed)
        y = aout(n * p, np.float64)
        comm.allgather(x, out=y)
        expect(f"allgather {tag}", y, np.concatenate([vals(n, k, seed) for k in range(p)]))
        # reduce_scatter
        xs = ain(n * p, np.float64)
        xs[:] = vals(n * p, r, seed)
        y = aout(n, np.float64)
        comm.reduce_scatter(xs, out=y)
        expect(f"reduce_scatter {tag}",
               y, sum(vals(n * p, k, seed) for k in range(p))[r * n:(r + 1) * n])
        # alltoall
        y = aout(n * p, np.float64)
        comm.alltoall(xs, out=y)
        expect(f"alltoall {tag}",
               y, np.concatenate([vals(n * p, k, seed)[r * n:(r + 1) * n] for k in range(p)]))
        for root in range(p):
            b = ain(n, np.float64)
            b[:] = vals(n, root, seed) if r == root else -1
            comm.broadcast(b, root=root)
            expect(f"broadcast root {root} {tag}", b, vals(n, root, seed))
            x[:] = vals(n, r, seed)
            y = aout(n, np.float64)
            y[:] = -1
            comm.reduce(x, out=y, root=root)
            if r == root:
                expect(f"reduce root {root} {tag}", y, want)
            g = aout(n * p, np.float64) if r == root else None
            comm.gather(x, out=g, root=root)
            if r == root:
                expect(f"gather root {root} {tag}",
                       g, np.concatenate([vals(n, k, seed) for k in range(p)]))
            y = aout(n, np.float64)
            comm.scatter(xs if r == root else None, out=y, root=root)
            expect(f"scatter root {root} {tag}", y, vals(n * p, root, seed)[r * n:(r + 1) * n])
        if p >= 2:      # send/recv around a ring
            x[:] = vals(n, r, seed)
            y = aout(n, np.float64)
            rq = comm.irecv(y, (r - 1) % p, tag=5)
            comm.send(x, (r + 1) % p, tag=5)
            rq.wait()
            expect(f"send/recv {tag}", y, vals(n, (r - 1) % p, seed))

# a view that starts inside a shared array: the location word's offset
n = MiB // 8 + 11
big = comm.zeros(n + 100, np.float64)
expect("zeros are zero", big, np.zeros(n + 100))
v = big[37:37 + n]
v[:] = vals(n, r, 9)
comm.allreduce(v)
expect("allreduce of a view at an offset", v, sum(vals(n, k, 9) for k in range(p)))
expect("allreduce of a view: around it untouched", np.concatenate([big[:37], big[37 + n:]]),
       np.zeros(100))
out = comm.empty((p, 3, n), np.float64)
src = comm.empty((3, n), np.float64)
src[:] = vals(3 * n, r, 10).reshape(3, n)
comm.allgather(src, out=out)
expect("allgather of 2-D shared arrays", out,
       np.stack([vals(3 * n, k, 10).reshape(3, n) for k in range(p)]))
del big, v, out, src

# allocate, use, free: the peers drop mappings of freed arrays; no descriptor leaks
gc.collect()
fds0 = len(os.listdir("/proc/self/fd"))
for i in range(40):
    a = comm.empty(MiB // 8, np.float64)
    a[:] = vals(MiB // 8, r, i)
    comm.allreduce(a)
    if i % 13 == 0:
        expect(f"allreduce, fresh array {i}", a, sum(vals(MiB // 8, k, i) for k in range(p)))
    del a
    gc.collect()
fds1 = len(os.listdir("/proc/self/fd"))
if fds1 > fds0 + 2:
    bad.append(f"rank {r}: {fds1 - fds0} file descriptors more after 40 arrays came and went")
maps = [ep.maps for ep in comm.endpoints.values() if getattr(ep, "maps", None) is not None]
shm = next((t for t in comm._transports if t.name == "shm"), None)
if shm is not None and comm.endpoints:
    if off_expected:
        if maps or not shm.map_why:
            bad.append(f"rank {r}: GPURT_SHM_SHARED=0 but peers' arrays are mapped ({shm.map_why!r})")
    elif shm.map_why:
        bad.append(f"rank {r}: shared arrays are not read through mappings: {shm.map_why}")
    elif not maps:
        bad.append(f"rank {r}: no mapping tables")
    else:
        for m in maps:
            m.sweep()
            if len(m.maps) > 3:     # the arrays still alive: none after the loop
                bad.append(f"rank {r}: {len(m.maps)} mappings of rank {m.rank}'s arrays "
                           f"left after its arrays were freed")
        chk.count += 1
if sharedmem.is_shared(np.empty(4)):
    bad.append(f"rank {r}: a NumPy array counts as shared")

comm.barrier()
casekit.verdict(world, comm, chk)
