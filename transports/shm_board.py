"""``shm_board``: small collectives in one shared-memory round, the flag in the data.

How it works
------------
When every rank of a communicator is on one node, its shm segment also holds a *board*:
per rank two buffers (double-buffered by call number parity) and one control line with
two counters, ``flag`` (the last call whose data this rank has published) and ``done``
(the last call this rank has finished reading).  A small collective is then one round:

1. every rank that has data to give writes it once into its own buffer ``seq % 2``,
   with a header (call number, signature, the call's arguments), then stores ``flag = seq``;
2. every rank waits for the flags of the ranks it needs, checks their headers (a different
   signature is a ``CollectiveMismatchError`` naming both calls), and reads — copies or
   reduces in rank order, so all ranks get bitwise the same result — straight from their
   buffers into its output;
3. it stores ``done = seq``.

A rank may overwrite buffer ``b`` only when every peer's ``done`` has passed the last
call that used ``b``; in steady state that is already true when it looks.  Compared with
the ``direct`` schedule over the rings, each rank's data is written once instead of p-1
times and there are no per-message headers, slots or acknowledgements: one store to
publish, one load per peer to wait.

Broadcast and scatter: the non-roots publish a header without data and the root waits
for all of them, so ranks that disagree on the root all raise instead of one keeping a
stale buffer.

Cost (S bytes written per rank): α_board + S·β + (bytes read)·β + (bytes reduced)·γ,
with α_board ≈ 1.5 µs.  Used only while S fits a board buffer (``GPURT_SHM_BOARD``).
"""

from __future__ import annotations

import time
import zlib
from functools import lru_cache
from typing import Callable

import numpy as np

from gpurt.callsite import WORDS, at, site, words
from gpurt.errors import CollectiveMismatchError, PeerFailure, from_peer, relayed_rank

from .fence import fence as _fence
from gpurt.ops import DTYPE_CODE, DTYPE_NAMES, Op

CTRL = 64            # per rank: flag (+0), done (+8); shm_direct's words (+16..+32)
W_REJECTED = 5       # control-line words: the last call this rank rejected as invalid input,
                     # its kind (+1) and its call site's id (+2) — stored at once: its header
                     # may wait for a free buffer (mark_rejected)
HDR = 128            # per buffer: seq, sig, nbytes, coll, dtype, n, op, root, call site id
_SITE = 8            # header word of the call site's id (gpurt.callsite)
_EXTRA = 9           # header words 9..15: a protocol's own (shm_direct: buffer locations)
EXTRA = HDR // 8 - _EXTRA
SITES = 256          # per rank: call-site texts published (64 B each), by id
SITE_WAIT = 0.5      # s a rank that found a mismatch waits for the peer's call site
_U8 = np.dtype(np.uint8)

# the signature a rank publishes for a call it rejected as invalid input (no real call's
# crc32 signature is this large)
REJECTED = 0xFFFFFFFFFFFFFFFF
#: set in a header's call-number word: this rank failed with the call published and gave
#: it up (``revoke``): a peer that comes to it later raises PeerFailure, not a result
REVOKED = 1 << 63

COLLS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
         "gather", "scatter", "barrier")
_OPS = (None,) + tuple(Op)


def _load_native():
    """gpurt._fastboard (the compiled inline round), or None and why not."""
    try:
        from gpurt import _fastboard as fb
    except ImportError as e:
        return None, f"not built ({e}); the board runs in Python"
    if getattr(fb, "ABI", 0) != 11 or tuple(fb.COLLS) != COLLS:
        return None, ("built from another version of gpurt (reinstall it: pip install -e . "
                      "rebuilds the extension)")
    fb.set_ndarray(np.ndarray)
    probe = np.arange(3, dtype=np.float64)
    if fb.data_address(probe) != probe.ctypes.data:
        return None, "this NumPy's array layout is not the one it was built for"
    return fb, ""


