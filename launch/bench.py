"""``gpurt bench``: nccl-tests-style sweeps of one collective, with MPI and gloo baselines.

Two halves live here:

* the *parent* (``bench_command``, the click command wired into ``gpurt``): parses the
  options, computes the sizes, starts one ``mpiexec -n N python -m gpurt.launch.bench``
  per library and repeat (gpurt, then each baseline, alternating), combines what they
  report, prints the table and writes the JSON / PNG.  Run under an MPI launcher with more
  than one rank, it runs the gpurt sweep in place instead (no baselines then).
* the *worker* (``worker``, ``python -m gpurt.launch.bench CONFIG.json``): runs on every
  rank, times the sweep through one library, checks results (``-c``) and has rank 0
  write a JSON result file.

Method (nccl-tests'): per size, ``warmup`` untimed calls, one MPI barrier, then ``iters``
calls each timed with ``perf_counter`` on every rank, without checking.  The time of an
iteration is the maximum over ranks; a size's time is the median (p50) of those, with p99
and the mean beside it.  ``-c`` runs a *separate* checked call per size on exact inputs
(small integers) and counts wrong elements over all ranks.  docs/bench.md explains the
columns and the formulas (bus bandwidth factors, the memory ceiling).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from time import perf_counter
from typing import Callable

import click
import numpy as np

COLLECTIVES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
               "gather", "scatter", "barrier", "sendrecv")
# collectives whose size S is the whole buffer of nranks blocks (nccl-tests' convention)
BLOCKED = ("allgather", "reduce_scatter", "alltoall", "gather", "scatter")
REDUCING = ("allreduce", "reduce", "reduce_scatter")
ROOTED = ("reduce", "broadcast", "gather", "scatter")
OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "complex64", "complex128", "bool")
BASELINES = ("mpi", "gloo", "nocheck")
#: dtypes torch.distributed's gloo backend refuses ("Invalid scalar type"; torch 2.x)
_GLOO_NO_DTYPES = ("int16", "uint16", "uint32", "uint64")
#: blocks per size when two libraries are timed in the same run (gpurt and nocheck)
_BLOCKS = 8
#: ranks `gpurt bench` launches without -n (and outside an MPI launch)
DEFAULT_NRANKS = 2


# ---------------------------------------------------------------------------------------
# pure helpers: sizes, layouts, bandwidth formulas
# ---------------------------------------------------------------------------------------

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """``8``, ``64K``, ``256M``, ``1G`` (binary multiples, as nccl-tests; ``KB``/``KiB``
    and a trailing ``B`` are accepted) -> bytes.  A fraction is fine where the bytes come
    out whole (``1.5K``); ``0.5`` or ``1.3K`` (not a whole number of bytes) and ``inf`` /
    ``nan`` are refused: truncated or converted they became a size of 0 — a sweep that
    never grew — or an OverflowError."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace("IB", "").rstrip("B") or "0"
    unit = t[-1] if t[-1] in "KMGT" else ""
    num = t[:-1] if unit else t
    try:
        val = float(num)
    except ValueError:
        raise ValueError(f"bad size {text!r}: use a number with an optional K, M or G "
                         f"suffix (e.g. 8, 64K, 256M)") from None
    if not math.isfinite(val):
        raise ValueError(f"bad size {text!r}: not a finite number")
    if val < 0:
        raise ValueError(f"bad size {text!r}: negative")
    nbytes = val * _SUFFIX[unit]
    if nbytes != int(nbytes):
        raise ValueError(f"bad size {text!r}: {nbytes:g} bytes is not a whole number")
    return int(nbytes)


