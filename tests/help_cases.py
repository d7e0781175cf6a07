"""Run under ``mpiexec -n N`` (N >= 2): the shm transport's cooperative single copy — a
large plain receive cut into chunks that the receiver reads and the waiting sender writes
(transports/shm.py, ``_open_help``).  Exact data in every case:

* broadcast, gather, scatter, allgather and send/recv of sizes around the chunk and
  threshold boundaries (1 MiB - 1 .. 17 MiB + 3, odd byte counts), from every root;
* a sender that is busy elsewhere (``isend``, then 0.3 s of sleep before ``wait``): the
  receiver must finish on its own, before the sender looks;
* a receiver slower than the sender (the sender takes most chunks);
* many messages back to back on one pair (generations must not mix);
* the counts of chunks each side copied, read from the rings, show both sides worked.

Prints ``ok ... on N ranks`` on rank 0; exits non-zero on a failure.
"""

from __future__ import annotations

import time

import numpy as np

import casekit

world, comm, r, p, chk = casekit.start()
bad, expect = chk.bad, chk.expect


def pattern(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 2654435761 + seed * 40503) % 251).astype(np.uint8)


shm = next(t for t in comm._transports if t.name == "shm")
if shm.cma_why:
    raise SystemExit(f"single copy is off here: {shm.cma_why}")
MiB = 1 << 20
sizes = [MiB - 1, MiB, MiB + 3, 3 * MiB + 5, 17 * MiB + 3]

for n in sizes:
    for root in range(p):
        x = pattern(n, root) if r == root else np.zeros(n, np.uint8)
        comm.broadcast(x, root=root)
        expect(f"broadcast {n} root {root}", x, pattern(n, root))
    g = comm.gather(pattern(n, r), root=p - 1)
    if r == p - 1:
        expect(f"gather {n}", g, np.stack([pattern(n, k) for k in range(p)]))
    a = comm.allgather(pattern(n, r + 7))
    expect(f"allgather {n}", a, np.stack([pattern(n, k + 7) for k in range(p)]))

# point to point: 0 -> 1, a busy sender, then a slow receiver
n = 9 * MiB + 1
if r == 0:
    req = comm.isend(pattern(n, 1), 1, tag=5)
    # busy (no gpurt call): the receiver copies every chunk alone — until rank 1 says it
    # finished (an MPI message), at most 10 s, not a fixed second it could overrun
    t0 = time.monotonic()
    while not world.Iprobe(source=1, tag=99) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    entered = time.monotonic()            # CLOCK_MONOTONIC: one clock for the machine
    req.wait()
    world.recv(source=1, tag=99)          # (taken; rank 1 sent it once its receive ended)
    time.sleep(0.05)
    comm.send(pattern(n, 2), 1, tag=6)    # the receiver is slow: the sender helps
    for i in range(20):                   # back to back: generations must not mix
        comm.send(pattern(MiB + 17 * i, 100 + i), 1, tag=7)
elif r == 1:
    got = comm.recv(np.empty(n, np.uint8), 0, tag=5)
    finished = time.monotonic()
    world.send(finished, 0, tag=99)
    expect("recv from a busy sender", got, pattern(n, 1))
    time.sleep(0.2)
    got = comm.recv(np.empty(n, np.uint8), 0, tag=6)
    expect("recv, slow receiver", got, pattern(n, 2))
    for i in range(20):
        got = comm.recv(np.empty(MiB + 17 * i, np.uint8), 0, tag=7)
        expect(f"recv {i} back to back", got, pattern(MiB + 17 * i, 100 + i))
comm.barrier()
if p > 1:
    t = world.allgather(entered if r == 0 else finished if r == 1 else None)
    if r == 1 and t[1] >= t[0]:
        bad.append(f"rank 1: the receive from a busy sender waited for its wait() "
                   f"({t[1] - t[0]:.3f} s after it)")

# who copied: chunks this rank wrote into its peers (as a sender) and read (as a receiver)
wrote = sum(ring.helped for ep in shm.endpoints.values() for ring in ep.tx)
read = sum(ring.helped for ep in shm.endpoints.values() for ring in ep.rx)
every = world.allgather((wrote, read))
helping = any(ring.help_min for ep in shm.endpoints.values() for ring in ep.rx)
if r == 0 and helping:
    if sum(w for w, _ in every) == 0:
        bad.append(f"no sender ever copied a chunk: {every}")
    if sum(rd for _, rd in every) == 0:
        bad.append(f"no receiver ever copied a chunk: {every}")

casekit.verdict(world, comm, chk, f"(cooperative copy {'on' if helping else 'off'}; chunks "
                f"written by senders / read by receivers per rank: {every})")
