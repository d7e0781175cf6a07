"""``shm_direct``: a large collective on one node as plain loads and stores into every
rank's own buffers — each byte read once and written once.

Why
---
A schedule over point-to-point messages moves more bytes than the collective needs: a
2-rank Rabenseifner allreduce reads and writes 2.5·S per rank even when every message is
single-copy, because the reduced half has to travel to the peer as a message before the
peer copies it into place.  When a rank can address its peers' buffers directly, the
minimum (docs/bench.md, "minimum traffic") is reachable: rank r reduces block r of every
input and writes the result straight into block r of every output — 2·S per rank.

Access to a peer's buffer
-------------------------
- an array from ``gpurt.empty``/``zeros`` (``comm.empty``) is mapped here through
  ``/proc/<pid>/fd`` (``gpurt.sharedmem.PeerMaps``, cached): ordinary loads, stores and
  NumPy reductions straight on the peer's memory;
- any other host array is reached with CMA (``process_vm_readv``/``writev``), chunk by
  chunk through a small scratch, where the node's probe allows it.

Protocol (call number ``seq``; one node, every rank on the shm board)
--------------------------------------------------------------------
1. A header round on the board (``BoardRun(check=True)``): the agreement check — a
   mismatch raises on every rank before any byte moves — whose headers also carry each
   rank's buffer locations (shared-array file and offset, or address).
2. Every rank decides from the same headers, hence identically, whether every buffer the
   collective touches is reachable; if not, all ranks run the tuner's schedule instead.
3. Each rank opens what it needs (mappings may fail: file descriptors, memory) and stores
   ``ready = 2·seq + failed`` in its board control line; all wait for all, and any failure
   sends every rank to the schedule.  The wait stays even where nothing is mapped (every
   buffer by CMA, nothing can fail to open): it is also what keeps a peer out of this
   rank's buffers while this rank can still fail in the header round and return — only
   from READY on does ``Access.drain`` hold a failing rank until its peers are out.
   (Skipping it saved ~8 % at 1 MiB on 4 ranks; a review found that window, so it was
   reverted.)
4. Each rank does its share (below), then stores ``finished = seq``; a rank returns only
   when every rank has finished, since peers write into its output and read its input.

Shares (p ranks, blocks of the element range split evenly on 4 KiB boundaries):

| collective | rank r | reads / writes per rank |
|---|---|---|
| allreduce | reduces block r of every input, writes it into every output | S / S |
| reduce | reduces block r of every input into the root's output | S / S/p |
| reduce_scatter | reduces its block of every input into its output | S / S/p |
| allgather | writes its input into every output | S/p / S |
| alltoall | copies its block of every input into its output | S / S |
| broadcast | copies block r of the root's buffer into every other output | S/p / (p−1)S/p |

Reductions are done in rank order by the one rank that owns the block, so every rank holds
the same bits.  Large transfers write with non-temporal stores (``gpurt.memcopy``).

Staged allreduce (``shm_staged``)
---------------------------------
An allreduce on ordinary arrays (no ``comm.empty`` one on this rank) that fits the board's
staging room (``Board.stage``, ``GPURT_SHM_STAGE``) rides the header round with its input
(``BoardRun(stage=x)``; header word 0 bit 1).  If every rank's header says so, steps 3–4
become ``_staged_allreduce``: reduce block r of every board buffer into the own output,
copy it back over block r of the own board buffer, store ``_REDUCED = seq``, wait for all,
copy the other blocks out, then store the board's ``done``.  No rank touches another's
arrays, so there is no READY wait and nothing to drain; a rank that did not stage (its
arrays are shared) sends everyone down the path above.

On the inline path (a blocking allreduce on NumPy arrays) the whole round is compiled:
``gpurt._fastboard``'s ``staged`` publishes the same header, reduces with the board's
kernels and copies the same blocks, without the GIL.  Where it gives up waiting (a late
peer: about 1 ms plus 1 ns a byte) or finds anything but every rank staging the same
call, it returns the phase it reached and this ``DirectRun`` goes on from there
(``phase`` 1 of the header round, or 7), under the executor's deadlines and liveness
checks; ranks on either path interoperate, word for word.

Compiled shares by CMA
----------------------
On the inline path, a call on ordinary arrays that does not stage, and whose every peer
buffer would be reached by CMA, runs steps 1–4 in C (``_fastboard``'s ``direct``, GIL
released): the same header words, the same checks, READY, the share (copies and
``process_vm_readv``/``writev`` in 2 MiB pieces, reductions through 256 KiB of scratch
with the board's kernels, the peers' error records checked between pieces), FINISHED.
Anything else — a header that is not the same call, a peer's shared array or staged
header, a peer late at READY or FINISHED, a peer's error, a failed transfer — returns
the phase reached, and ``DirectRun.resume`` (or the header round's phase 1) goes on.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

import logging
import os
import threading
import time

from gpurt import memcopy, sharedmem
from gpurt.errors import (CommunicatorClosed, GpurtError, TransportError, from_peer,
                          relayed_rank)
from gpurt.tuner import collective_bytes  # noqa: F401 - S as nccl-tests counts it (also for comm)

from . import cma
from .shm import CLOSED, _pid_alive
from .shm_board import _EXTRA as _HDR_EXTRA, BoardRun

log = logging.getLogger("gpurt.shm_direct")


COLLS = ("allreduce", "reduce", "reduce_scatter", "allgather", "alltoall", "broadcast")
NAME = "shm_direct"
_K, _M = 1 << 10, 1 << 20
# GPURT_SHM_DIRECT=auto / GPURT_SHM_DIRECT_CMA=auto: the least S (bytes) per collective
# from which it beat the tuner's schedule here, on comm.empty arrays / on NumPy arrays
# (A/B runs at 320 KiB, 512 KiB, 1, 4 and 16 MiB with 2 and 4 ranks,
# docs/performance.md): from just above the board (256 KiB) — except a reduce on
# comm.empty arrays (2 ranks, 512 KiB: 158 against the binomial tree's 128 µs) and a
# broadcast on them (2 ranks, 4 MiB: the schedule's cooperative single copy).  On NumPy
# arrays the compiled shares (~15 µs of fixed cost) beat every schedule from 64 KiB; the
# board still runs a call where the tuner picks it (2 ranks, alltoall 128 KiB: the
# "direct" schedule 140 µs, the compiled shares 24 µs; reduce_scatter 121 against 27)
AUTO_MAP = {"allreduce": 256 * _K, "reduce": 1 * _M, "reduce_scatter": 256 * _K,
            "allgather": 256 * _K, "alltoall": 256 * _K, "broadcast": 4 * _M}
AUTO_CMA = {c: 64 * _K for c in ("allreduce", "reduce", "reduce_scatter", "allgather",
                                 "alltoall", "broadcast")}


def thresholds(setting, auto: dict) -> dict:
    """Per collective, the least S for shm_direct from a GPURT_SHM_DIRECT* value (0: off)."""
    if setting == "auto":
        return dict(auto)
    return {c: int(setting) for c in COLLS}
CHUNK = 512 << 10          # bytes per step of a share (stays in the core's L2)
# alltoall's pieces: each byte is read once and written once, so nothing is gained by
# staying in the cache, and fewer pieces are fewer Python calls (2 ranks, 16 MiB, in one
# launch: 1803 against 2005 µs on comm.empty arrays, 1740 against 1876 on NumPy's; an
# allgather, which writes each piece to every output, was slower with them: 1655
# against 1422)
COPY_PIECE = 8 << 20
_ALIGN = 4096
# board control-line words (flag and done are 0 and 1); _REDUCED: a staged call's
# reduced block is in the rank's board buffer
_READY, _FINISHED, _REDUCED = 2, 3, 4
# what the compiled round (_fastboard: staged, direct) returns, past DONE (0), PUBLISHED
# (1), NOTHING (2) and REDUCED (4); the low byte (D_STOPPED, D_CMAFAIL carry more)
D_READY, D_FINISHED, D_STOPPED, D_CMAFAIL, D_CLOSED = 5, 6, 7, 8, 9
STAGED = "shm_staged"      # what a staged call reports as its algorithm
_U8 = np.dtype(np.uint8)

# which ranks' "in"/"out" a collective touches: "all", "own" or "root"
_NEEDS = {
    "allreduce": ("all", "all"),
    "reduce": ("all", "root"),
    "reduce_scatter": ("all", "own"),
    "allgather": ("own", "all"),
    "alltoall": ("all", "own"),
    "broadcast": ("none", "all"),       # in place: the root's "out" is its input
}


def blocks(count: int, p: int, isz: int) -> list[tuple[int, int]]:
    """``p`` element ranges covering ``count``, split on 4 KiB boundaries where possible."""
    unit = max(1, _ALIGN // isz)
    units = -(-count // unit)
    out = []
    for k in range(p):
        lo, hi = units * k // p * unit, units * (k + 1) // p * unit
        out.append((min(lo, count), min(hi, count)))
    return out


class Access:
    """How this rank reaches the buffers of the one node's ranks (from the shm transport):
    ``pids[k]``, ``maps[k]`` (``PeerMaps`` or None) by local rank."""

    def __init__(self, me: int, pids: list[int], maps: list, can_map: bool, can_cma: bool,
                 ranks: list[int], seg=None):
        self.me, self.pids, self.maps = me, pids, maps
        self.can_map, self.can_cma, self.ranks = can_map, can_cma, ranks
        self._scratch = np.empty(0, np.uint8)
        # the segment's error records (a rank going down writes one before its caller gets
        # its buffers back): a share stops as soon as a peer's is set
        self.seg = seg
        self.err_i = [seg.err_off(k) // 8 for k in range(len(pids))] if seg is not None \
            else []
        self.active: "DirectRun | None" = None     # the call between READY and the end
        # abort() or close() from another thread is under way: a call that has not stored
        # READY stops there (``Stopped``), as the compiled round does (D_CLOSED), and a
        # share at its next piece (``stop_if_failed``)
        self.stopping = False
        self._draining = threading.RLock()
        self._pid = os.getpid()
        # tests only: this rank fails to open its peers' buffers (stands in for a mapping
        # that cannot be made: no file descriptor or address space left)
        self.fail_open = os.environ.get("GPURT_TEST_DIRECT_OPEN_FAIL") == str(me)

    def scratch(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]

    def stop_if_failed(self) -> None:
        """PeerFailure if a peer has published an error (it is going down, and may already
        have its buffers back): no more loads or stores into its memory.  ``Stopped`` if
        another thread is aborting or closing this rank's communicator: it tells the peers
        once this share has stopped storing into their buffers."""
        if self.stopping:
            raise Stopped(f"rank {self.ranks[self.me]}: stopped during shm_direct: the "
                          f"communicator is being aborted or closed by another thread")
        seg = self.seg
        if seg is None:
            return
        q = seg.q
        for k, i in enumerate(self.err_i):
            if k != self.me and q[i] and not q[i] & CLOSED:     # (a close notice: see
                raise self.failure(k)                          # ShmEndpoint.check)

    def failure(self, k: int) -> GpurtError:
        """The error for local rank k, which has published its error record."""
        text = self.seg.read_error(k)
        return from_peer(text, f"rank {self.ranks[self.me]}: rank {self.ranks[k]} failed "
                         f"during shm_direct: {text}", relayed_rank(text, self.ranks[k]))

    def drain(self, bound: float = 5.0) -> None:
        """This rank is going down (its error is published) in the middle of a call:
        before its caller gets the buffers back, wait — boundedly — until every live peer
        has finished its share or stopped (published its own error), since peers load
        from and store into this rank's buffers until then."""
        if os.getpid() != self._pid:   # a forked child: the calls are its parent's
            self.active = None
            return
        # a second thread's drain waits for the first's (re-entered from the same thread —
        # a signal handler's close() — it finds nothing left to drain); bounded
        if not self._draining.acquire(timeout=bound + 1.0):
            log.warning("shm_direct: another thread's drain did not end in %g s", bound + 1.0)
            return
        try:
            self._drain(bound)
        finally:
            self._draining.release()

    def _drain(self, bound: float) -> None:
        run, self.active = self.active, None
        if run is None or run.phase not in (2, 3) or self.seg is None:
            return
        q, ctrl, seq = run.board.q, run.board.ctrl, run.seq
        if q[ctrl[run.r] + _READY] < 2 * seq:     # (READY not stored: nobody came in)
            return
        deadline = time.monotonic() + bound
        while True:
            late = [k for k in range(run.p) if k != run.r and q[ctrl[k] + _FINISHED] < seq
                    and not q[self.err_i[k]] and _pid_alive(self.pids[k])]
            if not late:
                return
            if time.monotonic() > deadline:
                log.warning("shm_direct: rank(s) %s still in call #%d after %g s; their loads "
                            "and stores into this rank's buffers may still come",
                            [self.ranks[k] for k in late], seq, bound)
                return
            time.sleep(1e-4)


