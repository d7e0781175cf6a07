"""The plug points every transport implements, and the ordered transport registry.

Vocabulary (after gloo): a *transport* knows how to reach a class of peers (same node,
other nodes, GPU memory); ``connect`` gives one *endpoint* per peer; an endpoint moves
*messages*, each of which completes through a *completion* that never blocks.

Messages travel on *lanes*: lane 0 carries collectives (one at a time per communicator,
so their order is the same on every rank), lane 1 point-to-point traffic.  Every message
carries a ``tag`` and a signature hash ``sig`` that the receiver checks: a mismatch is a
``CollectiveMismatchError``, never a silent wrong answer.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from gpurt.errors import ResourceError

log = logging.getLogger("gpurt.transports")

LANE_COLL = 0
LANE_P2P = 1
LANES = 2
LANE_NAMES = ("collective", "point-to-point")

#: in a peer's close notice: it closed the communicator during its own split or dup of
#: it, whose exchange it stays in to its end (``Transport.staying``) — a peer waiting in
#: that exchange waits on; any other close means the peer will never come to one
CLOSED_IN_EXCHANGE = "during its own split or dup"
#: a close notice that cannot say which (verbs): a peer waiting in a split or dup acts
#: on it only where the closer's process is seen gone
CLOSED_OR_EXITED = "(it closed the communicator or exited)"

# a receive that accepts a shorter message (``upto``: the agreement check's headers, with
# or without a folded call's data) is for messages below this size, and every transport
# moves such a message as one piece: one tcp frame (tcp refuses an upto receive as large
# as its stripe threshold when it stripes), eager or one rendezvous on verbs, the rings or
# one single-copy read on shm.  (The largest are a two-rank communicator's folded
# allreduce: GPURT_NET_FOLD_PAIR, at most 4 MiB, plus a header.)
UPTO_MAX = 8 << 20

# sink(offset_in_bytes, chunk_bytes_view): consumes one arriving chunk (copy or reduce)
Sink = Callable[[int, np.ndarray], None]


@runtime_checkable
class Completion(Protocol):
    peer: int
    done: bool      # True once complete (set by whatever moved the last byte)

    def test(self) -> bool:
        """Advance the transfer as far as possible without blocking; True once complete."""


class Endpoint(Protocol):
    peer: int
    transport: str

    def send(self, src: np.ndarray, lane: int, tag: int, sig: int) -> Completion:
        """Queue ``src`` (a uint8 view) for the peer; the completion tests True once the
        bytes have left ``src`` (the caller may then reuse it)."""

    def recv(self, nbytes: int, sink: Sink, lane: int, tag: int, sig: int,
             upto: bool = False) -> Completion:
        """Receive the next message of ``lane`` from the peer; it must be ``nbytes`` long
        (``upto``: at most ``nbytes``, fewer bytes arrive — only for messages under
        ``UPTO_MAX``) and carry ``tag`` and ``sig``.  ``sink`` is called once per
        arriving chunk."""

    def check(self) -> None:
        """Raise ``PeerFailure`` if the peer is known to be gone (cheap; called while
        waiting)."""


class Transport(Protocol):
    name: str

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """(available on this machine, why or why not) — for ``gpurt info``."""

    def can_connect(self, topo, me: int, peer: int) -> bool:
        """Can this transport reach ``peer`` from ``me``?  The first yes in the registry wins."""

    def connect(self, peers: list[int], comm) -> dict[int, Endpoint]:
        """Collective over the communicator's control plane: endpoints to ``peers``."""

    #: set by the communicator before ``close()``: this rank closes during its own split
    #: or dup of the communicator (another thread's close, a signal handler's) and stays
    #: in that exchange; the close notice says so (``CLOSED_IN_EXCHANGE``)
    staying: bool

    def close(self) -> None:
        """Release everything; safe to call twice and from an exception path."""


_REGISTRY: list[tuple[str, Callable[[], type]]] = []


def register(name: str, loader: Callable[[], type]) -> None:
    """Append a transport to the registry (order = preference)."""
    _REGISTRY.append((name, loader))


def registered() -> list[tuple[str, Callable[[], type]]]:
    return list(_REGISTRY)


def p2p_sig(dtype: np.dtype, device: bool) -> int:
    """The signature of a point-to-point message: its dtype and where its buffer lives
    (the receiver checks the size apart)."""
    return _p2p_sig(dtype.str, device)


def _p2p_sig(dtype_str: str, device: bool) -> int:
    return zlib.crc32(f"p2p|{dtype_str}{'@device' if device else ''}".encode())


_P2P_NAMES: dict[int, tuple[str, int, str]] = {}


