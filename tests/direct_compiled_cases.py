"""shm_direct's compiled shares (``gpurt._fastboard``'s ``direct``: the header round,
READY, the share by process_vm_readv/writev, FINISHED, all without the GIL), run by
tests/test_direct.py under mpiexec:

    python tests/direct_compiled_cases.py numpy|late|mixed|unaligned

- ``numpy``: every collective shm_direct runs, on NumPy arrays, exact, in several dtypes
  and ops, odd counts, every root kind, in place where the API allows; the compiled
  round must have finished calls on every rank (its answers are spied on);
- ``late``: rank 1 runs DirectRun (Python) and is 20 ms late before publishing, while
  opening the buffers, or before its share, call after call: the others' compiled
  rounds must hand their calls over at each of those phases (answers 1, 5 and 6), with
  exact results;
- ``mixed``: rank 0's arrays are ``comm.empty`` ones (mapped, not reached by CMA): it
  does not try the compiled round, and the others' hand every call to DirectRun after
  the header round (answer 1);
- ``unaligned``: as ``numpy``, every array a view at an odd byte offset (C-contiguous,
  not aligned: NumPy allows it), which the compiled kernels read and write through
  types of alignment 1.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import casekit  # noqa: E402

from gpurt.transports import shm_direct  # noqa: E402

mode = sys.argv[1]
world, comm, r, p, chk = casekit.start()
late, mixed = mode == "late", mode == "mixed"
codes: list[int] = []

if late and r == 1:
    casekit.python_direct(comm)
    opened, shares = shm_direct.DirectRun._open, dict(shm_direct._SHARES)
    when = {"slow": None}

    def slow_open(run):
        if when["slow"] == "open":
            time.sleep(0.02)
        return opened(run)

    shm_direct.DirectRun._open = slow_open
    for name, share in shares.items():
        def slow_share(run, share=share):
            if when["slow"] == "share":
                time.sleep(0.02)
            return share(run)
        shm_direct._SHARES[name] = slow_share
elif comm.board.fast is not None:
    codes = casekit.spy_compiled(comm, "direct")


def odd(n, dt):
    """n elements of dt at an odd address (3 bytes past an aligned one)."""
    dt = np.dtype(dt)
    a = np.empty(n * dt.itemsize + 64, np.uint8)
    k = (-a.ctypes.data) % 64 + 3
    v = a[k:k + n * dt.itemsize].view(dt)
    assert not v.flags.aligned or dt.itemsize == 1
    return v


alloc = comm.empty if mixed and r == 0 else odd if mode == "unaligned" else np.empty
calls = 0


def fill(a, k, salt):
    a[...] = ((np.arange(a.size) * 7 + k * 5 + salt) % 11 + 1).reshape(a.shape).astype(a.dtype)


def call(fn):
    """One call; on rank 1 in ``late`` mode, late somewhere, turn by turn."""
    global calls
    calls += 1
    if late and r == 1:
        kind = ("publish", "open", "share")[calls % 3]
        when["slow"] = kind
        if kind == "publish":
            time.sleep(0.02)
    return fn()


OPS = {"sum": np.add, "max": np.maximum, "prod": np.multiply, "min": np.minimum}

# S from just above the board (256 KiB) to a few MiB, counts that split unevenly
for m in (65537 + 3, 300007):
    for dt, op in ((np.float32, "sum"), (np.int64, "max"), (np.float64, "prod"),
                   (np.int32, "min")):
        dt = np.dtype(dt)
        n = m // p + 1                # elements per block
        red = OPS[op]
        # alltoall: block k of rank j's input goes to block j of rank k's output
        ins = []
        for k in range(p):
            a = np.empty(p * n, dt)
            fill(a, k, 1)
            ins.append(a)
        x, y = alloc(p * n, dt), alloc(p * n, dt)
        x[:] = ins[r]
        y[:] = 0
        call(lambda: comm.alltoall(x, out=y))
        chk.expect(f"alltoall n={n} {dt}", y,
                   np.concatenate([ins[k][r * n:(r + 1) * n] for k in range(p)]))
        chk.expect(f"alltoall ran {comm.last_algorithm}", np.array(comm.last_algorithm),
                   np.array("shm_direct"))
        # allgather
        xs, ys = alloc(n, dt), alloc(p * n, dt)
        xs[:] = ins[r][:n]
        ys[:] = 0
        call(lambda: comm.allgather(xs, out=ys))
        chk.expect(f"allgather n={n} {dt}", ys.reshape(-1),
                   np.concatenate([ins[k][:n] for k in range(p)]))
        # reduce_scatter: rank r gets block r of the reduction
        want = ins[0].copy()
        for a in ins[1:]:
            want = red(want, a)
        call(lambda: comm.reduce_scatter(x, out=xs, op=op))
        chk.expect(f"reduce_scatter n={n} {dt} {op}", xs, want[r * n:(r + 1) * n])
        chk.expect(f"reduce_scatter ran {comm.last_algorithm}", np.array(comm.last_algorithm),
                   np.array("shm_direct"))
        # broadcast from the first and the last rank (in place)
        for root in sorted({0, p - 1}):
            x[:] = ins[r] if r == root else 0
            call(lambda: comm.broadcast(x, root=root))
            chk.expect(f"broadcast root={root} n={p * n} {dt}", x, ins[root])
        # reduce into out on the last rank, and in place on it
        for inplace in (False, True):
            x[:] = ins[r]
            y[:] = -1
            if inplace:
                call(lambda: comm.reduce(x, op=op, root=p - 1))
                got = x
            else:
                call(lambda: comm.reduce(x, out=y, op=op, root=p - 1))
                got = y
            if r == p - 1:
                chk.expect(f"reduce inplace={inplace} n={p * n} {dt} {op}", got, want)
            elif not inplace:
                chk.expect(f"reduce: a non-root's input n={p * n}", x, ins[r])
        # allreduce above the staging room (2 MiB: else staged), into out and in place
        if x.nbytes > comm.board.stage:
            for inplace in (False, True):
                x[:] = ins[r]
                if inplace:
                    call(lambda: comm.allreduce(x, op=op))
                    got = x
                else:
                    call(lambda: comm.allreduce(x, y, op=op))
                    got = y
                chk.expect(f"allreduce inplace={inplace} n={p * n} {dt} {op}", got, want)
                chk.expect(f"allreduce ran {comm.last_algorithm}",
                           np.array(comm.last_algorithm), np.array("shm_direct"))

if not late and not mixed and comm.board.fast is not None:
    # with more ranks than cores under load, every phase of every call above may have
    # outwaited the compiled round's yield budget and been handed to Python: a few more
    # calls, each after a barrier, until every rank has seen it finish one (at most 50)
    n = (65537 + 3) // p + 1
    xs, ys = np.ones(n, np.float32), np.zeros(p * n, np.float32)
    for _ in range(50):
        if all(world.allgather(0 in {c & 0xFF for c in codes})):
            break
        world.Barrier()
        comm.allgather(xs, out=ys)
        chk.expect("probe allgather", ys, np.ones(p * n, np.float32))

note = ""
if comm.board.fast is not None and not (late and r == 1):
    kinds = sorted({c & 0xFF for c in codes})
    note = f"answers {kinds}"
    if late:
        chk.count += 1
        if not {1, 5, 6} <= set(kinds):
            chk.bad.append(f"rank {r}: the compiled round answered {kinds}, not all of "
                           f"1 (published), 5 (READY) and 6 (FINISHED)")
    elif mixed:       # (rank 0, whose arrays are shared, does not try it)
        chk.count += 1
        if set(kinds) != (set() if r == 0 else {1}):
            chk.bad.append(f"rank {r}: with rank 0's arrays shared the compiled round "
                           f"answered {kinds}")
    else:
        chk.count += 1
        if 0 not in kinds:
            chk.bad.append(f"rank {r}: the compiled round never finished a call: {kinds}")
casekit.verdict(world, comm, chk, note if r == 0 else "")
