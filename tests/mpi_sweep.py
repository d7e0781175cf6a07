"""Run under ``mpiexec -n N``: many collective cases in one launch, exact checks.

    mpiexec -n 3 python tests/mpi_sweep.py [--device standin|cupy|torch] algorithms|dtypes|all
    mpiexec -n 3 python tests/mpi_sweep.py transport     # fewer cases: see Sweep.algorithms

``--device`` runs the same cases on device arrays: ``standin`` is gpurt's host-memory
stand-in for a GPU (``GPURT_DEVICE_BACKEND=standin``, set here; not a GPU), ``cupy`` and
``torch`` real CUDA arrays.  Inputs are made on the host and copied in; results copied out.

Inputs are small integers (in every dtype), so every reduction order gives the same
exact answer and results are compared with ``==`` against a NumPy reference computed
from every rank's input.  Prints one line per failing case and a summary on rank 0;
exits non-zero if any rank saw a failure.
"""

from __future__ import annotations

import sys
import time
import traceback

import numpy as np

import gpurt
from gpurt.algorithms import REGISTRY
from gpurt.ops import _ALLOWED, DTYPES, Op
from gpurt.tuner import collective_bytes

PRIME = 100_003          # a prime above 10^5
BIG_BYTES = 3 << 20      # "a few MiB"


def gen(q: int, n: int, dtype: np.dtype, op: Op | None) -> np.ndarray:
    """Rank q's input: small integers, exact under any reduction order for p <= 8."""
    i = np.arange(n, dtype=np.int64)
    if dtype == np.bool_:
        return ((i + q) % 3 == 0)
    if op is Op.PROD:
        v = (i * 5 + q) % 2 + 1                   # 1 or 2: products up to 2^p
    elif op in (Op.BAND, Op.BOR, Op.BXOR):
        v = (i * 7 + q * 13) % 61
    else:
        v = (i * 7 + q * 3) % 9                   # sums up to 8p
        if np.dtype(dtype).kind == "i":
            v = v - 4                             # negative values for signed types
    if np.dtype(dtype).kind == "c":
        im = (i + q) % 2 if op is Op.PROD else (i * 3 + q) % 5
        return (v + 1j * im).astype(dtype)
    return v.astype(dtype)


def ref_reduce(arrs: list[np.ndarray], op: Op, p: int) -> np.ndarray:
    uf = {Op.SUM: np.add, Op.AVG: np.add, Op.PROD: np.multiply, Op.MIN: np.minimum,
          Op.MAX: np.maximum, Op.BAND: np.bitwise_and, Op.BOR: np.bitwise_or,
          Op.BXOR: np.bitwise_xor}[op]
    acc = arrs[0].copy()
    for a in arrs[1:]:
        uf(acc, a, out=acc)
    if op is Op.AVG and acc.size:   # (complex: each part ÷ the real count, as gpurt)
        v = acc.view(acc.real.dtype) if acc.dtype.kind == "c" else acc
        np.divide(v, v.dtype.type(p), out=v)
    return acc


def _kinds(kind: str | None):
    """(to device, to host) for a device kind (gpurt bench's DeviceIO); identity for host
    runs.  ``to host`` passes anything that is not a device array through."""
    if kind is None:
        return (lambda a: a), (lambda a: a)
    from gpurt.launch.bench import DeviceIO

    io = DeviceIO(kind)
    dev_type = type(io.to_dev(np.zeros(1, np.float32)))
    return io.to_dev, (lambda a: io.to_host(a) if isinstance(a, dev_type) else a)


