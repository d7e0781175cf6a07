"""Run under ``mpiexec -n N`` with an argument ``shared``, ``numpy`` or ``mixed``:
collectives by ``shm_direct`` (transports/shm_direct.py) — every rank loads and stores
straight into its peers' buffers — with exact data in every case.

* ``shared``: every buffer from ``comm.empty`` (peers' arrays mapped); ``numpy``: NumPy
  arrays (peers reached with process_vm_readv/writev, when GPURT_SHM_DIRECT_CMA allows);
  ``mixed``: rank 0's buffers shared, the others' NumPy.
* every collective shm_direct runs, forced with ``algo="shm_direct"``: dtypes, ops (SUM,
  MAX, PROD, AVG), counts from 1 (blocks left empty) to 1 Mi + 13, every root, in place;
* which path ran (``last_algorithm``) — shm_direct where every buffer is reachable, the
  tuner's schedule otherwise — is the same on every rank and the one expected
  (``DIRECT_EXPECT=yes|no``);
* in ``shared`` mode with the default thresholds: a 2 MiB allreduce is chosen as
  shm_direct, a 64 KiB one is not;
* with the default thresholds (no algo=): every collective at 4 MiB, even ranks blocking
  (run inline, without a Request), odd ranks on the i-variant: the two paths meet;
* last, a call with different counts on one rank: CollectiveMismatchError on every rank
  (forced, or with ``DIRECT_MISMATCH=auto`` chosen by the thresholds, inline and
  i-variant meeting).

Prints ``ok ... on N ranks`` on rank 0; exits non-zero on a failure.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import casekit
from gpurt import CollectiveMismatchError, Op

world, comm, r, p, chk = casekit.start()
bad, expect = chk.bad, chk.expect
mode = sys.argv[1]
want_direct = os.environ.get("DIRECT_EXPECT", "yes") == "yes" and world.size > 1


def alloc(n: int, dtype) -> np.ndarray:
    if mode == "shared" or (mode == "mixed" and r == 0):
        return comm.empty(n, dtype)
    return np.empty(n, dtype)


def vals(n: int, k: int, seed: int, dtype) -> np.ndarray:
    """Rank k's data: small integers (exact in every dtype, sums and products too)."""
    v = (np.arange(n, dtype=np.int64) * 7 + k * 13 + seed * 5) % 3 + 1
    if np.dtype(dtype) == np.bool_:
        return v == 2
    return v.astype(dtype)


def ref(op: Op, arrays: list[np.ndarray]) -> np.ndarray:
    acc = arrays[0].copy()
    for a in arrays[1:]:
        if op in (Op.SUM, Op.AVG):
            acc = acc + a
        elif op is Op.MAX:
            acc = np.maximum(acc, a)
        elif op is Op.PROD:
            acc = acc * a
        elif op is Op.BXOR:
            acc = acc ^ a
        elif op is Op.BOR:
            acc = acc | a
    if op is Op.AVG:
        acc = acc / p
    return acc.astype(arrays[0].dtype)


paths: list[str] = []


# an allreduce on NumPy arrays (every rank's) that fits the board's staging room is
# staged through the board (shm_staged), where a room is in use (GPURT_SHM_STAGE=auto:
# only without the compiled CMA shares)
STAGE = comm.board.stage if comm.board is not None and comm._direct is not None and \
    comm._direct_min["allreduce"][2] else 0


def staged(nbytes: int) -> bool:
    return (world.size > 1 and mode == "numpy" and 0 < nbytes <= STAGE and
            os.environ.get("GPURT_SHM_DIRECT_CMA") != "0")


def ran(what: str, nbytes: int = 0) -> None:
    """Record which path ran; it must be the expected one (``nbytes``: an allreduce's)."""
    alg = comm.last_algorithm
    paths.append(alg)
    chk.count += 1
    if staged(nbytes):
        if alg != "shm_staged":
            bad.append(f"rank {r}: {what} ran {alg}, expected shm_staged")
    elif (alg == "shm_direct") != want_direct:
        bad.append(f"rank {r}: {what} ran {alg}, expected "
                   f"{'shm_direct' if want_direct else 'the schedule'}")


D = "shm_direct"
cases = [(np.float64, Op.SUM), (np.float32, Op.MAX), (np.int32, Op.PROD), (np.float64, Op.AVG),
         (np.int64, Op.SUM), (np.float16, Op.SUM), (np.complex64, Op.SUM), (np.uint8, Op.BXOR),
         (np.bool_, Op.BOR)]
try:
    import ml_dtypes
    cases.append((ml_dtypes.bfloat16, Op.SUM))
except ImportError:
    pass
