"""Run under ``mpiexec -n 2`` (driven by tests/test_processes.py), with the transport to
test forced by ``GPURT_TRANSPORTS`` (shm or tcp): receives that accept a shorter message
(``upto``), straight on the endpoints — what the agreement check's messages use.

* a message shorter than the receive: its bytes arrive, the rest of the destination is
  left as it was; exact lengths, 0 .. the capacity, posted before and after the send
  (a tcp frame read straight into place, or buffered first);
* a reduction's sink (a receive that is not a plain copy) also gets only those bytes;
* a message longer than the capacity: CollectiveMismatchError on the receiver, saying
  "at most" (``UPTO_LONG=big``: a long one, a refused rendezvous on verbs).
* capacities of 1000 and 40000 bytes: on verbs eager messages and rendezvous.

Prints ``upto ok on rank R (TRANSPORT)``; raises on a failure.
"""

from __future__ import annotations

import os
import time

import numpy as np

import gpurt
from gpurt.errors import CollectiveMismatchError

c = gpurt.init()
r, peer = c.rank, 1 - c.rank
ep = c.endpoints[peer]
CAP, BIG = 1000, 40000
lane, sig = 0, 0x5A5A


def wait(*done) -> None:
    c.engine._drive(lambda: False, lambda: all(d.test() for d in done),
                    lambda: [peer], 30, lambda t, m: TimeoutError(f"rank {r}: stuck"))


class Sink:           # a plain copy (the transports may write dst directly)
    def __init__(self, d):
        self.dst = d

    def __call__(self, off, chunk):
        self.dst[off:off + chunk.nbytes] = chunk


tag = 0
# capacities under and over verbs' eager limit (16 KiB: eager messages, and rendezvous)
for cap, sizes in ((CAP, (CAP, 1, 0, 8, 999, 512)), (BIG, (BIG, 20000, 100, BIG - 8))):
    for n in sizes:
        for recv_first in (True, False):
            tag += 1
            src = (np.arange(n) * 3 + tag).astype(np.uint8)
            dst = np.full(cap, 0xEE, np.uint8)
            if r == 0:
                wait(ep.send(src, lane, tag, sig))
            else:
                if not recv_first:
                    # the message is there before the receive: read (buffered) meanwhile
                    end = time.monotonic() + 0.05
                    while time.monotonic() < end:
                        ep.check()
                rv = ep.recv(cap, Sink(dst), lane, tag, sig, upto=True)
                wait(rv)
                assert np.array_equal(dst[:n], src), (cap, n, recv_first)
                assert (dst[n:] == 0xEE).all(), (cap, n, recv_first, "bytes past the message")
            c.mpi.Barrier()

# a reduction's sink: only the message's bytes reach it
tag += 1
got = []
if r == 0:
    wait(ep.send(np.arange(40, dtype=np.uint8), lane, tag, sig))
else:
    wait(ep.recv(CAP, lambda off, chunk: got.append((off, bytes(chunk))), lane, tag, sig,
                 upto=True))
    assert b"".join(ch for _, ch in sorted(got)) == bytes(range(40)), got
c.mpi.Barrier()

# longer than the capacity: a mismatch on the receiver (on verbs a rendezvous is refused)
tag += 1
long = BIG + 8 if os.environ.get("UPTO_LONG") == "big" else CAP + 8
cap = long - 8
if r == 0:
    try:
        wait(ep.send(np.zeros(long, np.uint8), lane, tag, sig))
    except gpurt.GpurtError:
        pass          # the receiver refused it, or failed the endpoint already
else:
    try:
        wait(ep.recv(cap, Sink(np.zeros(cap, np.uint8)), lane, tag, sig, upto=True))
        raise AssertionError("a message longer than the receive was accepted")
    except CollectiveMismatchError as e:
        assert f"at most {cap} bytes" in str(e), e
print(f"upto ok on rank {r} ({ep.transport})", flush=True)
c.mpi.Barrier()
c.close()
