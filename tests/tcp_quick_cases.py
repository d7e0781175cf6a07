"""send/recv's quick path to peers on tcp (Communicator._tsend/_trecv: the endpoint's own
send and receive, without a Request or a run) against the general path, under mpiexec:

    GPURT_TRANSPORTS=tcp python tests/tcp_quick_cases.py quick|mixed

``quick``: every rank takes the quick path where it applies; ``mixed``: the odd ranks
take the general path only (their tcp entries dropped from the quick table), so each
connection has a quick end and a general one.  Run on one node with tcp only, or across
nodes (cliques) where a rank's table holds shm peers and tcp peers.  Every rank sends to
its right neighbour and receives from its left one: messages of every size class (empty,
small, larger than the socket buffers: those go in part, the waits write the rest) and
dtype, blocking and non-blocking in several orders, bursts that fill the connection,
receives posted before their message; exact values.  Then progress and errors: a receive
posted early advanced by a wait on another communicator while its sender fills the
connection, a Ctrl-C right after the endpoint's send or receive, a mismatch after the
quick path is warm (dtype, tag, size; blocking and posted early), a timeout on a receive
posted early, test() polling, the flight records.  Rank 0 prints the verdict."""

from __future__ import annotations

import sys
import time

import numpy as np

from casekit import start, verdict

import gpurt
from gpurt.comm import _TcpQuick

MODE = sys.argv[1]
DTYPES = [np.float32, np.int64, np.uint8, np.float64, np.complex64, np.bool_, np.int16]
SIZES = [0, 1, 7, 64, 1000, 4096, 65536, 300_000, 3_000_000]


