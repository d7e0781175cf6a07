"""Multi-node allreduce on a virtual cluster: hierarchical vs flat ring vs MPICH over TCP.

    sudo python benchmarks/multinode.py [--nodes 2] [--ppn 2] [--rate 1gbit] [--bytes 64M]
                                        [--iters 5] [--rounds 2] [--json FILE]

Brings up ``tests/cluster``'s virtual cluster (network namespaces with private /dev/shm
and PID namespaces, joined by a bridge, every node's uplink shaped with ``tc tbf`` to
``--rate``), then runs ``benchmarks/mn_allreduce.py`` under MPICH hydra across it, one
launch per library, alternating, ``--rounds`` times:

* ``gpurt`` with the tuner's choice (the hierarchical schedule: reduce-scatter inside the
  node, allreduce along the rails between nodes, allgather inside the node, pipelined);
* ``gpurt`` forced onto the flat ring (``algo="ring"``) over the same cluster;
* MPICH's own ``MPI_Allreduce``, forced onto TCP (``MPIR_CVAR_CH4_NETMOD=ofi
  FI_PROVIDER=tcp``: its default path cannot cross the namespaces).

Link-bound ideal: in an allreduce of S bytes over N nodes, each node must send (and
receive) ``2 (N-1)/N · S`` bytes across its link on average (2 (N-1) S in all: the
bandwidth bound of Patarasuk & Yuan) — for 2 nodes, S per direction — so no schedule
beats ``t_ideal = 2 (N-1)/N · S / rate``; "of ideal" is ``t_ideal / t``.  TCP/IP and Ethernet headers take ~4 % of the frames, so ~96 % is the
practical ceiling.  Every run's bytes per iteration on each node's link are read from the
node's own counters and printed: a run whose links carried less than the bound in all is
rejected (shared memory or CMA must not have carried the data).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpurt.launch.vcluster import MPICH_TCP_ENV, VirtualCluster, available  # noqa: E402


def rate_bytes(rate: str) -> float:
    r = rate.strip().lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * mult / 8
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit or 500mbit")


def parse_bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


CONFIGS = (("gpurt", "auto", "gpurt (tuner: hierarchical)"),
           ("gpurt", "ring", "gpurt flat ring"),
           ("mpi", "auto", "MPICH over TCP"))


def run_one(vc: VirtualCluster, ppn: int, lib: str, algo: str, size: str, iters: int,
            extra_env: dict) -> dict:
    argv = [sys.executable, str(ROOT / "benchmarks" / "mn_allreduce.py"), "--lib", lib,
            "--algo", algo, "--bytes", size, "--iters", str(iters)]
    env = dict(MPICH_TCP_ENV)
    env.update(extra_env)
    env.setdefault("PYTHONPATH", str(ROOT))
    p = vc.mpiexec(ppn, argv, env=env, timeout=900, cwd=str(ROOT))
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"{lib}/{algo} failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ppn", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--bytes", default="64M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--env", action="append", default=[],
                    help="K=V for the gpurt runs (e.g. GPURT_TCP_STRIPES=2)")
    a = ap.parse_args()
    ok, why = available()
    if not ok:
        print(f"cannot build a virtual cluster here: {why}", file=sys.stderr)
        return 2
    S = parse_bytes(a.bytes)
    rate = rate_bytes(a.rate)
    N = a.nodes
    ideal = 2 * (N - 1) / N * S / rate
    need = 2 * (N - 1) / N * S          # bytes each node must send per iteration
    extra = dict(kv.split("=", 1) for kv in a.env)
    runs: dict[str, list[dict]] = {label: [] for _, _, label in CONFIGS}
    with VirtualCluster(nodes=N, rate=a.rate) as vc:
        for rnd in range(a.rounds):
            for lib, algo, label in CONFIGS:
                r = run_one(vc, a.ppn, lib, algo, a.bytes, a.iters,
                            extra if lib == "gpurt" else {})
                per_iter = [tx / a.iters for _, tx, _ in r["links"]]
                r["link_tx_per_iter"] = per_iter
                if r["wrong"]:
                    raise SystemExit(f"{label}: {r['wrong']} wrong elements")
                if sum(per_iter) < 0.95 * N * need:
                    raise SystemExit(f"{label}: only {sum(per_iter) / 1e6:.1f} MB/iteration "
                                     f"crossed the links, {N * need / 1e6:.1f} MB must: the "
                                     f"data did not go over the network")
                runs[label].append(r)
                print(f"round {rnd + 1}: {label:<28} median {r['median_s']:.3f} s "
                      f"({r['algorithm'] or 'MPI_Allreduce'}), link tx/iter "
                      + ", ".join(f"{b / 1e6:.1f} MB" for b in per_iter), flush=True)
    med = {label: statistics.median(x["median_s"] for x in rs) for label, rs in runs.items()}
    hier, ring, mpi = (med[label] for _, _, label in CONFIGS)
    print()
    print(f"allreduce of {S / (1 << 20):g} MiB float32 on {N} nodes x {a.ppn} ranks, links "
          f"shaped to {a.rate} ({rate / 1e6:.0f} MB/s); link-bound ideal "
          f"2(N-1)/N*S/rate = {ideal:.3f} s")
    print(f"{'':<30}{'median s':>10}{'of ideal':>10}{'busbw GB/s':>12}")
    p = N * a.ppn
    for label, t in med.items():
        busbw = 2 * (p - 1) / p * S / t / 1e9
        print(f"{label:<30}{t:>10.3f}{ideal / t:>9.0%}{busbw:>12.3f}")
    print(f"hierarchical vs flat ring: {ring / hier:.2f}x   vs MPICH/TCP: {mpi / hier:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"nodes": N, "ppn": a.ppn, "rate": a.rate, "bytes": S,
                       "ideal_s": ideal, "median_s": med, "runs": runs,
                       "ratio_vs_ring": ring / hier, "ratio_vs_mpi": mpi / hier}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