def _p2p_named(sig: int, total: int) -> str | None:
    """A point-to-point message of signature ``sig`` and ``total`` bytes in words
    ("float32 x 8 (32 bytes)", "int8 in device memory": what a host transport carries of
    a device message is not its size), for every dtype
    a message can carry; None for any other signature."""
    if not _P2P_NAMES:
        kinds = [(d.str, d.name, d.itemsize) for d in map(np.dtype, "?bBhHiIlLqQefdgFDG")]
        kinds += [("<V2", "bfloat16", 2), (">V2", "bfloat16", 2)]    # ml_dtypes' to NumPy
        for text, name, size in kinds:
            for dev in (False, True):
                _P2P_NAMES[_p2p_sig(text, dev)] = (name, size,
                                                   " in device memory" if dev else "")
    got = _P2P_NAMES.get(sig)
    if got is None:
        return None
    name, size, where = got
    if where:   # a device message's bytes on a host transport are a cuda_ipc descriptor or
        return f"{name}{where}"    # one staged chunk, not the message: no count to tell
    n = f"{total // size}" if total % size == 0 else f"{total / size:g}"
    return f"{name} x {n} ({total} bytes)"


def mismatch_detail(lane: int, tag: int, sig: int, total: int,
                    want_tag: int, want_sig: int, want_total: int,
                    upto: bool = False) -> str | None:
    """How an arriving message's header differs from the receive posted for it, in words
    (None if tag, signature and size agree — for an ``upto`` receive, a size of at most
    ``want_total``): shared by the transports' mismatch errors."""
    what = "collective call #" if lane == LANE_COLL else "tag "
    if tag != want_tag:
        return f"it carries {what}{tag}, this rank expects {what}{want_tag}"
    if sig != want_sig:
        got, want = (_p2p_named(sig, total), _p2p_named(want_sig, want_total)) \
            if lane == LANE_P2P else (None, None)
        if got and want:    # (what a message is and what its receive is for, by dtype)
            return f"both are {what}{tag} but the message is {got} and the receive {want}"
        return (f"both are {what}{tag} but the calls differ (dtype, count, op, root or "
                f"collective; signature {sig:#x} vs {want_sig:#x})")
    if upto and total <= want_total:
        return None
    if total != want_total:
        return (f"it is {total} bytes long, this rank expects "
                f"{'at most ' if upto else ''}{want_total} bytes")
    return None


def unpaired(name: str, peer_sets: list[set], hint: str) -> list[str]:
    """A transport's set-up check after its allgather: every rank that chose ``name`` for
    a peer must have been chosen by that peer too (else the two would wait on different
    transports).  One error text per unpaired choice; ``hint`` says what may differ."""
    errs = []
    for r, peers in enumerate(peer_sets):
        for q in sorted(peers):
            if r not in peer_sets[q]:
                errs.append(f"rank {r} chose {name} for rank {q} but rank {q} chose another "
                            f"transport for rank {r} ({hint})")
    return errs


# descriptors kept free beyond what a transport asks for: MPI's own, the user's files, a
# later communicator's listener and heartbeat before it asks for its own room
FD_SPARE = 64


class Throttle:
    """Warnings of one kind at most once every ``every`` seconds (strangers' connections
    and datagrams must not flood the log): ``due()`` — this one is to be logged (the
    count held back since the last comes with it), or ``None`` and it is counted;
    ``take()`` — the count held back, logged now whatever the time."""

    __slots__ = ("every", "last", "held")

    def __init__(self, every: float) -> None:
        self.every, self.last, self.held = every, -math.inf, 0

    def due(self) -> int | None:
        now = time.monotonic()
        if now - self.last < self.every:
            self.held += 1
            return None
        return self.take(now)

    def take(self, now: float | None = None) -> int:
        held, self.held = self.held, 0
        self.last = time.monotonic() if now is None else now
        return held


def ensure_fds(need: int, who: str, hint: str = "") -> None:
    """Room for ``need`` more open files in this process (a transport about to open that
    many sockets): where the open ones plus ``need`` (and ``FD_SPARE``) exceed the soft
    ``RLIMIT_NOFILE`` — 1024 on many clusters, which a full mesh of tcp connections
    passes at about a thousand remote ranks — the soft limit is raised, up to the hard
    one (any process may), rounded up to a multiple of 1024; where even the hard limit
    cannot hold them (spare or not), ``ResourceError`` naming ``who``, the counts and the
    fix, before any socket is opened (instead of EMFILE halfway through the handshakes)."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = FD_SPARE
    want = used + need + FD_SPARE
    inf = resource.RLIM_INFINITY
    if soft == inf or want <= soft:
        return
    if hard != inf and used + need > hard:
        raise ResourceError(
            f"{who}: needs {need} more open files ({used} open already, {FD_SPARE} kept "
            f"spare) but the limit is {soft} (hard limit {hard}): raise it where the job "
            f"starts (`ulimit -n {-(-want // 1024) * 1024}`, or LimitNOFILE= for a "
            f"service){hint}")
    new = -(-want // 1024) * 1024
    new = new if hard == inf else min(hard, new)
    if new <= soft:
        return          # (the hard limit is the soft one: what fits, fits without spare)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (OSError, ValueError) as e:      # (above fs.nr_open, say)
        if used + need <= soft:
            return
        raise ResourceError(
            f"{who}: needs {need} more open files ({used} open already) but the limit is "
            f"{soft}, and raising it to {new} failed ({e}): raise it where the job starts "
            f"(`ulimit -n {new}`){hint}") from None
    log.info("%s: raised the open-file limit from %d to %d (%d more needed, %d open)",
             who, soft, new, need, used)
