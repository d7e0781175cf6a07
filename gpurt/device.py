"""The device interface: every CUDA call gpurt makes goes through one small object.

Two implementations:

* ``gpurt.device_cuda.CudaBackend`` — the real one, on CuPy's runtime bindings (and the
  driver library for address ranges); used for ``__cuda_array_interface__`` / CUDA DLPack
  buffers whenever CuPy and a GPU are present;
* ``gpurt.device_standin.StandinBackend`` — **a host-memory stand-in, not a GPU**: "device"
  allocations are memfd mappings that other processes open by handle (as CUDA IPC opens an
  allocation), streams are queues executed asynchronously by a worker thread, events are
  counters in shared memory with CUDA's record/wait semantics.  It exists so that the
  protocol logic of the device path (handle exchange, base + offset, the handle cache,
  cross-process ordering with events, staging, stream semantics) runs and is tested on
  machines without a GPU.  Selected with ``GPURT_DEVICE_BACKEND=standin``; its arrays
  (``gpurt.device_standin.asarray``) carry ``__cuda_array_interface__`` like CuPy's.

A backend works on **views**: flat device arrays over raw memory that support
``v[a:b]`` (a view), ``v.view(dtype)``, ``v.nbytes``, ``v.size``, ``v.dtype`` and
``backend.ptr(v)`` (the address of its first byte).  For the CUDA backend they are CuPy
arrays; for the stand-in, ``device_standin.View``.

Everything is stream-ordered: ``copy``, ``reduce``, ``record`` … enqueue work on ``stream``
(an integer handle as in ``__cuda_array_interface__`` v3: 0/1 legacy default, 2 per-thread
default, else a ``cudaStream_t``) and return at once.  The host learns of completion only by
``query(event)`` — gpurt never blocks in a CUDA call while a peer may need it to progress.

Interface (all methods; errors are raised as ``gpurt.errors.TransportError`` or
``ResourceError`` with the CUDA error text):

  probe() -> (bool, str)                 usable here?  and why / why not (classmethod)
  count() -> int                         visible devices
  bind(device) / current() -> int        this process's device (by local rank, GPURT_DEVICE)
  uuid(device) -> str                    the physical GPU (two ranks on one GPU share it)
  can_access_peer(a, b) -> bool          P2P between two devices
  device_of(ptr) -> int                  the device that holds ``ptr``
  address_range(ptr) -> (base, size)     the allocation that holds ``ptr``
  ipc_handle(base) -> bytes              a handle another process can open
  ipc_open(handle) -> int                base address of that allocation in this process
  ipc_close(base)
  alloc_id(ptr) -> int                   the allocation's unique id (CUDA's BUFFER_ID): a new
                                         allocation at a freed one's address differs
  gdr_prepare(view)                      memory the NIC will access (SYNC_MEMOPS)
  view(ptr, nbytes, owner) -> view       a uint8 view over raw device memory (owner kept alive)
  ptr(view) -> int                       the address of a view's first byte
  alloc(nbytes, stream=None) -> view     scratch device memory for use on ``stream`` (CuPy's
                                         pool is stream-ordered; freed with the view: keep
                                         it until an event after its last use has fired)
  empty(shape, dtype, like, stream=None) -> object
                                         a user-facing array of ``like``'s kind (CuPy array,
                                         torch tensor, stand-in array) for ``out=None``,
                                         taken from its pool for ``stream`` (the call's)
  pinned(nbytes) -> numpy uint8 array    page-locked host memory (staging)
  current_stream() -> int
  event(ipc: bool) -> Event              ``.handle`` (bytes) when ipc
  event_open(handle) -> Event            another process's event
  record(ev, stream); query(ev) -> bool; wait_event(stream, ev)
  copy(dst, src, stream)                 device <- device (any device, peer memory included)
  to_host(dst_np, src, stream); from_host(dst, src_np, stream)   (src_np pinned, kept alive
                                         by the caller until an event recorded after it fires)
  reduce(op, acc, src, out, stream)      out = acc op src element-wise (same dtype views);
                                         bfloat16 is 16-bit storage converted in the kernel
  scale(view, divisor, stream)           AVG's final division
  rdma_flush()                           make GPUDirect RDMA writes that have landed visible to
                                         kernels (cuFlushGPUDirectRDMAWrites)
  synchronize(stream)                    only for tests and tools, never on a collective path
"""

from __future__ import annotations

import os
from typing import Any

from . import config

_BACKEND: Any = None
_FAILED: str | None = None


def backend_name() -> str:
    """``cuda`` or ``standin`` (``GPURT_DEVICE_BACKEND``; ``auto`` means cuda)."""
    want = str(config.get("GPURT_DEVICE_BACKEND")).strip().lower() or "auto"
    return "cuda" if want == "auto" else want


def _load(name: str):
    if name == "standin":
        from .device_standin import StandinBackend
        return StandinBackend
    if name == "cuda":
        from .device_cuda import CudaBackend
        return CudaBackend
    if name == "none":
        raise ValueError("GPURT_DEVICE_BACKEND=none: device buffers are switched off")
    raise ValueError(f"GPURT_DEVICE_BACKEND={name!r}: use auto, cuda, standin or none")


def probe() -> tuple[bool, str]:
    """Is the selected device backend usable here, and why (not)?  Never raises."""
    try:
        return _load(backend_name()).probe()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return False, f"{type(e).__name__}: {e}"


def get():
    """The process's device backend (created and bound on first use).  Raises ``TypeError``
    with the reason when there is none: a device buffer reached gpurt on a machine that
    cannot handle it."""
    global _BACKEND, _FAILED
    if _BACKEND is not None:
        return _BACKEND
    if _FAILED is not None:
        raise TypeError(_FAILED)
    name = backend_name()
    ok, why = probe()
    if not ok:
        _FAILED = f"device buffers need a device backend, and {name!r} is unavailable: {why}"
        raise TypeError(_FAILED)
    _BACKEND = _load(name)()
    return _BACKEND


def loaded():
    """The backend if one has been created in this process, else None (cheap)."""
    return _BACKEND


def choose_device(local_rank: int, ndev: int) -> int:
    """The device this rank binds to: ``GPURT_DEVICE`` if set (an index into the visible
    devices), else ``local_rank % ndev`` — several ranks may share a GPU."""
    forced = str(config.get("GPURT_DEVICE")).strip()
    if forced:
        try:
            d = int(forced)
        except ValueError:
            raise ValueError(f"GPURT_DEVICE={forced!r} is not a device index") from None
        if not 0 <= d < ndev:
            raise ValueError(f"GPURT_DEVICE={d} but {ndev} device(s) are visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r})")
        return d
    return local_rank % ndev if ndev else 0


def _reset_for_tests() -> None:
    global _BACKEND, _FAILED
    _BACKEND, _FAILED = None, None
