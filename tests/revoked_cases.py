"""A large send that fails on the sender (its deadline, a watchdog's ``abort()``, a
``close()`` with the send in flight) before the receiver has read it: the sender's caller
gets its buffer back and overwrites it, and the receiver, which posts its receive only
afterwards, must raise ``PeerFailure`` naming the sender and why — never complete with
what the program wrote there next (shm's single copy reads the sender's memory in place;
tcp had the rest of the message queued on the socket, pointing into that buffer).
``mpiexec -n 2 python tests/revoked_cases.py [MiB]`` (8 by default; more than the
sockets hold under tcp striping); each rank prints one
``REVOKED {json}`` record: for each ``mode/buffer`` what happened.

Modes: ``none`` (no failure: the late receive gets the data exact), ``timeout``
(``send(timeout=0.5)``), ``abort`` (a watchdog thread's ``abort()`` 0.5 s into a blocking
send), ``poll`` (the same while the caller polls an ``isend``'s ``wait(timeout=0.001)``:
it must not have the buffer back before the peers are told), ``close`` (``isend`` then
``close()``).  Buffers: ``numpy`` (single copy by
process_vm_readv on shm) and ``shared`` (``comm.empty``: read through a mapping of it).
Each case on a communicator of its own; rank 1 posts its receive once rank 0's send has
failed and its buffer was overwritten (an MPI message says so), or 1.5 s after rank 0
started sending in ``none``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import gpurt

# MiB of float64: single copy on shm, more than the kernel's socket buffers hold
N = int(sys.argv[1] if len(sys.argv) > 1 else 8) << 17


def case(world, mode: str, buf: str) -> str:
    comm = gpurt.Communicator(world)
    comm.allreduce(np.ones(4))              # connected, warm
    r = comm.rank
    x = comm.empty(N, np.float64) if buf == "shared" else np.empty(N)
    world.Barrier()
    if r == 0:
        x[:] = 3.0
        try:
            if mode == "none":
                comm.send(x, 1, timeout=30)
            elif mode == "timeout":
                comm.send(x, 1, timeout=0.5)
            elif mode == "abort":
                threading.Timer(0.5, comm.abort, ("watchdog: send hung",)).start()
                comm.send(x, 1, timeout=30)
            elif mode == "poll":          # the caller polls its Request meanwhile
                req = comm.isend(x, 1)
                threading.Timer(0.5, comm.abort, ("watchdog: send hung",)).start()
                while True:
                    try:
                        req.wait(timeout=0.001)
                        break
                    except gpurt.CollectiveTimeout:
                        pass
            else:
                comm.isend(x, 1)
                comm.close()
            out = "sent"
        except gpurt.GpurtError as e:
            out = f"{type(e).__name__}: {e}"
        x[:] = -7.0                        # the program's next use of its buffer
        if mode != "none":
            world.send(None, 1, tag=77)    # (rank 1 receives only now)
    else:
        if mode == "none":
            time.sleep(1.5)                # (late is harmless here: the send waits)
        else:                              # once rank 0's send failed and its buffer
            world.recv(source=0, tag=77)   # was overwritten, not after a fixed 1.5 s
        y = np.zeros(N)
        t0 = time.monotonic()
        try:
            comm.recv(y, 0, timeout=10)
            vals = np.unique(y).tolist()
            out = "exact" if vals == [3.0] else f"WRONG DATA {vals}"
        except gpurt.PeerFailure as e:
            out = f"PeerFailure(rank={e.rank}) {time.monotonic() - t0:.1f}s: {e}"
        except gpurt.GpurtError as e:
            out = f"{type(e).__name__}: {e}"
    world.Barrier()         # (rank 0 closes only after rank 1's receive has ended)
    del x
    comm.close()
    return out


def main() -> None:
    world = MPI.COMM_WORLD
    got = {}
    for buf in ("numpy", "shared"):
        for mode in ("none", "timeout", "abort", "poll", "close"):
            got[f"{mode}/{buf}"] = case(world, mode, buf)
    print("REVOKED " + json.dumps({"rank": world.rank, **got}), flush=True)


if __name__ == "__main__":
    main()
