"""``cuda_ipc``: device buffers between ranks of one node, read straight from the peer's
GPU memory; and the pinned host staging that carries device buffers over host transports.

How ``cuda_ipc`` works (all CUDA calls go through ``gpurt.device``'s interface, so the same
code runs on a GPU and, for tests, on the host-memory stand-in):

* A message is a *descriptor* sent over the ``shm`` ring to the same peer (so tag,
  signature, order and liveness are checked exactly as for host messages): the message
  length, the IPC memory handle of the allocation that holds the sender's buffer and the
  buffer's offset in it (pooled allocators hand out pieces of big allocations; a handle
  always covers a whole one), and the IPC handle of an event the sender recorded on its
  stream after the work that produced the buffer.
* The receiver polls the sender's event from the host (``cudaEventQuery`` on the opened
  IPC event, as every wait of gpurt's); once it has fired, it opens the handle (once:
  opened allocations are cached by handle, LRU bounded, never closed while a read from
  them is in flight) and queues the copy or the reduction *reading the peer's memory
  directly* (NVLink / PCIe P2P) on its stream, then records an event of its own.  The
  stream never waits on the peer's event: a stream wait cannot be cancelled, so a peer
  that failed before its event fired would hold the caller's stream for ever (work the
  caller queues there after the ``PeerFailure`` would never run).  The price is a host
  round trip (poll, then launch) per message whose sender's event has not fired when its
  descriptor arrives; ``GPURT_IPC_STREAM_WAIT=1`` queues a stream wait instead.
* When that event has fired (polled, never waited on in CUDA) the receiver stores the
  message's number into its acknowledgement word in the shm segment header; the send
  completes when the acknowledgement arrives, so the sender cannot reuse its buffer while
  the peer still reads it.  A receiver whose posted size differs stores a refusal instead
  and both ranks raise ``CollectiveMismatchError``.
* The sender records its event when the call is made, so the peer's read waits for the
  work queued on the stream before the call.  Nothing orders work queued after it behind
  the peer's read: as with MPI's non-blocking sends, the application must not write the
  buffer (on any stream) until the request completes (a blocking call returns only
  then).  Events come from a per-peer pool of interprocess events, and one returns to
  the pool only when its message has been acknowledged (the peer may wait on it until
  then).

Staging (``StagedEndpoint``): device buffers to a peer that ``cuda_ipc`` cannot reach (other
nodes, or GPUs without P2P) move through page-locked host buffers in chunks of
``GPURT_DEVICE_STAGE`` bytes, pipelined: each chunk is copied device→host on the stream and
handed to the host transport as soon as its event fires (one per chunk, or per group of
chunks: at most ``_EVENTS`` per message), while later chunks are still being copied; the
receiver copies each arriving chunk host→device into device scratch of its own and
consumes it (copy or reduce) on its stream, at most ``_WINDOW`` chunks waiting for the
stream at a time.  Page-locked memory: the message's size on each side (pooled; released
after ``GPURT_DEVICE_STAGE_KEEP`` seconds idle).
"""

from __future__ import annotations

import math
import struct
import time
from collections import OrderedDict, deque

import numpy as np

from gpurt import config
from gpurt.errors import CollectiveMismatchError, TransportError

from .base import LANE_COLL, LANES, mismatch_detail

_DESC = struct.Struct("<8sQQQqQ64s64s")  # magic, nbytes, offset, seq, device, allocation id,
                                         # mem handle, event handle
_MAGIC = b"gpurtDV1"
_NAK = 1 << 63
_OPEN_MAX = 64         # idle opened peer allocations kept (LRU; an opened one stays mapped,
                       # so memory its owner freed is held until it is closed — and CUDA
                       # calls freeing an exported allocation before the importers closed it
                       # undefined (cudaIpcOpenMemHandle); the caching pools of CuPy and
                       # PyTorch return freed blocks to the driver only on empty_cache() /
                       # free_all_blocks() or when an allocation fails; a reused address is
                       # told apart by the allocation id)
_U8 = np.dtype(np.uint8)
_FIRED = object()       # an empty message's "sender event": nothing to wait for
_EVENTS = 64           # events a staged send records at most (one per chunk, or per group)
_WINDOW = 4            # chunks of a staged receive waiting for its stream at a time


class _Events:
    """Local (non-IPC) events for completions, recycled."""

    def __init__(self, be):
        self.be, self.free = be, []

    def get(self):
        return self.free.pop() if self.free else self.be.event(False)

    def put(self, ev) -> None:
        self.free.append(ev)


