"""Multi-node communicators: real processes on several "nodes", every collective exact.

Two ways to have several nodes on one machine:

* the virtual cluster (``tests/cluster``, needs root): network namespaces with their own
  host name, /dev/shm, IPC and PID namespaces, so shared memory (or CMA) between nodes is
  physically impossible; real hydra ``mpiexec`` across them.  Each test reads the links'
  byte counters and asserts that the collectives' data really crossed the network;
* MPICH's cliques (``MPIR_CVAR_NUM_CLIQUES``, any machine with the mpich wheel): MPI
  reports several nodes on one host; gpurt then connects ranks of different "nodes" with
  tcp over loopback.  Cheaper, but nothing stops a transport from cheating there, which
  is why the namespace tests exist.

``tests/multinode_check.py`` checks on every rank that the communicator sees the right
number of nodes, that no pair on different nodes uses ``shm``, that large allreduce,
reduce_scatter, allgather, broadcast and reduce go through the hierarchical schedule
(``comm.last_algorithm``), and with ``sweep`` runs every collective x algorithm
(hierarchical included) x sizes x roots with exact results (``tests/mpi_sweep.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import is_hydra, rank_records, run_mpi

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpurt.launch.vcluster import MPICH_TCP_ENV, VirtualCluster, available  # noqa: E402

CHECK = str(ROOT / "tests" / "multinode_check.py")
MiB = 1 << 20


def _summary(out: str) -> dict:
    line = next((ln for ln in out.splitlines() if ln.startswith("MULTINODE ")), None)
    assert line is not None, out[-3000:]
    return json.loads(line[len("MULTINODE "):])


def _assert_facts(s: dict, nnodes: int, size: int, sweep: bool) -> None:
    assert s["failures"] == 0
    assert s["nnodes"] == nnodes and s["size"] == size
    if nnodes < size:     # (one rank per node: the hierarchical schedule is the flat one)
        for coll, alg in s["chosen"].items():
            if coll in ("reduce_scatter", "allgather") and not _even(s):
                continue      # hierarchical only on nodes of equal size
            assert alg == "hierarchical", (coll, alg)
    if sweep:
        assert s["cases"] > 1000
    assert "hierarchical" in s["explain"] and "<- chosen" in s["explain"]


def _assert_one_machine(s: dict, size: int) -> None:
    """Every rank runs on this host (MPI's nodes are cliques, or namespaces, of it): all
    report one boot id, each counts the ranks whose CPUs overlap its own on the machine
    (all of them where no launcher pinned them apart) over the CPUs their affinity sets
    cover, and its waits do not spin where they outnumber those — nor where its node's
    ranks outnumber its own CPUs (before, a node of 2 ranks spun on a 2-core host that
    ran 4: docs/performance.md).  GPURT_SPIN_US is the default's 50 here (the env)."""
    from gpurt.wait import machine_load
    ranks = sorted(s["ranks"], key=lambda r: r["rank"])
    ids, masks = [r["boot"] for r in ranks], [r["mask"] for r in ranks]
    assert len(set(ids)) == 1, ids
    for r in ranks:
        want = list(machine_load(ids, masks, r["rank"]))
        assert r["machine"] == want, (r, want)
        if len(set(masks)) == 1:          # (no binding: one pool of CPUs for all)
            assert want == [size, bin(masks[0]).count("1")]
        crowded = want[0] > want[1]
        assert (r["spin"] == 0) == (crowded or r["node_over"]), r
        assert r["spin"] == 0 or r["spin"] == pytest.approx(50e-6), r


def _even(s: dict) -> bool:
    per = {}
    for r in s["ranks"]:
        per[r["node"]] = per.get(r["node"], 0) + 1
    return len(set(per.values())) == 1


# -- MPICH cliques: every machine ---------------------------------------------------------

def _loopback_bytes() -> int:
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


@pytest.mark.skipif(not is_hydra(), reason="MPICH cliques need the MPICH hydra mpiexec")
@pytest.mark.parametrize("n,cliques,sweep", [(4, 2, True), (5, 2, True), (3, 3, False)],
                         ids=["2x2-sweep", "3+2-sweep", "3x1"])
def test_cliques(n: int, cliques: int, sweep: bool) -> None:
    env = {"MPIR_CVAR_NUM_CLIQUES": str(cliques), "MPIR_CVAR_CLIQUES_BY_BLOCK": "1",
           "GPURT_SPIN_US": "50"}
    lo0 = _loopback_bytes()
    p = run_mpi(n, [CHECK, str(cliques)] + (["sweep"] if sweep else []), env=env, timeout=600)
    s = _summary(p.stdout)
    # "nodes" of one host talk tcp over loopback: the 4 MiB allreduce alone moves >= 4 MiB
    # there (other traffic on the machine only adds to the count)
    assert _loopback_bytes() - lo0 >= 4 * MiB
    _assert_facts(s, cliques, n, sweep)
    _assert_one_machine(s, n)
    for r in s["ranks"]:
        assert set(r["transports"]) <= {"shm", "tcp"}


@pytest.mark.skipif(not is_hydra(), reason="MPICH cliques need the MPICH hydra mpiexec")
@pytest.mark.parametrize("n,cliques,block,absent,mode",
                         [(10, 2, True, 7, "hier"), (9, 3, False, 4, "hier"),
                          (6, 2, True, 4, "hier_fold"), (6, 3, False, 4, "hier_fold"),
                          (4, 2, True, 3, "flat")],
                         ids=["2x5-blocks", "3x3-round-robin", "2x3-blocks-folding",
                              "3x2-round-robin-folding", "2x2-flat-folding"])
def test_agreement_across_nodes_is_hierarchical(n, cliques, block, absent, mode):
    """Several nodes with several ranks: the calls' headers (more than 8 ranks), or the
    headers and the folded calls' data (up to 8, where that saves two network messages
    per rank: not on 2 x 2, which stays flat), travel inside each node, then node to node
    (not from every rank to every rank); every collective exact, a mismatch (whose folded
    rows lie at another stride on the mismatched rank) named exactly and a rejected call
    raised on every rank, and a rank that never calls named by the ranks of its node,
    and among the ranks the others name (tests/agreement_cases.py)."""
    env = {"MPIR_CVAR_NUM_CLIQUES": str(cliques),
           "MPIR_CVAR_CLIQUES_BY_BLOCK": "1" if block else "0", "GPURT_FLIGHT": "0"}
    proc = run_mpi(n, [str(ROOT / "tests" / "agreement_cases.py"), str(absent)], env=env,
                   timeout=300)
    recs = rank_records(proc.stdout, "AGREE", n)
    nodes = recs[0]["nodes"]
    assert len(nodes) == cliques
    assert (nodes == sorted(nodes)) or not block
    if not block:      # (round robin: nodes are not blocks of consecutive ranks)
        assert any(rs != list(range(rs[0], rs[0] + len(rs))) for rs in nodes), nodes
    home = next(rs for rs in nodes if absent in rs)
    for q, rec in recs.items():
        assert rec["hier"] == (mode == "hier") and rec["hier_fold"] == (mode == "hier_fold"), \
            rec
        assert rec["checks"] == 16, rec
        assert rec["mismatch"] is True and rec["rejected"] is True, rec
        assert rec["rejected_s"] < 20, rec         # (the deadline here is 60 s)
        if q == absent:
            continue
        m = rec["missing"]
        if isinstance(m, str):      # a peer that timed out first told this rank
            assert m.startswith("relayed: ") and "did not complete" in m, rec
        elif q in home:
            assert m == [absent], rec
        else:
            assert absent in m and set(m) <= set(home), rec


# -- the virtual cluster: root only ---------------------------------------------------------

_OK, _WHY = available()


@pytest.fixture(scope="module")
def cluster3():
    if not _OK:
        pytest.skip(f"virtual cluster unavailable: {_WHY}")
    with VirtualCluster(nodes=3, rate=None) as vc:
        yield vc


@pytest.mark.parametrize("ranks,sweep", [([2, 2, 0], True), ([3, 3, 0], True),
                                         ([2, 2, 2], True), ([3, 2, 0], True)],
                         ids=["2x2", "2x3", "3x2", "3+2"])
def test_virtual_cluster(cluster3: VirtualCluster, ranks: list[int], sweep: bool) -> None:
    nodes = sum(1 for k in ranks if k)
    size = sum(ranks)
    with cluster3.traffic() as t:
        p = cluster3.mpiexec(ranks, [sys.executable, CHECK, str(nodes)]
                             + (["sweep"] if sweep else []),
                             env=dict(MPICH_TCP_ENV, GPURT_TIMEOUT="120",
                                      GPURT_SPIN_US="50"), timeout=900,
                             cwd=str(ROOT))
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    s = _summary(p.stdout)
    _assert_facts(s, nodes, size, sweep)
    _assert_one_machine(s, size)
    hosts = {r["node"]: r["host"] for r in s["ranks"]}
    devs = {r["node"]: r["shm_dev"] for r in s["ranks"]}
    assert len(set(hosts.values())) == nodes, hosts            # a host name per node
    assert len(set(devs.values())) == nodes, devs              # a /dev/shm per node
    # the 4 MiB allreduce alone makes every node send at least 4 MiB across its link
    for k in range(nodes):
        assert t.tx[k] >= 4 * MiB and t.rx[k] >= 4 * MiB, (k, t.tx, t.rx)


# -- a failure on one rank reaches every rank ---------------------------------------------

SPREAD = str(ROOT / "tests" / "spread_check.py")


@pytest.mark.parametrize("mode", ["mismatch", "abort"])
@pytest.mark.parametrize("cliques", [1, 2], ids=["one-node", "2-cliques"])
def test_a_failure_on_one_rank_is_an_error_on_every_rank(tmp_path, mode, cliques):
    """The failing rank catches its exception and keeps running (no exit, no closed
    connection): the others still raise within a second, not at their 30 s deadline."""
    if cliques > 1 and not is_hydra():
        pytest.skip("MPICH cliques need the MPICH hydra mpiexec")
    env = {"MPIR_CVAR_NUM_CLIQUES": str(cliques), "MPIR_CVAR_CLIQUES_BY_BLOCK": "1"} \
        if cliques > 1 else {}
    n = 4
    run_mpi(n, [SPREAD, mode, str(tmp_path)], env=env, timeout=120)
    res = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(n)]
    for r, x in enumerate(res):
        assert x["error"] is not None, (r, res)
        if mode == "abort" and r == 1:
            continue
        assert x["seconds"] < 2.0, (r, res)
    if mode == "abort":
        others = [x for r, x in enumerate(res) if r != 1]
        assert all(x["error"] == "PeerFailure" and "giving up on purpose" in x["message"]
                   for x in others), res
    else:   # every rank: by its own comparison of the calls, or told by the peer that made it
        assert all(x["error"] == "CollectiveMismatchError" for x in res), res


