"""Liveness between ranks on different nodes: noticing a peer that is frozen, not dead.

A process stopped by SIGSTOP (or a debugger, or swapped to death) on another node keeps its
TCP connections alive — its kernel still acknowledges — so neither EOF nor
``TCP_USER_TIMEOUT`` ever fires, and without this a peer waiting for it would only stop at
its deadline.  gpurt has no progress thread, so the data connections cannot carry the
question; instead every rank with tcp (or verbs) peers has one UDP socket and one small
daemon thread that answers it.  A stopped process stops *all* its threads, so it stops
answering; a process that is merely busy (computing between collectives, inside a long
NumPy call) still answers, because the thread needs the GIL only for microseconds.

Asked, not broadcast: a rank pings a peer only while it *waits* for that peer.  The
endpoints' ``check`` (every 0.2 s of a wait, ``Engine._drive``) calls ``stopped(peer)``;
if nothing authentic has come from that peer for ``interval`` seconds it sends a ping (at
most one per ``interval`` while the wait lasts) and the peer's thread answers at once.
When the time spent waiting with a ping unanswered adds up to ``GPURT_PEER_STOPPED``
seconds (a gap between two waits counting for at most three intervals, so a wait retried
after a timeout still gets there), the peer is a ``PeerFailure`` — the same bound and
meaning as a stopped local peer under ``shm``.  A freeze shorter than the bound is not a failure (the
thread answers the queued pings when the process continues).  So a rank that nobody waits
for sends and receives nothing, whatever the job's size: the datagrams every rank used to
send every peer twice a second (until 2026-12-02) cost each rank about 5 µs of CPU per
peer and datagram, ~5 % of a core with a thousand remote ranks, for nothing while all were
busy.  A waiting rank costs each peer it waits for one ping and one answer per
``interval``, no more than those beats did; and a rank that was itself stopped does not
mistake a live peer for a dead one when it continues (it asks again).

The same socket carries *notices*: ``notify(text)`` sends every peer an authenticated
datagram (``<8sII>`` magic ``b"gpurtHE1"``, from-rank, text length, the text (at most 1 KiB),
then 16 bytes of HMAC over all of it and the receiving rank), three times against loss; the
peers' ``notice(rank)`` returns it.  A transport whose data path to a peer is broken (a verbs
queue pair in the error state cannot carry an error message) still tells the peer why.

Pings and answers: ``<8sII>`` magic ``b"gpurtHQ1"`` (ping) or ``b"gpurtHB1"`` (answer),
from-rank, sequence, then the first 16 bytes of HMAC-SHA256(secret, magic | from | to |
sequence) over the communicator's tcp secret.  Anything that does not verify (a stranger,
another job, a forged sender) is dropped (counted, and logged: the first from every
address at once, the rest in a summary at most every 10 s).  An authentic datagram
that is old — a ping not newer than the last one from that peer, an answer to no ping this
rank sent or not newer than the last answer taken: reordered or replayed — is ignored
(counted in ``stale``): it proves nothing about the peer now.  The socket is bound to the rank's
advertised address and an OS-chosen port, exchanged with the transport's set-up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref

from gpurt.errors import fit_text

from .base import Throttle

log = logging.getLogger("gpurt.tcp")

_HB = struct.Struct("<8sII")
_PING = b"gpurtHQ1"
_ANSWER = b"gpurtHB1"
_NOTE = b"gpurtHE1"
_NOTE_MAX = 1024
_MAC = 16
SIZE = _HB.size + _MAC
_LOG_SOURCES = 64       # addresses whose first refused datagram is logged at once
_LOG_EVERY_S = 10.0     # beyond those: one summary warning at most this often

# peer processes (address, pid) that a Heartbeat of this process found silent past the
# bound, and when: another communicator's Heartbeat waiting on the same process fails once
# its own ping goes unanswered for an interval, instead of waiting the whole bound again
_silent: dict[tuple[str, int], float] = {}


def _mac(secret: bytes, magic: bytes, frm: int, to: int, seq: int) -> bytes:
    return hmac.new(secret, magic + struct.pack("<III", frm, to, seq),
                    hashlib.sha256).digest()[:_MAC]


def _note_mac(secret: bytes, signed: bytes, to: int) -> bytes:
    return hmac.new(secret, signed + struct.pack("<I", to), hashlib.sha256).digest()[:_MAC]


def _pids(comm, peers) -> dict[int, int] | None:
    """The peers' process ids, where the communicator knows them (for ``start``)."""
    pids = getattr(comm, "pids", None)
    return {q: pids[q] for q in peers} if pids else None


