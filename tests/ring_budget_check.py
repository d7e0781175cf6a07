"""Run under ``mpiexec -n N``: the shm rings as sized for N local ranks (GPURT_SHM_RING_MEM),
and collectives and point-to-point messages larger than a slot streaming through them, with
exact results.  Prints one ``RINGS {json}`` record per rank."""

from __future__ import annotations

import json
import os

import numpy as np

import gpurt
from gpurt import config
from gpurt.transports import shm

comm = gpurt.init()
r, p = comm.rank, comm.size
seg = comm._shm().seg
slot, (k_coll, k_p2p) = seg.slot, seg.nslots
rec = {"rank": r, "slot": slot, "slots": [k_coll, k_p2p],
       "ring_bytes_per_rank": (p - 1) * sum(seg.ring_bytes),
       "ring_mem": int(config.get("GPURT_SHM_RING_MEM")),
       "segment": seg.size,
       # the segment's name (local rank 0's pid) is gone once every rank mapped it
       "segment_files": sorted(f for f in os.listdir(str(config.get("GPURT_SHM_DIR")))
                               if f.startswith(f"{shm.PREFIX}{comm.pids[0]}-")),
       "bad": []}
bad = rec["bad"]
tot = p * (p + 1) // 2
big = 3 * slot + 1000          # a message of several slots and a piece

# collectives: sums and blocks that name their source exactly
for n in (1, 1000, big // 4):
    x = np.full(n, r + 1, np.float32)
    y = comm.allreduce(x)
    if not (y == tot).all():
        bad.append(f"allreduce {n}: {np.unique(y)[:5]}")
    b = comm.broadcast(np.arange(n, dtype=np.int32) + r, root=p - 1)
    if not (b == np.arange(n) + p - 1).all():
        bad.append(f"broadcast {n}")
    g = comm.allgather(np.arange(n, dtype=np.int32) * p + r)
    if not (g.reshape(p, n) == np.arange(n)[None, :] * p + np.arange(p)[:, None]).all():
        bad.append(f"allgather {n}")
m = big // 4 // p + 1
src = (np.arange(p * m, dtype=np.int64) + 1000 * r).reshape(p, m)
a = comm.alltoall(src)
want = np.arange(m)[None, :] + r * m + 1000 * np.arange(p)[:, None]
if not (a.reshape(p, m) == want).all():
    bad.append("alltoall")

# point-to-point around the ring, both lanes' slots filled several times over
for n in (7, big // 8, 4 * big // 8):
    out = np.empty(n, np.float64)
    right, left = (r + 1) % p, (r - 1) % p
    if p > 1:
        reqs = [comm.isend(np.arange(n, dtype=np.float64) + r, right, tag=5),
                comm.irecv(out, left, tag=5)]
        for q in reqs:
            q.wait(timeout=60)
        if not (out == np.arange(n) + left).all():
            bad.append(f"send/recv {n}")
comm.barrier()
comm.close()
print("RINGS " + json.dumps(rec), flush=True)
