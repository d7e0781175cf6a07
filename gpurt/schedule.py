"""Schedules as data, and a symbolic simulator that proves them.

Vocabulary
----------
A *schedule* is what one rank does for one collective: a sequence of *steps*.
A step is a tuple of ops that may run at once.  Its semantics, shared by the
executor and the simulator:

1. the step's local ops (``Copy``, ``Reduce``) run first, in list order;
2. then every ``Send``/``Recv``/``RecvReduce`` of the step is posted;
3. the step ends when all of them have completed.

Messages between two ranks match in posting order (FIFO per ordered pair).
A ``Send`` reads its source during the step, so no op of the same step may
write what a ``Send`` reads (the simulator rejects such a *hazard*).

A ``Slice`` names a buffer *role* — ``"in"`` (the user's input, never written),
``"out"`` (the user's output) or ``"tmp"`` (scratch owned by the executor) —
with an offset and a length in *elements*, never a pointer, so schedules are
cacheable and checkable.  Schedules carry no reduction op: every reduction in
a collective uses the collective's op.  Peers are indices into the group the
algorithm was written for; ``Schedule.relabel`` maps them to communicator ranks.

The simulator (``simulate``) runs the schedules of all ranks without data: each
element holds the set of (rank, index) contributions it carries.  It checks
that sends and receives match in size, that nothing deadlocks under
rendezvous semantics (the strictest a transport may have), that no step has a
hazard, that ``in`` is never written, that no contribution is reduced twice,
and finally the postcondition of the collective, both with ``in`` and ``out``
as separate buffers and aliased (in-place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable, Sequence, Union

ROLES = ("in", "out", "tmp")


@dataclass(frozen=True)
class Slice:
    buf: str
    off: int
    n: int

    def __post_init__(self) -> None:
        if self.buf not in ROLES:
            raise ValueError(f"unknown buffer role {self.buf!r}")
        if self.off < 0 or self.n < 0:
            raise ValueError(f"negative slice {self}")

    @property
    def end(self) -> int:
        return self.off + self.n

    def sub(self, off: int, n: int) -> "Slice":
        return Slice(self.buf, self.off + off, n)


@dataclass(frozen=True)
class Send:
    peer: int
    src: Slice


@dataclass(frozen=True)
class Recv:
    """``upto``: the message may be shorter than ``dst`` (at most ``dst.n`` elements; the
    rest of ``dst`` keeps what it held) — the agreement check's messages, whose length
    depends on the call."""

    peer: int
    dst: Slice
    upto: bool = False


@dataclass(frozen=True)
class RecvReduce:
    """``dst = op(acc if acc else dst, incoming)`` as the data arrives."""

    peer: int
    dst: Slice
    acc: Slice | None = None


@dataclass(frozen=True)
class Copy:
    src: Slice
    dst: Slice


@dataclass(frozen=True)
class Reduce:
    """Local ``dst = op(acc if acc else dst, src)``."""

    src: Slice
    dst: Slice
    acc: Slice | None = None


Op = Union[Send, Recv, RecvReduce, Copy, Reduce]
COMM_OPS = (Send, Recv, RecvReduce)
LOCAL_OPS = (Copy, Reduce)


def _map_slice(s: Slice | None, mapping: dict[str, tuple[str, int]]) -> Slice | None:
    if s is None or s.buf not in mapping:
        return s
    role, off = mapping[s.buf]
    return Slice(role, s.off + off, s.n)


def _map_op(op: Op, peers: Callable[[int], int] | None,
            roles: dict[str, tuple[str, int]] | None) -> Op:
    m = roles or {}
    if isinstance(op, Send):
        return Send(peers(op.peer) if peers else op.peer, _map_slice(op.src, m))
    if isinstance(op, Recv):
        return Recv(peers(op.peer) if peers else op.peer, _map_slice(op.dst, m), op.upto)
    if isinstance(op, RecvReduce):
        return RecvReduce(peers(op.peer) if peers else op.peer,
                          _map_slice(op.dst, m), _map_slice(op.acc, m))
    if isinstance(op, Copy):
        return Copy(_map_slice(op.src, m), _map_slice(op.dst, m))
    return Reduce(_map_slice(op.src, m), _map_slice(op.dst, m), _map_slice(op.acc, m))


@dataclass(frozen=True)
class Schedule:
    steps: tuple[tuple[Op, ...], ...] = ()
    tmp: int = 0  # scratch elements this schedule needs

    @staticmethod
    def build(steps: Iterable[Iterable[Op]], tmp: int = 0) -> "Schedule":
        return Schedule(tuple(tuple(s) for s in steps if s), tmp)

    def then(self, other: "Schedule") -> "Schedule":
        """Run ``self`` and then ``other`` (their scratch areas may overlap)."""
        return Schedule(self.steps + other.steps, max(self.tmp, other.tmp))

    def relabel(self, group: Sequence[int]) -> "Schedule":
        """Map peer indices (into ``group``) to the ranks ``group`` holds."""
        return Schedule(tuple(tuple(_map_op(o, group.__getitem__, None) for o in s)
                              for s in self.steps), self.tmp)

    def rebase(self, roles: dict[str, tuple[str, int]], tmp: int | None = None) -> "Schedule":
        """Move slices: ``roles={"out": ("tmp", 64)}`` makes ``out[i]`` mean ``tmp[64+i]``."""
        return Schedule(tuple(tuple(_map_op(o, None, roles) for o in s) for s in self.steps),
                        self.tmp if tmp is None else tmp)

    @cached_property
    def split_steps(self) -> tuple[tuple[tuple, tuple], ...]:
        """Per step: (local ops, communication ops) — what the executor iterates."""
        return tuple((tuple(o for o in st if isinstance(o, LOCAL_OPS)),
                      tuple(o for o in st if isinstance(o, COMM_OPS))) for st in self.steps)

    @property
    def nmessages(self) -> int:
        return sum(isinstance(o, Send) for s in self.steps for o in s)

    def peers(self) -> set[int]:
        return {o.peer for s in self.steps for o in s if isinstance(o, COMM_OPS)}


# ---------------------------------------------------------------------------
# Collective specifications: buffer sizes and postconditions.
#
# ``n`` is the per-rank count as the public API sees it:
#   allreduce/reduce/broadcast: the vector length;
#   allgather/gather: the input length (output is p*n);
#   reduce_scatter/scatter: the output length (input is p*n);
#   alltoall: the block length (input and output are p*n);
#   barrier: ignored.
# ---------------------------------------------------------------------------

Contrib = frozenset  # of (rank, index)


@dataclass(frozen=True)
class CollSpec:
    name: str
    in_len: Callable[[int, int, int, int], int]   # (p, r, n, root) -> elements
    out_len: Callable[[int, int, int, int], int]
    # expected out[i] on rank r, or None where out is unspecified (left as it was)
    expect: Callable[[int, int, int, int, int], Contrib | None]
    inplace: str = "never"   # "both": out may alias in; "only": always aliased (broadcast)
    reduction: bool = False
    root: bool = False


def _all(p: int, i: int) -> Contrib:
    return frozenset((q, i) for q in range(p))


SPECS: dict[str, CollSpec] = {
    "allreduce": CollSpec("allreduce", lambda p, r, n, t: n, lambda p, r, n, t: n,
                          lambda p, r, n, t, i: _all(p, i), inplace="both", reduction=True),
    "reduce": CollSpec("reduce", lambda p, r, n, t: n, lambda p, r, n, t: n,
                       lambda p, r, n, t, i: _all(p, i) if r == t else None,
                       inplace="both", reduction=True, root=True),
    "broadcast": CollSpec("broadcast", lambda p, r, n, t: n, lambda p, r, n, t: n,
                          lambda p, r, n, t, i: frozenset({(t, i)}),
                          inplace="only", root=True),
    "allgather": CollSpec("allgather", lambda p, r, n, t: n, lambda p, r, n, t: p * n,
                          lambda p, r, n, t, i: frozenset({(i // n, i % n)})),
    "reduce_scatter": CollSpec("reduce_scatter", lambda p, r, n, t: p * n, lambda p, r, n, t: n,
                               lambda p, r, n, t, i: _all(p, r * n + i), reduction=True),
    "alltoall": CollSpec("alltoall", lambda p, r, n, t: p * n, lambda p, r, n, t: p * n,
                         lambda p, r, n, t, i: frozenset({(i // n, r * n + i % n)})),
    "gather": CollSpec("gather", lambda p, r, n, t: n,
                       lambda p, r, n, t: p * n if r == t else 0,
                       lambda p, r, n, t, i: frozenset({(i // n, i % n)}) if r == t else None,
                       root=True),
    "scatter": CollSpec("scatter", lambda p, r, n, t: p * n if r == t else 0,
                        lambda p, r, n, t: n,
                        lambda p, r, n, t, i: frozenset({(t, r * n + i)}), root=True),
    "barrier": CollSpec("barrier", lambda p, r, n, t: 0, lambda p, r, n, t: 0,
                        lambda p, r, n, t, i: None),
}


class ScheduleError(AssertionError):
    """A schedule is wrong: it deadlocks, mismatches, races or misses its postcondition."""


@dataclass
class _RankState:
    bufs: dict[str, list]
    step: int = 0
    known: set = field(default_factory=set)   # ranks whose start this rank has heard of


def _overlap(a: Slice, b: Slice, alias: bool) -> bool:
    ab, bb = a.buf, b.buf
    if alias:
        ab = "out" if ab == "in" else ab
        bb = "out" if bb == "in" else bb
    return ab == bb and a.off < b.end and b.off < a.end and a.n > 0 and b.n > 0


def simulate(coll: str, p: int, n: int, scheds: Sequence[Schedule], root: int = 0,
             inplace: bool | None = None) -> None:
    """Prove ``scheds`` (one per rank, peers as ranks 0..p-1) implement ``coll``.

    With ``inplace=None`` both the separate-buffer and the aliased (in-place)
    runs are checked (broadcast: in-place only).  Raises ``ScheduleError``.
    """
    spec = SPECS[coll]
    if len(scheds) != p:
        raise ScheduleError(f"{coll}: {len(scheds)} schedules for {p} ranks")
    modes = {"only": [True], "never": [False], "both": [False, True]}[spec.inplace]
    if inplace is not None:
        modes = [m for m in modes if m == inplace]
    for alias in modes:
        _simulate(spec, p, n, scheds, root, alias)


def _simulate(spec: CollSpec, p: int, n: int, scheds: Sequence[Schedule], root: int,
              alias: bool) -> None:
    where = f"{spec.name} p={p} n={n} root={root} {'in-place' if alias else 'out-of-place'}"
    states: list[_RankState] = []
    for r in range(p):
        nin, nout = spec.in_len(p, r, n, root), spec.out_len(p, r, n, root)
        inb = [frozenset({(r, i)}) for i in range(nin)]
        if alias:
            # in-place: "in" and "out" are one list (sizes agree for these collectives)
            if spec.inplace == "only" and r != root:
                inb = [None] * nin
            outb = inb
        else:
            outb = ["init"] * nout
        states.append(_RankState({"in": inb, "out": outb, "tmp": [None] * scheds[r].tmp},
                                 known={r}))
    initial_out = [list(s.bufs["out"]) for s in states]
    snaps: dict[int, tuple[list, set]] = {}   # id(Send op) -> (contents, sender's knowledge)

    def rd(r: int, s: Slice) -> list:
        b = states[r].bufs[s.buf]
        if s.end > len(b):
            raise ScheduleError(f"{where}: rank {r} reads {s} beyond {s.buf}[{len(b)}]")
        return b[s.off:s.end]

    def wr(r: int, s: Slice, vals: list) -> None:
        if s.buf == "in":
            raise ScheduleError(f"{where}: rank {r} writes the input buffer: {s}")
        b = states[r].bufs[s.buf]
        if s.end > len(b):
            raise ScheduleError(f"{where}: rank {r} writes {s} beyond {s.buf}[{len(b)}]")
        b[s.off:s.end] = vals

    def combine(r: int, a: list, b: list, what: str) -> list:
        res = []
        for x, y in zip(a, b):
            if not isinstance(x, frozenset) or not isinstance(y, frozenset):
                raise ScheduleError(f"{where}: rank {r} reduces undefined data ({what})")
            if x & y:
                raise ScheduleError(f"{where}: rank {r} reduces {sorted(x & y)} twice ({what})")
            res.append(x | y)
        return res

    # per ordered pair (src, dst): the ops in posting order, as keys (rank, step, index)
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    ops: dict[tuple[int, int, int], Op] = {}
    for r, sc in enumerate(scheds):
        for k, step in enumerate(sc.steps):
            for j, o in enumerate(step):
                ops[(r, k, j)] = o
                if not isinstance(o, COMM_OPS):
                    continue
                if not 0 <= o.peer < p or o.peer == r:
                    raise ScheduleError(f"{where}: rank {r} step {k}: bad peer {o.peer}")
                if isinstance(o, Send):
                    sends.setdefault((r, o.peer), []).append((r, k, j))
                else:
                    recvs.setdefault((o.peer, r), []).append((r, k, j))
            # hazards inside the step
            # (a RecvReduce may read its own acc where it writes: elementwise, in order)
            comm = [o for o in step if isinstance(o, COMM_OPS)]
            reads = [o.src for o in comm if isinstance(o, Send)]
            rops = [o for o in comm if not isinstance(o, Send)]
            for i, w in enumerate(rops):
                others = [x for x in rops if x is not w]
                for x in reads + [o.dst for o in rops[i + 1:]] + \
                        [o.acc for o in others if isinstance(o, RecvReduce) and o.acc]:
                    if _overlap(w.dst, x, alias):
                        raise ScheduleError(f"{where}: rank {r} step {k}: hazard {w.dst} vs {x}")
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for ch in set(sends) | set(recvs):
        s, d = sends.get(ch, []), recvs.get(ch, [])
        if len(s) != len(d):
            raise ScheduleError(f"{where}: {len(s)} sends but {len(d)} receives from rank "
                                f"{ch[0]} to rank {ch[1]}")
        for ks, kr in zip(s, d):
            if ops[ks].src.n != ops[kr].dst.n and not (
                    getattr(ops[kr], "upto", False) and ops[ks].src.n <= ops[kr].dst.n):
                raise ScheduleError(f"{where}: rank {ch[0]} step {ks[1]} sends {ops[ks].src.n} "
                                    f"elements, rank {ch[1]} step {kr[1]} expects {ops[kr].dst.n}")
            partner[ks], partner[kr] = kr, ks
    snaps: dict[tuple[int, int, int], tuple[list, set]] = {}  # send key -> (data, knowledge)

    def enter(r: int) -> None:
        st = states[r]
        if st.step >= len(scheds[r].steps):
            return
        for j, o in enumerate(scheds[r].steps[st.step]):
            if isinstance(o, Copy):
                wr(r, o.dst, rd(r, o.src))
            elif isinstance(o, Reduce):
                wr(r, o.dst, combine(r, rd(r, o.acc or o.dst), rd(r, o.src), f"local {o}"))
        for j, o in enumerate(scheds[r].steps[st.step]):
            if isinstance(o, Send):
                snaps[(r, st.step, j)] = (rd(r, o.src), set(st.known))

    for r in range(p):
        enter(r)
    done = [False] * p
    while True:
        ready = []
        for r in range(p):
            st = states[r]
            if st.step >= len(scheds[r].steps):
                done[r] = True
                continue
            step = scheds[r].steps[st.step]
            # an op is matched once its peer has posted (or passed) the counterpart's step
            if all(states[partner[(r, st.step, j)][0]].step >= partner[(r, st.step, j)][1]
                   for j, o in enumerate(step) if isinstance(o, COMM_OPS)):
                ready.append(r)
        if all(done):
            break
        if not ready:
            stuck = [f"rank {r} at step {states[r].step}" for r in range(p) if not done[r]]
            raise ScheduleError(f"{where}: deadlock: " + ", ".join(stuck))
        for r in ready:  # complete the steps of every ready rank: apply the receives
            k = states[r].step
            for j, o in enumerate(scheds[r].steps[k]):
                if isinstance(o, (Recv, RecvReduce)):
                    data, known = snaps[partner[(r, k, j)]]
                    states[r].known |= known
                    if isinstance(o, Recv):
                        dst = o.dst if len(data) == o.dst.n else Slice(o.dst.buf, o.dst.off,
                                                                       len(data))
                        wr(r, dst, list(data))
                    else:
                        wr(r, o.dst, combine(r, rd(r, o.acc or o.dst), data, f"{o}"))
        for r in ready:
            states[r].step += 1
            enter(r)
    for r in range(p):
        out = states[r].bufs["out"]
        if spec.name == "barrier":
            if states[r].known != set(range(p)):
                raise ScheduleError(f"{where}: rank {r} leaves the barrier without hearing from "
                                    f"ranks {sorted(set(range(p)) - states[r].known)}")
            continue
        for i in range(len(out)):
            want = spec.expect(p, r, n, root, i)
            got = out[i]
            if want is None:
                if got != initial_out[r][i]:
                    raise ScheduleError(f"{where}: rank {r} out[{i}] must stay untouched, "
                                        f"holds {_fmt(got)}")
            elif got != want:
                raise ScheduleError(f"{where}: rank {r} out[{i}] holds {_fmt(got)}, "
                                    f"expected {_fmt(want)}")


def _fmt(x) -> str:
    if isinstance(x, frozenset):
        return "{" + ",".join(f"{a}:{b}" for a, b in sorted(x)) + "}"
    return repr(x)