_SO_ATTACH_FILTER = 26     # (linux/filter.h; classic BPF on a socket: no privilege needed)
_SKF_NET_OFF = -0x100000   # BPF_ABS loads from the IP header, not the UDP one
_BPF_MAX = 4096            # instructions a classic filter may have
_unfiltered_told = False   # the warning that no filter attached: once per process


def _bpf(known: set[tuple[str, int]], by_address: bool = False) -> tuple[bytes, str] | None:
    """A classic BPF socket filter that keeps only datagrams whose source is one of
    ``known`` (address, port): the kernel drops a stranger's before they take room in the
    socket's buffer, whatever this process is doing.  Per pair: load the source address,
    compare, load the source port, compare, accept; none matched: drop.  By address alone
    (``by_address``, or where the pairs would not fit); None where the addresses alone
    would not.  (The program, and what it matches: "address and port" or "address".)"""
    ld_w, ld_h, jeq, ret = 0x20, 0x28, 0x15, 0x06     # BPF_LD|W|ABS, LD|H|ABS, JMP|JEQ|K, RET|K
    src_ip = (_SKF_NET_OFF + 12) & 0xFFFFFFFF
    ins: list[tuple[int, int, int, int]] = []
    pairs = sorted((int.from_bytes(socket.inet_aton(h), "big"), p) for h, p in known)
    how = "address and port" if not by_address and 5 * len(pairs) + 1 <= _BPF_MAX else \
        "address"
    if how != "address":
        for ip, port in pairs:
            ins += [(ld_w, 0, 0, src_ip), (jeq, 0, 3, ip), (ld_h, 0, 0, 0), (jeq, 0, 1, port),
                    (ret, 0, 0, 0xFFFFFFFF)]
    else:
        ips = sorted({ip for ip, _ in pairs})
        if 2 * len(ips) + 2 > _BPF_MAX:
            return None
        ins.append((ld_w, 0, 0, src_ip))
        for ip in ips:
            ins += [(jeq, 0, 1, ip), (ret, 0, 0, 0xFFFFFFFF)]
    ins.append((ret, 0, 0, 0))
    return b"".join(struct.pack("=HBBI", *i) for i in ins), how     # (struct sock_filter)


def _filter(sock: socket.socket, known: set[tuple[str, int]]) -> str:
    """Attach the tightest filter the kernel takes (its memory counts against
    ``net.core.optmem_max``: 20 KiB on kernels before 6.9, a per-pair filter of ~100
    peers): by address and port, else by address; "" where none attached."""
    for by_address in (False, True):
        got = _bpf(known, by_address)
        if got is not None and _attach(sock, got[0]):
            return got[1]
    return ""