class CudaIpcTransport:
    """Per communicator: opened peer allocations and events, and the endpoints."""

    name = "cuda_ipc"

    def __init__(self, be, shm, rank: int):
        self.be, self.shm, self.rank = be, shm, rank
        # handle + allocation id -> [base, the local events of the receives reading it]
        self.opened: OrderedDict[bytes, list] = OrderedDict()
        self.peer_events: dict[bytes, object] = {}
        self.events = _Events(be)
        self.endpoints: dict[int, IpcEndpoint] = {}
        # (GPURT_IPC_STREAM_WAIT: the receiver's stream waits on the sender's event
        # instead of the host polling it first — faster, not cancellable)
        self.stream_wait = bool(config.get("GPURT_IPC_STREAM_WAIT"))

    def endpoint(self, peer: int, shm_ep) -> "IpcEndpoint":
        ep = IpcEndpoint(self, peer, shm_ep)
        self.endpoints[peer] = ep
        return ep

    def open(self, handle: bytes, aid: int) -> list:
        """The peer allocation of ``handle`` mapped here, cached by (handle, allocation id):
        a new allocation at a freed one's address is a new entry, never the stale one."""
        _reap()
        key = handle + aid.to_bytes(8, "little")
        ent = self.opened.get(key)
        if ent is not None:
            self.opened.move_to_end(key)
            return ent
        stale = [k for k, e in self.opened.items() if k[:-8] == handle and not e[1]]
        for k in stale:          # the same handle for an allocation since freed: close it
            self.be.ipc_close(self.opened.pop(k)[0])
        self._trim(_OPEN_MAX - 1)
        ent = self.opened[key] = [self.be.ipc_open(handle), set()]
        return ent

    def _trim(self, keep: int) -> None:
        """Close idle mappings, least recently used first, until at most ``keep`` stay
        (one a queued copy still reads stays, whatever the count)."""
        if len(self.opened) <= keep:
            return
        for k, e in list(self.opened.items()):
            if len(self.opened) <= keep:
                break
            if not e[1]:
                del self.opened[k]
                self.be.ipc_close(e[0])

    def read(self, ent: list, ev) -> None:
        """A receive's copy, complete at its local event ``ev``, reads ``ent``."""
        ent[1].add(ev)

    def done_reading(self, ent: list, ev) -> None:
        ent[1].discard(ev)
        if not ent[1] and len(self.opened) > _OPEN_MAX:   # after a burst: back to the bound
            self._trim(_OPEN_MAX)

    def peer_event(self, handle: bytes):
        ev = self.peer_events.get(handle)
        if ev is None:
            ev = self.peer_events[handle] = self.be.event_open(handle)
        return ev

    def close(self) -> None:
        """Close every mapping; one that a queued copy still reads (a receive that timed
        out or was abandoned, its peer's event not fired yet) is closed only once that
        copy's event has fired — unmapping it under the copy crashed the process."""
        for base, reading in self.opened.values():
            if reading:
                _LINGER.append((self.be, base, list(reading)))
                continue
            try:
                self.be.ipc_close(base)
            except Exception:  # noqa: BLE001 - closing on an error path
                pass
        self.opened.clear()
        self.peer_events.clear()
        self.endpoints.clear()
        _reap()


# mappings closed by a communicator while copies still read them: (backend, base, the
# copies' events); closed by the next open or close of any communicator once all have fired
_LINGER: list = []


def _reap() -> None:
    if not _LINGER:
        return
    keep = []
    for be, base, evs in _LINGER:
        try:
            fired = all(be.query(ev) for ev in evs)
        except Exception:  # noqa: BLE001 - a failed context: the copies will never run
            fired = True
        if not fired:
            keep.append((be, base, evs))
            continue
        try:
            be.ipc_close(base)
        except Exception:  # noqa: BLE001
            pass
    _LINGER[:] = keep