def _plain_agrees(plain) -> bool:
    """Whether ``plain`` (the extension's reading of NumPy's array struct past the data
    pointer: flags, dtype, shape) answers cases whose answers are known."""
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    b = np.zeros((4, 3))
    ro = np.zeros(12)
    ro.flags.writeable = False
    cases = ((a, b, True), (a, a, True), (b, a.T, False), (a.T, b, False), (ro, b, True),
             (a, ro, False), (a, np.zeros(11), False), (a, np.zeros(12, np.int64), False),
             (a.reshape(-1)[2:], a.reshape(-1)[:10], False),
             (a.reshape(-1)[:6], a.reshape(-1)[6:], True))
    return all(plain(x, o, x.nbytes) is want for x, o, want in cases)


NATIVE, NATIVE_WHY = _load_native()
#: the extension's ``plain(x, out, nbytes)`` (allreduce's quick path: may an inline call
#: take x and out as they are?), or None where the extension is not loaded or reads
#: this NumPy's array struct wrongly (the quick path then checks in Python)
PLAIN = None
if NATIVE is not None:
    from . import cma as _cma
    _cma._fast_address = NATIVE.data_address
    PLAIN = NATIVE.plain if _plain_agrees(NATIVE.plain) else None
# element types and ops by the extension's codes (it has kernels for these)
_NTYPES = {np.dtype(t): i for i, t in enumerate(NATIVE.TYPES)} if NATIVE else {}
_NOPS = {Op(o): i for i, o in enumerate(NATIVE.OPS) if o} if NATIVE else {}
if NATIVE:
    _NOPS[Op.AVG] = _NOPS[Op.SUM]      # AVG sums; the caller divides


def native_enabled() -> bool:
    from gpurt import config
    return NATIVE is not None and bool(config.get("GPURT_NATIVE"))


def region_bytes(nlocal: int, slot: int) -> int:
    return nlocal * (CTRL + 2 * (HDR + slot) + SITES * 8 * WORDS)


def written_bytes(coll: str, p: int, S: float) -> float:
    """Bytes one rank writes into its buffer, for a collective of size S (nccl-tests S)."""
    if coll in ("allgather", "gather"):
        return S / p
    if coll == "barrier":
        return 0
    return S


