"""A virtual cluster on one Linux machine: N "nodes" that cannot share memory.

Multi-node behaviour (inter-node transports, hierarchical collectives, node detection,
failure handling) needs several machines.  This module fakes them with kernel namespaces,
so that tests and benchmarks run real ``mpiexec`` across real (virtual) network links::

    from gpurt.launch.vcluster import VirtualCluster

    with VirtualCluster(nodes=2, rate="1gbit") as vc:
        with vc.traffic() as t:
            p = vc.mpiexec([2, 2], [sys.executable, "prog.py"], env=MPICH_TCP_ENV)
        assert p.returncode == 0 and t.tx[1] >= payload      # the data really crossed

Layout (``T`` is the run's tag, ``gpc<creator pid><2 random letters>``)::

        switch netns  T"sw"   (the "head" node: mpiexec runs here)
        +----------------------------------------------------+
        |  bridge T"br"  10.X.0.254/24                       |
        |     |- port T"p0" -+     |- port T"p1" -+   ...    |
        +--------------------|----------------------|--------+
                      veth   |               veth   |
        node netns T"n0"     |        node netns T"n1"
        +--------------------|--+     +-------------|-----------+
        | uplink T"n0" 10.X.0.1 |     | uplink T"n1" 10.X.0.2   |   tbf on each uplink's
        | lo                    |     | lo                      |   egress (rate/burst/
        | init (PID 1)          |     | init (PID 1)            |   latency)
        +-----------------------+     +-------------------------+

* Each node is a network namespace ``T"n<k>"`` with ``lo`` and one uplink, a veth whose
  peer is a port of a bridge in the switch namespace ``T"sw"``; all nodes share one /24,
  ``10.X.0.<k+1>``, with X chosen not to clash with the host's networks (the cluster is not
  routed to the host anyway).  The uplink's egress is shaped with
  ``tc qdisc add dev UPLINK root tbf rate RATE burst BURST latency LATENCY`` (``rate=None``:
  unshaped), so every node sends at most RATE; the kernel here has no ``netem``, so added
  *delay* must be emulated in user space.
* Each node has an init process started as ``ip netns exec T"n<k>" unshare --uts --ipc
  --mount --propagation private --pid --fork --kill-child --mount-proc sh -c 'hostname
  vnode<k>; mount -t tmpfs tmpfs /dev/shm; mount --bind HOSTS /etc/hosts; exec INIT'``.
  Everything that runs "on" the node is started by ``nsenter``-ing that init's namespaces
  (net, uts, ipc, mount, pid): it sees the node's host name, the node's own /dev/shm (one
  tmpfs per node, shared by all processes of the node, invisible to the host and to other
  nodes), its own System V IPC, an /etc/hosts that names every node, and only the node's
  processes in /proc.  The file system is otherwise the host's (like a shared home).
* Private IPC and PID namespaces are what make the nodes honest.  MPICH's default netmod
  (UCX) takes the namespaces for one host and moves the data through memory: measured for
  a 64 MiB allreduce between 2 nodes with only /dev/shm private, UCX used cross-memory
  attach (``cma/memory``) while the nodes shared the host's PIDs, and System V shared
  memory (``sysv/memory``) once they had their own PIDs but not their own IPC -- either
  way only ~16-40 KB crossed the link (the FIELD-NOTES trap).  With private PID *and* IPC
  namespaces UCX falls back to TCP and the whole payload crosses the link.
  ``pid_ns=False`` keeps the host's PID namespace (PIDs then match the host's ``ps``);
  :attr:`VirtualCluster.MPICH_TCP_ENV` pins MPICH to its libfabric/TCP netmod explicitly,
  independent of UCX's heuristics.
* ``mpiexec`` (MPICH hydra) runs in the switch namespace -- the cluster's head/login node,
  host PID and mount namespaces, address 10.X.0.254 -- with ``-iface <bridge> -launcher ssh
  -launcher-exec vcluster_exec.sh -hosts IP0:k0,IP1:k1,...``; every proxy, node 0's
  included, is started through ``vcluster_exec.sh``, the cluster's "ssh", which enters the
  node that owns the address.  (mpiexec cannot run inside node 0: a process in one node's
  PID namespace cannot enter a sibling's.)  Ranks are placed block-wise: ranks 0..k0-1 on
  node 0, the next k1 on node 1, and so on.

Why the byte counters matter: a "multi-node" test proves nothing unless its data actually
crossed a link.  :meth:`VirtualCluster.link_bytes` reads each uplink's
``/sys/class/net/UPLINK/statistics/{tx,rx}_bytes`` (through the node's own sysfs mount;
the host's /sys only shows the host's interfaces), and :meth:`VirtualCluster.traffic`
gives per-node deltas around a block, so every multi-node test can assert that its payload
went over the wire (and, with a rate set, at the shaped speed).

Clean-up: names embed the creating PID, so anything left behind by a process that died
without cleaning up (SIGKILL) is recognisable; :meth:`VirtualCluster.up` first reaps stale
clusters whose creator is gone.  Clusters are torn down by ``down()``/``__exit__`` (also
on exceptions), at interpreter exit (atexit) and on SIGTERM/SIGINT (handlers chained to the
previous ones); node inits die with their creator (``PR_SET_PDEATHSIG``), and the death of
a node's init kills every process of the node (PID namespace).  The host's mount table is
never touched (all mounts live in the nodes' private mount namespaces); the only host
state is the netns files and ``/run/gpurt-vcluster/<tag>/``.

Command line::

    python -m gpurt.launch.vcluster --nodes 2 --ppn 2 [--ppn-list 3,2] [--rate 1gbit|none]
                                     [--mpich-tcp] -- PROGRAM ARGS...

Requirements: root, iproute2 (``ip``, ``tc`` with ``tbf``), util-linux (``unshare``,
``nsenter``, ``setpriv``); :func:`available` checks them.  Standard library only.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import ipaddress
import json
import math
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

__all__ = [
    "ClusterError", "MPICH_TCP_ENV", "Traffic", "VirtualCluster", "available",
    "hydra_mpiexec", "main", "reap_stale",
]

#: Environment that forces MPICH's (the ``mpich`` wheel's ch4) inter-node data onto TCP:
#: the libfabric netmod with its ``tcp`` provider.  The default netmod, UCX, picks its
#: transports by its own heuristics (it takes the namespaces for one host, and uses
#: cross-memory attach or System V shared memory wherever the nodes leave it one).  Ranks
#: on the same node still use MPICH's own shared memory, through the node's /dev/shm.
MPICH_TCP_ENV: dict[str, str] = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}

PREFIX = "gpc"                          # every netns / interface name starts with it
STATE_ROOT = Path("/run/gpurt-vcluster")
NETNS_DIR = Path("/run/netns")
HERE = Path(__file__).resolve().parent
LAUNCHER_EXEC = HERE / "vcluster_exec.sh"
IFNAMSIZ = 15                           # longest interface name the kernel accepts
MAX_NODES = 99                          # keeps T"n<k>" within IFNAMSIZ for any PID
HEAD_HOST = 254                         # the switch/head address is 10.X.0.254

# gpc<pid><two letters g-z><role>: the letters are never digits, so the pid parses back.
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)([g-z]{{2}})([a-z]{{1,2}}\d*)$")

# The node's PID 1: reaps orphans (so no zombies pile up in the node) and otherwise sleeps.
# SIGCHLD is blocked and waited for synchronously, so no wake-up is ever lost.
_INIT_PY = """\
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
print("ready", flush=True)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0); os.dup2(null, 1)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
"""

# Runs as the node's first process, inside its fresh UTS + mount (+ PID) namespaces.
_NODE_SH = """\
set -e
hostname "$1"
mount -t tmpfs -o "size=$2,mode=1777" vcluster-shm /dev/shm
mount --bind "$3" /etc/hosts
exec "$4" -I -S -c "$5"
"""


class ClusterError(RuntimeError):
    """The virtual cluster could not be built, used or torn down."""


# --------------------------------------------------------------------------------------
# small helpers

def _cmd(argv: Sequence[str], *, check: bool = True, input: str | None = None,
         timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a set-up command; on failure raise ClusterError with its stderr."""
    try:
        p = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"{' '.join(argv)}: {e}") from e
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
    return p


