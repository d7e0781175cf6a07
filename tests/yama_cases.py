"""Single copies (CMA) under Yama's ptrace_scope=1, run by an unprivileged user.

Ubuntu's default ``ptrace_scope=1`` refuses ``process_vm_readv``/``writev`` between sibling
processes, so MPI ranks cannot read each other unless each declares its readers
(``transports.cma.allow_peers``: ``PR_SET_PTRACER_ANY``).  This host kernel has no Yama, so
tests/rdma/guest_suite.sh runs this inside the Debian guest (whose kernel has it), with
``ptrace_scope`` set to 1 and the ranks started without CAP_SYS_PTRACE (``setpriv
--bounding-set -sys_ptrace``: that capability passes Yama; as an unprivileged user the
ranks could not read a CI checkout of mode 0700 through the guest's share).  ``mpiexec -n N python3 tests/yama_cases.py EXPECT`` where EXPECT is
``cma`` (the default GPURT_SHM_PTRACER: single copies work) or ``nocma``
(GPURT_SHM_PTRACER=0: CMA off, with the reason, and every result still exact).  Rank 0
prints one line ``YAMA_CASE {json}``; the exit status is 1 on any failure.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpurt  # noqa: E402
from gpurt.transports import cma  # noqa: E402


def has_sys_ptrace() -> bool:
    """CAP_SYS_PTRACE (bit 19) in this process's effective capabilities."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 19 & 1)
    return False


def main() -> int:
    expect = sys.argv[1]
    world = MPI.COMM_WORLD
    comm = gpurt.Communicator(world)
    r, p = comm.rank, comm.size
    fails: list[str] = []
    shm = comm._shm()
    res = {"ranks": p, "cap_sys_ptrace": has_sys_ptrace(), "scope": cma.yama_scope(),
           "cma_why": shm.cma_why if shm is not None else None,
           "cma_shares": bool(comm._cma_shares), "algos": {}}
    if res["cap_sys_ptrace"]:
        fails.append("run with CAP_SYS_PTRACE, which passes Yama: nothing is tested")
    if res["scope"] != 1:
        fails.append(f"Yama ptrace_scope is {res['scope']}, not 1")
    if expect == "cma":
        if res["cma_why"] != "":
            fails.append(f"rank {r}: CMA refused: {res['cma_why']}")
        if not res["cma_shares"]:
            fails.append(f"rank {r}: the compiled CMA shares are off")
    elif not res["cma_why"] or "Operation not permitted" not in res["cma_why"] \
            or "GPURT_SHM_PTRACER=0" not in res["cma_why"]:
        fails.append(f"rank {r}: CMA should be refused, saying why: {res['cma_why']!r}")
    # ordinary NumPy arrays, sizes where the single copies (CMA) or the rings carry them
    for nbytes in (4 << 10, 1 << 20, 8 << 20):
        n = nbytes // 4
        base = np.arange(n, dtype=np.float32) % 1000
        x = base + r
        out = comm.allreduce(x)
        want = base * p + p * (p - 1) / 2
        if not np.array_equal(out, want):
            fails.append(f"rank {r}: allreduce of {nbytes} B wrong")
        res["algos"][f"allreduce {nbytes}"] = comm.last_algorithm
        blk = n // p
        mine = np.full(blk, r, np.int32)
        got = comm.allgather(mine)
        if not np.array_equal(got.reshape(p, blk), np.repeat(np.arange(p, dtype=np.int32),
                                                             blk).reshape(p, blk)):
            fails.append(f"rank {r}: allgather of {nbytes} B wrong")
        res["algos"][f"allgather {nbytes}"] = comm.last_algorithm
        a = (np.arange(p * blk, dtype=np.int32) + 1000 * r)
        got = comm.alltoall(a)
        want = np.concatenate([np.arange(r * blk, (r + 1) * blk, dtype=np.int32) + 1000 * s
                               for s in range(p)])
        if not np.array_equal(got, want):
            fails.append(f"rank {r}: alltoall of {nbytes} B wrong")
        res["algos"][f"alltoall {nbytes}"] = comm.last_algorithm
        # a plain large send/recv (the rings' single-copy receive)
        if p > 1:
            buf = np.empty(n, np.float32)
            if r == 0:
                comm.send(base, 1)
            elif r == 1:
                comm.recv(buf, 0)
                if not np.array_equal(buf, base):
                    fails.append(f"rank {r}: recv of {nbytes} B wrong")
    allfails = [f for fs in world.allgather(fails) for f in fs]
    res["failures"] = allfails
    if r == 0:
        print("YAMA_CASE " + json.dumps(res), flush=True)
    comm.close()
    return 1 if allfails else 0


if __name__ == "__main__":
    sys.exit(main())
