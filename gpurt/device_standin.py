"""A host-memory stand-in for a GPU: **not a GPU**, a model of the CUDA semantics gpurt
relies on, so that the device path's protocol logic is exercised on machines without one.

What it models (``GPURT_DEVICE_BACKEND=standin``):

* **Allocations** are anonymous memfd mappings.  ``ipc_handle`` names one (pid, fd, size,
  serial); another process opens it through ``/proc/<pid>/fd`` and gets *its own* address
  for the same bytes, as ``cudaIpcOpenMemHandle`` does.  Like CUDA, opening a handle in the
  process that made it is an error, and a handle covers the whole allocation: a buffer
  inside it travels as base handle + offset.
* **Streams** are queues run by one worker thread per process, in order, asynchronously:
  ``copy``/``reduce`` return at once and the bytes move later (``GPURT_STANDIN_DELAY_US``
  holds every operation back to widen race windows).  Host code that reads device memory
  before an event says the work is done reads stale bytes — which the tests would see.
* **Events** live in a shared-memory table per process (interprocess, like
  ``cudaEventInterprocess``): ``record`` bumps the event's *issued* count at once and its
  *completed* count when the stream reaches it; ``query`` is true once the most recent
  record has completed; ``wait_event`` makes a stream wait for the record current at the
  time of the call — CUDA's rules, including the trap that a wait issued before the
  record waits for nothing.
* **Devices**: ``GPURT_STANDIN_DEVICES`` devices (default 1, so all local ranks share one,
  as several ranks per GPU do); ``GPURT_STANDIN_P2P=0`` declares that distinct devices
  cannot reach each other (then gpurt must stage through the host).
* **bfloat16** reductions are done as the CUDA kernel does them: 16-bit storage widened
  to float32, the op, round-to-nearest-even back.

User-facing arrays: ``asarray(numpy_array)``, ``empty``, ``zeros`` give an ``Array`` with
``__cuda_array_interface__`` (v3, with ``stream``); ``Array.get()`` synchronizes its stream
and returns a NumPy copy.  ``Stream()`` makes a stream; ``with stream:`` makes it current.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import struct
import threading
import time
import weakref
from bisect import bisect_right
from collections import deque

import numpy as np

from . import config
from .errors import ResourceError, TransportError
from .ops import Op, is_bfloat16

_U8 = np.dtype(np.uint8)
_serials = itertools.count(1)
_HANDLE = struct.Struct("<8sqqqqq")      # magic, pid, fd, size, serial, device
_MAGIC = b"gpurtSI1"
_EV_SLOTS = 4096
_EV_HANDLE = struct.Struct("<8sqqqq")    # magic, pid, fd, slot, serial
_EV_MAGIC = b"gpurtSE1"

LEGACY, PER_THREAD = 1, 2


def _ndev() -> int:
    return max(1, int(config.get("GPURT_STANDIN_DEVICES")))


# -- memory ----------------------------------------------------------------------------
class _Mapping:
    """A memfd mapping: ours (``fd`` open, handle exportable) or a peer's (opened)."""

    def __init__(self, size: int, device: int, fd: int | None = None, serial: int = 0,
                 remote: bool = False):
        self.size, self.device, self.remote = size, device, remote
        if fd is None:
            fd = os.memfd_create("gpurt-standin", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, max(size, 1))
            except OSError as e:
                os.close(fd)
                raise ResourceError(f"stand-in device: cannot allocate {size} bytes: {e}") from e
            serial = next(_serials)
        self.fd, self.serial = fd, serial
        self.mm = mmap.mmap(fd, max(size, 1))
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        if remote:
            os.close(fd)
            self.fd = -1

    def close(self) -> None:
        _forget(self)
        try:
            self.mm.close()
        except BufferError:  # a view still exported: let the GC take the mapping
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_LOCK = threading.Lock()
_BASES: list[int] = []
_MAPS: list[_Mapping] = []


def _remember(m: _Mapping) -> None:
    with _LOCK:
        i = bisect_right(_BASES, m.base)
        _BASES.insert(i, m.base)
        _MAPS.insert(i, m)


