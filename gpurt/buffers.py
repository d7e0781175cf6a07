"""Any array -> ``Buf``: pointer, bytes, dtype, count, memory kind, device.

Nothing below ``gpurt.comm`` sees user objects: they are resolved here once per call.
Recognised, in this order:

1. ``__cuda_array_interface__`` (CuPy, Numba, PyTorch CUDA tensors): kind ``"cuda"``;
2. ``__dlpack__`` with ``__dlpack_device__``: CPU -> a NumPy view (PyTorch CPU tensors),
   CUDA -> kind ``"cuda"``;
3. ``numpy.ndarray`` and anything with the buffer protocol (``array.array``,
   ``memoryview``, ``bytearray``): kind ``"host"``.

Host buffers carry ``array``: a flat, C-contiguous NumPy view of the user's memory
(no copy).  Device buffers are described (pointer, dtype, count, stream); the
communicator checks them against its device backend (``gpurt.device``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .ops import _SUPPORTED, _names, bfloat16, check_dtype

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13

# __cuda_array_interface__ typestr -> dtype (bfloat16 has no NumPy typestr of its own)
_CAI_BF16 = ("<V2", "|V2")


class Buf:
    """A resolved buffer.  Host buffers carry ``array`` (flat view); ``ptr`` is computed
    on first use (most calls never need it)."""

    __slots__ = ("kind", "_ptr", "nbytes", "dtype", "shape", "readonly", "owner", "array",
                 "device", "stream", "count")

    def __init__(self, kind: str, ptr: int | None, nbytes: int, dtype: np.dtype,
                 shape: tuple[int, ...], readonly: bool, owner: Any,
                 array: np.ndarray | None = None, device: int = -1, stream: int | None = None):
        self.kind, self._ptr, self.nbytes, self.dtype = kind, ptr, nbytes, dtype
        self.shape, self.readonly, self.owner, self.array = shape, readonly, owner, array
        self.device, self.stream = device, stream
        self.count = nbytes // dtype.itemsize if dtype.itemsize else 0

    @property
    def ptr(self) -> int:
        if self._ptr is None:
            self._ptr = self.array.__array_interface__["data"][0]
        return self._ptr

    def describe(self) -> str:
        return f"{self.kind} {self.dtype}[{self.count}]"

    def __repr__(self) -> str:
        return f"<Buf {self.describe()}>"


def _not_contiguous(what: str, owner: Any, strides, shape) -> ValueError:
    """The refusal of a strided buffer, in the owner's own terms (a tensor's strides in
    elements, as ``t.stride()`` says), with the copy to pass — and a reminder that a
    result written into a copy must be copied back (else it is lost, silently)."""
    if (type(owner).__module__ or "").startswith("torch") and hasattr(owner, "stride"):
        try:
            strides, shape = tuple(owner.stride()), tuple(owner.shape)
        except Exception:  # noqa: BLE001 - only for the message
            pass
        return ValueError(
            f"{what} is not contiguous (strides {strides} elements for shape {shape}, e.g. "
            f"channels_last or a transposed view); pass c = {what}.contiguous(), and where "
            f"the result is written into it (in place, or out=) copy it back: "
            f"{what}.copy_(c)")
    mod = "cupy" if (type(owner).__module__ or "").startswith("cupy") else \
        "numpy" if isinstance(owner, np.ndarray) else None
    copy = f"c = {mod}.ascontiguousarray({what})" if mod else "a C-contiguous copy c"
    back = f"{what}[...] = c" if mod else f"into {what}"
    return ValueError(
        f"{what} is not C-contiguous (strides {tuple(strides)} for shape {tuple(shape)}); "
        f"pass {copy}, and where the result is written into it (in place, or out=) copy "
        f"it back: {back}")


def _host(arr: np.ndarray, owner: Any, what: str) -> Buf:
    flags = arr.flags
    if not flags.c_contiguous:
        raise _not_contiguous(what, owner, arr.strides, arr.shape)
    dtype = arr.dtype
    if dtype not in _SUPPORTED:
        dtype = check_dtype(dtype)
    return Buf("host", None, arr.nbytes, dtype, arr.shape, not flags.writeable, owner,
               arr.reshape(-1))


def _cuda(cai: dict, owner: Any, what: str) -> Buf:
    if cai.get("mask") is not None:
        raise TypeError(f"{what}: a masked device array (__cuda_array_interface__ 'mask'): "
                        f"its mask would be ignored; pass the data with its masked "
                        f"elements filled")
    typestr = cai["typestr"]
    if typestr in _CAI_BF16 and bfloat16() is not None:
        dtype = bfloat16()
    else:
        dtype = check_dtype(np.dtype(typestr))
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if strides is not None and count > 1:
        expect, acc = [], dtype.itemsize
        for dim in reversed(shape):
            expect.append(acc)
            acc *= dim
        # (an axis of length 1 may carry any stride — CuPy and PyTorch differ there —
        # but only those: a.T[None] is as strided as a.T)
        if any(d != 1 and st != want
               for d, st, want in zip(shape, strides, reversed(expect))):
            raise _not_contiguous(what, owner, strides, shape)
    ptr, ro = cai["data"]
    return Buf("cuda", int(ptr), count * dtype.itemsize, dtype, shape, bool(ro), owner,
               None, -1, cai.get("stream"))


_OP_NAMES = frozenset({"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"})


def as_buf(x: Any, what: str = "x") -> Buf:
    """Resolve ``x`` (``what`` names the argument in error messages) to a ``Buf``."""
    if type(x) is np.ndarray:  # the common case first
        return _host(x, x, what)
    if isinstance(x, Buf):
        return x
    try:
        return _as_buf(x, what)
    except (ValueError, TypeError):
        raise
    except Exception as e:  # noqa: BLE001 - the object's own protocol failed (a KeyError
        # from a malformed interface, ...): the caller's bad input, said as such (and
        # announced to the peers as every rejection is), not a bare error of the object's
        raise TypeError(f"{what}: {type(x).__name__} cannot be taken as an array: its "
                        f"{type(e).__name__}: {e}") from e


def _as_buf(x: Any, what: str) -> Buf:
    if isinstance(x, np.ndarray):   # a subclass (memmap, recarray, matrix): its memory
        if isinstance(x, np.ma.MaskedArray):   # (the compiled paths take plain arrays)
            raise TypeError(f"{what}: a masked array: its mask would be ignored; pass "
                            f"x.filled(value) (masked elements replaced) or x.data")
        return _host(x.view(np.ndarray), x, what)
    # (torch's lazy views: the storage holds the values negated or unconjugated, which
    # __cuda_array_interface__ (and for is_neg DLPack too) would hand over as they are)
    is_neg = getattr(x, "is_neg", None)
    if is_neg is not None and callable(is_neg) and is_neg():
        raise TypeError(f"{what}: this tensor is a lazily negated view (is_neg(): e.g. "
                        f"z.conj().imag); call .resolve_neg() first")
    is_conj = getattr(x, "is_conj", None)
    if is_conj is not None and callable(is_conj) and is_conj():
        raise TypeError(f"{what}: this tensor is a lazily conjugated view (is_conj(): "
                        f"z.conj()); call .resolve_conj() first")
    try:
        cai = getattr(x, "__cuda_array_interface__", None)
    except (RuntimeError, AttributeError, TypeError, KeyError):
        # e.g. a torch tensor that requires grad; torch < 2.5 looks bfloat16 and bool up
        # in a table without them (KeyError): DLPack below
        cai = None
    if cai is not None:
        return _cuda(cai, x, what)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        try:
            dev_type, dev_id = x.__dlpack_device__()
        except Exception as e:  # noqa: BLE001 - e.g. torch's meta or nested tensors
            raise TypeError(f"{what}: {_dlpack_what(x)} cannot be exported through DLPack: "
                            f"{e}") from None
        if int(dev_type) in (_DL_CPU, _DL_CUDA_HOST):
            try:
                arr = np.from_dlpack(x)
            except Exception as e:  # noqa: BLE001 - BufferError, TypeError, RuntimeError, ...
                arr = _torch_bfloat16(x)
                if arr is None:
                    # (the list of dtypes only where the dtype is the trouble, not for a
                    # tensor that requires grad or is sparse)
                    names = _names(_SUPPORTED)
                    dt = str(getattr(x, "dtype", "")).removeprefix("torch.")
                    more = "" if dt in names.split(", ") else f" (supported dtypes: {names})"
                    raise TypeError(f"{what}: cannot view {_dlpack_what(x)} through DLPack: "
                                    f"{type(e).__name__}: {e}{more}") from e
            return _host(arr, x, what)
        if int(dev_type) in (_DL_CUDA, _DL_CUDA_MANAGED):
            try:   # a CUDA DLPack tensor without __cuda_array_interface__: view it in CuPy
                import cupy
                view = cupy.from_dlpack(x)
            except Exception as e:  # noqa: BLE001 - no CuPy, or an unviewable tensor
                raise TypeError(f"{what}: a CUDA DLPack tensor ({type(x).__name__}) without "
                                f"__cuda_array_interface__ needs CuPy to be viewed: {e}") from None
            b = _cuda(view.__cuda_array_interface__, x, what)
            b.owner = x
            if (type(x).__module__ or "").startswith("torch"):
                # (torch < 2.5's bfloat16 and bool: the view's stream is CuPy's current one,
                # which from_dlpack ordered after PyTorch's; but the caller's next kernels
                # run on PyTorch's current stream, where the call must end: as for a
                # tensor seen through its __cuda_array_interface__, which has no stream)
                b.stream = None
            return b
        raise TypeError(f"{what}: DLPack device type {dev_type} is not supported")
    try:
        mv = memoryview(x)
    except TypeError:
        hint = ""
        if type(x).__name__ == "Op" or (isinstance(x, str) and x.lower() in _OP_NAMES):
            hint = f"; {x!r} is a reduction op: pass it as op=, by keyword"
        raise TypeError(f"{what}: {type(x).__name__} is not an array (it has neither the "
                        f"buffer protocol, __dlpack__ nor __cuda_array_interface__){hint}") \
            from None
    try:
        arr = np.asarray(mv)
    except (ValueError, TypeError) as e:
        raise TypeError(f"{what}: buffer format {mv.format!r} is not understood: {e}") from None
    return _host(arr, x, what)


def _dlpack_what(x: Any) -> str:
    """``Tensor (torch.float8_e4m3fn on cpu)``: the type, and its dtype and device where it
    has them (for the messages of a DLPack tensor that cannot be taken)."""
    parts = [str(v) for v in (getattr(x, "dtype", None), getattr(x, "device", None))
             if v is not None]
    return type(x).__name__ + (f" ({' on '.join(parts)})" if parts else "")


def _torch_bfloat16(x: Any) -> np.ndarray | None:
    """A PyTorch bfloat16 CPU tensor as a NumPy bfloat16 view of the same memory (NumPy's
    DLPack import has no bfloat16): through an int16 view of its storage; None for
    anything else."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(x, "dtype", None) is not torch.bfloat16 or \
            getattr(x, "requires_grad", False) or bfloat16() is None:
        return None     # (a tensor that requires grad is refused, as in every other dtype)
    try:
        return np.from_dlpack(x.view(torch.int16)).view(bfloat16())
    except (BufferError, TypeError, RuntimeError, ValueError):
        return None