class IpcEndpoint:
    transport = "cuda_ipc"

    def __init__(self, owner: CudaIpcTransport, peer: int, shm_ep):
        self.owner, self.peer, self.shm_ep = owner, peer, shm_ep
        self.be = owner.be
        seg = owner.shm.seg
        me, other = owner.shm.local_rank, shm_ep.local_peer
        self.q = seg.q
        self.ack_tx = [seg.ack_i(me, other, lane) for lane in range(LANES)]   # peer writes
        self.ack_rx = [seg.ack_i(other, me, lane) for lane in range(LANES)]   # we write
        self.sent = [0] * LANES           # messages sent per lane (the segment is this
        self.got = [0] * LANES            # communicator's own, so counts start at 0)
        self.finished: list[set] = [set() for _ in range(LANES)]
        self.acked_upto = [0] * LANES
        self.refused = [False] * LANES    # a refusal stays: nothing on the lane counts after
        self.free_evs: list = []          # interprocess events not in use by a message

    def check(self) -> None:
        self.shm_ep.check()

    def opening(self, what: str, fn, *args):
        """``fn(*args)``, opening something of the peer's (its allocation, its event): an
        exception there is ``PeerFailure`` where the peer has exited meanwhile (a sender
        that exits with a message in flight takes its allocation and events with it: that
        was a ``TransportError`` about a file), else ``TransportError`` naming the peer."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the peer's state says which it is
            end = time.monotonic() + 0.2      # (an exiting peer closes its files before
            while True:                       # /proc shows it gone)
                self.shm_ep.check()
                if time.monotonic() >= end:
                    break
                time.sleep(0.01)
            if isinstance(e, TransportError):
                e.args = (f"rank {self.owner.rank}: {what} of rank {self.peer}: "
                          f"{e.args[0]}",) + e.args[1:]
                raise
            raise TransportError(f"rank {self.owner.rank}: {what} of rank {self.peer}: "
                                 f"{type(e).__name__}: {e}") from e

    def acked(self, lane: int) -> int:
        return int(self.q[self.ack_tx[lane]])

    def send(self, src, lane: int, tag: int, sig: int, stream) -> "_IpcSend":
        self.sent[lane] += 1
        return _IpcSend(self, src, lane, tag, sig, stream, self.sent[lane])

    def recv(self, nbytes: int, sink, lane: int, tag: int, sig: int, stream) -> "_IpcRecv":
        self.got[lane] += 1
        return _IpcRecv(self, nbytes, sink, lane, tag, sig, stream, self.got[lane])

    def finish(self, lane: int, seq: int) -> None:
        """Acknowledge in order: the word says 'all messages up to n are read'."""
        if self.refused[lane]:
            return
        done = self.finished[lane]
        done.add(seq)
        n = self.acked_upto[lane]
        while n + 1 in done:
            n += 1
            done.discard(n)
        if n != self.acked_upto[lane]:
            self.acked_upto[lane] = n
            self.q[self.ack_rx[lane]] = n

    def refuse(self, lane: int, seq: int) -> None:
        self.refused[lane] = True
        self.q[self.ack_rx[lane]] = seq | _NAK


class _IpcSend:
    __slots__ = ("ep", "src", "lane", "tag", "sig", "stream", "seq", "msg", "peer", "done",
                 "ev")

    def __init__(self, ep: IpcEndpoint, src, lane, tag, sig, stream, seq):
        self.ep, self.src, self.lane, self.tag, self.sig = ep, src, lane, tag, sig
        self.stream, self.seq, self.msg, self.peer, self.done = stream, seq, None, ep.peer, False
        self._start()

    def _start(self) -> None:
        """Record the event now (the buffer's content is what the stream holds at the
        call, whatever is queued after it) and send the descriptor (in call order)."""
        ep, be = self.ep, self.ep.be
        self._refused(ep.acked(self.lane))
        ptr = be.ptr(self.src)
        nbytes = self.src.nbytes
        if nbytes:
            base, _size = be.address_range(ptr)
            mem, aid = be.ipc_handle(base), be.alloc_id(base)
        else:
            base, mem, aid = ptr, b"", 0
        # an event no unacknowledged message uses: the peer may still wait on those
        ev = self.ev = ep.free_evs.pop() if ep.free_evs else be.event(True)
        be.record(ev, self.stream)
        desc = _DESC.pack(_MAGIC, nbytes, ptr - base, self.seq, be.current(), aid, mem,
                          ev.handle)
        self.msg = ep.shm_ep.send(np.frombuffer(desc, _U8), self.lane, self.tag, self.sig)

    def _refused(self, word: int) -> None:
        """A refusal on the lane fails every send not yet acknowledged: the receiver's
        side of the lane is out of step from that message on."""
        if word & _NAK:
            what = "collective call #" if self.lane == LANE_COLL else "tag "
            raise CollectiveMismatchError(
                f"rank {self.ep.owner.rank}: rank {self.peer} refused this rank's device "
                f"message ({what}{self.tag}, {self.src.nbytes} bytes): the receive it posted "
                f"differs (cuda_ipc)")

    def local(self) -> bool:
        """Held up by this rank's own stream: the work queued on it before the call has not
        reached the send's event (the peer waits for that event before it reads)."""
        return not self.done and self.ev is not None and not self.ep.be.query(self.ev)

    def test(self) -> bool:
        if self.done:
            return True
        if not self.msg.test():
            return False
        word = self.ep.acked(self.lane)
        self._refused(word)
        if word >= self.seq:
            self.ep.free_evs.append(self.ev)
            self.done, self.src, self.ev = True, None, None
        return self.done


