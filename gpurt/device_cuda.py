"""The CUDA device backend: the interface of ``gpurt.device`` on CuPy's runtime bindings,
plus the driver library (``libcuda.so.1``, through ctypes) for the few calls CuPy lacks
(``cuMemGetAddressRange``, ``cuDeviceGetUuid``).

CuPy is imported lazily, inside the methods: ``import gpurt`` (and this module) never needs
it; ``CudaBackend.probe()`` says whether it is there and sees a GPU.

Views are flat CuPy arrays.  bfloat16 has no CuPy dtype: a bfloat16 view is a ``uint16``
CuPy array (``typed(v, BFLOAT16)``), and ``reduce``/``scale`` take the logical dtype as
``dtype=`` and run their own kernel for it (16-bit storage widened to float32, the op,
round-to-nearest-even back, as ml_dtypes computes on the host).

Every method makes the bound device current for its call and restores the caller's device
afterwards (as NCCL does), so a progress loop may run on any thread.  CUDA errors are raised
as ``TransportError`` (``ResourceError`` when out of memory) naming the call.

Memory from ``alloc`` comes from CuPy's pool and goes back to it when the view is dropped:
drop a scratch view only after an event recorded after its last use has fired (the pool may
hand the bytes to the next allocation on the same stream at once).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Any

import numpy as np

from .errors import ResourceError, TransportError
from .ops import Op, bfloat16, is_bfloat16

log = logging.getLogger("gpurt.device")

_U8 = np.dtype(np.uint8)
_U16 = np.dtype(np.uint16)
_BOOL = np.dtype(np.bool_)

# CUDA runtime constants
_MEMCPY_DEFAULT = 4                  # cudaMemcpyDefault (UVA decides the direction)
_EVENT_DISABLE_TIMING = 2            # cudaEventDisableTiming
_EVENT_INTERPROCESS = 4              # cudaEventInterprocess
_IPC_LAZY_PEER = 1                   # cudaIpcMemLazyEnablePeerAccess
_SUCCESS, _NOT_READY = 0, 600        # cudaSuccess, cudaErrorNotReady
_OOM_STATUS = 2                      # cudaErrorMemoryAllocation == CUDA_ERROR_OUT_OF_MEMORY
_MEMTYPE_UNREGISTERED, _MEMTYPE_HOST = 0, 1   # cudaMemoryType (2 device, 3 managed)


def _version(v: int) -> str:
    """12040 -> '12.4'."""
    return f"{v // 1000}.{(v % 1000) // 10}"


# -- errors ------------------------------------------------------------------------------
_CUDA_ERRORS = frozenset({"CUDARuntimeError", "CUDADriverError", "CompileException",
                          "NVRTCError"})


def _translate(call: str, e: BaseException) -> BaseException | None:
    """The gpurt error for a CUDA failure in ``call``; None when ``e`` is not one (bad
    arguments and the like propagate as themselves)."""
    if isinstance(e, (TransportError, ResourceError)):
        return None
    name = type(e).__name__
    if name == "OutOfMemoryError":     # CuPy's pool (and torch.cuda's)
        return ResourceError(f"{call}: out of device memory: {e}")
    if name in _CUDA_ERRORS:
        status = getattr(e, "status", None)
        cls = ResourceError if status == _OOM_STATUS else TransportError
        return cls(f"{call} failed: {e}")
    return None


def _reraise(call: str, e: BaseException):
    w = _translate(call, e)
    if w is None:
        raise e
    raise w from e


# -- the driver library (ctypes), for what CuPy does not wrap ------------------------------
class _Driver:
    """``libcuda.so.1``: cuMemGetAddressRange_v2, cuDeviceGetUuid(_v2), cuCtxGetCurrent."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise TransportError(f"cannot load the CUDA driver library libcuda.so.1: {e}") from e
        c_int, c_uint, c_size_t, c_u64 = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, \
            ctypes.c_uint64
        lib.cuInit.argtypes, lib.cuInit.restype = [c_uint], c_int
        lib.cuGetErrorName.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorName.restype = c_int
        lib.cuGetErrorString.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.restype = c_int
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(c_u64), ctypes.POINTER(c_size_t),
                                                c_u64]
        lib.cuMemGetAddressRange_v2.restype = c_int
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxGetCurrent.restype = c_int
        lib.cuDeviceGet.argtypes, lib.cuDeviceGet.restype = [ctypes.POINTER(c_int), c_int], c_int
        lib.cuDevicePrimaryCtxGetState.argtypes = [c_int, ctypes.POINTER(c_uint),
                                                   ctypes.POINTER(c_int)]
        lib.cuDevicePrimaryCtxGetState.restype = c_int
        self.get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or \
            getattr(lib, "cuDeviceGetUuid", None)
        if self.get_uuid is not None:
            self.get_uuid.argtypes = [ctypes.c_char * 16, c_int]
            self.get_uuid.restype = c_int
        # (the driver's query keeps no per-thread "last error": the runtime's cudaEventQuery
        # leaves cudaErrorNotReady there, which PyTorch's check after its next kernel
        # launch reads as "CUDA error: device not ready" where both share one runtime)
        lib.cuEventQuery.argtypes, lib.cuEventQuery.restype = [ctypes.c_void_p], c_int
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, c_int, c_u64]
        lib.cuPointerGetAttribute.restype = c_int
        lib.cuPointerSetAttribute.argtypes = [ctypes.c_void_p, c_int, c_u64]
        lib.cuPointerSetAttribute.restype = c_int
        # CUDA >= 11.3: make the NIC's GPUDirect RDMA writes visible to later kernels
        self.flush = getattr(lib, "cuFlushGPUDirectRDMAWrites", None)
        if self.flush is not None:
            self.flush.argtypes, self.flush.restype = [c_int, c_int], c_int
        self.lib = lib
        self.check(lib.cuInit(0), "cuInit")

    def check(self, rc: int, call: str) -> None:
        if rc == 0:
            return
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        self.lib.cuGetErrorString(rc, ctypes.byref(text))
        msg = f"{call} failed: {(name.value or b'CUDA_ERROR_%d' % rc).decode()}: " \
              f"{(text.value or b'').decode()}"
        raise (ResourceError if rc == _OOM_STATUS else TransportError)(msg)

    def has_context(self) -> bool:
        ctx = ctypes.c_void_p()
        return self.lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and bool(ctx.value)

    def primary_active(self, ordinal: int) -> bool:
        """Does device ``ordinal``'s primary context exist (cuDevicePrimaryCtxGetState)?
        True where the driver cannot say."""
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if self.lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0 or \
                self.lib.cuDevicePrimaryCtxGetState(dev.value, ctypes.byref(flags),
                                                    ctypes.byref(active)) != 0:
            return True
        return bool(active.value)

    def event_query(self, ev: int) -> int:
        """cuEventQuery's status: 0 (done), 600 (CUDA_ERROR_NOT_READY) or an error."""
        return int(self.lib.cuEventQuery(ctypes.c_void_p(ev)))

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                    ptr), "cuMemGetAddressRange")
        return int(base.value), int(size.value)

    def buffer_id(self, ptr: int) -> int:
        """CU_POINTER_ATTRIBUTE_BUFFER_ID (7 in cuda.h; 18 is MAPPING_SIZE, which two
        allocations of one size share): unique per allocation in the process."""
        v = ctypes.c_uint64()
        self.check(self.lib.cuPointerGetAttribute(ctypes.byref(v), 7, ptr),
                   "cuPointerGetAttribute(BUFFER_ID)")
        return int(v.value)

    def sync_memops(self, ptr: int) -> None:
        """CU_POINTER_ATTRIBUTE_SYNC_MEMOPS (6) = 1 on the allocation at ``ptr``."""
        one = ctypes.c_uint(1)
        self.check(self.lib.cuPointerSetAttribute(ctypes.byref(one), 6, ptr),
                   "cuPointerSetAttribute(SYNC_MEMOPS)")

    def uuid(self, ordinal: int) -> str | None:
        if self.get_uuid is None:
            return None
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        buf = (ctypes.c_char * 16)()
        self.check(self.get_uuid(buf, dev.value), "cuDeviceGetUuid")
        return _format_uuid(bytes(buf))