def human_size(nbytes: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def parse_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("bfloat16 needs the ml_dtypes package") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def size_unit(coll: str, nranks: int, itemsize: int) -> int:
    """What S must be a multiple of: one element per rank for the blocked collectives."""
    return itemsize * (nranks if coll in BLOCKED else 1)


def sweep_sizes(coll: str, nranks: int, itemsize: int, minbytes: int, maxbytes: int,
                factor: int) -> list[int]:
    """The sizes S of a sweep: minbytes, ×factor, ... up to maxbytes, each rounded down to
    a multiple of ``size_unit`` (a size that rounds to 0 becomes one unit), duplicates
    dropped.  A barrier has a single size, 0."""
    if coll == "barrier":
        return [0]
    if minbytes < 1:      # 0 × factor stays 0: the loop below would never end
        raise ValueError(f"-b {minbytes}: the smallest size must be at least 1 byte")
    if minbytes > maxbytes:
        raise ValueError(f"-b {minbytes} is larger than -e {maxbytes}")
    if factor < 2 and minbytes != maxbytes:
        raise ValueError("-f must be 2 or more (or give -b equal to -e)")
    unit = size_unit(coll, nranks, itemsize)
    out: list[int] = []
    s = minbytes
    while s <= maxbytes:
        r = max(unit, s // unit * unit)
        if r not in out:
            out.append(r)
        if factor < 2:
            break
        s *= factor
    return out


def layout(coll: str, nranks: int, rank: int, nbytes: int, itemsize: int, root: int = 0
           ) -> tuple[int, int, int]:
    """(per-rank count c, elements of the input buffer, elements of the output buffer) of
    ``rank`` for a collective of size S = ``nbytes``."""
    n = nbytes // itemsize
    c = n // nranks if coll in BLOCKED else n
    is_root = rank == root
    nin, nout = {
        "allreduce": (c, c), "reduce": (c, c), "broadcast": (c, 0), "sendrecv": (c, c),
        "allgather": (c, nranks * c), "reduce_scatter": (nranks * c, c),
        "alltoall": (nranks * c, nranks * c),
        "gather": (c, nranks * c if is_root else 0),
        "scatter": (nranks * c if is_root else 0, c),
        "barrier": (0, 0),
    }[coll]
    return c, nin, nout


def busbw_factor(coll: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw × factor (docs/bench.md)."""
    n = nranks
    if coll == "allreduce":
        return 2 * (n - 1) / n
    if coll in ("allgather", "reduce_scatter", "alltoall", "gather", "scatter"):
        return (n - 1) / n   # gather/scatter: nccl-tests' GatherGetBw/ScatterGetBw
    if coll == "barrier":
        return 0.0
    return 1.0  # broadcast, reduce, sendrecv


def min_traffic(coll: str, nranks: int, nbytes: int) -> tuple[int, int]:
    """(R, W): bytes that must be read and written in memory, over all ranks together, by
    any implementation of ``coll`` of size S = ``nbytes``: every input byte the result
    depends on read once, every output byte written once (docs/bench.md)."""
    n, S = nranks, nbytes
    return {
        "allreduce": (n * S, n * S),          # n inputs of S; n outputs of S
        "reduce": (n * S, S),                 # n inputs; the root's output
        "broadcast": (S if n > 1 else 0, (n - 1) * S),  # the root's buffer; n-1 copies (in place)
        "allgather": (S, n * S),              # n blocks of S/n; n outputs of S
        "reduce_scatter": (n * S, S),         # n inputs of S; n outputs of S/n
        "alltoall": (n * S, n * S),
        "gather": (S, S),                     # n blocks of S/n; the root's S
        "scatter": (S, S),
        "sendrecv": (n * S, n * S),           # every rank sends S and receives S
        "barrier": (0, 0),
    }[coll]


def min_bytes_per_rank(coll: str, nranks: int, nbytes: int) -> float:
    """(R + W) / nranks: the least memory traffic per rank when the work is spread evenly."""
    r, w = min_traffic(coll, nranks, nbytes)
    return (r + w) / nranks


def ceiling_busbw(coll: str, nranks: int, ceiling_Bps: float) -> float | None:
    """The bus bandwidth a collective would show if it ran at the memory ceiling (the
    same for every size, since the minimum traffic is proportional to S)."""
    S = 1 << 20
    mb = min_bytes_per_rank(coll, nranks, S)
    if not mb or not ceiling_Bps or coll == "barrier":
        return None
    return busbw_factor(coll, nranks) * S / (mb / ceiling_Bps) / 1e9


# ---------------------------------------------------------------------------------------
# exact inputs and the checker
# ---------------------------------------------------------------------------------------

_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
           "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or,
           "bxor": np.bitwise_xor}


def _exact_limit(dtype: np.dtype) -> int:
    """Largest integer the dtype holds exactly (and without overflow)."""
    if dtype == np.bool_:
        return 1
    if dtype.kind in "iu":
        return int(np.iinfo(dtype).max)
    if dtype.name == "bfloat16":
        return 256
    if dtype == np.float16:
        return 2048
    if dtype in (np.float32, np.complex64):
        return 1 << 24
    return 1 << 53


def _modulus(dtype: np.dtype, op: str | None, nranks: int) -> int:
    """Inputs are (131·q + 7·i + 1) mod M: small enough that every reduction of nranks
    of them is exact in ``dtype`` whatever the order, and M is the pattern's period."""
    if dtype == np.bool_:
        return 6
    lim = _exact_limit(dtype)
    if op is None:
        return min(lim, 4093)
    if op == "prod":
        return 4
    return max(2, min(8, lim // max(nranks, 1)))


def _values(q: int, start: int, length: int, dtype: np.dtype, op: str | None,
            nranks: int, blk: int = 0) -> np.ndarray:
    """Rank q's input elements start..start+length-1 of block ``blk`` (exact small
    integers): (131·q + 7·i + 3·blk + 1) mod M.  The block term tells the blocks of one
    rank apart (a reduce_scatter or alltoall that delivers the wrong block is caught)
    whatever the count; the pattern is periodic in i with period M."""
    i = np.arange(start, start + length, dtype=np.int64)
    m = _modulus(dtype, op, nranks)
    if dtype == np.bool_:
        return ((131 * q + 7 * i + 3 * blk + 1) % m % 2).astype(np.bool_)
    if op == "prod":  # mostly ones, a two where (i + q + blk) % 4 == 0: products stay small
        raw = np.where((i + q + blk) % 4 == 0, 2, 1)
    else:
        raw = (131 * q + 7 * i + 3 * blk + 1) % m
    if dtype.kind in "fc" or dtype.name == "bfloat16":
        return raw.astype(np.float64).astype(dtype)
    return raw.astype(dtype)


def _reduced(start: int, length: int, dtype: np.dtype, op: str, nranks: int, blk: int
             ) -> np.ndarray:
    acc = _values(0, start, length, dtype, op, nranks, blk)
    uf = _UFUNCS[op]
    for q in range(1, nranks):
        acc = uf(acc, _values(q, start, length, dtype, op, nranks, blk)).astype(dtype,
                                                                               copy=False)
    if op == "avg":     # (complex: each part ÷ the real count, correctly rounded, as gpurt)
        v = acc.view(acc.real.dtype) if dtype.kind == "c" else acc
        acc = np.divide(v, v.dtype.type(nranks)).astype(v.dtype, copy=False).view(dtype)
    return acc


def sentinel(dtype: np.dtype):
    """What output buffers hold before a checked call: NaN, or the largest integer (never
    a correct result here).  bool has no spare value (False is used)."""
    if dtype == np.bool_:
        return False
    if dtype.kind in "iu":
        return np.iinfo(dtype).max
    return np.array(np.nan).astype(dtype)[()]


def _segments(coll: str, nranks: int, rank: int, c: int, root: int
              ) -> list[tuple[int, int, str, int, int]]:
    """What ``rank``'s output must hold, as (out offset, length, kind, source rank,
    source offset); kind "copy" (rank q's input) or "red" (reduction over all ranks).
    Empty when this rank's output is not defined (reduce/gather off the root, barrier)."""
    n = nranks
    if coll == "allreduce":
        return [(0, c, "red", -1, 0)]
    if coll == "reduce":
        return [(0, c, "red", -1, 0)] if rank == root else []
    if coll == "reduce_scatter":
        return [(0, c, "red", -1, rank * c)]
    if coll == "broadcast":
        return [(0, c, "copy", root, 0)]
    if coll == "allgather" or (coll == "gather" and rank == root):
        return [(q * c, c, "copy", q, 0) for q in range(n)]
    if coll == "alltoall":
        return [(q * c, c, "copy", q, rank * c) for q in range(n)]
    if coll == "scatter":
        return [(0, c, "copy", root, rank * c)]
    if coll == "sendrecv":
        return [(0, c, "copy", (rank - 1) % n, 0)] if n > 1 else []
    return []


def _stream(kind: str, q: int, start: int, length: int, dtype: np.dtype, op: str | None,
            nranks: int, blk: int) -> np.ndarray:
    if kind == "red":
        return _reduced(start, length, dtype, op or "sum", nranks, blk)
    return _values(q, start, length, dtype, op, nranks, blk)


def count_wrong(got: np.ndarray, want: np.ndarray) -> int:
    """Elements of ``got`` that differ from ``want`` (NaN never equals anything)."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} vs {want.shape}")
    return int(got.size - np.count_nonzero(got == want))


_CHUNK = 1 << 20   # elements per step of the streaming fill and check


def _tiled(dst: np.ndarray, kind: str, q: int, start: int, blk: int, dtype: np.dtype,
           op: str | None, nranks: int, compare: bool) -> int:
    """Write into ``dst`` (or, with ``compare``, count the elements of ``dst`` that differ
    from) the stream's elements start..start+len(dst)-1 of block ``blk``, a chunk at a
    time, from one period-aligned tile: memcpy speed, little memory, even for GiB."""
    size = dst.size
    if size == 0:
        return 0
    period = _modulus(dtype, op, nranks)
    chunk = max(period, _CHUNK // period * period)
    tile = _stream(kind, q, 0, min(size, chunk) + period, dtype, op, nranks, blk)
    wrong = 0
    for k in range(0, size, chunk):
        seg = dst[k:min(size, k + chunk)]
        o = (start + k) % period
        if compare:
            wrong += count_wrong(seg, tile[o:o + seg.size])
        else:
            seg[...] = tile[o:o + seg.size]
    return wrong


def check_output(coll: str, nranks: int, rank: int, c: int, dtype: np.dtype, op: str | None,
                 root: int, out: np.ndarray | None) -> int:
    """Wrong elements of ``rank``'s output of a checked call of per-rank count ``c``
    (every rank's input from ``fill_input(x, q, ..., c)``)."""
    segs = _segments(coll, nranks, rank, c, root)
    if not segs or c == 0:
        return 0
    dtype = np.dtype(dtype)
    op = op if coll in REDUCING else None
    flat = np.asarray(out).reshape(-1)
    if flat.size < max(o + n for o, n, *_ in segs):
        raise ValueError(f"{coll}: output of {flat.size} elements is too short")
    # the pattern is indexed within each block (src is always a block's start): with the
    # global index, block b of a rank was block 0 shifted by b·(7c + 3), a whole period
    # whenever 7c + 3 ≡ 0 (mod M) — every block alike, a wrong block undetectable
    return sum(_tiled(flat[off:off + length], kind, q, src % c, src // c, dtype, op, nranks,
                      True)
               for off, length, kind, q, src in segs)


def expected_output(coll: str, nranks: int, rank: int, c: int, dtype: np.dtype,
                    op: str | None, root: int = 0) -> np.ndarray | None:
    """The whole expected output of ``rank`` (for tests; ``check_output`` streams)."""
    dtype = np.dtype(dtype)
    segs = _segments(coll, nranks, rank, c, root)
    if not segs:
        return None
    op = op if coll in REDUCING else None
    out = np.empty(max(o + n for o, n, *_ in segs), dtype)
    for off, length, kind, q, src in segs:
        out[off:off + length] = _stream(kind, q, src % c if c else 0, length, dtype, op,
                                        nranks, src // c if c else 0)
    return out


def fill_input(x: np.ndarray, rank: int, dtype: np.dtype, op: str | None, nranks: int,
               c: int) -> None:
    """Rank ``rank``'s exact input, in blocks of ``c`` elements (the per-rank count),
    into the whole of ``x``."""
    dtype = np.dtype(dtype)
    if x.size == 0 or c == 0:
        return
    for b, k in enumerate(range(0, x.size, c)):
        _tiled(x[k:k + c], "copy", rank, 0, b, dtype, op, nranks, False)


# ---------------------------------------------------------------------------------------
# the libraries, as seen by the worker
# ---------------------------------------------------------------------------------------

class _Lib:
    """What the sweep needs from a library: rank, size, and a zero-argument call per size
    (returning the algorithm used).  Control (barrier before the loop, gathering the
    timings) goes through mpi4py outside the timed region."""

    name = "?"
    rank = 0
    size = 1
    in_place_reductions = False   # does the call overwrite its input (torch.distributed)?

    def __init__(self) -> None:
        from mpi4py import MPI
        self.MPI = MPI
        self.ctl = MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.ctl.Get_rank(), self.ctl.Get_size()

    def make(self, coll: str, x: np.ndarray, y: np.ndarray, op: str | None, root: int,
             algo: str | None) -> Callable[[], str]:
        raise NotImplementedError

    def explain(self, coll: str, nbytes: int) -> str | None:
        return None

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        self.ctl.Free()


class _GpurtLib(_Lib):
    name = "gpurt"

    def __init__(self) -> None:
        super().__init__()
        import gpurt
        from gpurt.ops import as_op
        self.gpurt, self.as_op = gpurt, as_op
        self.comm = gpurt.init()

    def info(self) -> dict:
        c = self.comm
        return {"gpurt": self.gpurt.__version__, "nodes": c.nnodes,
                "local_size": c.local_size, "check": bool(c._check or c._netcheck),
                "transports": sorted(set(getattr(c, "transport_of", {}).values())),
                "machine": list(c.machine), "spin_us": c.engine.spin * 1e6}

    def explain(self, coll: str, nbytes: int) -> str | None:
        if coll == "sendrecv":
            return None
        try:
            return self.comm.explain(coll, nbytes)
        except Exception as e:  # noqa: BLE001 - informational only
            return f"explain failed: {e}"

    def make(self, coll, x, y, op, root, algo):
        c, r, n = self.comm, self.rank, self.size
        o = self.as_op(op) if op else None
        if coll == "allreduce":
            def call():
                c.allreduce(x, y, o, algo=algo)
                return c.last_algorithm
        elif coll == "reduce":
            def call():
                c.reduce(x, y, o, root, algo=algo)
                return c.last_algorithm
        elif coll == "broadcast":
            def call():
                c.broadcast(x, root, algo=algo)
                return c.last_algorithm
        elif coll == "allgather":
            def call():
                c.allgather(x, y, algo=algo)
                return c.last_algorithm
        elif coll == "reduce_scatter":
            def call():
                c.reduce_scatter(x, y, o, algo=algo)
                return c.last_algorithm
        elif coll == "alltoall":
            def call():
                c.alltoall(x, y, algo=algo)
                return c.last_algorithm
        elif coll == "gather":
            yy = y if r == root else None

            def call():
                c.gather(x, yy, root, algo=algo)
                return c.last_algorithm
        elif coll == "scatter":
            xx = x if r == root else None

            def call():
                c.scatter(xx, y, root, algo=algo)
                return c.last_algorithm
        elif coll == "barrier":
            def call():
                c.barrier(algo=algo)
                return c.last_algorithm
        elif coll == "sendrecv":
            right, left = (r + 1) % n, (r - 1) % n

            def call():
                a = c.irecv(y, left)
                b = c.isend(x, right)
                b.wait(); a.wait()
                return "p2p"
        else:
            raise ValueError(coll)
        return call

    def close(self) -> None:
        self.comm.close()
        super().close()


class _MpiLib(_Lib):
    name = "mpi"

    def __init__(self) -> None:
        super().__init__()
        self.comm = self.MPI.COMM_WORLD.Dup()

    def make(self, coll, x, y, op, root, algo):
        MPI, c, r, n = self.MPI, self.comm, self.rank, self.size
        o = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
             "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR, None: None}[op]
        if x.dtype == np.bool_ and op is not None:
            # MPI_C_BOOL takes only the logical ops (MPI_MAX, MPI_BAND... are erroneous on
            # it); on bools they compute what gpurt's max/min/band/bor/bxor do
            o = {"max": MPI.LOR, "bor": MPI.LOR, "min": MPI.LAND, "band": MPI.LAND,
                 "bxor": MPI.LXOR}[op]
        name = "MPI_" + {"allreduce": "Allreduce", "reduce": "Reduce", "broadcast": "Bcast",
                         "allgather": "Allgather", "reduce_scatter": "Reduce_scatter_block",
                         "alltoall": "Alltoall", "gather": "Gather", "scatter": "Scatter",
                         "barrier": "Barrier", "sendrecv": "Isend/Irecv"}[coll]
        if coll == "allreduce":
            def call():
                c.Allreduce(x, y, o); return name
        elif coll == "reduce":
            yy = y if r == root else None

            def call():
                c.Reduce(x, yy, o, root); return name
        elif coll == "broadcast":
            def call():
                c.Bcast(x, root); return name
        elif coll == "allgather":
            def call():
                c.Allgather(x, y); return name
        elif coll == "reduce_scatter":
            def call():
                c.Reduce_scatter_block(x, y, o); return name
        elif coll == "alltoall":
            def call():
                c.Alltoall(x, y); return name
        elif coll == "gather":
            yy = y if r == root else None

            def call():
                c.Gather(x, yy, root); return name
        elif coll == "scatter":
            xx = x if r == root else None

            def call():
                c.Scatter(xx, y, root); return name
        elif coll == "barrier":
            def call():
                c.Barrier(); return name
        elif coll == "sendrecv":
            right, left = (r + 1) % n, (r - 1) % n
            Waitall = MPI.Request.Waitall

            def call():
                Waitall([c.Irecv(y, left), c.Isend(x, right)]); return name
        else:
            raise ValueError(coll)
        return call

    def close(self) -> None:
        self.comm.Free()
        super().close()


class _GlooLib(_Lib):
    name = "gloo"
    in_place_reductions = True

    def __init__(self) -> None:
        super().__init__()
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)   # one core per rank, like the others
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(self.rank), str(self.size)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from datetime import timedelta
        dist.init_process_group("gloo", init_method="env://", rank=self.rank,
                                world_size=self.size, timeout=timedelta(seconds=120))

    def info(self) -> dict:
        return {"torch": self.torch.__version__}

    def make(self, coll, x, y, op, root, algo):
        dist, torch, r, n = self.dist, self.torch, self.rank, self.size
        R = dist.ReduceOp
        o = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX, "band": R.BAND,
             "bor": R.BOR, "bxor": R.BXOR, None: None}[op]
        tx = torch.from_numpy(x)
        ty = torch.from_numpy(y)
        name = "gloo"
        if coll == "allreduce":   # torch.distributed reduces in place: into x
            def call():
                dist.all_reduce(tx, o); return name
        elif coll == "reduce":
            def call():
                dist.reduce(tx, root, o); return name
        elif coll == "broadcast":
            def call():
                dist.broadcast(tx, root); return name
        elif coll == "allgather":
            def call():
                dist.all_gather_into_tensor(ty, tx); return name
        elif coll == "reduce_scatter":
            def call():
                dist.reduce_scatter_tensor(ty, tx, o); return name
        elif coll == "alltoall":
            def call():
                dist.all_to_all_single(ty, tx); return name
        elif coll == "gather":
            lst = list(ty.chunk(n)) if r == root else None

            def call():
                dist.gather(tx, lst, root); return name
        elif coll == "scatter":
            lst = list(tx.chunk(n)) if r == root else None

            def call():
                dist.scatter(ty, lst, root); return name
        elif coll == "barrier":
            def call():
                dist.barrier(); return name
        elif coll == "sendrecv":
            right, left = (r + 1) % n, (r - 1) % n

            def call():
                a = dist.irecv(ty, left)
                b = dist.isend(tx, right)
                b.wait(); a.wait()
                return name
        else:
            raise ValueError(coll)
        return call

    def close(self) -> None:
        self.dist.destroy_process_group()
        super().close()


class _NoCheckLib(_GpurtLib):
    """gpurt itself with ``GPURT_CHECK=0``: the baseline that prices the agreement check.
    It runs in the same processes as the checked communicator (a second one, created with
    the variable set), the two timed in alternating blocks (``_sweep``)."""

    name = "nocheck"

    def __init__(self) -> None:
        from gpurt import config
        was = os.environ.get("GPURT_CHECK")
        os.environ["GPURT_CHECK"] = "0"
        config.reload()
        try:
            _Lib.__init__(self)
            import gpurt
            from gpurt.ops import as_op
            self.gpurt, self.as_op = gpurt, as_op
            self.comm = gpurt.Communicator(self.MPI.COMM_WORLD)
        finally:
            if was is None:
                os.environ.pop("GPURT_CHECK", None)
            else:
                os.environ["GPURT_CHECK"] = was
            config.reload()


_LIBS = {"gpurt": _GpurtLib, "mpi": _MpiLib, "gloo": _GlooLib, "nocheck": _NoCheckLib}


# ---------------------------------------------------------------------------------------
# the worker
# ---------------------------------------------------------------------------------------

def _quiet_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning (leaves the CPU to whoever works)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def _yielding_barrier(comm) -> None:
    """A barrier that gives its CPU away between polls (``sched_yield``) instead of
    spinning in MPI's progress loop: what follows a timed region, so that a rank done
    with it never takes the CPU from one still timing (with more ranks than cores, that
    rank's last call came out 10-100x too long, and loop/mean/p99 with it).  Not
    ``_quiet_barrier``: ranks that slept there ran the next timed block slower, every
    call of it (3 ranks on 2 cores, 4 KiB allreduce: p50 ~20 us -> ~40 us), where this
    keeps them as before."""
    req = comm.Ibarrier()
    while not req.Test():
        os.sched_yield()


def measure_ceiling(comm, nbytes: int, reps: int = 3) -> dict:
    """Memory bandwidth from ``np.copyto`` of ``nbytes``, counted as bytes read + written
    per second: per rank with every rank copying at once (the ceiling), and rank 0 alone."""
    from mpi4py import MPI
    n = max(1, nbytes // 8)
    src = np.ones(n, np.float64)
    dst = np.zeros(n, np.float64)     # both touched: no page faults in the timed copies
    nb = n * 8
    together = []
    for _ in range(reps):
        comm.Barrier()
        t0 = perf_counter()
        np.copyto(dst, src)
        t = perf_counter() - t0
        _yielding_barrier(comm)  # (not spinning in the allreduce beside a rank that copies)
        together.append(comm.allreduce(t, op=MPI.MAX))
    alone = []
    _quiet_barrier(comm)
    if comm.Get_rank() == 0:
        for _ in range(reps):
            t0 = perf_counter()
            np.copyto(dst, src)
            alone.append(perf_counter() - t0)
    _quiet_barrier(comm)
    alone = comm.bcast(alone, 0)
    del src, dst
    return {"bytes": nb, "reps": reps,
            "per_rank_Bps": 2 * nb / min(together),
            "single_rank_Bps": 2 * nb / min(alone),
            "together_s": together, "alone_s": alone}


MEMORIES = ("host", "shared", "cupy", "torch", "standin")
HOST_MEMORIES = ("host", "shared")


class DeviceIO:
    """Device buffers for the benchmark: CuPy arrays, PyTorch CUDA tensors, or gpurt's
    host-memory stand-in for a GPU (``standin``: tests the device path without a GPU; its
    numbers are not a GPU's)."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "cupy":
            import cupy
            self.cp = cupy
        elif kind == "torch":
            import torch
            if not torch.cuda.is_available():
                raise SystemExit("gpurt bench --memory torch: torch sees no CUDA device")
            self.torch = torch
        elif kind == "standin":
            from gpurt import device_standin
            self.si = device_standin
        else:
            raise ValueError(kind)

    def to_dev(self, a: np.ndarray):
        from gpurt.ops import is_bfloat16
        if self.kind == "cupy":
            if is_bfloat16(a.dtype):
                raise SystemExit("gpurt bench: CuPy has no bfloat16; use --memory torch")
            return self.cp.asarray(a)
        if self.kind == "torch":
            t = self.torch
            if is_bfloat16(a.dtype):
                return t.from_numpy(a.view(np.int16).copy()).view(t.bfloat16).cuda()
            return t.from_numpy(a.copy()).cuda()
        return self.si.asarray(a)

    def to_host(self, d) -> np.ndarray:
        if self.kind == "cupy":
            return self.cp.asnumpy(d)
        if self.kind == "torch":
            t = self.torch
            d = d.cpu()
            if d.dtype == t.bfloat16:
                from gpurt.ops import bfloat16
                return d.view(t.int16).numpy().view(bfloat16())
            return d.numpy()
        return d.get()

    def put(self, d, a: np.ndarray) -> None:
        """Copy host ``a`` into device ``d`` (same size), synchronously."""
        if self.kind == "cupy":
            d.set(a)
        elif self.kind == "torch":
            d.copy_(self.to_dev(a))
        else:
            d.set(a)
        self.sync()

    def sync(self) -> None:
        if self.kind == "cupy":
            self.cp.cuda.get_current_stream().synchronize()
        elif self.kind == "torch":
            self.torch.cuda.synchronize()
        else:
            self.si.StandinBackend.synchronize_stream(self.si.LEGACY)

    def copy(self, dst, src) -> None:
        if self.kind == "cupy":
            self.cp.copyto(dst, src)
        elif self.kind == "torch":
            dst.copy_(src)
        else:
            from gpurt import device
            be = device.get()
            be.copy(be.view(dst.ptr, dst.nbytes, dst), be.view(src.ptr, src.nbytes, src),
                    self.si.LEGACY)


def measure_device_ceiling(comm, io: DeviceIO, nbytes: int, reps: int = 5) -> dict:
    """Device-to-device copy bandwidth of ``nbytes``, bytes read + written per second, per
    rank with every rank copying at once (ranks sharing a GPU share it), and rank 0
    alone: the ceiling for device buffers."""
    from mpi4py import MPI
    n = max(1, nbytes // 8)
    src = io.to_dev(np.ones(n, np.float64))
    dst = io.to_dev(np.zeros(n, np.float64))
    nb = n * 8
    io.copy(dst, src)
    io.sync()
    together, alone = [], []
    for _ in range(reps):
        comm.Barrier()
        t0 = perf_counter()
        io.copy(dst, src)
        io.sync()
        t = perf_counter() - t0
        _yielding_barrier(comm)  # (not spinning in the allreduce beside a rank that copies)
        together.append(comm.allreduce(t, op=MPI.MAX))
    _quiet_barrier(comm)
    if comm.Get_rank() == 0:
        for _ in range(reps):
            t0 = perf_counter()
            io.copy(dst, src)
            io.sync()
            alone.append(perf_counter() - t0)
    _quiet_barrier(comm)
    alone = comm.bcast(alone, 0)
    return {"bytes": nb, "reps": reps, "memory": io.kind,
            "per_rank_Bps": 2 * nb / min(together),
            "single_rank_Bps": 2 * nb / min(alone),
            "together_s": together, "alone_s": alone}


def _stats(t: np.ndarray) -> dict:
    return {"p50_s": float(np.percentile(t, 50)), "p99_s": float(np.percentile(t, 99)),
            "mean_s": float(t.mean()), "min_s": float(t.min()), "max_s": float(t.max())}


def _log(msg: str) -> None:
    """One line to stderr in one write: print's message and newline were two, and the
    lines of ranks writing at once (PYTHONUNBUFFERED=1) ran into each other."""
    try:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass


def worker(cfg: dict) -> dict | None:
    """Run one library's sweep on every rank; rank 0 returns the result, others None.

    ``cfg``: lib, collective, sizes, dtype, op, root, warmup, iters, algo, check,
    ceiling_bytes (0: don't measure), label (progress prefix), memory (host or a device
    kind)."""
    if cfg.get("memory") == "standin":
        os.environ["GPURT_DEVICE_BACKEND"] = "standin"
    libs = [_LIBS[cfg["lib"]]()]
    try:
        if cfg["lib"] == "gpurt" and cfg.get("paired"):
            libs.append(_LIBS[cfg["paired"]]())      # timed alongside, in the same run
        res = _sweep(libs, cfg)
    finally:
        for lib in reversed(libs):
            lib.close()
    if res is None:
        return None
    if len(res) > 1:
        res[0]["paired"] = res[1]
    return res[0]


def _sweep(libs: list[_Lib], cfg: dict) -> list[dict] | None:
    """Every size through every library in ``libs`` (one, or gpurt and its ``nocheck``
    twin); with several, each size's iterations run in blocks that alternate between
    them (the order turning every block), so slow phases of a shared machine fall on
    both alike.  Rank 0 returns one result per library."""
    lib = libs[0]
    coll, root = cfg["collective"], int(cfg.get("root", 0))
    dtype = parse_dtype(cfg["dtype"])
    op = cfg["op"] if coll in REDUCING else None
    it = dtype.itemsize
    r, n, ctl = lib.rank, lib.size, lib.ctl
    if coll == "sendrecv" and n < 2:
        raise SystemExit("gpurt bench: sendrecv needs 2 ranks or more")
    if coll in ROOTED and root >= n:    # (a collective without a root ignores -r)
        raise SystemExit(f"gpurt bench: root {root} is not a rank of {n}")
    label = cfg.get("label", lib.name)
    t_start = time.time()
    memory = cfg.get("memory", "host")
    io = DeviceIO(memory) if memory not in HOST_MEMORIES else None
    ceiling = None
    if cfg.get("ceiling_bytes"):
        ceiling = measure_ceiling(ctl, int(cfg["ceiling_bytes"])) if io is None else \
            measure_device_ceiling(ctl, io, int(cfg["ceiling_bytes"]))
        if r == 0:
            what = "memory" if io is None else f"device copy ({memory})"
            _log(f"[{label}] {what} ceiling: {ceiling['per_rank_Bps'] / 1e9:.2f} GB/s per "
                 f"rank with {n} copying at once, {ceiling['single_rank_Bps'] / 1e9:.2f} "
                 f"GB/s alone")
    sizes = [int(s) for s in cfg["sizes"]]
    lays = [layout(coll, n, r, S, it, root) for S in sizes]
    alloc = np.empty
    if memory == "shared" and lib.name in ("gpurt", "nocheck"):
        # gpurt's buffers from gpurt.empty (comm.empty); the baselines keep NumPy's,
        # their best: they cannot use shared arrays, and NumPy's large allocations get
        # transparent huge pages where memfd memory (shmem) usually does not
        from gpurt import sharedmem
        alloc = sharedmem.empty
    x = alloc(max([l[1] for l in lays] + [0]), dtype)
    y = alloc(max([l[2] for l in lays] + [0]), dtype)
    fill_input(x, r, dtype, op, n, max([l[0] for l in lays] + [0]))
    y.fill(sentinel(dtype))
    xd = yd = None
    if io is not None:        # device copies of the same inputs; timed with a stream sync
        xd, yd = io.to_dev(x), io.to_dev(y)
        io.sync()
    rows: list[list[dict]] = [[] for _ in libs]
    blocks = 1 if len(libs) == 1 else max(1, min(int(cfg["iters"]), _BLOCKS))
    for S, (c, nin, nout) in zip(sizes, lays):
        xv, yv = x[:nin], y[:nout]
        if io is None:
            calls = [lb.make(coll, xv, yv, op, root, cfg.get("algo")) for lb in libs]
        else:
            xdv, ydv = xd[:nin], yd[:nout]

            def synced(dcall):
                def call():
                    a = dcall()
                    io.sync()      # the result is ready on the stream: count that too
                    return a
                return call

            calls = [synced(lb.make(coll, xdv, ydv, op, root, cfg.get("algo")))
                     for lb in libs]
        for call in calls:
            for _ in range(int(cfg["warmup"])):
                call()
        iters = int(cfg["iters"])
        times = [np.empty(iters) for _ in libs]
        algos: list[list[str]] = [[] for _ in libs]
        cuts = [iters * b // blocks for b in range(blocks + 1)]
        for b in range(blocks):
            for k in [(b + j) % len(libs) for j in range(len(libs))]:
                call, tk, ak = calls[k], times[k], algos[k]
                ctl.Barrier()
                for i in range(cuts[b], cuts[b + 1]):
                    t0 = perf_counter()
                    a = call()
                    tk[i] = perf_counter() - t0
                    ak.append(a)
                # before the next block's Barrier or the gathers below: a rank done with
                # its loop spun there in MPI's progress loop and, with more ranks than
                # cores, took the CPU from a rank still in its last timed call (which
                # yields rather than spins then) — the same for every library timed here
                _yielding_barrier(ctl)
        for k, lb in enumerate(libs):
            every = ctl.gather(times[k], 0)
            wrong = None
            if cfg.get("check") and coll != "barrier":
                # a separate pass on exact inputs; outputs preset to a sentinel (a barrier
                # has no output: nothing to check, #wrong stays n/a rather than a 0 that
                # would claim a check)
                if coll == "broadcast" and r != root:
                    xv.fill(sentinel(dtype))
                else:
                    fill_input(xv, r, dtype, op, n, c)
                yv.fill(sentinel(dtype))
                if io is not None:
                    io.put(xdv, xv)
                    io.put(ydv, yv)
                ctl.Barrier()
                calls[k]()
                out = xv if coll == "broadcast" or (lb.in_place_reductions and
                                                    coll in ("allreduce", "reduce")) else yv
                if io is not None:
                    out = io.to_host(xdv if out is xv else ydv)
                wrong = ctl.reduce(check_output(coll, n, r, c, dtype, op, root, out), root=0)
                if coll == "broadcast" and r != root:
                    fill_input(xv, r, dtype, op, n, c)
                    if io is not None:
                        io.put(xdv, xv)
            if r == 0:
                per_iter = np.max(np.vstack(every), axis=0)
                st = _stats(per_iter)
                means = [float(np.mean(t)) for t in every]
                row = {"size": S, "count": S // it if it else 0, "per_rank_count": c, **st,
                       "iter_max_s": per_iter.tolist(), "rank_mean_s": means,
                       # nccl-tests' time: the timed loop / iterations (the slowest rank's)
                       "loop_s": max(means),
                       "wrong": wrong, "algo": "/".join(sorted(set(algos[k]))) or "-"}
                ex = lb.explain(coll, S)
                if ex:
                    row["explain"] = ex
                rows[k].append(row)
                bw = S / st["p50_s"] / 1e9 * busbw_factor(coll, n) if st["p50_s"] > 0 \
                    and S else None
                tag = label if k == 0 else f"{label} +{lb.name}"
                _log(f"[{tag}] {coll} {S:>12} B  p50 {st['p50_s'] * 1e6:10.1f} us  "
                     f"busbw {_f(bw, '.3f', 8)} GB/s  "
                     f"#wrong {'n/a' if wrong is None else wrong}  {row['algo']}")
    if r != 0:
        return None
    from mpi4py import MPI
    mpi = " ".join(MPI.Get_library_version().split("\n")[0].split())
    wall = time.time() - t_start
    return [{"lib": lb.name, "nranks": n, "rows": rows[k], "ceiling": ceiling if k == 0 else
             None, "info": {"mpi_library": mpi, **lb.info()}, "wall_s": wall,
             **({"paired_blocks": blocks} if len(libs) > 1 else {})}
            for k, lb in enumerate(libs)]


def _worker_main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gpurt.launch.bench CONFIG.json (started by `gpurt bench`)",
              file=sys.stderr)
        return 2
    cfg = json.loads(Path(argv[0]).read_text())
    try:
        res = worker(cfg)
    except ImportError as e:
        res = {"lib": cfg["lib"], "skipped": f"{cfg['lib']}: cannot import {e.name or e}"}
        # every rank fails the same way: rank 0 reports
        if launcher_rank() != 0:
            return 0
    except Exception as e:  # noqa: BLE001 - one clear line, then take the job down
        _fail(cfg, e)
        return 1
    if res is not None:
        Path(cfg["result"]).write_text(json.dumps(res))
    return 0


def _fail(cfg: dict, e: BaseException, together: float = 2.0) -> None:
    """Say what went wrong (a traceback only for what looks like a bug), then end this
    rank: where every rank fails within ``together`` seconds (the same bad argument on
    all, or a failure gpurt told every peer of) they all return and MPI ends normally —
    aborting left MPICH's shared-memory segment in /dev/shm each time; else abort the
    launch, since the other ranks may be waiting in a collective for this one."""
    from gpurt.errors import GpurtError
    if isinstance(e, (ValueError, TypeError, GpurtError)):
        _log(f"gpurt bench: {cfg['lib']} on rank {launcher_rank()}: "
             f"{type(e).__name__}: {e}")
    elif isinstance(e, MemoryError):
        _log(f"gpurt bench: {cfg['lib']} on rank {launcher_rank()}: cannot allocate the "
             f"buffers of a size of the sweep ({e or 'MemoryError'}): a smaller -e, or "
             f"fewer ranks on this host")
    else:
        import traceback
        _log(f"gpurt bench: {cfg['lib']} on rank {launcher_rank()} failed:\n"
             + "".join(traceback.format_exception(e)))
    try:
        from mpi4py import MPI
    except Exception:  # noqa: BLE001 - no MPI: nobody to wait for
        return
    if MPI.Is_finalized() or not MPI.Is_initialized():
        return          # MPI has ended (or never began) in this process: no peers to tell
    try:
        req = MPI.COMM_WORLD.Ibarrier()
        deadline = time.monotonic() + together
        while not req.Test():
            if time.monotonic() > deadline:
                MPI.COMM_WORLD.Abort(1)
            time.sleep(0.005)
    except Exception:  # noqa: BLE001 - the barrier failed: the others may wait for us
        try:
            MPI.COMM_WORLD.Abort(1)
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------------------
# the parent: launches, combining, output
# ---------------------------------------------------------------------------------------

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK")


def launcher_size(env: dict | None = None) -> int:
    """Ranks of the MPI launch this process is part of (1 when not under a launcher)."""
    env = os.environ if env is None else env
    for k in _SIZE_VARS:
        if env.get(k, "").isdigit():
            return int(env[k])
    if any(k in env for k in _RANK_VARS):
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_size()
    return 1


def launcher_rank(env: dict | None = None) -> int:
    env = os.environ if env is None else env
    for k in _RANK_VARS:
        if env.get(k, "").isdigit():
            return int(env[k])
    return 0


def launch_command(nranks: int, program: list[str]) -> list[str]:
    """``program`` on ``nranks`` ranks, as `gpurt launch` would start it: srun inside a
    Slurm job (on the allocation's nodes, as hydra's mpiexec would place them there too),
    else $GPURT_MPIEXEC (may carry flags), else the mpiexec beside this Python, else
    PATH's, with the flags its kind needs (Open MPI as root or with more ranks than
    cores: launcher.build_command)."""
    from gpurt.launch.launcher import LaunchError, build_command, find_launcher
    try:
        return build_command(find_launcher(), nranks, program)
    except LaunchError as e:
        raise click.ClickException(str(e)) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stopped(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached `gpurt bench` while it launched (``_stop_on_signals``).
    (A BaseException: no ``except Exception`` on its way out swallows it.)"""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """What ``_stop_on_signals`` caught: the first signal, and whether it is held for now."""
    got: list[int] = []
    held = False


@contextlib.contextmanager
def _stop_on_signals():
    """While the launches run, SIGINT, SIGTERM and SIGHUP raise _Stopped: ``_launch`` stops the
    running job on its way out, as `gpurt launch` does, ``run_bench`` removes its
    directory, and ``bench_command`` exits 128 + N.  (SIGTERM's default action ended this
    process alone: mpiexec and the ranks ran on, orphaned, beside the directory and
    MPICH's segment.)  A second signal while the first is handled is ignored: the
    stopping runs to its end.  While a launch starts (``_run_launch``) a signal is held,
    then raised once the launch can be stopped."""
    _Signals.got, _Signals.held = [], False

    def on_signal(signum, _frame) -> None:
        if not _Signals.got:
            _Signals.got.append(signum)
            if not _Signals.held:
                raise _Stopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield       # (signal handlers are the main thread's to set)
        return
    old = {s: signal.signal(s, on_signal)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}   # (HUP: a closed terminal)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _Signals.got, _Signals.held = [], False


def _run_launch(cmd: list[str], env: dict, token: str, shm_before: set[str]) -> int:
    """Start ``cmd`` (``_start``), wait for it and return its status; on any way out before
    it ended (``_Stopped``, an error) stop the launch (``_stop_launch``: ``token`` names its
    processes, ``shm_before`` the MPI segments that were there before it).  A signal that
    comes while the launcher starts is held until ``proc`` is known (raised inside Popen,
    or before the assignment, it left the launch running with no one to stop it)."""
    proc = None
    try:
        _Signals.held = True
        try:
            proc = _start(cmd, env)
        except BaseException:
            if _Signals.got:        # (a signal held, then a launcher that cannot start)
                raise _Stopped(_Signals.got[0]) from None
            raise
        finally:
            _Signals.held = False
        if _Signals.got:
            raise _Stopped(_Signals.got[0])
        return proc.wait()
    except BaseException:     # (_Stopped: SIGINT/SIGTERM; anything else stops it too)
        if proc is not None:
            _stop_launch(proc, token, shm_before)
        raise


def _start(cmd: list[str], env: dict) -> subprocess.Popen:
    """``cmd`` (the launcher) started as `gpurt launch` starts it: in a session of its
    own, so that its process group is the job's to stop (``_stop_launch``) and a Ctrl-C
    at the terminal reaches the job through ``_stop_on_signals`` only; with SIGTERM when
    this process dies (even by SIGKILL: hydra then ends the ranks); and one line, not a
    traceback, when it cannot be started (a bad $GPURT_MPIEXEC)."""
    from gpurt.launch.launcher import _set_pdeathsig, quote
    me = os.getpid()

    def orphan_guard() -> None:          # (in the child, before the exec)
        _set_pdeathsig(signal.SIGTERM)
        if os.getppid() != me:           # (this process already gone before the prctl)
            os._exit(1)

    try:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                stderr=sys.stderr, start_new_session=True,
                                preexec_fn=orphan_guard)
    except OSError as e:
        raise click.ClickException(f"cannot start {quote(cmd)}: {e}") from None


def _job_processes(token: str) -> dict[int, set[str]]:
    """This host's processes whose command line holds ``token`` (a launch's config file:
    mpiexec and its ranks), each with the MPI library's /dev/shm segments it maps."""
    from gpurt.launch.launcher import _mapped_mpi_segments
    out: dict[int, set[str]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:   # (empty for a zombie)
                if token.encode() not in f.read():
                    continue
        except OSError:
            continue
        out[pid] = _mapped_mpi_segments(pid)
    return out


def _stop_launch(proc: subprocess.Popen, token: str, shm_before: set[str]) -> None:
    """Stop a running launch as `gpurt launch` stops its job (launcher._stop: a signal to
    the launcher, which passes it on to every rank, then SIGTERM, then SIGKILL to its
    process group); then end any rank still here (hydra runs each in a session of its
    own, out of that group's reach), and remove the MPI library's segments that the
    ranks mapped and nothing maps any more (``launcher._remove_segments``, as `gpurt
    launch` does): ranks ended by a signal never unlink MPICH's.  The first
    signal is SIGTERM, for a Ctrl-C too: the ranks run our worker, not a user's program
    that may want its SIGINT, and a SIGINT had each print a KeyboardInterrupt traceback."""
    from gpurt.launch.launcher import STOP_GRACE, _group_alive, _remove_segments, _stop
    ranks = _job_processes(token)        # (while they run: the segments they map)
    segments = {s for segs in ranks.values() for s in segs} - shm_before
    _stop(proc, proc.pid, signal.SIGTERM)
    if _group_alive(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for last in (False, True):      # a grace, then SIGKILL and another (bounded: no hang)
        deadline = time.monotonic() + STOP_GRACE
        while (left := _job_processes(token)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not left or last:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _remove_segments(segments)


def _launch(cfg: dict, nranks: int, tmp: Path, tag: str) -> dict:
    from gpurt.launch.launcher import _mpi_shm_files
    cfg = dict(cfg, result=str(tmp / f"{tag}.result.json"))
    cpath = tmp / f"{tag}.config.json"
    cpath.write_text(json.dumps(cfg))
    env = dict(os.environ)
    if cfg["lib"] == "gloo":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cmd = launch_command(nranks, [sys.executable, "-m", "gpurt.launch.bench", str(cpath)])
    rc = _run_launch(cmd, env, str(cpath), set(_mpi_shm_files()))
    res_path = Path(cfg["result"])
    if rc != 0 or not res_path.exists():
        raise click.ClickException(f"the {cfg['lib']} run failed (exit {rc}): "
                                   f"{' '.join(shlex.quote(c) for c in cmd)}")
    return json.loads(res_path.read_text())


def _machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    from gpurt._version import __version__
    return {"hostname": socket.gethostname(), "cpu": cpu, "cpus": os.cpu_count(),
            "memory_bytes": mem, "system": f"{platform.system()} {platform.release()}",
            "machine": platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "gpurt": __version__}


def _median(vals: list[float]) -> float:
    return float(np.median(vals)) if vals else float("nan")


def combine(coll: str, nranks: int, launches: list[dict], ceiling_Bps: float | None
            ) -> list[dict]:
    """One row per size from several launches (repeats) of one library: the median over
    repeats of p50, p99 and mean; bandwidths from the combined p50; #wrong summed."""
    out = []
    for i, first in enumerate(launches[0]["rows"]):
        rows = [L["rows"][i] for L in launches]
        S = first["size"]
        p50 = _median([r["p50_s"] for r in rows])
        algbw = S / p50 / 1e9 if p50 > 0 and S else None
        busbw = algbw * busbw_factor(coll, nranks) if algbw is not None else None
        mb = min_bytes_per_rank(coll, nranks, S)
        frac = (mb / p50 / ceiling_Bps) if ceiling_Bps and mb and p50 > 0 else None
        wrong = None if any(r["wrong"] is None for r in rows) else sum(r["wrong"] for r in rows)
        algos = sorted({a for r in rows for a in r["algo"].split("/")})
        out.append({"size": S, "count": first["count"], "p50_s": p50,
                    "p99_s": _median([r["p99_s"] for r in rows]),
                    "mean_s": _median([r["mean_s"] for r in rows]),
                    "loop_s": _median([r["loop_s"] for r in rows]),
                    "algbw_GBps": algbw, "busbw_GBps": busbw, "min_bytes_per_rank": mb,
                    "ceiling_fraction": frac, "wrong": wrong, "algo": "/".join(algos)})
    return out


def build_report(cfg: dict, nranks: int, launches: dict[str, list[dict]],
                 skipped: dict[str, str], command: list[str]) -> dict:
    coll = cfg["collective"]
    ceilings = [L["ceiling"] for L in launches["gpurt"] if L.get("ceiling")]
    best = max(ceilings, key=lambda c: c["per_rank_Bps"]) if ceilings else None
    ceil_Bps = best["per_rank_Bps"] if best else None
    libs = {}
    for name, ls in launches.items():
        libs[name] = {"launches": ls, "rows": combine(coll, nranks, ls, ceil_Bps),
                      "info": ls[0].get("info", {})}
    rows = []
    for i, g in enumerate(libs["gpurt"]["rows"]):
        row = {"size": g["size"], "count": g["count"], "dtype": cfg["dtype"], "gpurt": g,
               "ratio": {}, "loop_ratio": {}}
        for name in libs:
            if name == "gpurt":
                continue
            b = libs[name]["rows"][i]
            row[name] = b
            # gpurt busbw / baseline busbw == baseline time / gpurt time (also for barrier)
            row["ratio"][name] = b["p50_s"] / g["p50_s"] if g["p50_s"] > 0 else None
            # the same by nccl-tests' loop time (steadier where ranks drift apart)
            row["loop_ratio"][name] = b["loop_s"] / g["loop_s"] if g["loop_s"] > 0 else None
        rows.append(row)
    return {
        "command": command, "collective": coll, "nranks": nranks, "config": {
            k: cfg.get(k) for k in ("dtype", "op", "root", "warmup", "iters", "algo",
                                    "check", "repeat", "baselines", "sizes", "memory")},
        "machine": dict(_machine(), mpi_library=libs["gpurt"]["info"].get("mpi_library")),
        # a barrier moves no data: no bus bandwidth (null, "–" in the table; docs/bench.md)
        "busbw_factor": None if coll == "barrier" else busbw_factor(coll, nranks),
        "min_traffic": {"formula": _TRAFFIC_DOC[coll], "per_rank": "(R + W) / nranks"},
        "ceiling": {"per_rank_Bps": ceil_Bps, "best": best, "all": ceilings,
                    "busbw_equivalent_GBps": ceiling_busbw(coll, nranks, ceil_Bps or 0)},
        "libraries": libs, "skipped": skipped, "rows": rows,
    }


_TRAFFIC_DOC = {
    "allreduce": "R = n*S, W = n*S", "reduce": "R = n*S, W = S",
    "broadcast": "R = S, W = (n-1)*S (in place)", "allgather": "R = S, W = n*S",
    "reduce_scatter": "R = n*S, W = S", "alltoall": "R = n*S, W = n*S",
    "gather": "R = S, W = S", "scatter": "R = S, W = S", "sendrecv": "R = n*S, W = n*S",
    "barrier": "R = 0, W = 0",
}


def _f(v: float | None, fmt: str, width: int) -> str:
    return f"{'n/a':>{width}}" if v is None or (isinstance(v, float) and math.isnan(v)) \
        else f"{v:{width}{fmt}}"


def format_table(rep: dict) -> str:
    """The report as text: a header of '#' lines, then one row per size."""
    coll, n, cfg = rep["collective"], rep["nranks"], rep["config"]
    libs = [k for k in rep["libraries"] if k != "gpurt"]
    m = rep["machine"]
    ceil = rep["ceiling"]
    lines = [
        f"# gpurt bench {coll}: {n} rank{'s' if n != 1 else ''}, dtype {cfg['dtype']}"
        + (f", op {cfg['op']}" if coll in REDUCING else "")
        + (f", root {cfg['root']}" if coll in ROOTED else "")
        + f", warmup {cfg['warmup']}, iters {cfg['iters']}, repeat {cfg['repeat']}"
        + (f", algo {cfg['algo']}" if cfg.get("algo") else "")
        + ("" if cfg.get("memory", "host") == "host" else
           ", gpurt's buffers from gpurt.empty (node-shared), the baselines' from NumPy"
           if cfg["memory"] == "shared" else f", {cfg['memory']} device buffers"),
        f"# {m['hostname']}: {m['cpu']}, {m['cpus']} CPUs; {m.get('mpi_library') or ''}",
    ]
    if ceil.get("per_rank_Bps"):
        b = ceil["best"]
        how = "np.copyto" if b.get("memory", "host") == "host" else \
            f"device-to-device copy ({b['memory']})"
        lines.append(f"# memory ceiling: {b['per_rank_Bps'] / 1e9:.2f} GB/s per rank with "
                     f"{n} rank{'s' if n != 1 else ''} copying at once "
                     f"({b['single_rank_Bps'] / 1e9:.2f} GB/s one rank alone; {how} of "
                     f"{human_size(b['bytes'])}B, read+written)")
    factor = rep["busbw_factor"]
    lines.append("# time = per-iteration max over ranks; p50 = median; loop = nccl-tests' "
                 "time (timed loop / iterations, slowest rank); algbw = size / p50; "
                 "busbw = " + ("– (no data moves)" if factor is None else
                               f"algbw × {factor:.3g}")
                 + "; %ceil = min bytes/rank / time / ceiling (docs/bench.md)")
    gi = rep["libraries"].get("gpurt", {}).get("info", {})
    if "spin_us" in gi:
        ranks, cpus = gi["machine"]
        lines.append("# gpurt's waits (rank 0): " + (
            f"spin {gi['spin_us']:g} us, then yield" if gi["spin_us"] else
            "yield at once, no spinning") + f" ({gi['local_size']} ranks on its node; "
            f"{ranks} sharing its machine's CPUs, over {cpus} CPUs)")
    for k, why in rep.get("skipped", {}).items():
        lines.append(f"# {k} baseline skipped: {why}")
    head = (f"{'size(B)':>12} {'count':>11} {'type':>8} {'p50(us)':>10} {'p99(us)':>10} "
            f"{'mean(us)':>10} {'loop(us)':>10} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'%ceil':>6} {'#wrong':>7}  "
            f"{'algo':<18}")
    for k in libs:
        head += f" | {k + ' p50(us)':>13} {k + ' busbw':>11}"
        if cfg.get("check"):
            head += f" {k + ' #wrong':>11}"
        head += f" {'ratio':>6} {'lratio':>6}"
    lines.append("#" + head[1:])
    for row in rep["rows"]:
        g = row["gpurt"]
        frac = g["ceiling_fraction"]
        line = (f"{row['size']:>12} {row['count']:>11} {row['dtype']:>8} "
                f"{g['p50_s'] * 1e6:>10.1f} {g['p99_s'] * 1e6:>10.1f} {g['mean_s'] * 1e6:>10.1f} "
                f"{g['loop_s'] * 1e6:>10.1f} "
                f"{_f(g['algbw_GBps'], '.3f', 11)} {_f(g['busbw_GBps'], '.3f', 11)} "
                f"{_f(frac * 100 if frac is not None else None, '.1f', 6)} "
                f"{'n/a' if g['wrong'] is None else g['wrong']:>7}  {g['algo']:<18}")
        for k in libs:
            b = row[k]
            line += f" | {b['p50_s'] * 1e6:>13.1f} {_f(b['busbw_GBps'], '.3f', 11)}"
            if cfg.get("check"):
                line += f" {'n/a' if b['wrong'] is None else b['wrong']:>11}"
            line += f" {_f(row['ratio'][k], '.2f', 6)} {_f(row['loop_ratio'][k], '.2f', 6)}"
        lines.append(line)
    if libs:
        lines.append("# ratio = gpurt busbw / baseline busbw (= baseline p50 / gpurt p50); "
                     "lratio = baseline loop / gpurt loop; > 1: gpurt is faster")
    if cfg.get("check"):
        checked = [r[k]["wrong"] for r in rep["rows"] for k in ["gpurt"] + libs
                   if r[k]["wrong"] is not None]
        bad = sum(checked)
        lines.append("# out of bounds values : " + (
            "n/a (nothing to check)" if not checked else
            f"{bad} {'OK' if not bad else 'FAILED'}"))
        for lib, where in _wrong_by_lib(wrong_sizes(rep)):
            lines.append(f"# wrong elements: {lib} at {where}")
    return "\n".join(lines)


def wrong_sizes(rep: dict) -> list[tuple[str, int, int]]:
    """(library, size S, wrong elements) for every size whose checked pass (``-c``) found
    wrong elements, gpurt first; empty when everything checked was right (or nothing was
    checked).  Non-empty makes ``gpurt bench`` exit 1, as nccl-tests fails on "Out of
    bounds values": a wrong result is not a benchmark result."""
    return [(lib, row["size"], row[lib]["wrong"]) for lib in rep.get("libraries", {})
            for row in rep.get("rows", []) if row[lib]["wrong"]]


def _wrong_by_lib(bad: list[tuple[str, int, int]]) -> list[tuple[str, str]]:
    """``wrong_sizes`` per library: (library, "1024 B (3 wrong), 4096 B (1 wrong)")."""
    libs = list(dict.fromkeys(lib for lib, _, _ in bad))
    return [(lib, ", ".join(f"{S} B ({w} wrong)" for k, S, w in bad if k == lib))
            for lib in libs]


def plot(rep: dict, path: str) -> None:
    """busbw (GB/s) against size (log2 x axis) for gpurt and each baseline, with the
    memory ceiling converted to busbw; a barrier plots its time instead."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install 'gpurt[plot]' "
                                   "(or pip install matplotlib)") from None
    coll, n = rep["collective"], rep["nranks"]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    barrier = coll == "barrier"
    for name, lib in rep["libraries"].items():
        xs = [r["size"] if not barrier else 1 for r in lib["rows"]]
        ys = [(r["p50_s"] * 1e6 if barrier else (r["busbw_GBps"] or 0)) for r in lib["rows"]]
        ax.plot(xs, ys, marker="o", label=name)
    cb = rep["ceiling"].get("busbw_equivalent_GBps")
    if cb and not barrier:
        ax.axhline(cb, color="gray", linestyle="--",
                   label=f"memory ceiling ({cb:.2f} GB/s busbw)")
    ax.set_xscale("log", base=2)
    if not barrier:
        sizes = [r["size"] for r in rep["rows"]]
        ticks = sizes if len(sizes) <= 12 else sizes[:: math.ceil(len(sizes) / 12)]
        ax.set_xticks(ticks)
        ax.set_xticklabels([human_size(s) for s in ticks], rotation=45)
    ax.set_xlabel("size S (bytes)")
    ax.set_ylabel("p50 time (µs)" if barrier else "bus bandwidth (GB/s)")
    ax.set_title(f"{coll}, {n} ranks, {rep['config']['dtype']} — {rep['machine']['hostname']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    # (the format named: without it a name with no extension became NAME.png, and the
    # log said NAME)
    fig.savefig(path, format=plot_format(path))
    plt.close(fig)


def plot_format(path: str) -> str:
    """The format matplotlib writes ``path`` in: its extension (``.png``, ``.svg``,
    ``.pdf``, ...), PNG where it has none; a ``click.BadParameter`` for an extension
    matplotlib cannot write (``plot.txt`` was a traceback after the whole sweep) — or
    ``.pgf`` without the LaTeX it needs."""
    ext = os.path.splitext(os.path.basename(path))[1].lower().lstrip(".")
    if ext in ("", "png"):
        return "png"
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase
    known = FigureCanvasBase.get_supported_filetypes()
    why = ""
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:
        known = {k: v for k, v in known.items() if k != "pgf"}
        if ext == "pgf":
            why = f" ({matplotlib.rcParams['pgf.texsystem']} is not installed)"
    if ext not in known:
        raise click.BadParameter(f"{path}: matplotlib cannot write .{ext} files{why}; use "
                                 f"one of {', '.join('.' + k for k in sorted(known))} (or "
                                 f"no extension: PNG)", param_hint="'--plot'")
    return ext


def _ceiling_bytes(wanted: int, nranks: int) -> int:
    """The ceiling buffer, shrunk so that all ranks' two buffers take at most half of the
    available memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                avail = int(line.split()[1]) * 1024
                return min(wanted, avail // (4 * nranks) >> 20 << 20)
    except (OSError, ValueError):
        pass
    return wanted


def run_bench(cfg: dict, nranks: int | None, json_path: str | None, plot_path: str | None,
              command: list[str]) -> dict:
    """Run the whole benchmark (launching, or in place under a launcher) and print."""
    here = launcher_size()
    dtype = parse_dtype(cfg["dtype"])
    if plot_path:
        if importlib.util.find_spec("matplotlib") is None:   # say so before the run
            raise click.UsageError("--plot needs matplotlib: pip install 'gpurt[plot]' (or "
                                   "pip install matplotlib)")
        try:
            plot_format(plot_path)    # (an extension it cannot write: before the run)
        except click.BadParameter:
            if here > 1 and launcher_rank() != 0:
                raise SystemExit(2) from None   # rank 0 says why, once
            raise
    if here > 1:
        why = None
        if nranks not in (None, here):
            why = (f"running under an MPI launcher with {here} ranks but -n {nranks}: drop "
                   f"-n or make them agree")
        elif set(cfg["baselines"]) - {"nocheck"}:
            why = ("--baseline mpi and gloo need a launch of their own: run `gpurt bench` "
                   "itself, not under mpiexec (nocheck runs in place)")
        if why:
            if launcher_rank() != 0:
                raise SystemExit(2)   # rank 0 says why, once
            raise click.UsageError(why)
        nranks = here
    nranks = nranks or DEFAULT_NRANKS
    coll = cfg["collective"]
    if coll in ROOTED and cfg["root"] >= nranks:
        # bench_command checked an explicit -n; here the launch's size or the default
        # is known, before any rank starts (the ranks would only fail on it)
        whose = (f"this launch's {nranks} ranks" if here > 1 else
                 f"the {nranks} ranks launched (-n defaults to {DEFAULT_NRANKS})")
        if here > 1 and launcher_rank() != 0:
            raise SystemExit(2)   # rank 0 says why, once
        raise click.BadParameter(f"{cfg['root']} is not a rank of {whose}",
                                 param_hint="'-r' / '--root'")
    try:
        cfg["sizes"] = sweep_sizes(coll, nranks, dtype.itemsize, cfg["minbytes"],
                                   cfg["maxbytes"], cfg["factor"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    cfg["ceiling_bytes"] = _ceiling_bytes(cfg["ceiling_bytes"], nranks)
    skipped: dict[str, str] = {}
    launches: dict[str, list[dict]] = {"gpurt": []}
    base = {k: cfg[k] for k in ("collective", "sizes", "dtype", "op", "root", "warmup",
                                "iters", "algo", "check", "memory")}
    # the nocheck baseline is timed inside gpurt's own runs (a second communicator)
    paired = "nocheck" if "nocheck" in cfg["baselines"] else None

    def keep(res: dict, rep: int) -> None:
        res["repeat"] = rep
        launches["gpurt"].append(res)
        if "paired" in res:
            twin = res.pop("paired")
            twin["repeat"] = rep
            launches.setdefault(twin["lib"], []).append(twin)

    if here > 1:      # inside an existing launch: gpurt (and nocheck beside it) only
        rank = None
        for rep in range(cfg["repeat"]):
            wcfg = dict(base, lib="gpurt", ceiling_bytes=cfg["ceiling_bytes"],
                        label=f"gpurt {rep + 1}/{cfg['repeat']}", paired=paired)
            try:
                res = worker(wcfg)
            except Exception as e:  # noqa: BLE001 - one clear line, abort the launch
                _fail(wcfg, e)
                raise SystemExit(1) from None
            rank = 0 if res is not None else 1
            if res is not None:
                keep(res, rep)
        if rank != 0:
            return {}
    else:
        baselines = list(dict.fromkeys(cfg["baselines"]))
        if "gloo" in baselines:
            if importlib.util.find_spec("torch") is None:
                skipped["gloo"] = "torch is not importable here (pip install torch)"
        for b in baselines:
            if b in skipped:
                _log(f"gpurt bench: skipping the {b} baseline: {skipped[b]}")
            elif b != paired:
                launches[b] = []
        # (the directory inside: removed on a _Stopped too, before the handlers go)
        with _stop_on_signals(), tempfile.TemporaryDirectory(prefix="gpurt-bench-") as td:
            tmp = Path(td)
            for rep in range(cfg["repeat"]):
                for lib in list(launches):
                    if lib in skipped or lib == paired:
                        continue
                    c = dict(base, lib=lib, label=f"{lib} {rep + 1}/{cfg['repeat']}",
                             ceiling_bytes=cfg["ceiling_bytes"] if lib == "gpurt" else 0)
                    if lib == "gpurt":
                        c["paired"] = paired
                    else:
                        c["algo"] = None
                    res = _launch(c, nranks, tmp, f"{lib}-{rep}")
                    if "skipped" in res:
                        skipped[lib] = res["skipped"]
                        _log(f"gpurt bench: skipping the {lib} baseline: {res['skipped']}")
                        launches.pop(lib, None)
                        continue
                    if lib == "gpurt":
                        keep(res, rep)
                    else:
                        res["repeat"] = rep
                        launches[lib].append(res)
    if not launches.get("gpurt"):
        raise click.ClickException(f"gpurt's own run did not happen: "
                                   f"{skipped.get('gpurt', 'no result')}")
    report = build_report(cfg, nranks, launches, skipped, command)
    click.echo(format_table(report))
    # checked before the sweep, a file can still fail here (/dev/full, a disk that filled
    # up): one line saying so, after the table (stdout) that holds the numbers, and the
    # other file still written — not a traceback that lost them
    unwritten = []
    if json_path:
        try:
            Path(json_path).write_text(json.dumps(report, indent=1))
            _log(f"gpurt bench: wrote {json_path}")
        except OSError as e:
            unwritten.append(f"--json {json_path} ({e.strerror or e})")
    if plot_path:
        try:
            plot(report, plot_path)
            _log(f"gpurt bench: wrote {plot_path} ({plot_format(plot_path).upper()})")
        except OSError as e:
            unwritten.append(f"--plot {plot_path} ({e.strerror or e})")
    if unwritten:
        raise click.ClickException(f"could not write {' nor '.join(unwritten)}; the numbers "
                                   f"are in the table printed to stdout")
    return report


class _SizeType(click.ParamType):
    """A size option (``parse_size``); ``minimum`` bytes or more (-b, -e: 1 — a size of 0
    never grows; --ceiling-size: 0, which skips the measurement)."""

    name = "SIZE"

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def convert(self, value, param, ctx):
        try:
            nbytes = parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if nbytes < self.minimum:
            self.fail(f"{value!r}: must be at least {self.minimum} "
                      f"byte{'s' if self.minimum != 1 else ''}", param, ctx)
        return nbytes


def check_sweep_options(minbytes: int, maxbytes: int, factor: int) -> None:
    """-b, -e and -f together (also `gpurt tune`'s), as click usage errors naming the
    option, before anything is launched: -b ≤ -e (else no size is measured), and with
    -b < -e a factor of 2 or more (sizes grow by it; 1 never gets to -e).  A factor of 1
    with -b equal to -e is one size, as in nccl-tests."""
    if minbytes > maxbytes:
        raise click.BadParameter(f"{human_size(minbytes)} is larger than -e "
                                 f"{human_size(maxbytes)}", param_hint="'-b' / '--minbytes'")
    if factor < 2 and minbytes < maxbytes:
        raise click.BadParameter(f"{factor}: must be 2 or more when -b is smaller than -e "
                                 f"(the sizes grow by this factor)",
                                 param_hint="'-f' / '--stepfactor'")


def check_writable_path(path: str, hint: str) -> None:
    """An output file the run will write at its end (bench's --json/--plot, tune's -o):
    refused before the launch when it cannot be written — else the whole sweep ran and
    its write ended in a traceback, the measurements lost."""
    if launcher_size() > 1:
        # in place under a launch: rank 0 writes the file, alone, and it may be writable
        # (its directory may exist) on rank 0's node only, so rank 0 checks and every rank
        # learns its verdict — rank 0 alone refusing left the others waiting in the sweep
        # for it, forever.  (A collective: every rank gets here, in the same order.)
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        why = world.bcast(_unwritable(path) if world.Get_rank() == 0 else None, 0)
        if why and world.Get_rank() != 0:
            raise SystemExit(2)   # rank 0 says why, once
    else:
        why = _unwritable(path)
    if why:
        raise click.BadParameter(why, param_hint=hint)


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written here (``check_writable_path``), or None."""
    p = Path(os.path.realpath(path))        # (a symlink: where the write will go)
    if not p.parent.is_dir():
        return f"{path}: no directory {p.parent}"
    if p.is_dir():
        return f"{path}: is a directory"
    # tried, not asked where it can be (os.access says yes to root everywhere, /proc
    # included): an existing regular file opened for appending (nothing written, never
    # created), a missing one by a temporary file beside it (the path itself untouched);
    # anything else (a FIFO, a device) asked, since opening it may block or act
    try:
        if p.is_file():
            os.close(os.open(p, os.O_WRONLY | os.O_APPEND))
        elif p.exists():
            if not os.access(p, os.W_OK):
                raise PermissionError(13, "Permission denied")
        else:
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".gpurt-check-")
            os.close(fd)
            os.unlink(tmp)
    except OSError as e:
        return f"{path}: not writable here ({e.strerror or e})"
    return None


def algo_names(coll: str) -> list[str]:
    """Every name ``--algo`` may give for ``coll`` on some communicator: the registered
    schedules (gpurt/algorithms REGISTRY) and their aliases, and where the collective has
    them the shm board, shm_direct and the hierarchical form.  Whether one of the last
    three can run on this launch (the first two need one node, hierarchical several) is
    only known on the ranks, which say so; a name that is none of these is refused before
    the launch."""
    from gpurt import hier
    from gpurt.algorithms import ALIASES, REGISTRY
    from gpurt.transports import shm_board, shm_direct
    names = set(REGISTRY.get(coll, {}))
    names |= {a for a, name in ALIASES.items() if name in names}
    if coll in shm_board.COLLS:
        names.add("shm_board")
    if coll in shm_direct.COLLS:
        names.add(shm_direct.NAME)
    if coll in hier.COLLS:
        names |= {hier.HIER, "hier"}
    return sorted(names)


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"],
                                          "max_content_width": 100})
@click.argument("collective", type=click.Choice(COLLECTIVES))
@click.option("-n", "--nranks", type=click.IntRange(1), default=None,
              help=f"Number of ranks to launch (default {DEFAULT_NRANKS}).  NOTE: nccl-tests "
                   "uses -n for iterations; here -n is ranks and -i is iterations.  Under an "
                   "MPI launcher with >1 rank, the launch's size is used.")
@click.option("-b", "--minbytes", type=_SizeType(1), default="8", show_default=True,
              help="Smallest size S (K/M/G suffixes; at least 1 byte).")
@click.option("-e", "--maxbytes", type=_SizeType(1), default="32M", show_default=True,
              help="Largest size S (at least -b).")
@click.option("-f", "--stepfactor", "factor", type=click.IntRange(1), default=2,
              show_default=True, help="Multiplication factor between sizes (2 or more; 1 "
                                      "only with -b equal to -e).")
@click.option("-w", "--warmup", type=click.IntRange(0), default=5, show_default=True,
              help="Untimed calls per size before the timed loop.")
@click.option("-i", "--iters", type=click.IntRange(1), default=20, show_default=True,
              help="Timed calls per size.")
@click.option("-d", "--datatype", "dtype", type=click.Choice(DTYPES), default="float32",
              show_default=True)
@click.option("-o", "--op", type=click.Choice(OPS), default="sum", show_default=True,
              help="Reduction op (allreduce, reduce, reduce_scatter).")
@click.option("-r", "--root", type=click.IntRange(0), default=0, show_default=True,
              help="Root of reduce, broadcast, gather, scatter.")
@click.option("--algo", default=None, help="Force a gpurt algorithm (see `gpurt info`; "
                                          "shm_board, shm_direct, hierarchical where they "
                                          "apply).")
@click.option("-c", "--check", is_flag=True,
              help="Also run a separate checked call per size and report #wrong.")
@click.option("--baseline", "baselines", type=click.Choice(BASELINES), multiple=True,
              help="Also run the sweep through mpi4py (mpi) or torch.distributed gloo "
                   "(gloo), each in its own launch, or gpurt with GPURT_CHECK=0 (nocheck: "
                   "what the agreement check costs; a second communicator in gpurt's own "
                   "run, timed in alternating blocks); repeatable.")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True,
              help="Alternate the launches this many times (gpurt, mpi, gpurt, mpi, ...); "
                   "medians per size.")
@click.option("--ceiling-size", "ceiling_bytes", type=_SizeType(), default="256M",
              show_default=True, help="Bytes np.copyto'd to measure the memory ceiling "
                                      "(0: skip).")
@click.option("--memory", type=click.Choice(MEMORIES), default="host", show_default=True,
              help="Where the buffers live: host (NumPy), shared (gpurt's buffers from "
                   "gpurt.empty — comm.empty — which local peers read directly; the "
                   "baselines keep NumPy arrays, their fastest), cupy or torch (CUDA device "
                   "arrays; the ceiling is then a device-to-device copy), or standin "
                   "(gpurt's host-memory stand-in for a GPU: exercises the device path, "
                   "its numbers are not a GPU's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write busbw against size to this file (needs matplotlib), in the "
                   "format of its extension (.png, .svg, .pdf, ...; none: PNG).")
def bench_command(collective, nranks, minbytes, maxbytes, factor, warmup, iters, dtype, op,
                  root, algo, check, baselines, repeat, ceiling_bytes, memory, json_path,
                  plot_path):
    """Time COLLECTIVE over a sweep of sizes, nccl-tests style (docs/bench.md).

    Size S is nccl-tests' "size": the whole buffer for allgather, reduce_scatter,
    alltoall, gather and scatter (per-rank count × ranks × itemsize), the vector for the
    others.  Sizes are rounded down to a multiple of itemsize (× ranks where blocked).
    Progress goes to stderr, the table to stdout.

    \b
    Examples:
      gpurt bench allreduce -n 4 -b 8 -e 256M -f 2
      gpurt bench allgather -n 2 -b 1K -e 64M -f 4 -c --json ag.json --plot ag.png
      gpurt bench allreduce -n 2 -b 8 -e 64M -f 8 --baseline mpi --repeat 2
      gpurt bench reduce_scatter -n 3 -d float64 -o max --algo ring -c
      gpurt bench sendrecv -n 2 -e 16M --baseline mpi --baseline gloo
      mpiexec -n 4 gpurt bench broadcast -e 1M      (runs in place; no baselines)
    """
    from gpurt.ops import as_op, check_op
    # what the options say on their own is refused here, before any rank is launched
    check_sweep_options(minbytes, maxbytes, factor)
    for opt, path in (("--json", json_path), ("--plot", plot_path)):
        if path:
            check_writable_path(path, f"'{opt}'")
    try:
        dt = parse_dtype(dtype)
    except ValueError as e:      # bfloat16 without ml_dtypes
        raise click.BadParameter(str(e), param_hint="'-d' / '--datatype'") from None
    if collective in REDUCING:
        try:
            check_op(as_op(op), dt)
        except (TypeError, ValueError) as e:
            raise click.UsageError(str(e)) from None
        if op == "avg" and set(baselines) - {"nocheck"}:
            raise click.UsageError("MPI and gloo have no AVG op: use another -o with "
                                   "--baseline")
    if "gloo" in baselines and dtype in _GLOO_NO_DTYPES:
        raise click.UsageError(f"gloo has no {dtype} (torch.distributed's gloo backend: "
                               f"'Invalid scalar type'); use another -d with --baseline gloo")
    if ("gloo" in baselines and collective in REDUCING and dt.kind == "c"
            and op != "sum"):
        raise click.UsageError(f"gloo reduces complex tensors with sum only, not {op}; use "
                               f"another -o or -d with --baseline gloo")
    if dtype == "bfloat16" and set(baselines) - {"nocheck"}:
        raise click.UsageError("bfloat16 is gpurt's (via ml_dtypes): MPI has no datatype for "
                               "it and torch.from_numpy cannot view it; use another -d with "
                               "--baseline")
    if memory in ("cupy", "torch") and importlib.util.find_spec(memory) is None:
        raise click.UsageError(f"--memory {memory}: {memory} is not installed here")
    if memory not in HOST_MEMORIES and set(baselines) - {"nocheck"}:
        raise click.UsageError(f"--memory {memory}: the mpi and gloo baselines take host "
                               f"buffers only (the mpich wheel is not CUDA-aware)")
    if collective == "sendrecv" and algo:
        raise click.UsageError("sendrecv is point-to-point: --algo does not apply")
    if collective == "sendrecv" and nranks == 1:
        raise click.UsageError("sendrecv needs -n 2 or more")
    if algo and algo not in algo_names(collective):
        raise click.BadParameter(f"{algo!r} is not an algorithm of {collective} (known: "
                                 f"{', '.join(algo_names(collective))})",
                                 param_hint="'--algo'")
    # without -n, run_bench checks the root against the launch's size or the default
    if collective in ROOTED and nranks is not None and root >= nranks:
        raise click.BadParameter(f"{root} is not a rank of -n {nranks}",
                                 param_hint="'-r' / '--root'")
    cfg = {"collective": collective, "minbytes": minbytes, "maxbytes": maxbytes,
           "factor": factor, "warmup": warmup, "iters": iters, "dtype": dtype, "op": op,
           "root": root, "algo": algo, "check": check, "baselines": list(baselines),
           "repeat": repeat, "ceiling_bytes": ceiling_bytes, "memory": memory}
    try:
        report = run_bench(cfg, nranks, json_path, plot_path,
                           [Path(sys.argv[0]).name] + sys.argv[1:])
    except _Stopped as e:    # (SIGINT/SIGTERM while launching: the job is stopped)
        from gpurt.launch.launcher import _signame
        _log(f"gpurt bench: {_signame(e.signum)}: stopped every rank")
        raise SystemExit(128 + e.signum) from None   # (as `gpurt launch`: 130, 143)
    bad = wrong_sizes(report)       # (empty on the ranks but 0 of an in-place run)
    if bad:
        raise click.ClickException("the checked pass (-c) found wrong elements: " + "; ".join(
            f"{lib} at {where}" for lib, where in _wrong_by_lib(bad)))


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