class _IpcRecv:
    __slots__ = ("ep", "nbytes", "sink", "lane", "tag", "sig", "stream", "seq", "msg", "raw",
                 "ev", "ent", "peer", "done", "pev", "off")

    def __init__(self, ep: IpcEndpoint, nbytes, sink, lane, tag, sig, stream, seq):
        self.ep, self.nbytes, self.sink, self.lane = ep, nbytes, sink, lane
        self.tag, self.sig, self.stream, self.seq, self.peer = tag, sig, stream, seq, ep.peer
        self.raw = np.empty(_DESC.size, _U8)
        self.ev = self.ent = self.pev = None      # (pev: the sender's event)
        self.off = None                           # (offset, handle, allocation id)
        self.done = False
        self.msg = ep.shm_ep.recv(_DESC.size, self._desc, lane, tag, sig)

    def _desc(self, off: int, chunk: np.ndarray) -> None:
        self.raw[off:off + chunk.nbytes] = chunk

    def _check(self):
        """The descriptor, checked against this receive: the sender's event (None for an
        empty message); where its allocation lies is kept for ``_post``."""
        ep = self.ep
        magic, nbytes, off, seq, _dev, aid, mem, evh = _DESC.unpack(self.raw.tobytes())
        if magic != _MAGIC or seq != self.seq:
            ep.refuse(self.lane, self.seq)
            raise CollectiveMismatchError(
                f"rank {ep.owner.rank}: from rank {self.peer}: not a device message where "
                f"one was expected (host and device buffers mixed?) (cuda_ipc)")
        if nbytes != self.nbytes:
            ep.refuse(self.lane, self.seq)
            detail = mismatch_detail(self.lane, self.tag, self.sig, nbytes, self.tag,
                                     self.sig, self.nbytes)
            raise CollectiveMismatchError(
                f"rank {ep.owner.rank}: device message from rank {self.peer} does not match "
                f"the receive posted for it: {detail} (cuda_ipc)")
        if not nbytes:
            return None
        self.off = (off, mem, aid)   # (opened when the read is queued: an open allocation
        # not read yet is idle, the LRU could close it)
        return ep.opening("opening the event", ep.owner.peer_event, evh)

    def _post(self) -> None:
        """The read (copy or reduction) queued on the stream, the sender's event having
        fired: polled from the host (``test``), never waited for on the stream — a wait
        there on a peer that then failed would hold the caller's stream for ever."""
        ep, be = self.ep, self.ep.be
        ev = ep.owner.events.get()
        if self.off is not None:
            off, mem, aid = self.off
            self.ent = ent = ep.opening("opening the allocation", ep.owner.open, mem, aid)
            ep.owner.read(ent, ev)
            if ep.owner.stream_wait:
                be.wait_event(self.stream, self.pev)
            self.sink(0, be.view(ent[0] + off, self.nbytes, ep.owner))
        be.record(ev, self.stream)
        self.ev = ev

    def local(self) -> bool:
        """Held up by this rank's own stream: the read is queued, behind work queued there
        before it."""
        return not self.done and self.ev is not None and not self.ep.be.query(self.ev)

    def test(self) -> bool:
        if self.done:
            return True
        if self.ev is None:
            if self.pev is None:
                if not self.msg.test():
                    return False
                pev = self._check()
                self.pev = _FIRED if pev is None else pev
            if self.pev is not _FIRED and not self.ep.owner.stream_wait and \
                    not self.ep.be.query(self.pev):
                return False
            self._post()
        if not self.ep.be.query(self.ev):
            return False
        if self.ent is not None:
            self.ep.owner.done_reading(self.ent, self.ev)
        self.ep.owner.events.put(self.ev)
        self.ep.finish(self.lane, self.seq)
        self.done, self.sink, self.pev = True, None, None
        return True