def check_writable(b: Buf, what: str) -> None:
    """``b`` is to be written: refused when read-only; a PyTorch tensor's version counter
    is bumped, as its own in-place operations do (written through a DLPack view or its
    data pointer, autograd did not see it: a backward that had saved the tensor — or the
    tensor it was detached from — used the overwritten values without a word)."""
    if b.readonly:
        raise ValueError(f"{what} is read-only; the result must be written into it "
                         f"(pass a writable array)")
    owner = b.owner
    if type(owner) is not np.ndarray and owner is not None and \
            (type(owner).__module__ or "").startswith("torch"):
        _bump_version(owner)


def _bump_version(t: Any) -> None:
    try:
        from torch.autograd.graph import increment_version
    except ImportError:         # (a torch without it: nothing to tell)
        return
    increment_version(t)


def empty_like(b: Buf, count: int, shape: tuple[int, ...] | None = None,
               stream: int | None = None) -> tuple[Any, Buf]:
    """A new array of the same kind and dtype as ``b`` with ``count`` elements
    (``shape`` if given): a PyTorch tensor for a PyTorch input (``new_empty``),
    else a NumPy array.  A device array is taken from its pool for ``stream`` (the
    stream of the call that writes it, resolved by the caller): CuPy's and PyTorch's
    pools are stream-ordered, and a block taken for another stream may still be read
    there by kernels of its previous owner, or be handed out there again while this
    call's stream still writes it."""
    shape = shape if shape is not None else (count,)
    if b.kind != "host":   # on the same device, of the same kind (CuPy, torch, ...)
        from . import device
        obj = device.get().empty(shape, b.dtype, b.owner, stream)
        return obj, as_buf(obj, "out")
    new_empty = getattr(b.owner, "new_empty", None)
    if new_empty is not None and not isinstance(b.owner, np.ndarray):
        obj = new_empty(shape)
        return obj, as_buf(obj, "out")
    arr = np.empty(shape, dtype=b.dtype)
    return arr, _host(arr, arr, "out")


def overlaps(a: Buf, b: Buf) -> bool:
    """Do two buffers share any byte?"""
    if a.kind != b.kind or a.nbytes == 0 or b.nbytes == 0:
        return False
    if a.kind == "host":  # contiguous: the bounds test is exact (and done in C)
        return bool(np.may_share_memory(a.array, b.array))
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def same(a: Buf, b: Buf) -> bool:
    """The very same bytes (in place)?"""
    return a is b or (a.kind == b.kind and a.nbytes == b.nbytes and overlaps(a, b)
                      and a.ptr == b.ptr)