def _format_uuid(b: bytes) -> str:
    """16 bytes -> 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' (as nvidia-smi -L shows)."""
    h = b.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_DRIVER: _Driver | None = None
_DRIVER_LOCK = threading.Lock()


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        with _DRIVER_LOCK:
            if _DRIVER is None:
                _DRIVER = _Driver()
    return _DRIVER


# -- bfloat16 kernels ------------------------------------------------------------------------
_BF16_PREAMBLE = r"""
__device__ __forceinline__ float gpurt_bf2f(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short gpurt_f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {       /* NaN: a quiet NaN of the same sign */
        return (u & 0x80000000u) ? (unsigned short)0xffc0u : (unsigned short)0x7fc0u;
    }
    u += 0x7fffu + ((u >> 16) & 1u);              /* round to nearest, ties to even */
    return (unsigned short)(u >> 16);
}
/* float32 arithmetic as explicit PTX without .ftz: CuPy compiles every kernel with
   -ftz=true (last on its command line), which would flush bfloat16's subnormals (float32
   subnormals once widened) to zero, where the host (ml_dtypes) keeps them */
__device__ __forceinline__ float gpurt_add(float x, float y) {
    float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y)); return r;
}
__device__ __forceinline__ float gpurt_mul(float x, float y) {
    float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y)); return r;
}
__device__ __forceinline__ float gpurt_div(float x, float y) {
    float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y)); return r;
}
/* MIN/MAX compare the bits, not floats (a float compare would be .ftz too): NaN, and
   the order of the values with -0 == +0 */
__device__ __forceinline__ bool gpurt_bfnan(unsigned short h) {
    return (h & 0x7fffu) > 0x7f80u;
}
__device__ __forceinline__ int gpurt_bfkey(unsigned short h) {
    int m = h & 0x7fff;
    return (h & 0x8000) ? -m : m;
}
"""

