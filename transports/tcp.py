"""``tcp``: the host data path over sockets — between nodes, and the fallback everywhere.

How it works
------------
*Set-up* (``connect``, collective over the communicator's MPI control plane):

1. Every rank with tcp peers listens on a port the OS picks (port 0, so no fixed ports and
   no ``EADDRINUSE``), bound to the address it advertises.  One MPI allgather carries each
   rank's address, port, host name and tcp peer list, and from rank 0 a fresh per-
   communicator secret (32 random bytes), so every rank agrees on the secret and on the
   striping settings.
2. Of each pair of ranks the higher connects to the lower's listener, ``GPURT_TCP_STRIPES``
   connections per pair; every connect is non-blocking and one ``poll`` loop drives the
   outgoing connects, the incoming accepts and every handshake at once, so set-up cannot
   deadlock and a stranger that connects and says nothing cannot hold up a legitimate
   peer (an unfinished handshake is dropped after a few seconds), nor can a flood of
   them fill the descriptor table (at most 32 unauthenticated connections beyond the
   expected ones still missing are held; beyond that the oldest is dropped, and an
   accept out of descriptors drops one instead of spinning).
3. Handshake, a mutual challenge-response over the secret, which never crosses the wire:
   the connector sends *hello* ``{magic, version, stripe, from-rank, to-rank,
   communicator-id digest, nonce}``; the acceptor checks magic, version, communicator id,
   that it is rank *to-rank* and expects *from-rank* / *stripe*, and answers ``{nonce',
   HMAC-SHA256(secret, "A" | hello | nonce')}``; the connector verifies that (the listener
   really is its peer), answers ``HMAC-SHA256(secret, "C" | hello | nonce')``; the
   acceptor verifies it and sends one byte ``0x01``.  Anything else — bad magic, another
   job's or communicator's id, an unexpected rank, a duplicate, a wrong HMAC, silence —
   is closed and logged (a warning on the ``gpurt.tcp`` logger naming the remote address
   and the reason), and the rank keeps waiting for its real peers until the set-up
   deadline (``GPURT_TIMEOUT``).  A connector retries a refused or dropped connection
   until then.  A rank whose set-up fails tells every other rank at once through MPI, so
   nobody waits for it until the deadline.  The listener is closed as soon as every
   expected connection is in.

*Address*: ``GPURT_SOCKET_IFNAME`` as NCCL's ``NCCL_SOCKET_IFNAME``: a comma list of
interface-name prefixes (``eth,ib``), ``^`` in front to exclude them (``^docker,lo``),
``=`` in front for exact names (``=eth0``, ``^=eth1``).  Unset: the first interface that
is up, not loopback and not ``docker*``/``virbr*``, with an IPv4 address (enumerated with
``if_nameindex`` and the ``SIOCGIFFLAGS``/``SIOCGIFADDR`` ioctls); loopback (127.0.0.1)
only when there is no other.

*Sockets*: non-blocking; ``TCP_NODELAY``; keepalive with short timers and
``TCP_USER_TIMEOUT`` (``GPURT_TCP_USER_TIMEOUT`` s) so a silently dead link or host is
noticed in seconds, not the kernel's ~15 minutes; ``SO_SNDBUF``/``SO_RCVBUF`` from
``GPURT_TCP_BUFFER`` (0: the kernel's autotuning).  A killed process is noticed at once
(its kernel closes the sockets: EOF or reset).

*Wire format*: every message travels as one or more *frames*, each a 48-byte header
``<IBBHQQQQQ``: magic ``0x50435447``, kind (0 collective lane, 1 point-to-point lane,
2 error notice), flags (0), stripe, tag, signature, total message bytes, this part's
offset, this part's length — then the part's bytes.  Messages of at least
``GPURT_TCP_STRIPE_MIN`` bytes are cut into ``GPURT_TCP_STRIPES`` contiguous parts (cut
on 64-byte boundaries), part *i* on connection *i*; smaller ones go whole on
connection 0, so every message has a part on connection 0.

*Matching*: per peer, lane and connection, frames match the posted receives in order
(FIFO, as on ``shm``); every header field is checked against the receive (tag, signature,
total, offset, length) and a difference is a ``CollectiveMismatchError`` saying what the
peer sent and what this rank expects.  A frame with no receive posted yet (say
point-to-point traffic while a collective is posted) is read into a buffer of its own
(reading never stops, so neither lane can block the other) and consumed by the next
receive.  A plain receive is read straight into its destination (``recv_into``, no extra
copy); a reduction reads into the connection's 256 KiB staging buffer and reduces chunk
by chunk (whole 16-byte units), overlapping the receive.

*Progress*: no threads.  A completion's ``test()`` pumps its endpoint's connections both
ways (writes what is queued, reads everything readable), so two ranks sending to each
other with full buffers cannot deadlock.  ``check()`` pumps and raises ``PeerFailure``
once the connection was reset or timed out, the peer published an error, or every
connection to it is closed; a connection closed by the peer (after its last byte) fails
only the parts it still owed, since with several stripes the others may still be
delivering.  ``wait(timeout)`` blocks in ``select`` (``poll`` past FD_SETSIZE) on every
socket and pumps the ones that became ready, for an idle executor that should wake as
soon as bytes arrive; ``fds()`` lists the sockets.

*Frozen peers*: a stopped process's kernel keeps its connections alive, so each transport
also runs a heartbeat thread (``transports/heartbeat.py``: authenticated UDP datagrams
every 0.5 s, its port exchanged with the set-up); ``check()`` raises ``PeerFailure`` after
``GPURT_PEER_STOPPED`` seconds of silence.

*Failure*: ``publish_error(text)`` (the excepthook, any failure of the communicator)
queues an error frame to every peer and flushes for at most half a second; the peers raise
``PeerFailure("rank R (host) failed: TEXT")``.  A connection that still has frames queued
is ended instead (after what the kernel holds): they point into the buffers of sends
whose callers get them back with the failure, so nothing more may go out, and the head
frame may be half written; the peer fails the message the end cuts and reads the
heartbeat's UDP notice for the reason.  ``close()`` shuts down the sending side (so
queued bytes are delivered before the FIN), discards what is still unread (so the kernel
does not answer with a reset) and closes every socket; no thread, no socket is left.

Measured here (2 vCPU VM, loopback, 2 ranks): 8-byte allreduce ~145 µs (shm ~30 µs with
its board), 16 MiB ~18.5 ms (0.9 GB/s busbw; shm 6.5 ms) — about what a plain Python
socket exchange achieves.  Striping (4 connections) made 16-64 MiB allreduces 1.3-2x
faster with one core per rank but slower with 3 ranks on 2 cores, so it is off by
default.  Cost constants: ``gpurt.tuner`` (``GPURT_COST`` overrides).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import math
import os
import secrets
import select
import socket
import struct
import time
from collections import deque
from itertools import islice

import numpy as np

from gpurt import config
from gpurt.errors import (CollectiveMismatchError, CommunicatorClosed, PeerFailure,
                          ResourceError, TransportError, fit_text, from_peer, published_class,
                          relayed_rank)

from .base import (CLOSED_IN_EXCHANGE, LANE_NAMES, LANES, UPTO_MAX, Sink, Throttle, ensure_fds,
                   mismatch_detail, unpaired)
from .heartbeat import Heartbeat, _pids

log = logging.getLogger("gpurt.tcp")

# -- wire format --------------------------------------------------------------------------
_FRAME = struct.Struct("<IBBHQQQQQ")  # magic, kind, flags, stripe, tag, sig, total, off, n
HDR = _FRAME.size                     # 48
FRAME_MAGIC = 0x50435447              # b"GTCP" little-endian
KIND_ERROR = 2                        # kinds 0, 1 are the lanes
KIND_STAYING = 3                      # (no body) the close that follows is made during
                                      # the peer's own split or dup: it stays in it
_ERR_MAX = 4096                       # bytes of error text carried
_M64 = 0xFFFFFFFFFFFFFFFF

_HELLO = struct.Struct("<8sHHII16s16s")  # magic, version, stripe, from, to, cid digest, nonce
HELLO_MAGIC = b"gpurtTCP"
VERSION = 1
_REPLY = struct.Struct("<16s32s")        # nonce', HMAC("A" | hello | nonce')
_MAC = 32                                # HMAC("C" | hello | nonce')
_ACK = b"\x01"

_fails = 0                  # failures any tcp endpoint of this process has met (send())
_SEND_CHECK = 0.2           # a send reads what its peer sent if nobody did for this long (s)
_HB_INTERVAL = 0.5          # seconds between heartbeats (transports/heartbeat.py)
_IBUF = 256 * 1024          # per-connection staging buffer (reads, reductions)
_DIRECT_MIN = 4096          # plain receives read at least this much straight into dst
STRIPE_FLOOR = 128 << 10    # the least stripe threshold (GPURT_TCP_STRIPE_MIN)
_SPLIT_ALIGN = 64           # stripes are cut on this boundary (keeps elements whole)
_RED_ALIGN = 16             # reductions get chunks of whole 16-byte units (any dtype)
_HANDSHAKE_S = 3.0          # an accepted connection must finish its handshake in this
_ACCEPT_BATCH = 16          # accepts per turn of the set-up loop
_STRANGERS_MAX = 32         # unauthenticated accepted connections held beyond the expected
                            # ones still missing (the rest of base.FD_SPARE stays free): a
                            # flood of strangers cannot fill the descriptor table
_EMFILE_PAUSE_S = 0.1       # out of descriptors with nothing to drop: accept again after this
_REFUSALS_LOGGED = 16       # refused connections logged one by one; beyond, a summary a second
_ABORT_TAG = 0x67_74_63     # MPI tag of the "my set-up failed" notice on comm.mpi
_PUBLISH_S = 0.5            # publish_error flushes for at most this long
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)   # a reset peer is an error, never SIGPIPE
_SELECT_MAX = 1024          # FD_SETSIZE: wait() uses select below it, poll above

# -- interfaces ---------------------------------------------------------------------------
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_VIRTUAL = ("docker", "virbr")


def interfaces() -> list[tuple[str, str, int]]:
    """(name, IPv4 address, flags) of every interface that has an IPv4 address."""
    out = []
    try:
        names = socket.if_nameindex()
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in names:
            req = struct.pack("16s16x", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req), 16)[0]
                addr = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue                     # gone meanwhile, or no IPv4 address
            out.append((name, socket.inet_ntoa(addr[20:24]), flags))
    return out


def pick_address(spec: str = "", ifs: list[tuple[str, str, int]] | None = None
                 ) -> tuple[str, str]:
    """(IPv4 address, interface name) this rank advertises; see the module docstring for
    ``spec`` (``GPURT_SOCKET_IFNAME``).  ``ifs`` replaces the enumeration (tests)."""
    ifs = interfaces() if ifs is None else ifs
    up = [i for i in ifs if i[2] & _IFF_UP]
    have = ", ".join(f"{n} {a}" for n, a, _ in up) or "none"
    spec = spec.strip()
    if spec:
        body = spec
        exclude = body.startswith("^")
        body = body[1:] if exclude else body
        exact = body.startswith("=")
        body = body[1:] if exact else body
        names = [x.strip() for x in body.split(",") if x.strip()]

        def match(name: str) -> bool:
            return name in names if exact else any(name.startswith(p) for p in names)

        cands = [i for i in up if match(i[0]) != exclude]
        if not cands:
            raise TransportError(f"GPURT_SOCKET_IFNAME={spec!r} matches no interface that "
                                 f"is up with an IPv4 address (have: {have})")
        return cands[0][1], cands[0][0]
    for name, addr, flags in up:
        if not flags & _IFF_LOOPBACK and not name.startswith(_VIRTUAL):
            return addr, name
    for name, addr, flags in up:
        if flags & _IFF_LOOPBACK:
            return addr, name
    return "127.0.0.1", "lo"


def _settings() -> tuple[int, int]:
    """(stripes, stripe threshold) from the environment (rank 0's values are used)."""
    stripes = int(config.get("GPURT_TCP_STRIPES"))
    if not 1 <= stripes <= 64:
        raise ValueError(f"GPURT_TCP_STRIPES={stripes} must be between 1 and 64")
    # (never below 128 KiB: the agreement's messages, up to GPURT_NET_FOLD and a header,
    # travel as one frame; larger upto receives, a pair's folds, are kept under smin)
    smin = max(int(config.get("GPURT_TCP_STRIPE_MIN")), STRIPE_FLOOR)
    return stripes, smin


def _tune(sock: socket.socket, bufsize: int) -> None:
    """Buffer sizes: before listen/connect, so the window scale is negotiated for them."""
    if bufsize > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)


