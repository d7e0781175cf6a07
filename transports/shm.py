"""``shm``: the intra-node host data path over POSIX shared memory.

How it works
------------
One segment per communicator per node.  Local rank 0 creates it in ``/dev/shm`` (name
``gpurt-<pid>-<n>``), reserves its pages with ``posix_fallocate`` (a full ``/dev/shm``
is a clean ``ResourceError`` now, not a SIGBUS later), the other local ranks map it,
and as soon as everyone has mapped it the name is unlinked — from then on no exit,
SIGKILL included, can leave a file behind.  Names whose creator died before the unlink
(a crash inside that window) are removed by the next job on the node.

The segment holds one *ring* per ordered pair of local ranks and *lane*.  A ring is a
single-producer single-consumer queue of fixed-size *slots*: the sender copies a chunk
into slot ``head % nslots``, writes the slot's header (tag, signature, message length,
chunk offset, chunk length) and then publishes it by storing ``head + 1``; the receiver
consumes slot ``tail % nslots`` — copying it out or reducing it straight into the
destination — and stores ``tail + 1``.  Each counter has one writer and sits in its own
cache line.  A message longer than a slot streams through the ring chunk by chunk, so a
sender never needs more than ``nslots`` slots of buffer: large messages are pipelined.
Small messages cost one copy in and one copy (or reduce) out.

Ordering: x86-64 keeps stores in order (TSO), so data written before the counter is
visible before it (``fence.py``); on other CPUs the transport declares itself
unavailable, since pure Python cannot issue the barriers they need.

Liveness: every rank writes its pid into the segment header; a waiting endpoint checks
that the peer's pid still exists (``check``), so a peer that died becomes ``PeerFailure``
instead of a wait until the deadline.  A failing rank writes its error record there
before its caller gets its buffers back; a single-copy read of its memory checks that
record before and after (``_Ring._trust``), so it never takes bytes written after the
failure.

Cost constants (defaults, overridden by ``GPURT_COST``): α ≈ 4 µs per message (Python
per-message overhead), β ≈ 1/4 GB/s, γ ≈ 1/2 GB/s.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import secrets
import struct
import time
from collections import deque

import numpy as np

from gpurt import config, memcopy, sharedmem
from gpurt.wait import mpi_barrier, oversubscribed
from gpurt.errors import (CollectiveMismatchError, PeerFailure, ResourceError, TransportError,
                          fit_text, from_peer, relayed_rank)

from . import cma, shm_board
from .fence import ORDERED, WHY_NOT
from .fence import fence as _fence
from .base import CLOSED_IN_EXCHANGE, LANE_NAMES, LANE_P2P, LANES, UPTO_MAX, Sink, mismatch_detail

log = logging.getLogger("gpurt.shm")


PREFIX = "gpurt-"
# a segment from this size on is reserved while the other local ranks sleep (below it the
# reservation takes a few ms, and a nap would overshoot it)
_SLEEPY_SETUP = 64 << 20
_MAGIC = 0x67707572745F7368  # "gpurt_sh"
_HDR = 4096                  # segment header (at least): magic, pid and probe tables
_CTRL = 192                  # ring control: head (+0), tail (+64), help words (+80..)
_SLOT_HDR = 64
_HELP_CHUNK = 512 << 10       # cooperative single copy: bytes per chunk
_READ_MAX = 16 << 20          # bytes a single-copy read takes per advance
_HELP_READ_MAX = _READ_MAX // _HELP_CHUNK   # the same in chunks, cooperative (32)
_BOUNCE = 256 * 1024          # reductions of single-copy data go through this much cache


_ERR = 256                    # per local rank: length word + the text of its fatal error
CLOSED = 1 << 62              # in that length word: a close notice, not an error
_SHARED_MIN = 128 * 1024      # messages from a shared array of at least this go single-copy


def cma_threshold(nlocal: int) -> int:
    """Messages of at least this many bytes go single-copy with process_vm_readv
    (GPURT_SHM_CMA; 0: never).  ``auto``: the last-level cache / (4 × local ranks), at
    least 128 KiB — below it the rings' two copies stay in the cache and, pipelined, beat
    the kernel's one copy (measured here, 2 ranks, 32 MiB L3, allreduce of 1 MiB:
    381–433 µs through the rings against 471–562 µs single-copy; of 4 MiB 1298–1564
    against 1570–1876 µs; of 16 MiB single-copy wins, 5777–6835 against 7129–7751 µs) —
    except with more local ranks than CPUs, where every chunk through a ring waits for
    the other process to be scheduled and one copy by one process wins: 128 KiB there
    (4 ranks on 2 cores, allreduce of 2 MiB: 2932–4605 µs single-copy against 4736–5080
    through the rings).  The cache counted is at most ``_CMA_LLC_MAX`` (32 MiB): a virtual
    machine may report its host's whole L3, shared with every other guest (300 MiB on one
    host of this VM), which put the threshold at 37.5 MiB for 2 ranks, and there the rings
    lost to the single copy from 2 MiB messages on (2 ranks, ring allreduce of 4 MiB
    1178–1335 µs through the rings against 1078–1135 single-copy, of 16 MiB 5045–6929
    against 3475–4719; sendrecv of 16 MiB 4155–4949 against 2011–2234)."""
    val = config.get("GPURT_SHM_CMA")
    if val != "auto":
        return int(val)
    if oversubscribed(nlocal):
        return 128 * 1024
    llc = min(memcopy.llc_bytes() or _CMA_LLC_MAX, _CMA_LLC_MAX)
    return max(128 * 1024, llc // (4 * max(1, nlocal)))


_CMA_LLC_MAX = 32 << 20   # the most last-level cache cma_threshold counts on
_CMA_P2P_MAX = 128 << 10  # the highest single-copy threshold of the point-to-point lane


def cma_threshold_p2p(nlocal: int) -> int:
    """The single-copy threshold of the point-to-point lane (GPURT_SHM_CMA_P2P; 0: never).
    ``auto``: ``cma_threshold``'s, at most 128 KiB.  The collectives' rings pipeline a
    schedule's steps, and their two copies in cache win up to the last-level cache's
    share; a send/recv has nothing to overlap with, and from 128 KiB one copy wins (2
    ranks on the 2-core Xeon VM, ``gpurt bench sendrecv``: 128 KiB 25 against 34 µs,
    1 MiB 89-107 against 225, 2 MiB 208-228 against 468; below 64 KiB both ~20 µs)."""
    val = config.get("GPURT_SHM_CMA_P2P")
    if val != "auto":
        return int(val)
    return min(cma_threshold(nlocal), _CMA_P2P_MAX)


def header_bytes(nlocal: int) -> int:
    """Header: word 0 magic, words 8.. one pid per local rank, then one probe address per
    local rank, then one error record per local rank, then the device path's
    acknowledgement words (one per ordered pair of local ranks and lane: how many of the
    sender's device messages the receiver has finished reading, ``cuda_ipc``);
    page-aligned, one page at least."""
    nbytes = (8 + 2 * nlocal) * 8 + _ERR * nlocal + nlocal * nlocal * LANES * 8
    return max(_HDR, -(-nbytes // 4096) * 4096)


_names = itertools.count()

def _pid_state(pid: int) -> str:
    """The process state letter from /proc (R, S, D, T, t, Z, ...), or "gone"."""
    if pid <= 0:
        return "?"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "?"


class _PeerProc:
    """What this process knows of one local peer process, shared by every endpoint to it
    (every communicator, every dup): that it has exited, since when it has been seen
    stopped, and when its state was last read.  Per endpoint, a freeze's bound restarted
    with each communicator a survivor waited on, and a send on a dup did not know what a
    failed call on the parent had found."""

    __slots__ = ("pid", "gone", "stopped_since", "checked", "visible")

    def __init__(self, pid: int, visible: bool = True):
        self.pid, self.gone = pid, ""
        self.stopped_since: float | None = None
        self.checked = -1e18    # time.monotonic() of the last /proc read
        self.visible = visible  # its pid names it in this process's /proc (same namespace)

    def state(self, now: float) -> str:
        """Read the state (and remember it): "gone" once it has exited, for good; "?"
        where its pid means nothing here (another pid namespace)."""
        if self.gone:
            return "gone"
        last, self.checked = self.checked, now
        if not self.visible:
            return "?"
        state = _pid_state(self.pid)
        if state in ("gone", "Z", "X"):
            self.gone = state
            return "gone"
        if state in ("T", "t"):
            # (not seen for a while: it may have run and stopped again meanwhile — the
            # freeze is counted from now, not from a stop that may have ended)
            if self.stopped_since is None or now - last > 1.0:
                self.stopped_since = now
        else:
            self.stopped_since = None
        return state


_procs: dict[int, _PeerProc] = {}
_SEND_CHECK = 0.2    # a send reads its peer's state if nobody did for this long (seconds)


def _peer_proc(pid: int, visible: bool = True) -> _PeerProc:
    """The record of a local peer process that has just taken part in a communicator's
    set-up (so it lives, and runs): a record of an earlier process with the same pid
    (pid reuse: a spawned rank) that exited, or of a freeze, starts again; endpoints of
    the earlier communicators keep theirs.  A peer whose pid means nothing here (another
    pid namespace) gets a record of its own whose state is unknown."""
    if not visible:
        return _PeerProc(pid, False)
    p = _procs.get(pid)
    if p is None or p.gone or p.stopped_since is not None:
        p = _procs[pid] = _PeerProc(pid)
    return p


def _pid_alive(pid: int) -> bool:
    """Not provably gone, nor a zombie (an unknown pid counts as alive).  Asked first
    without a file descriptor: the question may come because none is left."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass                    # (EPERM: it exists)
    return _pid_state(pid) not in ("gone", "Z", "X")


def _fresh_name() -> str:
    """A segment name no other process makes: this pid, a counter and a random part (a
    stale file of a crashed job whose pid this process now has never collides)."""
    return f"{PREFIX}{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"


def _segment_name(how: tuple) -> str:
    return f"/proc/{how[1]}/fd/{how[2]}" if how[0] == "fd" else how[1]


def _create_segment(directory: str, size: int, rank: int, nlocal: int) -> tuple[int, tuple]:
    """Local rank 0's segment of ``size`` bytes in ``directory``, reserved (so a full
    /dev/shm is a ResourceError now, not a SIGBUS later): (fd, where the others open it)
    — ``("fd", pid, fd, st_dev, st_ino)`` for a nameless file (O_TMPFILE: nothing is
    left in the directory whatever ends the job), else ``("path", path)`` where the
    directory's file system has no O_TMPFILE (named, unlinked once all have mapped it)."""
    fd, path = -1, ""
    try:
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            path = os.path.join(directory, _fresh_name())
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                st = os.statvfs(directory)
                raise ResourceError(
                    f"rank {rank}: cannot reserve {size / 2**20:.1f} MiB in {directory} for "
                    f"{nlocal} local ranks ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB "
                    f"free); make it larger (docker --shm-size) or lower GPURT_SHM_SLOT / "
                    f"GPURT_SHM_SLOTS / GPURT_SHM_STAGE") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    except BaseException:
        if fd >= 0:
            os.close(fd)
            if path:                # (ours: another's name is never removed)
                try:
                    os.unlink(path)
                except OSError:
                    pass
        raise
    if path:
        return fd, ("path", path)
    st = os.fstat(fd)
    return fd, ("fd", os.getpid(), fd, st.st_dev, st.st_ino)


def _open_segment(how: tuple) -> int:
    """Open local rank 0's segment: through its descriptor (the same file: device and
    inode checked) or by name."""
    if how[0] == "path":
        return os.open(how[1], os.O_RDWR)
    f = os.open(_segment_name(how), os.O_RDWR)
    st = os.fstat(f)
    if (st.st_dev, st.st_ino) != (how[3], how[4]):
        os.close(f)
        raise OSError(errno.ESTALE, "not the segment local rank 0 made (descriptor reused)")
    return f


def clean_stale(directory: str, min_age: float = 30.0) -> list[str]:
    """Remove segments whose creating process is gone (left by a crash between create
    and unlink).  Returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = re.match(rf"{PREFIX}(\d+)-\d+(-[0-9a-f]+)?$", name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            if now - os.stat(path).st_mtime < min_age or _pid_alive(int(m.group(1))):
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    return removed


STAGE_AUTO = 2 << 20      # GPURT_SHM_STAGE=auto: the staging room (where staging is used)


def geometry(nlocal: int) -> tuple[int, int, int, int, int]:
    """(slot bytes, slots on the collective lane, slots on the p2p lane, board limit, board
    buffer bytes) for ``nlocal`` ranks: the configured sizes, with the slots shrunk (size
    down to 16 KiB, then count down to 2) until a rank's rings to its local peers fit in
    ``GPURT_SHM_RING_MEM``, then (the staging room first, then slot size, then slot count,
    then the board) until the segment fits in a quarter of the free space in the shm
    directory.  The board's buffers hold the one-round protocol's data (up to the limit,
    ``GPURT_SHM_BOARD``) and a staged allreduce's input (up to ``GPURT_SHM_STAGE``, at most
    32 MiB / ``nlocal``)."""
    slot = max(4096, int(config.get("GPURT_SHM_SLOT")) // 64 * 64)
    nslots = max(2, int(config.get("GPURT_SHM_SLOTS")))
    try:
        st = os.statvfs(str(config.get("GPURT_SHM_DIR")))
        budget = st.f_bavail * st.f_frsize // 4
    except OSError:
        budget = 1 << 30
    pairs = nlocal * (nlocal - 1)
    board = int(config.get("GPURT_SHM_BOARD")) // 64 * 64
    stage = config.get("GPURT_SHM_STAGE")
    stage = min(STAGE_AUTO if stage == "auto" else int(stage),
                (32 << 20) // max(1, nlocal)) // 4096 * 4096
    stage = stage if board and stage > board else 0

    def size(s: int, k: int) -> int:
        rings = pairs * (2 * _CTRL + (k + max(2, k // 2)) * (s + _SLOT_HDR))
        return (header_bytes(nlocal) + rings
                + (shm_board.region_bytes(nlocal, max(board, stage)) if board else 0))

    # a rank's rings to all its local peers within GPURT_SHM_RING_MEM: the segment grows
    # with the square of the local ranks (3 GiB for 32 with the default slots: 26 s of
    # start-up on 2 cores), while a busy node's pairs each need less room
    mine = int(config.get("GPURT_SHM_RING_MEM"))

    def per_rank(s: int, k: int) -> int:
        return (nlocal - 1) * (k + max(2, k // 2)) * (s + _SLOT_HDR)

    while mine and per_rank(slot, nslots) > mine and slot > 16384:
        slot = max(16384, slot // 2 // 64 * 64)   # (slots stay 64-byte aligned)
    while mine and per_rank(slot, nslots) > mine and nslots > 2:
        nslots -= 1
    while size(slot, nslots) > budget and stage > board:
        stage = stage // 2 // 4096 * 4096
    stage = stage if stage > board else 0
    while size(slot, nslots) > budget and slot > 16384:
        slot = max(16384, slot // 2 // 64 * 64)   # (slots stay 64-byte aligned)
    while size(slot, nslots) > budget and nslots > 2:
        nslots -= 1
    while size(slot, nslots) > budget and board > 4096:
        board //= 2
    return slot, nslots, max(2, nslots // 2), board, max(board, stage)


class _Segment:
    """The mapped segment and the arithmetic of its layout."""

    def __init__(self, fd: int, size: int, nlocal: int, slot: int, nslots: tuple[int, int]):
        self.size, self.nlocal, self.slot, self.nslots = size, nlocal, slot, nslots
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.u8 = np.frombuffer(self.mm, dtype=np.uint8)
        self.q = memoryview(self.mm).cast("Q")
        self.ring_bytes = [_CTRL + k * (slot + _SLOT_HDR) for k in nslots]
        self.hdr = header_bytes(nlocal)

    def pid_i(self, k: int) -> int:
        """Word index of local rank k's pid."""
        return 8 + k

    def probe_i(self, k: int) -> int:
        """Word index of local rank k's single-copy probe address."""
        return 8 + self.nlocal + k

    def err_off(self, k: int) -> int:
        """Byte offset of local rank k's error record (length word, then UTF-8 text)."""
        return (8 + 2 * self.nlocal) * 8 + _ERR * k

    def ack_i(self, src: int, dst: int, lane: int) -> int:
        """Word index of the count of ``src``'s device messages on ``lane`` that ``dst``
        has finished reading (written by ``dst`` only)."""
        return ((8 + 2 * self.nlocal) * 8 + _ERR * self.nlocal) // 8 + \
            (src * self.nlocal + dst) * LANES + lane

    def write_error(self, k: int, text: str, closed: bool = False,
                    replace_close: bool = False) -> None:
        """Local rank k's fatal error (``closed``: its close notice — a plain close(),
        not a failure — which marks the length word with CLOSED).  The first word stays
        (an error is not a close), except that ``replace_close`` turns a close notice
        into this error."""
        data = fit_text(text, _ERR - 8)
        off = self.err_off(k)
        w = self.q[off // 8]
        if w and not (replace_close and w & CLOSED and not closed):
            return
        if w:
            self.q[off // 8] = 0    # (a reader in between sees neither)
            _fence()
        self.u8[off + 8:off + 8 + len(data)] = np.frombuffer(data, np.uint8)
        _fence()
        self.q[off // 8] = len(data) | (CLOSED if closed else 0)

    def read_error(self, k: int, closed: bool = False) -> str:
        """Local rank k's fatal error, or with ``closed`` its close notice; "" if it has
        published none (of that kind)."""
        off = self.err_off(k)
        n = int(self.q[off // 8])
        if not n or bool(n & CLOSED) != closed:
            return ""
        n &= CLOSED - 1
        _fence()
        return bytes(self.u8[off + 8:off + 8 + min(n, _ERR - 8)]).decode("utf-8", "replace")

    def ring_offset(self, src: int, dst: int, lane: int) -> int:
        pair = src * (self.nlocal - 1) + (dst if dst < src else dst - 1)
        return self.hdr + pair * sum(self.ring_bytes) + sum(self.ring_bytes[:lane])

    def close(self) -> None:
        try:
            self.q.release()
        except Exception:  # noqa: BLE001 - views may still be alive; the GC unmaps
            pass
        self.u8 = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass


class _Msg:
    """One message in flight on a ring (either direction)."""

    __slots__ = ("peer", "data", "sink", "total", "tag", "sig", "off", "started", "done",
                 "ring", "lane", "ack", "remote", "src", "help", "upto")

    def __init__(self, ring, peer: int, lane: int, total: int, tag: int, sig: int,
                 data: np.ndarray | None = None, sink: Sink | None = None):
        self.ring, self.peer, self.lane = ring, peer, lane
        self.data, self.sink, self.total = data, sink, total
        self.tag, self.sig = tag & 0xFFFFFFFFFFFFFFFF, sig & 0xFFFFFFFFFFFFFFFF
        self.off, self.started, self.done = 0, False, False
        self.ack = 0        # sender, single copy: done once the peer acknowledges this many
        self.remote = 0     # receiver, single copy: the sender's address
        self.src = None     # receiver, single copy from a peer's shared array: its bytes
        self.help = None    # receiver, cooperative single copy: (gen, chunks, chunk, bytes)
        self.upto = False   # receiver: a message of at most ``total`` bytes is accepted

    def test(self) -> bool:
        if not self.done:
            ring = self.ring
            ring.progress()
            if self.ack:
                if ring.seg.q[ring.ack_i] >= self.ack:
                    self.done, self.data = True, None
                elif ring.can_help:
                    ring.help_copy(self)    # waiting anyway: copy chunks for the peer
        return self.done


class _Ring:
    """One direction of one lane between two local ranks, seen from one end."""

    def __init__(self, seg: _Segment, src: int, dst: int, lane: int, me_is_sender: bool):
        base = seg.ring_offset(src, dst, lane)
        self.seg, self.lane = seg, lane
        self.src = src       # the sending end's local rank (its error record: _trust)
        self.nslots, self.slot = seg.nslots[lane], seg.slot
        # control: head (+0, the sender's), tail and single-copy acks (+64, +72: the receiver's)
        self.head_i, self.tail_i, self.ack_i = base // 8, (base + 64) // 8, (base + 72) // 8
        # cooperative single copy (the receiver's line): claim word (generation << 32 |
        # next chunk), chunks done (same form), destination, source, bytes, chunk size,
        # and where the destination is a shared array (gpurt.sharedmem): its location
        # word and offset (0, 0 if it is not one)
        self.claim_i, self.hdone_i = (base + 80) // 8, (base + 88) // 8
        self.hdst_i, self.hsrc_i = (base + 96) // 8, (base + 104) // 8
        self.hlen_i, self.hchunk_i = (base + 112) // 8, (base + 120) // 8
        self.hdloc_i, self.hdoff_i = (base + 128) // 8, (base + 136) // 8
        addr = cma.address(seg.u8)
        self.claim_addr, self.hdone_addr = addr + base + 80, addr + base + 88
        self.help_min = 0    # receiver: plain single-copy receives of >= this many bytes are
                             # offered to the sender for help (0: never)
        self.can_help = False   # sender: copy chunks into the peer while waiting for its ack
        self.helped = 0         # chunks copied for the other end (sender) / by itself (receiver)
        self.copied = False     # receiver: the last _read_remote copied a chunk
        self.mid = False        # receiver: inside its own chunk's copy
        self.open_help: _Msg | None = None   # receiver: the message whose chunks are offered
        offs = [base + _CTRL + k * (self.slot + _SLOT_HDR) for k in range(self.nslots)]
        self.hdr_i = [o // 8 for o in offs]
        self.data = [seg.u8[o + _SLOT_HDR:o + _SLOT_HDR + self.slot] for o in offs]
        self.count = 0       # my counter (head if sender, tail if receiver): I am its only writer
        self.seen = 0        # last value read of the other end's counter
        self.sender = me_is_sender
        self.queue: deque[_Msg] = deque()
        self.cma_min = 0     # messages of at least this many bytes go single-copy (0: never)
        self.map_min = 0     # ... and those from a shared array (gpurt.sharedmem), read
                             # through a mapping of it (0: never)
        self.writev = False  # sender: may write into the peer with process_vm_writev
        self.maps: sharedmem.PeerMaps | None = None   # the peer's shared arrays mapped here
        self.acks = 0        # single-copy messages sent (sender) / completed (receiver:
                             # as its ack word, which the compiled end bumps too)
        self.peer_pid = 0
        self.cma_ok = False     # receiver: process_vm_readv allowed from the peer
        self.unmapped_told = False   # receiver: warned once that a mapping failed
        self.bounce: np.ndarray | None = None   # receiver: where reduced data lands first

    # -- sender side ---------------------------------------------------------
    def _push(self) -> bool:
        q, moved = self.seg.q, False
        while self.queue:
            m = self.queue[0]
            while not m.done:
                if self.count - self.seen >= self.nslots:
                    self.seen = q[self.tail_i]
                    if self.count - self.seen >= self.nslots:
                        return moved
                k = self.count % self.nslots
                h = self.hdr_i[k]
                loc, addr = None, 0
                if self.map_min and m.total >= self.map_min:
                    addr = cma.address(m.data)
                    loc = sharedmem.lookup(addr, m.total)
                if loc is not None or self.cma_min and m.total >= self.cma_min:
                    # single copy: publish where the data is — an address for
                    # process_vm_readv, and in a shared array its location, for a mapping
                    # of it — the peer reads it and acks
                    q[h], q[h + 1], q[h + 2], q[h + 3], q[h + 4] = m.tag, m.sig, m.total, 0, 0
                    q[h + 5] = addr or cma.address(m.data)
                    q[h + 6], q[h + 7] = loc if loc is not None else (0, 0)
                    self.acks += 1
                    m.ack, m.off = self.acks, m.total
                else:
                    n = min(self.slot, m.total - m.off)
                    if n:
                        self.data[k][:n] = m.data[m.off:m.off + n]
                    q[h], q[h + 1], q[h + 2], q[h + 3], q[h + 4] = m.tag, m.sig, m.total, m.off, n
                    q[h + 5] = 0
                    m.off += n
                _fence()
                self.count += 1
                q[self.head_i] = self.count
                moved = True
                if m.off >= m.total:
                    if m.ack:
                        break       # in flight until acknowledged (see _Msg.test)
                    m.done = True
                    m.data = None
            self.queue.popleft()
        return moved

    # -- receiver side -------------------------------------------------------
    def _pull(self, post: bool = False) -> bool:
        q, moved = self.seg.q, False
        while self.queue:
            m = self.queue[0]
            while not m.done:
                if m.remote:
                    if post:
                        # a receive being posted reads no single-copy message yet: its
                        # caller's next call may be the send its peer waits for (irecv,
                        # then isend), and the peer's copy of it should run beside this
                        # one, not after it (as the compiled end's irecv: Communicator._qrecv)
                        return moved
                    self.copied = False
                    if not self._read_remote(m):
                        # the sender is copying its last chunks: progress only if this
                        # call copied some (else the caller's wait backs off, yields)
                        return moved or self.copied
                    moved = True
                    continue
                if self.count == self.seen:
                    self.seen = q[self.head_i]
                    if self.count == self.seen:
                        return moved
                _fence()
                k = self.count % self.nslots
                h = self.hdr_i[k]
                tag, sig, total, off, n = q[h], q[h + 1], q[h + 2], q[h + 3], q[h + 4]
                if tag != m.tag or sig != m.sig or total != m.total or off != m.off:
                    if m.upto and not m.off and not off and tag == m.tag and \
                            sig == m.sig and total <= m.total:
                        m.total = total         # the shorter message this receive accepts
                    else:
                        self._mismatch(m, tag, sig, total, off)
                remote = q[h + 5]
                if remote:
                    self._trust(m, "")      # (its shared array may be gone with it)
                    m.remote = remote   # single copy: read from the sender's memory below
                    if q[h + 6] and self.maps is not None:   # ... or its shared array
                        try:
                            m.src = self.maps.view(q[h + 6], q[h + 7], total)
                        except TransportError as e:
                            self._unmapped(m, total, e)     # (m.src stays None)
                elif n:
                    m.sink(off, self.data[k][:n])
                self.count += 1
                _fence()
                q[self.tail_i] = self.count     # the slot is free again at once
                m.off += n
                moved = True
                if m.off >= m.total and not m.remote:
                    m.done = True
                    m.sink = None
            self.queue.popleft()
        return moved

    def _unmapped(self, m: _Msg, total: int, e: TransportError) -> None:
        """The sender's shared array could not be mapped here (``PeerMaps``: no file
        descriptor or memory map left, or the sender gone): ``PeerFailure`` where the
        sender has exited (its array went with it); else the message is read with
        ``process_vm_readv`` from the address it also published, where that is allowed
        here; else ``e``, naming the peer and the message (before: ``TransportError``
        for an exited sender, and a communicator failed where a copy by address would
        have done)."""
        pid = self.peer_pid
        if not _pid_alive(pid):
            raise PeerFailure(f"rank {m.peer} (pid {pid}, same node) has exited with its "
                              f"{total}-byte message to this rank unread (single copy from "
                              f"its shared array)", rank=m.peer) from None
        if self.cma_ok:
            if not self.unmapped_told:
                self.unmapped_told = True
                log.warning("shm: %s; reading rank %d's shared arrays with "
                            "process_vm_readv instead", e.args[0], m.peer)
            return
        raise TransportError(f"{e.args[0]} (its {total}-byte message to this rank; "
                             f"process_vm_readv is not allowed here either)") from None

    def _read_remote(self, m: _Msg) -> bool:
        """Single copy: read the rest of ``m`` from the sender's memory — straight into the
        destination for a plain receive (shared with the sender, chunk by chunk, when it is
        large: ``_help_read``), through a cache-sized bounce buffer for a reduction — then
        acknowledge.  False while chunks the sender took are still being copied.  From a
        sender's shared array (``m.src``) it is a memcpy out of a mapping of it, and a
        reduction reads it in place."""
        if not m.off:
            self._trust(m, "")          # (not worth reading what is revoked)
        dst = getattr(m.sink, "dst", None)
        if dst is not None:
            if m.help is None and self.help_min and not m.off and m.total >= self.help_min:
                self._open_help(m, dst)
            if m.help is not None:
                try:
                    if not self._help_read(m, dst):
                        return False
                except BaseException:
                    self.seal_help()
                    raise
                self.open_help = None
                m.off = m.total
            else:       # (at most _READ_MAX per advance: the wait checks its deadline)
                end = min(m.off + _READ_MAX, m.total)
                if m.src is not None:
                    memcopy.copyto(dst[m.off:end], m.src[m.off:end], m.total)
                else:
                    cma.read(self.peer_pid, m.remote + m.off, dst[m.off:end], m.peer)
                m.off = end
                if end < m.total:
                    return False
        else:       # a reduction, in cache-sized pieces: read in place from a shared
            if m.src is None and self.bounce is None:   # array, else through the bounce
                self.bounce = np.empty(_BOUNCE, np.uint8)
            stop = min(m.off + _READ_MAX, m.total)
            while m.off < stop:
                n = min(_BOUNCE, stop - m.off)
                if m.src is not None:
                    chunk = m.src[m.off:m.off + n]
                else:
                    chunk = self.bounce[:n]
                    cma.read(self.peer_pid, m.remote + m.off, chunk, m.peer)
                m.sink(m.off, chunk)
                m.off += n
            if m.off < m.total:
                return False
        self._trust(m, "before this rank finished reading it: what was read cannot be "
                       "trusted")
        q = self.seg.q
        self.acks = int(q[self.ack_i]) + 1    # (the word is the count: the compiled end
        q[self.ack_i] = self.acks             # acknowledges there too, P2PRing.get)
        m.done, m.sink, m.remote, m.help, m.src = True, None, 0, None, None
        return True

    def _trust(self, m: _Msg, when: str) -> None:
        """A single-copy message is read in place from the sender's memory, which is the
        sender's again once it has failed (or closed, and given up waiting for this
        read): its program may be writing it.  The sender publishes that (its error
        record) before its caller gets the buffer back, so a read that finds no record
        after it ended read the bytes as sent; else ``PeerFailure``, never stale data."""
        err = self.seg.read_error(self.src)
        if err:
            pid = self.peer_pid
            raise from_peer(err, f"rank {m.peer} (pid {pid}, same node) failed with its "
                                 f"{m.total}-byte message to this rank unread in its memory "
                                 f"(single copy){' ' + when if when else ''}: {err}",
                            relayed_rank(err, m.peer))

    # -- cooperative single copy -----------------------------------------------
    # process_vm_readv copies at ~1/3 of memcpy's speed here, and in a one-to-one transfer
    # (broadcast, gather, a tree's edge) the sender has nothing to do but wait for the
    # ack.  So the receiver cuts a large plain receive into chunks that either end takes
    # with a compare-and-swap on a claim word (gpurt._fastboard.claim): the receiver reads
    # its chunks (readv), the sender writes its chunks into the receiver's buffer (writev)
    # while it polls for the ack, and the receiver acknowledges once every chunk is done.
    # The claim word carries the message's ack number as its generation, so a sender
    # that looks late never takes a chunk of another message; a sender that never looks
    # (busy elsewhere, or without the extension) leaves every chunk to the receiver.

    def _open_help(self, m: _Msg, dst: np.ndarray) -> None:
        q = self.seg.q
        gen = (int(q[self.ack_i]) + 1) & 0xFFFFFFFF   # = the sender's m.ack for this message
        nbytes = m.total                         # (opened only at m.off == 0)
        chunk = _HELP_CHUNK
        q[self.claim_i] = (gen << 32) | 0xFFFFFFFF   # closed while the words below change
        _fence()
        q[self.hdst_i] = cma.address(dst)
        q[self.hsrc_i] = m.remote
        q[self.hlen_i] = nbytes
        q[self.hchunk_i] = chunk
        loc = sharedmem.lookup(q[self.hdst_i], nbytes) if self.maps is not None else None
        q[self.hdloc_i], q[self.hdoff_i] = loc if loc is not None else (0, 0)
        q[self.hdone_i] = gen << 32
        _fence()
        q[self.claim_i] = gen << 32              # open: chunks can be taken
        m.help = (gen, -(-nbytes // chunk), chunk, nbytes)
        self.open_help = m

    def _help_read(self, m: _Msg, dstv: np.ndarray) -> bool:
        """Receiver: copy the chunks of the open message that nobody took yet — at most
        ``_HELP_READ_MAX`` per call, so that the caller's wait checks its deadline between
        them (a 1 GiB receive with a 5 ms timeout copied everything first, overshooting
        by seconds, then timed out with every byte there); True once every chunk is in."""
        gen, nch, chunk, nbytes = m.help
        q = self.seg.q
        dst, src, srcv = q[self.hdst_i], q[self.hsrc_i], m.src
        claim, add = shm_board.NATIVE.claim, shm_board.NATIVE.fetch_add
        for _ in range(_HELP_READ_MAX):
            c = claim(self.claim_addr, gen, nch)
            if c < 0:
                break
            off = c * chunk
            self.mid = True
            if srcv is not None:
                end = min(off + chunk, nbytes)
                memcopy.copyto(dstv[off:end], srcv[off:end], nbytes)
            else:
                cma.copy(self.peer_pid, dst + off, src + off, min(chunk, nbytes - off), False,
                         m.peer)
            add(self.hdone_addr, 1)
            self.mid = False
            self.helped += 1
            self.copied = True
        w = q[self.hdone_i]
        return w >> 32 == gen and (w & 0xFFFFFFFF) >= nch

    def seal_help(self, bound: float = 1.0) -> None:
        """Giving up on the open message (an error here, or the communicator failed): no
        chunk can be taken any more, and — for up to ``bound`` seconds — the chunks the
        sender already took are waited for, so that no write into the destination lands
        after the caller has it back (a sender stopped mid-chunk past the bound is the
        one case left: the communicator is failed then, and says so)."""
        m = self.open_help
        if m is None or m.help is None or shm_board.NATIVE is None:
            return
        gen = m.help[0]
        self.open_help, m.help = None, None
        taken = shm_board.NATIVE.seal(self.claim_addr, gen)
        if taken <= 0:
            return
        mine = 1 if self.mid else 0       # a chunk of ours cut short is never counted
        q, deadline = self.seg.q, time.monotonic() + bound
        while time.monotonic() < deadline:
            w = q[self.hdone_i]
            if w >> 32 != gen or (w & 0xFFFFFFFF) + mine >= taken:
                return
            time.sleep(1e-4)

    def help_copy(self, m: _Msg) -> None:
        """Sender: copy chunks of ``m`` (at most 8, 4 MiB, per call, so the caller's wait
        still checks its deadline) into the peer's buffer, if the peer offers them."""
        q = self.seg.q
        gen = m.ack & 0xFFFFFFFF
        w = q[self.claim_i]
        if w >> 32 != gen or w & 0xFFFFFFFF == 0xFFFFFFFF:
            return
        # open for our message: the words below are the receiver's for it (they change
        # only after the claim word has moved on, and then the claims below fail)
        nbytes, chunk = m.total, _HELP_CHUNK
        nch = -(-nbytes // chunk)
        dstv = None
        if q[self.hdloc_i] and self.maps is not None:
            try:        # its destination is a shared array: memcpy into a mapping of it
                dstv = self.maps.view(q[self.hdloc_i], q[self.hdoff_i], nbytes)
            except TransportError as e:
                log.debug("shm: not helping rank %d: %s", m.peer, e)
        if dstv is None and not self.writev:
            return      # nothing claimed: the receiver copies every chunk itself
        src = cma.address(m.data)
        claim, add = shm_board.NATIVE.claim, shm_board.NATIVE.fetch_add
        for _ in range(8):
            c = claim(self.claim_addr, gen, nch)
            if c < 0:
                return
            # taken: the receiver waits for this chunk, so its destination is ours
            off = c * chunk
            end = min(off + chunk, nbytes)
            if dstv is not None:
                memcopy.copyto(dstv[off:end], m.data[off:end], nbytes)
            else:
                cma.copy(self.peer_pid, src + off, q[self.hdst_i] + off, end - off, True,
                         m.peer)
            add(self.hdone_addr, 1)
            self.helped += 1

    def progress(self) -> bool:
        return self._push() if self.sender else self._pull()

    def _mismatch(self, m: _Msg, tag: int, sig: int, total: int, off: int) -> None:
        lane = LANE_NAMES[self.lane]
        detail = mismatch_detail(self.lane, tag, sig, total, m.tag, m.sig, m.total,
                                 m.upto) or \
            f"chunk at byte {off}, expected byte {m.off}"
        raise CollectiveMismatchError(
            f"message from rank {m.peer} on the shm {lane} lane does not match the "
            f"receive posted here: {detail}")


class ShmEndpoint:
    transport = "shm"

    def __init__(self, owner: "ShmTransport", peer: int, local_peer: int):
        self.owner, self.peer, self.local_peer = owner, peer, local_peer
        me, seg = owner.local_rank, owner.seg
        self.tx = [_Ring(seg, me, local_peer, lane, True) for lane in range(LANES)]
        self.rx = [_Ring(seg, local_peer, me, lane, False) for lane in range(LANES)]
        self._pid = 0
        self.err_i = seg.err_off(local_peer) // 8      # the peer's error record's word
        self._proc: _PeerProc | None = None            # the peer process (_PeerProc)
        self._closed_seen = False
        self.maps: sharedmem.PeerMaps | None = None     # the peer's shared arrays

    def send(self, src: np.ndarray, lane: int, tag: int, sig: int) -> _Msg:
        w = self.owner.seg.q[self.err_i]
        if w and not w & CLOSED:
            # failed: a message into its ring would complete, and be lost.  (A peer that
            # only closed is left to the receives: its rejection of this call's input,
            # say, then comes first as the error this call raises)
            self._gone()
        p = self._proc
        if p is None or p.gone or w or time.monotonic() - p.checked > _SEND_CHECK:
            self._send_check(w)
        ring = self.tx[lane]
        m = _Msg(ring, self.peer, lane, src.nbytes, tag, sig, data=src)
        ring.queue.append(m)
        ring._push()
        return m

    def recv(self, nbytes: int, sink: Sink, lane: int, tag: int, sig: int,
             upto: bool = False) -> _Msg:
        if upto and nbytes >= UPTO_MAX:
            raise ValueError(f"an upto receive is for messages under {UPTO_MAX} bytes")
        ring = self.rx[lane]
        m = _Msg(ring, self.peer, lane, nbytes, tag, sig, sink=sink)
        m.upto = upto
        ring.queue.append(m)
        ring._pull(True)
        return m

    def _process(self) -> _PeerProc:
        if self._proc is None:
            seg = self.owner.seg
            if not self._pid:
                self._pid = seg.q[seg.pid_i(self.local_peer)]
            self._proc = _peer_proc(self._pid)
        return self._proc

    def _send_check(self, w: int) -> None:
        """A send to a peer that exited without a word (SIGKILL, os._exit, the OOM
        killer), or closed the communicator, would fit in the ring, complete, and be
        lost: PeerFailure instead.  The process state is read at most every _SEND_CHECK
        seconds per peer process (one /proc read), and at once where this process already
        knows it exited (a failed call on another communicator).  A peer that closed with
        messages to this rank still unread here is left to the receives: what it sent
        last (its rejection of this call's input, say) is the error to raise.  A peer
        that dies after the check loses what was sent, as with any eager send: the
        receives and waits are where that shows."""
        if self._process().state(time.monotonic()) == "gone":
            raise PeerFailure(f"rank {self.peer} (pid {self._pid}, same node) has exited: "
                              f"this send to it would be lost", rank=self.peer)
        if w & CLOSED and all(self.owner.seg.q[r.head_i] == r.count for r in self.rx):
            raise PeerFailure(f"rank {self.peer} (pid {self._pid}, same node) has closed the "
                              f"communicator: this send to it would be lost", rank=self.peer)

    def _gone(self) -> None:
        """A send to a peer that has failed: nobody will read it."""
        seg = self.owner.seg
        pid = self._pid or seg.q[seg.pid_i(self.local_peer)]
        err = seg.read_error(self.local_peer)
        raise from_peer(err, f"rank {self.peer} (pid {pid}, same node) failed before this "
                             f"send to it: {err}", relayed_rank(err, self.peer))

    def published(self) -> Exception | None:
        """The failure the peer published (its error record), if any — no system call
        (asked of every peer while a collective waits: ``Communicator._check_peers``)."""
        seg = self.owner.seg
        err = seg.read_error(self.local_peer) if seg is not None else ""
        if not err:
            return None
        pid = self._pid or seg.q[seg.pid_i(self.local_peer)]
        return from_peer(err, f"rank {self.peer} (pid {pid}, same node) failed: {err}",
                         relayed_rank(err, self.peer))

    def check(self) -> None:
        """PeerFailure if the peer process is gone, or has been stopped (SIGSTOP, a
        debugger) for longer than GPURT_PEER_STOPPED; a shorter freeze is not a failure."""
        seg = self.owner.seg
        proc = self._process()
        failed = self.published()
        if failed is not None:
            raise failed
        closed = seg.read_error(self.local_peer, closed=True)
        if closed:
            # everything the peer sent before it closed is in the rings already: a wait
            # that still needs it after one more liveness period (the steps in between
            # read what was there) waits for what will never come
            if self._closed_seen:
                raise PeerFailure(f"rank {self.peer} (pid {self._pid}, same node) {closed}",
                                  rank=self.peer)
            self._closed_seen = True
        now = time.monotonic()
        state = proc.state(now)
        if state == "gone":
            raise PeerFailure(f"rank {self.peer} (pid {self._pid}, same node) has exited",
                              rank=self.peer)
        if proc.stopped_since is not None:
            # (since this process first saw it stopped, on any communicator: a survivor
            # that waits on one call after another is held up once, not once per call)
            bound = float(config.get("GPURT_PEER_STOPPED"))
            if now - proc.stopped_since > bound:
                raise PeerFailure(f"rank {self.peer} (pid {self._pid}, same node) has been "
                                  f"stopped for more than {bound:g} s (SIGSTOP or a "
                                  f"debugger)", rank=self.peer)


class ShmTransport:
    """Shared-memory rings between the ranks of one node (see the module docstring)."""

    name = "shm"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        if not ORDERED:
            return False, WHY_NOT
        d = str(config.get("GPURT_SHM_DIR"))
        try:
            st = os.statvfs(d)
        except OSError as e:
            return False, f"{d} is not usable: {e}"
        if not os.access(d, os.W_OK):
            return False, f"{d} is not writable"
        free = st.f_bavail * st.f_frsize
        ys = cma.yama_scope()
        allowed = bool(config.get("GPURT_SHM_PTRACER"))
        scope = "no Yama" if ys is None else f"Yama ptrace_scope={ys}" + (
            ": the ranks declare each other as ptracers (PR_SET_PTRACER_ANY; "
            "GPURT_SHM_PTRACER=0 does not)" if cma.ptracer_plan(ys, allowed) == "declare"
            else cma.yama_hint(ys, allowed))
        single, single_p2p = cma_threshold(2), cma_threshold_p2p(2)
        auto = config.get("GPURT_SHM_CMA") == "auto"
        p2p_txt = f"send/recv from {single_p2p / 2**10:g} KiB" if single_p2p else \
            "not for send/recv (GPURT_SHM_CMA_P2P=0)"
        cma_txt = (f"single-copy (CMA) for messages >= {single / 2**20:g} MiB"
                   + (" with 2 local ranks (GPURT_SHM_CMA=auto: last-level cache, counted "
                      "up to 32 MiB, / (4 × local ranks), >= 128 KiB)" if auto else "")
                   + f", {p2p_txt}, probed between ranks at start ({scope})"
                   if single else
                   f"single-copy (CMA) for send/recv from {single_p2p / 2**10:g} KiB, probed "
                   f"between ranks at start ({scope}); off for collectives (GPURT_SHM_CMA=0)"
                   if single_p2p else "single-copy (CMA) off (GPURT_SHM_CMA=0)")
        helpmin = int(config.get("GPURT_SHM_HELP"))
        if single and helpmin:
            cma_txt += (f"; single-copy receives >= {helpmin / 2**20:g} MiB copied by both ends "
                        f"where every local rank has a CPU"
                        if shm_board.native_enabled() else
                        "; receiver-only copies (gpurt._fastboard, for the shared claim, is "
                        "not built or GPURT_NATIVE=0)")
        return True, f"{d} has {free / 2**30:.1f} GiB free; {cma_txt}"

    def __init__(self) -> None:
        self.seg: _Segment | None = None
        self.board: shm_board.Board | None = None
        self.cma_why = "not connected"
        self.map_why = "not connected"
        self.writev_why = "not probed"
        self.local_rank = -1
        self.endpoints: dict[int, ShmEndpoint] = {}

    def can_connect(self, topo, me: int, peer: int) -> bool:
        return ORDERED and topo.node_of[me] == topo.node_of[peer]

    def connect(self, peers: list[int], comm) -> dict[int, ShmEndpoint]:
        """Collective over the node communicator ``comm.node_comm`` (every local rank calls
        it, even one with no peers)."""
        topo, node = comm.topo, comm.node_comm
        self.local_rank = node.Get_rank()
        nlocal = node.Get_size()
        memcopy.set_local_ranks(nlocal)
        if nlocal == 1:
            return {}
        geo, bad = None, ""
        if self.local_rank == 0:
            try:
                geo = geometry(nlocal)
            except ValueError as e:   # a bad GPURT_SHM_* value: every local rank raises
                bad = f"rank {comm.rank}: shm: {e}"
        geo, bad = node.bcast((geo, bad), 0)
        if bad:
            raise TransportError(bad)
        slot, k_coll, k_p2p, board, bslot = geo
        ring_bytes = _CTRL + k_coll * (slot + _SLOT_HDR) + _CTRL + k_p2p * (slot + _SLOT_HDR)
        board_off = header_bytes(nlocal) + nlocal * (nlocal - 1) * ring_bytes
        size = board_off + (shm_board.region_bytes(nlocal, bslot) if board else 0)
        directory = str(config.get("GPURT_SHM_DIR"))
        err, fd, where = "", -1, None
        if self.local_rank == 0:
            clean_stale(directory)
            try:
                fd, where = _create_segment(directory, size, comm.rank, nlocal)
            except (OSError, ResourceError) as e:
                err = str(e)
        if size >= _SLEEPY_SETUP:
            # the others sleep while local rank 0 reserves a large segment (~2 GB/s here):
            # with more ranks than cores, naps of up to 10 ms, else 1 ms
            mpi_barrier(node, 1e-2 if oversubscribed(nlocal) else 1e-3)
        where, err = node.bcast((where, err), 0)
        if err:
            # (the same text on every rank of the node, local rank 0's, which names it:
            # the communicator's one error then says it once, not once per rank)
            raise ResourceError(err)
        who = f"local rank {self.local_rank} (rank {comm.rank})"

        def attach(how: tuple) -> str:
            """Open (local rank 0 has it) and map the segment; '' or why not."""
            nonlocal fd
            try:
                if self.local_rank != 0:
                    fd = _open_segment(how)
                self.seg = _Segment(fd, size, nlocal, slot, (k_coll, k_p2p))
                if self.local_rank != 0:
                    os.close(fd)
                    fd = -1
                self.seg.q[self.seg.pid_i(self.local_rank)] = os.getpid()
                return ""
            except OSError as e:
                if fd >= 0 and self.local_rank != 0:
                    os.close(fd)
                    fd = -1
                return f"{who} cannot map {_segment_name(how)}: {e}"

        # a nameless segment (O_TMPFILE) is opened through local rank 0's descriptor: no
        # name in the directory at any time, so no exit, SIGKILL included, leaves one
        need = False
        if where[0] == "fd" and self.local_rank != 0 and \
                os.environ.get("GPURT_TEST_SHM_NO_PROC") == "1":
            need, ok = True, ""              # (tests: /proc/PID/fd out of reach)
        else:
            ok = attach(where)
            if ok and where[0] == "fd" and self.local_rank != 0:
                need, ok = True, ""          # (hidepid, another owner...): by name, below
        got = node.allgather((ok, need))
        errs = [e for e, _ in got if e]
        if any(n for _, n in got) and not errs:
            # a name after all, for the ranks that cannot open the descriptor: linked
            # only now, unlinked once they have mapped it
            path, why = "", ""
            if self.local_rank == 0:
                path = os.path.join(directory, _fresh_name())
                root = -1
                try:    # (linkat with AT_SYMLINK_FOLLOW: os.link uses it only given a dir fd)
                    root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
                    os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=root,
                            follow_symlinks=True)
                except OSError as e:
                    path, why = "", f"local rank 0 (rank {comm.rank}) cannot name the " \
                                    f"segment in {directory}: {e}"
                finally:
                    if root >= 0:
                        os.close(root)
            path, why = node.bcast((path, why), 0)
            ok = why if why and need else attach(("path", path)) if need else ""
            errs = list(dict.fromkeys(e for e in node.allgather(ok) if e))
            if self.local_rank == 0 and path:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if self.local_rank == 0:
            os.close(fd)            # (mapped: the mapping keeps the memory)
            fd = -1
            if where[0] == "path":  # everyone has mapped it (or failed): the name can go
                try:
                    os.unlink(where[1])
                except OSError:
                    pass
        if errs:
            self.close()
            raise TransportError("shm: " + "; ".join(errs))
        if self.local_rank == 0:
            self.seg.q[0] = _MAGIC
        self.cma_why = self._probe_cma(node, comm.rank,
                                       topo.local_ranks[topo.node_of[comm.rank]])
        self.map_why = self._probe_map(node, comm.rank, bool(config.get("GPURT_SHM_SHARED")))
        if board:
            self.board = shm_board.Board(self.seg.q, self.seg.u8, board_off, nlocal,
                                         self.local_rank, bslot, board)
            self.board.error_of = self.seg.read_error
        node_ranks = topo.local_ranks[topo.node_of[comm.rank]]
        self.endpoints = {p: ShmEndpoint(self, p, node_ranks.index(p)) for p in peers}
        threshold = cma_threshold(nlocal)
        threshold_p2p = cma_threshold_p2p(nlocal)
        shared_min = _SHARED_MIN if config.get("GPURT_SHM_SHARED") else 0
        helpmin = int(config.get("GPURT_SHM_HELP"))
        # helping pays with a core to spare for the waiting sender; with more ranks than
        # cores it only shuffles the same copies around (measured: 4 ranks on 2 cores,
        # 16 MiB alltoall, no gain), so it is off there
        help_on = int(config.get("GPURT_SHM_HELP")) > 0 and shm_board.native_enabled() \
            and not oversubscribed(nlocal)
        use_cma = (threshold or threshold_p2p) and not self.cma_why
        use_map = shared_min and not self.map_why
        for ep in self.endpoints.values():
            pid = self.seg.q[self.seg.pid_i(ep.local_peer)]
            ns = getattr(comm, "pidns", None)
            ep._pid = pid
            ep._proc = _peer_proc(pid, not ns or ns[ep.peer] == ns[comm.rank])
            if use_map:
                ep.maps = sharedmem.PeerMaps(pid, ep.peer, comm.rank)
            for ring in ep.rx + ep.tx:
                ring.peer_pid = pid
                ring.maps = ep.maps
            for ring in ep.tx:
                ring.cma_min = (threshold_p2p if ring.lane == LANE_P2P else threshold) \
                    if use_cma else 0
                ring.map_min = shared_min if use_map else 0
                ring.writev = bool(use_cma) and not self.writev_why
                ring.can_help = help_on and (ring.writev or bool(use_map))
            for ring in ep.rx:
                ring.help_min = helpmin if help_on and (use_cma or use_map) else 0
                ring.cma_ok = bool(use_cma)
        return dict(self.endpoints)

    def _probe_map(self, node, rank: int, enabled: bool = True) -> str:
        """Can every local rank map every other's shared arrays (``gpurt.sharedmem``,
        through /proc/<pid>/fd)?  '' if so (agreed by all), else the first reason it
        cannot.  Collective on ``node``: a rank with GPURT_SHM_SHARED=0 (``enabled``
        False) takes part too, and its 'off' turns it off on every rank (it skipped the
        exchanges once, and the others waited in them for good)."""
        me = self.local_rank
        token = struct.pack("<QQ", os.getpid(), _MAGIC)
        mine = loc = None
        if not enabled:
            why = f"off (GPURT_SHM_SHARED=0 on rank {rank})"
        else:
            try:
                mine = sharedmem.empty(len(token), np.uint8)
                mine[:] = np.frombuffer(token, np.uint8)
                loc = sharedmem.lookup(cma.address(mine), len(token))
                why = ""
            except (ResourceError, OSError) as e:
                mine, loc, why = None, None, f"local rank {me} (rank {rank}): {e}"
        infos = node.allgather((os.getpid(), loc, rank, why))
        for k, (pid, ploc, prank, pwhy) in enumerate(infos):
            if k == me or why:
                continue
            if ploc is None:
                why = pwhy or f"rank {prank} could not allocate a shared array"
                continue
            maps = sharedmem.PeerMaps(pid, prank, rank)
            try:
                got = maps.view(ploc[0], ploc[1], len(token)).tobytes()
                if got != struct.pack("<QQ", pid, _MAGIC):
                    why = f"rank {rank} read the wrong bytes from rank {prank}'s shared array"
            except TransportError as e:
                why = str(e)
            finally:
                maps.close()
        whys = [w for w in node.allgather(why) if w]
        del mine
        if whys:
            log.info("shm: reading peers' shared arrays (gpurt.empty) disabled: %s", whys[0])
        return whys[0] if whys else ""

    def _probe_cma(self, node, rank: int, node_ranks) -> str:
        """Can every local rank read every other's memory with process_vm_readv?  ''
        if so (agreed by all), else the first reason it cannot.  Collective on ``node``
        (whose local rank k is rank ``node_ranks[k]``)."""
        me, nlocal, seg = self.local_rank, node.Get_size(), self.seg
        q = seg.q
        # Yama's ptrace_scope=1 refuses process_vm_readv between siblings unless the one
        # read has declared its readers: every rank declares before any peer probes it
        scope = cma.yama_scope()
        uses = config.get("GPURT_SHM_CMA") != 0 or config.get("GPURT_SHM_DIRECT_CMA") != 0 \
            or config.get("GPURT_SHM_CMA_P2P") != 0
        allowed = bool(config.get("GPURT_SHM_PTRACER")) and uses
        done = cma.allow_peers(allowed, scope) if nlocal > 1 else ""
        if done:
            log.info("shm: Yama ptrace_scope=%s: %s", scope, done)
        token = np.frombuffer(struct.pack("<QQ", os.getpid(), _MAGIC), np.uint8).copy()
        q[seg.probe_i(me)] = cma.address(token)
        node.Barrier()
        why = ""
        for k in range(nlocal):
            if k != me and not why:
                pid = q[seg.pid_i(k)]
                expect = struct.pack("<QQ", pid, _MAGIC)
                why = cma.probe(pid, q[seg.probe_i(k)], expect, node_ranks[k])
                if why:
                    why = (f"local rank {me} (rank {rank}) cannot read local rank {k} "
                           f"(rank {node_ranks[k]}): {why}{cma.yama_hint(scope, allowed)}")
        if os.environ.get("GPURT_TEST_FORBID_CMA") == "1":
            # tests only: stands in for a refusal (no CAP_SYS_PTRACE, Yama), which forbids
            # process_vm_readv but not the /proc/<pid>/fd opens of shared arrays (not
            # reproducible as root)
            why = why or f"local rank {me} (rank {rank}): forbidden by GPURT_TEST_FORBID_CMA"
        whys = [w for w in node.allgather(why) if w]
        # the cooperative copy's sender writes (process_vm_writev): the same permission as
        # reading, unless a seccomp filter allows one call and not the other — try it on
        # ourselves (this rank then only never helps; nothing to agree on)
        back = np.zeros_like(token)
        try:
            cma.copy(os.getpid(), cma.address(token), cma.address(back), token.nbytes, True)
            self.writev_why = "" if back.tobytes() == token.tobytes() else \
                "process_vm_writev wrote the wrong bytes"
        except (TransportError, PeerFailure) as e:
            self.writev_why = str(e)
        del token
        if whys:
            log.info("shm: single-copy (CMA) disabled: %s", whys[0])
        return whys[0] if whys else ""

    def publish_error(self, text: str) -> None:
        """Tell the local peers why this rank is going down (read by their ``check``), and
        stop them writing into our receive buffers (cooperative single copy)."""
        if self.seg is not None and self.local_rank >= 0:
            self.seg.write_error(self.local_rank, text)
            if self.board is not None:      # (after the record: a peer reads it then)
                shm_board.revoke(self.board)
        self._seal_helps()

    def _seal_helps(self) -> None:
        for ep in self.endpoints.values():
            for ring in ep.rx:
                try:
                    ring.seal_help()
                except Exception:  # noqa: BLE001 - failing already; best effort
                    pass

    def _drain_single_copy(self, bound: float = 5.0) -> None:
        """A single-copy send's data is read by the peer from *our* memory after we have
        published its address; before unmapping and returning to the caller (who may then
        reuse or free the buffer), wait — boundedly — for the peers to finish reading."""
        if self.seg is None:
            return
        q = self.seg.q
        rings = [(ep.peer, ring) for ep in self.endpoints.values() for ring in ep.tx]
        deadline = time.monotonic() + bound
        seg = self.seg
        mine = q[seg.err_off(self.local_rank) // 8]
        if mine and not mine & CLOSED:
            return      # failed here: the peers read no single-copy send of ours (_trust)
        while True:
            late = [(peer, ring) for peer, ring in rings if q[ring.ack_i] < ring.acks]
            # (a peer that has exited, failed or closed reads nothing any more)
            now = time.monotonic()
            late = [(p, ring) for p, ring in late
                    if not q[self.endpoints[p].err_i]
                    and self.endpoints[p]._process().state(now) != "gone"]
            if not late:
                return
            if time.monotonic() > deadline:
                # the caller gets the buffers back: revoke the sends (an error record in
                # place of the close notice), so a late read raises instead of taking
                # whatever the program writes there next (_Ring._trust)
                who = sorted({p for p, _ in late})
                log.warning("shm: closing with single-copy sends that rank(s) %s did not "
                            "read within %g s; revoked", who, bound)
                seg.write_error(self.local_rank, f"closed the communicator with messages "
                                f"to rank(s) {who} unread after {bound:g} s (single copy: "
                                f"they were revoked)", replace_close=True)
                return
            time.sleep(1e-4)

    def close(self) -> None:
        if self.seg is not None and self.local_rank >= 0:
            # (after an error, the error stays what the peers read)
            self.seg.write_error(self.local_rank, (
                f"closed the communicator {CLOSED_IN_EXCHANGE} (another thread's close(), "
                f"or a signal handler's)" if getattr(self, "staying", False) else
                "closed the communicator (close(), or the process's exit)") +
                " while this rank still waits on it", closed=True)
        self._seal_helps()
        try:
            self._drain_single_copy()
        except Exception:  # noqa: BLE001 - closing must not fail
            pass
        for ep in self.endpoints.values():
            ep.tx = ep.rx = []
            if ep.maps is not None:
                ep.maps.close()
                ep.maps = None
        self.endpoints = {}
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.seg is not None:
            self.seg.close()
            self.seg = None