# out = a op b on bfloat16 bits (as ml_dtypes: float32 arithmetic, one rounding; MIN/MAX
# return one of the inputs unchanged, a NaN operand wins)
_BF16_BODY = {
    Op.SUM: "c = gpurt_f2bf(gpurt_add(gpurt_bf2f(a), gpurt_bf2f(b)))",
    Op.AVG: "c = gpurt_f2bf(gpurt_add(gpurt_bf2f(a), gpurt_bf2f(b)))",
    Op.PROD: "c = gpurt_f2bf(gpurt_mul(gpurt_bf2f(a), gpurt_bf2f(b)))",
    Op.MIN: "c = (gpurt_bfnan(a) || (!gpurt_bfnan(b) && gpurt_bfkey(a) < gpurt_bfkey(b)))"
            " ? a : b",
    Op.MAX: "c = (gpurt_bfnan(a) || (!gpurt_bfnan(b) && gpurt_bfkey(a) > gpurt_bfkey(b)))"
            " ? a : b",
}
_KERNELS: dict = {}
_KLOCK = threading.Lock()


def _bf16_kernel(op: Op):
    k = _KERNELS.get(op)
    if k is None:
        body = _BF16_BODY.get(op)
        if body is None:
            raise TypeError(f"op {op.name} is not defined for bfloat16")
        import cupy

        with _KLOCK:
            k = _KERNELS.get(op)
            if k is None:
                k = _KERNELS[op] = cupy.ElementwiseKernel(
                    "uint16 a, uint16 b", "uint16 c", body, f"gpurt_bf16_{op.name.lower()}",
                    preamble=_BF16_PREAMBLE)
    return k


def _bf16_scale_kernel():
    k = _KERNELS.get("scale")
    if k is None:
        import cupy

        with _KLOCK:
            k = _KERNELS.get("scale")
            if k is None:
                k = _KERNELS["scale"] = cupy.ElementwiseKernel(
                    "float32 d", "uint16 v", "v = gpurt_f2bf(gpurt_div(gpurt_bf2f(v), d))",
                    "gpurt_bf16_scale", preamble=_BF16_PREAMBLE)
    return k


class _StreamHandle:
    """A raw stream handle under the CUDA stream protocol (``__cuda_stream__``: version 0
    and the handle), which CuPy's ``Stream.from_external`` takes."""

    __slots__ = ("h",)

    def __init__(self, h: int):
        self.h = h

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.h)


# -- device scope --------------------------------------------------------------------------------
def _enter_device(rt, dev: int) -> int:
    """Make ``dev`` current; the device that was (-1: it already was ``dev``)."""
    prev = rt.getDevice()
    if prev == dev:
        return -1
    rt.setDevice(dev)
    return prev


def _leave_device(rt, prev: int) -> None:
    """The caller's device again — where it has a context: a thread that never used a
    device reports device 0, and setting it would create a context there (hundreds of
    MiB, and an error on a GPU in exclusive-process mode) for a rank bound to another
    GPU; that thread keeps the bound device current (PyTorch's MaybeSetDevice does the
    same)."""
    if prev >= 0 and _driver().primary_active(prev):
        rt.setDevice(prev)


# -- events ------------------------------------------------------------------------------------
class Event:
    """A CUDA event: ``ev`` (the ``cudaEvent_t`` as an int) and ``handle`` (the IPC handle's
    64 bytes when interprocess, else None).  Destroyed by ``close()`` or when collected."""

    __slots__ = ("ev", "handle", "opened", "dev", "__weakref__")

    def __init__(self, ev: int, handle: bytes | None, opened: bool = False, dev: int = -1):
        self.ev, self.handle, self.opened, self.dev = ev, handle, opened, dev

    def close(self) -> None:
        """Destroyed with its device current (``_enter_device``: from a thread that never
        used CUDA — a collection, a finaliser — the runtime call would otherwise create
        device 0's context for a rank bound to another GPU)."""
        ev, self.ev = self.ev, 0
        if ev:
            try:
                import cupy

                rt = cupy.cuda.runtime
                prev = _enter_device(rt, self.dev) if self.dev >= 0 else -1
                try:
                    rt.eventDestroy(ev)
                finally:
                    _leave_device(rt, prev)
            except Exception:  # noqa: BLE001 - at exit the context may be gone already
                pass

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "opened" if self.opened else ("ipc" if self.handle else "local")
        return f"<gpurt CUDA Event {kind} {self.ev:#x}>"


