"""Reduction ops and the dtypes they accept; the host (NumPy) reducer.

An op is dispatched per memory kind: ``reducer(op, dtype, kind)`` returns a function
``f(acc, src, out)`` computing ``out = acc op src`` element-wise on arrays of that kind
(NumPy ufuncs for host memory; device kernels arrive with the GPU transport).
"""

from __future__ import annotations

import enum
import os
import threading
from typing import Callable

import numpy as np


class Op(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"gpurt.{self.name}"

    # members are singletons compared by identity: hash them in C, not through Enum's
    # Python-level __hash__ (ops are dictionary keys on every call's hot path)
    __hash__ = object.__hash__


SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR = (Op.SUM, Op.PROD, Op.MIN, Op.MAX, Op.AVG,
                                             Op.BAND, Op.BOR, Op.BXOR)

_INTS = [np.dtype(t) for t in ("int8", "int16", "int32", "int64",
                                "uint8", "uint16", "uint32", "uint64")]
_FLOATS = [np.dtype(t) for t in ("float16", "float32", "float64")]
_COMPLEX = [np.dtype("complex64"), np.dtype("complex128")]
_BOOL = [np.dtype(bool)]

# Every dtype by name, in the order of its code on the wire (the shm board's call header):
# the codes must not depend on whether this rank has bfloat16 loaded yet.
DTYPE_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
               "uint64", "float16", "float32", "float64", "bfloat16", "complex64", "complex128")

# bfloat16 is ml_dtypes' NumPy dtype.  ml_dtypes is imported only once a bfloat16 array is
# seen (or a bfloat16 dtype asked for): importing it takes 1.3 s of CPU with ml_dtypes 0.7
# (0.14 s with 0.5), which every rank of every job paid at ``import gpurt`` before.  A host
# array can only have that dtype once ml_dtypes is imported, so nothing is missed; until
# then the tables below hold the other dtypes, and ``_load_bfloat16`` adds it to them in
# place (they are shared by reference with comm.py and buffers.py).
_bf16: np.dtype | None = None     # ml_dtypes.bfloat16 once loaded
_bf16_tried = False
_bf16_lock = threading.Lock()
if hasattr(os, "register_at_fork"):   # (a fork while another thread imports holds it)
    os.register_at_fork(after_in_child=lambda: globals().update(_bf16_lock=threading.Lock()))


def _allowed_of(bf16: list) -> dict:
    floats = _FLOATS + bf16
    return {
        Op.SUM: tuple(_INTS + floats + _COMPLEX),
        Op.PROD: tuple(_INTS + floats + _COMPLEX),
        Op.AVG: tuple(floats + _COMPLEX),
        Op.MIN: tuple(_BOOL + _INTS + floats),
        Op.MAX: tuple(_BOOL + _INTS + floats),
        Op.BAND: tuple(_BOOL + _INTS),
        Op.BOR: tuple(_BOOL + _INTS),
        Op.BXOR: tuple(_BOOL + _INTS),
    }


# which ops make sense for which dtypes (as sets: checked on every call)
_ALLOWED_SETS: dict[Op, set] = {o: set(ds) for o, ds in _allowed_of([]).items()}
_SUPPORTED: set = set(_BOOL + _INTS + _FLOATS + _COMPLEX)
# dtype -> its code on the wire (DTYPE_NAMES' index)
DTYPE_CODE: dict = {d: DTYPE_NAMES.index(d.name) for d in _SUPPORTED}
# (op as the user passes it: Op, its value or its name; dtype) -> Op, for the valid pairs:
# the fast path's whole argument check of op x dtype is one dict lookup
FAST_OPS: dict = {}


def _add_fast_ops(dtypes) -> None:
    for o, allowed in _ALLOWED_SETS.items():
        for d in dtypes:
            if d in allowed:
                FAST_OPS[(o, d)] = FAST_OPS[(o.value, d)] = FAST_OPS[(o.name, d)] = o


_add_fast_ops(_SUPPORTED)


def _load_bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16 (imported now if it was not), added to every table above;
    None when ml_dtypes is not installed."""
    global _bf16, _bf16_tried
    with _bf16_lock:        # (two threads' first bfloat16 calls: both see it loaded)
        if _bf16 is None and not _bf16_tried:
            _bf16_tried = True
            try:
                import ml_dtypes
            except ImportError:  # pragma: no cover - ml_dtypes is a dependency
                return None
            d = np.dtype(ml_dtypes.bfloat16)
            for o, ds in _allowed_of([d]).items():
                if d in ds:
                    _ALLOWED_SETS[o].add(d)
            DTYPE_CODE[d] = DTYPE_NAMES.index("bfloat16")
            _add_fast_ops([d])
            _bf16 = d              # (is_bfloat16 true before supported: see there)
            _SUPPORTED.add(d)      # last: a dtype in _SUPPORTED has every table filled in
    return _bf16


def bfloat16() -> np.dtype | None:
    """NumPy's bfloat16 dtype (``ml_dtypes.bfloat16``; imports ml_dtypes), or None when
    ml_dtypes is not installed."""
    return _bf16 if _bf16 is not None else _load_bfloat16()


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is bfloat16 (a dtype of that name, seen for the first time, loads
    it: the user may have imported ml_dtypes before gpurt saw any; other dtypes cost a
    name compare)."""
    if _bf16 is not None:
        return dtype == _bf16
    return getattr(dtype, "name", None) == "bfloat16" and _load_bfloat16() == dtype


