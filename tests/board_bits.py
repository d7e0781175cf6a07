"""Run under ``mpiexec -n N``: the blocking small-message path (the shm board's inline
round: every collective but scatter) against a NumPy reference, bit for bit.

    mpiexec -n 3 python tests/board_bits.py [native|python]

``native`` requires the compiled round (gpurt._fastboard) to be in use, ``python`` turns
it off (GPURT_NATIVE=0, set here), so both implementations are held to the same bits.
Inputs are random, with the awkward values mixed in — NaN, ±inf, −0.0, the extremes of
each integer type (sums and products wrap as NumPy's do) — and the reference is the rank-
order reduction ``((x0 op x1) op x2) ...`` with NumPy's ufuncs over every rank's input
(gathered through MPI).  Results are compared as raw bytes (a NaN matching any NaN: which
NaN comes out of two is not defined — see ``same``).  Also: in place and into a
separate ``out``, multi-dimensional arrays, every root of broadcast, AVG, zero-size
arrays, and calls alternating with non-blocking ones (whose BoardRun shares the board);
reduce/gather off the root leave ``out`` alone, reduce_scatter/allgather/alltoall with and
without ``out`` (and the shapes ``out=None`` gets).
Prints ``ok N checks on P ranks (native|python)`` on rank 0; exits non-zero on a failure.
"""

from __future__ import annotations

import os
import sys

mode = sys.argv[1] if len(sys.argv) > 1 else "native"
if mode == "python":
    os.environ["GPURT_NATIVE"] = "0"

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import gpurt  # noqa: E402
from gpurt.ops import _ALLOWED, _UFUNC, BFLOAT16, Op  # noqa: E402
from gpurt.transports import shm_board  # noqa: E402

world = MPI.COMM_WORLD
comm = gpurt.Communicator(world)
r, p = comm.rank, comm.size
assert comm.board is not None, "this check needs every rank on one node (the board)"
native = comm.board.fast is not None
if mode == "native" and not native:
    raise SystemExit(f"rank {r}: the compiled board is not in use: {shm_board.NATIVE_WHY}")
if mode == "python" and native:
    raise SystemExit(f"rank {r}: GPURT_NATIVE=0 but the compiled board is in use")

rng = np.random.default_rng(1234 + r)
checks = 0
bad = []


def specials(dtype: np.dtype, n: int) -> np.ndarray:
    """n values of dtype: random, with NaN/inf/-0.0 or integer extremes sprinkled in."""
    if dtype.kind == "f" or dtype == BFLOAT16:       # bfloat16's kind is "V"
        v = (rng.standard_normal(n) * 1000).astype(dtype)
        pick = rng.integers(0, 12, n)
        v[pick == 0] = np.nan
        v[pick == 1] = np.inf
        v[pick == 2] = -np.inf
        v[pick == 3] = -0.0
        v[pick == 4] = 0.0
        return v
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    pick = rng.integers(0, 8, n)
    v[pick == 0] = info.max
    v[pick == 1] = info.min
    v[pick == 2] = 0
    v[pick == 3] = -1 if info.min < 0 else 1
    return v


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, except that a NaN matches any NaN: IEEE 754 leaves open which NaN an
    operation on two NaNs returns (x86 returns the first operand's, and a C compiler may
    swap the operands of a commutative + or *), so only where the NaNs are is compared."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc" or a.dtype == BFLOAT16:
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        na, nb = np.isnan(a.astype(wide)), np.isnan(b.astype(wide))
        if not np.array_equal(na, nb):
            return False
        a, b = a.copy(), b.copy()
        a[na] = 0
        b[nb] = 0
    return a.tobytes() == b.tobytes()


