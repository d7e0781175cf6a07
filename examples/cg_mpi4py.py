"""An existing mpi4py program that hands its communicator to gpurt: a distributed
conjugate-gradient solve of the 1-D Poisson equation, checked against a serial solve.

    mpiexec -n 4 python examples/cg_mpi4py.py [--n-per-rank 100] [--tol 1e-10]
    gpurt launch -n 4 examples/cg_mpi4py.py

The application owns its MPI communicator (its own ``Dup`` of COMM_WORLD, and it keeps
using mpi4py on it for its own control traffic); ``gpurt.Communicator(app_comm)`` wraps
it for the data: the halo exchange of the matrix-vector product uses ``isend``/``recv``
with the neighbours, the dot products use ``allreduce``.  Rank 0 then gathers the
solution, solves the same system serially with NumPy, and exits non-zero unless they
agree.

The problem: -u'' = 1 on (0, 1), u(0) = u(1) = 0 (solution x(1-x)/2, which second-order
finite differences reproduce exactly at the grid points), on N interior points split into
contiguous blocks (rank r owns block r).  CG needs about N/2 iterations: as many halo
exchanges and twice as many allreduces.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import gpurt  # noqa: E402


class Poisson1D:
    """A = tridiag(-1, 2, -1) / h^2 on this rank's block, halo from the neighbours."""

    def __init__(self, comm: gpurt.Communicator, n_local: int, h: float):
        self.comm, self.n, self.h2 = comm, n_local, h * h
        r, p = comm.rank, comm.size
        self.left = r - 1 if r > 0 else None
        self.right = r + 1 if r < p - 1 else None
        self.ghost = np.zeros(2, np.float64)        # [left neighbour's last, right's first]

    def matvec(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        c = self.comm
        sends = []
        # halo exchange: my edge values out, the neighbours' edge values in
        if self.left is not None:
            sends.append(c.isend(x[:1], self.left, tag=1))
        if self.right is not None:
            sends.append(c.isend(x[-1:], self.right, tag=2))
        self.ghost[:] = 0.0                          # Dirichlet boundary where no neighbour
        if self.left is not None:
            c.recv(self.ghost[0:1], self.left, tag=2)
        if self.right is not None:
            c.recv(self.ghost[1:2], self.right, tag=1)
        for s in sends:
            s.wait()
        out[:] = 2.0 * x
        out[1:] -= x[:-1]
        out[:-1] -= x[1:]
        out[0] -= self.ghost[0]
        out[-1] -= self.ghost[1]
        out /= self.h2
        return out


def dot(comm: gpurt.Communicator, a: np.ndarray, b: np.ndarray) -> float:
    s = np.array([np.dot(a, b)], np.float64)
    comm.allreduce(s)
    return float(s[0])


def cg(comm, A: Poisson1D, b: np.ndarray, tol: float, maxiter: int):
    x = np.zeros_like(b)
    r = b.copy()                                     # b - A @ 0
    p = r.copy()
    q = np.empty_like(b)
    rs = dot(comm, r, r)
    bnorm = np.sqrt(dot(comm, b, b))
    for it in range(1, maxiter + 1):
        A.matvec(p, q)
        alpha = rs / dot(comm, p, q)
        x += alpha * p
        r -= alpha * q
        rs_new = dot(comm, r, r)
        if np.sqrt(rs_new) <= tol * bnorm:
            return x, it, np.sqrt(rs_new) / bnorm
        p *= rs_new / rs
        p += r
        rs = rs_new
    return x, maxiter, np.sqrt(rs) / bnorm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-per-rank", type=int, default=100)
    ap.add_argument("--tol", type=float, default=1e-10)
    args = ap.parse_args()

    app = MPI.COMM_WORLD.Dup()                       # the application's own communicator
    # ...on which the application keeps doing its own mpi4py business:
    cfg = app.bcast({"n_per_rank": args.n_per_rank, "tol": args.tol}, root=0)
    comm = gpurt.Communicator(app)                   # gpurt embedded, on the same ranks
    r, p = comm.rank, comm.size
    n_local = cfg["n_per_rank"]
    N = n_local * p
    h = 1.0 / (N + 1)
    xs = (np.arange(r * n_local, (r + 1) * n_local) + 1) * h
    f = np.ones_like(xs)

    t0 = time.perf_counter()
    u, iters, rel = cg(comm, Poisson1D(comm, n_local, h), f, cfg["tol"], 10 * N)
    elapsed = time.perf_counter() - t0
    full = comm.gather(u, root=0)                    # (p, n_local) on rank 0

    ok = True
    if r == 0:
        A = (np.diag(np.full(N, 2.0)) - np.diag(np.ones(N - 1), 1)
             - np.diag(np.ones(N - 1), -1)) / (h * h)
        xg = (np.arange(N) + 1) * h
        serial = np.linalg.solve(A, np.ones(N))
        err = float(np.max(np.abs(full.ravel() - serial)) / np.max(np.abs(serial)))
        exact = float(np.max(np.abs(full.ravel() - xg * (1 - xg) / 2)))
        ok = err < 1e-6
        print(f"{p} ranks, N={N}: CG converged in {iters} iterations (relative residual "
              f"{rel:.1e}, {elapsed:.2f} s)")
        print(f"max relative difference to the serial solve {err:.1e}: "
              f"{'matches the serial solve' if ok else 'DIFFERS from the serial solve'}; "
              f"error vs x(1-x)/2 {exact:.1e}")
    ok = bool(app.bcast(ok, root=0))                 # mpi4py again, beside gpurt
    comm.close()
    app.Free()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