counts = [1, 1000, 262147, (1 << 20) + 13]
for seed, n in enumerate(counts):
    for dt, op in cases if n < (1 << 20) else cases[:2]:
        dt = np.dtype(dt)
        tag = f"{dt.name} {op.name} n={n}"
        ins = [vals(n, k, seed, dt) for k in range(p)]
        want = ref(op, ins)
        x, y = alloc(n, dt), alloc(n, dt)
        x[:] = ins[r]
        comm.allreduce(x, y, op, algo=D)
        expect(f"allreduce {tag}", y, want)
        ran(f"allreduce {tag}", x.nbytes)
        comm.allreduce(x, op=op, algo=D)               # in place
        expect(f"allreduce in place {tag}", x, want)
        ran(f"allreduce in place {tag}", x.nbytes)
        for root in range(p):
            x[:] = ins[r]
            y[:] = 0
            comm.reduce(x, y, op, root=root, algo=D)
            if r == root:
                expect(f"reduce root={root} {tag}", y, want)
            ran(f"reduce {tag}")
            x[:] = ins[r]
            comm.reduce(x, None, op, root=root, algo=D)   # in place at the root
            if r == root:
                expect(f"reduce in place root={root} {tag}", x, want)
            x[:] = ins[r]
            comm.broadcast(x, root=root, algo=D)
            expect(f"broadcast root={root} {tag}", x, ins[root])
            ran(f"broadcast {tag}")
        m = n * p
        big = [vals(m, k, seed, dt) for k in range(p)]
        xb, ob = alloc(m, dt), alloc(n, dt)
        xb[:] = big[r]
        comm.reduce_scatter(xb, ob, op, algo=D)
        expect(f"reduce_scatter {tag}", ob, ref(op, big)[r * n:(r + 1) * n])
        ran(f"reduce_scatter {tag}")
        ga = alloc(m, dt)
        xg = alloc(n, dt)
        xg[:] = ins[r]
        comm.allgather(xg, ga, algo=D)
        expect(f"allgather {tag}", ga, np.concatenate(ins))
        ran(f"allgather {tag}")
        ta = alloc(m, dt)
        comm.alltoall(xb, ta, algo=D)
        expect(f"alltoall {tag}", ta, np.concatenate([big[k][r * n:(r + 1) * n]
                                                      for k in range(p)]))
        ran(f"alltoall {tag}")
        del x, y, xb, ob, ga, xg, ta

# the same path on every rank, call by call
every = world.allgather(paths)
if any(e != paths for e in every):
    bad.append(f"rank {r}: the ranks took different paths for the same calls")