# -- staging through pinned host memory --------------------------------------------------
class _Pinned:
    """Page-locked host buffers and device scratch, reused by power-of-two size class.

    A buffer given back waits for reuse; one left idle for ``GPURT_DEVICE_STAGE_KEEP``
    seconds is released (page-locked memory is taken from what the host can page, and a
    burst of large or concurrent messages would otherwise hold its peak for the process's
    life).  Releasing happens when the pool is next used (``get``/``put``): a loop that
    stages every few seconds keeps its buffers, a burst's surplus goes with the next
    message after it.  Scratch returns to the array library's pool (CuPy's or the
    stand-in's), which hands it out again to the application."""

    def __init__(self, be, keep: float | None = None):
        self.be = be
        # size class -> [(time given back, buffer)], oldest first (reuse takes the newest)
        self.host: dict[int, list] = {}
        self.dev: dict[int, list] = {}
        self.keep = float(config.get("GPURT_DEVICE_STAGE_KEEP")) if keep is None else keep
        self.trim_at = math.inf        # when the oldest idle buffer's time is up
        self.released = 0              # bytes released so far (gpurt info, tests)

    @staticmethod
    def _cls(n: int) -> int:
        return 1 << max(12, (max(n, 1) - 1).bit_length())

    def idle_bytes(self) -> int:
        """Bytes of page-locked host memory idle in the pool (and of device scratch)."""
        return sum(c * len(v) for c, v in self.host.items()) + \
            sum(c * len(v) for c, v in self.dev.items())

    def _trim(self, now: float) -> None:
        if now < self.trim_at:
            return
        cut, nxt = now - self.keep, math.inf
        for pool in (self.host, self.dev):
            for c, lst in list(pool.items()):
                k = 0
                while k < len(lst) and lst[k][0] <= cut:
                    k += 1
                if k:
                    del lst[:k]              # (freed when the last reference goes)
                    self.released += c * k
                if lst:
                    nxt = min(nxt, lst[0][0] + self.keep)
                else:
                    del pool[c]
        self.trim_at = nxt

    def _get(self, pool: dict, n: int, make):
        c = self._cls(n)
        lst = pool.get(c)
        buf = lst.pop()[1] if lst else make(c)
        self._trim(time.monotonic())
        return buf, c

    def _put(self, pool: dict, buf, c: int) -> None:
        now = time.monotonic()
        pool.setdefault(c, []).append((now, buf))
        self.trim_at = min(self.trim_at, now + self.keep)
        self._trim(now)

    def get_host(self, n: int):
        return self._get(self.host, n, self.be.pinned)

    def put_host(self, buf, c: int) -> None:
        self._put(self.host, buf, c)

    def get_dev(self, n: int, stream=None):
        return self._get(self.dev, n, lambda c: self.be.alloc(c, stream))

    def put_dev(self, buf, c: int) -> None:
        self._put(self.dev, buf, c)


class StagedEndpoint:
    """Device messages over a host endpoint (``shm`` without P2P, ``tcp``, ``verbs``)."""

    def __init__(self, host_ep, be, events: _Events, pool: _Pinned, stage: int | None = None):
        self.host_ep, self.be, self.events, self.pool = host_ep, be, events, pool
        self.peer = host_ep.peer
        self.transport = f"{host_ep.transport}+staged"
        # whole 64-byte units: a chunk never splits an element (``stage``: the
        # communicator's GPURT_DEVICE_STAGE, rank 0's: both ends must cut alike)
        if stage is None:
            stage = int(config.get("GPURT_DEVICE_STAGE"))
        self.chunk = max(4096, stage) // 64 * 64
        # sends whose chunks are not all handed to the host endpoint yet, per lane: chunks
        # go out in call order (a later send's copy may finish first, on another stream)
        self.outq: list[deque] = [deque() for _ in range(LANES)]

    def pump(self, lane: int) -> None:
        """Hand ready chunks to the host endpoint, oldest send first."""
        q = self.outq[lane]
        while q:
            head = q[0]
            head.post_ready()
            if not head.all_posted():
                return
            q.popleft()

    def ordered(self, lane: int, start):
        """Start another kind of send to this peer (a host message, a GPUDirect RTS) in
        call order with the staged ones: at once if none waits, else behind them."""
        if not self.outq[lane]:
            return start()
        return _Later(self, lane, start)

    def check(self) -> None:
        self.host_ep.check()

    def _spans(self, n: int) -> list[tuple[int, int]]:
        c = self.chunk
        return [(a, min(n, a + c)) for a in range(0, n, c)] or [(0, 0)]

    def send(self, src, lane: int, tag: int, sig: int, stream) -> "_StagedSend":
        return _StagedSend(self, src, lane, tag, sig, stream)

    def recv(self, nbytes: int, sink, lane: int, tag: int, sig: int, stream) -> "_StagedRecv":
        return _StagedRecv(self, nbytes, sink, lane, tag, sig, stream)