def _random_tag() -> str:
    """gpc<our pid><two random letters g-z>."""
    return f"{PREFIX}{os.getpid()}" + "".join(random.choices("ghijklmnopqrstuvwxyz", k=2))


def _proc_starttime(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): tells a PID from its reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _creator_alive(pid: int, state_dir: Path) -> bool:
    start = _proc_starttime(pid)
    if start is None:
        return False
    try:
        recorded = json.loads((state_dir / "creator.json").read_text())["starttime"]
    except (OSError, ValueError, KeyError):
        return True                       # no record (yet): trust the PID alone
    return recorded == start


def _netns_inode(ns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(NETNS_DIR / ns)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _netns_pids(ns: str) -> list[int]:
    """PIDs (host view) of the processes in network namespace ``ns`` (as ``ip netns
    pids``, without a subprocess)."""
    ident = _netns_inode(ns)
    if ident is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == ident:
            pids.append(int(entry))
    return pids


def _kill_in_netns(pid: int, ident: tuple[int, int] | None) -> None:
    """SIGKILL ``pid`` if it is (still) in the netns ``ident``: signalled through a pidfd
    after re-checking its namespace, so a recycled PID is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
        if (st.st_dev, st.st_ino) == ident:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def _kill_netns_processes(ns: str, *, wait: float = 5.0) -> list[int]:
    """SIGKILL every process in netns ``ns`` and wait until they are gone (dead; zombies
    no longer count).  Returns the PIDs still there after ``wait`` seconds (normally
    none)."""
    ident = _netns_inode(ns)
    if ident is None:
        return []
    deadline = time.monotonic() + wait
    while True:
        pids = _netns_pids(ns)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            _kill_in_netns(pid, ident)
        time.sleep(0.02)


def _host_links() -> list[str]:
    try:
        return os.listdir("/sys/class/net")
    except OSError:
        return []


def _host_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for argv in (["ip", "-4", "-j", "addr", "show"], ["ip", "-4", "-j", "route", "show"]):
        try:
            data = json.loads(_cmd(argv, check=False).stdout or "[]")
        except (ClusterError, ValueError):
            continue
        for item in data:
            for a in item.get("addr_info", []):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}",
                                                     strict=False))
            dst = item.get("dst")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def _pick_subnet() -> ipaddress.IPv4Network:
    """10.X.0.0/24 for the first X in 200..254 that overlaps none of the host's networks."""
    taken = _host_networks()
    for x in range(200, 255):
        net = ipaddress.ip_network(f"10.{x}.0.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise ClusterError("no free 10.X.0.0/24 (X in 200..254) on this host")


def hydra_mpiexec() -> str | None:
    """MPICH hydra's mpiexec: $GPURT_MPIEXEC, else the one beside this Python (the mpich
    wheel's), else ``mpiexec`` on PATH -- if it is hydra (needs ``-launcher-exec``)."""
    cands = [os.environ.get("GPURT_MPIEXEC"), str(Path(sys.executable).parent / "mpiexec"),
             shutil.which("mpiexec")]
    for c in cands:
        if c and os.access(c, os.X_OK):
            try:
                out = subprocess.run([c, "--version"], capture_output=True, text=True,
                                     timeout=30).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            if "HYDRA" in out.upper():
                return c
    return None


# --------------------------------------------------------------------------------------
# stale clusters, process-wide registry, signal handling

def reap_stale() -> list[str]:
    """Remove what clusters of dead creators left behind (after SIGKILL, or a crash):
    their processes, namespaces, interfaces and state dirs.  Returns the names removed.
    Clusters whose creator still runs are never touched."""
    by_tag: dict[str, dict] = {}

    def note(name: str, kind: str) -> None:
        m = _NAME_RE.match(name)
        if m:
            tag = f"{PREFIX}{m.group(1)}{m.group(2)}"
            by_tag.setdefault(tag, {"pid": int(m.group(1)), "netns": [], "links": [],
                                    "state": False})[kind].append(name)

    with contextlib.suppress(OSError):
        for ns in os.listdir(NETNS_DIR):
            note(ns, "netns")
    for link in _host_links():
        note(link, "links")
    with contextlib.suppress(OSError):
        for d in os.listdir(STATE_ROOT):
            m = _NAME_RE.match(d + "sw")       # state dirs are named by the bare tag
            if m:
                by_tag.setdefault(d, {"pid": int(m.group(1)), "netns": [], "links": [],
                                      "state": False})["state"] = True

    removed = []
    for tag, info in by_tag.items():
        if tag in _LIVE or _creator_alive(info["pid"], STATE_ROOT / tag):
            continue
        # nodes before the switch: a node's death takes its veth pair with it
        for ns in sorted(info["netns"], key=lambda n: n.endswith("sw")):
            _kill_netns_processes(ns)
            _cmd(["ip", "netns", "delete", ns], check=False)
            removed.append(ns)
        for link in info["links"]:
            _cmd(["ip", "link", "delete", link], check=False)
            removed.append(link)
        if info["state"]:
            shutil.rmtree(STATE_ROOT / tag, ignore_errors=True)
            removed.append(str(STATE_ROOT / tag))
    return removed


_LIVE: dict[str, "VirtualCluster"] = {}       # tag -> cluster, for atexit and signals
_LOCK = threading.RLock()
_PREV_HANDLERS: dict[int, object] = {}
_ATEXIT_DONE = False
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _down_all() -> None:
    with _LOCK:
        clusters = list(_LIVE.values())
    for vc in clusters:
        with contextlib.suppress(Exception):
            vc.down()


def _on_signal(signum: int, frame) -> None:
    """Tear every cluster down, then do what the previous handler would have done."""
    _down_all()
    prev = _PREV_HANDLERS.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)               # e.g. SIGINT's default_int_handler
    elif prev == signal.SIG_IGN:
        return
    else:                                 # SIG_DFL: die of the signal, as we would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(vc: "VirtualCluster") -> None:
    global _ATEXIT_DONE
    with _LOCK:
        _LIVE[vc.tag] = vc
        if not _ATEXIT_DONE:
            atexit.register(_down_all)
            _ATEXIT_DONE = True
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                cur = signal.getsignal(sig)
                if cur is not _on_signal:
                    _PREV_HANDLERS[sig] = cur
                    signal.signal(sig, _on_signal)


def _unregister(vc: "VirtualCluster") -> None:
    with _LOCK:
        _LIVE.pop(vc.tag, None)
        if _LIVE or threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:              # give the handlers back, unless replaced since
            if signal.getsignal(sig) is _on_signal and sig in _PREV_HANDLERS:
                signal.signal(sig, _PREV_HANDLERS.pop(sig))


# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Traffic:
    """Bytes moved over each node's uplink during a ``with vc.traffic() as t:`` block.
    Inside the block the values are live (so far); after it, frozen."""
    _vc: "VirtualCluster"
    _start: dict[int, tuple[int, int]]
    _end: dict[int, tuple[int, int]] | None = None

    def _now(self) -> dict[int, tuple[int, int]]:
        return self._end if self._end is not None else self._vc.link_bytes()

    @property
    def tx(self) -> dict[int, int]:
        """node -> bytes the node sent onto the link."""
        now = self._now()
        return {k: now[k][0] - self._start[k][0] for k in self._start}

    @property
    def rx(self) -> dict[int, int]:
        """node -> bytes the node received from the link."""
        now = self._now()
        return {k: now[k][1] - self._start[k][1] for k in self._start}

    @property
    def total(self) -> int:
        """Bytes that crossed the switch from the nodes: the sum of the nodes' tx (each
        such byte is counted once; traffic from the head, e.g. mpiexec's control messages,
        appears only in the nodes' rx)."""
        return sum(self.tx.values())

    @property
    def total_rx(self) -> int:
        return sum(self.rx.values())

    def __repr__(self) -> str:
        return f"Traffic(tx={self.tx}, rx={self.rx})"


class VirtualCluster:
    """``nodes`` network-namespace "nodes" behind one bridge; see the module docstring.

    Use as a context manager, or call :meth:`up` / :meth:`down`.  ``rate``/``burst``/
    ``latency`` shape each node's uplink egress with ``tbf`` (``rate=None``: unshaped;
    tbf's ``latency`` is its queueing limit, not added delay).  ``shm_size`` bounds each
    node's private /dev/shm (tmpfs ``size=``).  ``pid_ns`` gives each node its own PID
    namespace (default; makes cross-memory attach between nodes impossible).  Every
    node always has its own UTS, IPC and mount namespaces.
    """

    MPICH_TCP_ENV = MPICH_TCP_ENV

    def __init__(self, nodes: int = 2, rate: str | None = "1gbit", burst: str = "256kb",
                 latency: str = "50ms", *, shm_size: str = "50%", pid_ns: bool = True,
                 hostname_prefix: str = "vnode", mpiexec: str | None = None):
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}, not {nodes}")
        self.nodes = nodes
        self.rate = rate
        self.burst = burst
        self.latency = latency
        self.shm_size = shm_size
        self.pid_ns = pid_ns
        self.hostnames = [f"{hostname_prefix}{k}" for k in range(nodes)]
        self._mpiexec = mpiexec
        self.tag = ""                     # set by up()
        self.subnet: ipaddress.IPv4Network | None = None
        self._inits: dict[int, int] = {}             # node -> host PID of its init
        self._holders: dict[int, subprocess.Popen] = {}
        self._is_up = False
        self._planned = False             # plan(): names chosen, nothing built

    # ---- names ------------------------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{self.tag}sw"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def namespaces(self) -> list[str]:
        """The nodes' network namespaces, node 0 first."""
        return [f"{self.tag}n{k}" for k in range(self.nodes)]

    @property
    def uplinks(self) -> list[str]:
        """Each node's uplink interface (inside its namespace); named like the namespace."""
        return self.namespaces

    def _port(self, k: int) -> str:
        return f"{self.tag}p{k}"

    @property
    def ips(self) -> list[str]:
        """The nodes' addresses, node 0 first."""
        assert self.subnet is not None, "cluster is not up"
        return [str(self.subnet.network_address + k + 1) for k in range(self.nodes)]

    @property
    def head_ip(self) -> str:
        """The switch/head namespace's address (where mpiexec listens)."""
        assert self.subnet is not None, "cluster is not up"
        return str(self.subnet.network_address + HEAD_HOST)

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.tag

    @property
    def launcher_exec(self) -> str:
        """The cluster's ssh stand-in (a copy of vcluster_exec.sh in the state dir)."""
        return str(self.state_dir / "launcher_exec")

    @property
    def init_pids(self) -> dict[int, int]:
        """node -> host PID of the node's init (enter the node with ``nsenter -t``)."""
        return dict(self._inits)

    def all_names(self) -> list[str]:
        """Every netns and interface name this cluster creates."""
        return ([self.switch_ns, self.bridge] + self.namespaces
                + [self._port(k) for k in range(self.nodes)])

    # ---- life cycle -------------------------------------------------------------------
    def __enter__(self) -> "VirtualCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "VirtualCluster":
        """Build the cluster (reaping stale ones first).  On any failure, whatever was
        built is removed again and ClusterError is raised."""
        if self._is_up:
            return self
        reap_stale()
        self.tag = self._new_tag()
        self.subnet = _pick_subnet()
        self._is_up = True
        _register(self)                  # from here on, signals and atexit clean up
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def plan(self) -> "VirtualCluster":
        """Choose the names and addresses :meth:`up` would (a tag, a subnet) and build
        nothing: :meth:`command` then gives the command line a run would use (a dry run;
        each run chooses its own)."""
        if not self._is_up:
            self.tag = self._new_tag()
            self.subnet = _pick_subnet()
            self._planned = True
        return self

    def _new_tag(self) -> str:
        existing = set(_host_links())
        with contextlib.suppress(OSError):
            existing |= set(os.listdir(NETNS_DIR))
        with contextlib.suppress(OSError):
            existing |= set(os.listdir(STATE_ROOT))
        for _ in range(1000):
            tag = _random_tag()
            if not any(n.startswith(tag) for n in existing) and tag not in _LIVE:
                longest = f"{tag}n{self.nodes - 1}"
                assert len(longest) <= IFNAMSIZ, longest
                return tag
        raise ClusterError("no unused cluster tag")

    def _build(self) -> None:
        sd = self.state_dir
        sd.mkdir(parents=True, mode=0o755)
        (sd / "creator.json").write_text(json.dumps(
            {"pid": os.getpid(), "starttime": _proc_starttime(os.getpid()),
             "argv": sys.argv}))
        hosts = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 f"{self.head_ip} vhead"]
        hosts += [f"{ip} {name}" for ip, name in zip(self.ips, self.hostnames)]
        (sd / "hosts").write_text("\n".join(hosts) + "\n")
        shutil.copyfile(LAUNCHER_EXEC, self.launcher_exec)
        os.chmod(self.launcher_exec, 0o755)

        for ns in [self.switch_ns] + self.namespaces:
            _cmd(["ip", "netns", "add", ns])
        # nodes' inits first (slowest), while the links are built
        for k in range(self.nodes):
            self._start_init(k)

        prefix = self.subnet.prefixlen
        sw = ["link set lo up", f"link add {self.bridge} type bridge",
              f"link set {self.bridge} addrgenmode none",
              f"addr add {self.head_ip}/{prefix} dev {self.bridge}"]
        for k, ns in enumerate(self.namespaces):
            up, port = self.uplinks[k], self._port(k)
            _cmd(["ip", "link", "add", "name", up, "netns", ns, "type", "veth",
                  "peer", "name", port, "netns", self.switch_ns])
            sw += [f"link set {port} addrgenmode none",
                   f"link set {port} master {self.bridge}", f"link set {port} up"]
            # addrgenmode none: no IPv6 link-local address, so no DAD/MLD chatter in the
            # byte counters
            _cmd(["ip", "-n", ns, "-batch", "-"], input="\n".join([
                "link set lo up", f"link set {up} addrgenmode none",
                f"addr add {self.ips[k]}/{prefix} dev {up}", f"link set {up} up"]) + "\n")
            if self.rate is not None:
                _cmd(["tc", "-n", ns, "qdisc", "add", "dev", up, "root", "tbf", "rate",
                      self.rate, "burst", self.burst, "latency", self.latency])
        sw.append(f"link set {self.bridge} up")
        _cmd(["ip", "-n", self.switch_ns, "-batch", "-"], input="\n".join(sw) + "\n")

        for k in range(self.nodes):
            self._wait_init(k)
        (sd / "nodes").write_text("".join(
            f"{ip} {name} {self._inits[k]} {ns}\n" for k, (ip, name, ns) in
            enumerate(zip(self.ips, self.hostnames, self.namespaces))))

    def _start_init(self, k: int) -> None:
        ns_opts = ["--uts", "--ipc", "--mount", "--propagation", "private"]
        if self.pid_ns:
            # --kill-child: the node's init dies with unshare; with it, the whole node
            ns_opts += ["--pid", "--fork", "--kill-child", "--mount-proc"]
        argv = ["ip", "netns", "exec", self.namespaces[k], "unshare", *ns_opts, "--",
                "sh", "-c", _NODE_SH, f"vcluster-{self.hostnames[k]}", self.hostnames[k],
                self.shm_size, str(self.state_dir / "hosts"), sys.executable, _INIT_PY]
        if threading.current_thread() is threading.main_thread() and shutil.which("setpriv"):
            # the node dies with its creator, even on SIGKILL (the parent is the thread
            # that forks, hence only from the main thread)
            argv = ["setpriv", "--pdeathsig", "KILL", "--"] + argv
        log = open(self.state_dir / f"init{k}.log", "wb")
        try:
            self._holders[k] = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.PIPE, stderr=log)
        finally:
            log.close()

    def _wait_init(self, k: int, timeout: float = 20.0) -> None:
        p = self._holders[k]
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else b""
        p.stdout.close()
        if line.strip() != b"ready":
            err = (self.state_dir / f"init{k}.log").read_text(errors="replace").strip()
            raise ClusterError(f"node {k} did not come up: {err or 'timed out'}")
        if not self.pid_ns:
            self._inits[k] = p.pid        # ip netns exec / unshare / sh all exec'd
            return
        try:
            with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                children = f.read().split()
        except OSError:
            children = []
        if len(children) != 1:
            raise ClusterError(f"node {k}: cannot find its init (children of unshare "
                               f"{p.pid}: {children})")
        self._inits[k] = int(children[0])

    def down(self) -> None:
        """Remove everything: processes in the nodes and the head, namespaces, interfaces,
        state dir.  Idempotent; never raises (leftovers are reported as a warning and by
        :meth:`leftovers`)."""
        if not self._is_up:
            return
        try:
            # The nodes' inits first: with a PID namespace, the death of its init kills
            # every process of the node, and unshare (our child) reaps the init -- rather
            # than the host's PID 1, which may take its time.
            for k, pid in self._inits.items():
                _kill_in_netns(pid, _netns_inode(self.namespaces[k]))
            for k, p in self._holders.items():
                if k not in self._inits:          # up() failed before finding the init
                    p.kill()
            for p in self._holders.values():
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
            # then whatever else runs in our namespaces (mpiexec in the head; with
            # pid_ns=False, the nodes' processes)
            for ns in self.namespaces + [self.switch_ns]:
                _kill_netns_processes(ns)
            for ns in self.namespaces + [self.switch_ns]:
                if _netns_inode(ns) is not None:
                    _cmd(["ip", "netns", "delete", ns], check=False)
            host = set(_host_links())
            for name in self.all_names():      # never created in the host; just in case
                if name in host:
                    _cmd(["ip", "link", "delete", name], check=False)
            shutil.rmtree(self.state_dir, ignore_errors=True)
        finally:
            self._is_up = False
            self._holders.clear()
            self._inits.clear()
            _unregister(self)
        left = self.leftovers()
        if left:
            import warnings
            warnings.warn(f"virtual cluster {self.tag}: left behind {left}", RuntimeWarning)

    def leftovers(self) -> list[str]:
        """Names of this cluster's namespaces, host interfaces and state dir that exist."""
        if not self.tag:
            return []
        found = []
        with contextlib.suppress(OSError):
            found += [n for n in os.listdir(NETNS_DIR) if n.startswith(self.tag)]
        found += [n for n in _host_links() if n.startswith(self.tag)]
        if self.state_dir.exists():
            found.append(str(self.state_dir))
        return found

    @property
    def is_up(self) -> bool:
        return self._is_up

    def _check_up(self) -> None:
        if not self._is_up or len(self._inits) != self.nodes:
            raise ClusterError("the virtual cluster is not up")

    # ---- running things on nodes ------------------------------------------------------
    def node_command(self, node: int, argv: Sequence[str], *,
                     cwd: str | None = None) -> list[str]:
        """The argv that runs ``argv`` on ``node`` (its netns, hostname, IPC, /dev/shm, PIDs),
        in ``cwd`` (default: the current directory; the file system is the host's)."""
        self._check_up()
        return ["nsenter", "--target", str(self._inits[node]), "--net", "--uts", "--ipc",
                "--mount", "--pid", f"--wd={cwd or os.getcwd()}", "--", *argv]

    def run(self, node: int, argv: Sequence[str], *, cwd: str | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` on ``node``."""
        return subprocess.run(self.node_command(node, argv, cwd=cwd), **kwargs)

    def popen(self, node: int, argv: Sequence[str], *, cwd: str | None = None,
              **kwargs) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` on ``node``."""
        return subprocess.Popen(self.node_command(node, argv, cwd=cwd), **kwargs)

    # ---- mpiexec ----------------------------------------------------------------------
    def _ranks(self, ranks_per_node: int | Sequence[int]) -> list[int]:
        if isinstance(ranks_per_node, int):
            if ranks_per_node < 1:
                raise ValueError(f"ranks_per_node must be >= 1, not {ranks_per_node}")
            return [ranks_per_node] * self.nodes
        ranks = list(ranks_per_node)
        if len(ranks) != self.nodes or any(r < 0 for r in ranks) or sum(ranks) == 0:
            raise ValueError(f"ranks_per_node {ranks} does not fit {self.nodes} nodes")
        return ranks

    def hosts_arg(self, ranks_per_node: int | Sequence[int]) -> str:
        """hydra's ``-hosts`` value, ``IP0:k0,IP1:k1,...`` (nodes with 0 ranks left out)."""
        if not self._planned:
            self._check_up()
        return ",".join(f"{ip}:{k}" for ip, k in zip(self.ips, self._ranks(ranks_per_node))
                        if k > 0)

    def command(self, ranks_per_node: int | Sequence[int], argv: Sequence[str],
                env: dict | None = None, mpiexec_args: Sequence[str] = ()) -> list[str]:
        """The complete argv :meth:`mpiexec` runs (self-contained: the extra environment is
        set with ``env``), e.g.::

            ip netns exec gpc123xysw env K=V /venv/bin/mpiexec -iface gpc123xybr
               -launcher ssh -launcher-exec /run/gpurt-vcluster/gpc123xy/launcher_exec
               -hosts 10.200.0.1:2,10.200.0.2:2 -n 4 PROGRAM ARGS...

        (After :meth:`plan` instead of :meth:`up`: the command a run would use.)
        """
        if not self._planned:
            self._check_up()
        ranks = self._ranks(ranks_per_node)
        mpiexec = self._mpiexec or hydra_mpiexec()
        if not mpiexec:
            raise ClusterError("no MPICH hydra mpiexec (pip install mpich, "
                               "or set GPURT_MPIEXEC)")
        extra = dict(env or {})
        # the ranks resolve PROGRAM through the PATH hydra passes them (mpiexec's): make
        # this Python's bin dir (a venv's) come first, as it does when activated
        bindir = str(Path(sys.executable).parent)
        path = extra.get("PATH", os.environ.get("PATH", ""))
        if bindir not in path.split(os.pathsep):
            extra["PATH"] = bindir + os.pathsep + path if path else bindir
        return (["ip", "netns", "exec", self.switch_ns, "env"]
                + [f"{k}={v}" for k, v in extra.items()]
                + [mpiexec, "-iface", self.bridge, "-launcher", "ssh",
                   "-launcher-exec", self.launcher_exec,
                   "-hosts", self.hosts_arg(ranks), "-n", str(sum(ranks)),
                   *mpiexec_args, *argv])

    def mpiexec(self, ranks_per_node: int | Sequence[int], argv: Sequence[str],
                env: dict | None = None, timeout: float = 300,
                mpiexec_args: Sequence[str] = (), *, capture: bool = True,
                cwd: str | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` under hydra's mpiexec across the cluster, ``ranks_per_node`` ranks
        on each node (an int, or one count per node; block placement).  ``env`` is added
        to the environment (hydra passes mpiexec's whole environment to the ranks); use
        :attr:`MPICH_TCP_ENV` for MPICH's own traffic.  Output is captured as text unless
        ``capture=False``.  After ``timeout`` seconds, mpiexec and every process it started
        on the nodes are killed and ``subprocess.TimeoutExpired`` is raised (as
        ``subprocess.run`` does)."""
        cmd = self.command(ranks_per_node, argv, env, mpiexec_args)
        pipe = subprocess.PIPE if capture else None
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe,
                             text=capture, cwd=cwd, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_session(p.pid)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        except BaseException:               # KeyboardInterrupt & co: leave nothing running
            self._kill_session(p.pid)
            p.wait()
            raise
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)

    def _kill_session(self, sid: int) -> None:
        """Kill mpiexec's session: mpiexec, the launchers and what they started on the
        nodes (proxies, ranks), which stay in that session whatever their PID namespace,
        plus the descendants of all those (in case one left the session).  Only processes
        in this cluster's namespaces are signalled."""
        victims: set[int] = set()
        nets = {_netns_inode(ns) for ns in self.namespaces + [self.switch_ns]}
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            pid, ppid, session = int(entry), int(fields[1]), int(fields[3])
            children.setdefault(ppid, []).append(pid)
            if session == sid:
                victims.add(pid)
        todo = list(victims)                # and every descendant of those
        while todo:
            for c in children.get(todo.pop(), []):
                if c not in victims:
                    victims.add(c)
                    todo.append(c)
        for pid in victims:
            for ident in nets:
                if ident is not None:
                    _kill_in_netns(pid, ident)

    # ---- traffic ----------------------------------------------------------------------
    def link_bytes(self) -> dict[int, tuple[int, int]]:
        """node -> (tx_bytes, rx_bytes) of its uplink, from the node's own sysfs (read
        through its init's root: the host's /sys only lists the host's interfaces)."""
        self._check_up()
        out = {}
        for k, up in enumerate(self.uplinks):
            vals = []
            for what in ("tx_bytes", "rx_bytes"):
                path = f"/proc/{self._inits[k]}/root/sys/class/net/{up}/statistics/{what}"
                try:
                    with open(path) as f:
                        vals.append(int(f.read()))
                except OSError:             # fall back to a process in the netns
                    vals.append(int(_cmd(["ip", "netns", "exec", self.namespaces[k], "cat",
                                          f"/sys/class/net/{up}/statistics/{what}"]).stdout))
            out[k] = (vals[0], vals[1])
        return out

    @contextlib.contextmanager
    def traffic(self) -> Iterator[Traffic]:
        """``with vc.traffic() as t: ...`` -> ``t.tx[node]``, ``t.rx[node]``, ``t.total``:
        the bytes each uplink moved during the block."""
        t = Traffic(self, self.link_bytes())
        try:
            yield t
        finally:
            with contextlib.suppress(ClusterError):
                t._end = self.link_bytes()

    def __repr__(self) -> str:
        state = f"up {self.subnet}" if self._is_up else "down"
        return (f"<VirtualCluster {self.tag or '-'} nodes={self.nodes} rate={self.rate} "
                f"{state}>")


# --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(True, "") if virtual clusters can be built here: root, ``ip``/``tc``/``unshare``/
    ``nsenter``, network namespaces, veth, ``tbf`` and UTS/mount/PID namespaces (all
    probed for real, in a throw-away namespace); else (False, why)."""
    if sys.platform != "linux":
        return False, "virtual clusters need Linux network namespaces"
    if os.geteuid() != 0:
        return False, "virtual clusters need root (network namespaces, tc)"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if not shutil.which(tool):
            return False, f"virtual clusters need `{tool}` on PATH"
    if hydra_mpiexec() is None:
        return False, ("virtual clusters drive MPICH's hydra mpiexec (its -launcher-exec), "
                       "and this launcher is not one (pip install mpich, or set "
                       "GPURT_MPIEXEC to a hydra mpiexec)")
    with contextlib.suppress(Exception):
        reap_stale()
    tag = _random_tag()
    ns = f"{tag}pr"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "add", f"{tag}pa", "type", "veth", "peer", "name",
         f"{tag}pb"],
        ["tc", "-n", ns, "qdisc", "add", "dev", f"{tag}pa", "root", "tbf", "rate", "1gbit",
         "burst", "256kb", "latency", "50ms"],
        ["ip", "netns", "exec", ns, "unshare", "--uts", "--ipc", "--mount", "--propagation",
         "private",
         "--pid", "--fork", "--mount-proc", "sh", "-c",
         "hostname vprobe && mount -t tmpfs -o size=1m tmpfs /dev/shm && test \"$$\" = 1"],
    ]
    try:
        for argv in steps:
            try:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                return False, f"`{' '.join(argv)}` failed: {e}"
            if p.returncode != 0:
                return False, f"`{' '.join(argv[:6])} ...` failed: {p.stderr.strip()}"
    finally:
        _kill_netns_processes(ns)
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
    return True, ""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gpurt.launch.vcluster",
        description="Bring up a virtual cluster, run PROGRAM under MPICH hydra's mpiexec "
                    "across it (-n is the sum of the ranks per node), print each node's "
                    "link bytes, tear it down; exits with the program's status.")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ppn", type=int, default=1, help="ranks per node")
    ap.add_argument("--ppn-list", help="ranks per node, comma-separated (e.g. 3,2); "
                                       "sets --nodes")
    ap.add_argument("--rate", default="1gbit", help="tbf rate per uplink, or 'none'")
    ap.add_argument("--burst", default="256kb")
    ap.add_argument("--latency", default="50ms", help="tbf queueing limit (not delay)")
    ap.add_argument("--mpich-tcp", action="store_true",
                    help="force MPICH's own traffic onto TCP: " +
                         " ".join(f"{k}={v}" for k, v in MPICH_TCP_ENV.items()))
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra environment for the ranks (repeatable)")
    ap.add_argument("--no-pid-ns", action="store_true",
                    help="share the host's PID namespace (lets MPICH use cross-memory "
                         "attach between nodes: for demonstrating that trap only)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--print-command", action="store_true",
                    help="print the mpiexec command line before running it")
    ap.add_argument("program", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")
    a = ap.parse_args(argv)
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        ap.error(f"--timeout {a.timeout!r}: not a finite number of seconds above 0")
    prog = a.program[1:] if a.program[:1] == ["--"] else a.program
    if not prog:
        ap.error("no PROGRAM given (put it after --)")
    ppn: int | list[int] = a.ppn
    nodes = a.nodes
    if a.ppn_list:
        ppn = [int(x) for x in a.ppn_list.split(",")]
        nodes = len(ppn)
    env = dict(MPICH_TCP_ENV) if a.mpich_tcp else {}
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    ok, why = available()
    if not ok:
        print(f"vcluster: not available: {why}", file=sys.stderr)
        return 2
    rate = None if a.rate.lower() in ("none", "off", "0") else a.rate
    with VirtualCluster(nodes, rate, a.burst, a.latency, pid_ns=not a.no_pid_ns) as vc:
        if a.print_command:
            print("vcluster: " + " ".join(vc.command(ppn, prog, env)), file=sys.stderr)
        with vc.traffic() as t:
            try:
                rc = vc.mpiexec(ppn, prog, env, timeout=a.timeout, capture=False).returncode
            except subprocess.TimeoutExpired:
                print(f"vcluster: timed out after {a.timeout} s", file=sys.stderr)
                rc = 124
        for k in range(vc.nodes):
            print(f"vcluster: node {k} {vc.hostnames[k]} {vc.ips[k]}: "
                  f"tx {t.tx[k]} B, rx {t.rx[k]} B", file=sys.stderr)
        print(f"vcluster: total {t.total} B sent by the nodes", file=sys.stderr)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