class Sweep:
    def __init__(self, comm: gpurt.Communicator, device: str | None = None):
        self.comm, self.p, self.r = comm, comm.size, comm.rank
        self.failures: list[str] = []
        self.cases = 0
        self.device = device
        self.D, self.H = _kinds(device)

    def check(self, what: str, got, want) -> None:
        self.cases += 1
        got = np.asarray(self.H(got))
        want = np.asarray(want)
        if got.shape != want.shape:
            self.failures.append(f"{what}: shape {got.shape} != {want.shape}")
        elif got.dtype != want.dtype:
            self.failures.append(f"{what}: dtype {got.dtype} != {want.dtype}")
        elif not np.array_equal(got, want):
            bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
            k = bad[0]
            self.failures.append(f"{what}: {bad.size} wrong elements, first at {k}: "
                                 f"{got.reshape(-1)[k]!r} != {want.reshape(-1)[k]!r}")

    def run_case(self, coll: str, algo: str | None, n: int, dtype, op: Op | None, root: int,
                 inplace: bool) -> None:
        """One collective call with per-rank count n (see gpurt.schedule.SPECS)."""
        c, p, r, D = self.comm, self.p, self.r, self.D
        dtype = np.dtype(dtype)
        tag = f"{coll}/{algo or 'auto'} n={n} {dtype} {op.name if op else ''} root={root}" \
              f"{' inplace' if inplace else ''}"
        if coll == "allreduce":
            x0 = gen(r, n, dtype, op)
            x = D(x0)
            want = ref_reduce([gen(q, n, dtype, op) for q in range(p)], op, p)
            if inplace:
                y = c.allreduce(x, op=op, algo=algo)
                self.check(tag + " (returned is x)", y is x, True)
            else:
                y = c.allreduce(x, D(np.empty_like(x0)), op=op, algo=algo)
                self.check(tag + " (x unchanged)", x, x0)
            self.check(tag, y, want)
        elif coll == "reduce":
            x0 = gen(r, n, dtype, op)
            x = D(x0)
            want = ref_reduce([gen(q, n, dtype, op) for q in range(p)], op, p)
            if inplace:
                y = c.reduce(x, op=op, root=root, algo=algo)
                self.check(tag, y if r == root else x, want if r == root else x0)
            else:
                out = D(np.full_like(x0, 3))
                y = c.reduce(x, out, op=op, root=root, algo=algo)
                self.check(tag + " (x unchanged)", x, x0)
                self.check(tag, out, want if r == root else np.full_like(x0, 3))
        elif coll == "broadcast":
            x = D(gen(root, n, dtype, op) if r == root else np.zeros(n, dtype))
            c.broadcast(x, root=root, algo=algo)
            self.check(tag, x, gen(root, n, dtype, op))
        elif coll == "allgather":
            x = D(gen(r, n, dtype, op))
            y = c.allgather(x, algo=algo)
            self.check(tag, y, np.stack([gen(q, n, dtype, op) for q in range(p)]))
        elif coll == "reduce_scatter":
            x = D(gen(r, p * n, dtype, op))
            y = c.reduce_scatter(x, op=op, algo=algo)
            want = ref_reduce([gen(q, p * n, dtype, op) for q in range(p)], op, p)
            self.check(tag, y, want[r * n:(r + 1) * n])
        elif coll == "alltoall":
            x = D(gen(r, p * n, dtype, op).reshape(p, n))
            y = c.alltoall(x, algo=algo)
            self.check(tag, y, np.stack([gen(q, p * n, dtype, op).reshape(p, n)[r]
                                         for q in range(p)]))
        elif coll == "gather":
            x = D(gen(r, n, dtype, op))
            y = c.gather(x, root=root, algo=algo)
            if r == root:
                self.check(tag, y, np.stack([gen(q, n, dtype, op) for q in range(p)]))
            else:
                self.check(tag + " (None off root)", y is None, True)
        elif coll == "scatter":
            x = D(gen(root, p * n, dtype, op).reshape(p, n)) if r == root else None
            out = D(np.zeros(n, dtype))
            y = c.scatter(x, out, root=root, algo=algo)
            self.check(tag, y, gen(root, p * n, dtype, op)[r * n:(r + 1) * n])
        elif coll == "barrier":
            c.barrier(algo=algo)
            self.cases += 1
        else:
            raise ValueError(coll)

    def safe(self, *args) -> bool:
        try:
            self.run_case(*args)
            return True
        except Exception:  # noqa: BLE001 - report and stop: ranks may now be out of step
            self.failures.append(f"{args}: {traceback.format_exc()}")
            return False

    def algos(self, coll: str) -> list[str]:
        """Every schedule algorithm, plus the transports' native protocols (shm_board) and
        the hierarchical schedule where the communicator spans nodes."""
        t = self.comm.tuner if self.device is None else self.comm._dev_tuner()
        return sorted(REGISTRY[coll]) + sorted(t.natives.get(coll, {})) + \
            (["hierarchical"] if coll in t.hier and self.comm.nnodes > 1 else [])

    def fits(self, coll: str, algo: str, n: int, itemsize: int) -> bool:
        t = self.comm.tuner if self.device is None else self.comm._dev_tuner()
        nat = t.natives.get(coll, {}).get(algo)
        S = collective_bytes(coll, self.p, n, itemsize)
        return nat is None or nat.fits(self.p, S)

    # -- suites -----------------------------------------------------------------------
    def algorithms(self, full: bool = True) -> bool:
        """Every collective x every algorithm x sizes x roots, float32 (SUM/MAX), in and
        out of place.  ``full=False`` (the ``transport`` suite): every algorithm's messages
        at every size (empty, eager, rendezvous, several MiB), SUM, roots 0 and p - 1, in
        place only from PRIME up — for a transport under test where each case is slow (the
        Soft-RoCE guest runs under TCG, ~60 ms a case); MAX, the middle root and the small
        in-place cases exercise the algorithms' own logic, which the host sweeps run in
        full over shm and tcp."""
        p = self.p
        for coll in ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter",
                     "alltoall", "gather", "scatter", "barrier"):
            per_rank = coll in ("allgather", "reduce_scatter", "alltoall", "gather", "scatter")
            big = BIG_BYTES // 4 // (p if per_rank else 1)
            sizes = [0] if coll == "barrier" else [0, 1, 7, PRIME, big]
            roots = sorted({0, p - 1} | ({p // 2} if full else set())) \
                if coll in ("reduce", "broadcast", "gather", "scatter") else [0]
            ops = [Op.SUM] + ([Op.MAX] if full else []) \
                if coll in ("allreduce", "reduce", "reduce_scatter") else [None]
            for algo in self.algos(coll):
                for n in sizes:
                    if not self.fits(coll, algo, n, 4):
                        continue
                    inplaces = [False, True] if coll in ("allreduce", "reduce") and \
                        (full or n >= PRIME) else [False]
                    for root in roots:
                        for op in ops:
                            if op is Op.MAX and n not in (7, PRIME):
                                continue
                            for inplace in inplaces:
                                if not self.safe(coll, algo, n, np.float32, op, root, inplace):
                                    return False
        return True

    def transport(self) -> bool:
        return self.algorithms(full=False)

    def dtypes(self) -> bool:
        """Every dtype x every op it supports x the reducing collectives (and every
        allreduce algorithm); every dtype through every collective x algorithm."""
        p = self.p
        for dtype in DTYPES:
            for op in Op:
                if dtype not in _ALLOWED[op]:
                    continue
                for coll in ("allreduce", "reduce", "reduce_scatter"):
                    for n in (1, 7, 1000):
                        if not self.safe(coll, None, n, dtype, op, p - 1, coll == "reduce"):
                            return False
                for algo in self.algos("allreduce"):
                    if not self.safe("allreduce", algo, 13, dtype, op, 0, True):
                        return False
            # every collective x every algorithm in this dtype (first op it supports)
            first = next((o for o in (Op.SUM, Op.MAX, Op.BOR) if dtype in _ALLOWED[o]))
            for coll in REGISTRY:
                red = coll in ("allreduce", "reduce", "reduce_scatter")
                for algo in self.algos(coll):
                    if not self.safe(coll, algo, 13, dtype, first if red else None, p // 2,
                                     False):
                        return False
        return True


def main() -> int:
    args = sys.argv[1:]
    device = None
    if args[:1] == ["--device"]:
        device, args = args[1], args[2:]
        if device == "standin":
            import os
            os.environ["GPURT_DEVICE_BACKEND"] = "standin"
    suites = args or ["all"]
    comm = gpurt.init()
    if device is not None and comm.dev is None:
        print(f"rank {comm.rank}: no device backend: {comm.dev_why}", flush=True)
        return 2
    sw = Sweep(comm, device)
    t0 = time.perf_counter()
    for s in suites:
        for name in (["algorithms", "dtypes"] if s == "all" else [s]):
            if not getattr(sw, name)():
                break
    from mpi4py import MPI
    fails = comm.mpi.gather(sw.failures, 0)
    cases = comm.mpi.reduce(sw.cases, MPI.SUM, 0)
    if comm.rank == 0:
        nfail = sum(len(f) for f in fails)
        for q, fl in enumerate(fails):
            for f in fl[:10]:
                print(f"FAIL rank {q}: {f}", flush=True)
        where = f", {device} device buffers" if device else ""
        print(f"{cases} checks on {comm.size} ranks ({' '.join(suites)}{where}): {nfail} failed, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    bad = comm.mpi.allreduce(len(sw.failures), MPI.SUM)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
