"""send/recv's quick path (Communicator._qsend/_qrecv, executor.QuickRecv: the compiled
shm ring end, _fastboard.P2PRing) against the ring's Python protocol, under mpiexec:

    python tests/quick_p2p_cases.py quick|mixed

``quick``: every rank takes the quick path where it applies; ``mixed``: the odd ranks
take the Python protocol only (their quick table emptied), so each ring has a compiled
end and a Python end.  Every rank sends to its right neighbour and receives from its left
one: a stream of messages of every size class (empty, one slot, several slots, single
copy) and dtype, blocking and non-blocking in several orders, bursts that fill the ring
(a message of several slots then goes partly compiled, partly through the waits),
receives posted before their message, shared arrays; exact values (run with
GPURT_SHM_CMA=0 too, where messages of every size are the compiled ends').  Then
progress and errors: a receive posted early advanced by a wait on another
communicator, a Ctrl-C right after a compiled call, a mismatch after the quick path is
warm (dtype, tag, size; blocking and posted early), a timeout on a receive posted early,
test() polling.  Rank 0 prints the verdict."""

from __future__ import annotations

import sys

import numpy as np

from casekit import Checks, start, verdict

import gpurt

MODE = sys.argv[1]
DTYPES = [np.float32, np.int64, np.uint8, np.float64, np.complex64, np.bool_, np.int16]
# bytes (about): one slot (256 KiB) or less, then several slots (quick too, below the
# single-copy threshold: 4 MiB with 2 ranks here, 128 KiB with more ranks than cores;
# every size with GPURT_SHM_CMA=0), then single copy
SIZES = [0, 1, 7, 64, 1000, 4096, 16384, 60000, 200_000, 262_144, 300_000, 2_000_000]


class Counting:
    """A P2PRing's stand-in that counts the calls that moved chunks (put/get answers > 0),
    those of messages larger than a slot, those that moved only part of one, and the
    single-copy messages posted (put_addr) and read (get, seen on ``reads``)."""

    def __init__(self, ring, pyring, word: int):
        self.ring, self.slot, self.moved, self.multi, self.part = ring, pyring.slot, 0, 0, 0
        self.q, self.word = pyring.seg.q, word      # this end's counter in the segment
        self.posted = self.read = 0

    @property
    def reads(self) -> int:
        return self.ring.reads

    def _count(self, c: int, nbytes: int, off: int, before: int) -> None:
        if c > 0:
            self.moved += 1
            self.multi += nbytes > self.slot
            self.part += off + (c - before) * self.slot < nbytes

    def put(self, x, nbytes, tag, sig, off):
        before = int(self.q[self.word])
        c = self.ring.put(x, nbytes, tag, sig, off)
        self._count(c, nbytes, off, before)
        return c

    def put_addr(self, x, nbytes, tag, sig):
        c = self.ring.put_addr(x, nbytes, tag, sig)
        self.posted += c > 0
        return c

    def get(self, out, nbytes, tag, sig, spin, off, remote=True):
        before, reads = int(self.q[self.word]), self.ring.reads
        c = self.ring.get(out, nbytes, tag, sig, spin, off, remote)
        if self.ring.reads != reads:
            self.read += 1
            if c != before + 1 or not remote:
                raise AssertionError(f"a single-copy read answered {c} after {before} "
                                     f"(remote={remote})")
        else:
            self._count(c, nbytes, off, before)
        return c


def spy(comm) -> list[Counting]:
    spies = []
    for peer, e in list(comm._qt.items()):
        e.txf, e.rxf = Counting(e.txf, e.tx, e.tx.head_i), Counting(e.rxf, e.rx, e.rx.tail_i)
        spies += [e.txf, e.rxf]
    return spies


