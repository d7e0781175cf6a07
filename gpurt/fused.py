"""Small collectives on several nodes: the agreement check fused with the data.

On a communicator without a shared-memory board (it spans nodes), every collective is
checked before its data moves: an allgather of every rank's call header (call number,
signature, arguments, call site), then the schedule.  For small calls that header round
costs as much as the collective itself.  Here both travel together instead, in one round:
every rank sends every other rank its header (the agreement's own message: same layout,
tag and signature, so a rank on this path and a rank on the plain agreement path still
compare their calls) and, right behind it, its data — to the ranks that need it.  A rank
checks every header *before* it posts a single data receive: a rank that called something
else makes every rank raise ``CollectiveMismatchError`` naming each rank's call and call
site, and no user buffer is written (data that arrived meanwhile stays in the transport,
whose communicator is now poisoned).  Then the result is computed exactly as on the board
(``shm_board.read_into``: reductions in rank order, the same bits on every rank).

Used for calls whose per-message payload is at most ``GPURT_CHECK_FUSE`` bytes, on up to
32 ranks (the agreement's direct allgather; beyond, its Bruck rounds relay headers), when
no algorithm is forced.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from gpurt.transports import LANE_COLL
from gpurt.transports import shm_board

_U8 = np.dtype(np.uint8)
MAX_RANKS = 32

# who sends its data to whom, once the calls agree
_ALL = ("allreduce", "allgather", "reduce_scatter", "alltoall")
_TO_ROOT = ("reduce", "gather")
_FROM_ROOT = ("broadcast", "scatter")


def payload_elems(coll: str, p: int, n: int) -> int:
    """Elements of the message a contributing rank sends (its whole input, as on the
    board)."""
    if coll in ("reduce_scatter", "alltoall", "scatter"):
        return p * n
    if coll == "barrier":
        return 0
    return n


class _Into:
    __slots__ = ("dst",)

    def __init__(self, dst: np.ndarray):
        self.dst = dst

    def __call__(self, off: int, chunk: np.ndarray) -> None:
        self.dst[off:off + chunk.nbytes] = chunk


class FusedRun:
    """One checked small collective across nodes; ``advance`` never blocks."""

    __slots__ = ("eps", "p", "r", "coll", "root", "n", "dtype", "x", "out", "red", "every",
                 "agree", "pending", "phase", "bufs", "own", "sig", "seq", "peers")

    def __init__(self, eps: dict, p: int, r: int, coll: str, seq: int, sig: int,
                 header: np.ndarray, hdr_sig: int, x: np.ndarray, out: np.ndarray, root: int,
                 red: Callable | None, n: int, dtype: np.dtype,
                 agree: Callable[[np.ndarray], None]):
        self.eps, self.p, self.r, self.coll, self.root, self.n = eps, p, r, coll, root, n
        self.dtype, self.x, self.out, self.red, self.agree = dtype, x, out, red, agree
        self.seq, self.sig = seq, sig
        w = header.size
        self.every = np.zeros(p * w, np.uint64)
        self.every[r * w:(r + 1) * w] = header
        self.peers = [q for q in range(p) if q != r]
        self.bufs: dict[int, np.ndarray] = {}
        self.phase = 0
        hb = header.view(_U8)
        ev = self.every.view(_U8)
        nb = payload_elems(coll, p, n) * np.dtype(dtype).itemsize
        data = x.reshape(-1).view(_U8)[:nb] if nb else None
        pend = []
        for q in self.peers:
            ep = eps[q]
            pend.append(ep.send(hb, LANE_COLL, seq, hdr_sig))
            if data is not None and self._gives(r, q):
                pend.append(ep.send(data, LANE_COLL, seq, sig))
            pend.append(ep.recv(hb.nbytes, _Into(ev[q * hb.nbytes:(q + 1) * hb.nbytes]),
                                LANE_COLL, seq, hdr_sig))
        self.pending = pend
        self.own = None

    def _gives(self, k: int, q: int) -> bool:
        """Does rank k send its data to rank q (given that the calls agree)?"""
        c = self.coll
        if c in _ALL:
            return True
        if c in _TO_ROOT:
            return q == self.root and k != self.root
        if c in _FROM_ROOT:
            return k == self.root
        return False

    def advance(self) -> bool:
        moved = False
        if self.pending:
            self.pending = [c for c in self.pending if not c.test()]
            if self.pending:
                return moved
            moved = True
        if self.phase == 0:
            # every header is in: compare before any data is received or written
            self.agree(self.every)
            isz = np.dtype(self.dtype).itemsize
            nb = payload_elems(self.coll, self.p, self.n) * isz
            if nb:
                for q in self.peers:
                    if self._gives(q, self.r):
                        b = self.bufs[q] = np.empty(nb, np.uint8)
                        self.pending.append(self.eps[q].recv(nb, _Into(b), LANE_COLL,
                                                             self.seq, self.sig))
            self.phase = 1
            moved = True
            if self.pending:
                self.pending = [c for c in self.pending if not c.test()]
                if self.pending:
                    return moved
        if self.phase == 1:
            x = self.x
            if x.size and np.may_share_memory(x, self.out):
                x = x.copy()                    # in place: read my input before writing
            self.own = x.reshape(-1).view(_U8)
            shm_board.read_into(self.coll, self.p, self.r, self.n, self.root,
                                self.out.reshape(-1) if self.out.size else self.out,
                                self.red, self.dtype, self._slot)
            self.phase, self.bufs, self.own = 2, {}, None
            moved = True
        return moved

    def _slot(self, k: int, nbytes: int, off: int) -> np.ndarray:
        src = self.own if k == self.r else self.bufs[k]
        return src[off:off + nbytes].view(self.dtype)

    @property
    def done(self) -> bool:
        return self.phase == 2

    def waiting_on(self) -> list[int]:
        return sorted({c.peer for c in self.pending})