def payload(src: int, i: int, nbytes: int, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    n = max(0, nbytes // dt.itemsize)
    if dt == np.bool_:
        return (np.arange(n) + src + i) % 3 == 0
    v = (np.arange(n, dtype=np.int64) * 7 + 1000 * src + i) % 251
    return v.astype(dt) + (1j if dt.kind == "c" else 0)


def tcp_peers(c) -> list[int]:
    return [q for q, e in (c._qt or {}).items() if type(e) is _TcpQuick]


class Count:
    """What the quick calls of one communicator answered: done at once (True), a Request
    (in part), or False (the general path)."""

    def __init__(self, c):
        self.done = self.posted = self.general = 0
        for name in ("_tsend", "_trecv"):
            real = getattr(c, name)
            setattr(c, name, self._wrap(real))

    def _wrap(self, real):
        def call(*a):
            res = real(*a)
            if res is True:
                self.done += 1
            elif res is False:
                self.general += 1
            else:
                self.posted += 1
            return res
        return call


world, comm, r, p, chk = start()
if MODE == "mixed" and r % 2:
    for q in tcp_peers(comm):
        del comm._qt[q]
count = Count(comm)
right, left = (r + 1) % p, (r - 1) % p
over_tcp = right in tcp_peers(comm) or left in tcp_peers(comm)
modes = ["block", "irecv-first", "isend-first", "burst"]
i = 0
for rnd in range(4):
    for size in SIZES:
        for mode in modes:
            i += 1
            dt = DTYPES[i % len(DTYPES)]
            x, want = payload(r, i, size, dt), payload(left, i, size, dt)
            got = np.full_like(want, 1) if want.size else np.empty_like(want)
            tag = i % 5
            if mode == "block":
                if r % 2 == 0:
                    comm.send(x, right, tag)
                    comm.recv(got, left, tag)
                else:
                    comm.recv(got, left, tag)
                    comm.send(x, right, tag)
                chk.expect(f"#{i} {mode} {size}B {dt.__name__}", got, want)
            elif mode == "irecv-first":
                a = comm.irecv(got, left, tag)
                b = comm.isend(x, right, tag)
                (b.wait(), a.wait()) if i % 2 else (a.wait(), b.wait())
                chk.expect(f"#{i} {mode} {size}B {dt.__name__}", got, want)
            elif mode == "isend-first":
                b = comm.isend(x, right, tag)
                comm.recv(got, left, tag)
                b.wait()
                chk.expect(f"#{i} {mode} {size}B {dt.__name__}", got, want)
            elif mode == "burst" and size <= 300_000:
                # sends before any receive is posted: past the socket buffers the later
                # ones queue on the connection (their Requests, written by the waits)
                k = 12
                xs = [payload(r, i + j, size, dt) for j in range(k)]
                ws = [payload(left, i + j, size, dt) for j in range(k)]
                gs = [np.empty_like(w) for w in ws]
                sends = [comm.isend(xs[j], right, j) for j in range(k)]
                if i % 2:
                    for j in range(k):
                        comm.recv(gs[j], left, j)
                else:
                    recvs = [comm.irecv(gs[j], left, j) for j in range(k)]
                    for q in reversed(recvs):
                        q.wait()
                for q in sends:
                    q.wait()
                for j in range(k):
                    chk.expect(f"#{i}.{j} {mode} {size}B {dt.__name__}", gs[j], ws[j])

quick_rank = over_tcp and (MODE == "quick" or r % 2 == 0)
posted = world.allreduce(count.posted if quick_rank else 0)
if quick_rank:
    # the quick path carried messages: small ones whole, and (over all ranks) some in part
    # or posted before they came
    chk.count += 1
    if count.done < 150 or posted < 10:
        chk.bad.append(f"rank {r}: the quick tcp path completed {count.done} calls and "
                       f"posted {count.posted} ({posted} on all ranks; general "
                       f"{count.general})")
elif MODE == "mixed" and r % 2:
    chk.count += 1
    if count.done or count.posted:
        chk.bad.append(f"rank {r}: the general-only rank took the quick tcp path")

# flight records of quick calls: done, named as the general path names them
fl = comm.flight
if fl is not None and right in tcp_peers(comm):
    chk.count += 1
    names = {e["algorithm"] for e in fl.records() if e["kind"] == "p2p" and e["state"] == "done"}
    if not any(f"send to rank {right} tag {t}" in names for t in range(5)):
        chk.bad.append(f"rank {r}: no done flight record of a send: {sorted(names)[:5]}")


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except gpurt.GpurtError as e:
        return f"{type(e).__name__}: {e}"


# the cases below are between ranks 0 and 1 where they are tcp peers
pair = p >= 2 and world.allreduce(int(r in (0, 1) and type(comm.endpoints[1 - r]).__name__ ==
                                      "TcpEndpoint" and (1 - r) not in comm.dev_endpoints),
                                  op=__import__("mpi4py").MPI.SUM) == 2

# errors after the quick path is warm: every one on a dup
for case in ("dtype", "tag", "size", "dtype-early") if pair else ():
    c = comm.dup()
    if r in (0, 1):
        for j in range(3):      # warm: the same dtype, quick on both sides
            if r == 0:
                c.send(np.full(4, j, np.float32), 1, 3)
            else:
                g = np.empty(4, np.float32)
                c.recv(g, 0, 3)
                chk.expect(f"warm {case} {j}", g, np.full(4, j, np.float32))
        if r == 0:
            c.send(np.ones(4, np.float32), 1, 3)
        if r == 1:
            if case == "dtype":
                text = outcome(lambda: c.recv(np.empty(4, np.int32), 0, 3))
                want = "float32 x 4 (16 bytes) and the receive int32 x 4"
            elif case == "tag":
                text = outcome(lambda: c.recv(np.empty(4, np.float32), 0, 4))
                want = "tag 3"
            elif case == "size":
                text = outcome(lambda: c.recv(np.empty(5, np.float32), 0, 3))
                want = "rank 0"
            else:
                text = outcome(lambda: c.irecv(np.empty(4, np.int32), 0, 3).wait())
                want = "float32 x 4 (16 bytes) and the receive int32 x 4"
            chk.count += 1
            if not text.startswith("CollectiveMismatchError: rank 1:") or want not in text:
                chk.bad.append(f"rank 1: {case} mismatch: {text}")
            chk.count += 1
            after = outcome(lambda: c.send(np.ones(1), 0))
            if not after.startswith("CommunicatorClosed"):
                chk.bad.append(f"rank 1: after the {case} mismatch: {after}")
    world.Barrier()
    c.abort() if r in (0, 1) else None
    c.close()

# a receive posted early (quick: its Request) is advanced by a wait on another
# communicator (MPI's progress rule): rank 1 sends more than the connection holds, so its
# sends need rank 0 to read while rank 0 waits in c2's barrier
if pair:
    c1, c2 = comm.dup(), comm.dup()
    big = 64 << 10
    nmsg = 40
    if r == 0:
        first = np.zeros(8, np.uint8)
        q = c1.irecv(first, 1)
        text = outcome(lambda: c2.barrier(timeout=30))
        chk.count += 1
        if text != "ok":
            chk.bad.append(f"rank 0: barrier with a receive posted early: {text}")
        q.wait()
        chk.expect("early receive, advanced elsewhere", first, np.full(8, 7, np.uint8))
        for j in range(nmsg):
            g = np.zeros(big, np.uint8)
            c1.recv(g, 1)
            chk.expect(f"after it, #{j}", g, np.full(big, j, np.uint8))
    elif r == 1:
        time.sleep(0.3)                 # (rank 0 is in the barrier by then)
        c1.send(np.full(8, 7, np.uint8), 0)
        for j in range(nmsg):
            c1.send(np.full(big, j, np.uint8), 0)
        text = outcome(lambda: c2.barrier(timeout=30))
        chk.count += 1
        if text != "ok":
            chk.bad.append(f"rank 1: barrier after filling the connection: {text}")
    else:
        c2.barrier(timeout=30)
    world.Barrier()
    c1.close()
    c2.close()


class Interrupting:
    """The endpoint, whose send or receive raises KeyboardInterrupt right after it ran
    (as Python raises a Ctrl-C that came during it)."""

    def __init__(self, ep, side: str):
        self.ep, self.side = ep, side

    def __getattr__(self, name):
        return getattr(self.ep, name)

    def send(self, *a):
        m = self.ep.send(*a)
        if self.side == "send":
            raise KeyboardInterrupt
        return m

    def recv(self, *a, **k):
        m = self.ep.recv(*a, **k)
        if self.side == "recv":
            raise KeyboardInterrupt
        return m


# a Ctrl-C right after the endpoint's send or receive poisons the communicator (as one
# inside any transfer does): the frame went, or the receive was posted, without its Request
for side in ("send", "recv") if pair else ():
    c = comm.dup()
    if r in (0, 1):
        # (a first message each way: the endpoints' look at their peer is fresh, so the
        # send below is quick)
        w = np.zeros(1)
        (c.send(w, 1), c.recv(w, 1)) if r == 0 else (c.recv(w, 0), c.send(w, 0))
        e = c._qt[1 - r]
        e.ep = Interrupting(e.ep, side)
    text = "-"
    if r == 1:
        if side == "send":
            text = outcome(lambda: c.send(np.arange(5), 0))
        else:
            world.Barrier()             # (rank 0 sent meanwhile)
            text = outcome(lambda: c.recv(np.zeros(5, np.int64), 0))
        chk.count += 1
        after = outcome(lambda: c.send(np.ones(1), 0))
        if text != "KeyboardInterrupt" or not after.startswith("CommunicatorClosed"):
            chk.bad.append(f"rank 1: Ctrl-C in a quick tcp {side}: {text}; then {after}")
    elif r == 0:
        if side == "recv":
            c.send(np.arange(5), 1)
            world.Barrier()
    else:
        if side == "recv":
            world.Barrier()
    world.Barrier()
    if r in (0, 1):
        c.abort()
    c.close()

# a receive posted early times out (still in flight), then completes; test() polls one
if pair:
    c = comm.dup()
    if r == 1:
        c.recv(np.empty(2, np.float64), 0, 8)     # (warm)
        q = c.irecv(got := np.empty(3, np.float64), 0, 9)
        text = outcome(lambda: q.wait(timeout=0.3))
        chk.count += 1
        if not text.startswith("CollectiveTimeout: rank 1: recv from rank 0 (tag 9) did not "
                               "complete within 0.3 s; still waiting for rank(s) [0]"):
            chk.bad.append(f"rank 1: early receive's timeout: {text}")
        world.send(None, 0)
        q.wait()
        chk.expect("after the timeout", got, np.arange(3.0))
        q2 = c.irecv(got2 := np.empty(3, np.float64), 0, 10)
        world.send(None, 0)
        while not q2.test():
            pass
        chk.expect("polled", got2, np.arange(3.0) + 1)
    elif r == 0:
        c.send(np.zeros(2), 1, 8)
        world.recv(source=1)
        c.send(np.arange(3.0), 1, 9)
        world.recv(source=1)
        c.send(np.arange(3.0) + 1, 1, 10)
    world.Barrier()
    c.close()
verdict(world, comm, chk, f"({MODE})")
