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
