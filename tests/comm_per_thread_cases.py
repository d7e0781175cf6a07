"""One communicator per thread, as the README asks: ``mpiexec -n P python
tests/comm_per_thread_cases.py``; each rank prints ``PER_THREAD {json}``.

Three threads per rank, each with its own communicator (``init()`` and two ``dup()``s),
at the same time: allreduces (16 B to 1.2 MB), allgathers of int64 (64 B to 1.6 MB per
rank), and sends from rank 0 to every rank with a barrier after each, 200 calls each,
exact results — the two-threads check (per communicator) must not fire, and nothing
the communicators share in a process may mix their calls up."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpurt  # noqa: E402


def main() -> int:
    c1 = gpurt.init()
    c2, c3 = c1.dup(), c1.dup()
    p, r = c1.size, c1.rank
    errors: list[str] = []

    def reduces():
        for i in range(200):
            n = (16, 5000, 300000)[i % 3]
            y = c1.allreduce(np.full(n, r + i, np.float32))
            if not (y == sum(q + i for q in range(p))).all():
                errors.append(f"allreduce {i}: wrong")

    def gathers():
        for i in range(200):
            n = (8, 3000, 200000)[i % 3]
            y = c2.allgather(np.full(n, r * 1000 + i, np.int64))
            if not (y.reshape(p, -1) == (np.arange(p) * 1000 + i)[:, None]).all():
                errors.append(f"allgather {i}: wrong")

    def p2p():
        for i in range(200):
            if r == 0:
                for q in range(1, p):
                    c3.send(np.full(64, q + i, np.float64), q, tag=i)
            else:
                z = np.empty(64)
                c3.recv(z, 0, tag=i)
                if not (z == r + i).all():
                    errors.append(f"recv {i}: wrong")
            c3.barrier()

    def guarded(fn):
        def run():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(f"{type(e).__name__}: {e}"[:400])
        return run

    t0 = time.monotonic()
    threads = [threading.Thread(target=guarded(f)) for f in (reduces, gathers, p2p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    print("PER_THREAD " + json.dumps({"rank": r, "errors": errors,
                                      "alive": sum(t.is_alive() for t in threads),
                                      "seconds": round(time.monotonic() - t0, 2)}), flush=True)
    for c in (c3, c2, c1):
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
