"""A rank that closes its communicator (or exits, which closes it) while its peers still
wait on it: they raise ``PeerFailure`` naming it within a second or two, not at their
deadline — and a close right after a rank's last send costs its peers nothing they were
sent.  ``mpiexec -n 3 python tests/closed_peer_cases.py MODE``; each rank prints one line
``CLOSED_PEER {json}``.

- ``close [barrier|allreduce|shared]``: rank 2 closes its communicator with no call in
  flight and stays alive 6 s; ranks 0 and 1 call a barrier, or an allreduce of 4 MiB of
  NumPy or of shared arrays (shm_direct) (GPURT_TIMEOUT=60): ``PeerFailure`` naming rank 2
  and the close.
- ``close pending``: rank 2 posts an iallreduce of 8 MiB and an isend to rank 0 (tag 7),
  sends rank 1 a small message (complete at once), closes without waiting for the two; ranks 0 and 1 then call that allreduce: ``PeerFailure``
  naming rank 2's close during the allreduce (call #2).
- ``close send``: rank 2 aborts (fails); then ranks 0 and 1 send it 40 bytes / 4 MiB
  (shm): ``PeerFailure`` naming rank 2 (the small one used to complete into the ring,
  lost).  A peer that only closed is not checked by a send: its rejection of the call's
  input, say, must come first.
- ``exit``: rank 2 returns from main without closing (the exit handler closes it); the
  others as above.
- ``drained``: rank 0 sends rank 1 a small and a 4 MiB message and closes at once; rank 1
  first waits 1.5 s on a message rank 2 sends late, then receives rank 0's two: both
  arrive, exact (what a closed rank sent before it closed is still delivered).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import casekit  # noqa: E402

import gpurt  # noqa: E402


def report(**rec) -> None:
    print("CLOSED_PEER " + json.dumps(rec), flush=True)


def main() -> int:
    mode = sys.argv[1]
    world, comm, r, p, _ = casekit.start()
    comm.allreduce(np.ones(4, np.float32))          # connected, warm
    if mode in ("close", "exit"):
        call = sys.argv[2] if len(sys.argv) > 2 else "barrier"
        if r == 2:
            if mode == "close":
                if call == "send":      # (failed, not closed: see the docstring)
                    comm.abort("rank 2 gave up (and closed its side)")
                    world.Barrier()     # (before the others send)
                elif call == "pending":   # two requests not waited for, then close()
                    keep = (comm.iallreduce(np.full(1 << 20, 3.0)),  # noqa: F841
                            comm.isend(np.ones(1 << 20), 0, tag=7))
                    comm.send(np.ones(4), 1, tag=8)     # small: done at once, the newest
                    comm.close()                        # record (it hid the others)
                else:
                    comm.close()
                time.sleep(6)
            report(rank=r, outcome="left")
            return 0            # ("exit": the exit handler closes the communicator)
        if call == "send":
            world.Barrier()
        if call == "shared":            # shared arrays: shm_direct, the compiled round
            x = comm.empty(1 << 20, np.float32)
            x[:] = 1
        elif call == "allreduce":       # 4 MiB of NumPy: single copy
            x = np.ones(1 << 20, np.float32)
        elif call == "pending":         # rank 2's iallreduce (8 MiB) before its close()
            time.sleep(0.5)
            x = np.ones(1 << 20)
        t0 = time.monotonic()
        try:
            if call == "barrier":
                comm.barrier()
            elif call == "send":        # small (into the ring) / 4 MiB (single copy)
                comm.send(np.ones(10 if r == 0 else 1 << 20, np.float32), 2, timeout=60)
            else:
                comm.allreduce(x)
            outcome = "completed"
        except gpurt.PeerFailure as e:
            outcome = f"PeerFailure(rank={e.rank}): {e}"
        except gpurt.GpurtError as e:
            outcome = f"{type(e).__name__}: {e}"
        report(rank=r, outcome=outcome, seconds=round(time.monotonic() - t0, 2))
        return 0
    # drained
    small, big = 1000, 1 << 20
    if r == 0:
        comm.send(np.arange(small, dtype=np.int64), 1, tag=1)
        comm.send(np.arange(big, dtype=np.float32), 1, tag=2)
        comm.close()
        report(rank=r, outcome="sent")
    elif r == 1:
        late = np.zeros(8, np.int32)
        comm.recv(late, 2, tag=3)
        a, b = np.zeros(small, np.int64), np.zeros(big, np.float32)
        qa, qb = comm.irecv(a, 0, tag=1), comm.irecv(b, 0, tag=2)
        try:
            qa.wait()
            qb.wait()
            ok = bool(np.array_equal(a, np.arange(small)) and
                      np.array_equal(b, np.arange(big, dtype=np.float32)) and
                      np.array_equal(late, np.full(8, 7)))
            outcome = "exact" if ok else "WRONG DATA"
        except gpurt.GpurtError as e:
            outcome = f"{type(e).__name__}: {e}"
        report(rank=r, outcome=outcome)
        comm.close()
    else:
        time.sleep(1.5)
        comm.send(np.full(8, 7, np.int32), 1, tag=3)
        report(rank=r, outcome="sent")
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