def _forget(m: _Mapping) -> None:
    with _LOCK:
        for i, x in enumerate(_MAPS):
            if x is m:
                del _BASES[i], _MAPS[i]
                return


def _lookup(ptr: int) -> _Mapping:
    with _LOCK:
        i = bisect_right(_BASES, ptr) - 1
        if i >= 0:
            m = _MAPS[i]
            if m.base <= ptr < m.base + max(m.size, 1):
                return m
    raise TypeError(f"address {ptr:#x} is not stand-in device memory")


class _Alloc:
    """Owns one allocation; freed (unmapped, fd closed) when the last view goes."""

    def __init__(self, nbytes: int, device: int):
        self.map = _Mapping(nbytes, device)
        _remember(self.map)
        # (not at exit: the worker thread may still run a queued copy into it — a failed
        # call's, abandoned — and the exit's finalizers unmapped the memory under it,
        # a segfault in ~2 % of runs of device_cases.py sticky on 3 ranks; the process's
        # end unmaps it anyway)
        weakref.finalize(self, self.map.close).atexit = False


class View:
    """A flat typed view of stand-in device memory (what CuPy arrays are for the CUDA
    backend).  Host code must not read it: only queued operations do (``_np``)."""

    __slots__ = ("ptr", "size", "dtype", "owner", "__weakref__")

    def __init__(self, ptr: int, size: int, dtype: np.dtype, owner):
        self.ptr, self.size, self.dtype, self.owner = ptr, size, np.dtype(dtype), owner

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __getitem__(self, s: slice) -> "View":
        a, b, step = s.indices(self.size)
        if step != 1:
            raise ValueError("stand-in views are contiguous")
        b = max(a, b)
        return View(self.ptr + a * self.dtype.itemsize, b - a, self.dtype, self.owner)

    def view(self, dtype) -> "View":
        dtype = np.dtype(dtype)
        if self.nbytes % dtype.itemsize:
            raise ValueError(f"{self.nbytes} bytes are not a whole number of {dtype}")
        return View(self.ptr, self.nbytes // dtype.itemsize, dtype, self.owner)

    def _np(self) -> np.ndarray:
        if not self.size:
            return np.empty(0, self.dtype)
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, np.uint8).view(self.dtype)

    def __repr__(self) -> str:
        return f"<stand-in View {self.dtype}[{self.size}] @ {self.ptr:#x}>"


# -- events ------------------------------------------------------------------------------
class _EventTable:
    """This process's interprocess events: (issued, completed) per slot, in a memfd."""

    def __init__(self, pid: int | None = None, fd: int | None = None):
        size = _EV_SLOTS * 16
        if pid is None:
            self.map = _Mapping(size, -1)
            self.free = list(range(_EV_SLOTS - 1, -1, -1))
        else:
            rfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            self.map = _Mapping(size, -1, rfd, remote=True)
            self.free = []
        self.words = np.frombuffer(self.map.mm, np.uint64)


class Event:
    __slots__ = ("table", "slot", "handle", "owned", "queue", "stream", "__weakref__")

    def __init__(self, table: _EventTable, slot: int, handle: bytes | None, owned: bool):
        self.table, self.slot, self.handle, self.owned = table, slot, handle, owned
        self.queue = self.stream = None     # where it was last recorded (in this process)

    @property
    def issued(self) -> int:
        return int(self.table.words[2 * self.slot])

    @property
    def completed(self) -> int:
        return int(self.table.words[2 * self.slot + 1])


# -- streams -------------------------------------------------------------------------------
class _Queue:
    __slots__ = ("ops", "error")

    def __init__(self):
        self.ops: deque = deque()
        self.error: str | None = None


