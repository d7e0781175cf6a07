"""Exact-result bookkeeping shared by the scripts that tests run under ``mpiexec``
(``tests/help_cases.py``, ``tests/shared_cases.py``, ``tests/direct_cases.py``): each rank
collects what was wrong; rank 0 prints the verdict."""

from __future__ import annotations

import sys

import numpy as np


class Checks:
    """One rank's checks: ``expect`` compares exactly; ``bad`` lists the failures."""

    def __init__(self, rank: int):
        self.rank = rank
        self.bad: list[str] = []
        self.count = 0

    def expect(self, what: str, got: np.ndarray, want: np.ndarray) -> None:
        self.count += 1
        if got.shape != want.shape or not np.array_equal(got, want):
            i = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5] \
                if got.shape == want.shape else f"shape {got.shape} != {want.shape}"
            self.bad.append(f"rank {self.rank}: {what}: wrong at {i}")


def start():
    """(world, a gpurt communicator over it, rank, size, Checks) for a case script."""
    from mpi4py import MPI

    import gpurt

    world = MPI.COMM_WORLD
    comm = gpurt.Communicator(world)
    return world, comm, comm.rank, comm.size, Checks(comm.rank)


def verdict(world, comm, chk: Checks, note: str = "") -> None:
    """Gather every rank's failures; rank 0 prints them, or ``ok N checks on P ranks``
    (+ ``note``); close the communicator; exit 1 on any failure."""
    failed = world.allgather(chk.bad)
    if world.Get_rank() == 0:
        for lines in failed:
            for line in lines[:10]:
                print(line)
        nbad = sum(len(b) for b in failed)
        print(("ok" if not nbad else f"FAILED {nbad} of") +
              f" {chk.count} checks on {world.Get_size()} ranks" + (f" {note}" if note else ""),
              flush=True)
    comm.close()
    sys.exit(1 if any(failed) else 0)


def spy_compiled(comm, method: str) -> list[int]:
    """Every answer of the compiled round's ``method`` (``staged``, ``direct``) on this
    rank, appended to the list returned, as the calls go."""
    codes: list[int] = []
    fast = comm.board.fast

    class Spy:
        def __getattr__(self, name):
            return getattr(fast, name)

    def spied(*a):
        codes.append(getattr(fast, method)(*a))
        return codes[-1]

    spy = Spy()
    setattr(spy, method, spied)
    comm.board.fast = spy
    return codes


def python_direct(comm) -> None:
    """This rank runs shm_direct's and the board's rounds in Python (``DirectRun``,
    ``BoardRun``), not the compiled ones, which must interoperate with it."""
    comm.board.fast = None
    comm._fastplans.clear()        # the inline plans name the compiled rounds


def slow_python_staging(comm, seconds: float) -> None:
    """This rank runs a staged allreduce's Python round (``DirectRun``), not the compiled
    one, and sleeps ``seconds`` before reducing its block (phase 6): its peers' compiled
    rounds then give up waiting and hand their calls over, or time out."""
    import time

    from gpurt.transports import shm_direct

    python_direct(comm)
    staged = shm_direct._staged_allreduce

    def slow(d):
        if d.phase == 6:
            time.sleep(seconds)
        return staged(d)

    shm_direct._staged_allreduce = slow


def outcome(fn) -> tuple[str, float]:
    """Run ``fn()``: ("ok" or "Type: message", seconds it took) — for the case scripts
    that report how a call ended rather than assert it."""
    import time
    t0 = time.monotonic()
    try:
        fn()
        text = "ok"
    except BaseException as e:  # noqa: BLE001 - reported
        text = f"{type(e).__name__}: {e}"
    return text, round(time.monotonic() - t0, 3)


def until_stopped(acc, cap: float = 15.0) -> bool:
    """Wait (up to ``cap`` s) until ``acc`` (an shm_direct ``Access``) would stop its share:
    another thread aborts or closes this rank's communicator, or a peer published its
    error.  A case script's slow share waits for this instead of sleeping a fixed time in
    which the abort is assumed to come (on a loaded machine the aborting thread can run
    late, and the call then completes normally)."""
    import time
    t0 = time.monotonic()
    while time.monotonic() - t0 < cap:
        try:
            acc.stop_if_failed()
        except Exception:  # noqa: BLE001 - the stop it would raise
            return True
        time.sleep(1e-4)
    return False


def wait_for_file(path: str, cap: float = 15.0) -> bool:
    """Wait (up to ``cap`` s) for ``path`` to exist: a rank that must come into a call only
    after another rank's call ended waits for a marker the other writes, not a fixed sleep."""
    import os
    import time
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 >= cap:
            return False
        time.sleep(5e-4)
    return True


