"""Who am I, where am I, what can I see: an mpi4py probe for the virtual cluster.

Every rank reports its rank, host name, node (from
``MPI_Comm_split_type(COMM_TYPE_SHARED)``), the device/inode of ``/dev/shm`` and its
namespace ids; it drops a file into /dev/shm and checks which ranks' files it can see
(exactly those on its own node, if /dev/shm is private per node); then all ranks allreduce
``--bytes`` bytes.  Rank 0 prints one line, ``VCLUSTER_HELLO {json}``::

    {"size": 4, "nodes": 2, "node_hosts": [["vnode0"], ["vnode1"]],
     "ranks": [{"rank": 0, "host": "vnode0", "node": 0, "node_rank": 0, "node_size": 2,
                "shm": [dev, ino], "sees": [0, 1], "pid": ..., "cwd": ...,
                "ns": {"net": ino, ...}}, ...],
     "hosts_match_nodes": true, "shm_private": true,
     "ns_per_node": {"net": true, "uts": true, "ipc": true, "mnt": true, "pid": true},
     "allreduce": {"bytes": ..., "ok": true, "seconds": ...}, "ok": true}

and exits 1 if any check failed (``ok`` false; ``ns_per_node`` is reported, not required:
a cluster built with ``pid_ns=False`` shares the host's PID namespace).  Run it with
``python -m tests.cluster.vcluster --ppn 2 --mpich-tcp -- python tests/cluster/hello.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI


NAMESPACES = ("net", "uts", "ipc", "mnt", "pid")


def namespaces() -> dict[str, int]:
    """This process's namespace ids (inode numbers), by kind."""
    out = {}
    for kind in NAMESPACES:
        try:
            out[kind] = os.stat(f"/proc/self/ns/{kind}").st_ino
        except OSError:
            out[kind] = -1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 20, help="allreduce size (bytes)")
    a = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    leader = node_comm.bcast(rank, root=0)           # world rank of the node's first rank
    leaders = sorted(set(comm.allgather(leader)))
    node = leaders.index(leader)

    st = os.stat("/dev/shm")
    token = comm.bcast(os.urandom(8).hex() if rank == 0 else None, root=0)
    mark = f"/dev/shm/vcluster-hello-{token}-{rank}"
    with open(mark, "w") as f:
        f.write(socket.gethostname())
    comm.Barrier()
    sees = [r for r in range(size) if os.path.exists(f"/dev/shm/vcluster-hello-{token}-{r}")]
    comm.Barrier()
    os.unlink(mark)

    n = max(1, a.bytes // 8)
    send = np.ones(n, dtype=np.float64)
    recv = np.zeros(n, dtype=np.float64)
    comm.Barrier()
    t0 = time.perf_counter()
    comm.Allreduce(send, recv, op=MPI.SUM)
    seconds = time.perf_counter() - t0
    reduced_ok = bool(np.all(recv == size))

    info = {"rank": rank, "host": socket.gethostname(), "node": node,
            "node_rank": node_comm.Get_rank(), "node_size": node_comm.Get_size(),
            "shm": [st.st_dev, st.st_ino], "sees": sees, "pid": os.getpid(),
            "cwd": os.getcwd(), "ns": namespaces()}
    infos = comm.gather(info, root=0)
    all_ok = comm.reduce(reduced_ok, op=MPI.LAND, root=0)
    worst = comm.reduce(seconds, op=MPI.MAX, root=0)
    node_comm.Free()
    if rank != 0:
        return 0

    node_hosts = [sorted({i["host"] for i in infos if i["node"] == k})
                  for k in range(len(leaders))]
    hosts_match_nodes = (all(len(h) == 1 for h in node_hosts)
                         and len({h[0] for h in node_hosts}) == len(node_hosts))
    shm_private = all(i["sees"] == [j["rank"] for j in infos if j["node"] == i["node"]]
                      for i in infos)
    # per kind of namespace: ranks share one exactly when they share a node
    ns_per_node = {kind: all((i["ns"][kind] == j["ns"][kind]) == (i["node"] == j["node"])
                             for i in infos for j in infos)
                   for kind in NAMESPACES}
    summary = {"size": size, "nodes": len(leaders), "node_hosts": node_hosts, "ranks": infos,
               "hosts_match_nodes": hosts_match_nodes, "shm_private": shm_private,
               "ns_per_node": ns_per_node,
               "allreduce": {"bytes": n * 8, "ok": bool(all_ok), "seconds": worst}}
    summary["ok"] = hosts_match_nodes and shm_private and bool(all_ok)
    print("VCLUSTER_HELLO " + json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
