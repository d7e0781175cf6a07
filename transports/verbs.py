"""``verbs``: RDMA between nodes over InfiniBand or RoCE, through pyverbs (rdma-core).

How it works
------------
*Device* (``GPURT_IB_HCA``, as ``NCCL_IB_HCA``: ``mlx5_0:1,mlx5_1`` device-name prefixes with
an optional port, ``^`` in front excludes, ``=`` in front for exact names): the first device
with an ACTIVE port that the spec allows.  *Addressing*: on RoCE (Ethernet link layer) the
GID index is chosen automatically — a RoCE v2 GID holding an IPv4-mapped address (routable
over IP), else any RoCE v2 GID, else index 0 — unless ``GPURT_IB_GID_INDEX`` says; on
InfiniBand the port's LID (and GID index 0 only if ``GPURT_IB_GID_INDEX`` asks for a global
route).  The path MTU is the smaller of the two ports' active MTUs.

*Set-up* (``connect``, collective over the MPI control plane): every rank opens the
device, a protection domain, one completion queue and one RC queue pair per verbs peer,
registers its receive rings and a small control block, posts its receives, and one MPI
allgather carries every rank's QP numbers, GID/LID, MTU, ring and control-block addresses
and keys, and rank 0's per-communicator secret (for the heartbeats).  Each QP then goes
RESET→INIT→RTR→RTS with its peer's data, and a second allgather (of errors) makes sure
every QP is ready before anyone writes.  A rank whose set-up fails makes every rank raise
the same ``TransportError``.

*Eager path* (messages of at most ``GPURT_IB_EAGER`` bytes, and every control message):
each rank has, per peer, a ring of ``GPURT_IB_SLOTS`` slots of 64 + ``GPURT_IB_EAGER``
bytes registered for remote writes.  The sender copies a 64-byte header (kind, lane, tag,
signature, total size, message id, address/key for control messages) and the payload into
a registered staging slot and posts one RDMA WRITE WITH IMMEDIATE into the next slot of the
peer's ring; the immediate data (the slot's sequence number) raises a receive completion at
the peer, which matches the header against the receive posted for that lane and hands the
payload to the receive's sink straight from the ring (one copy into the user's buffer, or
a reduction reading the ring).  *Credits*: a sender never has more than ``SLOTS`` writes
in flight to a peer; the receiver returns consumed slots by an RDMA WRITE of its consumed
count into the sender's control block (no receive work request consumed, so credit returns
can never deadlock on credits).

*Rendezvous path* (larger messages, zero-copy): the sender posts an RTS (header only); the
receiver, once its receive is posted and the RTS matches it (tag, signature, size — or it
answers NAK and both sides raise ``CollectiveMismatchError`` before any byte is written),
answers CTS with the address and rkey of the destination: the user's buffer itself,
registered (plain receives), or a registered scratch buffer (reductions, which then read
it); the sender RDMA WRITEs its registered buffer straight there and posts FIN, whose
arrival completes the receive.  *Registration cache*: user buffers are registered whole
(the array that owns the memory, so every slice of it hits the same registration), keyed
by that owner, and deregistered when the owner is freed (a weakref finalizer) or at
close; at most ``GPURT_IB_REG_CACHE`` bytes stay registered (least recently used are
dropped).  Memory that cannot be registered goes through registered bounce buffers.

*Progress*: no threads on the data path.  A completion's ``test()`` polls the CQ (every
completion is signaled) and advances every peer's protocol.  *Failure*: a work completion
with an error status puts the endpoint in error — ``PeerFailure`` (retry counters exceeded:
the peer's QP is gone) or ``TransportError`` (anything else), naming the rank, the peer and
the verbs status; the rank tells its peers with an authenticated UDP notice (its QP cannot
carry it), so both sides raise.  A frozen or killed peer on another node is found by the
same heartbeats as ``tcp`` (``transports/heartbeat.py``, ``GPURT_PEER_STOPPED``), bound to
the IPv4 address of the RoCE GID (or the ``GPURT_SOCKET_IFNAME`` address on InfiniBand).
``publish_error`` sends an ERROR message to every peer (and the UDP notice); ``close``
sends BYE, so a peer that still waits raises at once instead of at its deadline.

*GPUDirect RDMA*: ``gpudirect()`` says whether device memory can be registered
(``nvidia_peermem`` loaded, or ``GPURT_IB_GDR=1``; the dma-buf path is detected, not used)
and ``gpurt info`` reports it.  ``send_device``/``recv_device`` move registered device
memory by rendezvous (the write waits for the producer's event); the device path's
``GdrEndpoint`` (``transports/cuda_ipc.py``) drives them.  Without it, device buffers
are staged through pinned host memory over the ordinary ``send``/``recv``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import socket
import struct
import time
import weakref
from collections import OrderedDict, deque
from typing import Callable

import numpy as np

from gpurt import config
from gpurt.errors import (CollectiveMismatchError, PeerFailure, ResourceError, TransportError,
                          fit_text, from_peer, published_class, relayed_rank)

from .base import CLOSED_OR_EXITED, LANE_NAMES, LANES, UPTO_MAX, Sink, mismatch_detail, unpaired
from .heartbeat import Heartbeat, _pids

log = logging.getLogger("gpurt.verbs")
# (a forked child) verbs objects of the parent's context that the child must never free
_INHERITED: list = []

# -- wire format of a slot -----------------------------------------------------------------
# magic, kind, lane, flags, msgid, tag, sig, total, addr, rkey, payload bytes
_HDR = struct.Struct("<IBBHIQQQQII")
HDR = 64
MAGIC = 0x56505447                  # b"GTPV"
K_EAGER, K_RTS, K_CTS, K_NAK, K_FIN, K_ERROR, K_BYE = range(1, 8)
_KIND = {K_EAGER: "eager", K_RTS: "RTS", K_CTS: "CTS", K_NAK: "NAK", K_FIN: "FIN",
         K_ERROR: "error", K_BYE: "bye"}
_M64 = 0xFFFFFFFFFFFFFFFF
_CTRL = 16                          # control block bytes per peer: credit in, credit out
_MAX_WRITE = 1 << 30                # one RDMA WRITE moves at most this much
_WHOLE_MAX = 64 << 20               # arrays up to this size are registered whole
_PAGE = 4096
_HB_INTERVAL = 0.5
_BYE_S = 0.2                        # close() waits at most this long for its BYE writes
_PUBLISH_S = 0.5
_REAP_S = 2.0                       # then at most this long for the flushed RDMA WRITEs

# work request ids: low 8 bits the kind of work, the rest an index
_W_SLOT, _W_CREDIT, _W_DATA, _W_RECV = 1, 2, 3, 4

# ibv_wc_status names (verbs.h), for error messages
_WC_STATUS = {
    0: "IBV_WC_SUCCESS", 1: "IBV_WC_LOC_LEN_ERR", 2: "IBV_WC_LOC_QP_OP_ERR",
    3: "IBV_WC_LOC_EEC_OP_ERR", 4: "IBV_WC_LOC_PROT_ERR", 5: "IBV_WC_WR_FLUSH_ERR",
    6: "IBV_WC_MW_BIND_ERR", 7: "IBV_WC_BAD_RESP_ERR", 8: "IBV_WC_LOC_ACCESS_ERR",
    9: "IBV_WC_REM_INV_REQ_ERR", 10: "IBV_WC_REM_ACCESS_ERR", 11: "IBV_WC_REM_OP_ERR",
    12: "IBV_WC_RETRY_EXC_ERR", 13: "IBV_WC_RNR_RETRY_EXC_ERR", 14: "IBV_WC_LOC_RDD_VIOL_ERR",
    15: "IBV_WC_REM_INV_RD_REQ_ERR", 16: "IBV_WC_REM_ABORT_ERR", 17: "IBV_WC_INV_EECN_ERR",
    18: "IBV_WC_INV_EEC_STATE_ERR", 19: "IBV_WC_FATAL_ERR", 20: "IBV_WC_RESP_TIMEOUT_ERR",
    21: "IBV_WC_GENERAL_ERR", 22: "IBV_WC_TM_ERR", 23: "IBV_WC_TM_RNDV_INCOMPLETE",
}
_PEER_GONE = (12, 13)               # retries exhausted: nobody answers at the other end
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def _view(addr: int, n: int) -> np.ndarray:
    """A uint8 array over ``n`` bytes at ``addr`` (registered memory pyverbs allocated)."""
    if n == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), np.uint8)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# -- device, port and address selection (pure functions: tested without hardware) ----------
def parse_hca(spec: str) -> tuple[bool, bool, list[tuple[str, int | None]]]:
    """``GPURT_IB_HCA`` → (exclude, exact, [(name, port or None)])."""
    body = spec.strip()
    exclude = body.startswith("^")
    body = body[1:] if exclude else body
    exact = body.startswith("=")
    body = body[1:] if exact else body
    out: list[tuple[str, int | None]] = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, port = item.partition(":")
        if port and not port.isdigit():
            raise ValueError(f"GPURT_IB_HCA entry {item!r}: the port after ':' must be a number")
        out.append((name, int(port) if port else None))
    return exclude, exact, out


def pick_port(spec: str, ports: list[tuple[str, int, bool]]) -> tuple[str, int]:
    """(device, port) from ``ports`` = [(device, port number, active)] in enumeration order,
    filtered by ``GPURT_IB_HCA`` ``spec``; the first active one wins."""
    exclude, exact, items = parse_hca(spec)

    def listed(dev: str, port: int) -> bool:
        for name, p in items:
            if (dev == name if exact else dev.startswith(name)) and p in (None, port):
                return True
        return False

    cands = [(d, p) for d, p, up in ports if up and (not items or listed(d, p) != exclude)]
    if not cands:
        have = ", ".join(f"{d}:{p} ({'ACTIVE' if up else 'down'})" for d, p, up in ports) or "none"
        why = f" allowed by GPURT_IB_HCA={spec!r}" if spec.strip() else ""
        raise TransportError(f"no active RDMA port{why} (have: {have})")
    return cands[0]


def pick_gid(entries: list[tuple[int, str, str]], want: int = -1) -> int:
    """GID index for RoCE: ``entries`` = [(index, gid text, type text)] of the port's
    non-zero GIDs.  ``want`` ≥ 0 forces one.  Else a RoCE v2 GID holding an IPv4-mapped
    address, else any RoCE v2 GID, else the first."""
    if want >= 0:
        return want
    if not entries:
        raise TransportError("the port has no GID (is an IP address assigned to its netdev?)")
    v2 = [e for e in entries if "v2" in e[2].lower()]
    for e in v2:
        if ipv4_of_gid(e[1]):
            return e[0]
    return (v2 or entries)[0][0]


def ipv4_of_gid(gid: str) -> str:
    """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else ''."""
    h = gid.replace(":", "").lower()
    if len(h) != 32 or h[:20] != "0" * 20 or h[20:24] != "ffff":
        return ""
    return socket.inet_ntoa(bytes.fromhex(h[24:]))


def _sysfs_gid_type(dev: str, port: int, idx: int) -> str:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{idx}") as f:
            return f.read().strip()
    except OSError:
        return ""


def gpudirect() -> tuple[str, str]:
    """(mode, why): how device buffers reach the NIC on this machine: "peermem" (device
    pointers registered directly: GPUDirect RDMA), "forced" (GPURT_IB_GDR=1), "dmabuf"
    (the driver could export dma-bufs, pyverbs cannot register them: staged), "staged"
    (pinned host memory)."""
    want = str(config.get("GPURT_IB_GDR")).strip().lower()
    if want in ("0", "off", "no"):
        return "staged", "GPURT_IB_GDR=0: device buffers are staged through pinned host memory"
    if want in ("1", "on", "yes"):
        return "forced", "GPURT_IB_GDR=1: device pointers are registered directly"
    try:
        with open("/proc/modules") as f:
            mods = {line.split()[0] for line in f}
    except OSError:
        mods = set()
    if "nvidia_peermem" in mods or "nv_peer_mem" in mods:
        return "peermem", "nvidia-peermem is loaded: device pointers are registered directly"
    try:
        import pyverbs.mr as m
        if hasattr(m, "DmaBufMR") and "nvidia" in mods:
            # (ibv_reg_dmabuf_mr on a dma-buf exported by cuMemGetHandleForAddressRange
            # would do; pyverbs' DmaBufMR registers only a dma-buf it allocated itself
            # through DRM, and takes no foreign file descriptor)
            return "dmabuf", ("no nvidia-peermem; the driver could export dma-bufs, but "
                              "pyverbs registers only dma-bufs it allocates itself (its "
                              "DmaBufMR takes no CUDA dma-buf fd): device buffers are staged "
                              "through pinned host memory")
    except ImportError:
        pass
    why = "no nvidia-peermem module" + ("" if "nvidia" in mods else " and no NVIDIA driver")
    return "staged", f"{why}: device buffers would be staged through pinned host memory"


def _settings() -> tuple[int, int, int, int]:
    eager = int(config.get("GPURT_IB_EAGER"))
    slots = int(config.get("GPURT_IB_SLOTS"))
    cache = int(config.get("GPURT_IB_REG_CACHE"))
    gid = int(config.get("GPURT_IB_GID_INDEX"))
    if not 64 <= eager <= (1 << 20) or eager % 64:
        raise ValueError(f"GPURT_IB_EAGER={eager} must be a multiple of 64 between 64 and 1M")
    if not 2 <= slots <= 1024:
        raise ValueError(f"GPURT_IB_SLOTS={slots} must be between 2 and 1024")
    if gid < -1:
        raise ValueError(f"GPURT_IB_GID_INDEX={gid} must be -1 (automatic) or an index")
    for name, hi in (("GPURT_IB_TIMEOUT", 31), ("GPURT_IB_RETRY_CNT", 7)):
        v = int(config.get(name))     # (a QP attribute: out of range, modify_qp failed)
        if not 0 <= v <= hi:
            raise ValueError(f"{name}={v} must be between 0 and {hi}")
    return eager, slots, cache, gid


# -- completions ---------------------------------------------------------------------------
class _Done:
    """A completion: ``test()`` polls the transport; raises the message's own error (a
    mismatch) or the endpoint's failure."""

    __slots__ = ()

    def test(self) -> bool:
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        self.ep.owner.poll()
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        if self.ep.failure is not None:
            self.ep.raise_failure()
        return False


