"""Every GPURT_* environment variable, typed and documented, in one place.

Each variable is read once per process, on first use; ``reload()`` forgets the values.
``gpurt info --env`` prints the table of ``VARIABLES`` with the current values.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    parse: Callable[[str], object]
    doc: str


def _bytes(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        v = float(s[:-1]) * mult[s[-1]]
        if not math.isfinite(v):
            raise ValueError(f"{s!r} is not a finite size")
        n = int(v)
    else:
        n = int(s)
    if n < 0:
        raise ValueError("a size cannot be negative")
    return n


def _number(lo: float = 0.0, hi: float = math.inf, integer: bool = False,
            above: bool = False, finite: bool = True) -> Callable[[str], float | int]:
    """A parser of a number in [lo, hi] (or (lo, hi] with ``above``), NaN never;
    infinity only where ``finite`` is False."""
    def parse(s: str):
        v = int(s) if integer else float(s)
        if v != v or (finite and not integer and not math.isfinite(v)):
            raise ValueError(f"{s.strip()!r} is not a finite number")
        if (v <= lo if above else v < lo) or v > hi:
            def g(x: float) -> str:
                return str(int(x)) if float(x).is_integer() else f"{x:g}"
            raise ValueError(f"must be {'above' if above else 'at least'} {g(lo)}" +
                             (f" and at most {g(hi)}" if hi != math.inf else ""))
        return v
    return parse


parse_bytes = _bytes     # "256K", "1M", "32768K" -> bytes (also for sysfs cache sizes)


def _bytes_or_auto(s: str) -> int | str:
    return "auto" if s.strip().lower() == "auto" else _bytes(s)


def _seconds_or_auto(s: str) -> float | str:
    return "auto" if s.strip().lower() == "auto" else _number(above=True, finite=False)(s)


def _flag(s: str) -> bool:
    """'0', 'false', 'no', 'off' (any case) are off; anything else is on."""
    return s.strip().lower() not in ("0", "false", "no", "off")


def _list(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _algo(s: str) -> dict[str, str]:
    """``allreduce:ring,broadcast:tree`` -> {"allreduce": "ring", "broadcast": "tree"};
    the collectives and algorithms must exist (``tuner.check_forced``: a bad name is a
    problem ``gpurt info`` reports, not only an error at every communicator's creation)."""
    out: dict[str, str] = {}
    for item in _list(s):
        if ":" not in item:
            raise ValueError(f"GPURT_ALGO entry {item!r} is not COLLECTIVE:ALGORITHM")
        coll, name = item.split(":", 1)
        out[coll.strip()] = name.strip()
    from gpurt.tuner import check_forced

    check_forced(out)
    return out


def _transports(s: str) -> tuple[str, ...]:
    """Transport names, each one gpurt has (``transports.check_names``)."""
    names = _list(s)
    from gpurt.transports import check_names

    check_names(names)
    return names


def _bytes_upto(hi: int) -> Callable[[str], int]:
    """A size (``_bytes``) of at most ``hi`` bytes."""
    def parse(s: str) -> int:
        n = _bytes(s)
        if n > hi:
            raise ValueError(f"{n} bytes: must be between 0 and {hi} bytes")
        return n
    return parse


# the most GPURT_NET_FOLD may be (an agreement message stays one tcp frame: under its
# least stripe threshold), and GPURT_NET_FOLD_PAIR (transports.base.UPTO_MAX)
NET_FOLD_MAX = 64 << 10
NET_FOLD_PAIR_MAX = 4 << 20


def _cost_names() -> tuple[str, ...]:
    """What GPURT_COST may name: every registered transport (one added through
    ``gpurt.transports.register`` too), the device-only ones and 'self'."""
    from gpurt.transports import DEVICE, registered

    return tuple(n for n, _ in registered()) + tuple(DEVICE) + ("self",)


def _cost(s: str) -> dict[str, tuple[float, float, float]]:
    """``shm=2e-6/3e9/2e9`` -> α seconds, then bandwidths in bytes/s for β and γ."""
    out = {}
    for item in _list(s):
        name, eq, vals = item.partition("=")
        name = name.strip()
        names = _cost_names()
        if not eq or name not in names:
            raise ValueError(f"entry {item!r} is not TRANSPORT=ALPHA_S/BW_Bps/REDUCE_Bps "
                             f"with a transport among {', '.join(names)}")
        parts = vals.split("/")
        if len(parts) != 3:
            raise ValueError(f"entry {item!r} needs three numbers separated by '/'")
        a, b, g = (float(v) for v in parts)
        if not (math.isfinite(a) and a >= 0):
            raise ValueError(f"entry {item!r}: ALPHA must be a finite number of seconds >= 0")
        if not (math.isfinite(b) and b > 0 and math.isfinite(g) and g > 0):
            raise ValueError(f"entry {item!r}: the bandwidths must be finite and above 0")
        out[name] = (a, 1.0 / b, 1.0 / g)
    return out


def _choice(*names: str) -> Callable[[str], str]:
    def parse(s: str) -> str:
        v = s.strip().lower()
        if v not in names:
            raise ValueError(f"use one of {', '.join(names)}")
        return v
    return parse


# (Ranges: checked here where every rank reads the value; a transport's own settings —
# GPURT_TCP_*, GPURT_IB_* — where that transport is set up, so that a bad one matters only
# where it is used.)
VARIABLES: tuple[Var, ...] = (
    Var("GPURT_TIMEOUT", "300", _number(finite=False),
        "Default deadline in seconds for every blocking call and wait (per call: timeout=)."),
    Var("GPURT_INIT_TIMEOUT", "auto", _seconds_or_auto,
        "Deadline in seconds for every rank to come to a communicator's creation "
        "(gpurt.init(), gpurt.Communicator(c)); auto: the larger of GPURT_TIMEOUT and 300 "
        "(ranks of a large job start minutes apart where imports come from a shared file "
        "system; a short GPURT_TIMEOUT for calls must not fail the start)."),
    Var("GPURT_CHECK", "1", _flag,
        "Before a collective moves data by a schedule, every rank checks that every rank "
        "made the same call (one shm-board round on one-node communicators), and a call's "
        "buffers are compared with those of the requests in flight; 0 skips both."),
    Var("GPURT_NET_FOLD", "64K", _bytes_upto(NET_FOLD_MAX),
        "Several nodes, with GPURT_CHECK=1, up to 8 ranks: a collective whose data a rank "
        "would send to all the others in at most this many bytes ((ranks - 1) x its "
        "contribution) runs inside the agreement's exchange (agreement and data together, "
        "one round) instead of the agreement then a schedule; each agreement message is as "
        "long as its call needs (0: never, at most 64K; decided on rank 0). Within it, a "
        "GPURT_PROFILE that measured the call's size decides (gpurt tune times 'folded')."),
    Var("GPURT_NET_FOLD_PAIR", "1M", _bytes_upto(NET_FOLD_PAIR_MAX),
        "Two ranks on two nodes (or without the shm board), with GPURT_CHECK=1: an "
        "allreduce of at most this many bytes also runs inside the agreement's exchange "
        "(each rank's whole input crosses once and both reduce: the bytes of the two-step "
        "ring in one round; its larger reduction outweighs the saved round beyond a few "
        "MiB). 0: only GPURT_NET_FOLD; at most 4M; with tcp striping, below "
        "GPURT_TCP_STRIPE_MIN; decided on rank 0."),
    Var("GPURT_PEER_STOPPED", "5", _number(finite=False),     # (inf: never)
        "Seconds a peer may stay stopped (SIGSTOP, a debugger) while others wait for it "
        "before they raise PeerFailure: a local peer's process state, a remote peer's "
        "silence after the first unanswered heartbeat ping."),
    Var("GPURT_ALGO", "", _algo,
        "Force algorithms, e.g. 'allreduce:ring,broadcast:tree'. Names: see `gpurt info`."),
    Var("GPURT_PROFILE", "", str,
        "A profile written by `gpurt tune`: the tuner picks its measured winners for "
        "communicators of the same shape (GPURT_ALGO and algo= still override)."),
    Var("GPURT_TRANSPORTS", "", _transports,
        "Order and filter the transport registry, e.g. 'shm,tcp'. Empty: all, default order. "
        "Device buffers use cuda_ipc inside a node when this is empty or names it; set "
        "without it, they are staged through pinned host memory everywhere."),
    Var("GPURT_SHM_SLOT", "256K", _bytes,
        "shm: bytes per ring slot (a message larger than a slot streams through the ring)."),
    Var("GPURT_SHM_SLOTS", "8", _number(1, 1 << 16, integer=True),
        "shm: slots per ring (per ordered pair of ranks and lane)."),
    Var("GPURT_SHM_RING_MEM", "32M", _bytes,
        "shm: the most bytes of ring slots one rank has towards all its local peers "
        "together (the slots shrink, size first down to 16K, then count down to 2, until "
        "they fit: the segment grows with the square of the local ranks; 0: no limit)."),
    Var("GPURT_SHM_BOARD", "256K", _bytes,
        "shm: bytes per board buffer; collectives whose per-rank data fits use the one-round "
        "board protocol when all ranks share a node (0 disables it)."),
    Var("GPURT_SHM_STAGE", "auto", _bytes_or_auto,
        "shm: an allreduce of at most this many bytes that would take shm_direct on "
        "ordinary (not comm.empty) arrays is staged through the board instead: every rank "
        "copies its input into its board buffer with the agreement's header, reduces its "
        "block of all of them, and copies the others' reduced blocks out (memcpy speed, "
        "no process_vm_readv/writev; no rank touches another's arrays).  The board's "
        "buffers (two per rank) grow to this size (each at most 32 MiB / local ranks); "
        "0 disables.  auto: 2M, staged only where the compiled shares by "
        "process_vm_readv/writev cannot run (CMA forbidden, or gpurt._fastboard not "
        "built), since they measured faster."),
    Var("GPURT_SHM_HELP", "1M", _bytes,
        "shm: a single-copy receive of at least this many bytes (straight into the "
        "destination) is shared with the sender, which copies chunks into it "
        "(process_vm_writev) while it waits; needs gpurt._fastboard and a CPU per local rank; "
        "0 disables."),
    Var("GPURT_NATIVE", "1", _flag,
        "Use the compiled gpurt._fastboard where it was built: the shm board's blocking "
        "round and its reads (every blocking collective on NumPy arrays), the "
        "cooperative single copy and the quick send/receive of host messages on the shm "
        "ring (through its slots, or single-copy from GPURT_SHM_CMA_P2P); 0 runs the board and the rings in Python "
        "and copies receiver-only. Set it alike on every rank (NaN payloads of float "
        "reductions may differ otherwise)."),
    Var("GPURT_NT_COPY", "auto", _bytes_or_auto,
        "Host copies of at least this many bytes (a local copy of a collective, a receive "
        "from a peer's shared array, a helping sender's chunks of one) use non-temporal "
        "stores (gpurt._fastboard, x86-64); auto: the last-level cache (counted up to 128M) "
        "/ (2 × ranks on the node), at least 1M; 0 disables."),
    Var("GPURT_SHM_SHARED", "1", _flag,
        "shm: single-copy messages from an array of gpurt.empty/zeros (comm.empty) are read "
        "through a mapping of the sender's shared memory (memcpy, and reductions in place), "
        "and helping senders copy into such a destination the same way; 0 disables (they "
        "then go as any other array)."),
    Var("GPURT_SHM_CMA", "auto", _bytes_or_auto,
        "shm: collectives' messages of at least this many bytes are read by the receiver "
        "straight from the sender's memory (process_vm_readv, one copy instead of two) "
        "where the probe at start allows it; auto: the last-level cache / (4 × local ranks), at least 128K "
        "(smaller messages stay in cache through the rings' two copies, which is faster), "
        "and 128K with more local ranks than CPUs; "
        "0 disables.  Messages from comm.empty arrays go single-copy from 128K "
        "(GPURT_SHM_SHARED)."),
    Var("GPURT_SHM_CMA_P2P", "auto", _bytes_or_auto,
        "shm: the same for send/recv (the point-to-point lane); auto: GPURT_SHM_CMA's "
        "threshold, at most 128K (a send waits for its receiver there, and one copy beats "
        "the rings' two from there on: 2 ranks, irecv/isend/wait of 256 KiB 31 against "
        "51 µs, of 1 MiB 89-107 against 225); 0 disables."),
    Var("GPURT_SHM_DIRECT", "auto", _bytes_or_auto,
        "shm: on a one-node communicator, allreduce, reduce, reduce_scatter, allgather, "
        "alltoall and broadcast of at least this many bytes (S as nccl-tests counts it) "
        "whose buffers are all comm.empty arrays run as loads and stores straight into "
        "the peers' buffers (shm_direct: each byte read and written once); auto: 256K, "
        "reduce 1M, broadcast 4M (where it measured faster than the schedules); 0 disables."),
    Var("GPURT_SHM_DIRECT_CMA", "auto", _bytes_or_auto,
        "shm: the same where some buffer is an ordinary array, reached with "
        "process_vm_readv/writev where the probe allows it (an allreduce that fits "
        "GPURT_SHM_STAGE is staged through the board instead); auto: 64K (where the "
        "tuner would pick a schedule; the board keeps what it runs); 0 disables."),
    Var("GPURT_SHM_PTRACER", "1", _flag,
        "shm: where Yama's ptrace_scope is 1 (Ubuntu's default), which refuses "
        "process_vm_readv/writev between sibling processes such as MPI ranks, every rank "
        "declares any process of its user a permitted ptracer (prctl PR_SET_PTRACER_ANY, as "
        "Open MPI does) before the start-up probe, so that single copies (CMA) work; 0 "
        "leaves Yama's rule alone (CMA is then off: two copies through shared memory)."),
    Var("GPURT_SHM_DIR", "/dev/shm", str, "shm: where segments are created (nameless: O_TMPFILE)."),
    Var("GPURT_SOCKET_IFNAME", "", str,
        "tcp: the interface whose IPv4 address a rank advertises, as NCCL_SOCKET_IFNAME: "
        "name prefixes 'eth,ib', '^docker,lo' excludes, '=eth0' exact names. Empty: the first "
        "up interface that is not loopback, docker* or virbr* (loopback if there is no other)."),
    Var("GPURT_TCP_STRIPES", "1", int,     # (its range: checked where tcp is set up)
        "tcp: connections per pair of ranks; messages of at least GPURT_TCP_STRIPE_MIN bytes "
        "are split over all of them (rank 0's value is used everywhere)."),
    Var("GPURT_TCP_STRIPE_MIN", "1M", _bytes,
        "tcp: messages of at least this many bytes are striped (128K at least; rank 0's "
        "value is used everywhere)."),
    Var("GPURT_TCP_USER_TIMEOUT", "10", float,
        "tcp: seconds of unacknowledged data (TCP_USER_TIMEOUT) or silence (keepalive) after "
        "which a link counts as dead: PeerFailure instead of the kernel's ~15 minutes."),
    Var("GPURT_TCP_BUFFER", "0", _bytes,
        "tcp: SO_SNDBUF/SO_RCVBUF per connection; 0 leaves them to the kernel's autotuning."),
    Var("GPURT_IB_HCA", "", str,
        "verbs: which RDMA device/port, as NCCL_IB_HCA: 'mlx5_0:1,mlx5_1' name prefixes with "
        "an optional port, '^mlx5_2' excludes, '=mlx5_0' exact names. Empty: the first "
        "active port."),
    Var("GPURT_IB_GID_INDEX", "-1", int,
        "verbs: GID index; -1 picks a RoCE v2 GID with an IPv4-mapped address on RoCE ports "
        "and routes by LID on InfiniBand."),
    Var("GPURT_IB_EAGER", "16K", _bytes,
        "verbs: messages of at most this many bytes are written into the peer's ring slots "
        "(one copy each side); larger ones go zero-copy by rendezvous (same on every rank)."),
    Var("GPURT_IB_SLOTS", "16", int,
        "verbs: ring slots (credits) per peer for eager and control messages (same on every "
        "rank)."),
    Var("GPURT_IB_REG_CACHE", "4G", _bytes,
        "verbs: user memory kept registered (pinned) at most; least recently used "
        "registrations are dropped beyond it."),
    Var("GPURT_IB_GDR", "auto", str,
        "verbs: GPUDirect RDMA for device buffers larger than GPURT_IB_EAGER: 'auto' (when "
        "nvidia-peermem is loaded), '1' (register device pointers regardless, e.g. the "
        "stand-in device), '0' (stage through pinned host memory)."),
    Var("GPURT_IB_TIMEOUT", "18", int,
        "verbs: QP local ACK timeout exponent (4.096 us * 2^N per try, as NCCL_IB_TIMEOUT)."),
    Var("GPURT_IB_RETRY_CNT", "7", int,
        "verbs: QP retry count; after the last try the QP errors (IBV_WC_RETRY_EXC_ERR)."),
    Var("GPURT_DEVICE", "", lambda s: s.strip() and str(_number(0, integer=True)(s)),
        "GPU path: the device index this rank binds to (default: local rank modulo the visible "
        "devices; several ranks may share one GPU). CUDA_VISIBLE_DEVICES is respected."),
    Var("GPURT_DEVICE_BACKEND", "auto", _choice("auto", "cuda", "standin", "none"),
        "GPU path: 'auto'/'cuda' (CuPy), 'standin' (a host-memory stand-in for testing the "
        "device protocol without a GPU; not a GPU) or 'none' (device buffers refused)."),
    Var("GPURT_DEVICE_STAGE", "4M", _bytes,
        "GPU path: chunk size of pinned host staging for device buffers sent over host "
        "transports (shm across GPUs without P2P, tcp, verbs without GPUDirect)."),
    Var("GPURT_DEVICE_STAGE_KEEP", "10", _number(),
        "GPU path: seconds a pooled page-locked staging buffer (or device scratch, or a "
        "GPUDirect bounce or scratch buffer, then deregistered) may stay idle before it is released (checked whenever staging uses the pool; 0: none is "
        "kept)."),
    Var("GPURT_IPC_STREAM_WAIT", "0", _flag,
        "GPU path, cuda_ipc: 1 makes the receiver's stream wait on the sender's IPC event "
        "(its read queued at once, no host round trip per message) instead of polling the "
        "event from the host first (the default: a stream wait cannot be cancelled, so a "
        "sender that fails before its event fires leaves the receiver's stream blocked "
        "for ever)."),
    Var("GPURT_STANDIN_DELAY_US", "0", _number(hi=60e6),
        "Stand-in device only: each queued device operation waits this long first (widens "
        "race windows in tests)."),
    Var("GPURT_STANDIN_DEVICES", "1", _number(1, 64, integer=True),
        "Stand-in device only: how many devices it pretends to have."),
    Var("GPURT_STANDIN_P2P", "1", _flag,
        "Stand-in device only: 0 declares that distinct devices cannot reach each other."),
    Var("GPURT_SPIN_US", "50", _number(hi=1e6),
        "Waits poll this many microseconds before yielding the CPU, then back off to sleeps."),
    Var("GPURT_COST", "", _cost,
        "Override the tuner's cost constants: 'shm=ALPHA_S/BW_Bps/REDUCE_Bps', e.g. "
        "'shm=3e-6/4e9/2e9'."),
    Var("GPURT_EXCEPTHOOK", "1", _flag,
        "Publish an unhandled exception to the peers (they raise PeerFailure naming this "
        "rank and the exception) before the usual traceback; 0 leaves sys.excepthook alone."),
    Var("GPURT_FLIGHT", "64", _number(0, 1 << 20, integer=True),
        "Calls each communicator remembers for the flight recorder (0: off); on a failure "
        "the last ones go to stderr."),
    Var("GPURT_MPIEXEC", "", str,
        "gpurt launch, bench and tune (and the tests): the MPI launcher command, flags "
        "allowed ('mpirun --oversubscribe'). Empty: srun inside a Slurm job, else the "
        "mpiexec beside this Python, else PATH's."),
    Var("GPURT_FLIGHT_DIR", "", str,
        "Also write every rank's flight records there as JSON on a failure; "
        "`gpurt flight DIR` lines the ranks up."),
    Var("GPURT_LOG", "warning",
        lambda s: _choice("debug", "info", "warning", "warn", "error", "critical", "fatal",
                          "notset")(s).upper(),       # (the names logging knows)
        "Level of the 'gpurt' logger: debug, info, warning, error."),
)

_BY_NAME = {v.name: v for v in VARIABLES}


_CACHE: dict[str, object] = {}


def reload() -> None:
    """Forget the values read so far (the next ``get`` re-reads the environment)."""
    _CACHE.clear()
    _read.cache_clear()


@lru_cache(maxsize=None)
def _read(name: str, raw: str | None) -> object:
    var = _BY_NAME[name]
    text = raw if raw else var.default
    try:
        return var.parse(text)
    except Exception as e:  # noqa: BLE001 - (OverflowError, ZeroDivisionError ... too)
        raise ValueError(f"{name}={raw!r} is not valid: {e}. {var.doc}") from None


def get(name: str) -> object:
    """The typed value of ``name`` from the environment, or its default.  Read once per
    process and cached (hot paths call this); ``reload()`` forgets."""
    try:
        return _CACHE[name]
    except KeyError:
        pass
    if name not in _BY_NAME:
        raise KeyError(f"{name} is not a gpurt variable")
    val = _CACHE[name] = _read(name, os.environ.get(name))
    return val


def problems() -> list[str]:
    """What is wrong with the gpurt variables set here (each as ``get`` would raise it):
    checked when a communicator is created, so a bad value is one clear error on every
    rank then, not an error of whichever part reads it first."""
    out = []
    for v in VARIABLES:
        try:
            get(v.name)
        except ValueError as e:
            out.append(str(e))
    return out


# read by every rank's own set-up in collective steps (the transports each rank connects):
# a value that differs between ranks must be one error on every rank, not a hang there
SAME_EVERYWHERE = ("GPURT_TRANSPORTS",)


def must_agree() -> tuple:
    """This rank's values of ``SAME_EVERYWHERE`` (None for one not valid: ``problems``
    reports it), compared across the ranks when a communicator is created."""
    out = []
    for name in SAME_EVERYWHERE:
        try:
            out.append(get(name))
        except ValueError:
            out.append(None)
    return tuple(out)


def table() -> list[tuple[str, str, str, str]]:
    """(name, default, current raw value or '', doc) for every variable."""
    return [(v.name, v.default, os.environ.get(v.name, ""), v.doc) for v in VARIABLES]