class Stopped(CommunicatorClosed):
    """A call stopped before READY because its communicator is being closed (no peer was
    let into this rank's buffers); the communicator turns it into its own error."""


class Pending:
    """``Access.active`` while the compiled round (``_fastboard``'s ``direct``) runs and
    until ``DirectRun.resume`` takes over: a failure in that window (a signal's exception
    raised right after the round returned) drains like one in phase 2 — once the round
    has stored READY, peers may be in this rank's buffers."""

    __slots__ = ("board", "seq", "p", "r", "phase")

    def __init__(self, board, seq: int):
        self.board, self.seq, self.p, self.r, self.phase = board, seq, board.nlocal, \
            board.me, 2


class _Buf:
    """One rank's buffer as seen from here: a byte array (ours, or a peer's mapped), or a
    CMA address in process ``pid``."""

    __slots__ = ("arr", "pid", "addr", "peer")

    def __init__(self, arr: np.ndarray | None, pid: int = 0, addr: int = 0, peer: int = -1):
        self.arr, self.pid, self.addr, self.peer = arr, pid, addr, peer

    def read(self, lo: int, nb: int, tmp: np.ndarray) -> np.ndarray:
        """Bytes [lo, lo + nb): a view where it is addressable, else copied into ``tmp``."""
        if self.arr is not None:
            return self.arr[lo:lo + nb]
        cma.copy(self.pid, cma.address(tmp), self.addr + lo, nb, False, self.peer)
        return tmp[:nb]

    def write(self, lo: int, src: np.ndarray, hint: int) -> None:
        nb = src.nbytes
        if self.arr is not None:
            memcopy.copyto(self.arr[lo:lo + nb], src, hint)
        else:
            cma.copy(self.pid, cma.address(src), self.addr + lo, nb, True, self.peer)


