"""Run under ``mpiexec`` on several nodes (a virtual cluster, or MPICH cliques): checks
what a multi-node communicator must be, then every collective with exact results.

    mpiexec ... python tests/multinode_check.py NODES [sweep|transport]

* MPI's view: ``comm.nnodes == NODES``; ranks on different nodes are connected by a
  network transport (never ``shm``; ``GPURT_TEST_NET=verbs`` names the one expected), ranks on one node by ``shm`` (unless
  ``GPURT_TRANSPORTS`` says otherwise);
* the hierarchical schedule is what the tuner picks for large allreduce, reduce_scatter,
  allgather, broadcast and reduce (``comm.last_algorithm``), and gives exact results;
* ``sweep``: every collective x every algorithm (hierarchical included) x sizes x roots
  (``tests/mpi_sweep.py algorithms``); ``transport``: its share that concerns the transports
  (every algorithm's messages at every size, ``Sweep.algorithms(full=False)``).

Rank 0 prints one JSON line ``MULTINODE {...}`` with the facts (and a ``FAIL`` line per
failure before it) -- into the file ``$MULTINODE_OUT`` instead when that is set
(``tests/rdma/guest_suite.sh``'s ``after`` prints it once mpiexec has ended: across two
guests, mpiexec forwards a remote rank's late stderr into the middle of rank 0's line);
exit status non-zero if any rank saw a failure.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import gpurt  # noqa: E402
from mpi_sweep import Sweep  # noqa: E402


def main() -> int:
    want_nodes = int(sys.argv[1])
    comm = gpurt.init()
    sw = Sweep(comm)
    fails = sw.failures
    if comm.nnodes != want_nodes:
        fails.append(f"comm.nnodes is {comm.nnodes}, expected {want_nodes}")
    forced = os.environ.get("GPURT_TRANSPORTS", "")
    net = os.environ.get("GPURT_TEST_NET", "")       # the transport expected between nodes
    for peer, name in comm.transport_of.items():
        cross = comm.topo.node_of[peer] != comm.node
        if cross and name == "shm":
            fails.append(f"rank {comm.rank} reaches rank {peer} on another node over shm")
        if cross and net and name != net:
            fails.append(f"rank {comm.rank} reaches rank {peer} on another node over {name}, "
                         f"not {net}")
        if not cross and not forced and name != "shm":
            fails.append(f"rank {comm.rank} reaches rank {peer} on its node over {name}")
    chosen = {}
    p = comm.size
    big = 1 << 20     # elements: 4 MiB of float32
    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        n = big // p if coll in ("reduce_scatter", "allgather") else big
        sw.safe(coll, None, n, np.float32, gpurt.SUM if coll in (
            "allreduce", "reduce_scatter", "reduce") else None, p - 1, False)
        chosen[coll] = comm.last_algorithm
        several = max(len(rs) for rs in comm.topo.local_ranks) > 1  # else it is the flat one
        if several and coll in comm.tuner.hier and comm.last_algorithm != "hierarchical":
            fails.append(f"{coll} of {n} float32 used {comm.last_algorithm}, not hierarchical")
    if "sweep" in sys.argv[2:]:
        sw.algorithms()
    elif "transport" in sys.argv[2:]:     # the sweep's transport share (mpi_sweep.py)
        sw.transport()
    facts = {
        "host": socket.gethostname(), "node": comm.node, "rank": comm.rank,
        "transports": sorted(set(comm.transport_of.values())),
        "shm_dev": os.stat("/dev/shm").st_dev,
        "machine": list(comm.machine), "spin": comm.engine.spin, "local": comm.local_size,
        "boot": gpurt.wait.machine_id(), "mask": gpurt.wait.affinity_mask(),
        "node_over": gpurt.wait.oversubscribed(comm.local_size),
    }
    every = comm.mpi.gather(facts, 0)
    allfails = comm.mpi.gather(fails, 0)
    cases = comm.mpi.reduce(sw.cases, op=__import__("mpi4py").MPI.SUM, root=0)
    explain = comm.explain("allreduce", 64 << 20)
    if comm.rank == 0:
        lines = [f"FAIL rank {q}: {f}" for q, fl in enumerate(allfails) for f in fl[:10]]
        lines.append("MULTINODE " + json.dumps({
            "nnodes": comm.nnodes, "size": p, "ranks": every, "chosen": chosen,
            "cases": cases, "failures": sum(len(f) for f in allfails),
            "explain": explain}))
        dest = os.environ.get("MULTINODE_OUT")
        if dest:
            with open(dest, "w") as f:
                f.write("\n".join(lines) + "\n")
        else:
            print("\n".join(lines), flush=True)
    bad = comm.mpi.allreduce(len(fails))
    comm.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