if mode == "shared" and want_direct and os.environ.get("GPURT_SHM_DIRECT", "auto") == "auto" \
        and os.environ.get("GPURT_SHM_SHARED", "1") != "0":
    a = comm.empty(1 << 19, np.float32)       # 2 MiB
    a[:] = r + 1
    comm.allreduce(a)
    expect("auto 2 MiB allreduce", a, np.full(1 << 19, p * (p + 1) // 2, np.float32))
    if comm.last_algorithm != D:
        bad.append(f"rank {r}: a 2 MiB allreduce on shared arrays ran {comm.last_algorithm}")
    s = comm.empty(1 << 14, np.float32)       # 64 KiB
    s[:] = 1
    comm.allreduce(s)
    if comm.last_algorithm == D:
        bad.append(f"rank {r}: a 64 KiB allreduce ran shm_direct")
    del a, s

if mode == "numpy" and want_direct and os.environ.get("GPURT_SHM_DIRECT_CMA", "auto") == "auto":
    a = np.full(1 << 20, r + 1, np.float32)     # 4 MiB, through process_vm_readv/writev
    comm.allreduce(a)
    expect("auto 4 MiB allreduce (NumPy)", a, np.full(1 << 20, p * (p + 1) // 2, np.float32))
    want = "shm_staged" if staged(a.nbytes) else D     # (GPURT_SHM_STAGE=4M or more)
    if comm.last_algorithm != want:
        bad.append(f"rank {r}: a 4 MiB allreduce on NumPy arrays ran {comm.last_algorithm}")

# the thresholds' choice (no algo=): blocking calls run shm_direct inline (without a
# Request), the i-variants through the engine; even ranks block, odd ranks wait on a
# request, so the two paths meet in every call — exact, and the same path everywhere
auto = all(os.environ.get(v, "auto") == "auto" for v in ("GPURT_SHM_DIRECT",
                                                          "GPURT_SHM_DIRECT_CMA"))
if auto and mode in ("numpy", "shared", "mixed"):
    inline = r % 2 == 0
    n = (1 << 20) // p + 3                    # every S >= 4 MiB: above every threshold
    for dt, op in ((np.float32, Op.SUM), (np.float64, Op.AVG), (np.int32, Op.MAX)):
        dt = np.dtype(dt)
        tag = f"{dt.name} {op.name} n={n} ({'blocking' if inline else 'i-variant'})"
        m = n * p
        ins = [vals(m, k, 7, dt) for k in range(p)]
        want = ref(op, ins)
        x, y = alloc(m, dt), alloc(m, dt)
        x[:] = ins[r]
        if inline:
            comm.allreduce(x, y, op)
        else:
            comm.iallreduce(x, y, op).wait()
        expect(f"auto allreduce {tag}", y, want)
        ran(f"auto allreduce {tag}", x.nbytes)
        if inline:
            comm.allreduce(x, op=op)
        else:
            comm.iallreduce(x, op=op).wait()
        expect(f"auto allreduce in place {tag}", x, want)
        for root in range(p):
            x[:] = ins[r]
            y[:] = 0
            if inline:
                comm.reduce(x, y, op, root=root)
            else:
                comm.ireduce(x, y, op, root=root).wait()
            if r == root:
                expect(f"auto reduce root={root} {tag}", y, want)
            else:
                expect(f"auto reduce root={root} leaves out alone {tag}", y,
                       np.zeros(m, dt))
            ran(f"auto reduce {tag}")
            x[:] = ins[r]
            if inline:
                comm.broadcast(x, root=root)
            else:
                comm.ibroadcast(x, root=root).wait()
            expect(f"auto broadcast root={root} {tag}", x, ins[root])
            ran(f"auto broadcast {tag}")
        x[:] = ins[r]
        rs = alloc(n, dt)
        if inline:
            comm.reduce_scatter(x, rs, op)
        else:
            comm.ireduce_scatter(x, rs, op).wait()
        expect(f"auto reduce_scatter {tag}", rs, want[r * n:(r + 1) * n])
        ran(f"auto reduce_scatter {tag}")
        xg = alloc(n, dt)
        xg[:] = ins[r][:n]
        if inline:
            comm.allgather(xg, y)
        else:
            comm.iallgather(xg, y).wait()
        expect(f"auto allgather {tag}", y, np.concatenate([a[:n] for a in ins]))
        ran(f"auto allgather {tag}")
        if inline:
            comm.alltoall(x, y)
        else:
            comm.ialltoall(x, y).wait()
        expect(f"auto alltoall {tag}", y, np.concatenate([ins[k][r * n:(r + 1) * n]
                                                          for k in range(p)]))
        ran(f"auto alltoall {tag}")
        del x, y, rs, xg
    # blocking with out=None: results allocated as the general path allocates them (NumPy
    # arrays: which path runs depends on CMA, so only that every rank took the same one)
    xa = np.full((p, n), r + 1, np.int32)
    got = comm.alltoall(xa)
    expect("auto alltoall out=None", got, np.tile(np.arange(1, p + 1, dtype=np.int32)[:, None],
                                                  (1, n)))
    paths.append(comm.last_algorithm)
    if got.shape != (p, n):
        bad.append(f"rank {r}: alltoall(out=None) returned shape {got.shape}")
    got = comm.allgather(xa[0])
    expect("auto allgather out=None", got, np.tile(np.arange(1, p + 1, dtype=np.int32)[:, None],
                                                   (1, n)))
    paths.append(comm.last_algorithm)
    if got.shape != (p, n):
        bad.append(f"rank {r}: allgather(out=None) returned shape {got.shape}")

# a different count on the last rank: every rank raises, naming both calls, and nothing
# was written.  DIRECT_MISMATCH=auto: chosen by the thresholds, even ranks blocking (the
# inline path), odd ranks on a request; else forced with algo=
n = 1 << 18 if os.environ.get("DIRECT_MISMATCH") != "auto" else 1 << 20
x = alloc(n + (4 if r == p - 1 else 0), np.float32)
x[:] = 7
try:
    if os.environ.get("DIRECT_MISMATCH") != "auto":
        comm.allreduce(x, algo=D, timeout=30)
    elif r % 2 == 0:
        comm.allreduce(x, timeout=30)
    else:
        comm.iallreduce(x).wait(timeout=30)
    if p > 1:
        bad.append(f"rank {r}: mismatched counts were not detected")
except CollectiveMismatchError as e:
    chk.count += 1
    if f"count={n}" not in str(e) or f"count={n + 4}" not in str(e):
        bad.append(f"rank {r}: the mismatch error does not show both counts: {e}")
    if not np.all(x == 7):
        bad.append(f"rank {r}: a mismatched call wrote its buffer")

casekit.verdict(world, comm, chk, f"({mode})")