class Board:
    """The board's memory, seen from local rank ``me``."""

    def __init__(self, q: memoryview, u8: np.ndarray, base: int, nlocal: int, me: int,
                 slot: int, limit: int | None = None):
        self.q, self.nlocal, self.me, self.slot = q, nlocal, me, slot
        # the one-round protocol's data fits ``limit`` (GPURT_SHM_BOARD); buffers larger
        # than that are room for a staged allreduce's input (shm_direct, GPURT_SHM_STAGE)
        self.limit = slot if limit is None else min(limit, slot)
        self.stage = slot if slot > self.limit else 0
        self.ctrl = [(base + k * CTRL) // 8 for k in range(nlocal)]   # flag at +0, done at +1
        bufs = base + nlocal * CTRL
        self.hdr = [[(bufs + (k * 2 + b) * (HDR + slot)) // 8 for b in range(2)]
                    for k in range(nlocal)]
        self.data = [[u8[bufs + (k * 2 + b) * (HDR + slot) + HDR:
                         bufs + (k * 2 + b + 1) * (HDR + slot)] for b in range(2)]
                     for k in range(nlocal)]
        # per rank: a table of call-site texts (by id); a header carries only the id
        sites = bufs + nlocal * 2 * (HDR + slot)
        self.sites = [(sites + k * SITES * 8 * WORDS) // 8 for k in range(nlocal)]
        self.published: set[int] = set()    # site ids whose text is in my table
        self.last_use = [0, 0]      # call number that last wrote my buffer b
        # the compiled inline round over the same memory (None: Python only)
        self.fast = NATIVE.FastBoard(u8.ctypes.data, nlocal, me, slot, self.ctrl,
                                     [h for k in range(nlocal) for h in self.hdr[k]],
                                     [bufs + (k * 2 + b) * (HDR + slot) + HDR
                                      for k in range(nlocal) for b in range(2)]) \
            if native_enabled() else None
        self._roles: dict = {}      # (coll, root) -> (writes, need)
        #: local rank -> its published fatal error ("" if none): set by the shm transport
        self.error_of: Callable[[int], str] = lambda k: ""
        self._views: dict = {}      # (k, b, off, nbytes, dtype) -> typed view of a buffer
        self._plans: dict = {}      # (coll, sig, dtype, n, op, root) -> the extension's plan

    def publish_site(self, sid: int) -> None:
        """Write call site ``sid``'s text into my table (once; before a header names it)."""
        self.published.add(sid)
        if 0 < sid < SITES:
            w, base = words(sid), self.sites[self.me] + sid * WORDS
            for i in range(WORDS):
                self.q[base + i] = w[i]

    def site_text(self, k: int, sid: int) -> tuple[int, ...]:
        """Rank k's call site ``sid`` (zeros when unknown)."""
        if not 0 < sid < SITES:
            return (0,) * WORDS
        base = self.sites[k] + sid * WORDS
        return tuple(self.q[base + i] for i in range(WORDS))

    def roles(self, coll: str, root: int) -> tuple[bool, list[int]]:
        """(does this rank write, whose data does it wait for) in ``coll``."""
        key = (coll, root)
        got = self._roles.get(key)
        if got is None:
            p, r = self.nlocal, self.me
            # every rank waits for every rank's header, also in the rooted collectives
            # where only the root reads data: a rank that believes another root (or called
            # anything else) is then an error on every rank, never a silent stale buffer
            # or a rank that returned from a call its peers reject
            got = (True, [k for k in range(p) if k != r])
            self._roles[key] = got
        return got

    def view(self, k: int, b: int, off: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        key = (k, b, off, nbytes, dtype)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 4096:
                self._views.clear()
            v = self._views[key] = self.data[k][b][off:off + nbytes].view(dtype)
        return v

    def set_wait(self, spin: float) -> None:
        """The compiled round's wait before it hands back to the executor's: spin ``spin``
        seconds, then yield for up to 1 ms more."""
        if self.fast is not None:
            self.fast.set_wait(int(spin * 1e9), int(spin * 1e9) + 1_000_000)

    def fast_plan(self, coll: str, sig: int, meta: tuple, dtype: np.dtype, n: int,
                  op: Op | None, root: int):
        """The extension's plan for one inline call (None when there is no extension)."""
        if self.fast is None:
            return None
        key = (coll, sig, dtype, n, op, root)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[key] = self._new_plan(coll, sig, meta, dtype, n, op, root)
        return plan

    def stage_plan(self, sig: int, meta: tuple, dtype: np.dtype, n: int, op: Op):
        """The extension's plan for a staged allreduce (``shm_direct``; ``sig``/``meta`` its
        own), or None where the extension has no kernel for the dtype and op, or the
        input does not fit the staging room (DirectRun then stages in Python, or not)."""
        if self.fast is None or dtype not in _NTYPES or op not in _NOPS or \
                not 0 < n * dtype.itemsize <= self.stage:
            return None
        return self.fast.plan(COLLS.index("allreduce"), sig, meta, n, dtype.itemsize,
                              _NTYPES[dtype], _NOPS[op], 0, n * dtype.itemsize)

    def direct_plan(self, coll: str, sig: int, meta: tuple, dtype: np.dtype, n: int,
                    op: Op | None, root: int):
        """The extension's plan for shm_direct's compiled shares by CMA (``direct``), or
        None where there is no extension, or no kernel for a reduction's dtype and op."""
        if self.fast is None or n < 1:
            return None
        if op is not None and (dtype not in _NTYPES or op not in _NOPS):
            return None
        return self.fast.dplan(COLLS.index(coll), sig, meta, n, dtype.itemsize,
                               _NTYPES.get(dtype, -1), _NOPS[op] if op is not None else 0,
                               root)

    def _new_plan(self, coll: str, sig: int, meta: tuple, dtype: np.dtype, n: int,
                  op: Op | None, root: int):
        if coll == "barrier" or (coll in ("broadcast", "scatter") and self.me != root):
            writes = 0
        elif coll in ("reduce_scatter", "alltoall", "scatter"):
            writes = self.nlocal * n * dtype.itemsize      # x holds one block per rank
        else:
            writes = n * dtype.itemsize
        return self.fast.plan(COLLS.index(coll), sig, meta, n, dtype.itemsize,
                              _NTYPES.get(dtype, -1), _NOPS.get(op, 0) if op else 0, root,
                              writes)

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()      # the segment is about to be unmapped
            self.fast = None
        self.data = []
        self._views = {}


class BoardRun:
    """One collective on the board; ``advance`` never blocks (the executor's protocol)."""

    __slots__ = ("board", "coll", "seq", "sig", "meta", "x", "out", "root", "red", "p",
                 "r", "n", "nbytes", "phase", "need", "writes", "b", "check", "site", "cplan",
                 "extra", "got", "hold")

    def __init__(self, board: Board, coll: str, seq: int, sig: int, meta: tuple,
                 x: np.ndarray, out: np.ndarray, root: int, red: Callable | None, n: int,
                 check: bool = False, publish_only: bool = False, site: int = 0,
                 extra: tuple = (), stage: np.ndarray | None = None):
        """``check=True``: only the headers go round (every rank waits for every other's
        and compares) — the agreement check run before a collective moves its data by
        another algorithm.  ``publish_only``: publish the header and wait for nobody (a
        rank announcing that it rejected its own call).  ``site``: the call site's id
        (``gpurt.callsite``), shown in mismatch errors, never compared.  ``extra``: up to
        ``EXTRA`` more words for the header (``shm_direct``'s buffer locations); once the
        round is done, ``got[k]`` holds rank k's (its own where k is this rank).
        ``stage`` (with ``check``): bytes published with the header (a staged allreduce's
        input); the round then leaves ``done`` to its owner, who stores it once it has
        read the peers' buffers (``release``)."""
        self.board, self.coll, self.seq, self.sig, self.meta = board, coll, seq, sig, meta
        self.site = site
        self.extra, self.got = extra, None
        self.x, self.out, self.root, self.red, self.n = x, out, root, red, n
        self.p, self.r = board.nlocal, board.me
        self.b = seq & 1
        self.check = check or publish_only
        self.writes, self.need = board.roles("barrier" if self.check else coll, root)
        if publish_only:
            self.need = []
        # broadcast and scatter: only the root has data; the others publish a header
        self.nbytes = 0 if self.check or (coll in ("broadcast", "scatter") and self.r != root) \
            else x.nbytes
        self.hold = stage is not None
        if self.hold:
            self.x, self.nbytes = stage, stage.nbytes
        self.phase = 0
        # the compiled reader, when built: every rank then reads (and reduces) with the
        # same kernels whichever path its call took, so the bits agree, NaN payloads too
        self.cplan = None
        if board.fast is not None and not self.check:
            self.cplan = board.fast_plan(coll, sig, meta, x.dtype, n,
                                         _op_of(meta[3]), root)

    @property
    def done(self) -> bool:
        return self.phase == 2

    def waiting_on(self) -> list[int]:
        q, bd = self.board.q, self.board
        if self.phase == 0:
            last = bd.last_use[self.b]
            return [k for k in range(self.p) if k != self.r and q[bd.ctrl[k] + 1] < last]
        return [k for k in self.need if q[bd.ctrl[k]] < self.seq]

    def advance(self) -> bool:
        bd, q, moved = self.board, self.board.q, False
        if self.phase == 0:
            last = bd.last_use[self.b]
            if last:
                for k in range(self.p):
                    if k != self.r and q[bd.ctrl[k] + 1] < last:
                        return False
            h = bd.hdr[self.r][self.b]
            if self.nbytes:
                bd.data[self.r][self.b][:self.nbytes] = self.x.view(_U8)
                _fence()
            meta = self.meta
            q[h] = self.seq
            q[h + 1] = self.sig
            q[h + 2] = self.nbytes
            q[h + 3] = meta[0]
            q[h + 4] = meta[1]
            q[h + 5] = meta[2]
            q[h + 6] = meta[3]
            q[h + 7] = meta[4]
            _show_site(bd, self.b, self.site)
            for i, w in enumerate(self.extra):
                q[h + _EXTRA + i] = w
            q[bd.ctrl[self.r]] = self.seq        # publish (x86 TSO: data is visible first)
            bd.last_use[self.b] = self.seq
            self.phase, moved = 1, True
        if self.phase == 1:
            seq = self.seq
            if self.cplan is not None:
                got = bd.fast.complete(self.cplan, seq, self.out)
                if got == 0:
                    self.phase = 2
                    return True
                if got == 1:              # a peer has not published yet
                    self._check_rejected()
                    return moved
                # 3: a header differs, or no kernel for this dtype/op: below
            for k in self.need:
                if q[bd.ctrl[k]] < seq:
                    self._check_rejected()
                    return moved
            _fence()
            gave_up = -1
            for k in self.need:
                h = bd.hdr[k][self.b]
                # the arguments too: calls whose 32-bit signatures collide differ there
                if q[h] != seq or q[h + 1] != self.sig or \
                        tuple(q[h + 3:h + 8]) != self.meta:
                    if q[h] == seq | REVOKED and q[h + 1] == self.sig and \
                            tuple(q[h + 3:h + 8]) == self.meta:
                        gave_up = k if gave_up < 0 else gave_up
                        continue        # (a call that differs is named first)
                    self._mismatch(k, h)
            if gave_up >= 0:
                self._gave_up(gave_up)
            if not self.check:
                self._read()
            if self.extra:      # read before ``done``: the peers may then reuse the buffer
                m = len(self.extra)
                self.got = [self.extra if k == self.r else
                            tuple(q[bd.hdr[k][self.b] + _EXTRA + i] for i in range(m))
                            for k in range(self.p)]
            if not self.hold:
                q[bd.ctrl[self.r] + 1] = seq
            self.phase, moved = 2, True
        return moved

    def release(self) -> None:
        """A holding round's owner is done with the peers' buffers of this call."""
        self.board.q[self.board.ctrl[self.r] + 1] = self.seq

    def _slot(self, k: int, nbytes: int, off: int) -> np.ndarray:
        return self.board.view(k, self.b, off, nbytes, self.x.dtype)

    def _read(self) -> None:
        read_into(self.coll, self.p, self.r, self.n, self.root, self.out, self.red,
                  self.x.dtype, self._slot)

    def _check_rejected(self) -> None:
        """While a peer's header is missing: has it rejected this call (``mark_rejected``)?"""
        q, bd, seq = self.board.q, self.board, self.seq
        for k in self.need:
            if q[bd.ctrl[k] + W_REJECTED] == seq and q[bd.ctrl[k]] < seq:
                _fence()        # (the kind and site were stored before the call number)
                theirs = bd.site_text(k, q[bd.ctrl[k] + W_REJECTED + 2])
                self._rejected(k, q[bd.ctrl[k] + W_REJECTED + 1],
                               at(theirs) if any(theirs) else "")

    def _rejected(self, k: int, coll: int, theirs_at: str = "",
                  mine_at: str | None = None) -> None:
        """Rank k rejected its call ``seq`` (``coll``: its kind's index in COLLS)."""
        if mine_at is None:
            mine_at = at(words(self.site or site()))
        what = COLLS[coll] if coll < len(COLLS) else "a collective"
        raise CollectiveMismatchError(
            f"call #{self.seq}: rank {k} rejected its own {what} call{theirs_at} as invalid "
            f"input (its ValueError/TypeError says why); rank {self.r} called "
            f"{describe(self.meta)}{mine_at}")

    def _gave_up(self, k: int) -> None:
        """Rank k published this very call, then failed and took it back (``revoke``)."""
        _fence()                # (its error record was written before the mark)
        err = self.board.error_of(k)
        text = f"rank {k} failed during call #{self.seq} and gave it up" + \
            (f": {err}" if err else "")
        raise from_peer(err, text, relayed_rank(err, k)) if err else \
            PeerFailure(text, rank=k)

    def _mismatch(self, k: int, h: int) -> None:
        bd = self.board
        q = bd.q
        hseq = int(q[h])
        revoked = hseq == self.seq | REVOKED
        if revoked:             # (a rank that failed, and whose call differs: its call
            hseq = self.seq     # number; the rest of its header as published)
        sid = self.site or site()
        mine_at = at(words(sid))
        if hseq == self.seq and not revoked:
            # the inline fast path publishes no call site (finding it costs ~2 µs a call):
            # a rank that finds a mismatch puts its own into its header now, and waits
            # briefly for the peer's — every rank reads every header, so the peer finds
            # the mismatch too and does the same — to name both lines
            _show_site(bd, self.b, sid)
            if not q[h + _SITE]:
                end = time.monotonic() + SITE_WAIT
                while not q[h + _SITE] and time.monotonic() < end:
                    time.sleep(0.0002)
            _fence()           # (the site's text was stored before its id)
        theirs = bd.site_text(k, q[h + _SITE])
        theirs_at = at(theirs) if any(theirs) else ""
        if hseq != self.seq:
            raise CollectiveMismatchError(
                f"rank {k} published call #{hseq} on the shm board where call #{self.seq} was "
                f"expected: the ranks called different collectives or sizes (rank {self.r}'s "
                f"call{mine_at or ' site unknown'})")
        if q[h + 1] == REJECTED:
            self._rejected(k, q[h + 3], theirs_at, mine_at)
        theirs, mine = describe_both(tuple(q[h + 3 + i] for i in range(len(self.meta))),
                                     self.meta)
        raise CollectiveMismatchError(f"call #{self.seq}: rank {k} called {theirs}{theirs_at}, "
                                      f"rank {self.r} called {mine}{mine_at}")


def revoke(board: Board) -> None:
    """This rank failed (a timeout, ``abort()``, ``close()`` or an exception mid-call) with
    a call published on the board that it has not finished: take the call back by
    marking its header ``REVOKED``, after its error record was written.  A peer that
    compared the headers already completes the call (it had everything); one that comes
    to it later raises PeerFailure with this rank's error — before, it found a complete,
    matching round and returned a result of a call this rank had given up, and learnt of
    the failure only at its next call."""
    q, me = board.q, board.me
    seq = int(q[board.ctrl[me]])
    if seq and int(q[board.ctrl[me] + 1]) < seq:
        _fence()                # (the error record before the mark)
        # (the call number, not the signature, carries the mark: a peer whose call
        # differs still names both calls from the header, as a mismatch)
        q[board.hdr[me][seq & 1]] = seq | REVOKED


def _site_word(sid: int) -> int:
    """A header's call-site word: the id, or ``SITES`` for a site past the table (no text,
    but not 0: 0 says the call's site is not published yet — as for a call that has no
    id, ``sid`` 0: a peer that finds a mismatch then waits for ``_show_site``)."""
    return sid if 0 < sid < SITES else (SITES if sid else 0)


def _show_site(board: Board, b: int, sid: int) -> None:
    """Put call site ``sid`` into this rank's header of its call in buffer ``b`` (as it
    publishes the call; or later, where the inline round left it 0), its text first."""
    if sid not in board.published:
        board.publish_site(sid)
    _fence()
    board.q[board.hdr[board.me][b] + _SITE] = _site_word(sid)


def mark_rejected(board: Board, seq: int, coll: int, sid: int = 0) -> None:
    """Tell the peers at once that this rank rejected its call ``seq`` (made at call site
    ``sid``) as invalid input: its rejected header (``BoardRun(publish_only=True)``) may
    wait for a buffer that a slower peer still reads, and the peers must not wait for it
    meanwhile — nor take the rank's exit, if it leaves before, for a failure
    (``BoardRun`` checks the word while a peer's flag is missing)."""
    q, w = board.q, board.ctrl[board.me] + W_REJECTED
    if sid and sid not in board.published:
        board.publish_site(sid)
    q[w + 1] = coll
    q[w + 2] = sid if sid < SITES else 0
    _fence()                 # seen before the call number (weakly ordered CPUs too)
    q[w] = seq


def read_into(coll: str, p: int, r: int, n: int, root: int, out: np.ndarray,
              red: Callable | None, dtype: np.dtype, slot: Callable) -> None:
    """Rank ``r``'s result of ``coll`` from every rank's published contribution:
    ``slot(k, nbytes, offset)`` is a ``dtype`` view of rank k's buffer.  Reductions go in
    rank order 0, 1, ... on every rank, so every rank computes the same bits."""
    isz = np.dtype(dtype).itemsize
    if coll in ("allreduce", "reduce"):
        if coll == "reduce" and r != root:
            return
        nb = n * isz
        np.copyto(out, slot(0, nb, 0))
        for k in range(1, p):
            red(out, slot(k, nb, 0), out)
    elif coll == "reduce_scatter":
        nb = n * isz
        np.copyto(out, slot(0, nb, r * nb))
        for k in range(1, p):
            red(out, slot(k, nb, r * nb), out)
    elif coll in ("allgather", "gather"):
        if coll == "gather" and r != root:
            return
        nb = n * isz
        for k in range(p):
            out[k * n:(k + 1) * n] = slot(k, nb, 0)
    elif coll == "alltoall":
        nb = n * isz
        for k in range(p):
            out[k * n:(k + 1) * n] = slot(k, nb, r * nb)
    elif coll == "broadcast":
        if r != root:
            np.copyto(out, slot(root, n * isz, 0))
    elif coll == "scatter":
        nb = n * isz
        np.copyto(out, slot(root, nb, r * nb))
    # barrier: the flags (headers) were the message


DEVICE_DT = 64   # added to the dtype field for device buffers: ranks mixing host and
                 # device memory in one call disagree (and are told so)


ALG_SHIFT = 8    # the op field's higher bits: a tag of the algorithm the call runs


@lru_cache(maxsize=None)
def alg_tag(name: str) -> int:
    """A 24-bit tag of an algorithm's name (crc32, the same in every process), remembered
    here so that a peer's tag can be named in an error message."""
    tag = zlib.crc32(name.encode()) & 0xFFFFFF or 1
    _ALG_NAMES.setdefault(tag, name)
    return tag


_ALG_NAMES: dict[int, str] = {}


def name_algorithms(names) -> None:
    """Learn the tags of ``names`` (every algorithm a peer may run)."""
    for name in names:
        alg_tag(name)


def _op_of(word: int) -> Op | None:
    op = word & ((1 << ALG_SHIFT) - 1)
    return _OPS[op] if op < len(_OPS) else None


def meta_of(coll: str, dtype: np.dtype, n: int, op: Op | None, root: int,
            device: bool = False, alg: str = "") -> tuple:
    """The call's arguments as integers, for the header (and error messages); ``alg``, the
    algorithm or protocol the call runs, rides in the op field: ranks that would run
    different ones for the same call disagree before anything moves."""
    return (COLLS.index(coll), DTYPE_CODE[dtype] + (DEVICE_DT if device else 0), n,
            _OPS.index(op) | (alg_tag(alg) << ALG_SHIFT if alg else 0), root)


def describe(meta: tuple, algo: bool = False) -> str:
    """The call a header describes; ``algo``: with the algorithm it runs."""
    try:
        coll, dt, n, opw, root = meta
        op, tag = opw & ((1 << ALG_SHIFT) - 1), opw >> ALG_SHIFT
        kind = " device" if dt >= DEVICE_DT else ""
        text = f"{COLLS[coll]}({DTYPE_NAMES[dt % DEVICE_DT]}{kind}, count={n}"
        if _OPS[op] is not None:
            text += f", op={_OPS[op].name}"
        if COLLS[coll] in ("reduce", "broadcast", "gather", "scatter"):
            text += f", root={root}"
        if algo and tag:
            name = _ALG_NAMES.get(tag, f"#{tag:06x}")
            first, _, fallback = name.partition("/")
            text += f", algorithm {first}" + (f" (fallback {fallback})" if fallback else "")
        return text + ")"
    except (IndexError, ValueError, TypeError):
        return f"an unknown call {meta}"


def describe_both(theirs: tuple, mine: tuple) -> tuple[str, str]:
    """Two calls that disagree, described; with their algorithms where that is all that
    differs (e.g. ``algo=`` given differently on the ranks)."""
    a, b = describe(theirs), describe(mine)
    if a == b:
        a, b = describe(theirs, True), describe(mine, True)
    return a, b
