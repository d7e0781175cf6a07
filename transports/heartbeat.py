"""Heartbeats between ranks on different nodes: noticing a peer that is frozen, not dead.

A process stopped by SIGSTOP (or a debugger, or swapped to death) on another node keeps its
TCP connections alive — its kernel still acknowledges — so neither EOF nor
``TCP_USER_TIMEOUT`` ever fires, and without this a peer waiting for it would only stop at
its deadline.  gpurt has no progress thread, so the data connections cannot carry
heartbeats; instead every rank with tcp peers runs one small daemon thread that, every
``interval`` seconds, sends each peer a 32-byte UDP datagram and records the datagrams it
receives.  A stopped process stops *all* its threads, so its heartbeats stop; a process
that is merely busy (computing between collectives, inside a long NumPy call) keeps
sending, because the thread needs the GIL only for microseconds every interval.

The same socket carries *notices*: ``notify(text)`` sends every peer an authenticated
datagram (``<8sII>`` magic ``b"gpurtHE1"``, from-rank, text length, the text (at most 1 KiB),
then 16 bytes of HMAC over all of it and the receiving rank), three times against loss; the
peers' ``notice(rank)`` returns it.  A transport whose data path to a peer is broken (a verbs
queue pair in the error state cannot carry an error message) still tells the peer why.

The waiting side asks ``silent_for(peer)`` from its endpoints' ``check`` (every 0.2 s while
it waits for that peer): past ``GPURT_PEER_STOPPED`` seconds of silence the peer is a
``PeerFailure`` — the same bound and meaning as a stopped local peer under ``shm``.  A
freeze shorter than the bound is not a failure.

Datagrams: ``<8sII>`` magic ``b"gpurtHB1"``, from-rank, sequence, then the first 16 bytes of
HMAC-SHA256(secret, magic | from | to | sequence) over the communicator's tcp secret:
anything that does not verify (a stranger, another job, a forged sender) is dropped
(counted, logged once).  The socket is bound to the rank's advertised address and an
OS-chosen port, exchanged with the tcp set-up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import select
import socket
import struct
import threading
import time

log = logging.getLogger("gpurt.tcp")

_HB = struct.Struct("<8sII")
_MAGIC = b"gpurtHB1"
_NOTE = b"gpurtHE1"
_NOTE_MAX = 1024
_MAC = 16
SIZE = _HB.size + _MAC


def _mac(secret: bytes, frm: int, to: int, seq: int) -> bytes:
    return hmac.new(secret, _MAGIC + struct.pack("<III", frm, to, seq),
                    hashlib.sha256).digest()[:_MAC]


def _note_mac(secret: bytes, signed: bytes, to: int) -> bytes:
    return hmac.new(secret, signed + struct.pack("<I", to), hashlib.sha256).digest()[:_MAC]


class Heartbeat:
    """One UDP socket and one daemon thread per tcp transport instance."""

    def __init__(self, ip: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((ip, 0))
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.me = -1
        self.peers: dict[int, tuple[str, int]] = {}
        self.last: dict[int, float] = {}
        self.dropped = 0
        self.notices: dict[int, str] = {}
        self._secret = b""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, me: int, secret: bytes, peers: dict[int, tuple[str, int]],
              interval: float) -> None:
        self.me, self._secret, self.peers = me, secret, dict(peers)
        now = time.monotonic()
        self.last = {q: now for q in peers}
        self._thread = threading.Thread(target=self._run, args=(interval,),
                                        name=f"gpurt-heartbeat-{me}", daemon=True)
        self._thread.start()

    def silent_for(self, peer: int) -> float:
        """Seconds since the last valid heartbeat from ``peer`` (0 if not watched)."""
        t = self.last.get(peer)
        return 0.0 if t is None else time.monotonic() - t

    def stopped(self, peer: int, host: str, what: str) -> str | None:
        """Why ``peer`` counts as failed — silent for more than ``GPURT_PEER_STOPPED``
        seconds (``what`` says what that may be) — or None."""
        from gpurt import config

        bound = float(config.get("GPURT_PEER_STOPPED"))
        silent = self.silent_for(peer)
        if silent <= bound:
            return None
        return (f"rank {peer} ({host}) has sent no heartbeat for {silent:.1f} s (more than "
                f"GPURT_PEER_STOPPED={bound:g} s): {what}")

    def notice(self, peer: int) -> str | None:
        """The text ``peer`` sent with ``notify``, if any."""
        return self.notices.get(peer)

    def notify(self, text: str, only: tuple[int, ...] | None = None) -> None:
        """Tell every peer (or those in ``only``) ``text`` (best effort: three datagrams
        each, no waiting)."""
        body = text.encode("utf-8", "replace")[:_NOTE_MAX]
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

    def _run(self, interval: float) -> None:
        seq = 0
        nxt = time.monotonic()
        sock = self.sock
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= nxt:
                seq += 1
                for q, addr in self.peers.items():
                    pkt = _HB.pack(_MAGIC, self.me, seq) + _mac(self._secret, self.me, q, seq)
                    try:
                        sock.sendto(pkt, addr)
                    except OSError:
                        pass            # a down link: the peer's silence tells them
                nxt = now + interval
            try:
                # (poll, not select: a communicator made when over a thousand files are
                # open has a descriptor above select's FD_SETSIZE)
                r = poller.poll(max(0, math.ceil((nxt - time.monotonic()) * 1000)))
            except (OSError, ValueError):
                return                  # closed under us
            if any(ev & select.POLLNVAL for _, ev in r):
                return
            if r:
                self._receive()

    def _receive(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(_HB.size + _NOTE_MAX + _MAC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            ok = False
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
                ok = (magic == _MAGIC and frm in self.peers and hmac.compare_digest(
                    data[_HB.size:], _mac(self._secret, frm, self.me, seq)))
            if ok:
                self.last[frm] = time.monotonic()
            else:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("tcp: rank %d dropped a heartbeat datagram from %s:%d that "
                                "does not prove this job's secret", self.me, *addr[:2])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        try:
            self.sock.close()
        except OSError:
            pass