class _Send(_Done):
    __slots__ = ("peer", "ep", "done", "error", "src", "total", "msgid", "lane", "tag", "sig",
                 "reg", "dev", "ready")

    def __init__(self, ep: "VerbsEndpoint", src: np.ndarray | None, lane: int, tag: int,
                 sig: int, total: int = -1):
        self.peer, self.ep, self.src = ep.peer, ep, src
        self.total = src.nbytes if src is not None else total
        self.lane, self.tag, self.sig = lane, tag, sig
        self.done, self.error, self.msgid, self.reg = False, None, 0, None
        #: GPUDirect: (device pointer, lkey of its registration, owned by the caller)
        #: instead of src, and a callable that says when the producer's work on it is
        #: done (the write waits for it)
        self.dev = self.ready = None


class _Recv(_Done):
    __slots__ = ("peer", "ep", "done", "error", "lane", "tag", "sig", "total", "sink", "dst",
                 "scratch", "reg", "into", "upto")

    def __init__(self, ep: "VerbsEndpoint", nbytes: int, sink: Sink | None, lane: int,
                 tag: int, sig: int, into: tuple | None = None, upto: bool = False):
        self.peer, self.ep, self.total, self.sink = ep.peer, ep, nbytes, sink
        self.upto = upto        # a message of at most ``nbytes`` is accepted
        self.lane, self.tag, self.sig = lane, tag & _M64, sig & _M64
        dst = getattr(sink, "dst", None)
        self.dst = dst if (isinstance(dst, np.ndarray) and dst.dtype == np.uint8 and
                           dst.flags.c_contiguous and dst.nbytes == nbytes) else None
        self.done, self.error, self.scratch, self.reg = False, None, None, None
        #: GPUDirect: (address, rkey) of registered device memory the peer writes into
        self.into = into


