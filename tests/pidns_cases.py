"""Local peers whose pid does not name them here (tests/test_processes.py).

    ns:    run as ``mpiexec -n 1 python tests/pidns_cases.py ns : -n 1 unshare --pid --fork
           --mount-proc python tests/pidns_cases.py ns`` — two ranks on one node (shared
           /dev/shm and IPC), in two pid namespaces: ping-pong must work, not fail with
           "has exited" (rank 0's pid is no process in rank 1's namespace).
    reuse: run as ``unshare --pid --fork --mount-proc mpiexec -n 1 python
           tests/pidns_cases.py reuse`` — spawns a child that leaves (os._exit), then one
           that gets the same pid (ns_last_pid): the second one must get its message.

Prints ``RESULT <rank or child>: <outcome>`` lines."""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import gpurt

mode = sys.argv[1]
if mode == "ns":
    c = gpurt.init()
    x = np.ones(4, np.float32)
    try:
        for _ in range(3):
            if c.rank == 0:
                c.send(x, 1, timeout=10)
                c.recv(x, 1, timeout=10)
            else:
                c.recv(x, 0, timeout=10)
                c.send(x, 0, timeout=10)
        out = f"ok via {sorted({e.transport for e in c.endpoints.values()})}"
    except gpurt.GpurtError as e:
        out = f"{type(e).__name__}: {e}"
    print(f"RESULT {c.rank}: {out}", flush=True)
    os._exit(0)

parent = MPI.Comm.Get_parent()
if parent != MPI.COMM_NULL:          # a spawned child
    m = parent.Merge(True)
    c = gpurt.Communicator(m)
    x = np.zeros(4, np.float32)
    c.recv(x, 0, timeout=20)
    print(f"RESULT child got {x[0]:g}", flush=True)
    if sys.argv[2] == "die":
        os._exit(0)                  # leaves without a word
    c.close()
    m.Free()
    parent.Disconnect()
    sys.exit(0)
pids = []
for i in range(2):
    if i == 1:      # the next child gets the dead one's pid
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pids[0] - 1))
    inter = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "reuse", "die" if i == 0 else "live"],
                                1)
    m = inter.Merge(False)
    c = gpurt.Communicator(m)
    pids.append(c.pids[1])
    try:
        c.send(np.full(4, i + 1, np.float32), 1, timeout=10)
        out = "sent"
        if i == 0:
            time.sleep(0.5)
            try:
                c.send(np.full(4, i + 1, np.float32), 1, timeout=10)
                out = "second send completed"
            except gpurt.PeerFailure as e:
                out = f"sent, then PeerFailure: {e}"
    except gpurt.GpurtError as e:
        out = f"{type(e).__name__}: {e}"
    print(f"RESULT {i} pid {c.pids[1]}: {out}", flush=True)
    if i == 0:
        c.abort() if hasattr(c, "abort") else None
    else:
        c.close()