# -- the backend -----------------------------------------------------------------------------------
class CudaBackend:
    """The device interface (``gpurt.device``) on CuPy and the CUDA driver."""

    name = "cuda"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            import cupy
        except ImportError as e:
            return False, f"CuPy not installed ({e}); pip install cupy-cuda12x"
        except Exception as e:  # noqa: BLE001 - a broken install is a reason, not a crash
            return False, f"CuPy failed to import: {type(e).__name__}: {e}"
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001
            return False, f"no CUDA device: {e}"
        if n <= 0:
            return False, "no CUDA device: cudaGetDeviceCount() returned 0"
        try:
            rt = _version(cupy.cuda.runtime.runtimeGetVersion())
            drv = _version(cupy.cuda.runtime.driverGetVersion())
        except Exception as e:  # noqa: BLE001
            return False, f"no usable CUDA driver: {e}"
        return True, f"CUDA {rt}, driver {drv}, {n} GPU(s)"

    def __init__(self):
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        self._streams: dict = {}
        self._uuids: dict[int, str] = {}
        self._no_flush = False
        self._ctx_ok = threading.local()
        try:
            self._device = self._rt.getDevice()
        except Exception as e:  # noqa: BLE001
            _reraise("cudaGetDevice", e)

    # -- device scope: the bound device is current during a call, the caller's after ------
    def _enter(self) -> int:
        return _enter_device(self._rt, self._device)

    def _leave(self, prev: int) -> None:
        _leave_device(self._rt, prev)

    def _ensure_ctx(self) -> None:
        """A driver API call needs a current context, which a thread whose current device
        already was the bound one (``_enter`` changed nothing) may not have yet: any
        runtime call makes the device's primary context current (CuPy does the same)."""
        if not getattr(self._ctx_ok, "ok", False):
            if not _driver().has_context():
                self._rt.memGetInfo()
            self._ctx_ok.ok = True

    def _stream(self, handle: int):
        """A CuPy stream object for a raw handle (0/1 legacy, 2 per-thread, else a
        cudaStream_t), to make current around CuPy kernel launches."""
        key = (handle, self._device)
        s = self._streams.get(key)
        if s is None:
            from_external = getattr(self._cp.cuda.Stream, "from_external", None)
            if from_external is not None:      # CuPy >= 14 (ExternalStream deprecated)
                try:   # (it takes an object of the CUDA stream protocol, not a handle)
                    s = from_external(_StreamHandle(handle))
                except (TypeError, AttributeError, ValueError):
                    s = None
            if s is None:
                ext = self._cp.cuda.ExternalStream
                try:
                    s = ext(handle, self._device)
                except TypeError:      # CuPy < 12: no device_id argument
                    s = ext(handle)
            if len(self._streams) > 256:
                self._streams.clear()
            self._streams[key] = s
        return s

    # -- devices ------------------------------------------------------------------------------
    def count(self) -> int:
        try:
            return self._rt.getDeviceCount()
        except Exception as e:  # noqa: BLE001
            _reraise("cudaGetDeviceCount", e)

    def bind(self, device: int) -> None:
        try:
            self._cp.cuda.Device(int(device)).use()
        except Exception as e:  # noqa: BLE001
            _reraise(f"cudaSetDevice({device})", e)
        self._device = int(device)
        self._streams.clear()

    def current(self) -> int:
        return self._device

    def uuid(self, device: int) -> str:
        """The physical GPU (MIG instance) as 'GPU-<uuid>' from the driver, else
        'PCI-<domain:bus:device.function>': the same string in every process that sees the
        GPU, whatever its CUDA_VISIBLE_DEVICES."""
        d = int(device)
        got = self._uuids.get(d)
        if got is not None:
            return got
        try:
            got = _driver().uuid(d)
        except Exception:  # noqa: BLE001 - fall back to the PCI address
            got = None
        if got is None:
            try:
                got = "PCI-" + self._rt.deviceGetPCIBusId(d).lower()
            except Exception as e:  # noqa: BLE001
                _reraise(f"cudaDeviceGetPCIBusId({d})", e)
        self._uuids[d] = got
        return got

    def can_access_peer(self, a: int, b: int) -> bool:
        if a == b:
            return True
        try:
            return bool(self._rt.deviceCanAccessPeer(int(a), int(b)))
        except Exception as e:  # noqa: BLE001
            _reraise(f"cudaDeviceCanAccessPeer({a}, {b})", e)

    def device_of(self, ptr: int) -> int:
        prev = self._enter()      # (a thread that never used CUDA: no context made on GPU 0)
        try:
            attrs = self._rt.pointerGetAttributes(int(ptr))
        except Exception as e:  # noqa: BLE001
            _reraise("cudaPointerGetAttributes", e)
        finally:
            self._leave(prev)
        if attrs.type in (_MEMTYPE_UNREGISTERED, _MEMTYPE_HOST) or attrs.device < 0:
            raise TransportError(f"cudaPointerGetAttributes: {int(ptr):#x} is not device memory "
                                 f"(memory type {attrs.type})")
        return int(attrs.device)

    def address_range(self, ptr: int) -> tuple[int, int]:
        prev = self._enter()
        try:
            self._ensure_ctx()
            return _driver().address_range(int(ptr))
        except Exception as e:  # noqa: BLE001
            _reraise("cuMemGetAddressRange", e)
        finally:
            self._leave(prev)

    # -- IPC memory -------------------------------------------------------------------------------
    def ipc_handle(self, base: int) -> bytes:
        prev = self._enter()
        try:
            return bytes(self._rt.ipcGetMemHandle(int(base)))
        except Exception as e:  # noqa: BLE001
            err = _translate("cudaIpcGetMemHandle", e)
            if isinstance(err, TransportError):   # e.g. cudaMallocAsync / cuMemCreate memory
                raise TransportError(
                    f"{err}: this memory cannot be shared by CUDA IPC (it comes from a "
                    f"stream-ordered pool (cudaMallocAsync, CuPy's MemoryAsyncPool), "
                    f"PyTorch's expandable_segments, or managed memory); use CuPy's default "
                    f"pool / PyTorch's caching allocator without expandable segments, or set "
                    f"GPURT_TRANSPORTS without cuda_ipc (e.g. shm,verbs,tcp) to stage "
                    f"device buffers through host memory") from None
            _reraise("cudaIpcGetMemHandle", e)
        finally:
            self._leave(prev)

    def alloc_id(self, ptr: int) -> int:
        """The allocation's unique id (CU_POINTER_ATTRIBUTE_BUFFER_ID): a handle of a new
        allocation at a freed one's address is told apart by it."""
        prev = self._enter()
        try:
            self._ensure_ctx()
            return _driver().buffer_id(int(ptr))
        finally:
            self._leave(prev)

    def ipc_open(self, handle: bytes) -> int:
        prev = self._enter()
        try:
            return int(self._rt.ipcOpenMemHandle(bytes(handle), _IPC_LAZY_PEER))
        except Exception as e:  # noqa: BLE001
            _reraise("cudaIpcOpenMemHandle", e)
        finally:
            self._leave(prev)

    def ipc_close(self, base: int) -> None:
        prev = self._enter()
        try:
            self._rt.ipcCloseMemHandle(int(base))
        except Exception as e:  # noqa: BLE001
            _reraise("cudaIpcCloseMemHandle", e)
        finally:
            self._leave(prev)

    # -- memory -------------------------------------------------------------------------------------
    def view(self, ptr: int, nbytes: int, owner: Any):
        """A flat uint8 CuPy array over ``nbytes`` at ``ptr`` (``owner`` kept alive)."""
        cp = self._cp
        ptr, nbytes = int(ptr), int(nbytes)
        try:
            # the bound device: user buffers live there (checked), and IPC-opened memory of a
            # peer GPU is mapped into this device's context (lazy peer access) — telling
            # CuPy the peer's id would make every kernel re-check peer access
            mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, self._device)
            return cp.ndarray((nbytes,), _U8, cp.cuda.MemoryPointer(mem, 0))
        except Exception as e:  # noqa: BLE001
            _reraise("view (cudaPointerGetAttributes)", e)

    def ptr(self, v) -> int:
        return v.data.ptr

    def typed(self, v, dtype):
        """``v`` reinterpreted as ``dtype``; bfloat16 (no CuPy dtype) as uint16."""
        dtype = np.dtype(dtype)
        if is_bfloat16(dtype):
            dtype = _U16
        return v if v.dtype == dtype else v.view(dtype)

    def alloc(self, nbytes: int, stream=None):
        """Scratch from CuPy's pool, taken for ``stream`` (the pool is stream-ordered: a
        block freed on another stream may still have pending kernels there)."""
        prev = self._enter()
        try:
            if stream is not None:
                with self._stream(int(stream)):
                    return self._cp.empty((int(nbytes),), dtype=_U8)
            return self._cp.empty((int(nbytes),), dtype=_U8)
        except Exception as e:  # noqa: BLE001
            _reraise(f"alloc({nbytes})", e)
        finally:
            self._leave(prev)

    def empty(self, shape, dtype, like, stream: int | None = None):
        """A new array like ``like``: a torch tensor (same device) for a torch input, a CuPy
        array on ``like``'s device for CuPy (or any other ``__cuda_array_interface__``)
        input.  bfloat16 exists only as a torch tensor here.  ``stream`` (a raw handle):
        the stream that will write it, which the block is taken from the pool for (both
        pools are stream-ordered; ``None``: the current stream)."""
        shape = tuple(int(s) for s in shape) if isinstance(shape, (tuple, list)) else \
            (int(shape),)
        dtype = np.dtype(dtype)
        mod = type(like).__module__ or ""
        if mod.startswith("torch"):
            import torch

            tdt = like.dtype if _torch_matches(like.dtype, dtype) else _torch_dtype(dtype)
            try:
                with _torch_stream(torch, like.device, stream):
                    return torch.empty(shape, dtype=tdt, device=like.device)
            except Exception as e:  # noqa: BLE001
                _reraise(f"torch.empty({shape}, {tdt})", e)
        if is_bfloat16(dtype):
            raise TypeError(f"cannot allocate a bfloat16 result like a {type(like).__name__}: "
                            f"CuPy has no bfloat16; pass out= (or use torch.bfloat16 tensors)")
        cp = self._cp
        if isinstance(like, cp.ndarray):
            dev = like.device.id
        else:
            cai = getattr(like, "__cuda_array_interface__", None)
            if cai is None:
                raise TypeError(f"cannot allocate a device array like a {type(like).__name__}")
            ptr = int(cai["data"][0])
            dev = self.device_of(ptr) if ptr else self._device
        try:
            with cp.cuda.Device(dev):
                if stream is None or stream == cp.cuda.get_current_stream().ptr or \
                        dev != self._device:      # (_stream's streams are on ours)
                    return cp.empty(shape, dtype=dtype)
                with self._stream(int(stream)):
                    return cp.empty(shape, dtype=dtype)
        except Exception as e:  # noqa: BLE001
            _reraise(f"cupy.empty({shape}, {dtype})", e)

    def pinned(self, nbytes: int) -> np.ndarray:
        nbytes = int(nbytes)
        if nbytes == 0:
            return np.empty(0, _U8)
        prev = self._enter()
        cuda = self._cp.cuda
        try:
            # cudaHostAlloc of its own, not CuPy's pinned pool (alloc_pinned_memory), which
            # keeps every block it ever handed out: gpurt's pool releases what stays idle
            mem = cuda.PinnedMemoryPointer(
                cuda.PinnedMemory(nbytes, getattr(cuda.runtime, "hostAllocPortable", 1)), 0)
        except Exception as e:  # noqa: BLE001
            _reraise(f"cudaHostAlloc({nbytes})", e)
        finally:
            self._leave(prev)
        # the array's base holds the PinnedMemoryPointer (and it the PinnedMemory): the
        # memory is freed (cudaFreeHost) when the last view of the array goes
        return np.frombuffer(mem, _U8, nbytes)

    # -- streams and events --------------------------------------------------------------------
    def current_stream(self) -> int:
        prev = self._enter()
        try:
            return int(self._cp.cuda.get_current_stream().ptr)
        finally:
            self._leave(prev)

    def event(self, ipc: bool = True) -> Event:
        flags = _EVENT_DISABLE_TIMING | (_EVENT_INTERPROCESS if ipc else 0)
        prev = self._enter()
        try:
            ev = Event(self._rt.eventCreateWithFlags(flags), None, dev=self._device)
            if ipc:       # on failure ev is collected, and destroyed
                ev.handle = bytes(self._rt.ipcGetEventHandle(ev.ev))
            return ev
        except Exception as e:  # noqa: BLE001
            _reraise("cudaEventCreateWithFlags/cudaIpcGetEventHandle", e)
        finally:
            self._leave(prev)

    def event_open(self, handle: bytes) -> Event:
        prev = self._enter()
        try:
            return Event(self._rt.ipcOpenEventHandle(bytes(handle)), bytes(handle), True,
                         self._device)
        except Exception as e:  # noqa: BLE001
            _reraise("cudaIpcOpenEventHandle", e)
        finally:
            self._leave(prev)

    def record(self, ev: Event, stream) -> None:
        prev = self._enter()
        try:
            self._rt.eventRecord(ev.ev, int(stream))
        except Exception as e:  # noqa: BLE001
            _reraise("cudaEventRecord", e)
        finally:
            self._leave(prev)

    def query(self, ev: Event) -> bool:
        """Through the driver (``_Driver.event_query``: no "last error" left behind), with
        the bound device current (a polling thread that never used CUDA)."""
        prev = self._enter()
        try:
            self._ensure_ctx()
            st = _driver().event_query(ev.ev)
        finally:
            self._leave(prev)
        if st == _SUCCESS:
            return True
        if st == _NOT_READY:
            return False
        _driver().check(st, "cuEventQuery")
        return False

    def wait_event(self, stream, ev: Event) -> None:
        prev = self._enter()
        try:
            self._rt.streamWaitEvent(int(stream), ev.ev, 0)
        except Exception as e:  # noqa: BLE001
            _reraise("cudaStreamWaitEvent", e)
        finally:
            self._leave(prev)

    # -- work ----------------------------------------------------------------------------------
    def _memcpy(self, dst: int, src: int, n: int, stream, call: str) -> None:
        if not n:
            return
        prev = self._enter()
        try:
            self._rt.memcpyAsync(dst, src, n, _MEMCPY_DEFAULT, int(stream))
        except Exception as e:  # noqa: BLE001
            _reraise(call, e)
        finally:
            self._leave(prev)

    def copy(self, dst, src, stream) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy: {dst.nbytes} bytes <- {src.nbytes}")
        self._memcpy(dst.data.ptr, src.data.ptr, src.nbytes, stream, "cudaMemcpyAsync (D2D)")

    def to_host(self, dst: np.ndarray, src, stream) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"to_host: {dst.nbytes} bytes <- {src.nbytes}")
        if not dst.flags.c_contiguous:
            raise ValueError("to_host: the host array is not contiguous")
        self._memcpy(dst.__array_interface__["data"][0], src.data.ptr, src.nbytes, stream,
                     "cudaMemcpyAsync (D2H)")

    def from_host(self, dst, src: np.ndarray, stream) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"from_host: {dst.nbytes} bytes <- {src.nbytes}")
        if not src.flags.c_contiguous:
            raise ValueError("from_host: the host array is not contiguous")
        self._memcpy(dst.data.ptr, src.__array_interface__["data"][0], src.nbytes, stream,
                     "cudaMemcpyAsync (H2D)")

    def reduce(self, op: Op, acc, src, out, stream, dtype=None) -> None:
        """out = acc op src element-wise, queued on ``stream``.  ``dtype`` is the logical
        dtype (default: ``out.dtype``); the views are reinterpreted as it (bfloat16: uint16
        storage, reduced by gpurt's kernel).  ``out`` may be ``acc``."""
        dtype = np.dtype(dtype) if dtype is not None else out.dtype
        if out.nbytes != acc.nbytes or out.nbytes != src.nbytes:
            raise ValueError(f"reduce: sizes differ (acc {acc.nbytes}, src {src.nbytes}, "
                             f"out {out.nbytes} bytes)")
        if not out.nbytes:
            return
        bf16 = is_bfloat16(dtype)
        store = _U16 if bf16 else dtype
        a = acc if acc.dtype == store else acc.view(store)
        b = src if src.dtype == store else src.view(store)
        # out is acc (in place): the same view object, or CuPy copies the input first
        # (two objects over one range look like overlapping arrays to it)
        o = a if out is acc or out.data.ptr == acc.data.ptr else \
            out if out.dtype == store else out.view(store)
        if b is not o and src.data.ptr == out.data.ptr:
            b = o       # (the same: src and out over one range, as recursive doubling's
                        # acc op out -> out; element-wise that is exact, and two objects
                        # would make CuPy copy src first)
        if bf16:
            kern = _bf16_kernel(op)
        else:
            kern = _ufunc(self._cp, op, dtype)
        prev = self._enter()
        try:
            with self._stream(int(stream)):
                if bf16:
                    kern(a, b, o)
                else:
                    kern(a, b, out=o)
        except Exception as e:  # noqa: BLE001
            _reraise(f"reduce {op.name} {dtype}", e)
        finally:
            self._leave(prev)

    def scale(self, v, divisor, stream, dtype=None) -> None:
        """v /= divisor in place (AVG's final division), queued on ``stream``."""
        dtype = np.dtype(dtype) if dtype is not None else v.dtype
        if not v.nbytes:
            return
        bf16 = is_bfloat16(dtype)
        if dtype.kind == "c":   # (as the host: each part ÷ the real count, correctly rounded)
            dtype = np.dtype(dtype.char.lower())
        store = _U16 if bf16 else dtype
        w = v if v.dtype == store else v.view(store)
        prev = self._enter()
        try:
            with self._stream(int(stream)):
                if bf16:
                    # the divisor as a bfloat16 value, as numpy's divide on bfloat16 uses it
                    d = float(np.array(divisor, np.float32).astype(bfloat16()).astype(np.float32))
                    _bf16_scale_kernel()(np.float32(d), w)
                else:
                    self._cp.divide(w, dtype.type(divisor), out=w)
        except Exception as e:  # noqa: BLE001
            _reraise(f"scale {dtype}", e)
        finally:
            self._leave(prev)

    def rdma_flush(self) -> None:
        """After a GPUDirect RDMA write into this device's memory has landed (the NIC said
        so), before a kernel reads it: cuFlushGPUDirectRDMAWrites(current context, to the
        owner) — NCCL's flush.  Skipped (once warned) where the driver lacks it (CUDA <
        11.3) or the device refuses it."""
        drv = _driver()
        if drv.flush is None or self._no_flush:
            return
        prev = self._enter()
        try:
            self._ensure_ctx()      # (a thread without a current context: not a refusal)
            drv.check(drv.flush(0, 100), "cuFlushGPUDirectRDMAWrites")
        except TransportError as e:
            self._no_flush = True
            log.warning("gpurt: %s; GPUDirect RDMA writes are consumed without a flush", e)
        finally:
            self._leave(prev)

    def gdr_prepare(self, v) -> None:
        """Memory the NIC will read or write (GPUDirect RDMA): CU_POINTER_ATTRIBUTE_
        SYNC_MEMOPS, as NVIDIA's GPUDirect RDMA guide asks (synchronous memory operations
        on it are then ordered with the NIC's accesses)."""
        prev = self._enter()
        try:
            _driver().sync_memops(int(v.data.ptr))
        except TransportError as e:
            log.warning("gpurt: %s", e)
        finally:
            self._leave(prev)

    def synchronize(self, stream) -> None:
        prev = self._enter()
        try:
            self._rt.streamSynchronize(int(stream))
        except Exception as e:  # noqa: BLE001
            _reraise("cudaStreamSynchronize", e)
        finally:
            self._leave(prev)

    # -- for `gpurt info` -------------------------------------------------------------------------
    def info(self) -> dict:
        return info()


