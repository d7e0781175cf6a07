"""Waiting without burning the CPU that the peer needs.

Spin (``GPURT_SPIN_US``, a few tens of µs: the common case when every rank has a core),
then ``sched_yield`` for up to 2 ms (lets a peer rank on the same core run, which is what
oversubscribed runs need), then sleep with exponential backoff up to 1 ms.  Any progress
resets the backoff.  When the node runs more ranks than it has CPUs for them
(``oversubscribed``: this process's affinity set, or the machine's count when the launcher
bound the process to a single CPU), the spin phase is skipped: spinning would only steal the core a peer needs (measured here: 5
ranks on 2 cores, 8-byte allreduce 536 µs with spinning, 427 µs without).

The node a communicator sees (MPI's shared-memory split) need not be the whole machine:
ranks of other "nodes" may run on the same kernel — MPICH cliques and network-namespace
clusters simulating several nodes on one host, or containers of one job on one host — and
compete for the same CPUs.  A communicator therefore also counts the ranks of its job on
this kernel (``machine_id``: the boot id, the same in every namespace and container of one
boot) whose affinity sets overlap this rank's, directly or through each other, and the
CPUs those sets cover (``machine_load``); where they outnumber them it marks the process
crowded (``note_machine``), and the waits of the communicators created from then on do
not spin (``spin_seconds``; measured here: 2 cliques x 2 ranks on 2 cores, 4 KiB
allreduce across the cliques 300-339 µs a call spinning, 248-319 without;
docs/performance.md).  Only the spin: the shared-memory transport's choices for
oversubscribed nodes (single-copy threshold, cooperative copies) stay with the node's
count (``oversubscribed``), as measured there.
"""

from __future__ import annotations

import os
import socket
import time

from . import config

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


_SYS_CPU = "/sys/devices/system/cpu"


def _cpu_list(text: str) -> set[int]:
    """``"0-1,64-65"`` (the kernel's CPU list format) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def core_threads(cpu: int) -> set[int] | None:
    """The hardware threads of ``cpu``'s core (itself and its SMT siblings); None where
    the kernel does not say."""
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            with open(f"{_SYS_CPU}/cpu{cpu}/topology/{name}") as f:
                return _cpu_list(f.read())
        except (OSError, ValueError):
            continue
    return None


def node_cpus() -> int:
    """The CPUs this node's ranks share: this process's affinity set — unless the launcher
    bound it to a single core (``--bind-to core``: each rank then has its own, and the set
    says nothing about the node), where the machine's count is the better guess.  A core
    is one CPU, or the hardware threads of one core where it has several (SMT: a rank
    bound to a core gets both of its threads, and 64 such ranks on a 64-core node must not
    count as oversubscribed against a set of 2)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = set()
    if len(cpus) > 1:
        threads = core_threads(min(cpus))
        if threads is None or not cpus <= threads:
            return len(cpus)
    return os.cpu_count() or 1


def oversubscribed(ranks_on_node: int) -> bool:
    """More ranks on this node than CPUs for them: every wait should give its CPU away."""
    return ranks_on_node > node_cpus()


_crowded = False     # note_machine: a communicator found its ranks on this machine crowded


def machine_id() -> str:
    """What identifies the kernel (so the CPUs) this process runs on: the boot id, which
    every namespace and container of one boot shares (host names differ in UTS
    namespaces, and MPI's node split may cut one host into several nodes); else the host
    name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            key = f.read().strip()
        if key:
            return key
    except OSError:
        pass
    return "host:" + socket.gethostname()


def affinity_mask() -> int:
    """This process's CPUs as a bit mask (bit c: CPU c); 0 where unknown."""
    try:
        return sum(1 << c for c in os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 0


def machine_load(ids: list, masks: list, me: int) -> tuple[int, int]:
    """(ranks that compete with rank ``me`` for CPUs, the CPUs they may run on), from
    every rank's ``machine_id`` and ``affinity_mask``: the ranks of ``me``'s machine whose
    affinity sets overlap its own, directly or through one another, and the union of
    those sets — so pods pinned to disjoint CPUs count apart (7 ranks on 2 CPUs do not
    crowd 2 ranks on 6 others), ranks that share CPUs together.  Where a set is unknown
    (0), every rank of the machine over the machine's count."""
    same = [m for k, m in zip(ids, masks) if k == ids[me]]
    if not all(same):
        return len(same), os.cpu_count() or 1
    union, group = masks[me], 1
    rest = list(same)
    rest.remove(masks[me])
    grown = True
    while grown:
        grown = False
        keep = []
        for m in rest:
            if m & union:
                union |= m
                group += 1
                grown = True
            else:
                keep.append(m)
        rest = keep
    return group, max(1, bin(union).count("1"))


def note_machine(ranks: int, cpus: int) -> bool:
    """Record a communicator's ``machine_load``: where its ranks outnumber their CPUs, the
    communicators this process creates from now on do not spin in their waits (the
    machine's other ranks run whatever communicator a wait is on; one created before
    keeps its spin).  Returns whether they do."""
    global _crowded
    if ranks > cpus:
        _crowded = True
    return ranks > cpus


def spin_seconds(ranks_on_node: int) -> float:
    """How long to spin before yielding, for a node running ``ranks_on_node`` ranks (none
    where they outnumber the CPUs, or a communicator found the machine crowded:
    ``note_machine``)."""
    if oversubscribed(ranks_on_node) or _crowded:
        return 0.0
    return float(config.get("GPURT_SPIN_US")) * 1e-6


class Backoff:
    """``sleeper(seconds)``, when given, replaces ``time.sleep`` in the sleep phase: a
    transport with sockets blocks in ``select`` on them instead, so the wait ends as soon
    as data arrives (and the GIL is released meanwhile)."""

    __slots__ = ("spin", "spin_until", "yield_until", "sleep", "start", "sleeper")

    def __init__(self, spin: float | None = None, sleeper=None) -> None:
        self.spin = float(config.get("GPURT_SPIN_US")) * 1e-6 if spin is None else spin
        self.sleeper = sleeper or time.sleep
        self.reset()

    def reset(self) -> None:
        now = time.perf_counter()
        self.start = now
        spin = self.spin
        self.spin_until = now + spin
        self.yield_until = now + spin + 2e-3
        self.sleep = 5e-6

    def pause(self) -> bool:
        """One pause: nothing while spinning (False), then a yield, then sleeps (True)."""
        now = time.perf_counter()
        if now < self.spin_until:
            return False
        if now < self.yield_until:
            _yield()
            return True
        self.sleeper(self.sleep)
        self.sleep = min(self.sleep * 2, 1e-3)
        return True


def mpi_barrier(comm, longest: float = 1e-2) -> None:
    """``comm.Barrier()`` for the control plane's waits while one rank works (creates and
    reserves a segment, say): a non-blocking barrier tested between sleeps that grow from
    20 µs to ``longest``.  MPICH's blocking calls poll without pause, and with more ranks
    than cores the waiting ranks take the CPU from the one they wait for; even 1 ms naps
    are too short there (measured here, 64 ranks on 2 cores, reserving a 1.5 GiB shm
    segment that takes 0.6 s alone: 8.5 s while the others napped up to 1 ms, 0.8 s up
    to 10 ms).  A rank sees the barrier complete only when it wakes: the wait overshoots
    by at most its last nap."""
    req = comm.Ibarrier()
    nap = 2e-5
    while not req.Test():
        time.sleep(nap)
        nap = min(nap * 2, longest)
