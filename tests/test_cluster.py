"""The virtual cluster (tests/cluster/vcluster.py) is what multi-node tests stand on, so it
is tested itself: distinct host names per node, one MPI node per namespace, private
/dev/shm, MPI data that really crosses the (shaped) links, and no namespace, interface or
process of ours left behind -- after a normal exit, an exception, SIGTERM or SIGKILL.

Needs root and iproute2/util-linux; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:             # `tests.cluster` is imported from the checkout
    sys.path.insert(0, str(ROOT))

from tests.cluster.vcluster import (MPICH_TCP_ENV, VirtualCluster, available,  # noqa: E402
                                    hydra_mpiexec, reap_stale)

_OK, _WHY = available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"virtual cluster unavailable: {_WHY}")

HELLO = str(ROOT / "tests" / "cluster" / "hello.py")
MiB = 1 << 20


def needs_hydra():
    if hydra_mpiexec() is None:
        pytest.skip("no MPICH hydra mpiexec (pip install mpich)")


def hello(vc: VirtualCluster, ranks, *, nbytes: int = 64 * 1024, env=MPICH_TCP_ENV,
          check: bool = True) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run hello.py on ``vc``; return the process and rank 0's summary."""
    p = vc.mpiexec(ranks, [sys.executable, HELLO, "--bytes", str(nbytes)], env=env,
                   timeout=120, cwd=str(ROOT))
    summary = None
    for line in p.stdout.splitlines():
        if line.startswith("VCLUSTER_HELLO "):
            summary = json.loads(line.split(" ", 1)[1])
    if check:
        assert p.returncode == 0 and summary is not None, (
            f"hello.py exited {p.returncode}\n"
            f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    return p, summary


def ours_in_host(tag: str) -> list[str]:
    """Names of ours in ``ip netns list`` and ``ip link`` (host), and the state dir."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [w for w in (netns + " " + links).replace(":", " ").replace("@", " ").split()
             if w.startswith(tag)]
    if Path("/run/gpurt-vcluster", tag).exists():
        found.append(f"/run/gpurt-vcluster/{tag}")
    return found


LIVE_PROCS = ("import os\n"
              "def state(p):\n"
              "    try:\n"
              "        return open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]\n"
              "    except OSError:\n"
              "        return 'Z'\n"
              "print(sum(1 for p in os.listdir('/proc') if p.isdigit() and state(p) != 'Z'))")


def live_processes(vc: VirtualCluster, node: int) -> int:
    """How many live (not zombie) processes the node's /proc shows, this probe included."""
    r = vc.run(node, [sys.executable, "-c", LIVE_PROCS], capture_output=True, text=True,
               timeout=30)
    return int(r.stdout)


def shm_identity() -> tuple[int, int, frozenset]:
    """The host's /dev/shm: which file system, and the files the cluster's programs would
    leave there if it leaked (other jobs on the machine may come and go meanwhile)."""
    st = os.stat("/dev/shm")
    ours = frozenset(f for f in os.listdir("/dev/shm")
                     if f.startswith(("vcluster-", "gpurt-", "gpc")))
    return st.st_dev, st.st_ino, ours


@pytest.fixture(scope="module")
def vc2():
    """Two nodes, uplinks shaped to 1 Gbit/s as in FIELD-NOTES."""
    with VirtualCluster(nodes=2, rate="1gbit", burst="256kb", latency="50ms") as vc:
        yield vc


# --------------------------------------------------------------------------------------
# the nodes

@pytest.mark.parametrize("ranks", [[2, 2], [3, 2]], ids=["2x2", "3+2"])
def test_nodes_are_nodes(vc2, ranks):
    """Distinct host names, one MPI node per namespace (split_type), block placement,
    private /dev/shm and namespaces per node."""
    needs_hydra()
    _, s = hello(vc2, ranks)
    assert s["size"] == sum(ranks)
    assert s["nodes"] == 2
    assert s["node_hosts"] == [["vnode0"], ["vnode1"]]
    hosts = [r["host"] for r in sorted(s["ranks"], key=lambda r: r["rank"])]
    assert hosts == ["vnode0"] * ranks[0] + ["vnode1"] * ranks[1]      # block-wise
    assert [r["node_size"] for r in s["ranks"]] == [ranks[r["node"]] for r in s["ranks"]]
    assert s["hosts_match_nodes"] and s["shm_private"]
    assert all(s["ns_per_node"].values()), s["ns_per_node"]
    host_shm = os.stat("/dev/shm")
    shm = {tuple(r["shm"]) for r in s["ranks"]}
    assert len(shm) == 2 and (host_shm.st_dev, host_shm.st_ino) not in shm
    assert s["allreduce"]["ok"]


def test_three_uneven_nodes():
    needs_hydra()
    shm_before = shm_identity()
    with VirtualCluster(nodes=3, rate=None) as vc:
        _, s = hello(vc, [2, 1, 2])
    assert s["nodes"] == 3
    assert s["node_hosts"] == [["vnode0"], ["vnode1"], ["vnode2"]]
    assert [r["host"] for r in sorted(s["ranks"], key=lambda r: r["rank"])] == \
        ["vnode0", "vnode0", "vnode1", "vnode2", "vnode2"]
    assert [r["node"] for r in sorted(s["ranks"], key=lambda r: r["rank"])] == [0, 0, 1, 2, 2]
    assert s["shm_private"] and s["hosts_match_nodes"]
    assert shm_identity() == shm_before          # nothing leaked into the host's /dev/shm
    assert ours_in_host(vc.tag) == []


def test_node_commands_and_private_shm(vc2):
    """What one node writes to /dev/shm, neither the other node nor the host sees."""
    name = f"vcluster-test-{os.getpid()}"
    r = vc2.run(0, ["sh", "-c", f"hostname; echo hi > /dev/shm/{name}; ls /dev/shm"],
                capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.split()[0] == "vnode0" and name in r.stdout
    r = vc2.run(1, ["sh", "-c", f"hostname; test ! -e /dev/shm/{name}"],
                capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "vnode1"
    assert not os.path.exists(f"/dev/shm/{name}")
    # the node keeps its /dev/shm between commands (one tmpfs per node, not per process)
    r = vc2.run(0, ["cat", f"/dev/shm/{name}"], capture_output=True, text=True, timeout=30)
    assert r.stdout == "hi\n"
    vc2.run(0, ["rm", f"/dev/shm/{name}"], timeout=30)
    # a node sees only its own processes (PID namespace): its init and this probe
    assert live_processes(vc2, 1) == 2


def test_launcher_exec_is_ssh_like(vc2):
    """hydra's ``-launcher-exec``: ``WRAPPER [-x] HOST CMD...``, run via ``sh -c`` on the
    node owning HOST, exit status passed through; 255 for an unknown host (as ssh)."""
    w = vc2.launcher_exec
    r = subprocess.run([w, "-x", vc2.ips[1], "hostname; exit 7"], capture_output=True,
                       text=True, timeout=30)
    assert (r.returncode, r.stdout) == (7, "vnode1\n")
    r = subprocess.run([w, vc2.hostnames[0], "printf", "'%s|'", "'a  b'", "c"],
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (0, "a  b|c|")
    r = subprocess.run([w, "-x", "10.255.255.1", "true"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 255 and "not a node" in r.stderr


def test_command_line(vc2):
    cmd = vc2.command([3, 2], ["prog", "arg"], env={"A": "1"}, mpiexec_args=["-v"])
    assert cmd[:4] == ["ip", "netns", "exec", vc2.switch_ns]
    assert "A=1" in cmd
    i = cmd.index("-hosts")
    assert cmd[i + 1] == f"{vc2.ips[0]}:3,{vc2.ips[1]}:2" and cmd[i + 2:i + 4] == ["-n", "5"]
    assert cmd[cmd.index("-launcher-exec") + 1] == vc2.launcher_exec
    assert cmd[-3:] == ["-v", "prog", "arg"]


# --------------------------------------------------------------------------------------
# the links

def test_mpi_allreduce_over_tcp_crosses_the_link(vc2):
    """With MPICH_TCP_ENV, a 64 MiB allreduce between two nodes sends the whole vector
    each way over the link (the counters say so; the FIELD-NOTES trap moved ~20 KB)."""
    needs_hydra()
    n = 64 * MiB
    with vc2.traffic() as t:
        _, s = hello(vc2, [1, 1], nbytes=n, env=MPICH_TCP_ENV)
    assert s["allreduce"]["ok"] and s["allreduce"]["bytes"] == n
    for node in (0, 1):
        assert n <= t.tx[node] <= 1.1 * n + 2 * MiB, t
        assert n <= t.rx[node] <= 1.1 * n + 2 * MiB, t
    assert t.total >= 2 * n


def test_default_transport_cannot_shortcut(vc2):
    """Without any transport settings, MPICH either fails or moves the data over the
    link: the nodes leave it no memory path (private /dev/shm, IPC and PIDs)."""
    needs_hydra()
    n = 16 * MiB
    with vc2.traffic() as t:
        p, s = hello(vc2, [1, 1], nbytes=n, env={}, check=False)
    if p.returncode == 0:
        assert s["allreduce"]["ok"]
        assert t.tx[0] >= n and t.tx[1] >= n, t


def test_shaped_rate(vc2):
    """A 64 MiB TCP stream from node 1 to node 0 under tbf 1gbit runs at ~0.12 GB/s
    (FIELD-NOTES measured 0.121), and the counters see it."""
    n = 64 * MiB
    server = textwrap.dedent(f"""
        import socket, sys, time
        s = socket.create_server(("0.0.0.0", 0))
        print(s.getsockname()[1], flush=True)
        c, _ = s.accept()
        got, t0 = 0, None
        while got < {n}:
            b = c.recv(1 << 20)
            if not b:
                break
            if t0 is None:
                t0 = time.perf_counter()
            got += len(b)
        print(got, time.perf_counter() - t0, flush=True)
    """)
    client = textwrap.dedent(f"""
        import socket, sys
        c = socket.create_connection(("{vc2.ips[0]}", int(sys.argv[1])))
        buf = bytes(1 << 20)
        for _ in range({n} // len(buf)):
            c.sendall(buf)
        c.close()
    """)
    with vc2.traffic() as t:
        srv = vc2.popen(0, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
        try:
            port = srv.stdout.readline().strip()
            cl = vc2.run(1, [sys.executable, "-c", client, port], timeout=60,
                         capture_output=True, text=True)
            assert cl.returncode == 0, cl.stderr
            got, seconds = srv.stdout.readline().split()
            srv.wait(timeout=30)
        finally:
            srv.kill()
            srv.wait()
    assert int(got) == n
    rate = n / float(seconds) / 1e9
    assert 0.06 <= rate <= 0.14, f"{rate:.3f} GB/s"
    assert t.tx[1] >= n and t.rx[0] >= n, t
    print(f"shaped rate: {rate:.3f} GB/s")


# --------------------------------------------------------------------------------------
# clean-up

def test_nothing_left_after_an_exception():
    shm_before = shm_identity()
    with pytest.raises(RuntimeError, match="boom"):
        with VirtualCluster(nodes=2) as vc:
            tag, inits = vc.tag, list(vc.init_pids.values())
            assert len(ours_in_host(tag)) == 3 + 1       # 3 netns + state dir
            raise RuntimeError("boom")
    assert ours_in_host(tag) == [] and vc.leftovers() == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in inits)
    assert shm_identity() == shm_before
    vc.down()                                             # idempotent


def test_explicit_up_down():
    vc = VirtualCluster(nodes=2, rate=None).up()
    try:
        assert vc.is_up and len(vc.link_bytes()) == 2
    finally:
        vc.down()
    assert not vc.is_up and ours_in_host(vc.tag) == []


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from tests.cluster.vcluster import VirtualCluster
    vc = VirtualCluster(nodes=2).up()
    print(vc.tag, *vc.init_pids.values(), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
""").format(root=str(ROOT))


def _child(how: str) -> tuple[subprocess.Popen, str, list[int]]:
    p = subprocess.Popen([sys.executable, "-c", _CHILD, how], stdout=subprocess.PIPE,
                         text=True)
    tag, *inits = p.stdout.readline().split()
    return p, tag, [int(i) for i in inits]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_signal_tears_down(sig):
    p, tag, inits = _child("sleep")
    assert ours_in_host(tag)
    p.send_signal(sig)
    p.wait(timeout=30)
    assert ours_in_host(tag) == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in inits)


def test_stale_cluster_of_a_killed_creator_is_reaped():
    p, tag, inits = _child("kill")
    assert p.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 5                       # nodes die with their creator
    while any(Path(f"/proc/{pid}").exists() for pid in inits) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in inits)
    assert ours_in_host(tag)                              # SIGKILL: namespaces stay...
    removed = reap_stale()                                # ...until the next up() reaps
    assert any(r.startswith(tag) for r in removed)
    assert ours_in_host(tag) == []


def test_mpiexec_timeout_kills_everything(vc2):
    needs_hydra()
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        vc2.mpiexec([1, 1], ["sleep", "100"], timeout=3)
    assert time.monotonic() - t0 < 20
    for k in range(2):                    # only the node's init is left (and the probe)
        assert live_processes(vc2, k) == 2
