"""The public communicator: argument checks, then one funnel (``_submit``) into the engine.

Semantics shared by every collective
------------------------------------
* Buffers: NumPy arrays, anything with the buffer protocol, DLPack CPU tensors (PyTorch),
  C-contiguous.  Results are written into ``out``; with ``out=None`` an in-place
  collective (allreduce, broadcast, reduce on the root) writes into ``x``, and the others
  allocate a new array of the same kind as ``x`` and return it.
* Every blocking call takes ``timeout=`` (seconds, default ``GPURT_TIMEOUT``); the
  ``i``-variants return a ``Request`` (``wait(timeout)``, ``test()``).
* Collectives on one communicator run in call order, one at a time; every rank must
  call the same collectives in the same order with matching arguments.  A message whose
  call number, kind, dtype, size, op or root differs from what the receiver posted is a
  ``CollectiveMismatchError``.
* Not thread-safe: use one communicator per thread (``dup``).
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import functools
import itertools
import logging
import math
import operator
import os
import re
import socket
import sys
import threading
import time
import weakref
import zlib
from functools import lru_cache
from typing import Any, Callable

import numpy as np

from . import callsite, config, devpath, flight, memcopy, sharedmem, wait
from . import executor as _executor
from .buffers import Buf, as_buf, check_writable, empty_like, overlaps, same
from .errors import (CollectiveMismatchError, CollectiveTimeout, CommunicatorClosed,
                     GpurtError, PeerFailure, ResourceError, relay_text,
                     TransportError)
from .executor import (Chain, Completed, Engine, P2PRun, QuickRecv, Request, RowsRun,
                       _ArraySink, _CopySink, _Run, check_timeout, wait_mpi)
from .flight import FlightRecorder
from .ops import FAST_OPS as _FAST_OPS, Op, _SUPPORTED, as_op, check_op, host_finalize, reducer, \
    supported
from .schedule import Copy, Recv, Schedule, Send, Slice
from .algorithms import REGISTRY, Cost
from .hier import HIER, Shape
from .topology import Topology, rank_ranges
from .tuner import FOLD, NATIVE_NAMES, Native, Tuner, load_profile, oversubscribed, transport_cost
from .wait import spin_seconds

from gpurt.transports import shm_board, shm_direct  # noqa: E402  (after the core imports)
from gpurt.transports.base import (CLOSED_IN_EXCHANGE, CLOSED_OR_EXITED, LANE_P2P,  # noqa: E402
                                   p2p_sig)
from gpurt.transports.shm import _SEND_CHECK, _Msg  # noqa: E402
from gpurt.transports import cma as _cma  # noqa: E402
from gpurt.transports.cma import address as _address  # noqa: E402
from gpurt.transports.tcp import _settings as tcp_settings  # noqa: E402

_PLAIN = shm_board.PLAIN   # the compiled check of x and out for allreduce's quick path

log = logging.getLogger("gpurt.comm")

_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
_COMM_IDS = itertools.count()
_ROOTED = frozenset({"reduce", "broadcast", "gather", "scatter"})
_WORLD: "Communicator | None" = None


def _mpi():
    from mpi4py import MPI
    return MPI


_THREAD_LEVELS = {"single": "THREAD_SINGLE", "funneled": "THREAD_FUNNELED",
                  "serialized": "THREAD_SERIALIZED", "multiple": "THREAD_MULTIPLE"}


def _mpi_ready(who: str = ""):
    """mpi4py's ``MPI``, initialised: a program that set ``mpi4py.rc.initialize = False``
    and has not called ``MPI.Init`` yet gets it initialised here (at the thread level
    ``mpi4py.rc.thread_level`` asks for, as mpi4py itself would, and finalized at exit
    after gpurt's communicators are closed: mpi4py does not finalize an MPI it did not
    initialise, and a rank leaving without MPI_Finalize gets the job's other ranks killed
    by the process manager).  After ``MPI.Finalize()`` no communicator can be made (MPICH
    would end the process from inside the call, with no exception): ``CommunicatorClosed``."""
    MPI = _mpi()
    if MPI.Is_finalized():
        if not who:     # (MPI cannot say which rank this was any more; the launcher can)
            world = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
            who = f"rank {world} of MPI_COMM_WORLD" if world else f"pid {os.getpid()}"
        raise CommunicatorClosed(
            f"{who}: MPI was finalized (MPI.Finalize() was called): gpurt makes "
            f"communicators with MPI, so none can be made or split any more; communicators "
            f"made before go on working until closed")
    if not MPI.Is_initialized():
        import mpi4py
        level = str(getattr(mpi4py.rc, "thread_level", "multiple")).lower()
        MPI.Init_thread(getattr(MPI, _THREAD_LEVELS.get(level, "THREAD_MULTIPLE")))
        global _MPI_OURS
        _MPI_OURS = os.getpid()
    return MPI


_TIMED_OUT = re.compile(r"failed: (PeerFailure\[rank=\d+\]: .*)?CollectiveTimeout: ")
_MPI_OURS = 0       # pid of the process in which gpurt initialised MPI (it finalizes it)
#: below MPI_THREAD_MULTIPLE: the thread in gpurt's MPI exchanges of a communicator
#: creation (split, dup, Communicator) and how deeply ([ident, depth]; ident None: none)
_MPI_TURN: list = [None, 0, ""]       # (and the holder's kind: "create" or "free")
_MPI_TURN_LOCK = threading.Lock()
_MPI_LEVEL: list = []      # MPI's thread level, once asked (it cannot change)
_REFUSED = "another thread of this process is making a communicator"


def _take_turn(MPI, kind: str = "create") -> bool | None:
    """This thread's turn in gpurt's MPI calls (``_mpi_turn``): None where MPI runs at
    MPI_THREAD_MULTIPLE (no turns), True when taken (``_give_turn`` after), False when
    another thread has it — except that a creation waits for another thread's frees
    (local and quick: no peer is waited for), instead of being refused for them."""
    if not _MPI_LEVEL:
        _MPI_LEVEL.append(MPI.Query_thread())
    if _MPI_LEVEL[0] >= MPI.THREAD_MULTIPLE:
        return None
    me = threading.get_ident()
    while True:
        with _MPI_TURN_LOCK:
            if _MPI_TURN[0] in (None, me):
                if _MPI_TURN[0] is None:
                    _MPI_TURN[2] = kind
                _MPI_TURN[0] = me
                _MPI_TURN[1] += 1
                return True
            if kind != "create" or _MPI_TURN[2] != "free":
                return False
        time.sleep(1e-4)


def _give_turn() -> None:
    with _MPI_TURN_LOCK:
        _MPI_TURN[1] -= 1
        if not _MPI_TURN[1]:
            _MPI_TURN[0] = None


@contextlib.contextmanager
def _mpi_turn(MPI, who: str, what: str):
    """The MPI exchanges of a communicator creation (``what``), refused with a clear error
    where another thread of this process is in one and MPI runs below
    ``MPI_THREAD_MULTIPLE``: two threads' MPI calls at once there crash MPI or mix up its
    messages (MPICH at SERIALIZED/FUNNELED/SINGLE: a segmentation fault, "Message
    truncated", or both threads waiting for ever; a bug hunt).  Waiting for the other
    thread instead is no way out: the threads of another rank may take the opposite
    order, and both ranks would wait for ever.  Nested creations of one thread (split's
    new communicator, dup's) are its own turn; a ``close()`` meanwhile leaves its MPI
    handles to be freed later (``_free_mpi``)."""
    took = _take_turn(MPI)
    if took is False:
        names = {getattr(MPI, n): n for n in _THREAD_LEVELS.values()}
        e = GpurtError(
            f"{who}: {what}: {_REFUSED} "
            f"(split, dup or Communicator: MPI exchanges) at the same time, and MPI "
            f"runs at MPI_{names.get(_MPI_LEVEL[0], _MPI_LEVEL[0])}, where two "
            f"threads' MPI calls at once crash MPI or mix up its messages: make "
            f"communicators one thread at a time (or before the threads start), or "
            f"initialise MPI with MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = "
            f"'multiple', mpi4py's default)")
        e.not_your_turn = True
        raise e
    try:
        yield
    finally:
        if took:
            _give_turn()


def _announces_rejection(coll: str):
    """For a collective's i-method: when the call is rejected as invalid input (ValueError
    or TypeError before it counted), tell the peers on the board — so that ranks that made
    a valid call raise CollectiveMismatchError at once instead of waiting for this rank
    until their deadline — then raise as usual.  Ranks that rejected the same call all
    skip it together and stay in step."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            self.engine.check_thread()  # (before a rejection could count: see Engine.enter)
            seq = self._seq
            try:
                algo = kwargs.get("algo")
                if algo is not None and not isinstance(algo, str):
                    raise TypeError(f"rank {self.rank}: {coll}: algo= is an algorithm's "
                                    f"name (a str) or None, got {algo!r}")
                return fn(self, *args, **kwargs)
            except (ValueError, TypeError):
                if self._seq == seq and (self.board is not None or self._netcheck) \
                        and not self._closed and self.engine.poisoned is None:
                    self._publish_rejection(coll)
                raise

        return wrapper

    return deco


_P2P_RUNS = frozenset((P2PRun, QuickRecv))


def _coll_held(coll: str, xb: Buf | None, ob: Buf | None, root: int, rank: int) -> tuple:
    """A host collective's buffers as (array, writes) pairs, as ``Request.held`` holds
    them: ``broadcast`` only reads its buffer on the root and only writes it elsewhere;
    ``reduce`` off the root only reads ``x`` (its ``out`` is ``x``, never written); in
    place (``out`` is ``x``) one buffer, written; else ``x`` read, ``out`` written."""
    if coll == "broadcast":
        return ((xb.array, rank != root),) if xb is not None else ()
    if coll == "reduce" and rank != root:
        return ((xb.array, False),) if xb is not None else ()
    if xb is not None and ob is not None and same(xb, ob):
        return ((ob.array, True),)
    return tuple((b.array, w) for b, w in ((xb, False), (ob, True)) if b is not None)


class _ClashIndex:
    """The spans of an engine's point-to-point requests in flight, sorted by first byte
    (``Communicator._clash_p2p``, where more than a few are in flight: a scan of all of
    them at every call made K posts cost K² — 2000 irecvs and isends took 6.6 s against
    0.4 s unchecked).  Built from ``Engine.p2p`` and extended with what was appended to
    that list since (a burst of posts appends; progress replaces the list, and the index
    is then built again).  Writes never overlap anything accepted, reads may overlap
    reads: a span overlapping [lo, hi) starts before hi and after lo - ``longest``."""

    __slots__ = ("src", "n", "tail", "keys", "ents", "longest", "odd")

    def __init__(self, src: list):
        self.src, self.n, self.tail = src, 0, None
        self.keys: list[int] = []
        self.ents: list[tuple] = []
        self.longest = 0
        self.odd: list[tuple] = []      # (not contiguous: compared one by one)
        self.extend()

    def extend(self) -> None:
        src = self.src
        for q in src[self.n:]:
            spans = q.spans
            if spans is None:
                spans = q.spans = _spans(q)
            for qlo, qhi, writes, arr in spans:
                if qlo < 0:
                    self.odd.append((qlo, qhi, writes, arr, q))
                    continue
                i = bisect.bisect_right(self.keys, qlo)
                self.keys.insert(i, qlo)
                self.ents.insert(i, (qlo, qhi, writes, arr, q))
                if qhi - qlo > self.longest:
                    self.longest = qhi - qlo
        self.n = len(src)
        self.tail = src[-1] if src else None

    def current(self, src: list) -> bool:
        """Is this index ``src``'s, with only appends since (a wait that completed one
        request takes it out of the list in place: then built again)?"""
        n = self.n
        return src is self.src and len(src) >= n and (n == 0 or src[n - 1] is self.tail)


def _spans(q: Request) -> tuple:
    """The host buffers request ``q`` holds while in flight, as (first byte, end, writes,
    array) — first byte -1 where not contiguous — from ``Request.held``, its
    ``coll_bufs`` (``_coll_held``) or its ``P2PRun`` (``Communicator._clash``)."""
    held = q.held
    if held is None:
        run = q.run
        bufs = q.coll_bufs
        held = _coll_held(*bufs) if bufs is not None else \
            ((run.arr, not run.send),) if isinstance(run, P2PRun) else ()
    out = []
    for arr, writes in held:
        if arr is None or not arr.nbytes:
            continue
        if arr.flags.c_contiguous:
            a = _address(arr)
            out.append((a, a + arr.nbytes, writes, arr))
        else:
            out.append((-1, -1, writes, arr))
    return tuple(out)


class Communicator:
    """A group of ranks that run collectives together; wraps an mpi4py intracommunicator.

    Construction is collective over ``mpi_comm``: it duplicates it (gpurt's control-plane
    traffic never mixes with the application's), finds the nodes, and connects a transport
    to every peer (``shm`` inside a node).
    """

    # shm_direct's compiled shares by CMA can run on every rank (``_direct_setup``)
    _cma_shares = False
    # the process that made this communicator (a forked child's close() waits for no
    # call: they run in its parent)
    _pid = 0
    # set in a forked child (``_after_fork``): the communicator is its parent's
    _forked = False
    # an error for the peers that the thread advancing a call (``Engine.busy``: an inline
    # one, or a Request's wait) publishes when it stops: another thread's abort() or
    # close() came while it may still be writing into their buffers, and a published
    # error tells them it has stopped (``_on_poison``, ``_publish_deferred``)
    _deferred: str | None = None
    # the thread publishing it and draining now (0: none; close() waits for the end)
    _telling = 0
    # what close() tells the peers of a call in flight (None: no call was running)
    _close_text: str | None = None
    # splits and dups in their exchanges over self.mpi here, and whether a close()
    # meanwhile left the MPI handles to them to free (_control_plane)
    _ctl_depth = 0
    _free_later = False
    _cidx: "_ClashIndex | None" = None      # (_clash_p2p)

    def __init__(self, mpi_comm: Any = None, *, _owned: bool = False,
                 _check: Callable[..., None] | None = None):
        MPI = _mpi_ready()
        world = MPI.COMM_WORLD.Get_rank()
        with _mpi_turn(MPI, f"rank {world} of MPI_COMM_WORLD", "gpurt.Communicator"):
            self._init(MPI, mpi_comm, _owned, _check)

    def _init(self, MPI, mpi_comm: Any, _owned: bool,
              _check: Callable[..., None] | None) -> None:
        if mpi_comm is None:
            mpi_comm = MPI.COMM_WORLD
        if not isinstance(mpi_comm, MPI.Comm) or mpi_comm == MPI.COMM_NULL or \
                mpi_comm.Is_inter():
            who = f"rank {MPI.COMM_WORLD.Get_rank()} of MPI_COMM_WORLD"
            if not isinstance(mpi_comm, MPI.Comm):
                raise TypeError(f"{who}: gpurt.Communicator needs an mpi4py "
                                f"intracommunicator, got {mpi_comm!r}")
            if mpi_comm == MPI.COMM_NULL:
                raise TypeError(f"{who}: gpurt.Communicator needs an mpi4py "
                                f"intracommunicator, got MPI.COMM_NULL (a communicator "
                                f"already freed, or one this rank is not in: Split/Create "
                                f"return COMM_NULL there)")
            raise TypeError(f"{who}: gpurt.Communicator needs an intracommunicator (got an "
                            f"intercommunicator; Merge() it first)")
        self._closed = False
        self._pid = os.getpid()
        self._ctl_lock = threading.RLock()      # split and dup, one at a time (_control_plane)
        self._transports: list = []
        self.dev, self.dev_why, self.dev_endpoints, self.dev_ipc = None, "not set up", {}, None
        self._devtuner = self._devtmp = self._devlast = self._devorder = None
        self._agree_bufs: tuple | None = None     # see _agreement_run
        self._hf: _HierFold | None = None         # the same, hierarchical (_hier_fold)
        self._agree_hdrs: dict = {}               # (sig, meta, site) -> header words
        self._fold_views: dict = {}               # (offset, bytes, dtype) -> rows' blocks
        self._devretired: list = []     # outgrown device scratch, until its event fires
        if _check is not None:      # (dup: its watch has the deadline)
            _gather_progressing(mpi_comm, _check)
        elif not _owned:            # (split's new communicator: split waited so already)
            _arrival(mpi_comm)
        self.mpi, self.node_comm = _mpi_comms(mpi_comm, _owned)
        # (MPI's handles of a communicator collected without close() are freed at the
        # next creation or close() here: see _MPI_GARBAGE)
        self._mpi_fin = weakref.finalize(self, _MPI_GARBAGE.extend,
                                         [(self._pid, self.node_comm), (self._pid, self.mpi)])
        self._mpi_fin.atexit = False
        self.rank: int = self.mpi.Get_rank()
        self.size: int = self.mpi.Get_size()
        leader = self.node_comm.bcast(self.rank, 0)
        info = self.mpi.allgather((leader, socket.gethostname(), os.getpid(), next(_COMM_IDS),
                                   config.problems(), config.must_agree(),
                                   os.urandom(3).hex(), _pid_namespace(),
                                   wait.machine_id(), wait.affinity_mask()))
        # the same on every rank: rank 0's pid, count and a random part (pids repeat
        # across hosts and in pid namespaces: two communicators of a job shared '11-1',
        # and one's flight records overwrote the other's)
        self.cid = f"{info[0][2]}-{info[0][3]}-{info[0][6]}"
        self.topo = Topology.from_ids([i[0] for i in info], [i[1] for i in info])
        self.pids = tuple(i[2] for i in info)
        # each rank's pid namespace (0: unknown): a local peer's pid names it in /proc here
        # only where the namespaces are the same (containers sharing IPC, not pids)
        self.pidns = tuple(i[7] for i in info)
        #: (ranks of this communicator on this rank's machine that share CPUs with it,
        #: the CPUs they may run on): where the ranks outnumber them, the communicators
        #: this process creates from now on (this one included) do not spin in their
        #: waits (wait.note_machine) — also where MPI's node is smaller than the machine
        self.machine = wait.machine_load([i[8] for i in info], [i[9] for i in info],
                                         self.rank)
        wait.note_machine(*self.machine)
        self.node: int = self.topo.node_of[self.rank]
        self.nnodes: int = self.topo.nnodes
        self.local_rank: int = self.topo.local_rank(self.rank)
        self.local_size: int = len(self.topo.local_ranks[self.node])
        self._seq = 0
        self._scratch = np.empty(0, np.uint8)
        self.board = None
        self._quick: tuple = ()   # allreduce's last board plans (op, dtype, count, plan, bytes)
        #: send/recv's quick path: per local peer on shm, its rings (_p2p_quick_table)
        self._qt: dict | None = None
        self._qspin = 0           # a quick blocking recv's spin budget (ns)
        self._direct: shm_direct.Access | None = None
        # per collective, shm_direct from S bytes (0: never) for shared arrays, others
        self._direct_min: dict[str, tuple[int, int, int]] = {}
        self._check = False
        self._clash_on = False
        self._netcheck = False
        self.flight: FlightRecorder | None = None
        self._fastplans: dict = {}
        self._netplans: dict = {}         # the inline path's plans across nodes, per call shape
        #: the algorithm (or native protocol) the last collective call used
        self.last_algorithm = ""
        try:
            bad = {r: i[4] for r, i in enumerate(info) if i[4]}
            if bad:     # (raised on every rank: the exchange above told them all)
                where = ", ".join(map(str, bad)) if len(bad) < self.size else "every rank"
                texts = list(dict.fromkeys(t for ts in bad.values() for t in ts))
                raise ValueError(f"rank {self.rank}: gpurt settings not valid on rank(s) "
                                 f"{where}: " + "; ".join(texts[:3]) +
                                 (f" (and {len(texts) - 3} more)" if len(texts) > 3 else ""))
            _check_alike(self.rank, [i[5] for i in info])
            self._connect()
            self.engine = Engine(self.rank, lambda: float(config.get("GPURT_TIMEOUT")),
                                 self._check_peers, spin_seconds(self.local_size))
            live = [t for t in self._transports if getattr(t, "endpoints", None)]
            waiters = [t.wait for t in live if callable(getattr(t, "wait", None))]
            if len(waiters) == 1 and len(live) == 1:
                self.engine.sleeper = waiters[0]   # e.g. tcp only: select on its sockets
            elif waiters:
                self.engine.sleeper = functools.partial(_sleep_polling, waiters)
            nflight = int(config.get("GPURT_FLIGHT"))
            self.flight = FlightRecorder(self.rank, self.size, self.cid, nflight) \
                if nflight > 0 else None
            self.engine.on_poison = self._on_poison
            self.engine.on_stopped = self._publish_deferred
            cost, levels, forced, profile, check, fold = self._tuner_inputs()
            natives = self._natives()             # sets self.board on one-node communicators
            self._direct = self._direct_setup() if self.board is not None else None
            self._check = bool(check) and self.board is not None
            #: compare a call's buffers with those of the requests in flight (_clash):
            #: GPURT_CHECK=1, as the agreement (rank 0's, as every rank's)
            self._clash_on = bool(check)
            # several nodes (or no board): agree through the endpoints instead
            self._netcheck = bool(check) and self.board is None and self.size > 1
            # the agreement's room for data (bytes, a multiple of 8): the same on every rank
            # (the most bytes of one rank's contribution: GPURT_NET_FOLD is what a rank may
            # send to all the others, one message each)
            self._fold = fold[0] // (self.size - 1) // 8 * 8 \
                if self._netcheck and self.size <= _FOLD_RANKS else 0
            # two ranks: an allreduce folds up to GPURT_NET_FOLD_PAIR (the ring's bytes in
            # one round); the agreement's rows have room for the larger of the two
            self._fold_pair = fold[1] // 8 * 8 if self._netcheck and self.size == 2 else 0
            self._room = max(self._fold, self._fold_pair)
            try:
                self.tuner = Tuner(self.size, self.rank, tuple(range(self.size)), cost,
                                   natives, self.nnodes, forced, profile,
                                   shape=Shape.of(self.topo.local_ranks), levels=levels)
            except ValueError as e:   # (GPURT_ALGO is rank 0's: the same error everywhere)
                raise ValueError(f"rank {self.rank}: {e}") from None
            self._tuner_in = (cost, levels, forced, profile, check, fold)
            _learn_algorithm_names()
            devpath.setup(self)      # device backend, device endpoints (collective)
            self._qt = self._p2p_quick_table()
        except BaseException:
            self._release()
            raise
        # a communicator collected without close(): its shm peers read the close notice,
        # as after close() (they waited until their deadline; tcp peers see the sockets
        # reset at once)
        self._drop_fins = []
        for t in self._transports:
            seg, k = getattr(t, "seg", None), getattr(t, "local_rank", -1)
            if seg is not None and k >= 0 and callable(getattr(seg, "write_error", None)):
                f = weakref.finalize(self, _dropped_notice, seg, k)
                f.atexit = False        # (at exit close() runs, or the process ends)
                self._drop_fins.append(f)
        _LIVE.add(self)
        _install_excepthook()

    # -- set-up ----------------------------------------------------------------
    def _connect(self) -> None:
        from gpurt.transports import selected

        classes = selected()
        self.transport_of: dict[int, str] = {}
        chosen: dict[str, list[int]] = {name: [] for name, _ in classes}
        instances = {name: cls() for name, cls in classes}
        missing = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            for name, _ in classes:
                if instances[name].can_connect(self.topo, self.rank, peer):
                    chosen[name].append(peer)
                    self.transport_of[peer] = name
                    break
            else:
                missing.append(peer)
        # every rank calls every transport's connect: each is collective in its own scope
        self.endpoints: dict[int, Any] = {}
        errors: list[tuple[str, str]] = []
        for name, _ in classes:
            try:
                self.endpoints.update(instances[name].connect(chosen[name], self))
                self._transports.append(instances[name])
            except GpurtError as e:
                errors.append((type(e).__name__, str(e)))
        if missing:
            errors.append(("TransportError",
                           self._unreachable(missing, [n for n, _ in classes])))
        # one exchange, so every rank raises the same error (or none does)
        every = [e for errs in self.mpi.allgather(errors) for e in errs]
        if every:
            cls = ResourceError if any(t == "ResourceError" for t, _ in every) else TransportError
            msgs = list(dict.fromkeys(m for _, m in every))
            more = f" (and {len(msgs) - 3} more like these)" if len(msgs) > 3 else ""
            text = "; ".join(msgs[:3]) + more
            if not text.startswith(f"rank {self.rank}: "):     # (another rank's error)
                text = f"rank {self.rank}: communicator not made: {text}"
            raise cls(text)

    def _unreachable(self, missing: list[int], names: list[str]) -> str:
        from gpurt.transports import PLANNED

        peer = missing[0]
        why = [f"{n}: not on the same node" if n == "shm" else f"{n}: cannot connect" for n in names]
        why += [f"{n}: {r}" for n, r in PLANNED.items() if n in ("tcp", "verbs")]
        return (f"rank {self.rank} (node {self.node}) has no transport to rank {peer} "
                f"(node {self.topo.node_of[peer]})" +
                (f" and {len(missing) - 1} more" if len(missing) > 1 else "") +
                " [" + "; ".join(why) + "]")

    def _natives(self) -> list[Native]:
        """Collectives the transports run natively: the shm board, when every rank of the
        communicator is on this node."""
        board = getattr(self._shm(), "board", None)
        if board is None or self.nnodes != 1 or self.size < 2:
            return []
        self.board = board
        board.set_wait(self.engine.spin or 0.0)
        return [Native(coll, "shm_board", _board_cost(coll, self._board_copy_share),
                       (lambda c: lambda p, S: shm_board.written_bytes(c, p, S) <=
                        self._board_room(c))(coll),
                       "one shared-memory round, the flag in the data")
                for coll in shm_board.COLLS]

    def _board_room(self, coll: str) -> int:
        """The most bytes a rank may write into the board for one call of ``coll``:
        ``GPURT_SHM_BOARD``'s limit — or, where no compiled CMA shares run and the
        buffers are larger (the staging room), the whole buffer for every collective but
        the reductions to one or all (which stage or reduce p inputs on every rank).
        2 ranks, CMA forbidden, 512 KiB / 1 MiB / 2 MiB: alltoall 71 / 190 / 373 µs on the
        board against 126 / 256 / 398 by the schedule, reduce_scatter 75 / 189 / 406
        against 218 / 357 / 630, broadcast 52 / 95 / 228 against 142 / 223 / 351."""
        board = self.board
        return board.limit if coll in ("allreduce", "reduce") or self._cma_shares \
            else board.slot

    def _board_copy_share(self) -> float:
        """The share of a message's β that the board's copies cost in the tuner's model:
        a half where the compiled CMA shares replace the schedules above 64 KiB (they
        measured faster than the board there: a 2-rank allgather of 512 KiB 44 against
        78 µs), a quarter where they cannot run — cache-resident `memcpy`s against a
        schedule's steps of Python (2 ranks, CMA forbidden, 128 KiB: the board's
        alltoall 23 µs, the `direct` schedule's 140; its reduce_scatter 22 against
        121)."""
        return 0.5 if self._cma_shares else 0.25

    def _direct_setup(self) -> "shm_direct.Access | None":
        """``shm_direct`` on this one-node communicator: its thresholds (decided on rank
        0) and how this rank reaches the others' buffers — or None.  Collective."""
        shm = self._shm()
        conf = (config.get("GPURT_SHM_DIRECT"), config.get("GPURT_SHM_DIRECT_CMA"),
                config.get("GPURT_SHM_STAGE")) if self.rank == 0 else None
        got = self.mpi.allgather((conf, getattr(shm, "writev_why", "no shm"),
                                  self.board.fast is not None))
        dmap = shm_direct.thresholds(got[0][0][0], shm_direct.AUTO_MAP)
        dcma = shm_direct.thresholds(got[0][0][1], shm_direct.AUTO_CMA)
        ranks = list(self.topo.local_ranks[self.node])
        if shm is None or shm.seg is None or ranks != list(range(self.size)):
            return None
        can_map = any(dmap.values()) and not shm.map_why
        can_cma = any(dcma.values()) and not shm.cma_why and not any(w for _, w, _ in got)
        # the compiled shares can run on every rank (agreed: the tuner's board costs and
        # the staging rule depend on it, and every rank must choose alike)
        self._cma_shares = can_cma and all(f for _, _, f in got)
        # a staged allreduce (its input through the board) needs neither: it takes
        # GPURT_SHM_DIRECT_CMA's threshold, as the path it replaces.  GPURT_SHM_STAGE=auto
        # stages only where the compiled shares by CMA cannot run: they measured faster
        # (2 ranks 1 MiB 184 against 326 us, 3 ranks 514 against 766, 4 ranks 866 against
        # 1062; docs/performance.md)
        stage = dcma["allreduce"] if self.board.stage and not (
            got[0][0][2] == "auto" and self._cma_shares) else 0
        if not (can_map or can_cma or stage):
            return None
        seg = shm.seg
        pids = [seg.q[seg.pid_i(k)] for k in range(self.size)]
        maps = [shm.endpoints[k].maps if k != self.rank else None for k in ranks]
        self._direct_min = {c: (dmap[c] if can_map else 0, dcma[c] if can_cma else 0,
                                stage if c == "allreduce" else 0)
                            for c in shm_direct.COLLS}
        acc = shm_direct.Access(self.rank, pids, maps, can_map, can_cma, ranks, seg)
        if self.board.fast is not None:     # the compiled shares (_DirectPlan.cma)
            self.board.fast.set_direct(pids, acc.err_i)
        return acc

    def _direct_wanted(self, coll: str, n: int, isz: int, algo: str | None) -> int:
        """0: not shm_direct; 1: shm_direct if the buffers allow (else the tuner's plan);
        2: forced (``algo='shm_direct'``); 3: forced where it cannot run.  The same on
        every rank for matching calls."""
        if algo is None and self._tuner_in[2].get(coll) == shm_direct.NAME:
            algo = shm_direct.NAME      # GPURT_ALGO=coll:shm_direct
        if algo == shm_direct.NAME:
            if coll not in shm_direct.COLLS:
                raise ValueError(f"rank {self.rank}: {coll}: algo='shm_direct' is for "
                                 f"{', '.join(shm_direct.COLLS)}")
            # where it cannot run at all (one rank, several nodes, GPURT_SHM_DIRECT*=0),
            # like a call whose buffers are out of reach: the cheapest schedule
            return 2 if self._direct is not None else 3
        if self._direct is None or algo is not None or coll not in shm_direct.COLLS \
                or coll in self._tuner_in[2]:
            return 0
        S = shm_direct.collective_bytes(coll, self.size, n, isz)
        measured = self.tuner.profile_winner(coll, S)
        if measured is not None:        # GPURT_PROFILE decides where it measured
            return 2 if measured == shm_direct.NAME else 0
        mins = [m for m in self._direct_min[coll] if m]
        return 1 if mins and S >= min(mins) else 0

    def fold_choice(self, coll: str, nbytes: int) -> bool:
        """Would a call of ``coll`` with S = ``nbytes`` of float32 elements and no algo=
        be folded into the agreement's exchange (several nodes, checked)?  For ``gpurt
        tune`` and ``explain``."""
        if not self._room:
            return False
        n = int(nbytes) // 4 // (self.size if coll in _BLOCKED else 1)
        try:
            sched = self.tuner.plan(coll, n, 4, 0, None)[1]
        except ValueError:
            return False
        return self._folds(coll, n, 4, None, sched)

    def direct_choice(self, coll: str, nbytes: int) -> bool:
        """Would a call of ``coll`` with S = ``nbytes`` try ``shm_direct`` (taken when
        every rank's buffers are reachable)?  For ``gpurt tune`` and ``explain``."""
        if coll not in shm_direct.COLLS or self._direct is None:
            return False
        isz = 4
        n = nbytes // isz // (self.size if coll in ("allgather", "reduce_scatter",
                                                     "alltoall") else 1)
        # as a call decides it (_host_plan): where the tuner gives the call to the board,
        # the board keeps it, whatever the thresholds say
        return self._host_plan(coll, n, isz, 0, None)[0] in (1, 2)

    def _inlines(self, algo: str | None) -> bool:
        """May a blocking call naming ``algo`` try an inline path (``_inline``,
        ``_inline_to``): the board's (one node; algo None or shm_board) or the network's
        (several nodes, or no board; no algo=)?"""
        if self.board is not None:
            return algo is None or algo == "shm_board"
        return algo is None and self.size > 1

    def _shm(self):
        return next((t for t in self._transports if t.name == "shm"), None)

    def _tuner_inputs(self):
        """(cost, GPURT_ALGO, profile entries, GPURT_CHECK), decided on rank 0 and broadcast:
        environment variables, CPU counts or files that differ between ranks must not make
        ranks choose different algorithms (or checks) for the same call.  Errors are raised
        on every rank."""
        node_of = self.topo.node_of
        mine = {("node" if node_of[p] == self.node else "net", name)
                for p, name in self.transport_of.items()}
        used = set().union(*self.mpi.allgather(mine))
        inputs, err = None, ""
        if self.rank == 0:
            try:
                busiest = max(len(rs) for rs in self.topo.local_ranks)

                def level(names: set) -> Cost:
                    c = max((transport_cost(n) for n in names or {"self"}),
                            key=lambda c: (c.alpha, c.beta))
                    return oversubscribed(c, busiest, os.cpu_count() or 1)

                levels = {lv: level({n for lv_, n in used if lv_ == lv})
                          for lv in ("node", "net")}
                cost = level({n for _, n in used})      # flat schedules: the slowest link
                if not any(lv == "net" for lv, _ in used):
                    levels["net"] = cost
                elif busiest > 1:
                    # a flat schedule across nodes may have every rank of a node use the
                    # node's network link at the same time: cost it as shared
                    cost = Cost(cost.alpha, cost.beta * busiest, cost.gamma)
                profile = load_profile(str(config.get("GPURT_PROFILE")), self.size,
                                       self.nnodes)
                fold = int(config.get("GPURT_NET_FOLD"))          # (ranges: config)
                pair = int(config.get("GPURT_NET_FOLD_PAIR"))
                if any(name == "tcp" for _, name in used):
                    stripes, smin = tcp_settings()
                    if stripes > 1:   # (an agreement message must stay one tcp frame)
                        pair = min(pair, smin - 8 * _HDR_WORDS - 8)
                forced = dict(config.get("GPURT_ALGO"))      # (names: tuner.check_forced)
                inputs = (cost, levels, forced, profile,
                          bool(config.get("GPURT_CHECK")), (fold, pair))
            except Exception as e:  # noqa: BLE001 - told to every rank, never only here
                err = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        inputs, err = self.mpi.bcast((inputs, err), 0)
        if err:
            raise ValueError(f"rank {self.rank}: (decided on rank 0) {err}")
        return inputs

    def _publish_rejection(self, coll: str) -> None:
        """The call counts (so ranks stay in step) and its board header says 'rejected'."""
        self._seq += 1
        seq = self._seq
        meta = (shm_board.COLLS.index(coll), 0, 0, 0, 0)
        site = callsite.site()
        if self.board is not None:
            shm_board.mark_rejected(self.board, seq, meta[0], site)

            def start():
                return shm_board.BoardRun(self.board, coll, seq, shm_board.REJECTED, meta,
                                          _EMPTY_U8, _EMPTY_U8, 0, None, 0, publish_only=True,
                                          site=site)
        else:   # several nodes: take part in the agreement allgather with a REJECTED header
            def start():
                return self._agreement_run(seq, shm_board.REJECTED, meta, site)
        req = Request(self.engine, f"{coll} (rejected)", seq, start)
        try:   # queued in call order; published now if it can be, else by the next call
            self.engine.submit(req)
            self.engine.progress()
            if self.board is None:
                # across nodes the header goes out only once the calls before it are done
                # (one collective at a time), and the hierarchical agreement relays its
                # node's headers to other nodes' ranks: this rank takes part to the end,
                # as the others' call does (returning at once held them until their
                # deadline while this rank did something else, or made its exit a
                # PeerFailure).  (On the board, mark_rejected tells the peers at once.)
                req.wait()
        except GpurtError:
            pass     # the user's own error is the one to raise

    def _agreement_run(self, seq: int, sig: int, meta: tuple, site: int,
                       data: np.ndarray | None = None, call_bytes: int = 0):
        """Multi-node (no board): every rank's header (call number, signature, arguments,
        call site) to every rank by a small allgather over the endpoints, before the data
        moves.  On communicators with ``_fold`` room, a message carries ``data``'s bytes
        after the header (a folded call's contribution) and the receives take up to that
        room (``upto``): a message is as long as its own call needs, and a rejected or
        mismatched call's header still fits the others' receives.

        The message and the rows it gathers are the communicator's own, allocated once:
        collectives run one at a time, and a call's rows are read (agreed, folded) before
        the next call starts.  Only the agreed length of a row is read; past it a row
        holds what an earlier, longer message left.

        Where nodes hold several ranks and calls fold (``_hier_fold``), the exchange is
        hierarchical instead (``_HierFold``: inside the node, then one message of the
        node's rows to a rank of every other node); ``call_bytes``: the largest
        contribution a rank makes to this call (a folded call's, else 0), which sets its
        rows' stride there."""
        hdr = _cached(self._agree_hdrs, (sig, meta, site), 1024, _agree_header, sig, meta,
                      site)
        if self._hf is None and self._agree_bufs is None and self._room and \
                _hier_fold(self.topo):
            self._hf = _HierFold(self.topo, self.rank, _HDR_WORDS + self._room // 8)
        if self._hf is not None:
            return self._hf.run(self.endpoints, seq, hdr, data, call_bytes)
        mine, bufs, scheds, rows8 = (self._agree_bufs or self._agreement_buffers())[1:5]
        mine[:_ROW_WORD] = hdr
        mine[0] = seq
        mine[_ROW_WORD] = self.rank << 32 | len(mine)
        m = _HDR_WORDS
        if data is not None and data.nbytes:
            rows8[self.rank][:data.nbytes] = data.view(np.uint8)
            m += -(-data.nbytes // 8)
        covers = self._agree_bufs[6]
        if covers is not None:     # hierarchical: header-only rows, one schedule
            return RowsRun(scheds[_HDR_WORDS], bufs, self.endpoints, seq, _AGREE_SIG, covers)
        sched = _cached(scheds, m, 256, _agreement_schedule, self.size, self.rank, len(mine), m)
        return _Run(sched, bufs, False, None, self.endpoints, 0, seq, _AGREE_SIG, dtype=_U64)

    def _agreement_buffers(self) -> tuple:
        words = _HDR_WORDS + self._room // 8
        # every rank's message, one row each; this rank's own row is what it sends (where
        # the schedule copies a message in, a separate one)
        every = np.zeros(self.size * words, np.uint64)   # no stale bytes of this process go out
        r = self.rank
        covers = None
        if _hier_agreement(self.topo):     # (no room there: header-only rows)
            sched, covers = _agreement_schedule_hier(self.topo.local_ranks, r, words)
            direct = True                  # (it sends this rank's row from the output)
        else:
            sched = _agreement_schedule(self.size, r, words, _HDR_WORDS)
            direct = not any(isinstance(o, Copy) for st in sched.steps for o in st)
        mine = every[r * words:(r + 1) * words] if direct else np.zeros(words, np.uint64)
        bufs = {"in": mine, "out": every, "tmp": _EMPTY_U64 if not sched.tmp else
                np.empty(sched.tmp, np.uint64)}
        # the data part of every row (a folded call's contributions: only where the rows
        # are the messages themselves — folding needs at most _FOLD_RANKS ranks)
        rows = every.reshape(self.size, words)
        rows8 = rows[:, _HDR_WORDS:].view(np.uint8)
        # the compared words of every header (seq, sig, meta), one strided view
        # the exchange's schedules by the length this rank sends (header, + a folded call's
        # data), in words
        # (hierarchical: which ranks' rows each receive brings, for naming the missing)
        self._agree_bufs = (rows, mine, bufs, {_HDR_WORDS: sched}, rows8,
                            rows[:, :2 + _META_WORDS], covers)
        return self._agree_bufs

    def _fold_finish(self, coll: str, out: np.ndarray | None, dtype: np.dtype, red, n: int,
                     root: int) -> None:
        """A folded call's result into ``out`` (flat, ``dtype``), from every rank's
        contribution in the agreement's messages (agreed already): reductions in rank
        order 0, 1, ..., so every rank gets the same bits."""
        p, r = self.size, self.rank
        nb = n * dtype.itemsize
        hf = self._hf
        if hf is None:
            rows = self._agree_bufs[4]   # every rank's data, one row each (past the headers)
            at = None
        else:   # (rows in node-major order: rank k's is row at[k])
            rows, at = hf.cur[1], hf.perm
        if coll in ("allreduce", "reduce", "reduce_scatter"):
            if coll == "reduce" and r != root:
                return
            lo = r * nb if coll == "reduce_scatter" else 0
            # (p, n): rank k's block, a view into the communicator's own rows (every rank
            # reduces them in the same order: rank order, or node-major order where the
            # rows are in that order)
            blk = _cached(self._fold_views, (lo, nb, dtype, rows.shape), 256, _row_blocks,
                          rows, lo, nb, dtype)
            # (a host reducer's bare ufunc inside one np.errstate for the p - 1
            # reductions: ops.host_reducer)
            raw = getattr(red, "raw", None)
            with np.errstate(all="ignore") if raw is not None else contextlib.nullcontext():
                f = raw or red
                f(blk[0], blk[1], out)                # p >= 2 here (a folded call moves data)
                for k in range(2, p):
                    f(out, blk[k], out)
        elif coll == "broadcast":
            if r != root:
                np.copyto(out, rows[root if at is None else at[root], :nb].view(dtype))
        elif coll in ("allgather", "gather"):
            if coll == "allgather" or r == root:
                blk = rows[:, :nb] if at is None else rows[at, :nb]
                np.copyto(out.reshape(p, n), blk.view(dtype))
        elif coll == "alltoall":
            blk = rows[:, r * nb:(r + 1) * nb] if at is None else rows[at, r * nb:(r + 1) * nb]
            np.copyto(out.reshape(p, n), blk.view(dtype))
        elif coll == "scatter":
            k = root if at is None else at[root]
            np.copyto(out, rows[k, r * nb:(r + 1) * nb].view(dtype))
        # barrier: the exchange was the barrier

    def _agree(self, seq: int, sig: int, meta: tuple, site: int) -> None:
        """Compare the headers that the agreement exchange gathered (after its run):
        ``CollectiveMismatchError`` naming each rank whose call differs."""
        hf = self._hf
        nm = 2 + len(meta)
        if hf is not None:
            if hf.clean:          # (compared as the exchange ended: _HierFold.run)
                return
            rows = hf.cur[0]      # the exact headers of the exchange that followed
            at = hf.perm
        else:
            rows = self._agree_bufs[0]
            at = range(self.size)
            # call number, signature and the arguments themselves (two calls whose 32-bit
            # signatures collide differ there: a folded call computes straight from the
            # rows), every rank's against this rank's own (as it sent them)
            if _heads_equal(self._agree_bufs[5].tobytes(), self.rank, self.size):
                return                # the common case: no text to build
        bad = []
        mine = shm_board.describe(meta)
        algo = False            # name the algorithms where a call differs in nothing else
        for k in range(self.size):
            row = rows[at[k]]
            s, g = int(row[0]), int(row[1])
            theirs = tuple(int(v) for v in row[2:nm])
            where = callsite.at(row[nm:_ROW_WORD])
            if s != seq:
                bad.append(f"rank {k} is at call #{s}{where}")
            elif g == shm_board.REJECTED:
                c = theirs[0]
                what = shm_board.COLLS[c] if c < len(shm_board.COLLS) else "collective"
                bad.append(f"rank {k} rejected its own {what} call{where} as invalid input "
                           f"(its ValueError/TypeError says why)")
            elif g != sig & _M64 or theirs != tuple(meta):
                text = ""
                if shm_board.describe(theirs) == mine:
                    algo, text = True, shm_board.describe(theirs, True)
                bad.append(f"rank {k} called {text or shm_board.describe(theirs)}{where}")
        if bad:
            more = f" (and {len(bad) - 4} more ranks)" if len(bad) > 4 else ""
            raise CollectiveMismatchError(
                f"call #{seq}: rank {self.rank} called {shm_board.describe(meta, algo)}"
                f"{callsite.at(callsite.words(site))}, but " + "; ".join(bad[:4]) + more)

    def _on_poison(self, exc: BaseException) -> None:
        """The communicator just failed here (a mismatch, a dead peer, a timeout, abort(),
        an exception mid-transfer): dump the flight recorder, and tell every peer, so that
        ranks waiting for this one raise ``PeerFailure`` at once instead of at their
        deadline (once per communicator; best effort, bounded).  close() comes here too,
        with the text for a call in flight, if any (a plain close() is no failure: the
        peers see the connections go — tcp's end of stream, verbs' BYE, shm's close
        notice — and raise ``PeerFailure`` only if they still wait on this rank).  Both
        before the requests get their error: the caller of a Request has its arrays back
        only after the drain."""
        if self._closed:
            text = self._close_text
            if text is None:
                self.engine.told.set()
                return
        else:
            text = relay_text(exc)
        # told first, dumped after: a caller in another thread that saw the poison has its
        # buffers back only once the peers know (Engine.wait_told), and a dump can block
        if not self._defer(text):
            self._publish(text)
            self._direct_drain()
            self.engine.told.set()
        if not self._closed and self.flight is not None:
            self.flight.name_site(callsite.site())   # inline calls record no site
            self.flight.dump(exc)

    def _elsewhere(self) -> bool:
        """A call is being advanced in another thread of this process (``Engine.busy``)."""
        return self.engine.elsewhere() and os.getpid() == self._pid

    def _defer(self, text: str) -> bool:
        """(abort() or close() from a watchdog thread) If another thread is advancing a
        call, which may be storing into the peers' buffers, that thread publishes ``text``
        and drains once it has stopped (``_publish_deferred``; its shm_direct share stops
        at its next piece): True.  Else False: the caller tells the peers itself."""
        eng = self.engine
        if getattr(self, "_direct", None) is not None:
            self._direct.stopping = True    # (before busy is read: see Engine.enter)
        with eng.lock:
            if not self._elsewhere():
                return False
            self._deferred = text
        return True

    def _publish_deferred(self) -> None:
        """In the thread that advanced a call, once it stopped: the error that another
        thread's abort()/close() left to it, published, then the drain; ``_deferred`` is
        cleared only then (close() waits for that before it releases the transports)."""
        text, told = None, False
        try:
            with self.engine.lock:
                text, self._deferred = self._deferred, None
                if text is not None:
                    self._telling = threading.get_ident()
            if text is None:
                return
            self._publish(text)
            told = True
            self._direct_drain()
            self.engine.told.set()
        finally:
            if text is not None:
                if not told:            # (interrupted: a KeyboardInterrupt) close() tells
                    self._deferred = text
                self._telling = 0

    def _publish(self, text: str) -> None:
        """Every transport tells this rank's peers ``text`` (shm: the error record; tcp:
        an error frame): they raise ``PeerFailure`` instead of waiting for it."""
        for t in self._transports:
            publish = getattr(t, "publish_error", None)
            if publish is not None:
                try:
                    publish(text)
                except Exception:  # noqa: BLE001 - never mask the failure itself
                    pass

    def _direct_drain(self) -> None:
        """Peers of a shm_direct call in flight load from and store into this rank's
        buffers until their shares end: wait for that (bounded) before the caller gets
        the buffers back — after a failure (they stop at the error just published) or a
        close."""
        if self._direct is not None:
            try:
                self._direct.drain()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    def _check_peers(self, peers: list[int], at_deadline: bool = False) -> None:
        """The engine's liveness check: the peers waited on (``check``: gone, stopped,
        failed); at a collective's deadline also any other peer that published a failure
        — read where it already is (shm's error records, tcp's error frames and UDP
        notices), no peer asked — so a rank that waited in vain on a slow one names the
        third one whose failure held it up, not the slow one.  (Not before the deadline:
        the slow rank may still come and the call complete, if the failed rank had done
        its part — a peer's failure fails this rank's *next* call.)"""
        for p in peers:
            ep = self.endpoints.get(p)
            if ep is not None:
                ep.check()
        if at_deadline and peers:
            for p, ep in self.endpoints.items():
                published = getattr(ep, "published", None)
                if p not in peers and published is not None:
                    e = published()
                    # (not a peer's timeout, first-hand or relayed: it gave up waiting,
                    # most likely for the slow rank this one waits for too, which its
                    # own deadline names — the better blame)
                    if e is not None and not _TIMED_OUT.search(e.args[0]):
                        e.args = (f"{e.args[0]} (rank {self.rank} waited for rank(s) {peers} "
                                  f"until its deadline)",) + e.args[1:]
                        raise e

    # -- properties --------------------------------------------------------------
    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.nnodes} node(s)"
        return f"<gpurt.Communicator rank {self.rank}/{self.size}, {state}>"

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- buffers -------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        """A host array in node-shared memory (``gpurt.sharedmem``): the other ranks of
        the node read it, and write into it, directly — a large message from or into it
        costs one memcpy instead of ``process_vm_readv``/``writev`` (about three times
        slower).  Allocate the buffers you reuse with it; any array still works anywhere.
        Local to this rank (not collective); the array outlives the communicator."""
        with _ranked(self.rank, (ValueError, TypeError, ResourceError)):
            return sharedmem.empty(shape, dtype)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        """``empty``, zero-filled."""
        with _ranked(self.rank, (ValueError, TypeError, ResourceError)):
            return sharedmem.zeros(shape, dtype)

    # -- the funnel ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CommunicatorClosed(f"rank {self.rank}: communicator is closed")
        self.engine.raise_if_poisoned()

    def _root(self, root: int) -> int:
        r = _rank_number(root)
        if r is None or not 0 <= r < self.size:
            raise ValueError(f"rank {self.rank}: root {root!r} is not a rank of this "
                             f"communicator (size {self.size})")
        return r

    def _scratch_view(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(1 << max(12, (nbytes - 1).bit_length()), np.uint8)
        return self._scratch[:nbytes]

    def _folds(self, coll: str, n: int, isz: int, algo: str | None, sched) -> bool:
        """Several nodes, checked, a call whose data fits the agreement's messages and that
        names no algorithm: one exchange carries both (the tuner's algorithm would be a
        second round)."""
        lim = self._fold_limit(coll)
        if not (lim and sched is not None and sched.steps and algo is None and
                coll not in self._tuner_in[2] and _fold_bytes(coll, self.size, n, isz) <= lim):
            return False
        if not self.tuner.profile:
            return True
        # where a `gpurt tune` profile timed folding at this size, it folds if that was
        # fastest
        return self.tuner.profile_folds(
            coll, shm_direct.collective_bytes(coll, self.size, n, isz)) is not False

    def _fold_limit(self, coll: str) -> int:
        """The most bytes of a rank's contribution that ``coll`` folds: GPURT_NET_FOLD
        shared by the peers, or on two ranks GPURT_NET_FOLD_PAIR for an allreduce."""
        return max(self._fold, self._fold_pair) if coll == "allreduce" else self._fold

    def _host_plan(self, coll: str, n: int, isz: int, root: int, algo: str | None):
        """(direct, algorithm, schedule, algo) of a call on host buffers: ``direct`` as
        ``_direct_wanted`` (1: shm_direct where the buffers allow, 2: forced; 0: not), the
        tuner's algorithm and schedule (None: the shm board) — for shm_direct the schedule
        run where a buffer is out of reach — and the algo= that decided it.  The same on
        every rank for matching calls; the general and the inline paths both ask here."""
        direct = self._direct_wanted(coll, n, isz, algo)
        if direct:
            # where a buffer is out of reach: the cheapest schedule, the same whether this
            # rank forced shm_direct or the thresholds chose it (a forcing rank takes the
            # others along)
            fallback = self.tuner.pick(coll, self.size, shm_direct.collective_bytes(
                coll, self.size, n, isz), "node")
            if direct >= 2:
                algo = fallback
                direct = 2 if direct == 2 else 0
        if self.size == 1 and coll == "barrier":
            alg, sched = None, Schedule()
            if algo is not None:        # (nothing to run: the name is checked all the same)
                with _ranked(self.rank, ValueError):
                    self.tuner.choose(coll, 0, 1, algo)
        else:
            with _ranked(self.rank, ValueError):   # a bad algo=: nothing has happened yet
                alg, sched = self.tuner.plan(coll, n, isz, root, algo)
                if direct == 1 and sched is not None and sched.steps and \
                        alg.name != fallback:
                    alg, sched = self.tuner.plan(coll, n, isz, root, fallback)
        direct = direct if sched is not None and sched.steps else 0
        return direct, alg, sched, algo

    def _submit(self, coll: str, xb: Buf | None, ob: Buf | None, n: int, dtype: np.dtype,
                op: Op | None, root: int, result: Any, algo: str | None = None,
                finish_root_only: bool = False, stream: Any = None) -> Request:
        b = xb if xb is not None else ob
        if b is not None and b.kind != "host":
            return self._submit_device(coll, xb, ob, n, dtype, op, root, result, algo,
                                       finish_root_only, stream)
        if stream is not None:
            raise ValueError(f"rank {self.rank}: {coll}: stream= is for device buffers; "
                             f"these are host memory")
        if self._clash_on and self.engine.p2p:  # (sends and receives run beside collectives)
            for a, writes in _coll_held(coll, xb, ob, root, self.rank):
                if a is not None and a.nbytes:
                    self._clash_p2p(a, writes, coll)
        direct, alg, sched, algo = self._host_plan(coll, n, dtype.itemsize, root, algo)
        if self.size == 1 and algo is None and coll not in self.tuner.forced:
            eng = self.engine       # (a forced algorithm runs: that is what it is for)
            if not (eng.colls or eng.p2p or eng.busy or eng.owner):
                return self._alone(coll, xb, ob, n, dtype, op, root, result)
        # several nodes, checked, a call whose data fits the agreement's messages: one
        # exchange carries both (the tuner's algorithm would be a second round)
        fold = self._folds(coll, n, dtype.itemsize, algo, sched)
        # what the ranks agree on includes the algorithm: ranks given different algo= (or
        # one of them shm_direct) disagree before any byte moves, instead of waiting for
        # messages that never come, or reading a board slot that holds no data
        tag = "none" if alg is None else FOLD if fold else \
            f"{shm_direct.NAME}/{alg.name}" if direct else alg.name
        self._seq += 1                # from here on the call is part of the sequence
        seq = self._seq
        sig = _signature(coll, dtype.str, n, op, root, tag)
        site = callsite.site()
        alias = xb is not None and ob is not None and same(xb, ob)
        xa = xb.array if xb is not None else None
        oa = ob.array if ob is not None else None
        red = reducer(op) if op is not None else None
        empty = np.empty(0, dtype)

        meta = _board_meta(coll, dtype, n, op, root, tag)
        if sched is None:  # a native protocol: the shm board

            def start() -> shm_board.BoardRun:
                xa = xb.array.view(dtype) if xb is not None else empty
                oa = ob.array.view(dtype) if ob is not None else empty
                return shm_board.BoardRun(self.board, coll, seq, sig, meta, xa, oa, root,
                                          red, n, site=site)
        elif fold:
            xs = xb.array if xb is not None and _fold_sends(coll, self.rank, root) else None

            def start() -> _Run:   # agreement and data in one exchange (finish() agrees)
                return self._agreement_run(seq, sig, meta, site, xs,
                                           _fold_bytes(coll, self.size, n, dtype.itemsize))

        else:
            start = self._schedule_start(sched, xa, oa, dtype, alias, red, seq, sig)
            if self._check:      # (an empty schedule too: its peers may not be empty)
                # agree first: every rank compares every rank's call before any byte moves
                data_start = start
                empty8 = _EMPTY_U8

                def start() -> Chain:  # noqa: F811 - the checked variant
                    check = shm_board.BoardRun(self.board, coll, seq, sig, meta, empty8, empty8,
                                               root, None, n, check=True, site=site)
                    return Chain(check, data_start)
            elif self._netcheck:      # (an empty schedule too: its peers may not be empty)
                data_start = start

                def start() -> Chain:  # noqa: F811 - the checked variant, over the network
                    run = self._agreement_run(seq, sig, meta, site)

                    def then():
                        self._agree(seq, sig, meta, site)
                        return data_start()

                    return Chain(run, then)

        if direct:
            start = self._direct_start(coll, xb, ob, dtype, op, root, red, n, seq, sig, meta,
                                       site,
                                       self._schedule_start(sched, xa, oa, dtype, alias, red,
                                                            seq, sig), direct == 2)
        name = FOLD if fold else alg.name if alg else "none"
        fl = self.flight
        rec = fl.start(seq, coll, (dtype.str, n, op, root if coll in _ROOTED else None), name,
                       site) \
            if fl is not None else None
        if direct:
            getattr(start, "box", {})["rec"] = rec

        def finish() -> Any:
            if fold:        # every header gathered: compare them, then compute from the rows
                self._agree(seq, sig, meta, site)
                self._fold_finish(coll, ob.array.view(dtype) if ob is not None else None,
                                  dtype, red, n, root)
            if op is Op.AVG and ob is not None and (not finish_root_only or self.rank == root):
                host_finalize(op, ob.array, self.size)
            if rec is not None:
                FlightRecorder.done(rec)
            return result

        return self._enqueue(coll, seq, start, finish, name, (coll, xb, ob, root, self.rank))

    def _alone(self, coll: str, xb: Buf | None, ob: Buf | None, n: int, dtype: np.dtype,
               op: Op | None, root: int, result: Any) -> Request:
        """A collective of a one-rank communicator on host buffers: the result is the
        rank's own contribution (a copy where ``out`` is not ``x``; AVG over one rank is
        the value itself), done here, complete at once.  Through the engine it cost ~25 µs
        of Python a call, which a single-process run of a distributed program (one GPU, a
        debug run) paid at every step.  Only while nothing else is in flight (else the
        general path keeps the calls in order).  In the flight recorder as every call."""
        seq, rec = self._alone_begin(coll, dtype, n, op, root, LOCAL)
        if xb is not None and ob is not None and not same(xb, ob):
            memcopy.copyto(ob.array, xb.array)   # (the same dtype and count: checked)
        return self._alone_end(coll, seq, rec, result)

    def _alone_begin(self, coll: str, dtype: np.dtype, n: int, op: Op | None, root: int,
                     name: str) -> tuple[int, list | None]:
        """(call number, flight record) of a one-rank call that completes at once."""
        self._seq += 1
        seq = self._seq
        fl = self.flight
        rec = fl.start(seq, coll, (dtype.str, n, op, root if coll in _ROOTED else None),
                       name, callsite.site()) if fl is not None else None
        return seq, rec

    def _alone_end(self, coll: str, seq: int, rec: list | None, result: Any) -> Request:
        if rec is not None:
            FlightRecorder.done(rec)
        req = Completed(self.engine, coll, seq, result)
        req.p2p = False
        req.algorithm = self.last_algorithm = LOCAL
        return req

    def _alone_device(self, coll: str, xb: Buf | None, ob: Buf | None, n: int,
                      dtype: np.dtype, op: Op | None, root: int, result: Any,
                      st: int) -> Request:
        """``_alone`` on device buffers: a copy queued on the call's stream ``st`` where
        ``out`` is not ``x`` (so after the producer's work there, and ready there for
        the caller's next kernels, as every device call), nothing where it is (AVG over
        one rank is the value itself: no division queued).  No scratch is touched, so the
        next call needs no wait on this one's end event."""
        seq, rec = self._alone_begin(coll, dtype, n, op, root, LOCAL + "@device")
        if xb is not None and ob is not None and xb.nbytes and not same(xb, ob):
            be = self.dev
            be.copy(be.view(ob.ptr, ob.nbytes, ob.owner), be.view(xb.ptr, xb.nbytes, xb.owner),
                    st)
        return self._alone_end(coll, seq, rec, result)

    def _enqueue(self, coll: str, seq: int, start, finish, name: str,
                 bufs: tuple | None = None) -> Request:
        req = Request(self.engine, coll, seq, start, finish)
        req.algorithm = self.last_algorithm = name
        # (a host call's buffers, said as held ones only where a send or receive comes
        # meanwhile: _spans)
        req.coll_bufs = bufs
        box = getattr(start, "box", None)
        if box is not None:
            box["req"] = req
        return self.engine.submit(req)

    # -- device buffers -----------------------------------------------------------------
    def _dev_tuner(self) -> Tuner:
        """The tuner for device calls: the same inputs without the host-only natives (the
        shm board moves host memory)."""
        if self._devtuner is None:
            _c, _l, forced, profile, _check, _fold = self._tuner_in
            cost, levels = self._dev_costs
            # (GPURT_ALGO's host protocols are the host calls'; device calls keep the choice)
            forced = {c: a for c, a in forced.items() if a not in NATIVE_NAMES}
            self._devtuner = Tuner(self.size, self.rank, tuple(range(self.size)), cost, (),
                                   self.nnodes, forced, profile,
                                   shape=Shape.of(self.topo.local_ranks), levels=levels)
        return self._devtuner

    def _dev_view(self, b: Buf | None, dtype: np.dtype):
        be = self.dev
        if b is None or not b.nbytes:
            return be.typed(self._dev_scratch(0, None), dtype)
        return be.typed(be.view(b.ptr, b.nbytes, b.owner), dtype)

    def _dev_scratch(self, nbytes: int, stream):
        """The communicator's device scratch, grown to ``nbytes``, allocated for use on
        ``stream``.  An outgrown one is kept until an event recorded on ``stream`` —
        which already waits for the previous call's end — has fired: kernels of earlier
        calls may still read it."""
        be = self.dev
        if self._devretired:
            self._devretired = [(v, ev) for v, ev in self._devretired if not be.query(ev)]
        if self._devtmp is None or self._devtmp.nbytes < nbytes:
            if self._devtmp is not None and stream is not None:
                ev = be.event(False)
                be.record(ev, stream)
                self._devretired.append((self._devtmp, ev))
            self._devtmp = be.alloc(1 << max(12, (max(nbytes, 1) - 1).bit_length()), stream)
        return self._devtmp[:nbytes]

    def _dev_order_event(self):
        """The event that orders a call's stream after its buffers' own streams."""
        ev = self._devorder
        if ev is None:
            ev = self._devorder = self.dev.event(False)
        return ev

    def _submit_device(self, coll: str, xb: Buf | None, ob: Buf | None, n: int,
                       dtype: np.dtype, op: Op | None, root: int, result: Any,
                       algo: str | None, finish_root_only: bool, stream: Any) -> Request:
        """A collective on device buffers: a schedule of the device tuner run by the
        executor on device views, through the device endpoints (``cuda_ipc`` inside a
        node, pinned staging elsewhere), everything ordered on one stream: ``stream=``,
        else the buffer's ``__cuda_array_interface__`` stream, else the current one."""
        be = self.dev
        b = xb if xb is not None else ob
        with _ranked(self.rank):
            st = devpath.stream_of(be, stream, b)
        # after the work queued on the buffers' own streams, where they name others than
        # the call's (before: a fill of out queued on its stream could land after the
        # result); the result is made ready on out's stream too (finish)
        others = devpath.other_streams(st, xb, ob)
        if others:
            devpath.order_after(be, st, others, self._dev_order_event())
        out_streams = devpath.other_streams(st, ob)
        with _ranked(self.rank, ValueError):
            if algo in NATIVE_NAMES:
                raise ValueError(f"{coll}: algorithm {algo!r} is a protocol of host memory "
                                 f"(the shm transport's): not one for device buffers")
            alg, sched = self._dev_tuner().plan(coll, n, dtype.itemsize, root, algo)
        if self.size == 1 and algo is None and coll not in self._dev_tuner().forced:
            eng = self.engine       # (a forced algorithm runs: that is what it is for)
            if not (eng.colls or eng.p2p or eng.busy or eng.owner):
                req = self._alone_device(coll, xb, ob, n, dtype, op, root, result, st)
                if out_streams:
                    devpath.ready_on(be, st, out_streams, self._dev_order_event())
                return req
        self._seq += 1
        seq = self._seq
        sig = _signature(coll, dtype.str + "@device", n, op, root, alg.name)
        site = callsite.site()
        alias = xb is not None and ob is not None and same(xb, ob)
        meta = shm_board.meta_of(coll, dtype, n, op, root, device=True, alg=alg.name)
        ctx = devpath.DevCtx(be, st, dtype, op)

        def data_start() -> _Run | None:
            if self._devlast is not None:       # the scratch may still be read by the
                be.wait_event(st, self._devlast)  # previous call's stream
            if not sched.steps:
                return None
            bufs = {"in": self._dev_view(xb, dtype), "out": self._dev_view(ob, dtype)}
            if alias:
                bufs["in"] = bufs["out"]
            bufs["tmp"] = be.typed(self._dev_scratch(sched.tmp * dtype.itemsize, st), dtype)
            return _Run(sched, bufs, alias, None, self.dev_endpoints, 0, seq, sig, dev=ctx,
                        dtype=dtype)

        def board_checked() -> Chain:
            check = shm_board.BoardRun(self.board, coll, seq, sig, meta, _EMPTY_U8, _EMPTY_U8,
                                       root, None, n, check=True, site=site)
            return Chain(check, data_start)

        def net_checked() -> Chain:
            run = self._agreement_run(seq, sig, meta, site)

            def then():
                self._agree(seq, sig, meta, site)
                return data_start()

            return Chain(run, then)

        start = data_start
        if self._check:
            start = board_checked
        elif self._netcheck:
            start = net_checked

        name = alg.name
        fl = self.flight
        rec = fl.start(seq, coll, (dtype.str, n, op, root if coll in _ROOTED else None),
                       name + "@device", site) if fl is not None else None

        def finish() -> Any:
            if op is Op.AVG and ob is not None and (not finish_root_only or self.rank == root):
                be.scale(self._dev_view(ob, dtype), self.size, st, dtype=dtype)
            if self._devlast is None:
                self._devlast = be.event(False)
            devpath.ready_on(be, st, out_streams, self._devlast)
            if rec is not None:
                FlightRecorder.done(rec)
            return result

        return self._enqueue(coll, seq, start, finish, name)

    def _direct_start(self, coll, xb, ob, dtype, op, root, red, n, seq, sig, meta, site,
                      data_start, forced: bool):
        """The start of a call that may run by ``shm_direct`` (``data_start``: the tuner's
        schedule, run where a buffer is out of reach)."""
        empty = np.empty(0, dtype)
        mins = self._direct_mins(coll, forced)
        box: dict = {}        # the request and its flight record, once they exist

        def chosen(name: str) -> None:       # they and last_algorithm say which ran
            if name and "req" in box:
                box["req"].algorithm = self.last_algorithm = name
                if box.get("rec") is not None:
                    box["rec"][flight.ALGO] = name

        def start() -> shm_direct.DirectRun:
            x = xb.array.view(dtype) if xb is not None else empty
            o = ob.array.view(dtype) if ob is not None else empty
            return shm_direct.DirectRun(self.board, self._direct, coll, seq, sig, meta, x, o,
                                        root, red, n, site, data_start, mins, chosen, forced)

        start.box = box       # _enqueue puts the request here
        return start

    def _direct_mins(self, coll: str, forced: bool) -> tuple[int, int, int]:
        """The least S for a call whose buffers are shared arrays / reached by CMA /
        staged through the board."""
        mins = tuple(m or 1 << 62 for m in self._direct_min[coll])
        # forced: every way from 1 byte, staging too where a staging room is in use
        return (1, 1, 1 if mins[2] < 1 << 62 else mins[2]) if forced else mins

    def _schedule_start(self, sched, x: np.ndarray | None, o: np.ndarray | None, dtype,
                        alias, red, seq, sig):
        """The start of ``sched`` on flat host arrays ``x`` (input) and ``o`` (output)."""
        empty = np.empty(0, dtype)

        def start() -> _Run | None:
            if not sched.steps:
                return None
            bufs = {"in": x.view(dtype) if x is not None else empty,
                    "out": o.view(dtype) if o is not None else empty}
            if alias:
                bufs["in"] = bufs["out"]
            bufs["tmp"] = self._scratch_view(sched.tmp * dtype.itemsize).view(dtype) \
                if sched.tmp else empty
            return _Run(sched, bufs, alias, red, self.endpoints, 0, seq, sig)

        return start

    def _timeout_arg(self, timeout, coll: str | None = None) -> float | None:
        """``timeout=`` checked before anything else; a bad one rejects the call (and, for
        a collective, announces the rejection to the peers like any bad argument)."""
        if timeout is None:
            return None
        try:
            return check_timeout(timeout)
        except ValueError as e:
            if coll is not None and (self.board is not None or self._netcheck) \
                    and not self._closed and self.engine.poisoned is None:
                self._publish_rejection(coll)
            raise ValueError(f"rank {self.rank}: {e}") from None

    def _blocking(self, req: Request, timeout: float | None) -> Any:
        try:
            return req.wait(timeout)
        except CollectiveTimeout as e:
            self.engine.poison(e)
            raise

    # -- argument preparation ---------------------------------------------------------
    def _host(self, b: Buf, what: str) -> Buf:
        """Host buffers pass; a device buffer needs this rank's device backend and must
        live on the device this rank uses."""
        if b.kind != "host":
            if self.dev is None:
                raise TypeError(f"{what} is a {b.kind} device buffer "
                                f"({type(b.owner).__name__}) but this rank has no device "
                                f"backend: {self.dev_why} (see `gpurt info`)")
            try:
                d = self.dev.device_of(b.ptr) if b.nbytes else self.dev.current()
            except Exception as e:  # noqa: BLE001 - a pointer the backend does not know
                raise TypeError(f"{what}: {e}") from None
            if d != self.dev.current():
                raise ValueError(f"{what} is on device {d} but this rank uses device "
                                 f"{self.dev.current()} (GPURT_DEVICE, else local rank "
                                 f"modulo the visible devices)")
            if b.nbytes:
                # (an array interface that claims more than its allocation holds would
                # have the peers read past it: a crash on their side, not this one's)
                try:
                    base, size = self.dev.address_range(b.ptr)
                except Exception:  # noqa: BLE001 - unknown extent: the transports ask again
                    base = None
                if base is not None and b.ptr + b.nbytes > base + size:
                    raise ValueError(
                        f"{what}: {b.nbytes} bytes at {b.ptr:#x} run past the end of its "
                        f"device allocation ({size} bytes at {base:#x}, so at most "
                        f"{base + size - b.ptr} from there): its __cuda_array_interface__ "
                        f"shape or pointer is wrong")
            b.device = d
        return b

    def _in(self, x: Any, what: str = "x") -> Buf:
        with _ranked(self.rank):
            return self._host(as_buf(x, what), what)

    def _out(self, out: Any, x: Buf, count: int, what: str = "out", dtype_from: Buf | None = None
             ) -> Buf:
        with _ranked(self.rank):
            ob = self._host(as_buf(out, what), what)
            check_writable(ob, what)
        self._same_kind(x, ob, what)
        if ob.dtype != x.dtype:
            raise TypeError(f"rank {self.rank}: {what} has dtype {ob.dtype}, x has {x.dtype}")
        if ob.count != count:
            raise ValueError(f"rank {self.rank}: {what} has {ob.count} elements, "
                             f"{count} expected")
        return ob

    def _new_out(self, xb: Buf, count: int, shape: tuple[int, ...], stream: Any) -> tuple:
        """A result for ``out=None`` like ``xb``: for device memory taken for the stream the
        call will run on (``stream=``, else ``xb``'s, else the current one), which is also
        the stream the result is ready on."""
        st = None
        if xb.kind != "host":
            with _ranked(self.rank):
                st = devpath.stream_of(self.dev, stream, xb)
        return empty_like(xb, count, shape, st)

    def _same_kind(self, x: Buf, ob: Buf, what: str = "out") -> None:
        if ob.kind != x.kind:
            raise TypeError(f"rank {self.rank}: {what} is {ob.kind} memory and x is {x.kind} "
                            f"memory; pass both on the host or both on the device")

    def _op(self, op: Any, dtype: np.dtype) -> Op:
        with _ranked(self.rank):
            o = as_op(op)
            check_op(o, dtype)
        return o

    def _distinct(self, xb: Buf, ob: Buf, coll: str) -> None:
        if overlaps(xb, ob):
            raise ValueError(f"rank {self.rank}: {coll}: out overlaps x; {coll} is not in "
                             f"place — pass a separate out (or out=None to allocate one)")

    @staticmethod
    def _blocked_shape(b: Buf, size: int) -> tuple[int, ...]:
        """Shape of one of ``size`` blocks of ``b``: drop a leading axis of length size
        (2-D and up), else a flat block."""
        if len(b.shape) >= 2 and b.shape[0] == size:
            return tuple(b.shape[1:])
        return (b.count // size,)

    # -- collectives (i-variants first; the blocking ones wait on them) -----------------
    @_announces_rejection("allreduce")
    def iallreduce(self, x: Any, out: Any = None, op: Any = Op.SUM, *, algo: str | None = None, stream: Any = None
                   ) -> Request:
        """Element-wise reduction of ``x`` over all ranks, result on every rank.
        ``out=None``: in place into ``x``."""
        self._check_open()
        xb = self._in(x)
        o = self._op(op, xb.dtype)
        if out is None:
            ob, result = self._in_place(xb, x), x
        else:
            ob = self._out(out, xb, xb.count)
            if overlaps(xb, ob) and not same(xb, ob):
                raise ValueError(f"rank {self.rank}: allreduce: out partly overlaps x "
                                 f"(use out=None or out=x for in place)")
            result = out
        return self._submit("allreduce", xb, ob, xb.count, xb.dtype, o, 0, result, algo, stream=stream)

    def allreduce(self, x: Any, out: Any = None, op: Any = Op.SUM, *,
                  timeout: float | None = None, algo: str | None = None, stream: Any = None) -> Any:
        if self._quick and type(x) is np.ndarray and (out is None or type(out) is np.ndarray) \
                and timeout is None and algo is None and stream is None:
            # the small allreduces a loop repeats (a loss, a norm): the plans of the last
            # few such calls on the board, whose checks _inline made, taken at once
            # (identity tests, no hashing)
            dt, n = x.dtype, x.size
            for q in self._quick:
                if op is q[0] and dt is q[1] and n == q[2]:
                    eng = self.engine
                    if not (self._closed or eng.colls or eng.p2p or eng.poisoned is not None
                            or eng.busy or eng.owner):
                        res = x if out is None else out
                        if (_PLAIN(x, res, q[4]) if _PLAIN is not None else
                                self._inline_res(x, out) is not None):
                            return self._board_go("allreduce", q[3], x, res, 0, n, None)
                    break
        timeout = self._timeout_arg(timeout, "allreduce")
        if stream is None and self._inlines(algo) and type(x) is np.ndarray and \
                (out is None or type(out) is np.ndarray):
            done = self._inline("allreduce", x, out, op, 0, timeout, algo)
            if done is not None:
                return done
        return self._blocking(self.iallreduce(x, out, op, algo=algo, stream=stream), timeout)

    def _inline(self, coll: str, x: np.ndarray, out: np.ndarray | None, op: Any,
                root: int, timeout: float | None, algo: str | None) -> np.ndarray | None:
        """The blocking fast path of allreduce, broadcast and barrier (a result of x's
        shape: in place, or into a separate ``out``) on NumPy arrays, run inline while
        nothing else is queued: on the board (``_board_go``; shm_direct for large calls)
        or across nodes (``_net_go``: the general path's agreement or folded call and
        schedule), without a ``Request``.  Returns None whenever the general path must
        decide (which also raises the errors)."""
        eng = self.engine
        if self._closed or eng.colls or eng.p2p or eng.poisoned is not None:
            return None   # keep call order; let pending send/recv progress in the queue
        if eng.busy or eng.owner:
            eng.check_thread()      # (another thread in a call: an error, before this counts)
        if op is not None and type(op) is not Op and type(op) is not str:
            return None
        n = x.size
        plan = self._inline_plan(coll, x.dtype, n, op, root, algo)
        if not plan:
            return None
        res = self._inline_res(x, out)
        if res is None:
            return None
        if self.board is None:
            return self._net_go(coll, plan, x, res, root, n, timeout)
        if coll == "allreduce" and type(op) is Op and algo is None and \
                type(plan) is tuple:     # (allreduce's quick path takes it next time)
            self._quick = ((op, x.dtype, n, plan, n * x.itemsize),) + self._quick[:_QUICK - 1]
        return self._board_go(coll, plan, x, res, root, n, timeout)

    def _inline_plan(self, coll: str, dtype: np.dtype, n: int, op: Any, root: int,
                     algo: str | None):
        """An inline call's plan, cached per call shape: the board's (``_fastplan``) on
        one node, the network's (``_netplan``; no algo=) across nodes; falsy where the
        general path must run."""
        if self.board is not None:
            return self._fastplan_of(coll, dtype, n, op, root, algo)
        if algo is None:
            return _cached(self._netplans, (coll, dtype, n, op, root), _PLANS_MAX,
                           self._netplan, coll, dtype, n, op, root)
        return False

    def _net_go(self, coll: str, plan: tuple, x: np.ndarray, res: np.ndarray | None,
                root: int, n: int, timeout: float | None) -> np.ndarray | None:
        """Run one inline call across nodes whose arguments were checked (``res``: where
        the result goes; None for a gather off the root, which writes nothing)."""
        eng = self.engine
        dtype = x.dtype
        o, sig, meta, red, fargs, sched, fold, name = plan
        self.last_algorithm = name
        self._seq += 1
        seq = self._seq
        site = callsite.site()
        fl = self.flight
        rec = fl.start(seq, coll, fargs, name, site) if fl is not None else None
        xf = x.reshape(-1)
        rf = res.reshape(-1) if res is not None else None
        # one deadline for the whole call, as a Request's wait has (its timeout is what a
        # CollectiveTimeout says, not what was left of it for the data run)
        said = eng._timeout() if timeout is None else timeout
        end = time.monotonic() + said
        try:
            if fold or self._netcheck:
                data = xf if fold and _fold_sends(coll, self.rank, root) else None
                cb = _fold_bytes(coll, self.size, n, dtype.itemsize) if fold else 0
                eng.run_inline(self._agreement_run(seq, sig, meta, site, data, cb), coll,
                               seq, timeout)
                self._agree(seq, sig, meta, site)
            if fold:
                self._fold_finish(coll, rf, dtype, red, n, root)
            else:
                alias = res is x
                bufs = {"in": rf if alias else xf,
                        "out": rf if rf is not None else np.empty(0, dtype),
                        "tmp": self._scratch_view(sched.tmp * dtype.itemsize).view(dtype)}
                eng.run_inline(_Run(sched, bufs, alias, red, self.endpoints, 0, seq, sig),
                               coll, seq, max(0.0, end - time.monotonic()), said)
        except BaseException as e:
            eng._annotate(e, f"in {coll} (call #{seq}): ")
            eng.poison(e)
            self._closed_raise(e, coll, seq)
            raise
        return self._inline_end(coll, o, res, root, rec)

    def _netplan(self, coll: str, dtype: np.dtype, n: int, op: Any, root: int):
        """For the inline path across nodes (``_inline``, ``_inline_to``): (op, signature, header meta, reducer, flight-recorder args,
        schedule, folded?, algorithm name), decided exactly as ``_submit`` decides; False
        where the general path must run (unsupported dtype or op, shm_direct asked for, no
        messages at all)."""
        if not supported(dtype) or (op is not None and (op, dtype) not in _FAST_OPS) \
                or (op is None and coll in _REDUCING):
            return False      # (op=None on a reduction: the general path raises)
        isz = dtype.itemsize
        try:
            if self._direct_wanted(coll, n, isz, None):
                return False
            alg, sched = self.tuner.plan(coll, n, isz, root, None)
        except ValueError:
            return False
        if sched is None or not sched.steps:
            return False
        o = _FAST_OPS[(op, dtype)] if op is not None else None
        fold = self._folds(coll, n, isz, None, sched)
        tag = FOLD if fold else alg.name
        return (o, _signature(coll, dtype.str, n, o, root, tag),
                _board_meta(coll, dtype, n, o, root, tag), reducer(o) if o is not None else None,
                (dtype.str, n, o, root if coll in _ROOTED else None), sched, fold, tag)

    @staticmethod
    def _inline_res(x: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
        """Where an inline call of x's shape writes its result (``out``, or ``x`` in
        place), or None when the arrays are not the plain case (not C-contiguous,
        read-only, another dtype or size, overlapping): the general path then decides,
        and raises."""
        if out is not None and out is not x:
            of = out.flags
            if not (x.flags.c_contiguous and of.c_contiguous and of.writeable) or \
                    out.dtype != x.dtype or out.size != x.size or np.may_share_memory(x, out):
                return None
            return out
        flags = x.flags
        return x if flags.c_contiguous and flags.writeable else None

    def _inline_to(self, coll: str, x: np.ndarray, out: Any, op: Any, root: int,
                   timeout: float | None, algo: str | None) -> Any:
        """The inline path of the collectives whose result is not x's shape (reduce,
        allgather, gather, reduce_scatter, alltoall, scatter) — on the board (one node) or across
        nodes (``_net_go``; no algo=): only C-contiguous NumPy arrays and the plain cases;
        ``_NO`` sends the call down the general path, which also raises every error (so
        the rules are written once, in the i-variants)."""
        eng = self.engine
        if self._closed or eng.colls or eng.p2p or eng.poisoned is not None or \
                (out is not None and type(out) is not np.ndarray):
            return _NO
        if coll == "scatter":
            return self._inline_scatter(x, out, root, timeout, algo)
        if not x.flags.c_contiguous:
            return _NO
        if op is not None and type(op) is not Op and type(op) is not str:
            return _NO
        p, dtype, xs = self.size, x.dtype, x.size
        n = xs
        if coll in ("reduce_scatter", "alltoall"):
            if xs % p:
                return _NO
            n = xs // p
        board = self.board is not None
        fp = self._inline_plan(coll, dtype, n, op, root, algo)
        if not fp:
            return _NO
        mine = self.rank == root
        if (coll == "reduce" or coll == "gather") and not mine:
            if coll == "reduce" and out is not None and not (
                    out.flags.c_contiguous and supported(out.dtype)):
                return _NO        # ireduce checks out= on every rank (and raises)
            res, ret = x, (None if coll == "gather" else (x if out is None else out))
            if coll == "gather" and not board:
                res = None            # (the board reads x's shape from it; a schedule no)
        elif coll == "reduce" and (out is None or out is x):
            if not x.flags.writeable:
                return _NO
            res = ret = x
        else:
            want = {"reduce": n, "reduce_scatter": n, "alltoall": xs}.get(coll, p * n)
            if out is None:
                if coll == "reduce_scatter":
                    shape = x.shape[1:] if x.ndim >= 2 and x.shape[0] == p else (n,)
                elif coll == "alltoall":
                    shape = x.shape
                else:
                    shape = (p,) + x.shape
                out = np.empty(shape, dtype)
            else:
                of = out.flags
                if not (of.c_contiguous and of.writeable) or out.dtype != dtype or \
                        out.size != want or np.may_share_memory(x, out):
                    return _NO
            res = ret = out
        if board:
            self._board_go(coll, fp, x, res, root, n, timeout)
        else:
            self._net_go(coll, fp, x, res, root, n, timeout)
        return ret

    def _inline_scatter(self, x: np.ndarray | None, out: np.ndarray | None, root: int,
                        timeout: float | None, algo: str | None) -> Any:
        """``_inline_to`` for scatter, whose ``x`` is read on the root only: elsewhere it
        may be None (with ``out``) or give the shape of ``out`` to allocate, as in
        ``iscatter``; anything unusual goes down the general path (``_NO``)."""
        p, mine = self.size, self.rank == root
        if x is not None and (type(x) is not np.ndarray or not x.flags.c_contiguous):
            return _NO
        if out is None:
            if x is None or x.size % p:
                return _NO
            n, dtype = x.size // p, x.dtype
            out = np.empty(x.shape[1:] if x.ndim >= 2 and x.shape[0] == p else (n,), dtype)
        else:
            of = out.flags
            n, dtype = out.size, out.dtype
            if not (of.c_contiguous and of.writeable) or (x is not None and (
                    x.dtype != dtype or (mine and x.size != p * n) or
                    np.may_share_memory(x, out))):
                return _NO
        if mine and x is None:
            return _NO
        fp = self._inline_plan("scatter", dtype, n, None, root, algo)
        if not fp:
            return _NO
        xin = x if mine else np.empty(0, dtype)      # (read on the root only)
        if self.board is not None:
            self._board_go("scatter", fp, xin, out, root, n, timeout)
        else:
            self._net_go("scatter", fp, xin, out, root, n, timeout)
        return out

    def _board_go(self, coll: str, fp: tuple, x: np.ndarray, res: np.ndarray, root: int,
                  n: int, timeout: float | None) -> np.ndarray:
        """Run one inline board call whose arguments were checked: the compiled round
        where built, the Python BoardRun for whatever it hands back."""
        if type(fp) is _DirectPlan:
            return self._direct_go(coll, fp, x, res, root, n, timeout)
        o, sig, meta, red, fargs, cplan = fp
        self.last_algorithm = "shm_board"
        self._seq += 1
        seq = self._seq
        fl = self.flight
        if fl is not None:
            # the call site is found only if the call fails (it costs ~2 µs per call)
            rec = [seq, coll, fargs, "shm_board", time.time(), 0.0, "running", 0]
            fl.events.append(rec)
        bd = self.board
        b = seq & 1
        got = 2
        try:
            if cplan is not None:
                # the compiled round: publish, wait briefly, check, read; 0 = done,
                # 1 = published (Python finishes), 2 = nothing done yet (Python does it all)
                lu = bd.last_use
                got = bd.fast.run(cplan, seq, lu[b], x, res)
                if got != 2:
                    lu[b] = seq
            if got:
                run = shm_board.BoardRun(bd, coll, seq, sig, meta, x.reshape(-1),
                                         res.reshape(-1), root, red, n)
                if got == 1:
                    run.phase = 1
                self.engine.run_inline(run, coll, seq, timeout)
        except BaseException as e:
            # a signal's exception can surface right after the compiled round returned,
            # with the call half done on the board: the communicator is unusable, as after
            # any failure inside a call
            self.engine.poison(e)
            self._closed_raise(e, coll, seq)
            raise
        return self._inline_end(coll, o, res, root, rec if fl is not None else None)

    def _inline_end(self, coll: str, o: Op | None, res, root: int, rec: list | None):
        """An inline call's last steps, as the general path's ``finish``: AVG's division
        (a reduce's on the root only) and the flight record; returns ``res``."""
        if o is Op.AVG and res is not None and (coll != "reduce" or self.rank == root):
            host_finalize(o, res, self.size)
        if rec is not None:
            FlightRecorder.done(rec)
        return res

    def _direct_go(self, coll: str, dp: "_DirectPlan", x: np.ndarray, res: np.ndarray,
                   root: int, n: int, timeout: float | None) -> np.ndarray:
        """Run one inline shm_direct call whose arguments were checked: a staged allreduce
        by the compiled round (``_fastboard.staged``) where it applies, else — or for the
        rest of a call it handed back — the general path's ``DirectRun`` (header round,
        shares, or the schedule where a buffer is out of reach), driven right here without
        a ``Request``."""
        eng = self.engine
        o, dtype = dp.op, dp.dtype
        self.last_algorithm = dp.fallback
        self._seq += 1
        seq = self._seq
        # the call site: in the flight record, and in the header (a peer's mismatch error
        # names it)
        site = callsite.site()
        fl = self.flight
        rec = fl.start(seq, coll, dp.fargs, dp.fallback, site) if fl is not None else None
        got = 2
        busy = eng.enter()   # (another thread's abort()/close() leaves the telling to us)
        try:     # (the call counts from here: any failure leaves the ranks out of step,
            # a signal's exception too, right after the compiled round returned)
            if eng.poisoned is not None:    # (read after enter(): see there)
                raise eng._interrupted(coll, seq) from eng.poisoned
            if dp.staged is not None or dp.cma is not None:
                # the compiled rounds, on ordinary arrays only (the header names a shared
                # one's file): the staged allreduce (a peer that did not stage sends every
                # rank to the shares), or the shares by CMA (a peer's shared array sends
                # every rank to DirectRun, which maps it).  (x and res as they are: C-
                # contiguous, of the plan's dtype — the flat views cost ~3 us to make)
                wx, wo = shm_direct.where(x), shm_direct.where(res)
                if not wx[0] and not wo[0]:
                    bd = self.board
                    b = seq & 1
                    if site not in bd.published:
                        bd.publish_site(site)
                    sid = shm_board._site_word(site)
                    if dp.staged is not None:
                        got = bd.fast.staged(dp.staged, seq, bd.last_use[b], x, res, sid,
                                             4 * seq + 2 + dp.forced, *wx, *wo)
                    else:
                        # peers enter this rank's buffers once the round stored READY: a
                        # failure from there on (a signal's exception as it returns) must
                        # drain, until resume() makes the DirectRun the active call
                        acc = self._direct
                        acc.active = shm_direct.Pending(bd, seq)
                        got = bd.fast.direct(dp.cma, seq, bd.last_use[b], x, res, sid,
                                             4 * seq + dp.forced, *wx, *wo,
                                             memcopy.threshold())
                        if got < shm_direct.D_READY or got == shm_direct.D_CLOSED:
                            acc.active = None           # done, or READY not stored
                        if got == shm_direct.D_CLOSED:
                            raise shm_direct.Stopped("closed before READY")
                    if got != 2:
                        bd.last_use[b] = seq
            if got == 0:
                name = shm_direct.STAGED if dp.staged is not None else shm_direct.NAME
                self.last_algorithm = name
                if rec is not None:
                    rec[flight.ALGO] = name
            else:
                self._direct_rest(coll, dp, x.reshape(-1).view(dtype),
                                  res.reshape(-1).view(dtype), res is x, root, n, seq, site,
                                  got, rec, timeout)
        except BaseException as e:
            eng.poison(e)           # (run_inline has annotated and poisoned what it ran)
            # closed by another thread meanwhile (stopped before READY, interrupted, the
            # board's "closed", ...): told, drained, raised
            self._closed_raise(e, coll, seq, drain=True)
            self._publish_deferred()        # (another thread's abort(): now it stopped)
            # peers may be in this rank's buffers: the caller has them back only after the
            # drain (a no-op if _on_poison drained here already)
            self._direct_drain()
            raise
        finally:
            eng.leave(busy)       # (the call ended as an abort came: _publish_deferred)
        return self._inline_end(coll, o, res, root, rec)

    def _closed_raise(self, e: BaseException, coll: str, seq: int, drain: bool = False
                      ) -> None:
        """An inline call that failed because another thread closed the communicator
        meanwhile (interrupted, stopped before READY, or the board released under it): its
        peers are told (now: this thread has stopped writing), an shm_direct call's
        arrays drained (``drain``), and the caller gets ``CommunicatorClosed``."""
        if self._closed and isinstance(e, Exception):
            text = f"rank {self.rank} closed the communicator during {coll} (call #{seq})"
            self._deferred = None
            self._publish(text)
            if drain:
                self._direct_drain()
            self.engine.told.set()
            raise CommunicatorClosed(text) from (None if isinstance(e, shm_direct.Stopped)
                                                 else e)

    def _stop_calls(self) -> None:
        """close() while another thread advances a call (inline, or a Request's wait):
        the compiled round stops before it lets peers into the caller's buffers (``stop``),
        an shm_direct share at its next piece (``stopping``), and that thread — which
        tells the peers once it has stopped writing, and drains — is waited for (bounded)
        before the transports, and the board with them, go away."""
        bd = self.board
        fast = getattr(bd, "fast", None)
        if fast is not None:
            fast.stop()
        if getattr(self, "_direct", None) is not None:
            self._direct.stopping = True
        eng = getattr(self, "engine", None)
        if eng is None or os.getpid() != self._pid:     # (a forked child: its parent's)
            return
        me = threading.get_ident()
        now = time.monotonic()
        deadline, grace = now + eng._timeout() + 5.0, now + 0.5
        while now < deadline:
            with eng.lock:
                deferred, telling = self._deferred, self._telling
            if self._elsewhere() or telling not in (0, me):
                grace = now + 0.5
            elif deferred is None or eng.busy or telling or now > grace:
                break   # (busy, telling: close() inside this thread's own call, a signal's)
            time.sleep(1e-4)
            now = time.monotonic()
        # a thread waiting on a Request between its steps leaves its wait at its next
        # turn (the requests have their error): not with the transports gone under it
        end = time.monotonic() + 2.0
        while eng.owner and eng.owner != me and time.monotonic() < end:
            time.sleep(1e-4)
        if self._elsewhere():
            log.warning("rank %d: closing while a call is still running in another thread",
                        self.rank)
        with eng.lock:
            text, self._deferred = self._deferred, None
        if text is not None:                # (its thread did not tell them: we do)
            self._publish(text)
        eng.told.set()

    def _direct_rest(self, coll: str, dp: "_DirectPlan", xf: np.ndarray, rf: np.ndarray,
                     alias: bool, root: int, n: int, seq: int, site: int, got: int,
                     rec: list | None, timeout: float | None) -> None:
        """An inline shm_direct call by ``DirectRun``: all of it (``got`` 2: the compiled
        round did nothing, or was not tried), or the rest of a call from the phase where
        the compiled round stopped (1: published; a staged call's 4: its block reduced;
        the shares' 5 and up: ``DirectRun.resume``)."""

        def chosen(name: str) -> None:
            if name:
                self.last_algorithm = name
                if rec is not None:
                    rec[flight.ALGO] = name

        fallback = self._schedule_start(dp.sched, xf, rf, dp.dtype, alias, dp.red, seq, dp.sig)
        run = shm_direct.DirectRun(self.board, self._direct, coll, seq, dp.sig, dp.meta,
                                   xf, rf, root, dp.red, n, site, fallback, dp.mins, chosen,
                                   dp.forced)
        if got == 1:      # published by the compiled round: the header round goes on
            run.hdr.phase = 1
        elif got == 4:    # this rank's block is reduced: wait for the others' and copy
            run.hdr.phase, run.phase = 2, 7
            chosen(shm_direct.STAGED)
        elif got != 2:    # the compiled shares agreed and stored READY
            run.resume(got)
        self.engine.run_inline(run, coll, seq, timeout)

    def _directplan(self, coll: str, dtype: np.dtype, n: int, op: Any, root: int):
        """For the inline path: a ``_DirectPlan`` when the general path would try
        shm_direct for this call (decided by the same ``_host_plan``), else None."""
        isz = dtype.itemsize
        try:
            direct, alg, sched, _algo = self._host_plan(coll, n, isz, root, None)
        except ValueError:
            return None
        if not direct or self._folds(coll, n, isz, None, sched):
            return None
        o = _FAST_OPS[(op, dtype)] if op is not None else None
        tag = f"{shm_direct.NAME}/{alg.name}"
        sig = _signature(coll, dtype.str, n, o, root, tag)
        meta = _board_meta(coll, dtype, n, o, root, tag)
        mins = self._direct_mins(coll, direct == 2)
        stages = shm_direct.stages(self.board, coll, n, isz, mins)
        staged = self.board.stage_plan(sig, meta, dtype, n, o) if stages else None
        # the compiled shares, where every buffer may be reached by CMA: taken when every
        # rank's header says so (ordinary arrays); anything else is DirectRun's
        acc = self._direct
        cma = self.board.direct_plan(coll, sig, meta, dtype, n, o, root) \
            if not stages and acc.can_cma and not acc.fail_open and \
            shm_direct.collective_bytes(coll, self.size, n, isz) >= mins[1] else None
        return _DirectPlan(o, reducer(o) if o is not None else None, dtype, sig, meta,
                           (dtype.str, n, o, root if coll in _ROOTED else None), sched,
                           alg.name, mins, direct == 2, staged, cma)

    def _fastplan_of(self, coll: str, dtype: np.dtype, n: int, op: Any, root: int,
                     algo: str | None):
        """``_fastplan``, cached per (collective, dtype, count, op, root, algo)."""
        return _cached(self._fastplans, (coll, dtype, n, op, root, algo), _PLANS_MAX,
                       self._fastplan, coll, dtype, n, op, root, algo)

    def _fastplan(self, coll: str, dtype: np.dtype, n: int, op: Any, root: int,
                  algo: str | None = None):
        """For the inline path: (op, signature, header meta, reducer, flight-recorder args,
        compiled plan) when this call goes to the board, a ``_DirectPlan`` when it tries
        shm_direct, else False (then the general path decides, and raises the errors).
        Cached per (collective, dtype, count, op, root): the choice depends on nothing else."""
        if not supported(dtype) or (op is not None and (op, dtype) not in _FAST_OPS) \
                or (op is None and coll in _REDUCING):
            return False      # (op=None on a reduction: the general path raises)
        if algo is None and self._direct is not None and coll in shm_direct.COLLS:
            dp = self._directplan(coll, dtype, n, op, root)
            if dp is not None:
                return dp
        if algo is None and shm_direct.NAME in (
                self._tuner_in[2].get(coll), self.tuner.profile_winner(
                    coll, shm_direct.collective_bytes(coll, self.size, n, dtype.itemsize))):
            return False        # GPURT_ALGO=coll:shm_direct, or the profile's winner
        try:
            if self.tuner.choose(coll, n, dtype.itemsize, algo).name != "shm_board":
                return False
        except ValueError:   # e.g. shm_board forced for a call too large for it
            return False
        o = _FAST_OPS[(op, dtype)] if op is not None else None
        sig = _signature(coll, dtype.str, n, o, root, "shm_board")
        meta = _board_meta(coll, dtype, n, o, root, "shm_board")
        return (o, sig, meta, reducer(o) if o is not None else None,
                (dtype.str, n, o, root if coll in _ROOTED else None),
                self.board.fast_plan(coll, sig, meta, dtype, n, o, root))

    def _in_place(self, xb: Buf, x: Any) -> Buf:
        with _ranked(self.rank, ValueError, " (out=None means in place)"):
            check_writable(xb, "x")
        return xb

    @_announces_rejection("broadcast")
    def ibroadcast(self, x: Any, root: int = 0, *, algo: str | None = None, stream: Any = None) -> Request:
        """Copy ``x`` of ``root`` into ``x`` on every rank (in place; ``x`` must be
        writable on every rank, the root included)."""
        self._check_open()
        root = self._root(root)
        xb = self._in(x)
        # writable on the root too: some algorithms (scatter_allgather) pass the root's
        # own blocks back through it
        self._in_place(xb, x)
        return self._submit("broadcast", xb, xb, xb.count, xb.dtype, None, root, x, algo, stream=stream)

    def broadcast(self, x: Any, root: int = 0, *, timeout: float | None = None,
                  algo: str | None = None, stream: Any = None) -> Any:
        timeout = self._timeout_arg(timeout, "broadcast")
        if stream is None and self._inlines(algo) and type(x) is np.ndarray and \
                type(root) is int and 0 <= root < self.size:
            done = self._inline("broadcast", x, None, None, root, timeout, algo)
            if done is not None:
                return done
        return self._blocking(self.ibroadcast(x, root, algo=algo, stream=stream), timeout)

    bcast = broadcast
    ibcast = ibroadcast

    @_announces_rejection("reduce")
    def ireduce(self, x: Any, out: Any = None, op: Any = Op.SUM, root: int = 0, *,
                algo: str | None = None, stream: Any = None) -> Request:
        """Reduction of ``x`` over all ranks into ``out`` on ``root`` (``out=None``: into
        ``x`` on the root).  Other ranks' ``x`` and ``out`` are left untouched."""
        self._check_open()
        root = self._root(root)
        xb = self._in(x)
        o = self._op(op, xb.dtype)
        if out is None or self.rank != root:
            ob = xb if out is None else self._in(out, "out")
            if self.rank == root:
                self._in_place(xb, x)
            result = x if out is None else out
        else:
            ob = self._out(out, xb, xb.count)
            if overlaps(xb, ob) and not same(xb, ob):
                raise ValueError(f"rank {self.rank}: reduce: out partly overlaps x")
            result = out
        if self.rank != root:
            ob = xb  # never written off the root
        return self._submit("reduce", xb, ob, xb.count, xb.dtype, o, root, result, algo,
                            finish_root_only=True, stream=stream)

    def reduce(self, x: Any, out: Any = None, op: Any = Op.SUM, root: int = 0, *,
               timeout: float | None = None, algo: str | None = None, stream: Any = None) -> Any:
        timeout = self._timeout_arg(timeout, "reduce")
        if stream is None and self._inlines(algo) and \
                type(x) is np.ndarray and type(root) is int and 0 <= root < self.size:
            done = self._inline_to("reduce", x, out, op, root, timeout, algo)
            if done is not _NO:
                return done
        return self._blocking(self.ireduce(x, out, op, root, algo=algo, stream=stream), timeout)

    @_announces_rejection("allgather")
    def iallgather(self, x: Any, out: Any = None, *, algo: str | None = None, stream: Any = None) -> Request:
        """Concatenate every rank's ``x`` in rank order: ``out`` has ``size * x.size``
        elements (allocated with shape ``(size, *x.shape)`` when ``out=None``)."""
        self._check_open()
        xb = self._in(x)
        if out is None:
            out, ob = self._new_out(xb, self.size * xb.count, (self.size,) + xb.shape, stream)
        else:
            ob = self._out(out, xb, self.size * xb.count)
            self._distinct(xb, ob, "allgather")
        return self._submit("allgather", xb, ob, xb.count, xb.dtype, None, 0, out, algo, stream=stream)

    def allgather(self, x: Any, out: Any = None, *, timeout: float | None = None,
                  algo: str | None = None, stream: Any = None) -> Any:
        timeout = self._timeout_arg(timeout, "allgather")
        if stream is None and self._inlines(algo) and \
                type(x) is np.ndarray:
            done = self._inline_to("allgather", x, out, None, 0, timeout, algo)
            if done is not _NO:
                return done
        return self._blocking(self.iallgather(x, out, algo=algo, stream=stream), timeout)

    @_announces_rejection("reduce_scatter")
    def ireduce_scatter(self, x: Any, out: Any = None, op: Any = Op.SUM, *,
                        algo: str | None = None, stream: Any = None) -> Request:
        """Reduce ``x`` (``size`` equal blocks) over all ranks; rank r gets block r."""
        self._check_open()
        xb = self._in(x)
        o = self._op(op, xb.dtype)
        n = self._blocks(xb, "reduce_scatter")
        if out is None:
            out, ob = self._new_out(xb, n, self._blocked_shape(xb, self.size), stream)
        else:
            ob = self._out(out, xb, n)
            self._distinct(xb, ob, "reduce_scatter")
        return self._submit("reduce_scatter", xb, ob, n, xb.dtype, o, 0, out, algo, stream=stream)

    def reduce_scatter(self, x: Any, out: Any = None, op: Any = Op.SUM, *,
                       timeout: float | None = None, algo: str | None = None, stream: Any = None) -> Any:
        timeout = self._timeout_arg(timeout, "reduce_scatter")
        if stream is None and self._inlines(algo) and \
                type(x) is np.ndarray:
            done = self._inline_to("reduce_scatter", x, out, op, 0, timeout, algo)
            if done is not _NO:
                return done
        return self._blocking(self.ireduce_scatter(x, out, op, algo=algo, stream=stream), timeout)

    def _blocks(self, xb: Buf, coll: str) -> int:
        if xb.count % self.size:
            raise ValueError(f"rank {self.rank}: {coll}: x has {xb.count} elements, not a "
                             f"multiple of the communicator size {self.size}")
        return xb.count // self.size

    @_announces_rejection("alltoall")
    def ialltoall(self, x: Any, out: Any = None, *, algo: str | None = None, stream: Any = None) -> Request:
        """Block i of ``x`` goes to rank i; block j of ``out`` came from rank j."""
        self._check_open()
        xb = self._in(x)
        n = self._blocks(xb, "alltoall")
        if out is None:
            out, ob = self._new_out(xb, xb.count, xb.shape, stream)
        else:
            ob = self._out(out, xb, xb.count)
            self._distinct(xb, ob, "alltoall")
        return self._submit("alltoall", xb, ob, n, xb.dtype, None, 0, out, algo, stream=stream)

    def alltoall(self, x: Any, out: Any = None, *, timeout: float | None = None,
                 algo: str | None = None, stream: Any = None) -> Any:
        timeout = self._timeout_arg(timeout, "alltoall")
        if stream is None and self._inlines(algo) and \
                type(x) is np.ndarray:
            done = self._inline_to("alltoall", x, out, None, 0, timeout, algo)
            if done is not _NO:
                return done
        return self._blocking(self.ialltoall(x, out, algo=algo, stream=stream), timeout)

    @_announces_rejection("gather")
    def igather(self, x: Any, out: Any = None, root: int = 0, *, algo: str | None = None, stream: Any = None
                ) -> Request:
        """Every rank's ``x`` into ``out`` on ``root``, in rank order (``size * x.size``
        elements; allocated with shape ``(size, *x.shape)`` when ``out=None``).  Returns
        ``None`` on the other ranks."""
        self._check_open()
        root = self._root(root)
        xb = self._in(x)
        ob, result = None, None
        if self.rank == root:
            if out is None:
                out, ob = self._new_out(xb, self.size * xb.count, (self.size,) + xb.shape, stream)
            else:
                ob = self._out(out, xb, self.size * xb.count)
                self._distinct(xb, ob, "gather")
            result = out
        return self._submit("gather", xb, ob, xb.count, xb.dtype, None, root, result, algo, stream=stream)

    def gather(self, x: Any, out: Any = None, root: int = 0, *, timeout: float | None = None,
               algo: str | None = None, stream: Any = None) -> Any:
        timeout = self._timeout_arg(timeout, "gather")
        if stream is None and self._inlines(algo) and \
                type(x) is np.ndarray and type(root) is int and 0 <= root < self.size:
            done = self._inline_to("gather", x, out, None, root, timeout, algo)
            if done is not _NO:
                return done
        return self._blocking(self.igather(x, out, root, algo=algo, stream=stream), timeout)

    @_announces_rejection("scatter")
    def iscatter(self, x: Any, out: Any = None, root: int = 0, *, algo: str | None = None, stream: Any = None
                 ) -> Request:
        """Block r of ``x`` on ``root`` goes to rank r.  ``x`` has ``size`` equal blocks;
        off the root it may be ``None`` if ``out`` is given (otherwise it only tells the
        shape and dtype of the block to allocate)."""
        self._check_open()
        root = self._root(root)
        xb = self._in(x) if x is not None else None
        if self.rank == root and xb is None:
            raise ValueError(f"rank {self.rank}: scatter: the root needs x")
        if out is None:
            if xb is None:
                raise ValueError(f"rank {self.rank}: scatter: pass out= (or x with the full "
                                 f"shape, to allocate out) on every rank that is not the root")
            n = self._blocks(xb, "scatter")
            out, ob = self._new_out(xb, n, self._blocked_shape(xb, self.size), stream)
        else:
            with _ranked(self.rank):
                ob = self._host(as_buf(out, "out"), "out")
                check_writable(ob, "out")
            n = ob.count
            if xb is not None:
                if xb.dtype != ob.dtype:
                    raise TypeError(f"rank {self.rank}: out has dtype {ob.dtype}, x has {xb.dtype}")
                if self.rank == root and xb.count != self.size * n:
                    raise ValueError(f"rank {self.rank}: scatter: x has {xb.count} elements, "
                                     f"size * out.size = {self.size * n} expected")
                if self.rank == root:     # (elsewhere x only gives the shape)
                    self._same_kind(xb, ob)
                self._distinct(xb, ob, "scatter")
        if self.rank != root:
            xb = None
        return self._submit("scatter", xb, ob, n, ob.dtype, None, root, out, algo, stream=stream)

    def scatter(self, x: Any, out: Any = None, root: int = 0, *, timeout: float | None = None,
                algo: str | None = None, stream: Any = None) -> Any:
        timeout = self._timeout_arg(timeout, "scatter")
        if stream is None and self._inlines(algo) and type(root) is int and \
                0 <= root < self.size:
            done = self._inline_to("scatter", x, out, None, root, timeout, algo)
            if done is not _NO:
                return done
        return self._blocking(self.iscatter(x, out, root, algo=algo, stream=stream), timeout)

    @_announces_rejection("barrier")
    def ibarrier(self, *, algo: str | None = None) -> Request:
        """Completes once every rank has entered the barrier."""
        self._check_open()
        return self._submit("barrier", None, None, 0, np.dtype(np.uint8), None, 0, None, algo)

    def barrier(self, *, timeout: float | None = None, algo: str | None = None) -> None:
        timeout = self._timeout_arg(timeout, "barrier")
        if self._inlines(algo) and \
                self._inline("barrier", _EMPTY_U8, None, None, 0, timeout, algo) is not None:
            return
        self._blocking(self.ibarrier(algo=algo), timeout)

    # -- point to point -------------------------------------------------------------
    def _peer(self, peer: Any, what: str) -> int:
        r = _rank_number(peer)
        if r is None or not 0 <= r < self.size:
            raise ValueError(f"rank {self.rank}: {what} peer {peer!r} is not a rank of this "
                             f"communicator (size {self.size})")
        if r == self.rank:
            raise ValueError(f"rank {self.rank}: {what} to itself is not supported (copy instead)")
        return r

    def _p2p(self, kind: str, b: Buf, peer: int, tag: int, stream: Any = None) -> Request:
        t = _rank_number(tag)       # (integral objects as peers and roots: 0-d arrays)
        if t is None or not 0 <= t <= _TAG_MAX:
            raise ValueError(f"rank {self.rank}: tag must be an int from 0 to 2**64-1, got "
                             f"{tag!r}")
        tag = t
        dev = b.kind != "host"
        sig = _p2p_sigs.get((b.dtype, dev))
        if sig is None:
            sig = _p2p_sigs[(b.dtype, dev)] = p2p_sig(b.dtype, dev)
        what = f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}"
        if not dev and stream is None and (kind != "send" or peer not in self.dev_endpoints):
            # the common case, lean: one message on the peer's host endpoint
            ep = self.endpoints.get(peer)
            arr = b.array.view(np.uint8)      # (flat and contiguous: its bytes)
            if ep is not None:
                tag = int(tag)
                fl = self.flight
                if fl is None:
                    finish = functools.partial(getattr, b, "owner")
                else:
                    rec = fl.start(tag, "p2p", (b.dtype.str, b.count, None, None),
                                   f"{what} tag {tag}")
                    finish = functools.partial(_p2p_done, rec, b)
                req = Request(self.engine, what, tag, None, finish, p2p=True)
                req.algorithm = "p2p"
                return self.engine.submit_run(
                    req, P2PRun(ep, kind == "send", arr, LANE_P2P, tag, sig, peer))
        sl = Slice("in" if kind == "send" else "out", 0, b.count)
        sched = Schedule(((Send(peer, sl) if kind == "send" else Recv(peer, sl),),))

        if dev:
            be = self.dev
            with _ranked(self.rank):
                st = devpath.stream_of(be, stream, b)
            others = devpath.other_streams(st, b)   # (stream= given: after b's own too)
            if others:
                devpath.order_after(be, st, others, self._dev_order_event())
            if peer not in self.dev_endpoints:
                raise TypeError(f"rank {self.rank}: {kind} of a device buffer to rank {peer}, "
                                f"which has no device backend")
            arr, empty = self._dev_view(b, b.dtype), self._dev_view(None, b.dtype)
            ctx, eps = devpath.DevCtx(be, st, b.dtype, None), self.dev_endpoints
        else:
            if stream is not None:
                raise ValueError(f"rank {self.rank}: stream= is for device buffers")
            arr, empty = b.array.view(b.dtype), np.empty(0, b.dtype)
            held = ((arr, kind != "send"),)
            ctx, eps = None, self.endpoints
            dev_ep = self.dev_endpoints.get(peer)
            if kind == "send" and dev_ep is not None and dev_ep.transport != "cuda_ipc":
                # behind staged device sends to that peer still waiting for their copies
                from gpurt.transports.cuda_ipc import HostInOrder
                eps = {peer: HostInOrder(dev_ep, self.endpoints[peer])}
        bufs = {"in": arr, "out": empty, "tmp": empty} if kind == "send" else \
               {"in": empty, "out": arr, "tmp": empty}

        def start() -> _Run:
            return _Run(sched, bufs, False, None, eps, LANE_P2P, int(tag), sig, dev=ctx,
                        dtype=b.dtype)

        fl = self.flight
        rec = fl.start(int(tag), "p2p", (b.dtype.str, b.count, None, None), f"{what} tag {tag}") \
            if fl is not None else None

        def finish() -> Any:
            if rec is not None:
                FlightRecorder.done(rec)
            return b.owner

        req = Request(self.engine, what, int(tag), start, finish, p2p=True)
        req.algorithm = "p2p"
        if not dev:
            req.held = held
        return self.engine.submit(req)

    def _p2p_clash(self, x: Any, send: bool, peer: Any, tag: Any) -> None:
        """A send or receive posted while this communicator has requests in flight
        (point-to-point ones, or non-blocking collectives, which run beside them): its
        host buffer compared with theirs (``_clash``).  Nothing has moved when it raises,
        and the peer is not told (as for any refused send/recv)."""
        eng = self.engine
        if self._closed or eng.poisoned is not None or eng.busy or eng.owner:
            return      # (the call raises that; another thread in a call is an error)
        if type(x) is not np.ndarray:
            try:
                b = as_buf(x, "x" if send else "out")
            except Exception:  # noqa: BLE001 - the call's own checks say what is wrong
                return
            if b.kind != "host":
                return
            x = b.array
        if not x.nbytes:
            return
        what = (send, peer, tag)        # (said only in the error)
        if eng.p2p:
            self._clash_p2p(x, not send, what)
        if eng.colls:   # (non-blocking collectives: few; a copy, as another thread's
            lo = _address(x) if x.flags.c_contiguous else -1    # call may take one off)
            for q in tuple(eng.colls):
                self._clash(x, lo, not send, what, q)

    def _clash_p2p(self, x: np.ndarray, writes: bool, what: Any) -> None:
        """``_clash`` of ``x`` against every point-to-point request in flight: one by one
        where there are a few (a send's or receive's ``P2PRun`` inline, by address: a
        ring exchange's check costs ~0.5 µs), through the ``_ClashIndex`` beyond."""
        p2p = self.engine.p2p
        n = x.nbytes
        contiguous = x.flags.c_contiguous
        if len(p2p) <= 4 or not contiguous:
            fa = _cma._fast_address or _address     # (the compiled one: 0.1 µs a call)
            lo = fa(x) if contiguous else -1
            for q in p2p:
                run = q.run
                if q.held is None and type(run) in _P2P_RUNS and lo >= 0:
                    # (the common case inline: a host send's or receive's flat array)
                    if not writes and run.send:
                        continue
                    arr = run.arr
                    a = fa(arr)
                    if lo >= a + arr.nbytes or a >= lo + n:
                        continue
                    if not (q.done or run.done):
                        self._clash_error(what, writes, q, not run.send)
                else:
                    self._clash(x, lo, writes, what, q)
            return
        idx = self._cidx
        if idx is None or not idx.current(p2p):
            idx = self._cidx = _ClashIndex(p2p)
        elif idx.n != len(p2p):
            idx.extend()
        lo = _address(x)
        hi = lo + n
        keys, ents = idx.keys, idx.ents
        j = bisect.bisect_left(keys, hi) - 1
        floor = lo - idx.longest
        while j >= 0 and keys[j] > floor:
            _qlo, qhi, qwrites, _arr, q = ents[j]
            if qhi > lo and (writes or qwrites):
                run = q.run
                if not (q.done or (run is not None and run.done)):
                    self._clash_error(what, writes, q, qwrites)
            j -= 1
        for _qlo, _qhi, qwrites, arr, q in idx.odd:
            if (writes or qwrites) and np.may_share_memory(x, arr):
                run = q.run
                if not (q.done or (run is not None and run.done)):
                    self._clash_error(what, writes, q, qwrites)

    def _clash(self, x: np.ndarray, lo: int, writes: bool, what: Any, q: Request) -> None:
        """``ValueError`` where the host array ``x`` (first byte ``lo``; -1: not
        contiguous), which the call ``what`` reads (or ``writes``), shares bytes with a
        buffer of request ``q``, still in flight, and one of the two writes there: a
        receive into a buffer that an unfinished send still reads or a receive still
        writes, a send from one that a receive writes (``irecv(x, p)`` then
        ``isend(x, p)`` for an exchange in place: each rank's message was read while the
        other's was written into it, a silent wrong answer), a collective into a
        receive's buffer, a send from an ``iallreduce``'s output.  MPI forbids the same
        and does not look.  Two reads of one buffer (sends to several peers) pass.
        Requests of other communicators are not compared."""
        spans = q.spans
        if spans is None:
            spans = q.spans = _spans(q)
        n = x.nbytes
        for qlo, qhi, qwrites, arr in spans:
            if not (writes or qwrites):
                continue
            if lo >= 0 and qlo >= 0:
                if lo >= qhi or qlo >= lo + n:
                    continue
            elif not np.may_share_memory(x, arr):
                continue
            run = q.run
            if not (q.done or (run is not None and run.done)):
                self._clash_error(what, writes, q, qwrites)

    def _clash_error(self, what: Any, writes: bool, q: Request, qwrites: bool) -> None:
        if type(what) is tuple:
            send, peer, tag = what
            what = f"{'send to' if send else 'recv from'} rank {peer} (tag {tag})"
        raise ValueError(
            f"rank {self.rank}: {what}: its buffer shares memory with that of {q.name} "
            f"({'tag' if q.p2p else 'call'} {q.seq}), still in flight, which "
            f"{'writes' if qwrites else 'reads'} it: the call would "
            f"{'write' if writes else 'read'} bytes the other is still "
            f"{'writing' if qwrites else 'reading'}, and the data would be wrong. Wait for "
            f"that request first (or use another buffer)")

    def _p2p_quick_table(self) -> dict:
        """Per local peer on shm (host endpoints; none with a device endpoint, whose
        staged sends a host send must stay behind): the p2p lane's two rings and their
        compiled ends (``_fastboard.P2PRing``), for ``_qsend``/``_qrecv``; per peer on
        tcp, its endpoint (``_TcpQuick``: ``_tsend``/``_trecv``)."""
        from gpurt.transports.shm import ShmEndpoint, _SLOT_HDR
        from gpurt.transports.tcp import TcpEndpoint
        # (the compiled end spins holding the GIL: at most 100 µs of GPURT_SPIN_US; a
        # quick tcp receive polls its socket as long)
        self._qspin = min(int((self.engine.spin or 0.0) * 1e9), 100_000)
        # peers on tcp: the endpoint's own send and receive, without a Request or a run
        # (_tsend, _trecv)
        table: dict = {peer: _TcpQuick(ep) for peer, ep in self.endpoints.items()
                       if type(ep) is TcpEndpoint and peer not in self.dev_endpoints}
        if _PLAIN is None or not shm_board.native_enabled():
            return table
        ring_type = shm_board.NATIVE.P2PRing
        for peer, ep in self.endpoints.items():
            if type(ep) is not ShmEndpoint or peer in self.dev_endpoints:
                continue
            tx, rx = ep.tx[LANE_P2P], ep.rx[LANE_P2P]
            seg = ep.owner.seg
            # messages from process_vm_readv's threshold on go single-copy: the compiled
            # end posts their address (put_addr) and reads them (get, given the peer's
            # pid where the start-up probe found process_vm_readv allowed) — receives
            # below the cooperative copy's threshold (GPURT_SHM_HELP), at least 2 MiB: from
            # there a sender with nothing else to do copying half of it wins (2 ranks,
            # ping-pong of 3 MiB: 131 against 174-181 µs; of 1 MiB the compiled read 38
            # against 52), while under 2 MiB the compiled read wins, and in a sendrecv,
            # whose sender has its own receive to copy, at every size (4 MiB 325-351
            # against 380-402 µs); shared arrays (gpurt.empty) from the mapping's
            # threshold on take the general path
            lim = tx.cma_min - 1 if tx.cma_min else 1 << 62
            pid = ep._pid if not ep.owner.cma_why else 0
            rlim = (max(rx.help_min, _QUICK_HELP_FROM) - 1 if rx.help_min else 1 << 62) \
                if pid else lim
            stride = tx.slot + _SLOT_HDR
            txf = ring_type(seg.u8, tx.head_i, tx.tail_i, ep.err_i, tx.hdr_i[0] * 8, stride,
                            tx.nslots, tx.slot)
            rxf = ring_type(seg.u8, rx.head_i, rx.tail_i, ep.err_i, rx.hdr_i[0] * 8, stride,
                            rx.nslots, rx.slot, pid, rx.ack_i)
            table[peer] = _QuickPeer(ep, tx, txf, rx, rxf, lim, max(lim, rlim),
                                     tx.map_min or 1 << 62)
        return table

    def _qsend(self, e: "_QuickPeer", x: np.ndarray, tag: int):
        """The quick path of a host send to a local peer below the single-copy threshold,
        when nothing is queued before it on the p2p ring: the compiled ring end writes its
        chunks into the free slots at once — True when all of them went (no Request, no
        run); a message with chunks left is posted as the general protocol's record from
        where the compiled end stopped: that Request, not complete.  False: take the
        general path (which also raises every error)."""
        if type(e) is _TcpQuick:
            return self._tsend(e, x, tag)
        eng, ring = self.engine, e.tx
        me = _get_ident()
        if self._closed or eng.poisoned is not None or eng.busy or eng.owner or ring.queue:
            return False
        eng.busy = me       # (a test and set, as in Engine.enter: another thread's call
        try:                # meanwhile is the two-threads error, not two writers)
            nb = x.nbytes
            if eng.poisoned is not None or nb >= e.map_min and \
                    sharedmem.lookup(shm_board.NATIVE.data_address(x), nb) is not None:
                return False
            s = _QSIGS.get(x.dtype)
            if s is None:
                return False
            p = e.ep._proc      # (the peer's liveness read, as ShmEndpoint.send does)
            if p is None or p.gone or time.monotonic() - p.checked > _SEND_CHECK:
                return False
            if nb > e.lim:
                return self._qsend_addr(e, x, nb, tag, s)
            old = ring.count
            try:
                c = e.txf.put(x, nb, tag, s[0], 0)
                if not c:
                    return False
                ring.count = c
            except BaseException as exc:
                self._quick_broke(ring, ring.head_i, exc)
                raise
            fl = self.flight
            sent = (c - old) * ring.slot
            if sent >= nb:
                if fl is not None:
                    fl.finished(tag, "p2p", (s[1], x.size, None, None), e.send_name, tag)
                return True
            # the rest as any send's: its record queued on the ring from where the
            # compiled end stopped, pushed by the waits (the ring's Python protocol)
            return self._qsend_rest(e, x, nb, tag, s, sent, 0)
        finally:
            eng.leave(0)

    def _qsend_rest(self, e: "_QuickPeer", x: np.ndarray, nb: int, tag: int, s, off: int,
                    ack: int) -> Request:
        """A quick send's Request, completed by the ring's Python protocol: its ``_Msg``
        from byte ``off`` (queued on the ring, whose waits push the rest), or with ``ack``
        > 0 a single-copy message posted whole (not queued: it is done once the receiver
        acknowledges that number).  Interrupted here, the communicator is poisoned: the
        message went in part, or whole, without its Request."""
        try:
            m = _Msg(e.tx, e.ep.peer, LANE_P2P, nb, tag, s[0],
                     data=x.reshape(-1).view(np.uint8))
            m.off, m.ack = off, ack
            run = P2PRun(e.ep, True, x, LANE_P2P, tag, s[0], e.ep.peer)
            run.k, run.pending = 1, [m]
            return self._qpost(None if ack else e.tx, m, run, x, e.send_name, s[1], tag)
        except BaseException as exc:
            self.engine.poison(exc)
            raise

    def _qsend_addr(self, e: "_QuickPeer", x: np.ndarray, nb: int, tag: int, s) -> Any:
        """``_qsend`` of a message from the single-copy threshold on (the engine held):
        its address in one slot (``P2PRing.put_addr``), as ``_Ring._push`` posts one, and
        a Request that is complete once the receiver has read it and acknowledged
        (``_Msg.test``, which also lends the sender's copies where the receiver asks).
        False where the ring has no free slot: the general path queues it."""
        ring = e.tx
        try:
            c = e.txf.put_addr(x, nb, tag, s[0])
            if not c:
                return False
            ring.acks += 1      # (before the count: _quick_broke poisons until both moved)
            ring.count = c
        except BaseException as exc:
            self._quick_broke(ring, ring.head_i, exc)
            raise
        return self._qsend_rest(e, x, nb, tag, s, nb, ring.acks)

    def _tsend(self, e: "_TcpQuick", x: np.ndarray, tag: int):
        """The quick path of a host send to a peer on tcp: the endpoint's own send (its
        frame written now, or queued behind what the connection still holds), without
        the argument checks of ``isend``, a Request or a run — True when the kernel took
        all of it; else its Request, not complete (the waits write the rest).  False:
        the general path (which raises every error) — also where the endpoint is due to
        look at its peer (``TcpEndpoint._send_check``), so nothing here raises but an
        exception from outside (a Ctrl-C), which poisons the communicator."""
        eng, ep = self.engine, e.ep
        if self._closed or eng.poisoned is not None or eng.busy or eng.owner or \
                ep.look_due():
            return False
        s = _QSIGS.get(x.dtype)
        if s is None or not x.size or not x.flags.c_contiguous:
            return False
        eng.busy = _get_ident()     # (a test and set: see _qsend)
        try:
            if eng.poisoned is not None:
                return False
            try:
                m = ep.send(x.reshape(-1).view(np.uint8), LANE_P2P, tag, s[0])
                return self._tend(e, x, m, True, tag, s)
            except BaseException as exc:
                eng.poison(exc)         # (the frame went in part, or whole, without its
                raise                   # Request)
        finally:
            eng.leave(0)

    def _trecv(self, e: "_TcpQuick", out: np.ndarray, tag: int, spin: int):
        """The quick path of a host receive from a peer on tcp: the endpoint's own receive,
        posted and read at once (a message that came already is copied out of the
        connection's buffer), polled up to ``spin`` ns — True when all of it was read;
        else its Request, not complete (the waits read the rest, and raise a mismatch or
        the peer's failure).  False: the general path."""
        eng, ep = self.engine, e.ep
        if self._closed or eng.poisoned is not None or eng.busy or eng.owner or \
                ep.failure is not None:
            return False
        s = _QSIGS.get(out.dtype)
        if s is None or not out.size or not out.flags.c_contiguous or \
                not out.flags.writeable:
            return False
        eng.busy = _get_ident()
        try:
            if eng.poisoned is not None:
                return False
            try:
                m = ep.recv(out.nbytes, _CopySink(out.reshape(-1).view(np.uint8)), LANE_P2P,
                            tag, s[0])
                if not m.done and spin:
                    until = time.perf_counter() + spin * 1e-9
                    while not m.done and m.error is None and ep.failure is None and \
                            time.perf_counter() < until:
                        ep.pump()
                return self._tend(e, out, m, False, tag, s)
            except BaseException as exc:
                eng.poison(exc)         # (posted, or read in part, without its Request)
                raise
        finally:
            eng.leave(0)

    def _tend(self, e: "_TcpQuick", arr: np.ndarray, m, send: bool, tag: int, s):
        """A quick tcp call's end: ``m`` (the endpoint's ``_Send``/``_Recv``) done — its
        flight record, True; failed already (a receive matched with a mismatched message
        that had come: ``_matches``) — its error raised by the call itself, as the
        general path's post raises it, and the caller poisons the communicator (before,
        the Request came back and only its wait raised); else a ``P2PRun`` holding it,
        posted (that Request)."""
        name = e.send_name if send else e.recv_name
        if not send and m.error is not None and not m.done:
            self.engine._annotate(m.error, f"in {name} (tag {tag}): ")
            raise m.error
        if m.done:
            fl = self.flight
            if fl is not None:
                fl.finished(tag, "p2p", (s[1], arr.size, None, None), name, tag)
            return True
        run = P2PRun(e.ep, send, arr, LANE_P2P, tag, s[0], e.ep.peer)
        run.k, run.pending = 1, [m]
        return self._qpost(None, None, run, arr, name, s[1], tag)

    def _qpost(self, ring, m: _Msg, run, arr: np.ndarray, name: str, dt: str,
               tag: int) -> Request:
        """A quick call's rest posted as the general protocol's: ``m`` queued on ``ring``
        (from its offset; ``ring`` None: nothing left to queue), a Request whose run is
        ``run``, flight-recorded as started, in the engine's point-to-point list, the
        engine marked as this thread's (its requests are advanced by waits elsewhere)."""
        eng, fl = self.engine, self.flight
        rec = fl.start(tag, "p2p", (dt, arr.size, None, None), f"{name} tag {tag}") \
            if fl is not None else None
        req = Request(eng, name, tag, None, functools.partial(_p2p_done, rec, arr)
                      if rec is not None else functools.partial(_same, arr), p2p=True)
        req.algorithm = "p2p"
        req.run = run
        if ring is not None:
            ring.queue.append(m)
        eng.p2p.append(req)
        eng.user = _get_ident()
        return req

    def _quick_broke(self, ring, word: int, exc: BaseException) -> None:
        """An exception (a Ctrl-C) right around a compiled ring call: if the ring's
        counter in the segment (``word``: its head or tail, this end's) moved without the
        Python ring knowing, the message went (or was taken) and the call did not finish —
        the counters are set from the segment and the communicator is poisoned, as after
        any failure inside a transfer."""
        w = int(ring.seg.q[word])
        if w != ring.count:
            ring.count = w
            if not ring.sender:
                ring.seen = w
            self.engine.poison(exc)

    def _qrecv(self, e: "_QuickPeer", out: np.ndarray, tag: int, spin: int,
               blocking: bool):
        """The quick path of a host receive from a local peer below the single-copy
        threshold: the ring's next chunks, read by the compiled ring end while they are
        exactly this receive's message (waiting up to ``spin`` ns for each) — True when
        all of it was read.  False: take the general path (which raises a mismatch, or
        waits under the deadlines and liveness checks).  A message not (all) there yet is
        posted as a ``QuickRecv`` from where the compiled end stopped: that Request, not
        complete (the caller waits on it, or returns it).  A single-copy message is read
        here only by a ``blocking`` receive: an ``irecv``'s caller may post next the send
        its peer waits for, and the two copies should then run side by side, not one
        after the other (docs/performance.md: no difference measurable on 2 ranks here)."""
        if type(e) is _TcpQuick:
            return self._trecv(e, out, tag, spin)
        eng, ring = self.engine, e.rx
        me = _get_ident()
        if self._closed or eng.poisoned is not None or eng.busy or eng.owner or ring.queue:
            return False
        eng.busy = me       # (a test and set: see _qsend)
        try:
            nb = out.nbytes
            s = _QSIGS.get(out.dtype)
            if s is None or nb > e.rlim or eng.poisoned is not None:
                return False        # (single copy where this end cannot read it)
            old, reads = ring.count, e.rxf.reads
            try:
                c = e.rxf.get(out, nb, tag, s[0], spin, 0, blocking)
                if c < 0:
                    return False
                if c:
                    ring.count = ring.seen = c
            except BaseException as exc:
                self._quick_broke(ring, ring.tail_i, exc)
                raise
            if c and e.rxf.reads != reads:
                got = nb            # a single-copy message, read whole and acknowledged
            else:
                got = (c - old) * ring.slot if c else 0
            if not c or got < nb:
                # posted as any receive is (its record queued on the ring, from the chunks
                # read on), then read by the compiled end while it is the ring's next
                # message (QuickRecv)
                try:
                    m = _Msg(ring, e.ep.peer, LANE_P2P, nb, tag, s[0],
                             sink=_ArraySink(out))
                    m.off = got
                    # (a blocking recv spun already: its wait does not spin again)
                    run = QuickRecv(e.ep, m, e.rxf, out, 0 if spin else self._qspin,
                                    e.ep.peer)
                    return self._qpost(ring, m, run, out, e.recv_name, s[1], tag)
                except BaseException as exc:
                    eng.poison(exc)     # (interrupted between queueing and posting)
                    raise
            fl = self.flight
            if fl is not None:
                fl.finished(tag, "p2p", (s[1], out.size, None, None), e.recv_name, tag)
            return True
        finally:
            eng.leave(0)

    def isend(self, x: Any, peer: int, tag: int = 0, *, stream: Any = None) -> Request:
        """Send ``x`` to ``peer``.  Messages between two ranks are matched in order; the
        tag, dtype and size are checked against the receive, not used to reorder."""
        if self._clash_on and (self.engine.p2p or self.engine.colls):
            self._p2p_clash(x, True, peer, tag)
        qt = self._qt
        if qt and type(x) is np.ndarray and type(peer) is int and type(tag) is int and \
                stream is None:
            e = qt.get(peer)
            if e is not None and 0 <= tag <= _TAG_MAX:
                r = self._qsend(e, x, tag)
                if r is not False:
                    return Completed(self.engine, e.send_name, tag, x) if r is True else r
        self._check_open()
        return self._p2p("send", self._in(x), self._peer(peer, "send"), tag, stream)

    def send(self, x: Any, peer: int, tag: int = 0, *, timeout: float | None = None,
             stream: Any = None) -> None:
        if self._clash_on and (self.engine.p2p or self.engine.colls):
            self._p2p_clash(x, True, peer, tag)
        qt = self._qt
        if qt and type(x) is np.ndarray and type(peer) is int and type(tag) is int and \
                timeout is None and stream is None:
            e = qt.get(peer)
            if e is not None and 0 <= tag <= _TAG_MAX:
                r = self._qsend(e, x, tag)
                if r is True:
                    return
                if r is not False:
                    self._blocking(r, None)
                    return
        timeout = self._timeout_arg(timeout)
        self._blocking(self.isend(x, peer, tag, stream=stream), timeout)

    def irecv(self, out: Any, peer: int, tag: int = 0, *, stream: Any = None) -> Request:
        """Receive the next message from ``peer`` into ``out`` (same size and dtype)."""
        if self._clash_on and (self.engine.p2p or self.engine.colls):
            self._p2p_clash(out, False, peer, tag)
        qt = self._qt
        if qt and type(out) is np.ndarray and type(peer) is int and type(tag) is int and \
                stream is None:
            e = qt.get(peer)
            if e is not None and 0 <= tag <= _TAG_MAX:
                r = self._qrecv(e, out, tag, 0, False)
                if r is not False:
                    return Completed(self.engine, e.recv_name, tag, out) if r is True else r
        self._check_open()
        with _ranked(self.rank):
            ob = self._host(as_buf(out, "out"), "out")
            check_writable(ob, "out")
        return self._p2p("recv", ob, self._peer(peer, "recv"), tag, stream)

    def recv(self, out: Any, peer: int, tag: int = 0, *, timeout: float | None = None,
             stream: Any = None) -> Any:
        if self._clash_on and (self.engine.p2p or self.engine.colls):
            self._p2p_clash(out, False, peer, tag)
        qt = self._qt
        if qt and type(out) is np.ndarray and type(peer) is int and type(tag) is int and \
                timeout is None and stream is None:
            e = qt.get(peer)
            if e is not None and 0 <= tag <= _TAG_MAX:
                r = self._qrecv(e, out, tag, self._qspin, True)
                if r is True:
                    return out
                if r is not False:
                    return self._blocking(r, None)
        timeout = self._timeout_arg(timeout)
        return self._blocking(self.irecv(out, peer, tag, stream=stream), timeout)

    # -- communicators ------------------------------------------------------------
    def split(self, color: int | None, key: int = 0) -> "Communicator | None":
        """Ranks with the same ``color`` form a new communicator, ordered by ``key`` then
        rank.  ``color=None`` (or ``MPI.UNDEFINED``) opts out (returns ``None``).
        Collective."""
        self._check_open()
        MPI = _mpi_ready(f"rank {self.rank}")
        why = ""
        try:
            if isinstance(color, (bool, np.bool_)) or isinstance(key, (bool, np.bool_)):
                raise TypeError
            # (index first: an array's == is an array, whose truth is a ValueError, a
            # tensor's a RuntimeError — that rank left, its peers waited in MPI for ever)
            c = None if color is None else operator.index(color)
            if c == MPI.UNDEFINED:
                c = None
            k = operator.index(key)
            if c is not None and not 0 <= c <= _INT_MAX:
                why = f"color={c} is outside 0..{_INT_MAX} (None opts out)"
            elif not -_INT_MAX - 1 <= k <= _INT_MAX:
                why = f"key={k} does not fit a C int"
        except Exception:  # noqa: BLE001 - whatever their __index__ raises
            why = f"color and key must be integers, got color={color!r}, key={key!r}"

        def make():
            # (one rank's bad argument would leave the others in MPI_Comm_split for ever)
            self._ctl_known_failed("split")
            self._ctl_published("split")
            _gather_progressing(self.mpi, self._ctl_watch("split"))
            whys = self.mpi.allgather(why)
            if any(whys):
                raise ValueError(f"rank {self.rank}: split: " + "; ".join(
                    f"rank {r}: {w}" for r, w in enumerate(whys) if w))
            new = _mpi_make(lambda: self.mpi.Split(MPI.UNDEFINED if c is None else c, k),
                            self.rank)
            return None if new == MPI.COMM_NULL else Communicator(new, _owned=True)

        return self._control_plane("split", make)

    def dup(self) -> "Communicator":
        """A new communicator over the same ranks, with its own transports.  Collective."""
        self._check_open()
        _mpi_ready(f"rank {self.rank}")
        def make():
            self._ctl_known_failed("dup")
            self._ctl_published("dup")
            return Communicator(self.mpi, _check=self._ctl_watch("dup"))

        return self._control_plane("dup", make)

    def _ctl_known_failed(self, what: str) -> None:
        """Before a split or dup posts anything in MPI: ``PeerFailure`` (the communicator
        poisoned) where a peer is already known to have failed — gone, stopped past the
        bound, or published a failure — since the exchange would wait for it for ever
        (it held a split until a frozen rank woke up: for ever, where it never did; a bug
        hunt).  A peer's *close* (or its exit's close notice) is not acted on: a rank that
        closes during its own split runs that exchange to its end, and its peers must
        come to it.  The transports' checks read their sockets, so they run only where
        no other thread is in this communicator's engine (a wait meanwhile does its own,
        and reading one connection from two threads mixes up the data)."""
        eng = self.engine
        me = threading.get_ident()
        if eng.poisoned is not None or eng.busy or eng.owner or eng.user not in (0, me):
            return      # (another thread's: its waits check, and it may come in any time)
        eng.busy, eng.lent = me, True   # (test and set, as progress_elsewhere: a thread
        try:                            # coming in meanwhile waits a moment, no error)
            failed = None
            for p, ep in list(self.endpoints.items()):
                try:
                    ep.check()
                except GpurtError as e:
                    # (a close during the peer's own split or dup — it stays in that
                    # exchange — or one that cannot say (verbs): acted on only where the
                    # peer's process is seen gone, on this node, in this pid space)
                    text = str(e)
                    if (CLOSED_IN_EXCHANGE not in text and CLOSED_OR_EXITED not in text) \
                            or self._gone(p):
                        failed = e
                        break
        finally:
            try:
                eng.leave(0)
            finally:
                eng.lent = False
        if failed is not None:
            failed.args = (f"rank {self.rank}: {what}: {failed.args[0]}",) + failed.args[1:]
            eng.poison(failed)
            raise failed

    def _gone(self, peer: int) -> bool:
        """Is ``peer``'s process seen to have exited (a peer of this node whose pid means
        the same here; else not known: False)?"""
        from gpurt.transports.shm import _pid_alive
        if self.topo.node_of[peer] != self.node or not self.pidns[peer] or \
                self.pidns[peer] != self.pidns[self.rank]:
            return False
        return not _pid_alive(self.pids[peer])

    def _ctl_watch(self, what: str) -> Callable[..., None]:
        """The check of a split's or dup's wait for every rank to come (``wait_mpi``, every
        20 ms, and once more when all have come): this communicator poisoned meanwhile —
        an ``abort()`` from another thread (a watchdog), another thread's failure on it,
        not a close — while not every rank has come (it stayed in MPI for ever); a peer
        that published a failure or its refusal of this exchange (``_ctl_published``);
        and every 0.1 s what ``_ctl_known_failed`` asks the transports — a peer gone,
        stopped past the bound, closed, or that published a failure.
        Such a peer never comes: a failed one's communicator is poisoned, and a poisoned
        communicator's split or dup raises before it posts anything; a peer that failed
        while in this exchange (its own watch saw another's failure) leaves it too, and
        publishes that.  The wait ended on it, every rank raises ``PeerFailure`` instead
        of waiting in MPI for ever (a rank that died of an exception, or exited, while
        the others split: a bug hunt).  A close is one too, but for a close made during
        the closer's own split or dup (``CLOSED_IN_EXCHANGE``: it runs the exchange to
        its end, and its peers wait on).  Past ``GPURT_TIMEOUT`` with a rank
        still to come, ``CollectiveTimeout`` (the communicator poisoned: published, so the
        peers in the wait leave too; MPI's barrier does not say which rank is missing)."""
        due = 0.0
        start = time.monotonic()
        limit = self.engine._timeout()

        def check(done: bool = False) -> None:
            nonlocal due
            own = self.engine.poisoned
            if own is not None and not self._closed and not done:
                # (this rank's abort() from another thread, or a failure another thread
                # met on this communicator — published, so the peers leave too — while
                # not every rank has come; once all have, the exchange runs to its end)
                raise CommunicatorClosed(f"rank {self.rank}: {what}: left the exchange: "
                                         f"{own}") from own
            now = time.monotonic()
            if not done and now - start > limit and not self._closed:
                e = CollectiveTimeout(
                    f"rank {self.rank}: {what}: not every rank came to it within {limit:g} s "
                    f"(GPURT_TIMEOUT; MPI's barrier does not say which rank is missing)",
                    collective=what)
                self.engine.poison(e)   # (published: the peers in the wait leave too)
                raise e
            self._ctl_published(what)
            if now >= due or done:      # (done: at once — a peer that left the wait
                due = now + 0.1         # may have posted first, and the exchanges that
                self._ctl_known_failed(what)    # follow are blocking)
        return check

    def _ctl_published(self, what: str) -> None:
        """Before a split or dup posts, and while it waits for every rank to come:
        ``PeerFailure`` where a peer published a failure — it refused this very exchange
        before posting anything in it (two threads making communicators below
        MPI_THREAD_MULTIPLE, ``_mpi_turn``), or its communicator is poisoned: it will
        never come, or it has left the wait — but for a close made during its own split or
        dup (``CLOSED_IN_EXCHANGE``: it stays).  What is already read only — shm's
        segment, tcp's error frame read by an earlier pump or the heartbeat's notice — no
        socket read: it runs where another thread is in the engine too, and
        ``_ctl_known_failed`` checks nothing (a review found a split posted after its
        peers had left it on their deadline, since another thread had used the
        communicator last, and then waiting in MPI for ever)."""
        for ep in list(self.endpoints.values()):
            published = getattr(ep, "published", None)
            e = published() if published is not None else None
            if e is not None and CLOSED_IN_EXCHANGE not in str(e):
                e.args = (f"rank {self.rank}: {what}: {e.args[0]}",) + e.args[1:]
                self.engine.poison(e)
                raise e

    def _control_plane(self, what: str, make: Callable[[], "Communicator | None"]
                       ) -> "Communicator | None":
        """``make()`` — split's or dup's exchanges over ``self.mpi`` and the new
        communicator's set-up — one at a time on this rank (``_ctl_lock``): two threads
        that split or dup one communicator at once made MPI collectives on one MPI
        communicator together — MPICH aborted on mixed-up messages, or a split returned
        size-1 communicators, silently (a bug hunt).  One after the other, each gets a
        whole communicator; which thread's call pairs with which on the other ranks is
        not defined (make them before the threads start: MPI says the same).  Not an
        error on one rank: the peers would be left in the exchange for ever; nor a call
        of the engine — another thread may wait on a request of this communicator
        meanwhile, as before.  A ``close()`` meanwhile (another thread, or a signal
        handler on this one) leaves ``self.mpi`` to this call to free (it freed the
        handle under the exchange: an MPI error naming no rank here, a peer left in MPI
        for ever); the exchange runs to its end, since the peers are in it, and then the
        new communicator is closed too and this call raises ``CommunicatorClosed`` (the
        peers' new one fails their first call in it with ``PeerFailure``)."""
        with self._ctl_lock:
            # (a nested one — a signal handler's split during this thread's — takes its
            # turn inside: the lock is this thread's already)
            with _CTL_LOCK:
                self._ctl_depth += 1
            new = None
            try:
                if self._closed:       # (closed since _check_open: nothing to exchange on)
                    raise CommunicatorClosed(f"rank {self.rank}: {what}: communicator "
                                             f"closed")
                try:
                    with _mpi_turn(_mpi(), f"rank {self.rank}", what):
                        new = make()
                except GpurtError as e:
                    if getattr(e, "not_your_turn", False):
                        # (refused before any MPI call: the peers, in the exchange, learn
                        # it from this communicator's poisoning — their waits check their
                        # peers)
                        self.engine.poison(e)
                    raise
            finally:
                with _CTL_LOCK:
                    self._ctl_depth -= 1
                    late = self._free_later and not self._ctl_depth
                    if late:
                        self._free_later = False
                if late:
                    self._free_mpi()
            if self._closed:
                if new is not None:
                    new.close()
                raise CommunicatorClosed(
                    f"rank {self.rank}: {what}: the communicator was closed (by another "
                    f"thread, or a signal handler) during the call; the new communicator "
                    f"is closed too")
            return new

    def explain(self, collective: str, nbytes: int) -> str:
        """The tuner's candidates for ``collective`` at ``nbytes`` (S as nccl-tests counts
        it), their predicted times and the choice, as a table — and, on one node, whether
        the call first tries ``shm_direct`` (taken when every rank's buffers are
        reachable; the table's choice is then the fallback); across nodes, whether it is
        folded into the agreement's exchange."""
        with _ranked(self.rank):
            nbytes = _nbytes(nbytes)
        with _ranked(self.rank, ValueError):
            text = self.tuner.explain(collective, nbytes)
        if self.direct_choice(collective, nbytes):
            if self.tuner.profile_winner(collective, nbytes) == shm_direct.NAME:
                why = "the profile's fastest at this size (measured: GPURT_PROFILE)"
            else:
                why = ("S >= its threshold on this one-node communicator; "
                       "GPURT_SHM_DIRECT*")
            text += (f"\n{shm_direct.NAME}: tried first ({why}), the choice above where a "
                     f"rank's buffers are out of reach")
        if self.fold_choice(collective, nbytes):
            n = int(nbytes) // 4 // (self.size if collective in _BLOCKED else 1)
            lim, why = self._fold_limit(collective), "GPURT_NET_FOLD / (ranks - 1)"
            if lim > self._fold:
                why = "GPURT_NET_FOLD_PAIR: an allreduce on two ranks"
            if self.tuner.profile_folds(collective, nbytes):
                why += "; the profile's fastest at this size (measured: GPURT_PROFILE)"
            text += (f"\n{FOLD}: the data ({_fold_bytes(collective, self.size, n, 4)} B "
                     f"per rank, <= {lim} B: {why}) rides "
                     f"in the agreement's exchange, one round instead of the agreement "
                     f"and the choice above (without algo=)")
        return text

    def candidates(self, collective: str, nbytes: int) -> list[dict]:
        """The same as ``explain`` as data: ``[{"algorithm", "predicted_s", "chosen"}]``,
        cheapest first (a forced choice — ``GPURT_ALGO`` — is marked chosen)."""
        with _ranked(self.rank):
            n = _nbytes(nbytes)
        with _ranked(self.rank, ValueError):
            return self.tuner.table(collective, n)

    def abort(self, reason: str = "aborted by the application") -> None:
        """Fail every request in flight and poison the communicator (local, immediate)."""
        if not self._closed:
            self.engine.poison(CommunicatorClosed(f"rank {self.rank}: {reason}"))

    def close(self) -> None:
        """Release transports and the duplicated MPI communicator.  Requests still in
        flight fail with ``CommunicatorClosed``.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._forked:
            # the transports, the board, the segments and the MPI communicator are the
            # parent's, which goes on using them: a child's close() touches none of them
            # (its descriptors and mappings go when it exits)
            return
        if self.flight is not None:
            calls = [e for e in self.flight._all() if e[flight.STATE] == "running"]
            last = calls[-1] if calls else None
            if last is not None:
                # a call in flight (another thread's, or a request not waited for): its
                # peers are told at once, or by the thread advancing it once that has
                # stopped writing (in _on_poison, as an abort's: after the poison, before
                # the requests' errors, deferred to the thread advancing it if any).  The
                # latest collective still running is named (a peer waits in it more likely
                # than in a send/recv, whose record holds a tag, not a call number)
                coll = next((e for e in reversed(calls) if e[flight.KIND] != "p2p"), None)
                what = f"{coll[flight.KIND]} (call #{coll[flight.SEQ]})" if coll is not None \
                    else f"a {last[flight.ALGO]}"      # ("isend tag 7")
                # (during this communicator's own split or dup too: it stays in that
                # exchange, and the peers waiting in it must wait on — _ctl_known_failed)
                stay = f" {CLOSED_IN_EXCHANGE}," if self._ctl_depth > 0 else ""
                self._close_text = (f"rank {self.rank} closed the communicator{stay} "
                                    f"during {what}")
                if not hasattr(self, "engine"):
                    self._publish(self._close_text)
            if self.flight.running():   # calls left unfinished: recorded as for a failure
                self.flight.dump(CommunicatorClosed(
                    f"rank {self.rank}: closed with calls unfinished " +
                    ("(at exit: a request never completed, e.g. its wait timed out)"
                     if _EXITING else "(close() with a request not completed: not "
                     "waited for, or its wait timed out; it fails with CommunicatorClosed)")))
            self.flight.dumped = True   # a plain close is no failure: nothing to report
        if hasattr(self, "engine"):
            self.engine.poison(CommunicatorClosed(f"rank {self.rank}: communicator closed"))
        self._release()

    def _release(self) -> None:
        for f in getattr(self, "_drop_fins", ()):
            f.detach()              # (close() writes its own notice, then unmaps)
        self._stop_calls()
        self._direct_drain()
        ipc = getattr(self, "dev_ipc", None)
        if ipc is not None:
            ipc.close()
        self.dev_endpoints, self._devtmp, self._devlast, self._devorder = {}, None, None, None
        self._devretired = []
        # (a close during this communicator's own split or dup — another thread's, a
        # signal handler's — says so in its notice: the peers waiting in that exchange
        # wait on, since this rank stays in it; any other close ends theirs)
        staying = self._ctl_depth > 0
        for t in self._transports:
            try:
                t.staying = staying
                t.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._transports = []
        self.endpoints = {}
        self._qt = None
        fin = getattr(self, "_mpi_fin", None)
        if fin is not None:
            fin.detach()
        # (a split or dup still exchanges over it — in another thread, or in this one
        # under a signal handler that closed: it frees the handles at its end)
        with _CTL_LOCK:
            later = self._ctl_depth > 0
            self._free_later = later
        if not later:
            self._free_mpi()
        _LIVE.discard(self)
        _free_mpi_garbage()

    def _free_mpi(self) -> None:
        MPI = _mpi()
        if not MPI.Is_finalized():
            comms = [getattr(self, c, None) for c in ("node_comm", "mpi")]
            took = _take_turn(MPI, "free")
            if took is False:
                # (another thread is in a creation's MPI exchanges, below
                # MPI_THREAD_MULTIPLE: freed by the next creation or close instead)
                _MPI_GARBAGE.extend((self._pid, c) for c in comms if c is not None)
                return
            try:
                for comm in comms:
                    if comm is not None and comm != MPI.COMM_NULL:
                        try:
                            comm.Free()
                        except Exception:  # noqa: BLE001
                            pass
            finally:
                if took:
                    _give_turn()


#: (pid, mpi4py communicator) of gpurt communicators collected without close(): freed
#: at the next creation or close() of one in this process — in the program's own flow,
#: not at a garbage collector's arbitrary moment and thread (a dropped communicator per
#: step otherwise used up MPI's context ids: ~1021 in MPICH)
_MPI_GARBAGE: list = []


def _dropped_notice(seg, k: int) -> None:
    """A communicator collected without ``close()``: local rank ``k``'s close notice in
    its shm segment, which its peers' waits read (``ShmEndpoint.check``)."""
    try:
        seg.write_error(k, "dropped the communicator without close() (the garbage "
                        "collector took it) while this rank still waits on it", closed=True)
    except Exception:  # noqa: BLE001 - a finalizer must not fail
        pass


def _free_mpi_garbage() -> None:
    if not _MPI_GARBAGE:
        return
    MPI = _mpi()
    if MPI.Is_finalized():
        return
    took = _take_turn(MPI, "free")
    if took is False:       # (another thread's creation is in MPI: later)
        return
    try:
        _free_garbage_now(MPI)
    finally:
        if took:
            _give_turn()


def _free_garbage_now(MPI) -> None:
    me = os.getpid()
    while _MPI_GARBAGE:
        try:
            pid, comm = _MPI_GARBAGE.pop()
        except IndexError:      # (another thread took the last one: a close() meanwhile)
            break
        if pid != me or MPI.Is_finalized():     # (a forked child's: its parent's handles)
            continue
        try:
            if comm != MPI.COMM_NULL:
                comm.Free()
        except Exception:  # noqa: BLE001 - best effort, as close()
            pass


def _ran_out(e: Exception) -> str:
    """MPI's cause, if ``e`` is MPI running out of communicators (context ids: the same
    on every rank, since a new communicator's id is agreed by all), else ""."""
    text = str(e)
    low = text.lower()
    if "too many communicators" not in low and "context id" not in low and \
            "contextid" not in low:
        return ""
    lines = [ln.split(": ", 1)[-1].strip() for ln in text.splitlines()]
    return next((ln for ln in reversed(lines) if ln), text)


def _mpi_make(make: Callable[[], Any], rank: int) -> Any:
    """``make()`` a communicator; MPI running out of them is a ResourceError naming how
    many gpurt communicators are open here — after a collection and one more try, since
    communicators only forgotten (a split per step) hold theirs until collected (their
    reference cycles wait for the cycle collector).  Any other MPI error is raised as it
    is (one rank's own failure must not make it repeat a collective alone)."""
    import gc

    MPI = _mpi()
    _free_mpi_garbage()
    try:
        return make()
    except MPI.Exception as e:
        if not _ran_out(e):
            raise
    gc.collect()
    _free_mpi_garbage()
    try:
        return make()
    except MPI.Exception as e:
        why = _ran_out(e)
        if not why:
            raise
        raise ResourceError(
            f"rank {rank}: MPI could not make a communicator ({why}) with {len(_LIVE)} gpurt "
            f"communicators open in this process: close() the ones no longer needed") from None


def _gather_progressing(mpi_comm: Any, check: Callable[..., None] | None = None) -> None:
    """Until every rank of ``mpi_comm`` has come to this communicator creation (or split,
    dup), keep this thread's requests on the other communicators moving: the blocking MPI
    exchanges that follow advance nothing of gpurt's, and a peer may still wait on one of
    them before it comes (an isend, then split, against recv, then split: the receiver
    timed out and the sender stayed in MPI_Comm_split for ever).  Once all are here, no
    rank waits on a gpurt request until the creation is over.  ``check``: a split's or
    dup's check for a peer that failed or refused the exchange (``wait_mpi``;
    ``Communicator._ctl_watch``), asked once more when all have come: a peer that left
    the wait on a failure it saw may have posted first, and this rank would then wait
    for it in the blocking exchanges that follow."""
    wait_mpi(mpi_comm.Ibarrier(), check=check)
    if check is not None:
        check(done=True)


#: the requests of creations this process left (``_arrival``): MPI completes them once
#: the late ranks come, and they must not be freed before
_LEFT_ARRIVALS: list = []


def _arrival(mpi_comm: Any) -> None:
    """The wait of a new communicator's creation (``gpurt.init()``, ``Communicator(c)``)
    for every rank of ``mpi_comm`` to come, at most this rank's ``GPURT_INIT_TIMEOUT``
    (``_init_timeout``) — a rank that had not called it yet (busy, stuck, or ended
    without it) left the others waiting in MPI for ever.  Two nonblocking collectives,
    so that every rank takes the same way: the barrier (``_gather_progressing``'s), then
    one allreduce in which a rank that gave up the barrier (its deadline, or an
    exception such as a Ctrl-C out of the wait) posts its rank, and a rank whose barrier
    completed posts nothing; every rank raises where one gave up.  A rank that gives up has posted both
    and leaves them to MPI; a late rank's barrier then completes at once, and the
    allreduce tells it who left (it waited in the blocking exchanges that follow for
    ever).  The allreduce itself has no deadline: every rank posts it right after its
    barrier.  (What still leaves the others waiting in MPI, as before: a rank killed, or
    one whose program is interrupted — a Ctrl-C of this rank alone — once the barrier has
    completed, in this wait or in the blocking exchanges of the creation after it.)"""
    MPI = _mpi()
    _tidy_arrivals()
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    limit = _init_timeout()
    what = (f"creating a gpurt communicator over the {size} ranks of "
            f"{'MPI_COMM_WORLD' if mpi_comm == MPI.COMM_WORLD else 'an MPI communicator'}")
    start = time.monotonic()

    def check(done: bool = False) -> None:
        if time.monotonic() - start > limit:
            raise CollectiveTimeout(
                f"rank {rank}: {what} (gpurt.init() or gpurt.Communicator(...)): not "
                f"every rank came to it within {limit:g} s (GPURT_INIT_TIMEOUT; MPI's barrier "
                f"does not say which rank is missing — one that has not called it yet: "
                f"busy, stuck, or ended without it)", collective="init")

    barrier = mpi_comm.Ibarrier()
    # (one word: the lowest rank that gave up, as size - rank; and why: 1 its deadline,
    # 2 an exception)
    word = np.zeros(1, np.int64)
    try:
        wait_mpi(barrier, check=check)
    except BaseException as e:
        word[0] = (size - rank) * 4 + (1 if isinstance(e, CollectiveTimeout) else 2)
        # (reduced in place: MPI writes into word after this rank has left; kept alive)
        with _ARRIVALS_LOCK:
            _LEFT_ARRIVALS.append((barrier, mpi_comm.Iallreduce(MPI.IN_PLACE, word,
                                                                MPI.MAX), word))
        _executor.JOB_FAILED = _executor.JOB_FAILED or (
            e if isinstance(e, CollectiveTimeout) else None)
        raise
    req = mpi_comm.Iallreduce(MPI.IN_PLACE, word, MPI.MAX)
    try:
        wait_mpi(req)
    except BaseException:
        with _ARRIVALS_LOCK:
            _LEFT_ARRIVALS.append((req, word))
        raise
    if word[0]:
        gave, why = size - int(word[0]) // 4, int(word[0]) % 4
        late = time.monotonic() - start < 0.05 and gave != rank
        e = PeerFailure(
            f"rank {rank}: {what}: rank {gave} gave up waiting for every rank to come "
            + ("(its GPURT_INIT_TIMEOUT passed)" if why == 1
               else "(an exception left its wait)")
            + ("; this rank came after it had" if late else "")
            + ": the communicator is not made on any rank", rank=gave)
        if _executor.JOB_FAILED is None:    # (as a rank that timed out marks it)
            _executor.JOB_FAILED = e
        raise e


def _init_timeout() -> float:
    """``GPURT_INIT_TIMEOUT`` in seconds (auto: max(GPURT_TIMEOUT, 300)); a value of this
    rank's that is not valid counts as its default here (the creation's exchange, which
    must be reached, reports it on every rank)."""
    def read(name: str) -> Any:
        try:
            return config.get(name)
        except ValueError:
            return config._BY_NAME[name].parse(config._BY_NAME[name].default)

    v = read("GPURT_INIT_TIMEOUT")
    return max(float(read("GPURT_TIMEOUT")), 300.0) if v == "auto" else float(v)


def _tidy_arrivals() -> None:
    """Frees the requests of the creations this process left that MPI has completed since
    (the late ranks came): MPI_Finalize named each one left as a "pending reference".
    (One thread at a time: two would test the same requests.)"""
    with _ARRIVALS_LOCK:
        for reqs in list(_LEFT_ARRIVALS):
            try:
                done = _mpi().Request.Testall([q for q in reqs if hasattr(q, "Test")])
            except Exception:  # noqa: BLE001 - MPI finalized, or its error: leave them
                return
            if done:
                _LEFT_ARRIVALS.remove(reqs)


_ARRIVALS_LOCK = threading.Lock()


@contextlib.contextmanager
def _errors_return(mpi_comm: Any):
    """MPI's errors on the program's ``mpi_comm`` returned (raised by mpi4py) for the
    block — gpurt's ``Dup`` of it — where the program set another handler (restored
    after): MPI's fatal default aborted the whole job when it ran out of communicators,
    where gpurt raises ``ResourceError`` (``_mpi_make``)."""
    MPI = _mpi()
    old = mpi_comm.Get_errhandler()
    try:
        if old == MPI.ERRORS_RETURN:
            yield
            return
        mpi_comm.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            yield
        finally:
            mpi_comm.Set_errhandler(old)
    finally:
        try:
            old.Free()
        except Exception:  # noqa: BLE001 - a predefined handle mpi4py will not free
            pass


def _mpi_comms(mpi_comm: Any, owned: bool) -> tuple[Any, Any]:
    """The control plane's duplicate of ``mpi_comm`` (itself if ``owned``: then freed
    here if this fails) and its node communicator (``_mpi_make``)."""
    MPI = _mpi()
    rank = mpi_comm.Get_rank()
    dup = None
    try:
        if owned:
            dup = mpi_comm
        else:
            with _errors_return(mpi_comm):
                dup = _mpi_make(mpi_comm.Dup, rank)
        # gpurt's own handles return MPI's errors (mpi4py raises them) whatever handler
        # the program chose (mpi4py.rc.errors = "default": MPI's ERRORS_ARE_FATAL), so
        # that running out of communicators is a ResourceError here, not an abort of
        # the job; their splits inherit it
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        node = _mpi_make(lambda: dup.Split_type(MPI.COMM_TYPE_SHARED, key=rank), rank)
        return dup, node
    except BaseException:
        if dup is not None:
            try:
                dup.Free()
            except Exception:  # noqa: BLE001
                pass
        raise


_INT_MAX = 2**31 - 1
_TAG_MAX = 2**64 - 1     # (the transports carry a tag in 64 bits)
_get_ident = threading.get_ident
#: the quick send/recv's dtypes (the host ones every call accepts): (p2p signature, str)
_QSIGS: dict = {dt: (p2p_sig(dt, False) & (2**64 - 1), dt.str) for dt in _SUPPORTED}


def _nbytes(nbytes: Any) -> int:
    """explain()'s and candidates()' size: an integer >= 0."""
    if isinstance(nbytes, float) and nbytes.is_integer():
        nbytes = int(nbytes)            # explain("allreduce", 1e6)
    try:
        n = operator.index(nbytes)
    except TypeError:
        raise TypeError(f"nbytes must be an integer, got {nbytes!r}") from None
    if n < 0:
        raise ValueError(f"nbytes must be >= 0, got {n}")
    return n


_EMPTY_U8 = np.empty(0, np.uint8)
_U64 = np.dtype(np.uint64)
LOCAL = "local"     # the algorithm of a one-rank communicator's host calls (_alone)
_EMPTY_U64 = np.empty(0, _U64)
_NO = object()     # "not taken inline" (None is a result: gather's off the root)


_M64 = 0xFFFFFFFFFFFFFFFF
_AGREE_SIG = 0x67707274414752   # "gprtAGR": the agreement messages' own signature
_META_WORDS = 5                        # shm_board.meta_of: the call's arguments
# an agreement header: seq, sig, meta, site, and the row word: (the sending rank << 32) |
# the row stride it used (words), which places the rows that a hierarchical exchange
# relays (_HierFold)
_ROW_WORD = 2 + _META_WORDS + callsite.WORDS
_HDR_WORDS = _ROW_WORD + 1
_AGREE_SIG2 = _AGREE_SIG ^ 1    # the header-only exchange after a mismatch (_HierFold)
_FOLD_RANKS = 8          # the most ranks for which agreement messages carry data
#: collectives whose size S (as nccl-tests and explain() count it) is the whole buffer
_REDUCING = frozenset({"allreduce", "reduce", "reduce_scatter"})
_BLOCKED = ("allgather", "reduce_scatter", "alltoall", "gather", "scatter")


def _fold_bytes(coll: str, p: int, n: int, isz: int) -> int:
    """The bytes of a rank's contribution to a folded call (its whole input)."""
    if coll == "barrier":
        return 0
    return (p if coll in ("reduce_scatter", "alltoall", "scatter") else 1) * n * isz


def _fold_sends(coll: str, r: int, root: int) -> bool:
    """Does rank r's data go into a folded call's exchange?  (Broadcast and scatter: only
    the root's; the others' messages carry the header.)"""
    return coll != "barrier" and (coll not in ("broadcast", "scatter") or r == root)


@lru_cache(maxsize=256)
def _agreement_schedule(p: int, r: int, n: int, m: int | None = None) -> Schedule:
    """The allgather that carries the headers of the agreement check: every rank's header
    straight to every rank up to 32 ranks (so a rank that times out in it can name every
    rank that has not arrived), Bruck's ⌈lg p⌉ rounds beyond.  Rows of ``n`` words; this
    rank sends the first ``m`` (default all) of its own, and where the rows have room for
    more than a header (folded calls: up to 32 ranks) every receive takes up to ``n``."""
    m = n if m is None else m
    if p > 32:
        if m != n:
            raise ValueError("the agreement's Bruck exchange moves whole rows")
        return REGISTRY["allgather"]["bruck"].build(p, r, n, 0)
    # direct, from this rank's own row of the output (no copy in)
    others = [q for q in range(p) if q != r]
    upto = n > _HDR_WORDS
    return Schedule.build([[Send(q, Slice("out", r * n, m)) for q in others]
                           + [Recv(q, Slice("out", q * n, n), upto) for q in others]])


_p2p_sigs: dict[tuple, int] = {}      # (dtype, device) -> p2p_sig


_QUICK_HELP_FROM = 2 << 20    # single-copy receives the compiled end leaves to the
                              # cooperative copy: from GPURT_SHM_HELP, at least this


class _QuickPeer:
    """One local peer's entry in the quick send/recv table (``_p2p_quick_table``): its
    endpoint, the p2p lane's two rings and their compiled ends, the largest message the
    compiled end sends through the slots (``lim``; larger ones it posts single-copy) and
    the largest it receives (``rlim``), where shared arrays stop being quick, and the
    names a request and a flight record give the calls."""

    __slots__ = ("ep", "tx", "txf", "rx", "rxf", "lim", "rlim", "map_min", "send_name",
                 "recv_name")

    def __init__(self, ep, tx, txf, rx, rxf, lim: int, rlim: int, map_min: int):
        self.ep, self.tx, self.txf, self.rx, self.rxf = ep, tx, txf, rx, rxf
        self.lim, self.rlim, self.map_min = lim, rlim, map_min
        self.send_name, self.recv_name = f"send to rank {ep.peer}", f"recv from rank {ep.peer}"


class _TcpQuick:
    """A peer on tcp in the quick send/recv table: its endpoint and the names a request
    and a flight record give the calls."""

    __slots__ = ("ep", "send_name", "recv_name")

    def __init__(self, ep):
        self.ep = ep
        self.send_name, self.recv_name = f"send to rank {ep.peer}", f"recv from rank {ep.peer}"


def _p2p_done(rec, b: Buf | np.ndarray) -> Any:
    FlightRecorder.done(rec)
    return b.owner if type(b) is Buf else b


def _same(x: Any) -> Any:
    return x


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid), 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _rank_number(v: Any) -> int | None:
    """``v`` as a rank number: an int, a NumPy integer, or anything integral by
    ``__index__`` (a 0-d integer tensor: ``torch.tensor(1)``, ``np.array(2)``); None for
    anything else — a bool (also a 0-d bool array or tensor), a float (2.0), a string, an
    array or tensor of one element but one dimension or more (whose ``__index__`` torch
    allows)."""
    if type(v) is int:
        return v
    if isinstance(v, (bool, np.bool_)):
        return None
    if getattr(v, "ndim", 0) != 0 or str(getattr(v, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return int(operator.index(v))      # (int(): an IntEnum as a plain number)
    except TypeError:
        return None


def _hier_agreement(topo: Topology) -> bool:
    """Does the agreement gather the headers hierarchically here?  On more than
    ``_FOLD_RANKS`` ranks (no call folds: every row is a header), 2 to 32 nodes, some with
    several ranks: inside each node first, then each rank swaps its node's headers with
    one rank of every other node — (local ranks − 1) messages inside the node and (nodes −
    1) or a few more across, instead of one to every other rank (most of them across
    nodes) or Bruck's ⌈lg p⌉ rounds."""
    return topo.size > _FOLD_RANKS and 2 <= topo.nnodes <= 32 and \
        max(len(rs) for rs in topo.local_ranks) > 1


def _hier_fold(topo: Topology) -> bool:
    """Does the agreement of a communicator whose calls fold (up to ``_FOLD_RANKS`` ranks,
    several nodes, some with several ranks) go hierarchically (``_HierFold``)?  Where that
    saves at least two network messages per rank and call, on average: a relayed row costs
    a second round, which on 2 nodes x 2 ranks (one message saved per rank) measured a
    loss for calls too large to fold (docs/performance.md), while 3 x 2 and 2 x 3 save two
    (2 x 4: three)."""
    nodes = topo.local_ranks
    if not (topo.size <= _FOLD_RANKS and len(nodes) >= 2 and max(len(rs) for rs in nodes) > 1):
        return False
    p = topo.size
    flat = sum(len(rs) * (p - len(rs)) for rs in nodes)
    hier = sum(len(_hfold_targets(ra, j, rb)) for a, ra in enumerate(nodes)
               for j in range(len(ra)) for b, rb in enumerate(nodes) if b != a)
    return flat - hier >= 2 * p


def _hfold_targets(mine: tuple, j: int, other: tuple) -> tuple:
    """The ranks of node ``other`` to which local rank ``j`` of node ``mine`` sends its
    node's rows in the step across nodes of ``_agreement_schedule_hfold``: local ranks j,
    j + len(mine), ... of ``other`` (so every rank of ``other`` gets them from exactly one
    rank of ``mine``: local rank k from k mod len(mine))."""
    return other[j::len(mine)]


def _heads_equal(b: bytes, i: int, p: int) -> bool:
    """Are the ``p`` equal-length headers in ``b`` all equal to the ``i``-th (this rank's
    own, as it sent it)?  One byte-string comparison: the agreement's common case."""
    w = len(b) // p
    return b == b[i * w:(i + 1) * w] * p


class _HierFold:
    """The agreement exchange, and the folded calls inside it, on a communicator of up to
    ``_FOLD_RANKS`` ranks over several nodes some of which hold several ranks
    (``_hier_fold``): ``_agreement_schedule_hfold`` — every rank's row to its node's other
    ranks, then the node's rows in one message to a rank of every other node.

    The rows lie in node-major order (rank k's is row ``perm[k]``) at a stride that each
    call sets: its largest message (``s`` words: a header, and a folded call's largest
    contribution), the same on every rank whose call matches, so that a node's rows go
    across as one short message.  A mismatched call may use another stride; a row then
    lands elsewhere, or brings what another rank's message held.  Every header carries
    its sender's rank and the stride it used (the row word), so a rank whose rows are all
    in place with the expected row word has every rank's own header, exactly; any other
    outcome shows a difference on every rank (a rank's header is either read in place, or
    its row holds something else there).  Then every rank runs one more, header-only
    exchange (stride: a header; nothing can land astray), whose rows name each rank's
    call exactly (``Communicator._agree``)."""

    __slots__ = ("every", "nodes", "order", "perm", "r", "i", "cap", "views", "scheds",
                 "cur", "clean")

    def __init__(self, topo: Topology, r: int, words: int):
        self.nodes = topo.local_ranks
        self.order = tuple(q for rs in self.nodes for q in rs)
        p = len(self.order)
        self.perm = np.empty(p, np.intp)
        self.perm[list(self.order)] = np.arange(p)
        self.r, self.i, self.cap = r, int(self.perm[r]), words
        # (no stale bytes of this process go out)
        self.every = np.zeros(p * words, np.uint64)
        self.views: dict[int, tuple] = {}
        self.scheds: dict[tuple, tuple] = {}
        self.cur: tuple | None = None      # the view of the last exchange's rows
        self.clean = False                 # ... and every row agreed

    def view(self, s: int) -> tuple:
        """(rows, their data as bytes, their compared words, their row words, the row
        words expected) at stride ``s``."""
        v = self.views.get(s)
        if v is None:
            p = len(self.order)
            rows = self.every[:p * s].reshape(p, s)
            expect = np.array([q << 32 | s for q in self.order], np.uint64)
            v = self.views[s] = (rows, rows[:, _HDR_WORDS:].view(np.uint8),
                                 rows[:, :2 + _META_WORDS], rows[:, _ROW_WORD], expect)
        return v

    def _post(self, eps: dict, seq: int, hdr: np.ndarray, s: int,
              data: np.ndarray | None, sig: int) -> RowsRun:
        v = self.cur = self.view(s)
        own = v[0][self.i]
        own[:_ROW_WORD] = hdr
        own[0] = seq
        own[_ROW_WORD] = self.r << 32 | s
        m = _HDR_WORDS
        if data is not None and data.nbytes:
            v[1][self.i][:data.nbytes] = data.view(np.uint8)
            m += -(-data.nbytes // 8)
        sched, covers = _cached(self.scheds, (s, m), 64, _agreement_schedule_hfold,
                                self.nodes, self.r, s, m, self.cap)
        return RowsRun(sched, {"in": own, "out": self.every, "tmp": _EMPTY_U64}, eps, seq,
                       sig, covers)

    def run(self, eps: dict, seq: int, hdr: np.ndarray, data: np.ndarray | None,
            call_bytes: int) -> Chain:
        self.clean = False
        first = self._post(eps, seq, hdr, _HDR_WORDS + -(-call_bytes // 8), data, _AGREE_SIG)

        def then() -> RowsRun | None:
            heads, words, expect = self.cur[2:]
            if _heads_equal(heads.tobytes(), self.i, len(self.order)) and \
                    np.array_equal(words, expect):
                self.clean = True
                return None
            # a call differs (every rank sees it): the headers again, header-only
            return self._post(eps, seq, hdr, _HDR_WORDS, None, _AGREE_SIG2)

        return Chain(first, then)


@lru_cache(maxsize=256)
def _agreement_schedule_hfold(nodes: tuple, r: int, s: int, m: int, cap: int) -> tuple:
    """(schedule, covers) of ``_HierFold``'s exchange for rank ``r``: rows of stride ``s``
    words in node-major order in ``out``; this rank sends the first ``m`` words of its own
    row to its node's other ranks (step 1), then its node's rows, from local rank j to the
    ranks k ≡ j (mod this node's size) of every other node (step 2), receiving one other
    node's rows from its local rank k mod that node's size.  Where ``cap`` > ``s`` the
    receives take messages of up to ``cap`` words a row (a mismatched call's, of another
    stride: it may overwrite the rows after it, which the comparison then finds; the
    buffer holds every such message).  ``covers[q]``: the ranks whose rows the receive
    from q brings (``RowsRun.missing``)."""
    order = [q for rs in nodes for q in rs]
    pos = {q: i for i, q in enumerate(order)}
    a = next(b for b, rs in enumerate(nodes) if r in rs)
    mine = nodes[a]
    j = mine.index(r)
    up = cap > s
    peers = [q for q in mine if q != r]
    covers = {q: (q,) for q in peers}
    step1 = [Send(q, Slice("out", pos[r] * s, m)) for q in peers] + \
        [Recv(q, Slice("out", pos[q] * s, cap if up else s), up) for q in peers]
    block = Slice("out", pos[mine[0]] * s, len(mine) * s)
    step2 = []
    for b, rs in enumerate(nodes):
        if b == a:
            continue
        step2 += [Send(q, block) for q in _hfold_targets(mine, j, rs)]
        src = rs[j % len(rs)]
        step2.append(Recv(src, Slice("out", pos[rs[0]] * s, len(rs) * (cap if up else s)),
                          up))
        covers[src] = rs
    return Schedule.build([step1, step2]), covers


@lru_cache(maxsize=64)
def _agreement_schedule_hier(nodes: tuple, r: int, n: int) -> tuple:
    """(schedule, covers) of the hierarchical agreement for rank ``r`` (rows of ``n``
    words, rank order, in ``out``; this rank's own row is its message): step 1 every
    rank's row to its node's other ranks; step 2 the rows of the whole node, packed
    node by node, from local rank j to the ranks k ≡ j (mod this node's size) of every
    other node, each rank receiving one other node's rows from its local rank k mod that
    node's size; where nodes are not blocks of consecutive ranks (round-robin
    placements), the rows are packed in ``tmp`` and a third step copies them out.
    ``covers[q]``: the ranks whose rows the receive from q brings (``RowsRun.missing``)."""
    node_of = {q: b for b, rs in enumerate(nodes) for q in rs}
    order = [q for rs in nodes for q in rs]            # node-major
    pos = {q: i for i, q in enumerate(order)}
    packed = order != sorted(order)                    # not blocks: pack in tmp
    a = node_of[r]
    mine = nodes[a]
    j = mine.index(r)
    row = lambda q: Slice("out", q * n, n)             # noqa: E731
    place = (lambda q: Slice("tmp", pos[q] * n, n)) if packed else row

    def block(b: int) -> Slice:
        first = nodes[b][0]
        return Slice("tmp" if packed else "out", (pos[first] if packed else first) * n,
                     len(nodes[b]) * n)

    peers = [q for q in mine if q != r]
    covers = {q: (q,) for q in peers}
    step1 = ([Copy(row(r), place(r))] if packed else []) + \
        [Send(q, row(r)) for q in peers] + [Recv(q, place(q)) for q in peers]
    step2 = []
    for b, rs in enumerate(nodes):
        if b == a:
            continue
        step2 += [Send(rs[k], block(a)) for k in range(j, len(rs), len(mine))]
        src = rs[j % len(rs)]
        step2.append(Recv(src, block(b)))
        covers[src] = rs
    steps = [step1, step2]
    if packed:
        steps.append([Copy(place(q), row(q)) for q in order if q != r])
    return Schedule.build(steps, tmp=len(order) * n if packed else 0), covers


class _DirectPlan:
    """An inline shm_direct call's plan (``Communicator._directplan``): what ``_submit``
    would decide for the same call, computed once per call shape."""

    __slots__ = ("op", "red", "dtype", "sig", "meta", "fargs", "sched", "fallback", "mins",
                 "forced", "staged", "cma")

    def __init__(self, op, red, dtype, sig, meta, fargs, sched, fallback, mins, forced,
                 staged=None, cma=None):
        self.op, self.red, self.dtype, self.sig, self.meta = op, red, dtype, sig, meta
        self.fargs, self.sched, self.fallback = fargs, sched, fallback
        self.mins, self.forced = mins, forced
        #: the compiled staged round's plan, where this call stages on ordinary arrays
        self.staged = staged
        #: the compiled shares' plan (``_fastboard``'s ``direct``: every buffer by CMA)
        self.cma = cma


_PLANS_MAX = 4096   # call shapes whose plans a communicator keeps (per path)
_QUICK = 4          # the small in-place allreduces whose plans allreduce tests first


def _cached(cache: dict, key, limit: int, make, *args):
    """``cache[key]``, made by ``make(*args)`` on a miss.  A cache that holds ``limit``
    entries is emptied first: a program uses few call shapes, and one that cycles through
    more stays correct, only slower."""
    v = cache.get(key)
    if v is None:
        if len(cache) >= limit:
            cache.clear()
        v = cache[key] = make(*args)
    return v


def _agree_header(sig: int, meta: tuple, site) -> np.ndarray:
    """An agreement header's words, less the sequence number (word 0)."""
    return np.array((0, sig & _M64) + meta + callsite.words(site), np.uint64)


def _row_blocks(rows: np.ndarray, lo: int, nb: int, dtype: np.dtype) -> tuple:
    """Each rank's ``nb`` bytes from byte ``lo`` of its row, as ``dtype``: views."""
    return tuple(rows[:, lo:lo + nb].view(dtype))


def _sleep_polling(waiters: list, seconds: float) -> None:
    """Several transports, some with sockets: short selects on those (so arriving data
    ends the wait) while the shared-memory ones are polled by the caller in between."""
    share = min(seconds, 2e-4) / len(waiters)
    for w in waiters:
        w(share)


@lru_cache(maxsize=1024)
def _board_meta(coll: str, dtype: np.dtype, n: int, op: Op | None, root: int,
                alg: str = "") -> tuple:
    return shm_board.meta_of(coll, dtype, n, op, root, alg=alg)


def _board_cost(coll: str, share: Callable[[], float]):
    """α-β-γ cost of the board protocol: one publication, then reads (W written, R read,
    G reduced bytes per rank, for a call of size S on p ranks); ``share()``: the share of
    a message's β that its copies cost (``Communicator._board_copy_share``)."""
    alpha = 15e-6   # one inline round of Python: write, publish, poll, read

    def cost(p: int, S: float, c) -> float:
        W = shm_board.written_bytes(coll, p, S)
        # reads: the reductions read the peers' buffers in place (that is γ); the first
        # buffer is copied
        R = {"barrier": 0, "scatter": S / p}.get(coll, S)
        G = {"allreduce": (p - 1) * S, "reduce": (p - 1) * S,
             "reduce_scatter": (p - 1) * S / p}.get(coll, 0)
        # W and R are single copies (into / out of shared memory)
        return alpha + 0.2e-6 * (p - 1) + (W + R) * c.beta * share() + G * c.gamma

    return cost


def _learn_algorithm_names() -> None:
    """Every algorithm a peer's header may name (its tag), so mismatch errors can say it."""
    names = {"none", HIER, FOLD, "shm_board", shm_direct.NAME}
    for algs in REGISTRY.values():
        for name in algs:
            names.update((name, f"{shm_direct.NAME}/{name}"))
    shm_board.name_algorithms(names)


@lru_cache(maxsize=1024)
def _signature(coll: str, dtype: str, n: int, op: Op | None, root: int, alg: str = "") -> int:
    """A hash of what every rank must agree on — the call and the algorithm or protocol
    that runs it — the same in every process (crc32, not Python's salted ``hash``)."""
    return zlib.crc32(f"{coll}|{dtype}|{n}|{op.name if op else ''}|{root}|{alg}".encode())


def _check_alike(rank: int, values: list[tuple]) -> None:
    """Every rank's ``config.must_agree()`` (gathered): a variable whose value differs
    between ranks is a ValueError on every rank that shows each value and its ranks."""
    for k, name in enumerate(config.SAME_EVERYWHERE):
        by_value: dict = {}
        for r, vals in enumerate(values):
            by_value.setdefault(vals[k], []).append(r)
        if len(by_value) > 1:
            def show(v):
                return ",".join(v) if isinstance(v, tuple) and v else \
                    ("unset" if v == () else repr(v))
            seen = "; ".join(f"{show(v)} on rank(s) {rank_ranges(rs)}"
                             for v, rs in by_value.items())
            raise ValueError(f"rank {rank}: {name} must be the same on every rank "
                             f"(each rank's set-up is collective): {seen}")


def _prefix(rank: int, e: BaseException) -> str:
    msg = str(e)
    return msg if msg.startswith("rank ") else f"rank {rank}: {msg}"


class _ranked:
    """``with _ranked(rank):`` argument checks inside the block raise with the rank in
    front of their text (``rank 3: ...``), the same class where it can be built from one
    string, else the plain ``ValueError``/``TypeError`` it derives from; the caller's
    traceback only.  (A class, not a ``contextlib.contextmanager``: entering and leaving
    a generator-based one cost ~1.5 us here, on every send and receive.)"""

    __slots__ = ("rank", "kinds", "suffix")

    def __init__(self, rank: int, kinds: Any = (ValueError, TypeError), suffix: str = ""):
        self.rank, self.kinds, self.suffix = rank, kinds, suffix

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, e, tb) -> bool:
        if e is None or not isinstance(e, self.kinds):
            return False
        text = _prefix(self.rank, e) + self.suffix
        try:
            again = type(e)(text)
        except Exception:       # a class that wants more than a message (UnicodeError ...)
            again = (TypeError if isinstance(e, TypeError) else ValueError)(text)
        raise again from None


def init() -> Communicator:
    """The communicator over ``MPI.COMM_WORLD`` (initialising MPI if needed).  Idempotent:
    later calls return the same object while it is open."""
    global _WORLD, _INIT_OWNER
    w = _WORLD
    if w is not None and not w.closed:
        return w
    # (two threads at once each made one, both collective over COMM_WORLD at the same
    # time: MPICH aborted on mixed-up messages, or each got its own, and a later call on
    # one of them hung — a bug hunt; the second waits here and gets the first's)
    me = threading.get_ident()
    if _INIT_OWNER == me:       # (a signal handler's init() inside this thread's first)
        raise GpurtError(f"pid {os.getpid()}: gpurt.init() called while this thread's "
                         f"first init() is still making the communicator (from a signal "
                         f"handler?)")
    with _INIT_LOCK:
        _INIT_OWNER = me
        try:
            if _WORLD is None or _WORLD.closed:
                world = _mpi_ready().COMM_WORLD
                _check_not_a_singleton(world.Get_size())
                _WORLD = Communicator(world)
            return _WORLD
        finally:
            _INIT_OWNER = 0


_INIT_LOCK = threading.Lock()
_INIT_OWNER = 0


def _init_lock_after_fork() -> None:
    # (a child forked while another thread of the parent held it would wait for ever)
    global _INIT_LOCK, _INIT_OWNER
    _INIT_LOCK, _INIT_OWNER = threading.Lock(), 0


os.register_at_fork(after_in_child=_init_lock_after_fork)

# Communicator._ctl_depth / _free_later: the hand-off of the MPI handles between a split or
# dup and a close() (re-entrant: a signal handler's close)
_CTL_LOCK = threading.RLock()


#: what launchers tell their processes of the job's size (hydra and other PMI-1 process
#: managers, Intel MPI; Open MPI)
_LAUNCH_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def _check_not_a_singleton(size: int) -> None:
    """``mpiexec -n 4`` with an mpi4py that loaded another MPI library than the launcher's
    (say the mpich wheel's hydra with mpi4py built against Open MPI) starts 4 processes
    that each see an MPI_COMM_WORLD of 1: every rank would run the whole program alone and
    succeed, silently.  A launcher that says the job is larger than the world is an error
    naming both."""
    if size != 1:
        return
    for var in _LAUNCH_SIZE_VARS:
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 1:
            from mpi4py import MPI
            lib = " ".join(MPI.Get_library_version().split("\n", 1)[0].split())
            raise GpurtError(
                f"pid {os.getpid()}: the launcher started a job of {v} processes ({var}={v}), "
                f"but MPI_COMM_WORLD has 1: mpi4py's MPI library ({lib}) is not the one "
                f"the launcher belongs to, so every process would run alone. Launch with "
                f"the mpiexec/mpirun of that library (`gpurt info` names both), or rebuild "
                f"mpi4py against the launcher's MPI (README: 'Using the site MPI')")


_HOOKED = False


def _install_excepthook() -> None:
    """With ``GPURT_EXCEPTHOOK=1`` (the default), an unhandled exception in the main thread
    is published to every live communicator's peers before the process dies, so they
    raise ``PeerFailure`` naming this rank and the exception instead of waiting; then the
    previous hook runs as before."""
    global _HOOKED
    if _HOOKED or not config.get("GPURT_EXCEPTHOOK"):
        return
    _HOOKED = True
    previous = sys.excepthook

    def hook(etype, value, tb):
        text = f"{etype.__name__}: {value}"
        for c in list(_LIVE):
            for t in c._transports:
                publish = getattr(t, "publish_error", None)
                if publish is not None:
                    try:
                        publish(text)
                    except Exception:  # noqa: BLE001 - never mask the user's error
                        pass
        # the calls this rank leaves unfinished as it dies (a Request whose wait timed out
        # stays in flight, so nothing dumped them): recorded as for a failure
        for c in list(_LIVE):
            fl = c.flight
            if fl is not None and not fl.dumped and fl.running():
                try:
                    fl.name_site(callsite.site())
                    fl.dump(value)
                except Exception:  # noqa: BLE001
                    pass
        previous(etype, value, tb)

    sys.excepthook = hook


_FORKED: list = []      # (a forked child) the parent's communicators, kept alive


def _after_fork() -> None:
    """(``os.register_at_fork``, in a forked child: a DataLoader worker, a plain
    ``os.fork()``) Every communicator the child inherited is its parent's — the same rank
    — and the parent goes on using it: in the child each one is poisoned here without a
    word to the peers, so a call raises ``CommunicatorClosed`` at once instead of speaking
    for the parent's rank next to it, and nothing the child does at its end (an unhandled
    exception's hook, close(), the exit handler) tells the peers anything or releases the
    transports, the board or the segments under the parent.  (The child must still end
    with ``os._exit``, as MPI requires of it — a normal exit runs MPI_Finalize — and so
    that interpreter shutdown deallocates no pyverbs object of the parent's context.)"""
    child = os.getpid()
    for c in list(_LIVE):
        _LIVE.discard(c)
        _FORKED.append(c)   # never collected here: pyverbs' dealloc of its queue pairs
        c._forked = True    # would destroy the parent's (one verbs context, one file)
        eng = getattr(c, "engine", None)
        if eng is None:
            continue
        eng.on_poison = eng.on_stopped = None       # (tell nobody)
        for t in getattr(c, "_transports", ()):
            forget = getattr(t, "forget_in_child", None)
            if forget is not None:  # (its copies of the parent's sockets: they held the
                try:                # connections open after the parent died)
                    forget()
                except Exception:  # noqa: BLE001 - a child's tidying must not fail it
                    pass
        eng.busy = eng.owner = 0    # (threads in calls stayed in the parent)
        eng.lent = False
        if eng.poisoned is None:
            eng.poison(CommunicatorClosed(
                f"rank {c.rank}: this communicator belongs to process {c._pid}, not to "
                f"this forked child (pid {child}): the parent goes on using it as rank "
                f"{c.rank}. Make gpurt calls in the parent (a worker process cannot "
                f"share its parent's rank)"))


os.register_at_fork(after_in_child=_after_fork)


_EXITING = False     # the interpreter is exiting: close() comes from _close_all


@atexit.register
def _close_all() -> None:  # runs before mpi4py's own finalisation (registered earlier)
    global _EXITING
    _EXITING = True
    for c in list(_LIVE):
        c.close()
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or _FORKED or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    _tidy_arrivals()
    import mpi4py
    ours = _MPI_OURS == os.getpid()     # (not in a forked child: the parent's MPI)
    mpi4pys = getattr(mpi4py.rc, "initialize", True) and \
        getattr(mpi4py.rc, "finalize", None) is not False
    if _dying_of_a_failure() and (ours or mpi4pys):
        _finalize_bounded(MPI)
        return
    gone = _failed_with_a_peer_gone()
    if gone and (ours or mpi4pys):
        _finalize_bounded(MPI, why=f"this job failed and {gone} has exited")
    elif _LEFT_ARRIVALS and _executor.JOB_FAILED is not None and (ours or mpi4pys) and \
            not (hasattr(sys, "ps1") or sys.flags.interactive):
        # (a creation this process gave up on a rank that has not come to it yet: that
        # rank may never come to MPI_Finalize either — stuck, asleep — and the program,
        # which caught the CollectiveTimeout, would wait there for it for ever)
        _finalize_bounded(MPI, why="a communicator's creation timed out waiting for a "
                                   "rank")
    elif ours:
        MPI.Finalize()


def _failed_with_a_peer_gone() -> str:
    """At a normal exit (or the program's own exception): where this process has seen the
    job fail (``JOB_FAILED``) and a rank of its node whose process has exited since —
    killed, or ended without MPI_Finalize — "rank's pid N" (else ""): MPI_Finalize waits
    for that rank for ever (a survivor that caught the PeerFailure and ended normally
    stayed alive with the job, -disable-auto-cleanup or a launcher that does not end a
    job when one rank dies).  A rank on another node cannot be told apart from one that
    only closed its communicators, and is not looked for.  (A rank that has exited after
    its own MPI_Finalize does not hold this one's: the bound is then never reached.)"""
    if _executor.JOB_FAILED is None or hasattr(sys, "ps1") or sys.flags.interactive:
        return ""
    try:
        from gpurt.transports.shm import _procs
        now = time.monotonic()
        for pid, proc in list(_procs.items()):
            if proc.state(now) == "gone":
                return f"a rank of this node (pid {pid})"
    except Exception:  # noqa: BLE001 - on the way out: finalize as usual
        pass
    return ""


def _dying_of_a_failure() -> bool:
    """Does this process end on an unhandled gpurt failure (a timeout, a failed peer, a
    mismatch: the job has failed, and a peer may never come to MPI_Finalize)?  Or on any
    unhandled exception after such a failure had poisoned one of its communicators (the
    program caught the PeerFailure, then died of something else: MPI_Finalize waited for
    the failed peer for ever — a stopped one never comes).  Not in an interactive session,
    whose shown errors also leave ``sys.last_value``; not for the program's own exceptions
    in a job that has not failed (the other ranks may still have work to finish, a
    checkpoint to write: MPI_Finalize waits for them as before)."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return False
    dying = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return isinstance(dying, GpurtError) or (dying is not None and
                                             _executor.JOB_FAILED is not None)


def _finalize_bounded(MPI, code: int = 1,
                      why: str = "this process's unhandled exception") -> None:
    """MPI_Finalize for a process that dies of an unhandled gpurt failure, at most
    max(2 s, GPURT_PEER_STOPPED) long: MPICH's waits for every rank, and a rank that
    never comes to it (asleep, computing, stuck outside gpurt) kept this one — whose
    collective timed out or whose peer failed — alive with it, and the job with them
    (``gpurt launch`` stops a job once a rank has exited).  Past that bound the process
    leaves without it, with the status Python gives an unhandled exception (1), and the
    process manager ends the job.  Also at a normal exit after the job failed where a
    rank of the node has exited (``_failed_with_a_peer_gone``; ``why`` says so): the
    status is then 1 too, whatever the program's would have been (Python's own exit code
    is out of reach here), since the job has lost a rank."""
    grace = max(2.0, float(config.get("GPURT_PEER_STOPPED")))
    if not math.isfinite(grace):        # (GPURT_PEER_STOPPED=inf: wait as long as it takes)
        MPI.Finalize()
        return
    done = threading.Event()
    try:
        who = f"rank {MPI.COMM_WORLD.Get_rank()} of MPI_COMM_WORLD (pid {os.getpid()})"
    except Exception:  # noqa: BLE001
        who = f"pid {os.getpid()}"

    def watchdog() -> None:
        if done.wait(grace):
            return
        try:
            sys.stderr.write(f"gpurt: {who}: MPI_Finalize still waits {grace:g} s "
                             f"after {why} (some rank has not come to it): leaving "
                             f"without it, so that the job ends (exit status {code})\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(code)

    threading.Thread(target=watchdog, name="gpurt-finalize-watchdog", daemon=True).start()
    try:
        # through ctypes, which lets go of the GIL (mpi4py's Finalize holds it: the
        # watchdog could not run until the late rank came), on the library mpi4py loaded
        fin = _libmpi_finalize()
        if fin is not None:
            fin()
        else:
            MPI.Finalize()
    finally:
        done.set()


def _libmpi_finalize():
    """``MPI_Finalize`` of the MPI library already loaded in this process (as a ctypes
    function: called without the GIL), or None where it cannot be found."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libmpi" in line}
        for path in sorted(paths):
            if os.path.basename(path).startswith(("libmpi.so", "libmpi_")):
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                fn = lib.MPI_Finalize
                fn.restype, fn.argtypes = ctypes.c_int, []
                return fn
    except (OSError, AttributeError):
        pass
    return None