class _Worker:
    """The stand-in's 'GPU': one thread running every stream's queue in order."""

    def __init__(self):
        self.queues: dict[int, _Queue] = {}
        self.cv = threading.Condition()
        self.delay = float(config.get("GPURT_STANDIN_DELAY_US")) * 1e-6
        self.thread = threading.Thread(target=self._run, name="gpurt-standin-device",
                                       daemon=True)
        self.thread.start()

    def queue(self, stream: int) -> _Queue:
        q = self.queues.get(stream)
        if q is None:
            q = self.queues.setdefault(stream, _Queue())
        return q

    def put(self, stream: int, op) -> None:
        q = self.queue(stream)
        if q.error is not None:
            raise TransportError(f"stand-in device: stream {stream} failed earlier: {q.error}")
        q.ops.append(op)
        with self.cv:
            self.cv.notify()

    def _run(self) -> None:
        idle = 0.0
        while True:
            moved = blocked = False
            # one operation per stream per pass: streams run side by side, as on a GPU
            for q in list(self.queues.values()):
                if not q.ops:
                    continue
                kind, fn = q.ops[0]
                if kind == "wait":
                    if not fn():
                        blocked = True
                        continue
                else:
                    if kind == "work" and self.delay:
                        time.sleep(self.delay)
                    try:
                        fn()
                    except Exception as e:  # noqa: BLE001 - a sticky stream error
                        q.error = f"{type(e).__name__}: {e}"
                        q.ops.clear()
                        continue
                q.ops.popleft()
                moved = True
            if moved:
                idle = 0.0
                continue
            if blocked:
                idle = min(1e-3, idle * 2 or 2e-5)
                time.sleep(idle)
                continue
            with self.cv:
                if not any(q.ops for q in self.queues.values()):
                    self.cv.wait(0.05)


_WORKER: _Worker | None = None
_TLS = threading.local()
_stream_ids = itertools.count(3)


def _worker() -> _Worker:
    global _WORKER
    if _WORKER is None:
        with _LOCK:
            if _WORKER is None:
                _WORKER = _Worker()
    return _WORKER


class Stream:
    """A stand-in stream; ``with s:`` makes it current on this thread."""

    def __init__(self):
        self.ptr = next(_stream_ids)

    def __enter__(self) -> "Stream":
        stack = getattr(_TLS, "streams", None)
        if stack is None:
            stack = _TLS.streams = []
        stack.append(self.ptr)
        return self

    def __exit__(self, *exc) -> None:
        _TLS.streams.pop()

    def synchronize(self) -> None:
        StandinBackend.synchronize_stream(self.ptr)


def _current_stream() -> int:
    stack = getattr(_TLS, "streams", None)
    return stack[-1] if stack else LEGACY


def _norm(stream) -> int:
    s = LEGACY if stream in (None, 0) else int(stream)
    return s


# -- user-facing arrays ----------------------------------------------------------------------
class Array:
    """A stand-in device array (contiguous), with ``__cuda_array_interface__`` v3."""

    def __init__(self, shape, dtype, device: int | None = None, stream: int | None = None,
                 _base: "Array | None" = None, _off: int = 0):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list))
                                             else (shape,)))
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        self.nbytes = self.size * self.dtype.itemsize
        if _base is not None:        # a view of another array's memory
            self._alloc, self._off, dev = _base._alloc, _off, _base.device
        else:
            dev = StandinBackend.current_device() if device is None else device
            self._alloc, self._off = _Alloc(self.nbytes, dev), 0
        self.device = dev
        self.stream = stream
        self.readonly = False

    @property
    def ptr(self) -> int:
        return self._alloc.map.base + self._off

    def __getitem__(self, s) -> "Array":
        """Contiguous slices of a 1-D array: a view (as CuPy's)."""
        if len(self.shape) != 1 or not isinstance(s, slice):
            raise TypeError("stand-in arrays support 1-D slices only")
        a, b, step = s.indices(self.shape[0])
        if step != 1:
            raise ValueError("stand-in arrays support contiguous slices only")
        b = max(a, b)
        return Array((b - a,), self.dtype, stream=self.stream, _base=self,
                     _off=self._off + a * self.dtype.itemsize)

    @property
    def __cuda_array_interface__(self) -> dict:
        bf16 = is_bfloat16(self.dtype)
        return {"shape": self.shape, "typestr": "<V2" if bf16 else self.dtype.str,
                "data": (self.ptr, self.readonly), "version": 3, "strides": None,
                "stream": self.stream}

    def _view(self) -> View:
        return View(self.ptr, self.size, self.dtype, self)

    def get(self) -> np.ndarray:
        """Synchronize the array's stream and the current one, and copy to the host."""
        StandinBackend.synchronize_stream(_norm(self.stream))
        StandinBackend.synchronize_stream(_current_stream())
        return self._view()._np().copy().reshape(self.shape)

    def set(self, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host, self.dtype).reshape(-1)
        if host.size != self.size:
            raise ValueError(f"{host.size} elements for an array of {self.size}")
        StandinBackend.synchronize_stream(_norm(self.stream))
        self._view()._np()[...] = host

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def __repr__(self) -> str:
        return f"<stand-in device Array {self.dtype}{list(self.shape)} on device {self.device}>"