def _liveness(sock: socket.socket, user_timeout: float) -> None:
    """No Nagle; a dead link or host noticed in about ``user_timeout`` seconds."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    ut = max(1.0, float(user_timeout))
    for opt, val in (("TCP_KEEPIDLE", max(1, int(ut / 3))), ("TCP_KEEPINTVL", max(1, int(ut / 6))),
                     ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", int(ut * 1000))):
        if hasattr(socket, opt):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
            except OSError:
                pass


def _cid_digest(cid: str) -> bytes:
    return hashlib.sha256(f"gpurt-tcp|{cid}".encode()).digest()[:16]


def _mac(secret: bytes, label: bytes, hello: bytes, nonce2: bytes) -> bytes:
    return hmac.new(secret, label + hello + nonce2, hashlib.sha256).digest()


def _split(total: int, stripes: int, smin: int) -> list[tuple[int, int, int]]:
    """(connection, offset, length) of each part of a ``total``-byte message.  Both ends
    compute the same split (rank 0's settings)."""
    if stripes == 1 or total < smin:
        return [(0, 0, total)]
    cuts = [0] + [(total * i // stripes) // _SPLIT_ALIGN * _SPLIT_ALIGN
                  for i in range(1, stripes)] + [total]
    return [(i, cuts[i], cuts[i + 1] - cuts[i]) for i in range(stripes)]


# -- messages -------------------------------------------------------------------------------
class _Send:
    """Completion of a send: done once every byte of every part is in the kernel."""

    __slots__ = ("peer", "ep", "left", "done", "conns")

    def __init__(self, ep: "TcpEndpoint", nparts: int):
        self.peer, self.ep, self.left, self.done = ep.peer, ep, nparts, False
        self.conns: list[_Conn] = []     # connections still holding a part of it

    def part_done(self, conn: "_Conn") -> None:
        self.left -= 1
        if conn in self.conns:
            self.conns.remove(conn)
        if not self.left:
            self.done = True

    def test(self) -> bool:
        if self.done:
            return True
        ep = self.ep
        ep.pump()
        if self.done:
            return True
        if ep.failure is not None or any(c.dead for c in self.conns):
            ep.raise_failure()
        return False


class _Recv:
    """Completion of a receive of ``total`` bytes with ``tag``/``sig`` on ``lane``."""

    __slots__ = ("peer", "ep", "lane", "tag", "sig", "total", "sink", "dst", "left", "done",
                 "error", "parts", "upto")

    def __init__(self, ep: "TcpEndpoint", lane: int, tag: int, sig: int, total: int, sink: Sink,
                 upto: bool = False):
        self.peer, self.ep, self.lane, self.upto = ep.peer, ep, lane, upto
        self.tag, self.sig, self.total = tag & _M64, sig & _M64, total
        dst = getattr(sink, "dst", None)
        # a plain receive: its destination is written directly (recv_into)
        if dst is not None and isinstance(dst, np.ndarray) and dst.flags.c_contiguous \
                and dst.dtype == np.uint8 and dst.nbytes == total:
            self.dst, self.sink = memoryview(dst), None
        else:
            self.dst, self.sink = None, sink
        self.left, self.done, self.error = 0, False, None
        self.parts: list[_Part] = []

    def part_done(self, part: "_Part") -> None:
        part.done = True
        self.left -= 1
        if not self.left:
            self.done, self.sink, self.dst, self.parts = True, None, None, []

    def test(self) -> bool:
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        ep = self.ep
        ep.pump()
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        if ep.failure is not None or any(p.conn.dead for p in self.parts if not p.done):
            ep.raise_failure()
        return False


class _Part:
    """The part of a posted receive that one connection carries."""

    __slots__ = ("msg", "off", "n", "conn", "done")

    def __init__(self, msg: _Recv, off: int, n: int, conn: "_Conn"):
        self.msg, self.off, self.n, self.conn, self.done = msg, off, n, conn, False


class _Rx:
    """The frame a connection is reading now."""

    __slots__ = ("kind", "n", "got", "part", "sink", "direct", "data", "hdr")

    def __init__(self, kind: int, n: int):
        self.kind, self.n, self.got = kind, n, 0
        self.part: _Part | None = None
        self.sink = None
        self.direct: memoryview | None = None
        self.data: bytearray | None = None
        self.hdr: tuple = ()


class _Out:
    """A frame waiting to be written: what is left of its buffers, and its message."""

    __slots__ = ("bufs", "msg")

    def __init__(self, bufs: list, msg: _Send | None):
        self.bufs, self.msg = bufs, msg


class _Conn:
    """One established connection (one stripe) to a peer."""

    def __init__(self, sock: socket.socket, ep: "TcpEndpoint", stripe: int):
        self.sock, self.fd, self.ep, self.stripe = sock, sock.fileno(), ep, stripe
        self.out: deque[_Out] = deque()
        self.ibuf = bytearray(_IBUF)
        self.iview = memoryview(self.ibuf)
        self.inp = np.frombuffer(self.ibuf, np.uint8)
        self.ilo = self.ihi = 0
        self.cur: _Rx | None = None
        self.posted: list[deque[_Part]] = [deque() for _ in range(LANES)]
        self.unexp: list[deque[tuple[tuple, bytearray]]] = [deque() for _ in range(LANES)]
        self.dead = False
        self.rdead = False          # reading stopped (a mismatch): the sending side still
                                    # carries the error notice that tells the peer why
        #: a write and its bookkeeping are under way; still set after they ended means an
        #: exception from outside (a KeyboardInterrupt) came between the kernel taking
        #: bytes and the record of it: the stream's framing is lost (``torn``)
        self.writing = False

    # -- sending ------------------------------------------------------------------------
    def push(self, bufs: list, msg: _Send | None) -> None:
        if self.writing:            # an earlier write was interrupted (or this is a signal
            self._tear()            # handler's, inside one): no frame may follow it
            if msg is not None:
                msg.conns.append(self)      # (its completion raises the failure)
            return
        self.writing = True
        self._push(bufs, msg)
        self.writing = False

    def flush(self) -> bool:
        """Write what is queued until the kernel takes no more; True if anything went."""
        if self.writing:
            self._tear()
            return False
        self.writing = True
        moved = self._flush()
        self.writing = False
        return moved

    def _tear(self) -> None:
        """The stream's framing is lost on the sending side (see ``writing``): end it (the
        peer sees the end at once) and fail what it carries; ``writing`` stays set, so
        ``publish`` frames no notice after it either."""
        if not self.dead:
            self.dead = True
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self.ep.fail(TransportError, f"the write to {self.ep._who()} on tcp connection "
                                         f"{self.stripe} was interrupted mid-frame (an "
                                         f"exception such as KeyboardInterrupt inside it): "
                                         f"the connection is closed")

    @property
    def torn(self) -> bool:
        """A write was interrupted between the kernel and its record (see ``writing``):
        nothing more may be framed on this connection."""
        return self.writing

    def _push(self, bufs: list, msg: _Send | None) -> None:
        if self.dead:               # the completion raises the endpoint's failure
            if msg is not None:
                msg.conns.append(self)
            return
        if not self.out:
            try:
                k = self.sock.sendmsg(bufs, (), _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                k = 0
            except OSError as e:
                self.ep.lost(self, e)
                return
            for i, b in enumerate(bufs):
                if k < len(b):
                    bufs = bufs[i:]
                    if k:
                        bufs[0] = bufs[0][k:]
                    break
                k -= len(b)
            else:
                if msg is not None:
                    msg.part_done(self)
                return
        if msg is not None:
            msg.conns.append(self)
        self.out.append(_Out(bufs, msg))

    def _flush(self) -> bool:
        out, moved = self.out, False
        while out and not self.dead:
            bufs = out[0].bufs if len(out) == 1 else \
                [b for f in islice(out, 0, 32) for b in f.bufs]
            try:
                k = self.sock.sendmsg(bufs, (), _NOSIGNAL)
            except BlockingIOError:
                return moved
            except InterruptedError:
                continue
            except OSError as e:
                self.ep.lost(self, e)
                return moved
            full = k < sum(len(b) for b in bufs)
            moved = moved or k > 0
            while k:
                f = out[0]
                b = f.bufs[0]
                if k >= len(b):
                    k -= len(b)
                    del f.bufs[0]
                else:
                    f.bufs[0] = b[k:]
                    k = 0
                if not f.bufs:
                    out.popleft()
                    if f.msg is not None:
                        f.msg.part_done(self)
            if full:
                return moved
        return moved

    # -- receiving ----------------------------------------------------------------------
    def read(self) -> bool:
        """Read everything readable now, delivering frames; True if anything moved."""
        moved = drained = False
        sock = self.sock
        while not self.dead and not self.rdead:
            cur = self.cur
            avail = self.ihi - self.ilo
            if cur is None:
                if avail >= HDR:
                    self._begin()
                    moved = True
                    continue
            else:
                need = cur.n - cur.got
                if not need:
                    self._end()
                    moved = True
                    continue
                if avail:
                    take = need if avail >= need else avail
                    if cur.sink is not None and take < need:
                        take -= take % _RED_ALIGN       # reductions: whole elements
                    if take:
                        lo = self.ilo
                        if cur.sink is not None:
                            cur.sink(cur.part.off + cur.got, self.inp[lo:lo + take])
                        else:
                            cur.direct[cur.got:cur.got + take] = self.iview[lo:lo + take]
                        cur.got += take
                        self.ilo = lo + take
                        moved = True
                        continue
                elif cur.direct is not None and need >= _DIRECT_MIN:
                    if drained:
                        return moved
                    k = self._recv_into(sock, cur.direct[cur.got:], need)
                    if not k:
                        return moved
                    cur.got += k
                    moved = True
                    drained = k < need
                    continue
            # more bytes are needed in the staging buffer
            if drained:
                return moved
            if self.ilo:
                if avail:
                    self.ibuf[:avail] = self.iview[self.ilo:self.ihi]
                self.ilo, self.ihi = 0, avail
            room = _IBUF - self.ihi
            k = self._recv_into(sock, self.iview[self.ihi:], room)
            if not k:
                return moved
            self.ihi += k
            moved = True
            drained = k < room
        return moved

    def _recv_into(self, sock: socket.socket, view, n: int) -> int:
        """Up to ``n`` bytes into ``view``; 0 when nothing is there now, or when the
        connection ended (EOF or an error: the endpoint is told)."""
        try:
            k = sock.recv_into(view, n)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            self.ep.lost(self, e)
            return 0
        if not k:
            self.ep.eof(self)
        return k

    def _begin(self) -> None:
        magic, kind, _flags, _stripe, tag, sig, total, off, n = \
            _FRAME.unpack_from(self.ibuf, self.ilo)
        self.ilo += HDR
        if magic != FRAME_MAGIC or kind > KIND_STAYING or (kind == KIND_ERROR and n > _ERR_MAX) \
                or off + n > total or (kind == KIND_STAYING and total):
            self.ep.corrupt(self, f"a malformed frame header (magic {magic:#x}, kind {kind}, "
                                  f"bytes {off}+{n} of {total})")
            return
        if kind == KIND_STAYING:
            self.ep.staying = True
            return
        rx = _Rx(kind, n)
        if kind < LANES and self.posted[kind]:
            part = self.posted[kind].popleft()
            if not self._matches(part, (tag, sig, total, off, n)):
                return
            rx.part = part
            m = part.msg
            if m.dst is not None:
                rx.direct = m.dst[off:off + n]
            else:
                rx.sink = m.sink
        else:                       # no receive posted yet (or an error notice): buffer it
            rx.hdr = (tag, sig, total, off, n)
            try:
                rx.data = bytearray(n)
            except (MemoryError, OverflowError):
                # (a length field no memory holds: the header is consumed, its body is
                # not, so the stream's framing is lost — fail it, never read on in it)
                self.ep.corrupt(self, f"a frame of {n} bytes with no receive posted, more "
                                      f"than this rank can buffer")
                return
            rx.direct = memoryview(rx.data)
        self.cur = rx

    def _end(self) -> None:
        rx, self.cur = self.cur, None
        if rx.part is not None:
            rx.part.msg.part_done(rx.part)
        elif rx.kind == KIND_ERROR:
            self.ep.peer_error(bytes(rx.data).decode("utf-8", "replace"))
        else:
            rx.direct = None
            posted = self.posted[rx.kind]
            if posted:
                self.deliver(posted.popleft(), rx.hdr, rx.data)
            else:
                self.unexp[rx.kind].append((rx.hdr, rx.data))

    def deliver(self, part: _Part, hdr: tuple, data: bytearray) -> None:
        """Hand a buffered frame to the receive it belongs to."""
        if not self._matches(part, hdr):
            return
        m = part.msg
        if part.n:
            if m.dst is not None:
                m.dst[part.off:part.off + part.n] = data
            else:
                m.sink(part.off, np.frombuffer(data, np.uint8))
        m.part_done(part)

    def post(self, part: _Part) -> None:
        lane = part.msg.lane
        if self.unexp[lane]:
            hdr, data = self.unexp[lane].popleft()
            self.deliver(part, hdr, data)
        else:
            self.posted[lane].append(part)

    def _matches(self, part: _Part, hdr: tuple) -> bool:
        tag, sig, total, off, n = hdr
        m = part.msg
        if tag == m.tag and sig == m.sig and total == m.total and off == part.off and n == part.n:
            return True
        if m.upto and tag == m.tag and sig == m.sig and total <= m.total and not off and \
                n == total:          # (one part: an upto receive is below the stripe size)
            part.n = m.total = total
            return True
        detail = mismatch_detail(m.lane, tag, sig, total, m.tag, m.sig, m.total, m.upto) or \
            (f"part at byte {off} ({n} bytes) on connection {self.stripe}, expected "
             f"byte {part.off} ({part.n} bytes)")
        ep = self.ep
        text = (f"message from rank {ep.peer} ({ep.host}) on the tcp {LANE_NAMES[m.lane]} "
                f"lane does not match the receive posted here: {detail}")
        m.error = CollectiveMismatchError(text)
        ep.fail(CollectiveMismatchError, text)
        # the stream's framing is no longer known: stop reading it, but keep the sending
        # side, which is how the peer learns of the mismatch (publish_error)
        self.rdead = True
        return False

    def close(self, staying: bool = False) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            if staying and not self.dead and not self.torn and not self.writing:
                # (the end of the stream then means a close in an exchange the peer
                # waits in too, not an exit: ``TcpEndpoint.eof``)
                self.push([_FRAME.pack(FRAME_MAGIC, KIND_STAYING, 0, self.stripe, 0, 0, 0,
                                       0, 0)], None)
                # (behind frames still queued: given up to _PUBLISH_S to go, as an error
                # notice is — lost, the peers would leave the exchange this rank stays in)
                deadline = time.monotonic() + _PUBLISH_S
                while self.out and not self.dead and not self.torn and \
                        time.monotonic() < deadline:
                    if not self.flush():
                        select.select([], [self.sock], [], 0.01)
            if self.out and not self.dead and not self.torn:
                self.flush()        # a last non-blocking try (an error notice, say)
            sock.shutdown(socket.SHUT_WR)
            for _ in range(64):     # discard what is unread: closing over it sends a reset
                if not sock.recv_into(self.iview, _IBUF):
                    break
        except OSError:
            pass
        finally:
            self.dead, self.sock = True, None
            self.out.clear()
            sock.close()


class TcpEndpoint:
    """The connections (stripes) to one peer."""

    transport = "tcp"

    def __init__(self, owner: "TcpTransport", peer: int, host: str, addr: str,
                 socks: list[socket.socket]):
        self.owner, self.peer, self.host, self.addr = owner, peer, host, addr
        self.conns = [_Conn(s, self, i) for i, s in enumerate(socks)]
        self.failure: tuple[type, str] | None = None
        self.closed = ""            # why a connection is closed (a failure once all are)
        self.staying = False        # the peer said it closes during its own split or dup
        self.reset: str | None = None   # why the peer reset a connection, if it did
        self.told: str | None = None    # the failure the peer published (peer_error)
        self.stripes, self.smin = owner.stripes, owner.smin
        self.polled = -1e18         # time.monotonic() of send()'s last look at the peer
        self.fails = 0              # _fails then

    def look_due(self) -> bool:
        """Is a send due to look at the peer first (``_send_check``)?"""
        return self.failure is not None or self.fails != _fails or \
            time.monotonic() - self.polled > _SEND_CHECK

    def send(self, src: np.ndarray, lane: int, tag: int, sig: int) -> _Send:
        if self.look_due():
            self._send_check()
        total = src.nbytes
        mv = memoryview(src)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        parts = _split(total, self.stripes, self.smin)
        m = _Send(self, len(parts))
        tag, sig = tag & _M64, sig & _M64
        for ci, off, n in parts:
            hdr = _FRAME.pack(FRAME_MAGIC, lane, 0, ci, tag, sig, total, off, n)
            self.conns[ci].push([hdr, mv[off:off + n]] if n else [hdr], m)
        return m

    def _send_check(self) -> None:
        """A send to a peer whose streams ended (it exited, was killed or closed the
        communicator: the kernel takes the bytes, then drops them) would complete, and be
        lost: PeerFailure instead.  Reads what has arrived at most every _SEND_CHECK
        seconds per peer (a non-blocking read), and at once where a failure is known, or
        any endpoint of this process met one since (a failed call on another
        communicator: the same peer's other streams have most likely ended too).  A
        peer that only closed, with bytes of it still unread here, is left to the
        receives: what it sent last (its rejection of this call's input, say) is the
        error to raise."""
        self.polled, self.fails = time.monotonic(), _fails
        if self.failure is None:
            self.pump()
        if self.failure is None:
            return
        if self.failure == (PeerFailure, self.closed) and any(
                c.ilo < c.ihi or c.cur is not None or any(c.unexp) for c in self.conns):
            return
        self.raise_failure()

    def recv(self, nbytes: int, sink: Sink, lane: int, tag: int, sig: int,
             upto: bool = False) -> _Recv:
        if upto and (nbytes >= UPTO_MAX or (self.stripes > 1 and nbytes >= self.smin)):
            # (a message the sender stripes cannot be matched before its length is known)
            raise ValueError(f"an upto receive is for messages under "
                             f"{UPTO_MAX if self.stripes == 1 else min(UPTO_MAX, self.smin)} "
                             f"bytes")
        m = _Recv(self, lane, tag, sig, nbytes, sink, upto)
        parts = [(0, 0, nbytes)] if upto else _split(nbytes, self.stripes, self.smin)
        m.left = len(parts)
        for ci, off, n in parts:
            part = _Part(m, off, n, self.conns[ci])
            m.parts.append(part)
            part.conn.post(part)
        if not m.done and m.error is None:
            self.pump()
        return m

    def pump(self) -> bool:
        moved = False
        for c in self.conns:
            if not c.dead:
                if c.out and c.flush():
                    moved = True
                if c.read():
                    moved = True
        return moved

    def check(self) -> None:
        """Read what is there (an EOF, a reset, an error notice) and raise ``PeerFailure``
        if the peer is gone or failed."""
        self.pump()
        if self.failure is not None:
            self.raise_failure()
        hb = getattr(self.owner, "heartbeat", None)
        # (the peer's datagram only once its stream ended: while the stream lives, what
        # the peer sent before failing is still in it, ahead of its error frame)
        note = hb.notice(self.peer) if hb is not None and \
            any(c.dead for c in self.conns) else None
        if note:
            self.peer_error(note)
            self.raise_failure()
        why = hb.stopped(self.peer, self.host, "stopped (SIGSTOP, a debugger) or hung") \
            if hb is not None else None
        if why:
            self.fail(PeerFailure, why)
            self.raise_failure()

    def published(self) -> Exception | None:
        """The failure the peer published (its error frame, read by an earlier pump, or
        its UDP notice), if any — no system call (asked of every peer while a collective
        waits: ``Communicator._check_peers``)."""
        text = self.told
        if text is None:
            hb = getattr(self.owner, "heartbeat", None)
            text = hb.notice(self.peer) if hb is not None else None
        if text is None:
            return None
        msg = f"rank {self.peer} ({self.host}) failed: {text}"
        return from_peer(text, msg, relayed_rank(text, self.peer))

    # -- failure ------------------------------------------------------------------------
    def fail(self, cls: type, text: str) -> None:
        global _fails
        if self.failure is None:    # the first reason is the one that explains the rest
            self.failure = (cls, text)
            _fails += 1
            log.debug("tcp: %s", text)

    def raise_failure(self) -> None:
        if self.failure is None or self.failure in ((PeerFailure, self.closed),
                                                    (PeerFailure, self.reset)):
            # a peer's stream that just ended (closed, or reset where it closed with bytes
            # of ours unread): its datagram may say why (it failed), and may have come
            # after the end of the stream (another path through the net)
            hb = getattr(self.owner, "heartbeat", None)
            note = hb.notice_now(self.peer) if hb is not None else None
            if note:
                self.failure = None
                self.peer_error(note)
        cls, text = self.failure or (PeerFailure, self.closed)
        if cls is PeerFailure:
            raise PeerFailure(text, rank=getattr(self, "blame", self.peer))
        raise cls(text)

    def _who(self) -> str:
        return f"rank {self.peer} ({self.host}, {self.addr})"

    def eof(self, conn: _Conn) -> None:
        """The peer closed this connection after its last byte.  With several stripes the
        others may still be delivering: only what this one owes fails now (see the
        completions), the endpoint once every connection is closed."""
        conn.dead = True
        self.closed = (f"{self._who()} closed the tcp connection (it closed the communicator "
                       f"{CLOSED_IN_EXCHANGE})" if self.staying else
                       f"{self._who()} closed the tcp connection (it exited, was killed or "
                       f"closed the communicator)")
        if all(c.dead for c in self.conns):
            self.fail(PeerFailure, self.closed)     # (raise_failure: its datagram says why)

    def lost(self, conn: _Conn, e: OSError) -> None:
        conn.dead = True
        if e.errno == errno.ETIMEDOUT:
            why = (f"is unreachable: the tcp connection timed out (no acknowledgement within "
                   f"GPURT_TCP_USER_TIMEOUT={float(config.get('GPURT_TCP_USER_TIMEOUT')):g} s: "
                   f"host down or network cut)")
        elif e.errno in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
            why = (f"reset the tcp connection (it exited, was killed, or dropped the "
                   f"communicator without close()): {e.strerror}")
            if self.failure is None:    # (raise_failure: its datagram may say why)
                self.reset = f"{self._who()} {why}"
        else:
            why = f"tcp connection failed: {e}"
        self.fail(PeerFailure, f"{self._who()} {why}")

    def corrupt(self, conn: _Conn, what: str) -> None:
        conn.dead = True
        self.fail(TransportError, f"{self._who()} sent {what} on tcp connection "
                                  f"{conn.stripe}; the stream cannot be trusted any more")

    def peer_error(self, text: str) -> None:
        self.told = text
        self.blame = relayed_rank(text, self.peer)
        self.fail(published_class(text), f"rank {self.peer} ({self.host}) failed: {text}")

    def publish(self, data: bytes) -> _Conn | None:
        for c in self.conns:
            if c.torn:
                # a write interrupted mid-frame (a KeyboardInterrupt): a notice framed
                # after it would be read as the rest of that frame — end the stream
                # instead (the peer sees its end at once; the UDP notice says why)
                c._tear()
            elif c.out and not c.dead:
                # frames still queued point into the senders' buffers, which their
                # callers get back with this failure and may overwrite: none of it may
                # go out any more (the peer would take the new bytes for the message),
                # and the head frame may be half written — end the stream after what
                # the kernel has (the peer fails the message it cuts; the UDP notice
                # says why)
                c.out.clear()
                c.dead = True
                try:
                    c.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                # (a thread still in a wait here ends with the poison: see
                # Engine._stopped_by_poison)
                self.fail(CommunicatorClosed, f"this rank failed with messages to "
                                              f"{self._who()} still queued on tcp "
                                              f"connection {c.stripe}: the connection was "
                                              f"ended")
        live = [c for c in self.conns if not c.dead]
        if not live:
            return None
        c = min(live, key=lambda c: len(c.out))
        c.push([_FRAME.pack(FRAME_MAGIC, KIND_ERROR, 0, c.stripe, 0, 0, len(data), 0,
                            len(data)), data], None)
        return c


class TcpTransport:
    """Sockets between ranks, authenticated per communicator (see the module docstring)."""

    name = "tcp"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            ip, ifname = pick_address(str(config.get("GPURT_SOCKET_IFNAME")))
            stripes, smin = _settings()
        except (TransportError, ValueError) as e:
            return False, str(e)
        striping = (f"messages >= {smin} B striped over {stripes} connections"
                    if stripes > 1 else "one connection per peer")
        return True, (f"sockets on {ip} ({ifname}), OS-chosen ports, per-job HMAC handshake; "
                      f"{striping}; dead links noticed in "
                      f"~{float(config.get('GPURT_TCP_USER_TIMEOUT')):g} s")

    def __init__(self) -> None:
        self.rank = -1
        self.listener: socket.socket | None = None
        self.endpoints: dict[int, TcpEndpoint] = {}
        self.stripes, self.smin = 1, 1 << 62
        self._loose: list[socket.socket] = []     # set-up sockets not yet owned by an endpoint
        self.address = ""
        self.heartbeat = None                     # transports/heartbeat.py, once connected

    def can_connect(self, topo, me: int, peer: int) -> bool:
        return True                 # the fallback: reaches every peer

    # -- set-up -------------------------------------------------------------------------
    def connect(self, peers: list[int], comm) -> dict[int, TcpEndpoint]:
        """Collective over ``comm.mpi`` (every rank calls it, with or without peers)."""
        mpi = comm.mpi
        me, size = mpi.Get_rank(), mpi.Get_size()
        self.rank = me
        host = socket.gethostname()
        err, ip, port, params, hb_port = "", "", 0, None, 0
        try:
            opts = (float(config.get("GPURT_TCP_USER_TIMEOUT")),
                    int(config.get("GPURT_TCP_BUFFER")), float(config.get("GPURT_TIMEOUT")))
            if not 0 < opts[0] <= 86400:      # (NaN too)
                raise ValueError(f"GPURT_TCP_USER_TIMEOUT={opts[0]} must be above 0 and at "
                                 f"most 86400 seconds")
            if me == 0:
                params = (secrets.token_bytes(32), str(comm.cid)) + _settings()
        except ValueError as e:
            err = f"rank {me} ({host}): {e}"
        # (a setting out of its range is the ValueError every setting's is; it was this
        # one's TransportError)
        kind = ValueError if err else TransportError
        if peers and not err:
            # a socket per peer and stripe, a listener and the heartbeat's: room for them
            # before the first is opened (the stripes rank 0 decides are the usual guess)
            try:
                stripes = min(max(int(config.get("GPURT_TCP_STRIPES")), 1), 64)
                ensure_fds(len(peers) * stripes + 2,
                           f"rank {me} ({host}): tcp to {len(peers)} ranks",
                           f", or open fewer connections per pair (GPURT_TCP_STRIPES="
                           f"{stripes})" if stripes > 1 else "")
            except ResourceError as e:
                err, kind = str(e), ResourceError
            except ValueError as e:       # (a bad GPURT_TCP_STRIPES: rank 0 names it too)
                err, kind = f"rank {me} ({host}): {e}", ValueError
        if peers and not err:
            try:
                ip, ifname = pick_address(str(config.get("GPURT_SOCKET_IFNAME")))
                self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                _tune(self.listener, opts[1])
                self.listener.bind((ip, 0))
                self.listener.listen(min(socket.SOMAXCONN, 128 + 8 * len(peers)))
                self.listener.setblocking(False)
                port = self.listener.getsockname()[1]
                self.address = f"{ip}:{port}"
                self.heartbeat = Heartbeat(ip)
                hb_port = self.heartbeat.port
                log.debug("tcp: rank %d listening on %s:%d (%s) for communicator %s",
                          me, ip, port, ifname, comm.cid)
            except (OSError, TransportError, ValueError) as e:
                err = f"rank {me} ({host}): cannot listen for tcp connections: {e}"
        # one exchange: addresses, ports, hosts, who wants tcp to whom, rank 0's secret
        info = mpi.allgather((err, ip, port, host, sorted(peers), params, hb_port,
                              (TransportError, ValueError, ResourceError).index(kind)))
        if any(i[7] == 2 for i in info):  # a rank lacks room for its sockets: that class
            kind = ResourceError          # on all; a setting not valid: ValueError
        elif any(i[7] == 1 for i in info):
            kind = ValueError
        errs = list(dict.fromkeys(i[0] for i in info if i[0]))
        peer_sets = [set(i[4]) for i in info]
        errs += unpaired("tcp", peer_sets, "does GPURT_TRANSPORTS differ between ranks?")
        if errs:
            self.close()
            raise kind("tcp: " + "; ".join(errs[:3]) +
                       (f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""))
        if not any(peer_sets):
            self.close()
            return {}
        secret, cid, self.stripes, self.smin = info[0][5]
        setup = _Setup(self, mpi, me, host, secret, cid, peers, info, opts[0], opts[1])
        notified, socks = False, {}
        try:
            socks = setup.run(time.monotonic() + opts[2])
        except _Abort as e:
            err, notified = str(e), e.notified
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange below
            err = f"rank {me} ({host}): tcp set-up failed: {type(e).__name__}: {e}"
            setup.notify(err)
            notified = True
        finally:
            setup.close_pending()
        # who told everyone that it failed: receive exactly those notices (nothing stays
        # queued on the communicator), and every rank raises
        told = mpi.allgather(notified)
        texts = setup.drain([q for q in range(size) if told[q] and q != me])
        err = err or next(iter(texts.values()), "")
        if err:
            self.close()
            raise TransportError(err)
        for q in peers:
            self.endpoints[q] = TcpEndpoint(self, q, info[q][3], f"{info[q][1]}:{info[q][2]}",
                                            [socks[(q, s)] for s in range(self.stripes)])
        self._loose = []            # owned by the endpoints now
        # a frozen peer on another node keeps its connections alive: heartbeats tell
        self.heartbeat.start(me, secret, {q: (info[q][1], info[q][6]) for q in peers},
                             _HB_INTERVAL, _pids(comm, peers))
        return dict(self.endpoints)

    # -- progress -------------------------------------------------------------------------
    def fds(self) -> list[int]:
        """The sockets of every live connection (for an external poll)."""
        return [c.fd for ep in self.endpoints.values() for c in ep.conns
                if not c.dead and not c.rdead]

    def wait(self, timeout: float) -> bool:
        """Block until a socket is readable (or writable with output queued) or ``timeout``
        seconds pass; pump the connections that became ready.  True if any did."""
        byfd = {c.fd: c for ep in self.endpoints.values() for c in ep.conns if not c.dead}
        if not byfd:
            if timeout > 0:
                time.sleep(timeout)
            return False
        timeout = max(0.0, timeout)
        try:
            if max(byfd) < _SELECT_MAX:     # select: microsecond timeouts
                r, w, _ = select.select([fd for fd, c in byfd.items() if not c.rdead],
                                        [fd for fd, c in byfd.items() if c.out], [], timeout)
                ready = set(r).union(w)
            else:                           # poll: no FD_SETSIZE limit, millisecond timeouts
                poller = select.poll()
                for fd, c in byfd.items():
                    ev = (0 if c.rdead else select.POLLIN) | (select.POLLOUT if c.out else 0)
                    if ev:
                        poller.register(fd, ev)
                ready = {fd for fd, _ in poller.poll(math.ceil(timeout * 1000))}
        except InterruptedError:
            return False
        for fd in ready:
            c = byfd[fd]
            if not c.dead:
                if c.out:
                    c.flush()
                c.read()
        return bool(ready)

    def progress(self) -> bool:
        """Pump every endpoint once (non-blocking)."""
        moved = False
        for ep in self.endpoints.values():
            if ep.pump():
                moved = True
        return moved

    # -- failure and shutdown ------------------------------------------------------------
    def publish_error(self, text: str) -> None:
        """Tell every peer why this rank is going down (best effort, at most half a
        second): they raise ``PeerFailure`` with ``text``."""
        data = fit_text(text, _ERR_MAX)
        if self.heartbeat is not None:
            # (also by datagram: it reaches a peer whose stream this rank had to end —
            # see TcpEndpoint.publish — and is read by its check())
            self.heartbeat.notify(text)
        conns = [c for c in (ep.publish(data) for ep in self.endpoints.values()) if c]
        deadline = time.monotonic() + _PUBLISH_S
        while True:
            late = [c for c in conns if c.out and not c.dead]
            left = deadline - time.monotonic()
            if not late or left <= 0:
                return
            poller = select.poll()
            for c in late:
                poller.register(c.fd, select.POLLOUT)
            try:
                poller.poll(max(1, int(left * 1000)))
            except InterruptedError:
                pass
            for c in late:
                c.flush()

    def forget_in_child(self) -> None:
        """In a forked child (``comm._after_fork``): drop the child's copies of the
        descriptors without a word on them — no shutdown, which would end the parent's
        streams too.  A child that held them (a DataLoader worker) kept the parent's
        connections open after the parent died: no FIN or RST reached its peers, which
        then noticed only by the heartbeat's bound (5.6 s, told "stopped or hung")."""
        socks = [c.sock for ep in self.endpoints.values() for c in ep.conns]
        socks += list(self._loose) + [self.listener]
        hb = self.heartbeat
        if hb is not None:
            socks.append(getattr(hb, "sock", None))
        forget_sockets(socks)

    def close(self) -> None:
        """Close every connection and the listener; safe twice and on an exception path."""
        staying = getattr(self, "staying", False)
        for ep in self.endpoints.values():
            for c in ep.conns:
                try:
                    c.close(staying)
                except Exception:  # noqa: BLE001 - closing must not fail
                    pass
        self.endpoints = {}
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        for s in self._loose:
            try:
                s.close()
            except OSError:
                pass
        self._loose = []
        if self.listener is not None:
            try:
                self.listener.close()
            except OSError:
                pass
            self.listener = None


def forget_sockets(socks) -> None:
    """Close this process's descriptors of ``socks`` (None skipped) without shutting the
    connections down: another process's copies (the parent's) carry on."""
    for sk in socks:
        if sk is None:
            continue
        try:
            fd = sk.detach()
        except OSError:
            continue
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


# -- the set-up loop ----------------------------------------------------------------------
class _Abort(Exception):
    def __init__(self, text: str, notified: bool):
        super().__init__(text)
        self.notified = notified


class _Shake:
    """A connection in its handshake."""

    __slots__ = ("sock", "fd", "connector", "peer", "stripe", "addr", "state", "buf", "need",
                 "out", "t0", "hello", "nonce2")

    def __init__(self, sock: socket.socket, connector: bool, peer: int, stripe: int, addr: str):
        self.sock, self.fd, self.connector = sock, sock.fileno(), connector
        self.peer, self.stripe, self.addr = peer, stripe, addr
        self.state = "connecting" if connector else "hello"
        self.buf = bytearray()
        self.need = _HELLO.size
        self.out = b""
        self.t0 = time.monotonic()
        self.hello = b""
        self.nonce2 = b""


class _Setup:
    """One poll loop: outgoing connects (to lower ranks), incoming accepts (from higher
    ranks), every handshake, and the MPI notices of ranks whose set-up failed."""

    def __init__(self, owner: TcpTransport, mpi, me: int, host: str, secret: bytes, cid: str,
                 peers: list[int], info: list, user_timeout: float, bufsize: int):
        self.owner, self.mpi, self.me, self.host = owner, mpi, me, host
        self.secret, self.cid, self.digest = secret, cid, _cid_digest(cid)
        self.info, self.ut, self.bufsize = info, user_timeout, bufsize
        stripes = owner.stripes
        self.expect = {(q, s) for q in peers if q > me for s in range(stripes)}
        self.dial = {(q, s): (0.0, 0) for q in peers if q < me for s in range(stripes)}
        self.last_err: dict[tuple[int, int], str] = {}
        self.shakes: dict[int, _Shake] = {}
        self.dialing: set[tuple[int, int]] = set()    # outgoing handshakes in progress
        self.done: dict[tuple[int, int], socket.socket] = {}
        self.requests: list = []
        self.heard: dict[int, str] = {}                # notices received: rank -> text
        self.me_addr = owner.address
        self.accept_after = 0.0                        # accepting paused until (EMFILE)
        self.refused = 0                               # connections refused so far
        self.refusals = Throttle(1.0)                  # their summaries past the first ones
        self.accept_failures = Throttle(1.0)           # "accept failed" warnings

    # -- the loop -------------------------------------------------------------------------
    def run(self, deadline: float) -> dict[tuple[int, int], socket.socket]:
        from mpi4py import MPI

        status = MPI.Status()
        listener = self.owner.listener
        log.debug("tcp: rank %d: set-up: dialing %d connection(s), expecting %d", self.me,
                  len(self.dial), len(self.expect))
        while self.expect - self.done.keys() or self.dial:
            now = time.monotonic()
            if now > deadline:
                self.fail(self._late(deadline))
            for key, (at, tries) in list(self.dial.items()):
                if at <= now and key not in self.dialing:
                    self._dial(key, tries)
            for sh in list(self.shakes.values()):
                if not sh.connector and now - sh.t0 > _HANDSHAKE_S:
                    self._refuse(sh, f"did not finish the handshake within {_HANDSHAKE_S:g} s")
            poller = select.poll()
            if listener is not None and self.expect - self.done.keys() and \
                    now >= self.accept_after:
                poller.register(listener.fileno(), select.POLLIN)
            for sh in self.shakes.values():
                poller.register(sh.fd, select.POLLOUT if sh.out or sh.state == "connecting"
                                else select.POLLIN)
            accept = False
            for fd, ev in poller.poll(50):
                if listener is not None and fd == listener.fileno():
                    accept = True       # after the handshakes: a connection accepted in
                    continue            # the last turn is read before any is dropped
                sh = self.shakes.get(fd)
                if sh is not None:
                    self._step(sh, ev)
            if accept:
                self._accept(listener)
            if self.mpi.iprobe(source=MPI.ANY_SOURCE, tag=_ABORT_TAG, status=status):
                src = status.Get_source()
                text = self.heard[src] = self.mpi.recv(source=src, tag=_ABORT_TAG)
                raise _Abort(text, False)
        self._finish()
        return self.done

    def _finish(self) -> None:
        owner = self.owner
        if owner.listener is not None:
            owner.listener.close()
            owner.listener = None
        for sh in list(self.shakes.values()):
            if not sh.connector:
                self._refuse(sh, "set-up finished before it completed the handshake")
        self._refusals_summed()

    def _late(self, deadline: float) -> str:
        missing_in = sorted({q for q, s in self.expect - self.done.keys()})
        parts = []
        if missing_in:
            parts.append(f"no authenticated connection from rank(s) {missing_in}")
        for q, s in sorted(self.dial):
            parts.append(f"could not connect to rank {q} ({self.info[q][3]}, "
                         f"{self.info[q][1]}:{self.info[q][2]}): "
                         f"{self.last_err.get((q, s), 'no answer')}")
        return (f"rank {self.me} ({self.host}): tcp set-up did not complete within the "
                f"deadline (GPURT_TIMEOUT={float(config.get('GPURT_TIMEOUT')):g} s): "
                + "; ".join(parts[:4]))

    def fail(self, text: str) -> None:
        self._refusals_summed()
        self.notify(text)
        raise _Abort(text, True)

    def notify(self, text: str) -> None:
        """Tell every other rank at once that this rank's set-up failed."""
        self.requests = [self.mpi.isend(text, dest=q, tag=_ABORT_TAG)
                         for q in range(self.mpi.Get_size()) if q != self.me]

    def drain(self, told: list[int]) -> dict[int, str]:
        """Receive the notices of the ranks in ``told`` not heard yet; all their texts."""
        for q in told:
            if q not in self.heard:
                self.heard[q] = self.mpi.recv(source=q, tag=_ABORT_TAG)
        for r in self.requests:
            r.wait()
        self.requests = []
        return dict(self.heard)

    def close_pending(self) -> None:
        for sh in list(self.shakes.values()):
            self._drop(sh)

    # -- connections ------------------------------------------------------------------------
    def _drop(self, sh: _Shake) -> None:
        self.shakes.pop(sh.fd, None)
        if sh.connector:
            self.dialing.discard((sh.peer, sh.stripe))
        try:
            sh.sock.close()
        except OSError:
            pass

    def _refuse(self, sh: _Shake, reason: str) -> None:
        """Drop an accepted connection that did not prove the secret, and log it: the
        first ``_REFUSALS_LOGGED`` one by one, the rest of a flood summed up at most once a
        second (and at the end of set-up), so strangers cannot flood the log."""
        self.refused += 1
        if self.refused <= _REFUSALS_LOGGED:
            log.warning("tcp: rank %d (listening on %s) refused a connection from %s: %s",
                        self.me, self.me_addr, sh.addr, reason)
        else:
            held = self.refusals.due()
            if held is not None:
                self._refusals_summed(held + 1, reason)
        self._drop(sh)

    def _refusals_summed(self, n: int | None = None, reason: str = "") -> None:
        """The summary of ``n`` refusals not logged one by one (default: those held back
        until now, at the end of set-up)."""
        n = self.refusals.take() if n is None else n
        if n:
            log.warning("tcp: rank %d (listening on %s) refused %d more connection(s)%s "
                        "(%d in all)", self.me, self.me_addr, n,
                        f", the last: {reason}" if reason else "", self.refused)

    def _retry(self, sh: _Shake, reason: str) -> None:
        key = (sh.peer, sh.stripe)
        self._drop(sh)
        _, tries = self.dial[key]
        self.last_err[key] = reason
        log.info("tcp: rank %d: connection %d to rank %d (%s) failed, retrying: %s",
                 self.me, sh.stripe, sh.peer, sh.addr, reason)
        self.dial[key] = (time.monotonic() + min(1.0, 0.05 * 2 ** tries), tries + 1)

    def _dial(self, key: tuple[int, int], tries: int) -> None:
        q, stripe = key
        ip, port = self.info[q][1], self.info[q][2]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            _tune(sock, self.bufsize)
            _liveness(sock, self.ut)
            sock.setblocking(False)
            rc = sock.connect_ex((ip, port))
        except OSError as e:
            sock.close()
            self.last_err[key] = str(e)
            self.dial[key] = (time.monotonic() + 0.2, tries + 1)
            return
        sh = _Shake(sock, True, q, stripe, f"{ip}:{port}")
        self.shakes[sh.fd] = sh
        self.dialing.add(key)
        if rc not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self._retry(sh, f"connect: {_strerror(rc)}")

    def _strangers(self) -> list[_Shake]:
        """Accepted connections not authenticated yet, the ones that proved least (no
        hello read yet) and the oldest first."""
        return sorted((sh for sh in self.shakes.values() if not sh.connector),
                      key=lambda sh: (sh.state != "hello", sh.t0))

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPT_BATCH):
            # never more unauthenticated connections than the expected ones still missing
            # and a few: a flood of strangers drops the oldest of them, not the descriptor
            # table (a dropped real peer reconnects)
            pending = self._strangers()
            room = len(self.expect - self.done.keys()) + _STRANGERS_MAX
            for sh in pending[:max(0, len(pending) + 1 - room)]:
                self._refuse(sh, f"too many unauthenticated connections pending ({room}): "
                                 f"the oldest is dropped")
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    pending = self._strangers()
                    if pending:             # room for the next one at a stranger's expense
                        self._refuse(pending[0], f"out of file descriptors ({e.strerror}) "
                                                 f"with connections still to accept")
                        continue
                    # nothing of ours to give up: wait, instead of spinning on a listener
                    # that stays readable (and a warning per turn)
                    self.accept_after = time.monotonic() + _EMFILE_PAUSE_S
                held = self.accept_failures.due()
                if held is not None:
                    log.warning("tcp: rank %d: accept failed: %s%s", self.me, e,
                                f" ({held} more failures not logged)" if held else "")
                return
            try:
                sock.setblocking(False)
                _liveness(sock, self.ut)
            except OSError as e:
                log.warning("tcp: rank %d: cannot set up a connection from %s:%s: %s",
                            self.me, addr[0], addr[1], e)
                sock.close()
                continue
            sh = _Shake(sock, False, -1, -1, f"{addr[0]}:{addr[1]}")
            self.shakes[sh.fd] = sh

    def _step(self, sh: _Shake, ev: int) -> None:
        if sh.state == "connecting":
            rc = sh.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if rc:
                self._retry(sh, f"connect: {_strerror(rc)}")
                return
            nonce = secrets.token_bytes(16)
            sh.hello = _HELLO.pack(HELLO_MAGIC, VERSION, sh.stripe, self.me, sh.peer,
                                   self.digest, nonce)
            sh.out, sh.state, sh.need = sh.hello, "reply", _REPLY.size
        if sh.out:
            try:
                k = sh.sock.send(sh.out, _NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(sh, str(e))
                return
            sh.out = sh.out[k:]
            if sh.out:
                return
            if sh.state == "established":
                self._established(sh)
            return
        if not ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            return
        try:
            data = sh.sock.recv(sh.need - len(sh.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(sh, str(e))
            return
        if not data:
            self._lost(sh, "closed the connection during the handshake")
            return
        sh.buf += data
        if sh.state == "hello" and not HELLO_MAGIC.startswith(bytes(sh.buf[:8])):
            self._refuse(sh, "not a gpurt connection (bad magic)")
            return
        if len(sh.buf) < sh.need:
            return
        msg, sh.buf = bytes(sh.buf), bytearray()
        getattr(self, "_on_" + sh.state)(sh, msg)

    def _lost(self, sh: _Shake, reason: str) -> None:
        if sh.connector:
            self._retry(sh, reason)
        else:
            self._refuse(sh, reason)

    # acceptor: hello -> reply; final -> ack
    def _on_hello(self, sh: _Shake, msg: bytes) -> None:
        _, version, stripe, frm, to, digest, _nonce = _HELLO.unpack(msg)
        if version != VERSION:
            return self._refuse(sh, f"speaks protocol version {version}, this rank {VERSION}")
        if not hmac.compare_digest(digest, self.digest):
            return self._refuse(sh, "belongs to another job or communicator (its "
                                    "communicator id does not match)")
        if to != self.me:
            return self._refuse(sh, f"is addressed to rank {to}, this is rank {self.me}")
        if (frm, stripe) not in self.expect:
            return self._refuse(sh, f"claims to be rank {frm} connection {stripe}, which "
                                    f"this rank does not expect")
        if (frm, stripe) in self.done:
            return self._refuse(sh, f"duplicate of rank {frm} connection {stripe}, which is "
                                    f"already authenticated")
        sh.peer, sh.stripe, sh.hello = frm, stripe, msg
        sh.nonce2 = secrets.token_bytes(16)
        sh.out = _REPLY.pack(sh.nonce2, _mac(self.secret, b"A", msg, sh.nonce2))
        sh.state, sh.need = "final", _MAC
        self._step(sh, 0)

    def _on_final(self, sh: _Shake, msg: bytes) -> None:
        if not hmac.compare_digest(msg, _mac(self.secret, b"C", sh.hello, sh.nonce2)):
            return self._refuse(sh, f"claims to be rank {sh.peer} connection {sh.stripe} but "
                                    f"failed authentication (wrong HMAC: it does not know "
                                    f"this job's secret)")
        if (sh.peer, sh.stripe) in self.done:
            return self._refuse(sh, f"duplicate of rank {sh.peer} connection {sh.stripe}")
        sh.out, sh.state = _ACK, "established"
        self._step(sh, 0)

    # connector: reply -> final; ack
    def _on_reply(self, sh: _Shake, msg: bytes) -> None:
        nonce2, mac = _REPLY.unpack(msg)
        if not hmac.compare_digest(mac, _mac(self.secret, b"A", sh.hello, nonce2)):
            self._drop(sh)
            self.fail(f"rank {self.me} ({self.host}): the listener at {sh.addr} (rank "
                      f"{sh.peer}, {self.info[sh.peer][3]}) failed authentication: it is not "
                      f"rank {sh.peer} of this job")
        sh.out = _mac(self.secret, b"C", sh.hello, nonce2)
        sh.state, sh.need = "ack", 1
        self._step(sh, 0)

    def _on_ack(self, sh: _Shake, msg: bytes) -> None:
        if msg != _ACK:
            return self._retry(sh, f"unexpected acknowledgement {msg!r}")
        sh.state = "established"
        self._established(sh)

    def _established(self, sh: _Shake) -> None:
        self.shakes.pop(sh.fd, None)
        key = (sh.peer, sh.stripe)
        self.done[key] = sh.sock
        self.owner._loose.append(sh.sock)
        if sh.connector:
            self.dialing.discard(key)
            self.dial.pop(key, None)
        log.debug("tcp: rank %d: connection %d with rank %d (%s) authenticated", self.me,
                  sh.stripe, sh.peer, sh.addr)


def _strerror(rc: int) -> str:
    return f"{errno.errorcode.get(rc, rc)} ({os.strerror(rc)})"