# -- registration cache ----------------------------------------------------------------------
class _Reg:
    __slots__ = ("mr", "addr", "n", "uses", "fin", "key")

    def __init__(self, mr, addr: int, n: int, key):
        self.mr, self.addr, self.n, self.uses, self.fin, self.key = mr, addr, n, 0, None, key


class RegCache:
    """User memory registered whole (the array owning it), deregistered when that array is
    freed, at ``close``, or when more than ``limit`` bytes are registered (least recently
    used first, never one in use)."""

    def __init__(self, pd, limit: int):
        self.pd, self.limit = pd, limit
        self.pid = os.getpid()
        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    @staticmethod
    def _owner(a: np.ndarray) -> np.ndarray:
        o = a
        while isinstance(o.base, np.ndarray):
            o = o.base
        return o

    def get(self, a: np.ndarray, access: int) -> _Reg | None:
        """The registration covering ``a`` (its use count raised: ``put`` it back), or None
        if the memory cannot be registered (the caller bounces it).  The whole owning array
        is registered unless it is much larger than ``a`` (then the pages of ``a``)."""
        o = self._owner(a)
        if not (o.flags.c_contiguous or o.flags.f_contiguous):
            return None
        base, n = _addr(o), o.nbytes
        lo = _addr(a)
        if n == 0 or not base <= lo <= lo + a.nbytes <= base + n:
            return None
        writable = bool(o.flags.writeable)
        if n > max(_WHOLE_MAX, 8 * a.nbytes):       # a slice of a huge array: its pages
            start = lo - lo % _PAGE
            end = -(-(lo + a.nbytes) // _PAGE) * _PAGE
            base, n = max(start, base), min(end, base + n) - max(start, base)
        key = (id(o), base, n, writable)
        r = self.entries.get(key)
        if r is None and n != o.nbytes:             # a whole-array registration covers it
            r = self.entries.get((id(o), _addr(o), o.nbytes, writable))
        if r is not None:
            return self._hit(r)
        self.misses += 1
        from pyverbs.mr import MR
        try:
            mr = MR(self.pd, n, access if writable else 0, address=base)
        except Exception as e:  # noqa: BLE001 - pyverbs raises its own errors
            log.debug("verbs: cannot register %d bytes at %#x: %s", n, base, e)
            return None
        return self._keep(mr, base, n, key, o)

    def _hit(self, r: _Reg) -> _Reg:
        self.entries.move_to_end(r.key)
        self.hits += 1
        r.uses += 1
        return r

    def _keep(self, mr, base: int, n: int, key, owner) -> _Reg:
        """A new registration, in use once, dropped when ``owner`` is freed (or, if it
        cannot be weakly referenced, when its last use is put back)."""
        r = _Reg(mr, base, n, key)
        try:
            r.fin = weakref.finalize(owner, self._drop, key)
            r.fin.atexit = False    # at exit, close() deregisters, after BYE
        except TypeError:           # not weak-referenceable: used once, dropped after
            r.fin = None
        self.entries[key] = r
        self.bytes += n
        r.uses += 1
        self._trim()
        return r

    def get_dev(self, ptr: int, n: int, owner, access: int) -> _Reg:
        """A registration of ``n`` bytes of device memory at ``ptr`` (GPUDirect RDMA:
        nvidia-peermem lets ibv_reg_mr pin GPU pages), kept while ``owner`` (the array
        that holds the memory) lives; raises ``TransportError`` if the HCA refuses."""
        key = ("dev", id(owner), ptr, n)
        r = self.entries.get(key)
        if r is not None:
            return self._hit(r)
        self.misses += 1
        from pyverbs.mr import MR
        try:
            mr = MR(self.pd, n, access, address=ptr)
        except Exception as e:  # noqa: BLE001 - pyverbs raises its own errors
            raise TransportError(f"verbs: cannot register {n} bytes of device memory at "
                                 f"{ptr:#x} for GPUDirect RDMA: {e} (is nvidia-peermem "
                                 f"loaded? GPURT_IB_GDR=0 stages through host memory)") from None
        return self._keep(mr, ptr, n, key, owner)

    def put(self, r: _Reg | None) -> None:
        if r is None:
            return
        r.uses -= 1
        if r.fin is None and r.uses <= 0:
            self._drop(r.key)
        else:
            self._trim()

    def _trim(self) -> None:
        if self.bytes <= self.limit:
            return
        for key in list(self.entries):
            if self.bytes <= self.limit:
                break
            r = self.entries.get(key)     # a finalizer may have dropped it meanwhile
            if r is not None and r.uses <= 0:
                self._drop(key)

    def _drop(self, key) -> None:
        r = self.entries.pop(key, None)
        if r is None:
            return
        self.bytes -= r.n
        if r.fin is not None:
            r.fin.detach()
        if os.getpid() != self.pid:
            # a forked child freeing an inherited array: the verbs context is the
            # parent's (the same open device file), so deregistering here would pull the
            # memory region from under the parent's transfers; kept, not collected
            # (pyverbs' dealloc would deregister it too)
            _INHERITED.append(r.mr)
            return
        try:
            r.mr.close()
        except Exception:  # noqa: BLE001 - the context may be closed already
            pass

    def close(self) -> None:
        for key in list(self.entries):
            self._drop(key)


class _Pool:
    """Registered scratch buffers (receives that reduce, memory that cannot be registered),
    by power-of-two size class."""

    def __init__(self, pd, access: int):
        self.pd, self.access = pd, access
        self.free: dict[int, list] = {}
        self.all: list = []

    def get(self, n: int):
        size = 1 << max(16, (n - 1).bit_length())
        lst = self.free.get(size)
        if lst:
            return lst.pop()
        from pyverbs.mr import MR
        try:
            mr = MR(self.pd, size, self.access)
        except Exception as e:  # noqa: BLE001
            raise ResourceError(f"verbs: cannot register a {size}-byte scratch buffer: {e} "
                                f"(ulimit -l?)") from None
        item = (size, mr, _view(mr.buf, size))
        self.all.append(item)
        return item

    def put(self, item) -> None:
        if item is not None:
            self.free.setdefault(item[0], []).append(item)

    def close(self) -> None:
        for _, mr, _ in self.all:
            try:
                mr.close()
            except Exception:  # noqa: BLE001
                pass
        self.all, self.free = [], {}


# -- endpoint ----------------------------------------------------------------------------
class VerbsEndpoint:
    """One RC queue pair to a peer, its rings and credits, and the matching state."""

    transport = "verbs"

    def __init__(self, owner: "VerbsTransport", peer: int, idx: int, qp):
        self.owner, self.peer, self.idx, self.qp = owner, peer, idx, qp
        self.host = ""
        self.failure: tuple[type, str] | None = None
        self.blame = peer
        self.told: str | None = None    # the failure the peer published (peer_error)
        # remote: where my slots and credit word live at the peer
        self.r_ring = self.r_ring_key = self.r_ctrl = self.r_ctrl_key = 0
        # flow control
        self.sent = 0               # slots written to the peer
        self.recvd = 0              # slots received from the peer (consumed in order)
        self.returned = 0           # consumed count last written back to the peer
        self.backlog: deque = deque()   # control messages waiting for credits or the SQ
        self.posted: list[deque] = [deque() for _ in range(LANES)]   # receives, unmatched
        self.unexp: list[deque] = [deque() for _ in range(LANES)]    # arrivals, unmatched
        self.rndv_out: dict[int, _Send] = {}    # sends waiting for CTS
        self.rndv_in: dict[int, _Recv] = {}     # receives waiting for FIN
        self.next_id = 1
        self.bye = False
        self.writes: deque = deque()    # rendezvous data to write: (send, addr, rkey, offset)

    # -- the Endpoint protocol --------------------------------------------------------
    def send(self, src: np.ndarray, lane: int, tag: int, sig: int) -> _Send:
        m = _Send(self, src, lane, tag & _M64, sig & _M64)
        if self.failure is not None:
            self.raise_failure()
        own = self.owner
        if m.total <= own.eager:
            self._ctrl(K_EAGER, lane, 0, m.tag, m.sig, m.total, 0, 0, src, m)
        else:
            m.msgid = self.next_id
            self.next_id = (self.next_id + 1) & 0xFFFFFFFF or 1
            self.rndv_out[m.msgid] = m
            self._ctrl(K_RTS, lane, m.msgid, m.tag, m.sig, m.total, 0, 0, None, None)
        own.poll()
        return m

    def send_device(self, ptr: int, nbytes: int, lkey: int, ready, lane: int, tag: int,
                    sig: int) -> _Send:
        """GPUDirect RDMA: send ``nbytes`` of device memory the caller registered
        (``RegCache.get_dev``; ``lkey``), always by rendezvous.  The RTS goes now, in call
        order; the RDMA WRITE waits until ``ready()`` (the producer's work is done)."""
        m = _Send(self, None, lane, tag & _M64, sig & _M64, total=nbytes)
        m.dev, m.ready = (ptr, lkey), ready
        if self.failure is not None:
            self.raise_failure()
        m.msgid = self.next_id
        self.next_id = (self.next_id + 1) & 0xFFFFFFFF or 1
        self.rndv_out[m.msgid] = m
        self._ctrl(K_RTS, lane, m.msgid, m.tag, m.sig, m.total, 0, 0, None, None)
        self.owner.poll()
        return m

    def recv_device(self, nbytes: int, addr: int, rkey: int, lane: int, tag: int,
                    sig: int) -> _Recv:
        """GPUDirect RDMA: receive into registered device memory (``addr``, ``rkey``); the
        completion tests true once the data is there (the caller then consumes it)."""
        return self.recv(nbytes, None, lane, tag, sig, into=(addr, rkey))

    def recv(self, nbytes: int, sink: Sink | None, lane: int, tag: int, sig: int,
             into: tuple | None = None, upto: bool = False) -> _Recv:
        if upto and (nbytes >= UPTO_MAX or into is not None):
            raise ValueError(f"an upto receive is for host messages under {UPTO_MAX} bytes")
        m = _Recv(self, nbytes, sink, lane, tag, sig, into, upto)
        if self.unexp[lane]:
            self._match(m, *self.unexp[lane].popleft())
        else:
            if self.failure is not None:
                self.raise_failure()
            self.posted[lane].append(m)
        self.owner.poll()
        return m

    def check(self) -> None:
        own = self.owner
        own.poll()
        if self.failure is not None:
            self.raise_failure()
        note = own.heartbeat.notice(self.peer) if own.heartbeat is not None else None
        if note:
            self.peer_error(note)
            self.raise_failure()
        why = own.heartbeat.stopped(self.peer, self.host, "killed, stopped (SIGSTOP, a "
                                    "debugger) or hung") if own.heartbeat is not None else None
        if why:
            self.fail(PeerFailure, why)
            self.raise_failure()

    def published(self) -> Exception | None:
        """The failure the peer published (its ERROR message, read by an earlier poll of
        the shared completion queue, or its UDP notice), if any — no verbs call (asked of
        every peer at a collective's deadline: ``Communicator._check_peers``)."""
        text = self.told
        if text is None:
            hb = self.owner.heartbeat
            text = hb.notice(self.peer) if hb is not None else None
        if text is None:
            return None
        return from_peer(text, f"rank {self.peer} ({self.host}) failed: {text}",
                         relayed_rank(text, self.peer))

    # -- failure ------------------------------------------------------------------------
    def fail(self, cls: type, text: str, tell: bool = False) -> None:
        """Record the endpoint's failure (the first reason explains the rest).  ``tell``:
        this rank found it (an error completion, a malformed message): the peer may be
        waiting on nothing that would ever fail, so it gets an authenticated UDP notice
        and the queue pair goes to the error state (its writes then fail too)."""
        if self.failure is not None:
            return
        self.failure = (cls, text)
        log.debug("verbs: %s", text)
        self.abandon()
        if tell:
            own = self.owner
            if own.heartbeat is not None:
                own.heartbeat.notify(f"{cls.__name__}: {text}", only=(self.peer,))
            own.stop_qp(self)

    def abandon(self) -> None:
        """After a failure nothing more moves: waiting receives and sends fail (a late
        FIN or CTS is ignored), queued messages are dropped — never a user buffer read
        or written after the endpoint failed."""
        cls, text = self.failure or (PeerFailure, f"rank {self.peer} is gone")
        err = PeerFailure(text, rank=self.blame) if cls is PeerFailure else cls(text)
        for m in list(self.rndv_in.values()) + list(self.rndv_out.values()):
            if not m.done and m.error is None:
                m.error = err
        self.rndv_in, self.rndv_out = {}, {}
        for q in self.posted:
            for m in q:
                if m.error is None:
                    m.error = err
            q.clear()
        for item in self.backlog:
            m = item[9]
            if m is not None and not m.done and m.error is None:
                m.error = err
        self.backlog.clear()
        for m, *_ in self.writes:
            if not m.done and m.error is None:
                m.error = err
        self.writes.clear()

    def raise_failure(self) -> None:
        cls, text = self.failure or (PeerFailure, f"rank {self.peer} is gone")
        if cls is PeerFailure:
            raise PeerFailure(text, rank=self.blame)
        raise cls(text)

    def peer_error(self, text: str) -> None:
        if self.told is None:
            self.told = text
        self.blame = relayed_rank(text, self.peer)
        self.fail(published_class(text), f"rank {self.peer} ({self.host}) failed: {text}")

    def wc_error(self, status: int, vendor: int, what: str) -> None:
        name = _WC_STATUS.get(status, f"status {status}")
        own = self.owner
        if status == 5 and self.failure is not None:
            return                  # flushed after the error that explains it
        cls = PeerFailure if status in _PEER_GONE else TransportError
        gone = (" — the peer's queue pair does not answer (process killed, host down or "
                "link cut)" if status in _PEER_GONE else "")
        self.fail(cls, f"rank {own.rank}: the verbs queue pair to rank {self.peer} "
                       f"({self.host}) failed on {what}: {name} (status {status}, vendor "
                       f"error {vendor:#x}){gone}", tell=True)

    # -- sending control messages ----------------------------------------------------------
    def _ctrl(self, kind: int, lane: int, msgid: int, tag: int, sig: int, total: int,
              addr: int, rkey: int, payload: np.ndarray | None, done: _Send | None) -> None:
        item = (kind, lane, msgid, tag, sig, total, addr, rkey, payload, done)
        if self.backlog or not self.owner.post_slot(self, item):
            self.backlog.append(item)

    def flush(self) -> None:
        own = self.owner
        while self.backlog and own.post_slot(self, self.backlog[0]):
            self.backlog.popleft()

    # -- arrivals ---------------------------------------------------------------------------
    def arrive(self, kind: int, lane: int, msgid: int, tag: int, sig: int, total: int,
               addr: int, rkey: int, payload: np.ndarray) -> None:
        if self.failure is not None:
            return                  # after ERROR, BYE or a local failure nothing counts
        if kind in (K_EAGER, K_RTS):
            if lane >= LANES:
                self.fail(TransportError, f"rank {self.peer} ({self.host}) sent a verbs "
                                          f"message on unknown lane {lane}", tell=True)
                return
            if self.posted[lane]:
                self._match(self.posted[lane].popleft(), kind, msgid, tag, sig, total,
                            payload)
            else:                   # no receive yet: keep a copy, free the slot
                self.unexp[lane].append((kind, msgid, tag, sig, total,
                                         payload.copy() if kind == K_EAGER else None))
        elif kind == K_CTS:
            m = self.rndv_out.pop(msgid, None)
            if m is None:
                self.fail(TransportError, f"rank {self.peer} ({self.host}) sent a CTS for "
                                          f"unknown message {msgid}", tell=True)
                return
            self.writes.append((m, addr, rkey, 0))
            self.owner.push_writes(self)
        elif kind == K_NAK:
            m = self.rndv_out.pop(msgid, None)
            if m is not None:
                detail = mismatch_detail(m.lane, m.tag, m.sig, m.total, tag, sig, total) or \
                    "the receive posted there differs"
                text = (f"message to rank {self.peer} ({self.host}) on the verbs "
                        f"{LANE_NAMES[m.lane]} lane does not match the receive posted "
                        f"there: it expects {_expect(lane, tag, total)}; this rank sends "
                        f"{_expect(m.lane, m.tag, m.total)} ({detail})")
                m.error = CollectiveMismatchError(text)
        elif kind == K_FIN:
            m = self.rndv_in.pop(msgid, None)
            if m is None:
                self.fail(TransportError, f"rank {self.peer} ({self.host}) sent a FIN for "
                                          f"unknown message {msgid}", tell=True)
                return
            self.owner.finish_rndv(m)
        elif kind == K_ERROR:
            self.peer_error(bytes(payload).decode("utf-8", "replace"))
        elif kind == K_BYE:
            self.bye = True
            self.fail(PeerFailure, f"rank {self.peer} ({self.host}) closed its verbs "
                                   f"connection {CLOSED_OR_EXITED}")

    def _match(self, m: _Recv, kind: int, msgid: int, tag: int, sig: int, total: int,
               payload) -> None:
        detail = mismatch_detail(m.lane, tag, sig, total, m.tag, m.sig, m.total, m.upto)
        if detail is None and total != m.total:      # shorter, and the receive takes it
            m.total = total
        if detail is not None:
            text = (f"message from rank {self.peer} ({self.host}) on the verbs "
                    f"{LANE_NAMES[m.lane]} lane does not match the receive posted here: "
                    f"{detail}")
            m.error = CollectiveMismatchError(text)
            if kind == K_RTS:       # the sender waits for an answer: tell it why not
                self._ctrl(K_NAK, m.lane, msgid, m.tag, m.sig, m.total, 0, 0, None, None)
            return
        if kind == K_EAGER:
            if m.into is not None:     # both sides go by the eager limit: never happens
                m.error = TransportError(f"rank {self.peer} ({self.host}) sent an eager "
                                         f"message where a GPUDirect rendezvous was expected "
                                         f"(GPURT_IB_EAGER differs between ranks?)")
                return
            if m.total:
                m.sink(0, payload[:m.total])
            m.done = True
            return
        self.owner.accept_rndv(self, m, msgid)


def _expect(lane: int, tag: int, total: int) -> str:
    what = "collective call #" if lane == 0 else "tag "
    return f"{what}{tag} of {total} bytes"


# -- transport ---------------------------------------------------------------------------
class VerbsTransport:
    """RC queue pairs over one RDMA port (see the module docstring)."""

    name = "verbs"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            dev, port, info = _open_probe()
        except TransportError as e:
            return False, str(e)
        mode, why = gpudirect()
        return True, f"{dev} port {port}: {info}; GPUDirect RDMA: {mode} ({why})"

    def __init__(self) -> None:
        self.rank = -1
        self.endpoints: dict[int, VerbsEndpoint] = {}
        self.ctx = self.pd = self.cq = None
        self.heartbeat: Heartbeat | None = None
        self.reg: RegCache | None = None
        self.pool: _Pool | None = None
        self._ok: bool | None = None
        self._why = ""
        self.by_qpn: dict[int, VerbsEndpoint] = {}
        self.wr: dict[int, tuple] = {}
        self.wr_next = 0
        self.sq_used: dict[int, int] = {}
        self._recv_wr = None
        self.stopping = False
        self.closed = False

    # -- availability ----------------------------------------------------------------------
    def can_connect(self, topo, me: int, peer: int) -> bool:
        if self._ok is None:
            try:
                self._open()
                self._ok = True
            except (TransportError, ValueError) as e:
                self._ok, self._why = False, str(e)
                log.debug("verbs: unavailable: %s", e)
        return self._ok

    def _open(self) -> None:
        try:
            import pyverbs.enums as e
            from pyverbs.device import Context
        except ImportError as ex:
            raise TransportError(f"pyverbs is not installed ({ex}): install the distribution's "
                                 f"python3-pyverbs or PyPI pyverbs matching rdma-core") from None
        self.eager, self.slots, cache, gid_want = _settings()
        self.slot = HDR + self.eager
        dev, port = pick_port(str(config.get("GPURT_IB_HCA")), _ports())
        from pyverbs.cq import CQ
        from pyverbs.pd import PD
        try:
            self.ctx = Context(name=dev)
            self.pd = PD(self.ctx)
            pa = self.ctx.query_port(port)
            da = self.ctx.query_device()
        except Exception as ex:  # noqa: BLE001
            self._close_ctx()
            raise TransportError(f"verbs: cannot open {dev} port {port}: {ex}") from None
        self.dev, self.port = dev, port
        self.mtu = int(pa.active_mtu)
        self.lid = int(pa.lid)
        self.roce = int(pa.link_layer) == int(e.IBV_LINK_LAYER_ETHERNET)
        self.gid_index, self.gid, self.ip = -1, "", ""
        if self.roce or gid_want >= 0:
            ents = _gids(self.ctx, dev, port, int(pa.gid_tbl_len))
            self.gid_index = pick_gid(ents, gid_want)
            self.gid = str(self.ctx.query_gid(port_num=port, index=self.gid_index))
            self.ip = ipv4_of_gid(self.gid)
        self.max_wr = int(da.max_qp_wr)
        self.max_cqe = int(da.max_cqe)
        self.cache_limit = cache
        self._CQ = CQ

    def _close_ctx(self) -> None:
        if self.ctx is not None:
            try:
                self.ctx.close()
            except Exception:  # noqa: BLE001
                pass
        self.ctx = self.pd = self.cq = None

    # -- set-up ------------------------------------------------------------------------------
    def connect(self, peers: list[int], comm) -> dict[int, VerbsEndpoint]:
        """Collective over ``comm.mpi`` (every rank calls it, with or without peers)."""
        mpi = comm.mpi
        me = mpi.Get_rank()
        self.rank = me
        host = socket.gethostname()
        peers = sorted(peers)
        err, mine = "", None
        secret = secrets.token_bytes(32) if me == 0 else b""
        if peers:
            try:
                if not self._ok:
                    raise TransportError(self._why or "verbs: not opened")
                mine = self._build(peers)
            except Exception as ex:  # noqa: BLE001 - every rank must reach the exchange
                err = f"rank {me} ({host}): verbs set-up failed: {type(ex).__name__}: {ex}"
        info = mpi.allgather((err, host, peers, mine, secret))
        errs = list(dict.fromkeys(i[0] for i in info if i[0]))
        peer_sets = [set(i[2]) for i in info]
        errs += unpaired("verbs", peer_sets, "does it lack the RDMA device, or does "
                                             "GPURT_TRANSPORTS differ between ranks?")
        if not errs and peers:
            try:
                self._wire(peers, info)
            except Exception as ex:  # noqa: BLE001
                err = f"rank {me} ({host}): verbs connect failed: {type(ex).__name__}: {ex}"
        errs2 = [e for e in mpi.allgather(err) if e]
        errs = list(dict.fromkeys(errs + errs2))
        if errs:
            self.close()
            raise TransportError("verbs: " + "; ".join(errs[:3]) +
                                 (f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""))
        if not peers:
            self.close()
            return {}
        self.heartbeat.start(me, info[0][4], {q: (info[q][3]["ip"], info[q][3]["hb"])
                                              for q in peers}, _HB_INTERVAL,
                             _pids(comm, peers))
        return dict(self.endpoints)

    def _build(self, peers: list[int]) -> dict:
        """Queue pairs, rings, control block; what the peers need to reach them."""
        import pyverbs.enums as e
        from pyverbs.mr import MR
        from pyverbs.qp import QP, QPCap, QPInitAttr

        n = len(peers)
        R = self.slots
        self.sq_depth = min(self.max_wr, 4 * R + 16)
        cqe = n * (R + self.sq_depth) + 64
        if cqe > self.max_cqe:
            raise ResourceError(f"verbs: {n} peers need a completion queue of {cqe} entries, "
                                f"the device allows {self.max_cqe} (lower GPURT_IB_SLOTS)")
        self.cq = self._CQ(self.ctx, cqe)
        access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
        self.access = access
        # my receive rings (peer i writes slots [i*R, (i+1)*R)), my staging slots, control
        self.ring_mr = MR(self.pd, n * R * self.slot, access)
        self.stage_mr = MR(self.pd, n * R * self.slot, e.IBV_ACCESS_LOCAL_WRITE)
        self.ctrl_mr = MR(self.pd, n * _CTRL, access)
        self.ring = _view(self.ring_mr.buf, n * R * self.slot)
        self.stage = _view(self.stage_mr.buf, n * R * self.slot)
        self.ctrl = _view(self.ctrl_mr.buf, n * _CTRL).view(np.uint64)   # [in, out] per peer
        self.stage_busy = np.zeros(n * R, bool)
        self.reg = RegCache(self.pd, self.cache_limit)
        self.pool = _Pool(self.pd, access)
        qps = {}
        for i, q in enumerate(peers):
            cap = QPCap(max_send_wr=self.sq_depth, max_recv_wr=R + 1, max_send_sge=1,
                        max_recv_sge=1)
            qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq,
                                        cap=cap))
            ep = VerbsEndpoint(self, q, i, qp)
            self.endpoints[q] = ep
            self.by_qpn[qp.qp_num] = ep
            self.sq_used[q] = 0
            qps[q] = (qp.qp_num, secrets.randbelow(1 << 24))
        ip = self.ip
        if not ip:
            from .tcp import pick_address
            ip, _ = pick_address(str(config.get("GPURT_SOCKET_IFNAME")))
        self.heartbeat = Heartbeat(ip)
        return dict(qps=qps, gid=self.gid, gid_index=self.gid_index, lid=self.lid,
                    mtu=self.mtu, roce=self.roce, ring=self.ring_mr.buf,
                    ring_key=self.ring_mr.rkey, ctrl=self.ctrl_mr.buf,
                    ctrl_key=self.ctrl_mr.rkey, peers=peers, slots=R, slot=self.slot,
                    ip=ip, hb=self.heartbeat.port, dev=self.dev)

    def _wire(self, peers: list[int], info: list) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        me = self.rank
        mine = info[me][3]
        for q in peers:
            ep = self.endpoints[q]
            theirs = info[q][3]
            ep.host = info[q][1]
            if (theirs["slots"], theirs["slot"]) != (self.slots, self.slot):
                raise ValueError(f"rank {q} has GPURT_IB_SLOTS/GPURT_IB_EAGER "
                                 f"{theirs['slots']}/{theirs['slot'] - HDR}, this rank "
                                 f"{self.slots}/{self.eager}: set them the same everywhere")
            if theirs["roce"] != self.roce:
                raise ValueError(f"rank {q}'s port is {'RoCE' if theirs['roce'] else 'IB'}, "
                                 f"this rank's is {'RoCE' if self.roce else 'IB'}")
            j = theirs["peers"].index(me)
            ep.r_ring = theirs["ring"] + j * self.slots * self.slot
            ep.r_ring_key = theirs["ring_key"]
            ep.r_ctrl = theirs["ctrl"] + j * _CTRL
            ep.r_ctrl_key = theirs["ctrl_key"]
            qpn, psn = theirs["qps"][me]
            my_psn = mine["qps"][q][1]
            attr = QPAttr(port_num=self.port)
            attr.qp_access_flags = self.access
            attr.path_mtu = min(self.mtu, int(theirs["mtu"]))
            attr.dest_qp_num = qpn
            attr.rq_psn = psn
            attr.sq_psn = my_psn
            attr.max_rd_atomic = 1
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = 12
            attr.timeout = int(config.get("GPURT_IB_TIMEOUT"))
            attr.retry_cnt = int(config.get("GPURT_IB_RETRY_CNT"))
            attr.rnr_retry = 7
            if self.roce or self.gid_index >= 0:
                gr = GlobalRoute(dgid=GID(theirs["gid"]), sgid_index=self.gid_index,
                                 hop_limit=64)
                attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=self.port)
            else:
                attr.ah_attr = AHAttr(dlid=int(theirs["lid"]), is_global=0,
                                      port_num=self.port)
            ep.qp.to_rts(attr)
            # nobody writes before the allgather that follows: receives posted now are
            # in place before the first write (a QP takes receives from INIT on)
            for _ in range(self.slots):
                self._post_recv(ep)

    # -- posting ------------------------------------------------------------------------------
    def _wrid(self, kind: int, what) -> int:
        self.wr_next += 1
        wid = (self.wr_next << 8) | kind
        self.wr[wid] = what
        return wid

    def _post(self, ep: VerbsEndpoint, wr, what: str) -> bool:
        """Post ``wr`` on ``ep``'s queue pair and count it; a refused post fails the
        endpoint (and tells the peer)."""
        try:
            ep.qp.post_send(wr)
        except Exception as ex:  # noqa: BLE001 - pyverbs raises its own errors
            self.wr.pop(wr.wr_id, None)
            ep.fail(TransportError, f"rank {self.rank}: posting {what} to the verbs queue pair "
                                    f"of rank {ep.peer} ({ep.host}) failed: {ex}", tell=True)
            return False
        self.sq_used[ep.peer] += 1
        return True

    def _post_recv(self, ep: VerbsEndpoint) -> None:
        # RDMA WRITE WITH IMM consumes a receive but writes nowhere through it: one work
        # request object serves every post (pyverbs copies it into the queue)
        wr = self._recv_wr
        if wr is None:
            from pyverbs.wr import SGE, RecvWR
            wr = self._recv_wr = RecvWR(wr_id=_W_RECV, num_sge=1,
                                        sg=[SGE(self.ctrl_mr.buf, 0, self.ctrl_mr.lkey)])
        ep.qp.post_recv(wr)

    def post_slot(self, ep: VerbsEndpoint, item) -> bool:
        """Write one control/eager message into the peer's next ring slot, if a credit, a
        staging slot and the send queue allow; False to try again later."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        if ep.failure is not None:
            return False
        R = self.slots
        credit_back = int(self.ctrl[2 * ep.idx])      # slots the peer consumed
        if ep.sent - credit_back >= R or self.sq_used[ep.peer] >= self.sq_depth:
            return False
        s = ep.idx * R + ep.sent % R
        if self.stage_busy[s]:
            return False
        kind, lane, msgid, tag, sig, total, addr, rkey, payload, done = item
        n = 0 if payload is None else payload.nbytes
        off = s * self.slot
        _HDR.pack_into(self.stage, off, MAGIC, kind, lane, 0, msgid, tag, sig, total, addr,
                       rkey, n)
        if n:
            self.stage[off + HDR:off + HDR + n] = payload
        # an eager send is done once its bytes are in the staging slot; a FIN's message
        # once the FIN completes (the data write before it on the queue pair is then read)
        later = done if kind != K_EAGER else None
        wr = SendWR(wr_id=self._wrid(_W_SLOT, (ep, s, later)), opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
                    num_sge=1, sg=[SGE(self.stage_mr.buf + off, HDR + n, self.stage_mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.imm_data = socket.htonl(ep.sent & 0xFFFFFFFF)
        wr.set_wr_rdma(ep.r_ring_key, ep.r_ring + (ep.sent % R) * self.slot)
        if not self._post(ep, wr, "an eager/control write"):
            return False
        self.stage_busy[s] = True
        ep.sent += 1
        if done is not None and kind == K_EAGER:
            done.done = True
        return True

    def _return_credits(self, ep: VerbsEndpoint) -> None:
        """Write how many of its slots this rank consumed into the peer's control block."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        if ep.returned == ep.recvd or self.sq_used[ep.peer] >= self.sq_depth or \
                ep.failure is not None:
            return
        self.ctrl[2 * ep.idx + 1] = ep.recvd
        wr = SendWR(wr_id=self._wrid(_W_CREDIT, ep), opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                    sg=[SGE(self.ctrl_mr.buf + ep.idx * _CTRL + 8, 8, self.ctrl_mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(ep.r_ctrl_key, ep.r_ctrl)
        if self._post(ep, wr, "a credit return"):
            ep.returned = ep.recvd

    def push_writes(self, ep: VerbsEndpoint) -> None:
        """CTS arrived: RDMA WRITE the messages straight into the receivers' buffers (in
        pieces of at most 1 GiB, as the send queue has room, keeping a few entries for
        control messages and credit returns), then FIN — the write before it on the same
        queue pair is placed first."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        room = self.sq_depth - 4
        while ep.writes and self.sq_used[ep.peer] < room and ep.failure is None:
            m, addr, rkey, off = ep.writes[0]
            if m.dev is not None:
                if m.ready is not None:
                    if not m.ready():
                        return      # the device data is not produced yet: later, in order
                    m.ready = None
                base, lkey = m.dev
            else:
                if m.reg is None:
                    src = m.src
                    r = self.reg.get(src, self.access)
                    if r is None:       # not registrable: bounce through a registered buffer
                        r = self.pool.get(m.total)
                        r[2][:m.total] = src.reshape(-1).view(np.uint8)
                    m.reg = r
                if isinstance(m.reg, tuple):
                    lkey, base = m.reg[1].lkey, m.reg[1].buf
                else:
                    lkey, base = m.reg.mr.lkey, _addr(m.src)
            n = min(_MAX_WRITE, m.total - off)
            wr = SendWR(wr_id=self._wrid(_W_DATA, ep), opcode=e.IBV_WR_RDMA_WRITE,
                        num_sge=1, sg=[SGE(base + off, n, lkey)],
                        send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(rkey, addr + off)
            if not self._post(ep, wr, "an RDMA WRITE of rendezvous data"):
                return
            if off + n < m.total:
                ep.writes[0] = (m, addr, rkey, off + n)
            else:
                ep.writes.popleft()
                ep._ctrl(K_FIN, m.lane, m.msgid, m.tag, m.sig, m.total, 0, 0, None, m)

    def _release(self, reg) -> None:
        if isinstance(reg, tuple):
            self.pool.put(reg)
        else:
            self.reg.put(reg)

    def accept_rndv(self, ep: VerbsEndpoint, m: _Recv, msgid: int) -> None:
        """An RTS matched a posted receive: answer CTS with where to write."""
        if m.total == 0:
            addr, rkey = 0, 0
        elif m.into is not None:        # GPUDirect: registered device memory
            addr, rkey = m.into
        else:
            r = self.reg.get(m.dst, self.access) if m.dst is not None else None
            if r is not None and m.dst.flags.writeable:
                m.reg, addr, rkey = r, _addr(m.dst), r.mr.rkey
            else:
                self.reg.put(r)
                m.scratch = self.pool.get(m.total)
                addr, rkey = m.scratch[1].buf, m.scratch[1].rkey
        ep.rndv_in[msgid] = m
        ep._ctrl(K_CTS, m.lane, msgid, m.tag, m.sig, m.total, addr, rkey, None, None)

    def finish_rndv(self, m: _Recv) -> None:
        if m.scratch is not None:
            m.sink(0, m.scratch[2][:m.total])
            self.pool.put(m.scratch)
            m.scratch = None
        self.reg.put(m.reg)
        m.reg = None
        m.done = True

    # -- progress -------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Drain the completion queue, handle what arrived, push what waits."""
        if self.cq is None:
            return False
        moved = False
        first = None
        while True:
            n, wcs = self.cq.poll(32)
            if not n:
                break
            moved = True
            for wc in wcs:          # every polled completion is accounted for, even if
                try:                # handing one to its receive raised
                    self._complete(wc)
                except Exception as ex:  # noqa: BLE001 - re-raised below
                    first = first or ex
        if first is not None:
            raise first
        # credits go back once half the ring is consumed: a sender stalls only with the
        # whole ring in flight, so this can never leave both sides waiting
        half = self.slots // 2
        for ep in self.endpoints.values():
            if ep.writes:
                self.push_writes(ep)
            if ep.backlog:
                ep.flush()
            if ep.recvd - ep.returned >= half:
                self._return_credits(ep)
        return moved

    progress = poll

    def _complete(self, wc) -> None:
        wid, status = wc.wr_id, wc.status
        kind = wid & 0xFF
        if kind == _W_RECV:
            ep = self.by_qpn.get(wc.qp_num)
            if ep is None:
                return
            if status != 0:
                ep.wc_error(status, wc.vendor_err, "a receive")
                return
            self._arrival(ep, wc)
            return
        what = self.wr.pop(wid, None)
        if kind == _W_SLOT:
            ep, s, later = what
            self.stage_busy[s] = False
            if later is not None and status == 0:
                self._release(later.reg)
                later.reg, later.src, later.done = None, None, True
        elif kind == _W_CREDIT:
            ep = what
        else:
            ep = self.by_qpn.get(wc.qp_num)
        if ep is None:
            return
        self.sq_used[ep.peer] = max(0, self.sq_used[ep.peer] - 1)
        if status != 0:
            op = {_W_SLOT: "an RDMA WRITE WITH IMM (eager/control slot)",
                  _W_CREDIT: "an RDMA WRITE (credit return)",
                  _W_DATA: "an RDMA WRITE (rendezvous data)"}.get(kind, "a send")
            ep.wc_error(status, wc.vendor_err, op)

    def _arrival(self, ep: VerbsEndpoint, wc) -> None:
        R = self.slots
        seq = socket.ntohl(wc.imm_data)
        if seq != ep.recvd & 0xFFFFFFFF:
            ep.fail(TransportError, f"rank {ep.peer} ({ep.host}) wrote verbs slot {seq}, this "
                                    f"rank expects {ep.recvd & 0xFFFFFFFF}", tell=True)
            return
        off = (ep.idx * R + ep.recvd % R) * self.slot
        magic, kind, lane, _, msgid, tag, sig, total, addr, rkey, n = \
            _HDR.unpack_from(self.ring, off)
        if magic != MAGIC or kind not in _KIND or n > self.eager:
            ep.fail(TransportError, f"rank {ep.peer} ({ep.host}) wrote a malformed verbs slot "
                                    f"(magic {magic:#x}, kind {kind}, {n} bytes)", tell=True)
            return
        try:
            ep.arrive(kind, lane, msgid, tag, sig, total, addr, rkey,
                      self.ring[off + HDR:off + HDR + n])
        finally:
            ep.recvd += 1
            if ep.failure is None:
                try:
                    self._post_recv(ep)
                except Exception as ex:  # noqa: BLE001
                    ep.fail(TransportError, f"rank {self.rank}: cannot post a receive for "
                                            f"rank {ep.peer}: {ex}")

    # -- failure and shutdown ---------------------------------------------------------------
    def publish_error(self, text: str) -> None:
        """Tell every peer why this rank is going down: an ERROR message over each healthy
        queue pair and an authenticated UDP notice (which also reaches a peer whose queue
        pair is in error).  Best effort, at most half a second."""
        data = np.frombuffer(fit_text(text, self.eager), np.uint8)
        if self.heartbeat is not None:
            self.heartbeat.notify(text)
        self.stopping = True
        for ep in self.endpoints.values():
            if ep.failure is None:
                self._stop_data(ep)
                ep._ctrl(K_ERROR, 0, 0, 0, 0, data.nbytes, 0, 0, data, None)
        self._drain(_PUBLISH_S)
        # late writes from peers that have not heard yet land nowhere: this rank's
        # receive buffers are the user's, and its communicator is finished
        for ep in self.endpoints.values():
            self.stop_qp(ep)
            if ep.failure is None:
                ep.failure = (PeerFailure, f"rank {self.rank} published its own failure")
        self._reap_data(_REAP_S)

    def data_in_flight(self) -> dict[int, int]:
        """Per peer, the RDMA WRITEs of message data (rendezvous, read straight from the
        sender's buffer) posted and not yet completed."""
        n: dict[int, int] = {}
        for wid, ep in self.wr.items():
            if wid & 0xFF == _W_DATA:
                n[ep.peer] = n.get(ep.peer, 0) + 1
        return n

    def _reap_data(self, seconds: float) -> None:
        """The queue pairs are in the error state: wait (bounded) until every RDMA WRITE
        that reads a user buffer has its completion, flushed or not.  Until then the NIC
        may still read the source — a buffer the program gets back when this rank's call
        fails and may overwrite, so a peer would receive changed bytes — which the error
        state alone does not rule out: the work requests already taken end only with
        their flush completions."""
        if self._poll_until(lambda: not self.data_in_flight(), seconds, quiet=True):
            return
        left = self.data_in_flight()
        log.warning("rank %d: %s RDMA WRITE(s) of message data still in flight %g s after "
                    "the queue pairs went to the error state (to rank(s) %s); the NIC may "
                    "read their buffers until they complete", self.rank, sum(left.values()),
                    seconds, ", ".join(map(str, sorted(left))))

    def _drain(self, seconds: float) -> None:
        self._poll_until(lambda: not any(ep.backlog or self.sq_used.get(ep.peer) for ep in
                                         self.endpoints.values() if ep.failure is None),
                         seconds)

    def _poll_until(self, done: Callable[[], bool], seconds: float,
                    quiet: bool = False) -> bool:
        """Poll the completion queue until ``done()`` (True) or ``seconds`` are gone
        (False); ``quiet``: a poll's error is ignored (the flushed completions after this
        rank's own failure)."""
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() >= deadline:
                return False
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - raised unless quiet
                if not quiet:
                    raise
            time.sleep(1e-4)
        return True

    def stop_qp(self, ep: VerbsEndpoint) -> None:
        """Move ``ep``'s queue pair to the error state (best effort): nothing more is
        written into this rank's memory through it, nor sent."""
        import pyverbs.enums as e
        from pyverbs.qp import QPAttr

        try:
            attr = QPAttr()
            attr.qp_state = e.IBV_QPS_ERR
            ep.qp.modify(attr, e.IBV_QP_STATE)
        except Exception:  # noqa: BLE001 - closing anyway
            pass

    def _stop_data(self, ep: VerbsEndpoint) -> None:
        """This rank is going down: no user buffer is read for a peer any more (queued
        eager sends and rendezvous writes dropped, their sends failed), only ERROR/BYE go."""
        err = TransportError(f"rank {self.rank}: the communicator failed or closed before "
                             f"this message to rank {ep.peer} left")
        keep = deque()
        for item in ep.backlog:
            if item[0] in (K_ERROR, K_BYE):
                keep.append(item)
            elif item[9] is not None and not item[9].done:
                item[9].error = err
        ep.backlog = keep
        for m, *_ in ep.writes:
            if not m.done:
                m.error = err
        ep.writes.clear()
        for m in ep.rndv_out.values():
            m.error = err
        ep.rndv_out = {}

    def inject_qp_error(self, peer: int) -> None:
        """Move the queue pair to ``peer`` into the error state (for tests: what a NIC does
        on a fatal transport error)."""
        import pyverbs.enums as e
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.qp_state = e.IBV_QPS_ERR
        self.endpoints[peer].qp.modify(attr, e.IBV_QP_STATE)

    def forget_in_child(self) -> None:
        """In a forked child: drop its copy of the heartbeat socket, without a word (the
        parent's goes on; the queue pairs stay: one verbs context, the parent's)."""
        from .tcp import forget_sockets
        if self.heartbeat is not None:
            forget_sockets([getattr(self.heartbeat, "sock", None)])

    def close(self) -> None:
        """BYE to every peer (best effort, briefly), then release queue pairs,
        registrations, the device; safe twice and on an exception path."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.cq is not None:
                self.stopping = True
                for ep in self.endpoints.values():
                    if ep.failure is None:
                        self._stop_data(ep)
                        ep._ctrl(K_BYE, 0, 0, 0, 0, 0, 0, 0, None, None)
                self._drain(_BYE_S)
        except Exception:  # noqa: BLE001 - closing must not fail
            pass
        for ep in self.endpoints.values():
            if ep.failure is None:
                ep.failure = (TransportError, f"rank {self.rank}: the verbs transport is "
                                              f"closed")
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        if self.reg is not None:
            self.reg.close()
        if self.pool is not None:
            self.pool.close()
        self.endpoints, self.by_qpn, self.wr = {}, {}, {}
        self.ring = self.stage = self.ctrl = None       # views of memory freed below
        self._close_ctx()


def _ports() -> list[tuple[str, int, bool]]:
    import pyverbs.enums as e
    import pyverbs.device as d
    out = []
    try:
        devs = d.get_device_list()
    except Exception as ex:  # noqa: BLE001
        raise TransportError(f"verbs: cannot list RDMA devices: {ex}") from None
    if not devs:
        raise TransportError("no RDMA device (ibv_get_device_list is empty: no HCA, or the "
                             "rdma kernel modules are not loaded)")
    for dv in devs:
        name = dv.name.decode() if isinstance(dv.name, bytes) else str(dv.name)
        try:
            with d.Context(name=name) as ctx:
                nports = int(ctx.query_device().phys_port_cnt)
                for p in range(1, nports + 1):
                    up = int(ctx.query_port(p).state) == int(e.IBV_PORT_ACTIVE)
                    out.append((name, p, up))
        except Exception as ex:  # noqa: BLE001
            log.debug("verbs: cannot query %s: %s", name, ex)
    return out


def _gids(ctx, dev: str, port: int, n: int) -> list[tuple[int, str, str]]:
    out = []
    for i in range(n):
        try:
            g = str(ctx.query_gid(port_num=port, index=i))
        except Exception:  # noqa: BLE001 - empty entries raise on some providers
            continue
        if g.replace(":", "").strip("0"):
            out.append((i, g, _sysfs_gid_type(dev, port, i)))
    return out


def _open_probe() -> tuple[str, int, str]:
    t = VerbsTransport()
    try:
        t._open()
        where = (f"RoCE, GID index {t.gid_index} ({t.gid}{', ' + t.ip if t.ip else ''})"
                 if t.roce else f"InfiniBand, LID {t.lid}")
        return t.dev, t.port, (f"{where}, MTU {_MTU_BYTES.get(t.mtu, t.mtu)}; eager <= "
                               f"{t.eager} B in {t.slots} credits, zero-copy rendezvous above")
    finally:
        t._close_ctx()