def stages(board, coll: str, n: int, isz: int, mins: tuple[int, int, int]) -> bool:
    """Whether a call of this shape stages (``shm_staged``) when neither of its arrays is a
    shared one: an allreduce that fits the board's staging room, from ``mins[2]`` bytes.
    (The compiled round, ``gpurt._fastboard``'s ``staged``, is used under the same rule.)"""
    return coll == "allreduce" and 0 < n * isz <= board.stage and \
        collective_bytes(coll, board.nlocal, n, isz) >= mins[2]


def where(a: np.ndarray | None) -> tuple[int, int, int]:
    """(location word, offset, address): (0, 0, address) for an array that is not in a
    shared one, zeros for none."""
    if a is None or not a.nbytes:
        return 0, 0, 0
    addr = cma.address(a)
    loc = sharedmem.lookup(addr, a.nbytes)
    return (loc[0], loc[1], addr) if loc is not None else (0, 0, addr)


class DirectRun:
    """One collective by ``shm_direct``, with the tuner's schedule (``fallback``) where a
    buffer is out of reach; ``advance`` never blocks (the executor's protocol)."""

    __slots__ = ("board", "acc", "coll", "seq", "x", "out", "root", "red", "n", "isz",
                 "hdr", "phase", "other", "fallback", "mins", "bufs", "on_choice", "p",
                 "r", "staging", "failed")

    def __init__(self, board, access: Access, coll: str, seq: int, sig: int, meta: tuple,
                 x: np.ndarray, out: np.ndarray, root: int, red: Callable | None, n: int,
                 site: int, fallback: Callable, mins: tuple[int, int, int],
                 on_choice: Callable[[str], None] | None = None, forced: bool = False):
        self.board, self.acc, self.coll, self.seq = board, access, coll, seq
        self.x, self.out, self.root, self.red, self.n = x, out, root, red, n
        self.isz = (out if out.nbytes else x).dtype.itemsize
        self.p, self.r = board.nlocal, board.me
        # the least S for a call whose buffers are shared arrays / reached by CMA / staged
        self.fallback, self.mins, self.on_choice = fallback, mins, on_choice
        empty = np.empty(0, np.uint8)
        wx, wo = where(x), where(out)
        # an allreduce on ordinary arrays that fits the board's buffers: the input rides
        # with the header (staged); if every rank staged, no rank touches another's arrays
        self.staging = stages(board, coll, n, self.isz, mins) and not wx[0] and not wo[0]
        self.hdr = BoardRun(board, coll, seq, sig, meta, empty, empty, root, None, n,
                            check=True, site=site,
                            extra=(4 * seq + 2 * self.staging + forced,) + wx + wo,
                            stage=x.reshape(-1).view(_U8) if self.staging else None)
        self.phase, self.other, self.bufs = 0, None, None
        self.failed: BaseException | None = None    # (resume: raised by advance)

    def resume(self, code: int) -> None:
        """Go on from where the compiled round (``gpurt._fastboard``'s ``direct``, the same
        protocol) stopped once the headers had agreed and READY was stored: ``code`` is
        what it returned — D_READY (a peer not READY yet: phase 2), D_FINISHED (this
        rank's share is done: phase 3), or a failure in the share (D_STOPPED: a peer
        published its error; D_CMAFAIL: a transfer failed), which the next ``advance``
        raises with this run active, so that ``Access.drain`` holds this rank's buffers
        until its peers are out of them."""
        bd, hdr = self.board, self.hdr
        q, m = bd.q, len(hdr.extra)
        # the peers' header words are still there: a peer reuses its buffer seq % 2 only
        # two calls later, which needs this rank in the next one
        hdr.got = [hdr.extra if k == self.r else
                   tuple(q[bd.hdr[k][hdr.b] + _HDR_EXTRA + i] for i in range(m))
                   for k in range(self.p)]
        hdr.phase = 2
        self.bufs = self._open()        # (every buffer by CMA: nothing to fail)
        self.acc.active = self
        kind = code & 0xFF
        if kind == D_READY:
            self.phase = 2
            return
        if self.on_choice is not None:
            self.on_choice(NAME)
        self.phase = 3
        if kind == D_STOPPED:
            self.failed = self.acc.failure((code >> 8) & 0xFFF)
        elif kind == D_CMAFAIL:
            k = (code >> 8) & 0xFFF
            self.failed = cma.failure(code >> 21, self.acc.pids[k], self.acc.ranks[k],
                                      bool(code >> 20 & 1))
        elif kind != D_FINISHED:
            raise ValueError(f"DirectRun.resume: unknown code {code}")

    @property
    def done(self) -> bool:
        return self.phase == 4 or (self.phase == 5 and (self.other is None or
                                                        self.other.done))

    def waiting_on(self) -> list[int]:
        if self.phase == 0:
            return self.hdr.waiting_on()
        if self.phase == 7:
            q, ctrl = self.board.q, self.board.ctrl
            return [k for k in range(self.p) if k != self.r and
                    q[ctrl[k] + _REDUCED] < self.seq]
        if self.phase == 5:
            return self.other.waiting_on() if self.other is not None else []
        q, ctrl = self.board.q, self.board.ctrl
        if self.phase == 2:
            return [k for k in range(self.p) if k != self.r and
                    q[ctrl[k] + _READY] < 2 * self.seq]
        return [k for k in range(self.p) if k != self.r and q[ctrl[k] + _FINISHED] < self.seq]

    def _to_fallback(self) -> bool:
        self.phase = 5
        if self.on_choice is not None:
            self.on_choice("")
        self.other = self.fallback()
        return True if self.other is None else (self.other.advance() or True)

    def advance(self) -> bool:
        if self.failed is not None:
            raise self.failed
        if self.phase == 5:
            return self.other.advance() if self.other is not None else False
        moved = False
        if self.phase in (6, 7):
            return _staged_allreduce(self)
        if self.phase == 0:
            if self.acc.stopping:
                raise Stopped(f"rank {self.acc.ranks[self.r]}: communicator aborted or closed "
                              f"during call #{self.seq}, before its peers were let in")
            moved = self.hdr.advance()
            if not self.hdr.done:
                return moved
            if self.staging:
                if all(w[0] & 2 for w in self.hdr.got):
                    if self.on_choice is not None:
                        self.on_choice(STAGED)
                    self.phase = 6
                    return _staged_allreduce(self) or True
                self.hdr.release()    # (not every rank staged: the staged bytes go unread)
            if not self._reachable():
                return self._to_fallback()
            q, ctrl = self.board.q, self.board.ctrl
            failed = 0
            try:
                self.bufs = self._open()
            except TransportError:
                failed = 1        # (a mapping we could not make): everyone takes the schedule
            self.acc.active = self
            q[ctrl[self.r] + _READY] = 2 * self.seq + failed
            self.phase, moved = 2, True
        if self.phase == 2:
            q, ctrl, seq = self.board.q, self.board.ctrl, self.seq
            bad = False
            for k in range(self.p):
                if k != self.r:
                    v = q[ctrl[k] + _READY]
                    if v < 2 * seq:
                        return moved
                    bad |= v == 2 * seq + 1
            if bad or q[ctrl[self.r] + _READY] & 1:
                self.bufs, self.acc.active = None, None
                return self._to_fallback()
            if self.on_choice is not None:
                self.on_choice(NAME)
            _SHARES[self.coll](self)      # (checks the peers' error words between pieces)
            # a peer that went down before this point may have had its buffers back while
            # we read them: no success on top of that
            self.acc.stop_if_failed()
            q[ctrl[self.r] + _FINISHED] = seq
            self.phase, moved = 3, True
        if self.phase == 3:
            q, ctrl, seq = self.board.q, self.board.ctrl, self.seq
            for k in range(self.p):
                if k != self.r and q[ctrl[k] + _FINISHED] < seq:
                    return moved
            self.bufs, self.acc.active = None, None
            self.phase, moved = 4, True
        return moved

    # -- the decision -----------------------------------------------------------------
    def _roles(self, k: int) -> tuple[bool, bool]:
        """(is rank k's "in", is its "out" touched by other ranks) in this collective —
        the same answer on every rank."""
        def used(who: str) -> bool:
            return who == "all" or (who == "root" and k == self.root)
        wi, wo = _NEEDS[self.coll]
        return used(wi), used(wo)

    def _reachable(self) -> bool:
        """From the headers alone (the same on every rank): does every rank mark this call
        as direct, and is every buffer that some rank must reach from another reachable?"""
        got = self.hdr.got
        S = collective_bytes(self.coll, self.p, self.n, self.isz)
        # a rank that forced shm_direct (algo=, GPURT_ALGO, a profile) ignores the
        # thresholds: then every rank does (decided from the headers, so identically)
        if any(w[0] >> 2 == self.seq and w[0] & 1 for w in got):
            self.mins = (1, 1, 1)
        for k in range(self.p):
            words = got[k]
            if words[0] >> 2 != self.seq:
                return False
            ti, to = self._roles(k)
            for touched, w in ((ti, 1), (to, 4)):
                if touched and self._how(words[w:w + 3], S) is None:
                    return False
        return True

    def _how(self, where: tuple, S: int) -> str | None:
        """How a buffer at ``where`` (location, offset, address) is reached: "map", "cma"
        or None (from facts every rank shares)."""
        loc, _off, addr = where
        acc = self.acc
        if loc and acc.can_map:       # a shared array: mapped, or the schedule
            return "map" if S >= self.mins[0] else None
        if addr and acc.can_cma and S >= self.mins[1]:
            return "cma"
        return None

    def _open(self) -> dict:
        """Every buffer this rank's share touches, by (rank, role)."""
        got, acc, me = self.hdr.got, self.acc, self.r
        if acc.fail_open:
            raise TransportError(f"rank {acc.ranks[me]}: GPURT_TEST_DIRECT_OPEN_FAIL")
        for m in acc.maps:          # drop the mappings of arrays the peers have freed (a
            if m is not None:       # loop of calls that all hit the cache never misses)
                m.sweep()
        S = collective_bytes(self.coll, self.p, self.n, self.isz)
        bufs = {(me, "in"): self.x.reshape(-1).view(_U8) if self.x.nbytes else None,
                (me, "out"): self.out.reshape(-1).view(_U8) if self.out.nbytes else None}
        for k in range(self.p):
            if k == me:
                continue
            ti, to = self._roles(k)
            words = got[k]
            for touched, role, w in ((ti, "in", 1), (to, "out", 4)):
                if not touched:
                    continue
                loc, off, addr = words[w:w + 3]
                if self._how((loc, off, addr), S) == "map":
                    bufs[(k, role)] = _Buf(acc.maps[k].view(loc, off, self._nbytes(role)))
                else:
                    bufs[(k, role)] = _Buf(None, acc.pids[k], addr, acc.ranks[k])
        for key in ((me, "in"), (me, "out")):
            if bufs[key] is not None:
                bufs[key] = _Buf(bufs[key])
        return bufs

    def _nbytes(self, role: str) -> int:
        c, n, isz, p = self.coll, self.n, self.isz, self.p
        if role == "in":
            return (p * n if c in ("reduce_scatter", "alltoall") else n) * isz
        return (p * n if c in ("allgather", "alltoall") else n) * isz