def check(what: str, got: np.ndarray, want: np.ndarray) -> None:
    global checks
    checks += 1
    if not same(got, want):
        diff = np.flatnonzero(got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
        bad.append(f"rank {r}: {what}: wrong bytes at {diff[:8]} (got {got.reshape(-1)[:4]}, "
                   f"want {want.reshape(-1)[:4]})")


def reference(xs: list[np.ndarray], op: Op) -> np.ndarray:
    acc = xs[0].copy()
    with np.errstate(all="ignore"):
        for k in range(1, p):
            _UFUNC[op](acc, xs[k], out=acc)
        if op is Op.AVG:            # (complex: each part ÷ the real count, as gpurt)
            v = acc.view(acc.real.dtype) if acc.dtype.kind == "c" else acc
            np.divide(v, v.dtype.type(p), out=v)
    return acc


np.seterr(all="ignore")
for op in Op:
    for dtype in _ALLOWED[op]:
        for n in (0, 1, 7, 64, 1000, 3 << 12):
            shape = (n,) if n < 64 else (8, n // 8)
            x = specials(dtype, n).reshape(shape)
            xs = world.allgather(x)
            want = reference(xs, op)
            what = f"allreduce({dtype}, {op.name}, n={n})"
            out = np.empty_like(x)
            got = comm.allreduce(x, out=out, op=op)
            check(what + " into out", got, want)
            check(what + " input unchanged", x, xs[r])
            y = x.copy()
            comm.allreduce(y, op=op)
            check(what + " in place", y, want)
            # a non-blocking call (the Python BoardRun) between blocking ones
            z = x.copy()
            comm.iallreduce(z, op=op).wait()
            check(what + " non-blocking", z, want)

for dtype in (np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.complex128)):
    for n in (0, 5, 4096):
        for root in range(p):
            x = specials(dtype, n)
            xs = world.allgather(x)
            comm.broadcast(x, root=root)
            check(f"broadcast({dtype}, n={n}, root={root})", x, xs[root])
# the collectives whose result is not x's shape
for op in (Op.SUM, Op.MAX, Op.AVG, Op.BXOR, Op.PROD):
    for dtype in [d for d in _ALLOWED[op]
                  if d.name in ("float32", "float64", "int8", "uint64", "float16", "int32",
                                "bfloat16", "complex64")]:
        for n in (0, 3, 500):
            x = specials(dtype, n * p).reshape(p, n) if n else specials(dtype, 0)
            xs = world.allgather(x)
            what = f"({dtype}, {op.name}, n={n})"
            # reduce_scatter: block r of the reduction of every rank's p blocks
            want = reference([v.reshape(p, -1)[r] if n else v for v in xs], op)
            got = comm.reduce_scatter(x, op=op)
            check("reduce_scatter" + what, got.reshape(-1), want.reshape(-1))
            if n:
                assert got.shape == (n,), got.shape
            out = np.full(n, 7, dtype)
            comm.reduce_scatter(x, out=out, op=op)
            check("reduce_scatter into out" + what, out, want.reshape(-1))
            check("reduce_scatter input unchanged" + what, x, xs[r])
            for root in range(p):
                y = x.copy()
                got = comm.reduce(y, op=op, root=root)
                want = reference(xs, op) if r == root else xs[r]
                check(f"reduce root={root} in place" + what, got, want)
                out = np.full(x.shape, 5, dtype)
                got = comm.reduce(x, out=out, op=op, root=root)
                if r == root:
                    check(f"reduce root={root} into out" + what, got, reference(xs, op))
                else:
                    check(f"reduce root={root} leaves out" + what, out, np.full(x.shape, 5, dtype))
for dtype in (np.dtype(np.float32), np.dtype(np.int16), np.dtype(np.complex128), BFLOAT16):
    for n in (0, 1, 7, 300):
        x = specials(dtype, n)
        xs = world.allgather(x)
        got = comm.allgather(x)
        check(f"allgather({dtype}, n={n})", got, np.stack(xs))
        out = np.empty(p * n, dtype)
        comm.allgather(x, out=out)
        check(f"allgather into out({dtype}, n={n})", out, np.concatenate(xs))
        for root in range(p):
            got = comm.gather(x, root=root)
            if r == root:
                check(f"gather({dtype}, n={n}, root={root})", got, np.stack(xs))
            elif got is not None:
                bad.append(f"rank {r}: gather returned {type(got)} off the root")
        a = specials(dtype, p * n).reshape(p, n)
        As = world.allgather(a)
        want = np.stack([As[k][r] for k in range(p)])
        got = comm.alltoall(a)
        check(f"alltoall({dtype}, n={n})", got, want)
        out = np.empty(p * n, dtype)
        comm.alltoall(a.reshape(-1), out=out)
        check(f"alltoall into out({dtype}, n={n})", out, want.reshape(-1))
for _ in range(50):
    comm.barrier()
    checks += 1

failed = world.allgather(bad)
if r == 0:
    for lines in failed:
        for line in lines[:10]:
            print(line)
    nbad = sum(len(b) for b in failed)
    kind = "native" if native else "python"
    print(("ok" if not nbad else f"FAILED {nbad} of") + f" {checks} checks on {p} ranks ({kind})",
          flush=True)
comm.close()
sys.exit(1 if any(failed) else 0)