# -- a network partition ------------------------------------------------------------------

def test_network_partition_is_a_peer_failure_within_the_tcp_bound(tmp_path):
    """2 nodes x 1 rank looping over 1 MiB allreduces; the test takes node 1's link down
    (``ip link set ... down``): with GPURT_TCP_USER_TIMEOUT=2 both ranks raise PeerFailure
    within a few seconds (not the kernel's ~15 minutes, not their 60 s deadline)."""
    import subprocess
    import threading
    import time

    if not _OK:
        pytest.skip(f"virtual cluster unavailable: {_WHY}")
    with VirtualCluster(nodes=2, rate=None) as vc:
        done: dict = {}

        def job() -> None:
            try:
                done["p"] = vc.mpiexec([1, 1], [sys.executable, str(ROOT / "tests" /
                                                                  "partition_check.py"),
                                                str(tmp_path)],
                                       env=dict(MPICH_TCP_ENV, GPURT_TCP_USER_TIMEOUT="2"),
                                       timeout=120, cwd=str(ROOT))
            except Exception as e:  # noqa: BLE001 - reported below
                done["e"] = e

        th = threading.Thread(target=job, daemon=True)
        th.start()
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and th.is_alive(), done
            time.sleep(0.1)
        time.sleep(1.0)                                     # some allreduces complete
        ns, up = vc.namespaces[1], vc.uplinks[1]
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "dev", up, "down"],
                       check=True)
        cut = time.monotonic()
        while not all((tmp_path / f"rank-{r}.json").exists() for r in (0, 1)):
            assert time.monotonic() - cut < 45, "no PeerFailure 45 s after the cut"
            time.sleep(0.1)
        noticed = time.monotonic() - cut
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "dev", up, "up"],
                       check=True)                          # let hydra wind down
        th.join(150)
    res = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r, x in enumerate(res):
        assert x["error"] == "PeerFailure", res
        assert f"rank {1 - r}" in x["message"], res
        assert x["calls"] > 0
    assert noticed < 12, (noticed, res)