def _ufunc(cp, op: Op, dtype: np.dtype):
    if dtype == _BOOL and op in (Op.MIN, Op.MAX):
        return cp.logical_and if op is Op.MIN else cp.logical_or
    return {Op.SUM: cp.add, Op.AVG: cp.add, Op.PROD: cp.multiply, Op.MIN: cp.minimum,
            Op.MAX: cp.maximum, Op.BAND: cp.bitwise_and, Op.BOR: cp.bitwise_or,
            Op.BXOR: cp.bitwise_xor}[op]


def _torch_dtype(dtype: np.dtype):
    import torch

    if is_bfloat16(dtype):
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _torch_stream(torch, device, stream: int | None):
    """A context in which ``stream`` (a raw handle) is PyTorch's current stream on
    ``device``, so that its caching allocator takes the block for that stream (nothing to
    do for None, or where it is current already)."""
    if stream is None or int(torch.cuda.current_stream(device).cuda_stream) == int(stream):
        return contextlib.nullcontext()
    if int(stream) in (0, 1):      # the legacy default stream: PyTorch's default stream
        return torch.cuda.stream(torch.cuda.default_stream(device))
    return torch.cuda.stream(torch.cuda.ExternalStream(int(stream), device=device))


def _torch_matches(tdt, dtype: np.dtype) -> bool:
    try:
        return tdt == _torch_dtype(dtype)
    except Exception:  # noqa: BLE001 - a dtype torch lacks
        return False


