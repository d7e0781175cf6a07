"""Large send/recv bandwidth through the ``verbs`` transport, for comparison with
perftest's ``ib_write_bw`` on the same device in the same run (inside a Soft-RoCE guest:
``tests/rdma/stage.sh`` runs both; rxe is software, so only the ratio means anything).

    GPURT_TRANSPORTS=verbs mpiexec -n 2 python3 benchmarks/verbs_bw.py [SIZE_MIB] [ITERS] [WINDOW]

Rank 0 sends ITERS messages of SIZE_MIB MiB to rank 1 (one direction, like
``ib_write_bw``; each message is one zero-copy rendezvous: RTS, CTS, one RDMA WRITE
straight into rank 1's registered buffer, FIN); rank 1 times from before the first
receive to after the last and prints ``GPURT_VERBS_BW_MIBS <MiB/s>`` (the data checked).
A warm-up message first registers both buffers (the registration cache keeps them).
WINDOW (default 1: blocking send/recv) messages are kept in flight with isend/irecv, into
WINDOW buffers, as ``ib_write_bw`` keeps its send queue full.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import gpurt


def main() -> None:
    size = int(float(sys.argv[1]) * (1 << 20)) if len(sys.argv) > 1 else 8 << 20
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    window = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    comm = gpurt.init()
    assert comm.size == 2, "two ranks"
    assert set(comm.transport_of.values()) == {"verbs"}, comm.transport_of
    want = np.arange(size, dtype=np.int64).astype(np.uint8)
    bufs = [want.copy() if comm.rank == 0 else np.empty(size, np.uint8) for _ in range(window)]

    def move(i: int):
        b = bufs[i % window]
        return comm.isend(b, 1, tag=i) if comm.rank == 0 else comm.irecv(b, 0, tag=i)

    for i in range(window):                   # warm-up: registers every buffer
        move(i).wait()
    comm.barrier()
    t0 = time.perf_counter()
    inflight = [move(i) for i in range(min(window, iters))]
    for i in range(window, iters + window):
        inflight.pop(0).wait()
        if i < iters:
            inflight.append(move(i))
    if comm.rank == 1:
        dt = time.perf_counter() - t0
        ok = all(np.array_equal(b, want) for b in bufs)
        print(f"GPURT_VERBS_BW_MIBS {size * iters / dt / 2**20:.2f} ({iters} x "
              f"{size >> 20} MiB, window {window}, in {dt:.2f} s, data "
              f"{'ok' if ok else 'WRONG'})", flush=True)
        if not ok:
            sys.exit(1)
    comm.barrier()


if __name__ == "__main__":
    main()
