"""``gpurt topo``: who is where and which transport each pair of ranks uses.

In the spirit of ``nvidia-smi topo -m``: nodes with their host and ranks, each rank's
local rank and pid, the rails (ranks with the same local rank on every node), the leaders
(local rank 0 of each node), and a rank x rank matrix of ``comm.transport_of[peer]``
("self" on the diagonal, "-" where there is none).

Run under any launcher (``mpiexec -n 4 gpurt topo``) it reports on that job; ``gpurt
topo -n 4`` launches itself through ``gpurt launch``'s machinery
(``python -m gpurt.launch.topo`` on every rank).  Rank 0 prints.  Where a communicator
cannot be created (e.g. ``GPURT_TRANSPORTS=shm`` on several nodes), the topology still
comes from MPI, each pair shows the transport it would get, marked "?", or "-" where none
could reach it, and the reason is printed.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import click

from gpurt.launch.launcher import (RANK_VARS, LaunchError, find_launcher, job_env,
                                   launch_options, run_job)
from gpurt.topology import rank_ranges


def gather() -> dict | None:
    """Collective over MPI.COMM_WORLD: the topology as a dict on rank 0, None elsewhere."""
    from mpi4py import MPI

    import gpurt
    from gpurt.topology import Topology

    world = MPI.COMM_WORLD
    error = ""
    comm = None
    try:
        comm = gpurt.Communicator(world)
        topo, pids = comm.topo, list(comm.pids)
        row = [comm.transport_of.get(p, "-") if p != comm.rank else "self"
               for p in range(comm.size)]
    except gpurt.GpurtError as e:   # e.g. several nodes: the topology, without transports
        error = f"{type(e).__name__}: {e}"
        node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
        leader = node_comm.bcast(world.rank, 0)
        node_comm.Free()
        info = world.allgather((leader, socket.gethostname(), os.getpid()))
        topo = Topology.from_ids([i[0] for i in info], [i[1] for i in info])
        pids = [i[2] for i in info]
        row = [_would_use(topo, world.rank, p) for p in range(world.size)]
    hosts = world.gather(socket.gethostname(), 0)
    rows = world.gather(row, 0)
    errors = world.gather(error, 0)
    if comm is not None:
        comm.close()
    if world.rank != 0:
        return None
    nl = max((len(rs) for rs in topo.local_ranks), default=0)
    return {
        "size": topo.size,
        "nnodes": topo.nnodes,
        "nodes": [{"node": i, "host": topo.hosts[i], "ranks": list(rs), "leader": rs[0]}
                  for i, rs in enumerate(topo.local_ranks)],
        "ranks": [{"rank": r, "node": topo.node_of[r], "local_rank": topo.local_rank(r),
                   "host": hosts[r], "pid": pids[r]} for r in range(topo.size)],
        "rails": [list(topo.rail(lr)) for lr in range(nl)],
        "leaders": list(topo.leaders),
        "transport": rows,
        "error": next((e for e in errors if e), ""),
    }


def _would_use(topo, rank: int, peer: int) -> str:
    """The transport the pair would get (the communicator could not be created)."""
    if peer == rank:
        return "self"
    try:
        from gpurt.transports import selected

        for name, cls in selected():
            if cls().can_connect(topo, rank, peer):
                return name + "?"
    except Exception:  # noqa: BLE001 - only a hint
        pass
    return "-"


def render(d: dict) -> str:
    out = [f"{d['size']} rank(s) on {d['nnodes']} node(s)", ""]
    out.append("nodes:")
    for n in d["nodes"]:
        out.append(f"  node {n['node']}  host {n['host']}  ranks {rank_ranges(n['ranks'])}  "
                   f"leader {n['leader']}")
    out.append("ranks:")
    out.append(f"  {'rank':>4}  {'node':>4}  {'local':>5}  {'pid':>8}  host")
    for r in d["ranks"]:
        out.append(f"  {r['rank']:>4}  {r['node']:>4}  {r['local_rank']:>5}  {r['pid']:>8}  "
                   f"{r['host']}")
    out.append("rails (same local rank on every node):")
    for i, rail in enumerate(d["rails"]):
        out.append(f"  rail {i}: {rank_ranges(rail)}")
    out.append(f"leaders (local rank 0): {rank_ranges(d['leaders'])}")
    out.append("")
    p = d["size"]
    w = max([4, len(f"r{p - 1}")] + [len(t) for row in d["transport"] for t in row]) + 2
    out.append(" " * w + "".join(f"{'r' + str(c):>{w}}" for c in range(p)))
    for r, row in enumerate(d["transport"]):
        out.append(f"{'r' + str(r):<{w}}" + "".join(f"{t:>{w}}" for t in row))
    out.append("")
    out.append("Legend: self = the rank itself; shm = shared memory (same node); tcp = TCP "
               "sockets (between nodes); - = no transport")
    if d.get("error"):
        out.append("note: no gpurt communicator could be created over these ranks, so "
                   "nothing is connected (NAME? = what the pair would use):")
        out.append(f"  {d['error']}")
    return "\n".join(out)


def _under_launcher() -> bool:
    return any(os.environ.get(v, "").isdigit() for v in RANK_VARS)


def worker(as_json: bool) -> int:
    d = gather()
    if d is not None:
        click.echo(json.dumps(d, indent=2) if as_json else render(d))
    return 0


def topo_command():
    @click.command()
    @click.option("-n", "--nranks", type=click.IntRange(min=1),
                  help="Launch N ranks and report on them (default: the job this runs in, "
                       "or this process alone).")
    @launch_options
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    @click.option("--timeout", type=float, default=120, show_default=True,
                  help="With -n: bound the job (seconds).")
    def topo(nranks, hosts, hostfile, launcher_kind, as_json, timeout):
        """Nodes, ranks, rails, leaders and the transport each pair of ranks uses.

        \b
        Examples:
          gpurt topo -n 4                 launch 4 ranks here and show them
          gpurt topo -n 8 --hosts a:4,b:4 --json
          mpiexec -n 4 gpurt topo         report on the job it runs in
        """
        if nranks is None:
            sys.exit(worker(as_json))
        if _under_launcher():
            raise click.UsageError("gpurt topo -n: already running under a launcher; "
                                   "drop -n to report on this job")
        try:
            launcher = find_launcher(launcher_kind)
            prog = [sys.executable, "-m", "gpurt.launch.topo"] + (["--json"] if as_json else [])
            res = run_job(launcher, nranks, prog, hosts=hosts, hostfile=hostfile,
                          env=job_env({}), timeout=timeout)
        except LaunchError as e:
            raise click.UsageError(str(e)) from None
        sys.exit(res.returncode)

    return topo


if __name__ == "__main__":
    sys.exit(worker("--json" in sys.argv[1:]))