# -- point-to-point cases shared by the quick paths' scripts (quick_p2p_cases.py: shm,
#    tcp_quick_cases.py: tcp) ---------------------------------------------------------------
def payload(src: int, i: int, nbytes: int, dtype) -> np.ndarray:
    """Rank ``src``'s ``i``-th message of about ``nbytes`` bytes of ``dtype``: values that
    differ by rank, message and element."""
    dt = np.dtype(dtype)
    n = max(0, nbytes // dt.itemsize)
    if dt == np.bool_:
        return (np.arange(n) + src + i) % 3 == 0
    v = (np.arange(n, dtype=np.int64) * 7 + 1000 * src + i) % 251
    return v.astype(dt) + (1j if dt.kind == "c" else 0)


def ended(fn) -> str:
    """How ``fn()`` ended: "ok" or "Type: message" (``outcome`` without the time)."""
    return outcome(fn)[0]


def p2p_mismatches(world, comm, chk: Checks) -> None:
    """After the quick path is warm, between ranks 0 and 1, every kind of mismatch (dtype,
    tag, size; blocking and posted early) raises CollectiveMismatchError on the receiver,
    which is poisoned after it; each on a dup of ``comm``.  ``dtype-arrived``: the message
    has come before the receive is posted — the ``irecv`` itself raises (over tcp it
    returned a Request and only the wait raised)."""
    import time
    r = comm.rank
    for case in ("dtype", "tag", "size", "dtype-early", "dtype-arrived"):
        c = comm.dup()
        if r in (0, 1):
            for j in range(3):      # warm: the same dtype, quick on both sides
                if r == 0:
                    c.send(np.full(4, j, np.float32), 1, 3)
                else:
                    g = np.empty(4, np.float32)
                    c.recv(g, 0, 3)
                    chk.expect(f"warm {case} {j}", g, np.full(4, j, np.float32))
            if r == 0:
                c.send(np.ones(4, np.float32), 1, 3)
                if case == "dtype-arrived":
                    world.send(None, 1)         # (sent: it is in the ring or the socket)
            if r == 1:
                if case == "dtype-arrived":
                    world.recv(source=0)
                    time.sleep(0.2)
                    text = ended(lambda: c.irecv(np.empty(4, np.int32), 0, 3))
                    want = "float32 x 4 (16 bytes) and the receive int32 x 4"
                    if "in recv from rank 0 (tag 3): " not in text:
                        chk.bad.append(f"rank 1: {case}: the irecv's error: {text}")
                elif case == "dtype":
                    text = ended(lambda: c.recv(np.empty(4, np.int32), 0, 3))
                    want = "float32 x 4 (16 bytes) and the receive int32 x 4"
                elif case == "tag":
                    text = ended(lambda: c.recv(np.empty(4, np.float32), 0, 4))
                    want = "tag 3"
                elif case == "size":
                    text = ended(lambda: c.recv(np.empty(5, np.float32), 0, 3))
                    want = "rank 0"
                else:
                    text = ended(lambda: c.irecv(np.empty(4, np.int32), 0, 3).wait())
                    want = "float32 x 4 (16 bytes) and the receive int32 x 4"
                chk.count += 1
                if not text.startswith("CollectiveMismatchError: rank 1:") or want not in text:
                    chk.bad.append(f"rank 1: {case} mismatch: {text}")
                chk.count += 1
                after = ended(lambda: c.send(np.ones(1), 0))
                if not after.startswith("CommunicatorClosed"):
                    chk.bad.append(f"rank 1: after the {case} mismatch: {after}")
        world.Barrier()
        c.abort() if r in (0, 1) else None
        c.close()


def p2p_early_timeout(world, comm, chk: Checks) -> None:
    """Between ranks 0 and 1: a receive posted early times out (still in flight), then
    completes; test() polls another to completion."""
    r = comm.rank
    c = comm.dup()
    if r == 1:
        c.recv(np.empty(2, np.float64), 0, 8)     # (warm)
        q = c.irecv(got := np.empty(3, np.float64), 0, 9)
        text = ended(lambda: q.wait(timeout=0.3))
        chk.count += 1
        if not text.startswith("CollectiveTimeout: rank 1: recv from rank 0 (tag 9) did not "
                               "complete within 0.3 s; still waiting for rank(s) [0]"):
            chk.bad.append(f"rank 1: early receive's timeout: {text}")
        world.send(None, 0)
        q.wait()
        chk.expect("after the timeout", got, np.arange(3.0))
        q2 = c.irecv(got2 := np.empty(3, np.float64), 0, 10)
        world.send(None, 0)
        while not q2.test():
            pass
        chk.expect("polled", got2, np.arange(3.0) + 1)
    elif r == 0:
        c.send(np.zeros(2), 1, 8)
        world.recv(source=1)
        c.send(np.arange(3.0), 1, 9)
        world.recv(source=1)
        c.send(np.arange(3.0) + 1, 1, 10)
    world.Barrier()
    c.close()


def flight_names_a_send(comm, chk: Checks, right: int) -> None:
    """The flight recorder holds a done record of a send to ``right`` (tags 0-4), named
    as the general path names one."""
    fl = comm.flight
    if fl is None:
        return
    chk.count += 1
    names = {e["algorithm"] for e in fl.records() if e["kind"] == "p2p" and e["state"] == "done"}
    if not any(f"send to rank {right} tag {t}" in names for t in range(5)):
        chk.bad.append(f"rank {comm.rank}: no done flight record of a send: {sorted(names)[:5]}")


def p2p_exchange(comm, chk: Checks, i: int, size: int, dt, mode: str, burst: int = 12) -> bool:
    """Exchange ``i`` of the ring (every rank sends to its right neighbour and receives from
    its left one) of ``size`` bytes of ``dt``, checked exactly, in ``mode``: ``block``
    (send/recv, the even ranks sending first), ``irecv-first``, ``isend-first``, or
    ``burst`` (``burst`` messages sent before any receive is posted).  False for another
    mode (the caller's own)."""
    r, p = comm.rank, comm.size
    right, left = (r + 1) % p, (r - 1) % p
    x, want = payload(r, i, size, dt), payload(left, i, size, dt)
    got = np.full_like(want, 1) if want.size else np.empty_like(want)
    tag = i % 5
    what = f"#{i} {mode} {size}B {np.dtype(dt).name}"
    if mode == "block":
        if r % 2 == 0:
            comm.send(x, right, tag)
            comm.recv(got, left, tag)
        else:
            comm.recv(got, left, tag)
            comm.send(x, right, tag)
    elif mode == "irecv-first":
        a = comm.irecv(got, left, tag)
        b = comm.isend(x, right, tag)
        (b.wait(), a.wait()) if i % 2 else (a.wait(), b.wait())
    elif mode == "isend-first":
        b = comm.isend(x, right, tag)
        comm.recv(got, left, tag)
        b.wait()
    elif mode == "burst":
        xs = [payload(r, i + j, size, dt) for j in range(burst)]
        ws = [payload(left, i + j, size, dt) for j in range(burst)]
        gs = [np.empty_like(w) for w in ws]
        sends = [comm.isend(xs[j], right, j) for j in range(burst)]
        if i % 2:
            for j in range(burst):
                comm.recv(gs[j], left, j)
        else:
            recvs = [comm.irecv(gs[j], left, j) for j in range(burst)]
            for q in reversed(recvs):
                q.wait()
        for q in sends:
            q.wait()
        for j in range(burst):
            chk.expect(f"{what}.{j}", gs[j], ws[j])
        return True
    else:
        return False
    chk.expect(what, got, want)
    return True


def p2p_progress_rule(world, comm, chk: Checks, sizes) -> None:
    """MPI's progress rule, between ranks 0 and 1 on two dups c1, c2 of ``comm``: rank 0
    posts a receive on c1 (quick: its Request) and waits in c2's barrier; rank 1 sends
    it messages of ``sizes`` bytes on c1 (message k filled with k), more than the
    transport holds, so its sends need rank 0's wait on c2 to advance c1's receive,
    then joins the barrier.  Rank 0 receives the rest afterwards; exact values."""
    import time

    r = comm.rank
    c1, c2 = comm.dup(), comm.dup()
    if r == 0:
        first = np.zeros(sizes[0], np.uint8)
        q = c1.irecv(first, 1)
        text = ended(lambda: c2.barrier(timeout=30))
        chk.count += 1
        if text != "ok":
            chk.bad.append(f"rank 0: barrier with a receive posted early: {text}")
        q.wait()
        chk.expect("early receive, advanced elsewhere", first, np.zeros(sizes[0], np.uint8))
        for k, n in enumerate(sizes[1:], 1):
            g = np.zeros(n, np.uint8)
            c1.recv(g, 1)
            chk.expect(f"after it, #{k}", g, np.full(n, k % 251, np.uint8))
    elif r == 1:
        time.sleep(0.3)                 # (rank 0 is in the barrier by then)
        for k, n in enumerate(sizes):
            c1.send(np.full(n, k % 251, np.uint8), 0)
        text = ended(lambda: c2.barrier(timeout=30))
        chk.count += 1
        if text != "ok":
            chk.bad.append(f"rank 1: barrier after filling the transport: {text}")
    else:
        c2.barrier(timeout=30)
    world.Barrier()
    c1.close()
    c2.close()


def p2p_sweep(rounds: int, sizes, dtypes, modes):
    """(i, size, dtype, mode) of a case script's exchanges: ``rounds`` times every size in
    every mode, the dtypes in turn (``i`` counts from 1)."""
    i = 0
    for _ in range(rounds):
        for size in sizes:
            for mode in modes:
                i += 1
                yield i, size, dtypes[i % len(dtypes)], mode