def payload(src: int, i: int, nbytes: int, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    n = max(0, nbytes // dt.itemsize)
    if dt == np.bool_:
        return (np.arange(n) + src + i) % 3 == 0
    v = (np.arange(n, dtype=np.int64) * 7 + 1000 * src + i) % 251
    return v.astype(dt) + (1j if dt.kind == "c" else 0)


world, comm, r, p, chk = start()
if MODE == "python" or MODE == "mixed" and r % 2:
    comm._qt = {}
spies = spy(comm) if comm._qt else []
right, left = (r + 1) % p, (r - 1) % p
modes = ["block", "irecv-first", "isend-first", "burst", "early-then-late"]
sent_tags = []
i = 0
for rnd in range(6):
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
            elif mode == "burst" and (size <= 16384 or size > 262_144):
                # more messages (or chunks) than the ring has slots: the later ones queue
                # behind, a large one partly written by the compiled end, the rest by
                # the waits
                k = 12 if size <= 16384 else 3
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
            elif mode == "early-then-late":
                # a small receive posted early (quick), a large one queued behind it on
                # the same ring, the sends in order; waited in the opposite order
                small_w = payload(left, i, 64, np.float32)
                small = np.empty_like(small_w)
                big_w = payload(left, i + 1, 300_000, np.float64)
                big = np.empty_like(big_w)
                a = comm.irecv(small, left, 11)
                b = comm.irecv(big, left, 12)
                s1 = comm.isend(payload(r, i, 64, np.float32), right, 11)
                s2 = comm.isend(payload(r, i + 1, 300_000, np.float64), right, 12)
                b.wait()
                while not a.test():
                    pass
                s1.wait()
                s2.wait()
                chk.expect(f"#{i} {mode} small", small, small_w)
                chk.expect(f"#{i} {mode} big", big, big_w)

# shared arrays (comm.empty) of at least the mapping's threshold take the general path (a
# single copy through a mapping of the sender's memory): exact, whatever the destination
for j, n in enumerate((1000, 40_000, 65_536, 100_000)):
    for dest in ("numpy", "shared"):
        x = comm.empty(n, np.float32)
        x[:] = payload(r, j, 4 * n, np.float32)
        got = comm.empty(n, np.float32) if dest == "shared" else np.empty(n, np.float32)
        q = comm.irecv(got, left, 7)
        tx = comm._qt[right].txf if comm._qt else None
        before = tx.moved if tx is not None else 0
        comm.send(x, right, 7)
        if tx is not None and n == 65_536 and comm._qt[right].map_min <= 4 * n:
            chk.count += 1      # one slot, but from a shared array: read through a mapping
            if tx.moved != before:
                chk.bad.append(f"rank {r}: a shared array's {4 * n} B went the quick way")
        q.wait()
        chk.expect(f"shared {4 * n}B into {dest}", got, payload(left, j, 4 * n, np.float32))
        del x, got

moved = sum(s.moved for s in spies)
if MODE == "quick" or r % 2 == 0:
    # the quick path carried messages (both ends of each ring here, or this end)
    chk.count += 1
    if moved < 200:
        chk.bad.append(f"rank {r}: the quick path moved only {moved} messages")
    # ... and, below the single-copy threshold, messages of several slots, some of them
    # only partly (the rest through the Python protocol, or a later compiled read)
    e = comm._qt.get(right) if comm._qt else None
    if e is not None and e.lim > 300_000:
        multi, part = sum(s.multi for s in spies), sum(s.part for s in spies)
        chk.count += 1
        if multi < 20 or part < 2:
            chk.bad.append(f"rank {r}: the quick path moved {multi} messages of several "
                           f"slots, {part} of them in part")
    # ... and from the point-to-point single-copy threshold on (128 KiB here by default),
    # single-copy messages: posted by this end's compiled sends, and read by its compiled
    # receives (in ``mixed`` from the Python ends' sends too: the same header)
    if e is not None and e.lim < 200_000:
        posted, read = sum(s.posted for s in spies), sum(s.read for s in spies)
        chk.count += 1
        if posted < 40 or read < 20:
            chk.bad.append(f"rank {r}: the quick path posted {posted} single-copy messages "
                           f"and read {read}")
else:
    chk.count += 1
    if spies:
        chk.bad.append(f"rank {r}: the Python-only rank has a quick table")

# flight records of quick calls: done, named as the general path names them
fl = comm.flight
if fl is not None:
    chk.count += 1
    names = {e["algorithm"] for e in fl.records() if e["kind"] == "p2p" and e["state"] == "done"}
    if f"send to rank {right} tag 0" not in names and f"send to rank {right} tag 1" \
            not in names:
        chk.bad.append(f"rank {r}: no done flight record of a send: {sorted(names)[:5]}")


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except gpurt.GpurtError as e:
        return f"{type(e).__name__}: {e}"


# errors after the quick path is warm: every one on a dup, between ranks 0 and 1
for case in ("dtype", "tag", "size", "dtype-early"):
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
                want = "tag 3 but the message is float32 x 4 (16 bytes) and the receive int32 x 4"
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

# a receive posted early is advanced by a wait on another communicator (MPI's progress
# rule): rank 1 fills the ring past its slots, so its last send needs rank 0's receive
# to move while rank 0 waits in c2's barrier (it hung until both timed out: the quick
# post did not mark the engine as this thread's)
c1, c2 = comm.dup(), comm.dup()
if r in (0, 1):
    nslots = c1.endpoints[1 - r].tx[1].nslots
    if r == 0:
        first = np.zeros(8, np.uint8)
        q = c1.irecv(first, 1)
        text = outcome(lambda: c2.barrier(timeout=20))
        chk.count += 1
        if text != "ok":
            chk.bad.append(f"rank 0: barrier with a receive posted early: {text}")
        q.wait()
        chk.expect("early receive, advanced elsewhere", first, np.full(8, 0, np.uint8))
        for j in range(1, nslots + 1):
            g = np.zeros(8, np.uint8)
            c1.recv(g, 1)
            chk.expect(f"after it, #{j}", g, np.full(8, j, np.uint8))
    else:
        import time
        time.sleep(0.3)                 # (rank 0 is in the barrier by then)
        for j in range(nslots + 1):
            c1.send(np.full(8, j, np.uint8), 0)
        text = outcome(lambda: c2.barrier(timeout=20))
        chk.count += 1
        if text != "ok":
            chk.bad.append(f"rank 1: barrier after filling the ring: {text}")
else:
    c2.barrier(timeout=20)
world.Barrier()
c1.close()
c2.close()


class Interrupting:
    """A ring end that raises KeyboardInterrupt right after a call that moved a message,
    as Python raises a Ctrl-C that came during the compiled call."""

    def __init__(self, ring):
        self.ring = ring

    @property
    def reads(self) -> int:
        return self.ring.reads

    def put(self, *a):
        c = self.ring.put(*a)
        if c > 0:
            raise KeyboardInterrupt
        return c

    def put_addr(self, *a):
        c = self.ring.put_addr(*a)
        if c > 0:
            raise KeyboardInterrupt
        return c

    def get(self, *a):
        c = self.ring.get(*a)
        if c > 0:
            raise KeyboardInterrupt
        return c


# a Ctrl-C right after the compiled end moved a message poisons the communicator (as one
# inside any transfer does): it delivered the message twice before
def interrupted(fn) -> str:
    try:
        fn()
        return "ok"
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except gpurt.GpurtError as exc:
        return f"{type(exc).__name__}: {exc}"


for side, n in [(s, n) for n in (2, 40_000) for s in ("recv", "send", "wait")]:
    # (40000 int64: 320 KB, a single-copy message where the threshold is 128 KiB)
    c = comm.dup()
    armed = r in (0, 1) and bool(c._qt)
    if armed:
        # (only the end under test: an interrupted sender revokes a single-copy message,
        # which its receiver then must not read)
        e = c._qt[1 - r]
        if side == "send":
            e.txf = Interrupting(e.txf)
        else:
            e.rxf = Interrupting(e.rxf)
    text = "-"
    if armed and r == 0:
        q = c.irecv(np.zeros(n, np.int64), 1) if side == "wait" else None
        world.Barrier()
        if side != "send":
            world.Barrier()             # (rank 1 sent meanwhile)
        text = interrupted(q.wait if q is not None else
                           lambda: c.recv(np.zeros(n, np.int64), 1))
        if side == "send":
            world.Barrier()
    elif armed and r == 1:
        world.Barrier()
        import time
        c.endpoints[0]._process().state(time.monotonic())   # (fresh: the send is quick)
        if side == "send":
            text = interrupted(lambda: c.send(np.arange(n), 0))
            world.Barrier()
        else:   # (a single-copy send completes once read: rank 0 reads after the barrier)
            sent = c.isend(src := np.arange(n), 0)
            world.Barrier()
            text = interrupted(sent.wait)
    else:
        world.Barrier()
        world.Barrier()
    if armed and (r == 1) == (side == "send"):
        chk.count += 1
        after = interrupted(lambda: c.send(np.ones(1), 1 - r))
        if text != "KeyboardInterrupt" or not after.startswith("CommunicatorClosed"):
            chk.bad.append(f"rank {r}: Ctrl-C in a quick {side} of {8 * n} B: {text}; "
                           f"then {after}")
    world.Barrier()
    if r in (0, 1):
        c.abort()
    c.close()

# a receive posted early times out (still in flight), then completes
c = comm.dup()
if p >= 2 and r in (0, 1):
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
    else:
        c.send(np.zeros(2), 1, 8)
        world.recv(source=1)
        c.send(np.arange(3.0), 1, 9)
        world.recv(source=1)
        c.send(np.arange(3.0) + 1, 1, 10)
world.Barrier()
c.close()
verdict(world, comm, chk, f"({MODE})")