class _StagedSend:
    """A device message to a staged peer: every chunk's device-to-host copy is queued on
    the call's stream at the call (so it reads what the stream holds then, and nothing
    the caller queues there afterwards delays it; the stream is not used after the call)
    into one page-locked buffer of the message's size, with an event after every
    ``step`` chunks — at most ``_EVENTS`` per message, however many chunks — and the
    chunks are handed to the host endpoint, in order, as their events fire."""

    __slots__ = ("ep", "spans", "host", "cls", "evs", "ends", "ready", "msgs", "lane", "tag",
                 "sig", "peer", "done", "src", "__weakref__")

    def __init__(self, ep: StagedEndpoint, src, lane, tag, sig, stream):
        self.ep, self.lane, self.tag, self.sig, self.peer = ep, lane, tag, sig, ep.peer
        be = ep.be
        n = src.nbytes
        self.spans = spans = ep._spans(n)
        self.host, self.cls = ep.pool.get_host(n)
        step = -(-len(spans) // _EVENTS)
        self.evs: list = []                 # event g fires once chunks [0, ends[g]) are copied
        self.ends: list[int] = []
        self.src = src                      # kept alive until the copies have run
        for i, (a, b) in enumerate(spans):
            if b > a:
                be.to_host(self.host[a:b], src[a:b], stream)
            if (i + 1) % step == 0 or i == len(spans) - 1:
                ev = ep.events.get()
                be.record(ev, stream)
                self.evs.append(ev)
                self.ends.append(i + 1)
        self.ready = 0                      # events seen fired
        self.msgs: list = []
        self.done = False
        ep.outq[lane].append(self)
        ep.pump(lane)

    def all_posted(self) -> bool:
        return len(self.msgs) == len(self.spans)

    def local(self) -> bool:
        """Held up by this rank's own stream: a chunk's copy to the host has not run (the
        work queued there before the call comes first)."""
        return not self.done and self.ready < len(self.evs) and \
            not self.ep.be.query(self.evs[self.ready])

    def post_ready(self) -> None:
        ep = self.ep
        while len(self.msgs) < len(self.spans):
            i = len(self.msgs)
            if i >= (self.ends[self.ready - 1] if self.ready else 0):
                if self.ready == len(self.evs) or not ep.be.query(self.evs[self.ready]):
                    return
                self.ready += 1
                continue
            a, b = self.spans[i]
            self.msgs.append(ep.host_ep.send(self.host[a:b], self.lane, self.tag, self.sig))

    def test(self) -> bool:
        if self.done:
            return True
        ep = self.ep
        if len(self.msgs) < len(self.spans):
            ep.pump(self.lane)             # (posts in call order: behind earlier sends)
        if len(self.msgs) < len(self.spans) or not all(m.test() for m in self.msgs):
            return False
        for ev in self.evs:
            ep.events.put(ev)
        ep.pool.put_host(self.host, self.cls)
        self.done, self.host, self.msgs, self.src = True, None, None, None
        return True


class _Later:
    """A send waiting behind earlier staged sends on its lane; started by ``pump``."""

    __slots__ = ("ep", "lane", "start", "inner", "peer")

    def __init__(self, ep: StagedEndpoint, lane: int, start):
        self.ep, self.lane, self.start, self.inner, self.peer = ep, lane, start, None, ep.peer
        ep.outq[lane].append(self)
        ep.pump(lane)

    def all_posted(self) -> bool:
        return self.inner is not None

    def post_ready(self) -> None:
        if self.inner is None:
            self.inner, self.start = self.start(), None

    @property
    def done(self) -> bool:
        return self.inner is not None and self.inner.done

    def test(self) -> bool:
        if self.inner is None:
            self.ep.pump(self.lane)
            if self.inner is None:
                return False
        return self.inner.test()


class HostInOrder:
    """The host endpoint to a peer that also has a staged device endpoint: host sends
    queue behind staged device sends still waiting for their copies (order on the lane)."""

    def __init__(self, dev_ep, host_ep):
        self.staged = getattr(dev_ep, "staged", dev_ep)
        self.host_ep, self.peer, self.transport = host_ep, host_ep.peer, host_ep.transport

    def send(self, src, lane: int, tag: int, sig: int):
        return self.staged.ordered(lane, lambda: self.host_ep.send(src, lane, tag, sig))

    def recv(self, nbytes: int, sink, lane: int, tag: int, sig: int, upto: bool = False):
        if upto:
            return self.host_ep.recv(nbytes, sink, lane, tag, sig, upto=True)
        return self.host_ep.recv(nbytes, sink, lane, tag, sig)

    def check(self) -> None:
        self.host_ep.check()


class _StagedRecv:
    """A staged device message's receiving end: every chunk's host receive is posted at
    once (message order on the lane) into one page-locked buffer of the message's size
    (taken at the call: the host transport may deliver any time); an arrived chunk is
    copied host-to-device into device scratch of its own and consumed there (``sink``) on
    the stream — at most ``_WINDOW`` chunks waiting for the stream at a time, each one's
    scratch and event given back once the event after it has fired, so device scratch
    and events stay bounded whatever the message's size."""

    __slots__ = ("ep", "spans", "host", "hcls", "devs", "msgs", "evs", "sink", "stream",
                 "peer", "done", "freed")

    def __init__(self, ep: StagedEndpoint, nbytes, sink, lane, tag, sig, stream):
        self.ep, self.sink, self.stream, self.peer = ep, sink, stream, ep.peer
        self.spans = ep._spans(nbytes)
        self.host, self.hcls = ep.pool.get_host(nbytes)
        host = self.host
        self.devs: list = [None] * len(self.spans)   # chunk i's (device scratch, class)

        def into(a):
            def sink_(off: int, chunk: np.ndarray) -> None:
                host[a + off:a + off + chunk.nbytes] = chunk
            return sink_

        self.msgs = [ep.host_ep.recv(b - a, into(a), lane, tag, sig) for a, b in self.spans]
        self.evs: list = []
        self.freed = 0
        self.done = False

    def local(self) -> bool:
        """Held up by this rank's own stream: an arrived chunk's copy to the device has not
        run (the work queued there before it comes first)."""
        return not self.done and self.freed < len(self.evs) and \
            not self.ep.be.query(self.evs[self.freed])

    def test(self) -> bool:
        if self.done:
            return True
        ep, be = self.ep, self.ep.be
        spans, pool, evs = self.spans, ep.pool, self.evs
        while True:
            while self.freed < len(evs) and be.query(evs[self.freed]):
                i = self.freed
                if self.devs[i] is not None:
                    pool.put_dev(*self.devs[i])
                ep.events.put(evs[i])
                self.devs[i] = evs[i] = None
                self.freed += 1
            i = len(evs)
            if i == len(spans) or i - self.freed >= _WINDOW or not self.msgs[i].test():
                break
            a, b = spans[i]
            if b > a:
                d, c = pool.get_dev(b - a, self.stream)
                self.devs[i] = (d, c)
                be.from_host(d[:b - a], self.host[a:b], self.stream)
                self.sink(a, d[:b - a])
            ev = ep.events.get()
            be.record(ev, self.stream)
            evs.append(ev)
        if self.freed < len(spans):
            return False
        pool.put_host(self.host, self.hcls)
        self.done, self.host, self.sink, self.msgs = True, None, None, None
        return True


# -- GPUDirect RDMA over verbs ------------------------------------------------------------
class GdrEndpoint:
    """Device messages over ``verbs`` with GPUDirect RDMA: messages larger than the eager
    limit go NIC-to-GPU — the sender copies its buffer into a registered device bounce
    buffer on the stream (a device copy: no registration of user memory, whose lifetime
    gpurt cannot see), and once that copy's event has fired the NIC RDMA-writes it into a
    registered device scratch buffer at the receiver, which consumes it (copy or reduce)
    on its stream.  The RTS goes at the call, so messages keep their order on the lane.
    Small messages are staged through pinned host memory (``StagedEndpoint``)."""

    def __init__(self, verbs_ep, be, events: _Events, staged: "StagedEndpoint"):
        self.vep, self.be, self.events, self.staged = verbs_ep, be, events, staged
        self.peer = verbs_ep.peer
        self.transport = "verbs+gdr"
        self.eager = verbs_ep.owner.eager
        # size class -> [(time given back, (view, registration, class))], oldest first
        self.free: dict[int, list] = {}
        self.keep = staged.pool.keep      # GPURT_DEVICE_STAGE_KEEP, as staging's pool
        self.trim_at = math.inf
        self.released = 0                 # bytes deregistered and freed so far (tests)

    def check(self) -> None:
        self.vep.check()

    def idle_bytes(self) -> int:
        return sum(c * len(v) for c, v in self.free.items())

    def scratch(self, n: int, stream=None) -> tuple:
        """(view, registration, size class): registered device memory, pooled (the newest
        idle one of its class)."""
        c = _Pinned._cls(n)
        lst = self.free.get(c)
        if lst:
            item = lst.pop()[1]
        else:
            v = self.be.alloc(c, stream)
            self.be.gdr_prepare(v)
            own = self.vep.owner
            item = (v, own.reg.get_dev(self.be.ptr(v), c, v, own.access), c)
        self._trim(time.monotonic())
        return item

    def release(self, item: tuple) -> None:
        now = time.monotonic()
        self.free.setdefault(item[2], []).append((now, item))
        self.trim_at = min(self.trim_at, now + self.keep)
        self._trim(now)

    def _trim(self, now: float) -> None:
        """Deregister and free what stayed idle longer than ``keep`` (a burst's bounce and
        scratch buffers were registered, and held, for the communicator's life)."""
        if now < self.trim_at:
            return
        cut, nxt = now - self.keep, math.inf
        reg = self.vep.owner.reg
        for c, lst in list(self.free.items()):
            k = 0
            while k < len(lst) and lst[k][0] <= cut:
                k += 1
            for _t, (_v, r, _c) in lst[:k]:
                reg._drop(r.key)          # (deregistered before its memory goes)
            if k:
                del lst[:k]
                self.released += c * k
            if lst:
                nxt = min(nxt, lst[0][0] + self.keep)
            else:
                del self.free[c]
        self.trim_at = nxt

    def send(self, src, lane: int, tag: int, sig: int, stream):
        if src.nbytes <= self.eager:
            return self.staged.send(src, lane, tag, sig, stream)
        return _GdrSend(self, src, lane, tag, sig, stream)

    def recv(self, nbytes: int, sink, lane: int, tag: int, sig: int, stream):
        if nbytes <= self.eager:
            return self.staged.recv(nbytes, sink, lane, tag, sig, stream)
        return _GdrRecv(self, nbytes, sink, lane, tag, sig, stream)


class _GdrSend:
    __slots__ = ("ep", "item", "ev", "m", "peer", "done")

    def __init__(self, ep: GdrEndpoint, src, lane, tag, sig, stream):
        be = ep.be
        self.ep, self.peer, self.done = ep, ep.peer, False
        n = src.nbytes
        self.item = ep.scratch(n, stream)
        be.copy(self.item[0][:n], src, stream)         # at the call: stream order
        self.ev = ev = ep.events.get()
        be.record(ev, stream)
        ptr, lkey = be.ptr(self.item[0]), self.item[1].mr.lkey
        # the RTS in call order with staged (small) sends on the lane
        self.m = ep.staged.ordered(lane, lambda: ep.vep.send_device(
            ptr, n, lkey, lambda: be.query(ev), lane, tag, sig))

    def test(self) -> bool:
        if self.done:
            return True
        if not self.m.test():
            return False
        self.ep.events.put(self.ev)
        self.ep.release(self.item)
        self.done, self.item, self.ev = True, None, None
        return True


class _GdrRecv:
    __slots__ = ("ep", "item", "ev", "m", "peer", "done", "sink", "stream", "n")

    def __init__(self, ep: GdrEndpoint, nbytes, sink, lane, tag, sig, stream):
        self.ep, self.peer, self.done, self.sink, self.stream = ep, ep.peer, False, sink, stream
        self.n = nbytes
        self.item = ep.scratch(nbytes, stream)
        self.ev = None
        reg = self.item[1]
        self.m = ep.vep.recv_device(nbytes, ep.be.ptr(self.item[0]), reg.mr.rkey, lane, tag,
                                    sig)

    def test(self) -> bool:
        if self.done:
            return True
        be = self.ep.be
        if self.ev is None:
            if not self.m.test():
                return False
            be.rdma_flush()                         # the NIC's write, visible to kernels
            self.sink(0, self.item[0][:self.n])     # on the stream: after the NIC's write
            self.ev = self.ep.events.get()
            be.record(self.ev, self.stream)
        if not be.query(self.ev):
            return False
        self.ep.events.put(self.ev)
        self.ep.release(self.item)
        self.done, self.item, self.ev, self.sink = True, None, None, None
        return True