# -- the shares -----------------------------------------------------------------------
def _chunks(lo: int, hi: int, step: int, acc: Access):
    """[lo, hi) in pieces of ``step``; before each, stop if a peer has gone down."""
    while lo < hi:
        acc.stop_if_failed()
        yield lo, min(hi, lo + step)
        lo += step


def _reduce_block(d: DirectRun, src_off: int, lo: int, hi: int, targets, hint: int,
                  home: bool = False) -> None:
    """Reduce elements [lo, hi) (+ ``src_off`` in every input) of all ranks' inputs in rank
    order, and write the result at [lo, hi) of each of ``targets`` (bufs).  ``home``: the
    first target is this rank's own output, which the reduction may use as its
    accumulator (not when it is an input still to be read)."""
    isz, p, dt = d.isz, d.p, (d.out if d.out.nbytes else d.x).dtype
    step = max(1, CHUNK // isz)
    sc = d.acc.scratch(2 * CHUNK)
    acc_u8, tmp = sc[:CHUNK], sc[CHUNK:]
    red, bufs = d.red, d.bufs
    t = memcopy.threshold()
    # below the streaming threshold the result is reduced straight into our output (its
    # lines then stay in the cache for the copies to the peers); above it, into a
    # scratch that stays in the cache, and every output is written with streaming stores
    if home and (not t or hint < t) and \
            (d.r < 2 or not np.may_share_memory(d.x, d.out)):
        own, targets = targets[0].arr, targets[1:]
    else:
        own = None
    for a, b in _chunks(lo, hi, step, d.acc):
        nb = (b - a) * isz
        so = (src_off + a) * isz
        dst = acc_u8[:nb] if own is None else own[a * isz:a * isz + nb]
        acc = dst.view(dt)
        # CMA inputs come through the scratch: input 0 into tmp, input 1 into the
        # accumulator itself (the ufunc reads it before it writes)
        first = bufs[(0, "in")].read(so, nb, tmp).view(dt)
        if p == 1:
            np.copyto(acc, first)
        else:
            red(first, bufs[(1, "in")].read(so, nb, acc_u8).view(dt), acc)
            for k in range(2, p):
                red(acc, bufs[(k, "in")].read(so, nb, tmp).view(dt), acc)
        for tg in targets:
            tg.write(a * isz, dst, hint)


def _staged_allreduce(d: DirectRun) -> bool:
    """A staged allreduce (every rank's input already in its board buffer ``seq % 2``,
    published with the agreement's header): phase 6 reduces block r of every board buffer
    into this rank's output, in rank order, and copies it back over block r of its own
    board buffer (only this rank reads that block), then stores ``_REDUCED``; phase 7
    waits for every rank's and copies their blocks out.  ``done`` is stored last: the
    buffers may be reused only once every rank has read them.  Nothing here touches
    another rank's arrays, so a rank that fails anywhere may return at once."""
    bd, q, ctrl, seq, p, r = d.board, d.board.q, d.board.ctrl, d.seq, d.p, d.r
    b, isz, dt = seq & 1, d.isz, d.out.dtype
    blk = blocks(d.n, p, isz)
    moved = False
    if d.phase == 6:
        lo, hi = blk[r]
        step = max(1, CHUNK // isz)
        red, out = d.red, d.out
        for a in range(lo, hi, step):
            z = min(hi, a + step)
            ins = [bd.view(k, b, a * isz, (z - a) * isz, dt) for k in range(p)]
            o = out[a:z]
            if p == 1:
                np.copyto(o, ins[0])
            else:
                red(ins[0], ins[1], o)
                for k in range(2, p):
                    red(o, ins[k], o)
            np.copyto(ins[r], o)
        q[ctrl[r] + _REDUCED] = seq        # (x86 TSO: the block is visible first)
        d.phase, moved = 7, True
    for k in range(p):
        if k != r and q[ctrl[k] + _REDUCED] < seq:
            return moved
    for k in range(p):
        if k != r:
            lo, hi = blk[k]
            if hi > lo:
                np.copyto(d.out[lo:hi], bd.view(k, b, lo * isz, (hi - lo) * isz, dt))
    d.hdr.release()
    d.phase = 4
    return True


def _allreduce(d: DirectRun) -> None:
    lo, hi = blocks(d.n, d.p, d.isz)[d.r]
    others = [d.bufs[(k, "out")] for k in range(d.p) if k != d.r]
    _reduce_block(d, 0, lo, hi, [d.bufs[(d.r, "out")]] + others, d.n * d.isz, True)


def _reduce(d: DirectRun) -> None:
    lo, hi = blocks(d.n, d.p, d.isz)[d.r]
    _reduce_block(d, 0, lo, hi, [d.bufs[(d.root, "out")]], d.n * d.isz)


def _reduce_scatter(d: DirectRun) -> None:
    n = d.n
    _reduce_block(d, d.r * n, 0, n, [d.bufs[(d.r, "out")]], d.p * n * d.isz, True)


def _allgather(d: DirectRun) -> None:
    nb, hint = d.n * d.isz, d.p * d.n * d.isz
    mine = d.x.reshape(-1).view(_U8)
    base = d.r * nb
    for a, b in _chunks(0, nb, CHUNK, d.acc):
        src = mine[a:b]
        for k in range(d.p):
            d.bufs[(k, "out")].write(base + a, src, hint)


def _alltoall(d: DirectRun) -> None:
    nb, hint = d.n * d.isz, d.p * d.n * d.isz
    out = d.bufs[(d.r, "out")]
    tmp = d.acc.scratch(CHUNK)
    for k in range(d.p):
        src = d.bufs[(k, "in")]
        if src.arr is None:         # CMA: straight into our output, one copy
            d.acc.stop_if_failed()
            cma.copy(src.pid, cma.address(out.arr) + k * nb, src.addr + d.r * nb, nb,
                     False, src.peer)
            continue
        for a, b in _chunks(0, nb, COPY_PIECE, d.acc):   # (src is addressable: no tmp)
            out.write(k * nb + a, src.read(d.r * nb + a, b - a, tmp), hint)


def _broadcast(d: DirectRun) -> None:
    lo, hi = blocks(d.n, d.p, d.isz)[d.r]
    isz, hint = d.isz, d.n * d.isz
    src = d.bufs[(d.root, "out")]
    targets = [d.bufs[(k, "out")] for k in range(d.p) if k != d.root]
    tmp = d.acc.scratch(CHUNK)
    for a, b in _chunks(lo * isz, hi * isz, CHUNK, d.acc):
        data = src.read(a, b - a, tmp)
        for t in targets:
            if t is not src:
                t.write(a, data, hint)


_SHARES = {"allreduce": _allreduce, "reduce": _reduce, "reduce_scatter": _reduce_scatter,
           "allgather": _allgather, "alltoall": _alltoall, "broadcast": _broadcast}