def supported(dtype: np.dtype) -> bool:
    """Whether gpurt moves and reduces ``dtype`` (a bfloat16 seen for the first time loads
    it into the tables)."""
    return dtype in _SUPPORTED or (getattr(dtype, "name", None) == "bfloat16" and
                                   _load_bfloat16() == dtype)


def _names(allowed: set) -> str:
    """The names of the dtypes in ``allowed`` (bfloat16 with the other floats, where
    ml_dtypes is installed), for error messages: without importing ml_dtypes."""
    global _bf16_installed
    if _bf16_installed is None:
        import importlib.util
        _bf16_installed = importlib.util.find_spec("ml_dtypes") is not None
    return ", ".join(n for n in DTYPE_NAMES if (
        np.dtype(n) in allowed if n != "bfloat16" else
        _bf16_installed and np.dtype(np.float32) in allowed))


_bf16_installed: bool | None = None


def all_dtypes() -> tuple[np.dtype, ...]:
    """Every supported dtype, bfloat16 included where ml_dtypes is installed (imports it)."""
    bfloat16()
    return tuple(np.dtype(n) if n != "bfloat16" else _bf16 for n in DTYPE_NAMES
                 if n != "bfloat16" or _bf16 is not None)


def __getattr__(name: str):
    """``DTYPES``, ``BFLOAT16`` and ``_ALLOWED`` (every dtype, bfloat16 included) for code
    that lists them: reading one imports ml_dtypes, which gpurt itself avoids until a
    bfloat16 array comes."""
    if name == "DTYPES":
        return all_dtypes()
    if name == "BFLOAT16":
        return bfloat16()
    if name == "_ALLOWED":
        return _allowed_of([bfloat16()] if bfloat16() is not None else [])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# AVG reduces with SUM and scales once at the end
_UFUNC: dict[Op, np.ufunc] = {
    Op.SUM: np.add, Op.AVG: np.add, Op.PROD: np.multiply, Op.MIN: np.minimum,
    Op.MAX: np.maximum, Op.BAND: np.bitwise_and, Op.BOR: np.bitwise_or, Op.BXOR: np.bitwise_xor,
}


def as_op(op: "Op | str") -> Op:
    """``gpurt.SUM`` or ``"sum"`` -> Op.SUM; anything else is a ValueError."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        try:
            return Op(op.lower())
        except ValueError:
            pass
    names = ", ".join(o.name for o in Op)
    raise ValueError(f"unknown reduction op {op!r} (use one of {names}, or lower-case strings)")


def check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if not supported(dtype):
        raise TypeError(f"dtype {dtype} is not supported (supported: {_names(_SUPPORTED)})")
    return dtype


def check_op(op: Op, dtype: np.dtype) -> None:
    """TypeError when ``op`` makes no sense for ``dtype`` (before anything moves)."""
    if dtype not in _ALLOWED_SETS[op]:
        dtype = np.dtype(dtype)
        if not (supported(dtype) and dtype in _ALLOWED_SETS[op]):
            raise TypeError(f"op {op.name} is not defined for dtype {dtype} (it is for: "
                            f"{_names(_ALLOWED_SETS[op])})")


def host_reducer(op: Op) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """``f(acc, src, out)``: out = acc op src, one ufunc call (out may alias acc).  Floats
    (and bfloat16, whose NumPy kind is 'V') overflow to inf and make NaN without a NumPy
    warning, as the compiled kernels and MPI do (a warning for float16 but not float32
    said nothing about the data).  ``f.raw``: the ufunc itself, for a caller that reduces
    several blocks in a row inside one ``np.errstate(all="ignore")`` (~1 µs each saved)."""
    uf = _UFUNC[op]

    def f(acc: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
        if acc.dtype.kind in "iub":         # (integers wrap without a warning)
            uf(acc, src, out=out)
        else:
            with np.errstate(all="ignore"):
                uf(acc, src, out=out)

    f.raw = uf

    return f


def host_finalize(op: Op, arr: np.ndarray, nranks: int) -> None:
    """Post-processing after the reduction: AVG divides the sum by the number of ranks."""
    if op is Op.AVG and arr.size:
        if arr.dtype.kind == "c":   # (complex ÷ complex is not correctly rounded: 1 ulp
            arr = arr.view(arr.real.dtype)  # off; each part ÷ the real count is)
        np.divide(arr, arr.dtype.type(nranks), out=arr)


_REDUCERS = {"host": host_reducer}


def reducer(op: Op, kind: str = "host"):
    try:
        return _REDUCERS[kind](op)
    except KeyError:
        raise TypeError(f"no reducer for {kind} memory yet") from None