def info() -> dict:
    """CUDA runtime/driver and CuPy versions, the GPUs, and the P2P matrix.  Never raises."""
    ok, why = CudaBackend.probe()
    out: dict = {"backend": "cuda", "available": ok, "why": why}
    if not ok:
        return out
    try:
        import cupy

        rt = cupy.cuda.runtime
        out["cupy"] = cupy.__version__
        out["cuda_runtime"] = _version(rt.runtimeGetVersion())
        out["cuda_driver"] = _version(rt.driverGetVersion())
        n = rt.getDeviceCount()
        gpus = []
        for d in range(n):
            row: dict = {"index": d}
            try:
                p = rt.getDeviceProperties(d)
                name = p.get("name", b"?")
                row["name"] = name.decode(errors="replace") if isinstance(name, bytes) else name
                row["memory_bytes"] = int(p.get("totalGlobalMem", 0))
                row["memory"] = f"{int(p.get('totalGlobalMem', 0)) / 2**30:.1f} GiB"
                row["compute_capability"] = f"{p.get('major')}.{p.get('minor')}"
                row["pci"] = rt.deviceGetPCIBusId(d).lower()
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"
            try:
                row["uuid"] = _driver().uuid(d)
            except Exception as e:  # noqa: BLE001
                row["uuid"] = f"unavailable: {e}"
            gpus.append(row)
        out["gpus"] = gpus
        p2p = []
        for a in range(n):
            line = []
            for b in range(n):
                try:
                    line.append(True if a == b else bool(rt.deviceCanAccessPeer(a, b)))
                except Exception:  # noqa: BLE001
                    line.append(None)
            p2p.append(line)
        out["p2p"] = p2p
    except Exception as e:  # noqa: BLE001 - info must not raise
        out["error"] = f"{type(e).__name__}: {e}"
    return out
