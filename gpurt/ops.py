"""Reduction ops and the dtypes they accept; the host (NumPy) reducer.

An op is dispatched per memory kind: ``reducer(op, dtype, kind)`` returns a function
``f(acc, src, out)`` computing ``out = acc op src`` element-wise on arrays of that kind
(NumPy ufuncs for host memory; device kernels arrive with the GPU transport).
"""

from __future__ import annotations

import enum
from typing import Callable

import numpy as np

try:  # bfloat16 for NumPy
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None


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
_FLOATS = [np.dtype(t) for t in ("float16", "float32", "float64")] + ([BFLOAT16] if BFLOAT16 else [])
_COMPLEX = [np.dtype("complex64"), np.dtype("complex128")]
_BOOL = [np.dtype(bool)]

DTYPES: tuple[np.dtype, ...] = tuple(_BOOL + _INTS + _FLOATS + _COMPLEX)

# which ops make sense for which dtypes
_ALLOWED: dict[Op, tuple[np.dtype, ...]] = {
    Op.SUM: tuple(_INTS + _FLOATS + _COMPLEX),
    Op.PROD: tuple(_INTS + _FLOATS + _COMPLEX),
    Op.AVG: tuple(_FLOATS + _COMPLEX),
    Op.MIN: tuple(_BOOL + _INTS + _FLOATS),
    Op.MAX: tuple(_BOOL + _INTS + _FLOATS),
    Op.BAND: tuple(_BOOL + _INTS),
    Op.BOR: tuple(_BOOL + _INTS),
    Op.BXOR: tuple(_BOOL + _INTS),
}

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


_DTYPE_SET = frozenset(DTYPES)
_ALLOWED_SETS: dict = {}


def check_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_SET:
        names = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"dtype {dtype} is not supported (supported: {names})")
    return dtype


def check_op(op: Op, dtype: np.dtype) -> None:
    """TypeError when ``op`` makes no sense for ``dtype`` (before anything moves)."""
    allowed = _ALLOWED_SETS.get(op)
    if allowed is None:
        allowed = _ALLOWED_SETS[op] = frozenset(_ALLOWED[op])
    if dtype not in allowed:
        ok = ", ".join(str(d) for d in _ALLOWED[op])
        raise TypeError(f"op {op.name} is not defined for dtype {dtype} (it is for: {ok})")


def host_reducer(op: Op) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """``f(acc, src, out)``: out = acc op src, one ufunc call (out may alias acc)."""
    uf = _UFUNC[op]

    def f(acc: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
        uf(acc, src, out=out)

    return f


def host_finalize(op: Op, arr: np.ndarray, nranks: int) -> None:
    """Post-processing after the reduction: AVG divides the sum by the number of ranks."""
    if op is Op.AVG and arr.size:
        np.divide(arr, arr.dtype.type(nranks), out=arr)


_REDUCERS = {"host": host_reducer}


def reducer(op: Op, kind: str = "host"):
    try:
        return _REDUCERS[kind](op)
    except KeyError:
        raise TypeError(f"no reducer for {kind} memory yet") from None
