"""gpurt and MPI's own life cycle (tests/test_processes.py::test_mpi_life_cycle): a program
that leaves initialising MPI to gpurt, and one that finalizes MPI while gpurt
communicators exist.  Each rank prints one ``rank R: ...`` record."""

from __future__ import annotations

import sys

import mpi4py
import numpy as np

mode = sys.argv[1]
if mode == "late_init":
    import atexit

    @atexit.register        # (registered before gpurt's: runs after it)
    def _at_exit():
        from mpi4py import MPI
        print(f"rank {MPI.COMM_WORLD.rank if not MPI.Is_finalized() else RANK}: at exit "
              f"finalized {MPI.Is_finalized()}", flush=True)


    mpi4py.rc.initialize = False          # the program does not start MPI itself
    mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI  # noqa: E402

import gpurt  # noqa: E402

if mode == "late_init":
    assert not MPI.Is_initialized()
    comm = gpurt.init()                   # initialises MPI at the level rc asks for
    x = np.full(5, comm.rank + 1.0)
    comm.allreduce(x)
    RANK = comm.rank
    print(f"rank {comm.rank}: late_init size {comm.size} level {MPI.Query_thread()} "
          f"sum {x.tolist()}", flush=True)
elif mode == "after_finalize":
    comm = gpurt.init()
    sub = comm.split(comm.rank % 2)
    MPI.Finalize()
    x = np.full(3, comm.rank + 1.0)
    comm.allreduce(x)                     # made before: gpurt's transports, not MPI
    sub.allreduce(y := np.ones(2))
    made = []
    for what, f in (("split", lambda: comm.split(0)), ("dup", comm.dup),
                    ("Communicator", lambda: gpurt.Communicator(MPI.COMM_WORLD))):
        try:
            f()
            made.append(f"{what}: made")
        except gpurt.CommunicatorClosed as e:
            made.append(f"{what}: {e}")
    print(f"rank {comm.rank}: after_finalize sum {x.tolist()} sub {y.tolist()} | "
          + " | ".join(made), flush=True)
    comm.close()
    sub.close()
elif mode == "null":
    world = MPI.COMM_WORLD
    d = world.Dup()
    d.Free()
    try:
        gpurt.Communicator(d)
        print(f"rank {world.rank}: null made", flush=True)
    except TypeError as e:
        print(f"rank {world.rank}: null {e}", flush=True)
