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

from casekit import (ended, flight_names_a_send, p2p_early_timeout, p2p_exchange,
                     p2p_mismatches, p2p_progress_rule, p2p_sweep, payload, start,
                     verdict)


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


world, comm, r, p, chk = start()
if MODE == "python" or MODE == "mixed" and r % 2:
    comm._qt = {}
spies = spy(comm) if comm._qt else []
right, left = (r + 1) % p, (r - 1) % p
for i, size, dt, mode in p2p_sweep(6, SIZES, DTYPES, ["block", "irecv-first", "isend-first",
                                                     "burst", "early-then-late"]):
    if mode != "early-then-late":
        # (burst: more messages (or chunks) than the ring has slots: the later ones
        # queue behind, a large one partly written by the compiled end, the rest
        # by the waits)
        if mode != "burst" or size <= 16384 or size > 262_144:
            p2p_exchange(comm, chk, i, size, dt, mode, 12 if size <= 16384 else 3)
    else:
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
flight_names_a_send(comm, chk, right)

# errors after the quick path is warm: every one on a dup, between ranks 0 and 1
p2p_mismatches(world, comm, chk)

# a receive posted early is advanced by a wait on another communicator (MPI's progress
# rule): rank 1 fills the ring past its slots, so its last send needs rank 0's receive
# to move while rank 0 waits in c2's barrier (it hung until both timed out: the quick
# post did not mark the engine as this thread's)
p2p_progress_rule(world, comm, chk,
                  [8] * (comm.endpoints[1 - r].tx[1].nslots + 1 if r in (0, 1) else 1))


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
        text = ended(q.wait if q is not None else
                           lambda: c.recv(np.zeros(n, np.int64), 1))
        if side == "send":
            world.Barrier()
    elif armed and r == 1:
        world.Barrier()
        import time
        c.endpoints[0]._process().state(time.monotonic())   # (fresh: the send is quick)
        if side == "send":
            text = ended(lambda: c.send(np.arange(n), 0))
            world.Barrier()
        else:   # (a single-copy send completes once read: rank 0 reads after the barrier)
            sent = c.isend(src := np.arange(n), 0)
            world.Barrier()
            text = ended(sent.wait)
    else:
        world.Barrier()
        world.Barrier()
    if armed and (r == 1) == (side == "send"):
        chk.count += 1
        after = ended(lambda: c.send(np.ones(1), 1 - r))
        if not text.startswith("KeyboardInterrupt") or not after.startswith("CommunicatorClosed"):
            chk.bad.append(f"rank {r}: Ctrl-C in a quick {side} of {8 * n} B: {text}; "
                           f"then {after}")
    world.Barrier()
    if r in (0, 1):
        c.abort()
    c.close()

# a receive posted early times out (still in flight), then completes
if p >= 2:
    p2p_early_timeout(world, comm, chk)
verdict(world, comm, chk, f"({MODE})")