def fill(a: Array, value, stream=None) -> None:
    """A 'kernel': set every element of ``a`` to ``value``, queued on ``stream`` (default:
    the array's, else the current one) — device work that runs later, like CuPy's fill."""
    v = a._view()
    s = _norm(stream if stream is not None else
              (a.stream if a.stream is not None else _current_stream()))
    _worker().put(s, ("work", lambda: v._np().__setitem__(Ellipsis, value)))


def asarray(host, dtype=None, stream: int | None = None) -> Array:
    host = np.asarray(host, dtype=dtype)
    a = Array(host.shape, host.dtype, stream=stream)
    a.set(host)
    return a


def empty(shape, dtype, stream: int | None = None) -> Array:
    return Array(shape, dtype, stream=stream)


def zeros(shape, dtype, stream: int | None = None) -> Array:
    a = Array(shape, dtype, stream=stream)
    a._view()._np()[...] = 0
    return a


# -- the backend -------------------------------------------------------------------------------
def _bf16_apply(op: Op, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """The device kernel for bfloat16: widen 16-bit storage to float32, apply, round to
    nearest even (NaN kept a NaN)."""
    fa = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    fb = (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    with np.errstate(all="ignore"):   # a kernel overflows to inf silently
        r = _F32[op](fa, fb)
    out.view(np.uint16)[...] = _to_bf16(r)


def _to_bf16(r: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even; a NaN stays a (quiet) NaN."""
    bits = r.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)
    nan = np.isnan(r)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16) | np.uint32(0x0040)
    return rounded.astype(np.uint16)


_F32 = {Op.SUM: np.add, Op.AVG: np.add, Op.PROD: np.multiply, Op.MIN: np.minimum,
        Op.MAX: np.maximum}
_UF = {Op.SUM: np.add, Op.AVG: np.add, Op.PROD: np.multiply, Op.MIN: np.minimum,
       Op.MAX: np.maximum, Op.BAND: np.bitwise_and, Op.BOR: np.bitwise_or,
       Op.BXOR: np.bitwise_xor}


class StandinBackend:
    """The device interface (``gpurt.device``) over host memory.  Not a GPU."""

    name = "standin"
    _device = 0
    _tables: dict[int, _EventTable] = {}
    _mine: _EventTable | None = None

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
            return False, "the stand-in needs memfd_create and /proc (Linux)"
        return True, (f"stand-in device backend (host memory, not a GPU): {_ndev()} "
                      f"device(s), P2P {'on' if config.get('GPURT_STANDIN_P2P') else 'off'}")

    def __init__(self):
        _worker()

    # devices
    def count(self) -> int:
        return _ndev()

    def bind(self, device: int) -> None:
        if not 0 <= device < _ndev():
            raise ValueError(f"stand-in device {device} does not exist ({_ndev()} devices)")
        StandinBackend._device = device

    @staticmethod
    def current_device() -> int:
        return StandinBackend._device

    def current(self) -> int:
        return StandinBackend._device

    def uuid(self, device: int) -> str:
        return f"standin-{os.uname().nodename}-{device}"

    def can_access_peer(self, a: int, b: int) -> bool:
        return a == b or bool(config.get("GPURT_STANDIN_P2P"))

    def device_of(self, ptr: int) -> int:
        return _lookup(ptr).device

    def address_range(self, ptr: int) -> tuple[int, int]:
        m = _lookup(ptr)
        return m.base, m.size

    # IPC memory
    def ipc_handle(self, base: int) -> bytes:
        m = _lookup(base)
        if m.remote or m.base != base:
            raise TransportError(f"stand-in ipc_handle: {base:#x} is not the base of an "
                                 f"allocation of this process")
        return _HANDLE.pack(_MAGIC, os.getpid(), m.fd, m.size, m.serial, m.device)

    def ipc_open(self, handle: bytes) -> int:
        magic, pid, fd, size, serial, device = _HANDLE.unpack(handle[:_HANDLE.size])
        if magic != _MAGIC:
            raise TransportError("stand-in ipc_open: not a stand-in memory handle")
        if pid == os.getpid():
            raise TransportError("stand-in ipc_open: a memory handle cannot be opened in the "
                                 "process that made it (as with cudaIpcOpenMemHandle)")
        try:
            rfd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        except OSError as e:
            raise TransportError(f"stand-in ipc_open: cannot open the allocation of pid "
                                 f"{pid}: {e}") from e
        m = _Mapping(size, device, rfd, serial, remote=True)
        _remember(m)
        return m.base

    def ipc_close(self, base: int) -> None:
        m = _lookup(base)
        if m.remote:
            m.close()

    # memory
    def view(self, ptr: int, nbytes: int, owner) -> View:
        return View(ptr, nbytes, _U8, owner)

    def ptr(self, v: View) -> int:
        return v.ptr

    def typed(self, v: View, dtype) -> View:
        return v.view(dtype)

    def alloc(self, nbytes: int, stream=None) -> View:
        a = _Alloc(nbytes, StandinBackend._device)
        return View(a.map.base, nbytes, _U8, a)

    def empty(self, shape, dtype, like, stream: int | None = None) -> Array:
        """On ``like``'s device, tagged with the stream of the call that writes it
        (``stream``, else ``like``'s): what later work on the result is ordered after,
        as CuPy's and PyTorch's pools take a block for the stream that will use it."""
        return Array(shape, dtype, device=getattr(like, "device", None),
                     stream=stream if stream is not None else getattr(like, "stream", None))

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    # streams and events
    def current_stream(self) -> int:
        return _current_stream()

    def event(self, ipc: bool = True) -> Event:
        cls = StandinBackend
        if cls._mine is None:
            cls._mine = _EventTable()
        t = cls._mine
        if not t.free:
            raise ResourceError("stand-in device: out of events")
        slot = t.free.pop()
        t.words[2 * slot] = t.words[2 * slot + 1] = 0
        handle = _EV_HANDLE.pack(_EV_MAGIC, os.getpid(), t.map.fd, slot, 0) if ipc else None
        ev = Event(t, slot, handle, True)
        weakref.finalize(ev, t.free.append, slot)
        return ev

    def event_open(self, handle: bytes) -> Event:
        magic, pid, fd, slot, _ = _EV_HANDLE.unpack(handle[:_EV_HANDLE.size])
        if magic != _EV_MAGIC:
            raise TransportError("stand-in event_open: not a stand-in event handle")
        if pid == os.getpid():
            return Event(StandinBackend._mine, slot, handle, True)
        t = self._tables.get(pid)
        if t is None:
            try:
                t = self._tables[pid] = _EventTable(pid, fd)
            except OSError as e:
                raise TransportError(f"stand-in event_open: pid {pid}'s events: {e}") from e
        return Event(t, slot, handle, False)

    def record(self, ev: Event, stream) -> None:
        w = ev.table.words
        i = 2 * ev.slot
        gen = int(w[i]) + 1
        w[i] = gen

        # (the mark holds the event: its slot goes back only after the mark ran, as CUDA
        # releases a destroyed event only once its pending record completed — a slot
        # handed out again while the mark was queued came out complete too early)
        def done(w=w, i=i + 1, gen=gen, ev=ev):
            if w[i] < gen:
                w[i] = gen

        st = _norm(stream)
        ev.queue, ev.stream = _worker().queue(st), st
        _worker().put(st, ("mark", done))

    def query(self, ev: Event) -> bool:
        """As cudaEventQuery: True once fired; a stream that failed before the event's
        mark ran (its queue cleared: the mark never runs) raises, like CUDA's sticky
        error, instead of leaving the event pending until every rank's deadline."""
        if ev.completed >= ev.issued:
            return True
        q = ev.queue
        if q is not None and q.error is not None and ev.completed < ev.issued:
            raise TransportError(f"stand-in device: stream {ev.stream} failed: {q.error}")
        return False

    def wait_event(self, stream, ev: Event) -> None:
        target = ev.issued
        _worker().put(_norm(stream), ("wait", lambda: ev.completed >= target))

    # work
    def copy(self, dst: View, src: View, stream) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"stand-in copy: {dst.nbytes} bytes <- {src.nbytes}")
        if dst.nbytes:   # the closure holds the views, so their memory outlives the op
            _worker().put(_norm(stream), ("work", lambda: ctypes.memmove(dst.ptr, src.ptr,
                                                                         dst.nbytes)))

    def to_host(self, dst: np.ndarray, src: View, stream) -> None:
        d = dst.reshape(-1).view(np.uint8)
        if d.nbytes != src.nbytes:
            raise ValueError(f"stand-in to_host: {d.nbytes} bytes <- {src.nbytes}")
        _worker().put(_norm(stream), ("work", lambda: d.__setitem__(Ellipsis,
                                                                   src.view(_U8)._np())))

    def from_host(self, dst: View, src: np.ndarray, stream) -> None:
        s = src.reshape(-1).view(np.uint8)
        if s.nbytes != dst.nbytes:
            raise ValueError(f"stand-in from_host: {dst.nbytes} bytes <- {s.nbytes}")
        _worker().put(_norm(stream), ("work", lambda: dst.view(_U8)._np().__setitem__(
            Ellipsis, s)))

    def reduce(self, op: Op, acc: View, src: View, out: View, stream, dtype=None) -> None:
        dtype = np.dtype(dtype) if dtype is not None else out.dtype
        if is_bfloat16(dtype):
            if op not in _F32:
                raise TypeError(f"op {op.name} is not defined for bfloat16")

            def fn():
                _bf16_apply(op, acc._np(), src._np(), out._np())
        else:
            uf = _UF[op]
            if dtype == np.bool_ and op in (Op.MIN, Op.MAX):
                uf = np.logical_and if op is Op.MIN else np.logical_or

            def fn():
                a, b, o = acc.view(dtype)._np(), src.view(dtype)._np(), out.view(dtype)._np()
                with np.errstate(all="ignore"):
                    uf(a, b, out=o)

        _worker().put(_norm(stream), ("work", fn))

    def scale(self, v: View, divisor: int, stream, dtype=None) -> None:
        dtype = np.dtype(dtype) if dtype is not None else v.dtype

        def fn():
            a = v.view(dtype)._np()
            if is_bfloat16(dtype):
                f = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32) / divisor
                a.view(np.uint16)[...] = _to_bf16(f)
            else:
                if a.dtype.kind == "c":     # (as the host: each part ÷ the real count)
                    a = a.view(a.real.dtype)
                np.divide(a, a.dtype.type(divisor), out=a)

        _worker().put(_norm(stream), ("work", fn))

    def rdma_flush(self) -> None:
        """GPUDirect RDMA writes land in host memory here: nothing to flush."""

    def gdr_prepare(self, v: View) -> None:
        """Nothing to set on host memory."""

    def alloc_id(self, ptr: int) -> int:
        return _lookup(ptr).serial

    @staticmethod
    def synchronize_stream(stream) -> None:
        q = _worker().queue(_norm(stream))
        t = 1e-5
        while q.ops:
            time.sleep(t)
            t = min(t * 2, 1e-3)
        if q.error is not None:
            raise TransportError(f"stand-in device: stream {stream} failed: {q.error}")

    def synchronize(self, stream) -> None:
        self.synchronize_stream(stream)

    def info(self) -> dict:
        return {"backend": "standin (host memory, not a GPU)", "devices": _ndev(),
                "p2p": bool(config.get("GPURT_STANDIN_P2P"))}
