"""Runs schedules on real buffers through endpoints; requests, progress and deadlines.

The executor is a single-threaded progress engine per communicator: nothing moves
unless a gpurt call (a blocking collective, ``Request.wait`` or ``Request.test``) drives
it, and every drive advances *all* outstanding work of the communicator, so a rank that
waits on one request keeps feeding the peers of the others.

Collectives run one at a time per communicator, in call order (on lane 0), so every rank
posts their messages in the same order; point-to-point requests (lane 1) run beside them.
A step of a schedule is started by running its local ops, then posting its sends and
receives; it ends when they have all completed (see ``gpurt.schedule``).

A failure inside a transfer (a mismatched message, a dead peer) leaves the rings in an
unknown state, so it *poisons* the engine: the request raises, and every later call on
the communicator raises at once.
"""

from __future__ import annotations

import copy
import datetime
import threading
import time
import weakref
from collections import deque
from typing import Callable

import numpy as np

from . import memcopy
from .errors import (CollectiveMismatchError, CollectiveTimeout, CommunicatorClosed, GpurtError,
                     PeerFailure, TransportError)
from .schedule import Copy, Recv, Schedule, Send, Slice
from .wait import Backoff

_U8 = np.dtype(np.uint8)


def check_timeout(timeout) -> float | None:
    """``timeout=`` as given by a user: None, a number of seconds >= 0, or a
    ``datetime.timedelta`` (as torch.distributed takes it).  A string or a bool is
    refused, not read as a number: ``"5"`` is most likely an unparsed option."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    try:
        if isinstance(timeout, (str, bytes, bytearray, bool)):
            raise TypeError
        t = float(timeout)
    except (TypeError, ValueError, OverflowError):   # (10**400: too large for a float)
        raise ValueError(f"timeout must be a number of seconds, a datetime.timedelta or "
                         f"None, got {timeout!r}") from None
    if not t >= 0:  # also rejects NaN
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
    return t


class _CopySink:
    """Receives a plain message: chunks are copied into ``dst``; a transport that can
    write into ``dst`` itself (single-copy) uses it directly."""

    __slots__ = ("dst",)

    def __init__(self, dst: np.ndarray):
        self.dst = dst

    def __call__(self, off: int, chunk: np.ndarray) -> None:
        self.dst[off:off + chunk.nbytes] = chunk


class _ArraySink(_CopySink):
    """A ``_CopySink`` into a C-contiguous array, whose flat byte view (``dst``) is made
    only when a chunk or a single-copy read needs it: a quick receive read by the
    compiled ring end never does (the view is ~0.8 µs of its posting)."""

    __slots__ = ("arr", "_dst")

    def __init__(self, arr: np.ndarray):
        self.arr, self._dst = arr, None

    @property
    def dst(self) -> np.ndarray:    # (shadows _CopySink's slot, which stays unused)
        d = self._dst
        if d is None:
            d = self._dst = self.arr.reshape(-1).view(np.uint8)
        return d


class P2PRun:
    """A host point-to-point request's run: its one send or receive on the p2p lane —
    what a ``_Run`` of the one-step schedule does, without building the schedule, the
    buffer table and the step list for each message (about a third of a small
    ``send``/``recv``'s Python)."""

    __slots__ = ("ep", "send", "arr", "lane", "tag", "sig", "pending", "k", "peer")

    def __init__(self, ep, send: bool, arr: np.ndarray, lane: int, tag: int, sig: int,
                 peer: int):
        self.ep, self.send, self.arr, self.peer = ep, send, arr, peer
        self.lane, self.tag, self.sig = lane, tag, sig
        self.pending: list = []
        self.k = 0

    def advance(self) -> bool:
        if self.k:
            if self.pending and self.pending[0].test():
                self.pending = []
                return True
            return False
        self.k = 1
        a = self.arr
        if self.send:
            c = self.ep.send(a, self.lane, self.tag, self.sig)
        else:
            c = self.ep.recv(a.nbytes, _CopySink(a), self.lane, self.tag, self.sig)
            if getattr(c, "remote", 0):
                # a single-copy message (shm) is read by the waits, not here: the
                # caller's next call may be the send its peer waits for (irecv, then
                # isend), whose copy should then run beside this one, not after it
                self.pending = [c]
                return True
        if not c.test():
            self.pending = [c]
        return True

    @property
    def done(self) -> bool:
        return self.k and not self.pending

    def waiting_on(self) -> list[int]:
        return [self.peer] if self.pending and not self.pending[0].done else []


class QuickRecv(P2PRun):
    """A host receive that ``Communicator.irecv``'s quick path posted before its message
    (or all of its chunks) arrived: its message record is queued on the shm ring like any
    receive's (so later receives from that peer queue behind it), and while it is the
    ring's next message, the compiled ring end reads its next chunks when they are exactly
    this receive's (``_fastboard.P2PRing.get``, from the record's offset on, which the
    Python protocol also keeps), or the whole message single-copy; anything else — a
    mismatch, a single-copy message from a shared array or one the Python protocol took
    up first — is the general run's ``_Msg.test``, which raises the errors."""

    __slots__ = ("fast", "out", "spin")

    def __init__(self, ep, m, fast, out: np.ndarray, spin: int, peer: int):
        self.ep, self.send, self.arr, self.peer = ep, False, out, peer
        self.lane, self.tag, self.sig = m.lane, m.tag, m.sig
        self.pending, self.k = [m], 1
        self.fast, self.out, self.spin = fast, out, spin

    def quick(self, spin: int) -> int:
        """The compiled read of the message's next chunks (waiting up to ``spin`` ns for
        each): 1 done, 2 some chunks read (not done), 0 none there yet, -1 for the general
        run (never raises)."""
        m = self.pending[0] if self.pending else None
        if m is None or m.done or m.remote:
            return -1
        ring = m.ring
        if not ring.queue or ring.queue[0] is not m:
            return -1
        old, fast = ring.count, self.fast
        reads = fast.reads
        c = fast.get(self.out, m.total, m.tag, m.sig, spin, m.off)
        if c <= 0:
            return c
        ring.count = ring.seen = c
        if fast.reads != reads:
            m.off = m.total     # a single-copy message, read whole and acknowledged
        else:
            m.off = min(m.total, m.off + (c - old) * ring.slot)
        if m.off < m.total:
            return 2
        ring.queue.popleft()
        m.done, m.sink = True, None
        self.pending = []
        return 1

    def advance(self) -> bool:
        if not self.pending:
            return False
        c = self.quick(0)
        if c >= 0:
            return c > 0
        if self.pending[0].test():
            self.pending = []
            return True
        return False


class _Run:
    """One schedule executing on bound buffers."""

    __slots__ = ("steps", "k", "pending", "bufs", "alias", "red", "eps", "lane", "tag", "sig",
                 "isz", "dtype", "dev")

    def __init__(self, sched: Schedule, bufs: dict[str, np.ndarray], alias: bool,
                 red: Callable | None, eps: dict, lane: int, tag: int, sig: int,
                 dev=None, dtype: np.dtype | None = None):
        self.steps, self.k, self.pending = sched.split_steps, 0, []
        self.bufs, self.alias, self.red, self.eps = bufs, alias, red, eps
        self.lane, self.tag, self.sig = lane, tag, sig
        #: device memory: a ``gpurt.devpath.DevCtx`` (its copy, reduce and stream); the
        #: buffers are then device views and the endpoints device endpoints
        self.dev = dev
        self.dtype = dtype if dtype is not None else next(iter(bufs.values())).dtype
        self.isz = self.dtype.itemsize

    def view(self, s: Slice) -> np.ndarray:
        return self.bufs[s.buf][s.off:s.off + s.n]

    def _ep(self, peer: int):
        try:
            return self.eps[peer]
        except KeyError:
            raise TransportError(f"no endpoint to rank {peer}") from None

    def _sink(self, op) -> Callable[[int, np.ndarray], None]:
        dst = self.view(op.dst)
        if self.dev is not None:
            if isinstance(op, Recv):
                return self.dev.sink(dst, None, True)
            return self.dev.sink(dst, self.view(op.acc) if op.acc is not None else None, False)
        if isinstance(op, Recv):
            return _CopySink(dst.view(_U8))
        acc = self.view(op.acc) if op.acc is not None else dst
        red, isz, dt = self.red, self.isz, self.dtype

        def reduce(off: int, chunk: np.ndarray) -> None:
            e0 = off // isz
            e1 = e0 + chunk.nbytes // isz
            red(acc[e0:e1], chunk.view(dt), dst[e0:e1])

        return reduce

    def _start_step(self) -> None:
        if self.dev is not None:
            return self._start_device_step()
        local, comm = self.steps[self.k]
        self.k += 1
        bufs = self.bufs
        for op in local:
            src, dst = op.src, op.dst
            d = bufs[dst.buf][dst.off:dst.off + dst.n]
            if type(op) is Copy:
                if self.alias and src.off == dst.off and src.buf != dst.buf and \
                        src.buf != "tmp" and dst.buf != "tmp":
                    continue  # in place: in and out are the same memory
                memcopy.copyto(d, bufs[src.buf][src.off:src.off + src.n])
            else:
                acc = op.acc
                self.red(d if acc is None else bufs[acc.buf][acc.off:acc.off + acc.n],
                         bufs[src.buf][src.off:src.off + src.n], d)
        pend = self.pending
        eps, lane, tag, sig, isz = self.eps, self.lane, self.tag, self.sig, self.isz
        for op in comm:
            ep = eps.get(op.peer)
            if ep is None:
                self._ep(op.peer)
            if type(op) is Send:
                s = op.src
                pend.append(ep.send(bufs[s.buf][s.off:s.off + s.n].view(_U8), lane, tag, sig))
            elif type(op) is Recv and op.upto:
                pend.append(ep.recv(op.dst.n * isz, self._sink(op), lane, tag, sig, upto=True))
            else:
                pend.append(ep.recv(op.dst.n * isz, self._sink(op), lane, tag, sig))

    def _start_device_step(self) -> None:
        """The same step on device memory: local copies and reductions are queued on the
        call's stream; device endpoints order their transfers after them (events)."""
        local, comm = self.steps[self.k]
        self.k += 1
        dev, view = self.dev, self.view
        for op in local:
            src, dst = op.src, op.dst
            if type(op) is Copy:
                if self.alias and src.off == dst.off and src.buf != dst.buf and \
                        src.buf != "tmp" and dst.buf != "tmp":
                    continue
                dev.copy(view(dst), view(src))
            else:
                d = view(dst)
                dev.reduce(d if op.acc is None else view(op.acc), view(src), d)
        pend, eps, stream = self.pending, self.eps, dev.stream
        lane, tag, sig, isz = self.lane, self.tag, self.sig, self.isz
        for op in comm:
            ep = eps.get(op.peer)
            if ep is None:
                self._ep(op.peer)
            if type(op) is Send:
                pend.append(ep.send(dev.u8(view(op.src)), lane, tag, sig, stream))
            else:
                pend.append(ep.recv(op.dst.n * isz, self._sink(op), lane, tag, sig, stream))

    def advance(self) -> bool:
        """Move as far as possible without blocking; True if anything happened."""
        moved = False
        while True:
            if self.pending:
                self.pending = [c for c in self.pending if not c.test()]
                if self.pending:
                    return moved
                moved = True
            if self.k >= len(self.steps):
                return moved
            self._start_step()
            moved = True

    @property
    def done(self) -> bool:
        return self.k >= len(self.steps) and not self.pending

    def waiting_on(self) -> list[int]:
        """The peers of the transfers not complete yet.  ``pending`` is pruned only by
        ``advance``; a transfer that finished since (a transport's ``select`` sleeper reads
        what arrives while the loop waits) is owed nothing more: asking its peer's
        endpoint about liveness would turn a peer that sent its part and then exited
        (a normal end of a program) into a ``PeerFailure`` of a call it completed for us."""
        return sorted({c.peer for c in self.pending if not c.done})


class RowsRun(_Run):
    """An exchange that gathers one row per rank (the agreement check's headers) where a
    receive may bring several ranks' rows at once (``covers[peer]``: the ranks whose rows
    the receive from ``peer`` brings; one receive per peer).  Times out naming the ranks
    whose rows the step under way waits for (``missing``), not only the peers it
    receives from — those stay what liveness is asked of (``waiting_on``)."""

    __slots__ = ("covers", "recvs")

    def __init__(self, sched: Schedule, bufs: dict[str, np.ndarray], eps: dict, tag: int,
                 sig: int, covers: dict[int, tuple[int, ...]]):
        super().__init__(sched, bufs, False, None, eps, 0, tag, sig,
                         dtype=np.dtype(np.uint64))
        self.covers = covers
        self.recvs: list = []       # (completion, peer) of the current step's receives

    def _start_step(self) -> None:
        k = self.k
        super()._start_step()
        # (a step starts only once the last one's transfers are all complete: pending
        # holds this step's, in the order of its operations)
        comm = self.steps[k][1]
        self.recvs = [(c, op.peer) for c, op in zip(self.pending, comm) if type(op) is Recv]

    def missing(self) -> list[int]:
        """The ranks whose rows the receives of the step under way still wait for (those
        of later steps wait on these: naming them too would blame ranks that did call,
        and whose rows are held up by the ones named); else the peers of its sends."""
        ranks: set[int] = set()
        for c, q in self.recvs:
            if not c.done:
                ranks.update(self.covers[q])
        return sorted(ranks) if ranks else self.waiting_on()


class Chain:
    """Runs one run, then the next (built only when the first is done): the agreement
    check before a schedule."""

    __slots__ = ("first", "make_next", "second")

    def __init__(self, first, make_next: Callable[[], "_Run | None"]):
        self.first, self.make_next, self.second = first, make_next, None

    def advance(self) -> bool:
        if not self.first.done:
            moved = self.first.advance()
            if not self.first.done:
                return moved
            self.second = self.make_next()
            if self.second is None:
                return True
            return self.second.advance() or True
        return self.second.advance() if self.second is not None else False

    @property
    def done(self) -> bool:
        return self.first.done and (self.second is None or self.second.done)

    def waiting_on(self) -> list[int]:
        if not self.first.done:
            return self.first.waiting_on()
        return self.second.waiting_on() if self.second is not None else []

    def missing(self) -> list[int]:
        return _missing(self.current())

    def current(self):
        return self.first if not self.first.done else self.second


def _missing(run) -> list[int]:
    """The ranks a run that timed out names: those whose part has not arrived
    (``missing``, where a run knows more than the peers it waits on), else the peers of
    its transfers not complete yet — less those held up by this rank's own device stream
    (``_local``: their peers wait for this rank, not it for them)."""
    if run is None:
        return []
    m = getattr(run, "missing", None)
    if m is not None:
        return m()
    local = _local(run)
    return [q for q in run.waiting_on() if q not in local]


def _local(run) -> set[int]:
    """The peers of a run's transfers that wait on this rank's own device stream (a device
    completion's ``local()``: work queued there before the call has not finished)."""
    out: set[int] = set()
    if type(run) is Chain:
        run = run.current()
    for c in getattr(run, "pending", None) or ():
        f = getattr(c, "local", None)
        if f is not None and not c.done and f():
            out.add(c.peer)
    return out


def _own(exc: BaseException) -> BaseException:
    """The engine's failure as one pending request's error: a new exception of the same
    class, text and attributes (a ``PeerFailure``'s rank, a timeout's missing ranks),
    caused by the failure itself (``__cause__``: its traceback is where it happened).  A
    fresh object, because every request still pending gets one, and the waits that raise
    them — in other threads too — would otherwise raise one object, each raise extending
    the traceback that the others print.  The failure itself where it cannot be copied."""
    try:
        c = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception class that cannot be rebuilt
        return exc
    if type(c) is not type(exc) or c.args != exc.args:
        return exc
    c.__cause__ = exc
    return c


class Request:
    """A collective or point-to-point operation in flight.

    ``wait(timeout=None)`` blocks until it completes and returns its result;
    ``test()`` advances it without blocking and says whether it has completed.  A
    ``wait`` that times out raises ``CollectiveTimeout`` and leaves the request in
    flight (wait again, or ``comm.abort()``); a blocking collective that times out
    poisons its communicator, since its messages are half sent.
    """

    #: the host arrays it reads or writes while in flight, as (array, writes) pairs, where
    #: no ``P2PRun`` or ``coll_bufs`` says (a general-path send or receive); ``spans``: the
    #: same as (first byte, end, writes, array), once a call compared its buffers with
    #: them (``comm._spans``, ``Communicator._clash``)
    held: "tuple | None" = None
    spans: "tuple | None" = None
    #: (a host collective) (coll, x's Buf, out's Buf, root, rank), ``held`` derived from
    #: it only where a call compares (``comm._coll_held``)
    coll_bufs: "tuple | None" = None

    def __init__(self, engine: "Engine", name: str, seq: int, start: Callable[[], _Run | None],
                 finish: Callable[[], object] | None = None, p2p: bool = False):
        self.engine, self.name, self.seq = engine, name, seq
        self._start, self._finish, self.p2p = start, finish, p2p
        self.run: _Run | None = None
        self.done = False
        self.result: object = None
        self.error: BaseException | None = None

    def _begin(self) -> None:
        self.run = self._start()
        self._start = None
        if self.run is None or self.run.done:
            self._complete()

    def _complete(self) -> None:
        if self._finish is not None:
            self.result = self._finish()
        self.done, self.run, self._finish = True, None, None

    def test(self) -> bool:
        # (while another thread is in a call it only reports: advancing would be two
        # threads at once.  A thread polling test() while another makes calls is still
        # two threads using one communicator, and may meet that error between calls)
        if not self.done and not self.engine.other_thread():
            eng = self.engine
            if not eng.progress() and not self.done:
                if _LIVE_ENGINES > 1:
                    # polled in a loop, test() also advances this thread's other
                    # communicators (as a held-up wait does: Engine.lend), at most every
                    # 50 us
                    now = time.perf_counter()
                    if now >= eng.lend_at:
                        eng.lend_at = now + 5e-5
                        eng.lend()
                if self.error is None:
                    eng.poll_liveness(self)
        if self.error is not None:
            self.engine.wait_told()
            raise self.error
        return self.done

    def wait(self, timeout: float | None = None):
        run = self.run
        if type(run) is QuickRecv and timeout is None and self.error is None:
            # a quick receive's wait: the compiled ring end spins for its message first
            eng = self.engine
            me = threading.get_ident()
            if not (eng.busy or eng.owner or eng.poisoned is not None):
                eng.busy = me       # (a test and set, as in Engine.enter)
                try:
                    if eng.poisoned is None and run.quick(run.spin) == 1:
                        self._complete()
                        try:
                            eng.p2p.remove(self)
                        except ValueError:
                            pass
                        return self.result
                except BaseException as e:
                    # (a Ctrl-C with the message half taken: unusable, as after any
                    # failure inside a transfer)
                    eng.poison(e)
                    raise
                finally:
                    eng.leave(0)
        try:
            t = check_timeout(timeout)
        except ValueError as e:
            raise ValueError(f"rank {self.engine.rank}: {e}") from None
        self.engine.wait(self, t)
        return self.result

    def __repr__(self) -> str:
        state = "done" if self.done else "in flight"
        return f"<gpurt.Request {self.name} #{self.seq} {state}>"


class Completed(Request):
    """A point-to-point request that completed as it was posted (a quick send, or a
    receive whose message was there): a Request whose state is its class's."""

    done, p2p, algorithm = True, True, "p2p"
    _start = _finish = run = error = None

    def __init__(self, engine: "Engine", name: str, seq: int, result: object):
        self.engine, self.name, self.seq, self.result = engine, name, seq, result


#: every engine of this process: a wait that stalls advances the others too (``lend``)
_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
#: how many of them are not poisoned (closed): lend only where there is another
_LIVE_ENGINES = 0


def _why(exc: BaseException | None) -> str:
    """A poisoning exception in words: its text, or its class where it has none (a
    KeyboardInterrupt left 'unusable after an earlier failure: ' with nothing after)."""
    text = str(exc)
    return text if text else type(exc).__name__


def progress_elsewhere(exclude: "Engine | None" = None) -> bool:
    """Advance every engine of this process (but ``exclude``) that this thread last used,
    that no thread is in now and that has requests in flight: ``Engine.lend``'s pass, and
    the one a blocking control-plane exchange (a communicator's creation, split, dup)
    makes while it waits, so that requests its peers wait on still move.  A failure there
    is that engine's: its requests carry it.  True if anything moved."""
    me, moved = threading.get_ident(), False
    try:
        engines = list(_ENGINES)
    except RuntimeError:    # (another thread made a communicator meanwhile: next time)
        return False
    for eng in engines:
        if eng is exclude or eng.user != me or eng.poisoned is not None or \
                not (eng.colls or eng.p2p):
            continue
        # (test and set, as in enter)
        if eng.busy or eng.owner:
            continue
        eng.busy, eng.lent = me, True
        try:
            if eng.progress():
                moved = True
        except Exception:  # noqa: BLE001 - poisoned that engine; its requests say why
            pass
        finally:
            try:
                eng.leave(0)    # (busy cleared first: a thread that came in meanwhile
            finally:            # waited for this, and finds the engine free; lent is
                eng.lent = False    # cleared even if on_stopped is interrupted)
    return moved


def wait_mpi(req, spin: float = 0.0, check: Callable[[], None] | None = None) -> None:
    """Wait for the MPI request ``req`` (a control-plane exchange) while advancing this
    thread's gpurt requests on every communicator (``progress_elsewhere``): a rank that
    enters ``split`` with an ``isend`` in flight still delivers it to a peer that
    receives it before its own ``split`` (MPI's progress rule; the blocking exchange
    left the receiver waiting until its deadline and the sender in MPI for ever).
    Reads no setting (``spin`` given, not GPURT_SPIN_US): a rank whose settings are not
    valid must reach the creation's exchange that tells every rank so.  ``check`` (a
    split's or dup's, every 20 ms: ``Communicator._ctl_watch``) raises where a peer
    failed, refused or left the exchange, or this rank's deadline or abort came."""
    backoff = None
    check_at = 0.0
    while not req.Test():
        if check is not None:
            now = time.monotonic()
            if now >= check_at:
                check()
                check_at = now + 0.02
        if _LIVE_ENGINES and progress_elsewhere():
            if backoff is not None:
                backoff.reset()
            continue
        if backoff is None:
            backoff = Backoff(spin)
        backoff.pause()


#: the first failure of the job that poisoned an engine of this process (a failed peer,
#: a timeout, a mismatch, a transport's error; not a close or a Ctrl-C): the process
#: dying later of any unhandled exception leaves MPI_Finalize bounded
#: (``comm._dying_of_a_failure``), since a peer may never come to it
JOB_FAILED: "BaseException | None" = None


def _count_engine(k: int) -> None:
    global _LIVE_ENGINES
    _LIVE_ENGINES += k


class Engine:
    """Progress for one communicator: a queue of collectives and a set of p2p requests."""

    def __init__(self, rank: int, default_timeout: Callable[[], float],
                 check_peers: Callable[[list[int], bool], None], spin: float | None = None):
        self.rank, self.spin = rank, spin
        #: blocks up to the given seconds until a transport has something (select on its
        #: sockets); None: plain sleep
        self.sleeper: Callable[[float], None] | None = None
        self.on_poison: Callable[[BaseException], None] | None = None
        self.colls: deque[Request] = deque()
        self.p2p: list[Request] = []
        self.poisoned: BaseException | None = None
        #: set once the peers have been told of the poison (or there was nothing to tell):
        #: no caller has its buffers back before (``wait_told``) — a thread that saw the
        #: poison set by another thread's abort() could otherwise return while that thread
        #: has not yet published, and a peer still reading this rank's buffers in place
        #: would take what the program writes there next
        self.told = threading.Event()
        self.teller = 0         # the thread that poisoned the engine (it tells)
        self._timeout = default_timeout
        self._check_peers = check_peers
        #: the thread advancing a run right now (0: none) — a run may be storing into
        #: the peers' buffers, so another thread's abort() must not tell the peers that
        #: this rank is out of them before it stopped (``Communicator._on_poison``)
        self.busy = 0
        #: the thread in a blocking call (a Request's wait: ``claim``), 0 if none
        self.owner = 0
        #: held by another thread's abort()/close() while it decides to defer its telling
        #: to the advancing thread, and by that thread while it takes the task over
        #: (re-entrant: a signal handler's close() may come in while this thread holds it)
        self.lock = threading.RLock()
        #: called in the advancing thread when it stops with the engine poisoned meanwhile
        self.on_stopped: Callable[[], None] | None = None
        #: the thread that last came into a call on this engine (``enter``/``claim``): a
        #: stalled wait of that thread on another engine advances this one (``lend``)
        self.user = 0
        #: ``busy`` is held by another engine's stalled wait advancing this one in passing
        #: (``lend``): a thread that comes in meanwhile waits a moment, it is no error
        self.lent = False
        self.lend_at = 0.0          # (Request.test: when it may lend next)
        self.check_at = 0.0         # (Request.test: when it may ask the peers' liveness next)
        _ENGINES.add(self)
        _count_engine(1)

    def enter(self) -> int:
        """This thread advances a run from here until ``leave`` (nests in one thread).  A
        second thread that comes in while another advances a run — two threads using one
        communicator at once, which it does not support — poisons the engine (as an
        abort() from another thread would: the first thread's call is interrupted, the
        peers are told once it stopped) and raises, instead of both moving the same
        transports.  The caller must not advance anything if the engine is poisoned once
        this returned: another thread's abort() may have seen ``busy`` still clear and told
        the peers itself."""
        me = threading.get_ident()
        while True:
            # (a test and set: between the load and the store nothing can switch threads
            # under the GIL — no call, no backward jump, no allocation; a lock here cost
            # ~0.5 us per call on this machine, a tenth of a small collective)
            prev = self.busy
            if prev == me:
                return me
            if prev and self.lent:      # another thread's wait advances it in passing
                time.sleep(0)
                continue
            if prev or (self.owner and self.owner != me):
                raise self._two_threads(prev or self.owner)
            self.busy = me
            return 0

    def claim(self) -> int:
        """This thread is in a call from here until ``unclaim`` — all of a Request's wait,
        sleeps between its steps included (``enter`` marks only the advancing); another
        thread's ``enter``, ``claim`` or ``check_thread`` meanwhile is the error above."""
        me = threading.get_ident()
        while True:
            prev = self.owner               # (a test and set, as in enter)
            if prev == me:
                return me
            if not prev and self.lent and self.busy and self.busy != me:   # (see enter)
                time.sleep(0)
                continue
            if prev or (self.busy and self.busy != me):
                raise self._two_threads(prev or self.busy)
            self.owner = self.user = me
            return 0

    def unclaim(self, prev: int) -> None:
        if self.owner == threading.get_ident():
            self.owner = prev

    def check_thread(self) -> None:
        """At a call's start, before it counts: another thread in a call is the error of
        ``enter`` (here no state of the call has changed yet; ``enter`` is the exact test
        and set)."""
        other = self.other_thread()
        if other:
            raise self._two_threads(other)

    def _two_threads(self, other: int) -> GpurtError:
        names = {t.ident: t.name for t in threading.enumerate()}
        exc = GpurtError(
            f"rank {self.rank}: two threads used this communicator at once: thread "
            f"{names.get(threading.get_ident(), '?')!r} came into a call while thread "
            f"{names.get(other, other)!r} was still in one.  A communicator is not "
            f"thread-safe: give each thread its own (comm.dup()) or serialize the calls; "
            f"this one is unusable now")
        self.poison(exc)
        return exc

    def leave(self, prev: int) -> None:
        if self.busy == threading.get_ident():
            self.busy = prev
        # (busy is cleared before poisoned is read, and another thread sets poisoned before
        # it reads busy: either it saw this thread out and told the peers itself, or it
        # left that to on_stopped, which then sees the poison)
        if not prev and self.poisoned is not None:
            if self.on_stopped is not None:
                self.on_stopped()
            self.wait_told()

    def wait_told(self, bound: float = 10.0) -> None:
        """(Poisoned) Before this thread hands a caller its buffers back: wait, bounded,
        until the thread that poisoned the engine has told the peers (``told``)."""
        if self.poisoned is not None and not self.told.is_set() and \
                self.teller != threading.get_ident():
            self.told.wait(bound)

    def elsewhere(self) -> bool:
        """Another thread of this process is advancing a run now."""
        return self.busy != 0 and self.busy != threading.get_ident()

    def submit(self, req: Request) -> Request:
        self.raise_if_poisoned()
        prev = self.enter()     # (queued and begun by this thread alone: see enter)
        self.user = self.busy
        try:
            self.raise_if_poisoned()        # (read after enter(): see there)
            if req.p2p:
                req._begin()
                if not req.done:
                    self.p2p.append(req)
                    self._step(req)   # publish an isend now: the peer may be in a blocking call
            else:
                self.colls.append(req)
                if len(self.colls) == 1:
                    self._step_begin()
        finally:
            self.leave(prev)
        return req

    def submit_run(self, req: Request, run) -> Request:
        """``submit`` for a point-to-point request whose run is built already (a host
        ``P2PRun``): posted now, completed at once where the transport could (a message
        that fits the ring, one already here), else left in flight like any request."""
        if self.poisoned is not None:
            self.raise_if_poisoned()
        prev = self.enter()
        self.user = self.busy
        try:
            self.raise_if_poisoned()        # (read after enter(): see there)
            req.run, req._start = run, None
            self._step(req)
            if not req.done and req.error is None:
                self.p2p.append(req)
        finally:
            self.leave(prev)
        return req

    def other_thread(self) -> int:
        """The other thread in a call on this engine (advancing, or in a wait), or 0."""
        busy, owner = self.busy, self.owner
        if busy and self.lent:
            busy = 0            # (advanced in passing by another thread's wait: see enter)
        if not busy and not owner:
            return 0
        me = threading.get_ident()
        return busy if busy and busy != me else owner if owner and owner != me else 0

    def _begin_head(self) -> None:
        while self.colls:
            head = self.colls[0]
            if head.run is None and not head.done:
                head._begin()
            if not head.done:
                return
            self.colls.popleft()

    def raise_if_poisoned(self) -> None:
        if self.poisoned is not None:
            self.wait_told()
            raise CommunicatorClosed(f"rank {self.rank}: communicator unusable after an earlier "
                                     f"failure: {_why(self.poisoned)}") from self.poisoned

    def poison(self, exc: BaseException) -> None:
        if self.poisoned is None:
            global JOB_FAILED
            self.teller = threading.get_ident()
            self.poisoned = exc
            _count_engine(-1)
            if JOB_FAILED is None and isinstance(exc, GpurtError) and \
                    not isinstance(exc, CommunicatorClosed):
                JOB_FAILED = exc
            if self.on_poison is None:
                self.told.set()
            else:       # (it sets told once the peers know, or leaves that to on_stopped)
                try:
                    self.on_poison(exc)
                except Exception:  # noqa: BLE001 - reporting must not mask the failure
                    self.told.set()
                except BaseException:   # (a Ctrl-C while telling: nobody waits on it)
                    self.told.set()
                    raise
        for r in list(self.colls) + self.p2p:
            if not r.done and r.error is None:
                r.error = _own(exc)
        self.colls.clear()
        self.p2p = []

    def progress(self) -> bool:
        """Advance every outstanding request; True if anything moved.  A request that
        fails in the pass poisons the engine (``_step``, ``_step_begin``), and every
        Request still pending carries the error: a wait or test() raises it for its own
        request — never for one that completed earlier in the same pass, whose caller has
        its result."""
        if self.poisoned is not None:
            return False
        try:
            return self._progress()
        except Exception:
            if self.poisoned is None:       # (not a request's failure: raised as it is)
                raise
            return True

    def _progress(self) -> bool:
        moved = False
        while self.colls:
            try:
                head = self.colls[0]
            except IndexError:      # (cleared by another thread's abort(): poison)
                break
            if self._step(head):
                moved = True
            if not head.done:
                break
            try:
                self.colls.popleft()
            except IndexError:
                break
            self._step_begin()
            moved = True
        if self.p2p:
            for r in self.p2p:
                if self._step(r):
                    moved = True
            self.p2p = [r for r in self.p2p if not r.done]
        return moved

    def lend(self) -> bool:
        """(A wait on this engine that found nothing to do) Advance, in passing, the other
        engines of this process that this thread last used and no thread is in now — so
        that a rank waiting on one communicator still moves its requests on the others,
        which its peers may be waiting for (MPI's progress rule: ``qa = c1.iallreduce();
        qb = c2.iallreduce()`` waited in opposite orders on two ranks completes).  A
        failure there is that engine's: its requests carry it, this wait goes on.  True
        if anything moved."""
        return progress_elsewhere(self)

    def _step_begin(self) -> None:
        prev = self.enter()
        try:
            self._begin_head()
        except BaseException as e:
            self._fail(e, self.colls[0] if self.colls else None)
            raise
        finally:
            self.leave(prev)

    def _step(self, req: Request) -> bool:
        """Advance one request.  Any exception — a mismatch, a dead peer, but also a NumPy
        error or a KeyboardInterrupt in the middle of a transfer — leaves the transports in
        an unknown state: it poisons the engine, annotated with the request, and is raised."""
        run = req.run
        if run is None:
            return False
        prev = self.enter()
        try:
            if self.poisoned is not None:       # (read after enter(): see there)
                return False
            moved = run.advance()
            if run.done:
                req._complete()
            return moved
        except BaseException as e:
            if self._stopped_by_poison(e):
                # another thread's abort()/close(): the request ends with its error
                if req.error is None:
                    req.error = _own(self.poisoned)
                return True
            self._fail(e, req)
            raise
        finally:
            self.leave(prev)

    def _stopped_by_poison(self, e: BaseException) -> bool:
        """A run stopped (``CommunicatorClosed`` from it: a transport's "stopping", a
        released segment's) because another thread poisoned the engine meanwhile — or
        failed in any way once another thread had (its abort() ended a tcp stream this
        thread was writing, say): a consequence, not a failure of its own."""
        return self.poisoned is not None and self.poisoned is not e and (
            isinstance(e, CommunicatorClosed) or
            isinstance(e, GpurtError) and self.teller != threading.get_ident())

    def _fail(self, e: BaseException, req: Request | None) -> None:
        if isinstance(e, Exception):
            self._annotate(e, f"in {req.name} (call #{req.seq}): " if req is not None
                           and not req.p2p else f"in {req.name} (tag {req.seq}): " if req
                           is not None else "")
        self.poison(e)

    def _annotate(self, e: BaseException, where: str = "") -> None:
        prefix = f"rank {self.rank}: "
        if not isinstance(e, GpurtError):
            return  # keep foreign exceptions (NumPy's, KeyboardInterrupt) as they are
        if e.args and isinstance(e.args[0], str) and not e.args[0].startswith(prefix):
            text = e.args[0]
            if isinstance(e, PeerFailure) and e.rank == self.rank:
                # a rank the others gave up on hears it back relayed ("rank 0 failed:
                # PeerFailure[rank=1]: ..."): say plainly that it is the one blamed
                text = ("the other ranks declared this rank failed (it was stopped, hung "
                        "or cut off for longer than they wait for a rank), and the "
                        "communicator is poisoned; what they saw: " + text)
            e.args = (prefix + where + text,) + e.args[1:]

    def run_inline(self, run, name: str, seq: int, timeout: float | None,
                   said: float | None = None) -> None:
        """Drive one collective to completion right here — the blocking fast path, used
        only while no other collective is queued (so call order is kept) and without a
        ``Request``.  Same deadlines, liveness checks and poisoning as ``wait``."""
        prev = self.enter()
        self.user = self.busy
        try:
            if self.poisoned is not None:       # (read after enter(): see there)
                raise self._interrupted(name, seq) from self.poisoned
            if run.advance() and run.done:
                return
            # another thread's abort() (a watchdog's) or failure poisons the engine: the
            # wait ends there, as a Request's does (poison() sets its error)
            def timed_out(t: float, _peers: list[int]) -> CollectiveTimeout:
                missing = _missing(run)
                return CollectiveTimeout(
                    f"rank {self.rank}: {name} (call #{seq}) did not complete within "
                    f"{said if said is not None else t:g} s; still waiting for rank(s) "
                    f"{missing}", collective=name, seq=seq, missing=tuple(missing))

            self._drive(run.advance, lambda: run.done or self.poisoned is not None,
                        run.waiting_on, timeout, timed_out)
            if not run.done:
                raise self._interrupted(name, seq) from self.poisoned
        except BaseException as e:
            if self._stopped_by_poison(e):
                raise self._interrupted(name, seq) from self.poisoned
            self._annotate(e, f"in {name} (call #{seq}): ")
            self.poison(e)
            raise
        finally:
            self.leave(prev)

    def _interrupted(self, name: str, seq: int) -> CommunicatorClosed:
        return CommunicatorClosed(f"rank {self.rank}: {name} (call #{seq}) interrupted: "
                                  f"{_why(self.poisoned)}")

    def _drive(self, step: Callable[[], bool], finished: Callable[[], bool],
               waiting_on: Callable[[], list[int]], timeout: float | None,
               timed_out: Callable[[float, list[int]], BaseException],
               collective: Callable[[], bool] = lambda: True) -> None:
        """The one wait loop: ``step`` until ``finished``; spin, yield, then sleep while
        nothing moves (``wait.Backoff``); every 0.2 s ask the endpoints whether the peers
        still waited on are alive (``PeerFailure`` propagates) and raise ``timed_out``'s
        exception past the deadline — unless, in a collective (``collective()``), another
        peer has published a failure: it explains the wait better than the slow rank
        waited on (which may still come, and completes the call if the failed one had done
        its part: so only at the deadline)."""
        timeout = self._timeout() if timeout is None else float(timeout)
        start = time.monotonic()
        deadline = start + timeout
        next_check = start + min(0.2, timeout)
        backoff = None
        while True:
            moved = step()
            if finished():
                return
            if moved:
                if backoff is not None:
                    backoff.reset()
            else:
                if backoff is None:
                    backoff = Backoff(self.spin, self.sleeper)
                # past the spin phase (pause() yielded or slept), another live engine's
                # requests are advanced too: nothing while this wait spins on its own
                if backoff.pause() and _LIVE_ENGINES > 1 and self.lend():
                    backoff.reset()
            now = time.monotonic()
            if now >= next_check:
                next_check = min(now + 0.2, deadline)
                try:
                    self._check_peers(waiting_on(), now >= deadline and collective())
                except GpurtError as failed:
                    # what a peer published before it failed or left comes first: its
                    # rejection of the call (step raises the mismatch), or its part, which
                    # may complete the call (the last step could have run just before);
                    # any other error of that step is the failure's echo
                    try:
                        step()
                    except CollectiveMismatchError:
                        raise
                    except GpurtError:
                        raise failed from None
                    if finished():
                        return
                    raise
                if now >= deadline:
                    # who is missing now, then one last step: a part that came since the
                    # step above completes the call (a timeout of 0 s often finds it so:
                    # it named nobody); else the ranks named were missing at the deadline
                    exc = timed_out(timeout, waiting_on())
                    step()
                    if finished():
                        return
                    if not getattr(exc, "missing", True):
                        # (named nobody: a chain between its agreement and its data
                        # run, or transfers arrived but not yet cleared — the step just
                        # run moved past them: who is missing now; a bug hunt found
                        # "still waiting for rank(s) []")
                        exc = timed_out(timeout, waiting_on())
                    raise exc

    def pending_peers(self, naming: bool = False) -> list[int]:
        """The peers the runs in flight wait on (liveness is asked of them); ``naming``:
        the ranks a timeout names instead (``_missing``)."""
        peers: set[int] = set()
        for r in ([self.colls[0]] if self.colls else []) + self.p2p:
            if r.run is not None:
                peers.update(_missing(r.run) if naming else r.run.waiting_on())
        return sorted(peers)

    def wait(self, req: Request, timeout: float | None) -> None:
        if req.error is not None:
            self.wait_told()
            raise req.error
        if req.done:
            return
        self.raise_if_poisoned()
        held = self.claim()
        try:
            self._wait(req, timeout)
        finally:
            self.unclaim(held)

    def poll_liveness(self, req: Request) -> None:
        """``Request.test``'s share of a wait's liveness checks, at most every 0.2 s as in
        ``_drive``: a loop polling ``test()`` meets a peer that died, failed or froze as
        ``wait()`` would (``PeerFailure``, the communicator poisoned) — not never."""
        now = time.monotonic()
        if now < self.check_at:
            return
        self.check_at = now + 0.2
        try:
            self._check_peers(self.pending_peers(), False)
        except GpurtError as e:
            if self._stopped_by_poison(e):
                self.wait_told()
                raise (req.error or self.poisoned) from None
            self._annotate(e, self._where(req))
            self.poison(e)
            raise

    def _where(self, req: Request) -> str:
        """Where a failure the liveness checks found while ``req`` was waited for (or
        tested) struck: the collective in flight — the head of the queue, whichever
        request the program polled (it named the polled one: "in barrier (call #4)" for a
        failure in call #2) — else nothing more (point-to-point)."""
        head = self.colls[0] if self.colls else None
        return f"in {head.name} (call #{head.seq}): " if head is not None else ""

    def _wait(self, req: Request, timeout: float | None) -> None:
        def timed_out(t: float, _peers: list[int]) -> CollectiveTimeout:
            stuck = None if req.p2p or not self.colls or self.colls[0] is req else \
                self.colls[0]
            earlier = f" in the earlier {stuck.name} (call #{stuck.seq})" if stuck else ""
            # (a point-to-point request's number is its tag, not a call number: seq -1;
            # the attributes say where it stopped: the earlier call it queues behind)
            where = stuck or req
            # the ranks *that* run waits for (every request's in flight, before: a wait on
            # a receive from rank 2 named rank 1 too, whose receive was another request)
            missing = _missing(where.run) if where.run is not None else \
                self.pending_peers(naming=True)
            own = ""
            if where.run is not None and _local(where.run):
                own = (f"{' and ' if missing else ''}for this rank's own device stream "
                       f"(work queued on it before the call has not finished)")
            waits = f"for rank(s) {missing}" if missing or not own else ""
            return CollectiveTimeout(
                f"rank {self.rank}: {req.name} "
                f"({'tag ' if req.p2p else 'call #'}{req.seq}) did not complete within "
                f"{t:g} s; still waiting {waits}{own}{earlier}",
                collective=where.name, seq=-1 if req.p2p else where.seq,
                missing=tuple(missing))

        try:
            self._drive(self.progress, lambda: req.done or req.error is not None,
                        self.pending_peers, timeout, timed_out, lambda: bool(self.colls))
        except CollectiveTimeout:
            raise           # (the request stays in flight: wait again, or abort())
        except GpurtError as e:
            if self._stopped_by_poison(e):      # (another thread's abort() came first)
                self.wait_told()
                raise (req.error or self.poisoned) from None
            # a peer's failure from the liveness checks: PeerFailure, or what it published
            # as something else (a CollectiveMismatchError, errors.from_peer; a transport's
            # own TransportError)
            self._annotate(e, self._where(req))
            self.poison(e)
            raise
        except BaseException as e:
            # a KeyboardInterrupt in the middle of the wait (a liveness check may have been
            # writing): as in a blocking call, the communicator is done and the peers are
            # told (``run_inline``)
            if not self._stopped_by_poison(e):
                self.poison(e)
            raise
        if req.error is not None:   # (a failure in a progress pass: see progress)
            self.wait_told()
            raise req.error