def _attach(sock: socket.socket, prog: bytes) -> bool:
    """Attach the filter ``_bpf`` made; False where the kernel refuses it."""
    import ctypes
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = struct.pack("@HL", len(prog) // 8, ctypes.addressof(buf))   # struct sock_fprog
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    except OSError:
        return False
    return True


def _kernel_drops(sock: socket.socket) -> int | None:
    """The datagrams the kernel dropped at this socket (the filter's and any for want of
    room): ``/proc/net/udp``'s last column, by the socket's inode."""
    try:
        ino = str(os.fstat(sock.fileno()).st_ino)
        with open("/proc/net/udp") as f:
            for line in f:
                cols = line.split()
                if len(cols) > 12 and cols[9] == ino:
                    return int(cols[-1])
    except (OSError, ValueError):
        return None
    return None


def _addr(a: tuple[str, int]) -> tuple[str, int]:
    """``(host, port)`` as ``recvfrom`` names a sender of that address (dotted IPv4)."""
    host, port = a
    try:
        return socket.inet_ntoa(socket.inet_aton(host)), int(port)
    except OSError:
        return socket.gethostbyname(host), int(port)


class Heartbeat:
    """One UDP socket and one daemon thread per tcp (or verbs) transport instance."""

    def __init__(self, ip: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((ip, 0))
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.me = -1
        self.interval = 0.5
        self.peers: dict[int, tuple[str, int]] = {}
        self.last: dict[int, float] = {}        # peer -> when something authentic came
        self.asked: dict[int, float] = {}       # peer -> its first unanswered ping
        self.sent: dict[int, float] = {}        # peer -> the latest ping to it
        self.called: dict[int, float] = {}      # peer -> the latest stopped() about it
        self.waited: dict[int, float] = {}      # peer -> waiting since its question
        self.pings = 0                          # pings sent (their sequence numbers)
        self._answered: dict[int, int] = {}     # peer -> newest sequence it answered
        self._pinged: dict[int, int] = {}       # peer -> newest sequence it pinged with
        self.dropped = 0
        self.stale = 0
        self._refused_from: set[str] = set()    # addresses already named in a warning
        self._refusals = Throttle(_LOG_EVERY_S)  # the warnings of the others
        self._klast = time.monotonic()          # the last look at the kernel's drops
        self.notices: dict[int, str] = {}
        self.ids: dict[int, tuple[str, int]] = {}  # peer -> (address, pid): its process
        self._secret = b""
        self._known: set[tuple[str, int]] = set()
        self._own = self.sock.getsockname()
        self.filtered = False                   # a kernel filter keeps strangers out
        self._kdrops = 0                        # the kernel's drop count, last looked at
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, me: int, secret: bytes, peers: dict[int, tuple[str, int]],
              interval: float, pids: dict[int, int] | None = None) -> None:
        """``pids``: each peer's process id, which with its address names the process
        across communicators (``stopped``)."""
        self.me, self._secret, self.peers = me, secret, dict(peers)
        # the peers' sockets, as recvfrom names a sender: a datagram from anywhere else is
        # refused before any parsing or MAC (a flood of them is drained fast enough that
        # the peers' pings still find room in the socket's buffer)
        self._known = {_addr(a) for a in peers.values()}
        # and in the kernel: a stranger's datagrams never reach the socket's buffer (its
        # own address too: close()'s wake-up call)
        how = _filter(self.sock, self._known | {self._own})
        self.filtered = bool(how)
        if not how:
            global _unfiltered_told
            if not _unfiltered_told:
                _unfiltered_told = True
                log.warning("tcp: rank %d: no socket filter could be attached to the "
                            "heartbeat socket (%d peers; net.core.optmem_max too small?): "
                            "strangers' datagrams are refused by the thread instead, which "
                            "a flood can outrun while this process computes", me,
                            len(self._known))
        self._kdrops = _kernel_drops(self.sock) or 0
        self.ids = {q: (peers[q][0], pids[q]) for q in peers} if pids else {}
        self.interval = float(interval)
        now = time.monotonic()
        self.last = {q: now for q in peers}
        # the thread holds the Heartbeat weakly: one dropped without close() (its
        # communicator was never closed, only forgotten) stops its thread and closes its
        # socket when it is collected, instead of leaving both behind for the process's life
        self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self.sock,
                                                             self._stop),
                                        name=f"gpurt-heartbeat-{me}", daemon=True)
        self._thread.start()
        self._fin = weakref.finalize(self, _wake, self.sock, self._stop)
        self._fin.atexit = False

    def silent_for(self, peer: int) -> float:
        """Seconds since the last authentic datagram from ``peer`` (0 if not watched)."""
        t = self.last.get(peer)
        return 0.0 if t is None else time.monotonic() - t

    def stopped(self, peer: int, host: str, what: str) -> str | None:
        """Called while this rank waits for ``peer``: ping it if it has been quiet for an
        interval, and say why it counts as failed — ``GPURT_PEER_STOPPED`` seconds of
        waiting with a ping unanswered (``what`` says what that may be) — or None.

        The waiting time is added up from call to call while the question is open, each
        gap counting for at most three intervals: a wait retried after a timeout with
        other work in between (``Request.wait(timeout=1)`` in a loop) still reaches the
        bound, while a gap between waits — or this rank itself stopped or descheduled —
        does not make a live peer look silent (it is asked again, and answers)."""
        heard = self.last.get(peer)
        if heard is None:
            return None
        now = time.monotonic()
        if now - heard < self.interval:
            return None
        prev = self.called.get(peer, now)
        self.called[peer] = now
        first = self.asked.get(peer)
        if first is None or first < heard:      # none yet, or the last one was answered
            self.asked[peer] = now
            self.waited[peer] = 0.0
            self.ping(peer)
            return None
        waited = self.waited[peer] = self.waited.get(peer, 0.0) + \
            min(now - prev, 3 * self.interval)
        if now - self.sent.get(peer, 0.0) >= self.interval / 5:
            # again, against a lost datagram: five times an interval while unanswered (a
            # flood that fills the peer's socket buffer drops most of them; one suffices)
            self.ping(peer)
        from gpurt import config

        bound = float(config.get("GPURT_PEER_STOPPED"))
        ident = self.ids.get(peer)
        since = _silent.get(ident) if ident is not None else None
        if waited <= bound:
            # found silent past the bound by another communicator here, and nothing heard
            # since, nor an answer to this one's ping within an interval: the same process,
            # still silent (a freeze is bounded once per process, not once per communicator)
            if since is None or heard > since or now - first < self.interval:
                return None
            return (f"rank {peer} ({host}) has not answered heartbeat pings for "
                    f"{now - first:.1f} s, and another communicator of this process found it "
                    f"silent for more than GPURT_PEER_STOPPED={bound:g} s {now - since:.1f} s "
                    f"ago: {what}")
        if ident is not None and (since is None or since < heard):
            _silent[ident] = now
        return (f"rank {peer} ({host}) has not answered heartbeat pings for {waited:.1f} s "
                f"of waiting (more than GPURT_PEER_STOPPED={bound:g} s): {what}")

    def ping(self, peer: int) -> None:
        addr = self.peers.get(peer)
        if addr is None:
            return
        self.pings += 1
        self.sent[peer] = time.monotonic()
        self._send(_PING, self.pings, peer, addr)

    def _send(self, magic: bytes, seq: int, peer: int, addr: tuple[str, int]) -> None:
        pkt = _HB.pack(magic, self.me, seq) + _mac(self._secret, magic, self.me, peer, seq)
        try:
            self.sock.sendto(pkt, addr)
        except OSError:
            pass            # a down link: the silence tells the asking side

    def notice(self, peer: int) -> str | None:
        """The text ``peer`` sent with ``notify``, if any."""
        return self.notices.get(peer)

    def notice_now(self, peer: int) -> str | None:
        """``notice``, after reading what has arrived meanwhile here (the thread may not
        have run yet: a peer's notice is sent just before its stream ends)."""
        if peer not in self.notices and self._thread is not None:
            self._receive()
        return self.notices.get(peer)

    def notify(self, text: str, only: tuple[int, ...] | None = None) -> None:
        """Tell every peer (or those in ``only``) ``text`` (best effort: three datagrams
        each, no waiting)."""
        body = fit_text(text, _NOTE_MAX)
        for q, addr in self.peers.items():
            if only is not None and q not in only:
                continue
            head = _HB.pack(_NOTE, self.me, len(body))
            pkt = head + body + _note_mac(self._secret, head + body, q)
            for _ in range(3):
                try:
                    self.sock.sendto(pkt, addr)
                except OSError:
                    break

    def _receive(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(_HB.size + _NOTE_MAX + _MAC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if addr not in self._known:
                if not data and addr == self._own:
                    continue            # close()'s wake-up call (from this very socket)
                self._refuse(addr)
                continue
            if data[:8] == _NOTE and len(data) >= _HB.size + _MAC:
                _, frm, n = _HB.unpack_from(data)
                body = data[_HB.size:-_MAC]
                if frm in self.peers and len(body) == n and hmac.compare_digest(
                        data[-_MAC:], _note_mac(self._secret, data[:-_MAC], self.me)):
                    self.notices.setdefault(frm, body.decode("utf-8", "replace"))
                    self.last[frm] = time.monotonic()
                    continue
            elif len(data) == SIZE:
                magic, frm, seq = _HB.unpack_from(data)
                if frm in self.peers and magic in (_PING, _ANSWER) and hmac.compare_digest(
                        data[_HB.size:], _mac(self._secret, magic, frm, self.me, seq)):
                    if magic == _PING:
                        fresh = seq > self._pinged.get(frm, 0)
                        if fresh:
                            self._pinged[frm] = seq
                            self._send(_ANSWER, seq, frm, self.peers[frm])
                    else:
                        fresh = self._answered.get(frm, 0) < seq <= self.pings
                        if fresh:
                            self._answered[frm] = seq
                    if fresh:
                        self.last[frm] = time.monotonic()
                        if _silent:     # (it answers again: no longer silent for anyone)
                            _silent.pop(self.ids.get(frm), None)
                    else:
                        self.stale += 1     # authentic but old: reordered, or replayed
                    continue
            self._refuse(addr)

    def _refuse(self, addr) -> None:
        """Count a datagram that does not verify; log it — the first from every address
        (up to ``_LOG_SOURCES`` of them) at once, the others in a summary at most every
        ``_LOG_EVERY_S`` seconds, so an attack that starts late is logged too and a flood
        does not flood the log."""
        self.dropped += 1
        ip = addr[0]
        if ip not in self._refused_from and len(self._refused_from) < _LOG_SOURCES:
            self._refused_from.add(ip)
            held = self._refusals.take()
        else:
            held = self._refusals.due()
            if held is None:
                return
        more = f" ({held} more dropped since the last warning)" if held else ""
        log.warning("tcp: rank %d dropped a heartbeat datagram from %s:%d that does not "
                    "prove this job's secret%s (%d dropped in all)", self.me, addr[0],
                    addr[1], more, self.dropped)

    def _kernel_refusals(self) -> None:
        """Log what the kernel's filter dropped (strangers' datagrams this thread never
        sees): looked at once per ``_LOG_EVERY_S`` from the thread, logged when it grew."""
        now = time.monotonic()
        if not self.filtered or now - self._klast < _LOG_EVERY_S:
            return
        self._klast = now
        n = _kernel_drops(self.sock)
        if n is None or n <= self._kdrops:
            return
        log.warning("tcp: rank %d's heartbeat socket dropped %d datagrams not from its "
                    "peers' sockets (the kernel's filter) or for want of room since the last "
                    "look", self.me, n - self._kdrops)
        self._kdrops = n

    def close(self) -> None:
        if self._thread is not None:
            self._fin.detach()
            _wake(self.sock, self._stop)    # now, not at the poll's next second
            self._thread.join(timeout=2.0)
            self._thread = None
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass


def _serve(ref: "weakref.ref[Heartbeat]", sock: socket.socket, stop: threading.Event) -> None:
    """The thread: answer pings, take notices — until close(), or until the Heartbeat
    was dropped without one (then the socket is closed here)."""
    poller = select.poll()
    # (poll, not select: a communicator made when over a thousand files are open has a
    # descriptor above select's FD_SETSIZE)
    poller.register(sock, select.POLLIN)
    while not stop.is_set():
        try:
            r = poller.poll(1000)       # _wake() sends a datagram to end it at once
        except (OSError, ValueError):
            return                      # closed under us
        if any(ev & select.POLLNVAL for _, ev in r):
            return
        if stop.is_set():
            continue
        hb = ref()
        if hb is None:
            break
        if r:
            hb._receive()
        hb._kernel_refusals()
        del hb
    if ref() is None:
        try:
            sock.close()
        except OSError:
            pass


def _wake(sock: socket.socket, stop: threading.Event) -> None:
    """Stop the thread (close(), or the Heartbeat's finalizer)."""
    stop.set()
    try:
        sock.sendto(b"", sock.getsockname())
    except OSError:
        pass
