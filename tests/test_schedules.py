"""Every registered algorithm, proven by the symbolic simulator for p = 1..17.

For each (collective, algorithm, p) all p schedules are built and ``simulate``d for
several counts (0, 1, p-1, p, p+1, 2p+3 and the prime 37: empty, tiny, uneven and
n < p cases) and, for rooted collectives, roots 0, p//2 and p-1.  ``simulate`` checks
matching, deadlock freedom, hazards, the input staying read-only, double reductions and
the postcondition, in place and out of place where the collective allows both.  The
negative tests at the end make sure the simulator really catches each kind of error.
"""

from __future__ import annotations

import importlib
import math

import pytest

from gpurt.schedule import (SPECS, Copy, Recv, RecvReduce, Reduce, Schedule, ScheduleError,
                            Send, Slice, simulate)

importlib.import_module("gpurt.algorithms")  # registers every module the package lists
for _mod in ("recursive", "tree", "exchange"):  # and these, even if the list lacks them
    importlib.import_module(f"gpurt.algorithms.{_mod}")
from gpurt.algorithms.base import REGISTRY, Cost  # noqa: E402

PS = range(1, 18)
CASES = sorted((coll, name) for coll, algs in REGISTRY.items() for name in algs)


def _counts(p: int) -> list[int]:
    return sorted({0, 1, p - 1, p, p + 1, 2 * p + 3, 37})


def _roots(coll: str, p: int) -> list[int]:
    return sorted({0, p // 2, p - 1}) if SPECS[coll].root else [0]


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("coll,name", CASES, ids=[f"{c}:{a}" for c, a in CASES])
def test_algorithm_proven(coll: str, name: str, p: int) -> None:
    build = REGISTRY[coll][name].build
    for n in _counts(p):
        for root in _roots(coll, p):
            scheds = [build(p, r, n, root) for r in range(p)]
            simulate(coll, p, n, scheds, root)


@pytest.mark.parametrize("coll,name", CASES, ids=[f"{c}:{a}" for c, a in CASES])
def test_one_rank_copies_once_at_most(coll: str, name: str) -> None:
    """On one rank a collective is in -> out or nothing: no scratch, at most one copy
    (the 1-rank direct allreduce went in -> tmp -> out, both copies even in place: 512
    MiB of scratch and ~50 ms a call for a 512 MiB in-place allreduce on one rank)."""
    s = REGISTRY[coll][name].build(1, 0, 1000, 0)
    ops = [o for st in s.steps for o in st]
    assert s.tmp == 0 and len(ops) <= 1, (s.tmp, ops)
    assert all(type(o) is Copy and o.src.buf == "in" and o.dst.buf == "out" for o in ops)


def test_registry_covers_this_work() -> None:
    want = {
        "allreduce": {"recursive_doubling", "rabenseifner"},
        "reduce_scatter": {"recursive_halving"},
        "allgather": {"recursive_doubling", "bruck"},
        "broadcast": {"binomial", "scatter_allgather"},
        "reduce": {"binomial"},
        "gather": {"binomial"},
        "scatter": {"binomial"},
        "alltoall": {"pairwise"},
        "barrier": {"dissemination"},
    }
    for coll, names in want.items():
        assert names <= set(REGISTRY.get(coll, {})), coll


@pytest.mark.parametrize("coll,name", CASES, ids=[f"{c}:{a}" for c, a in CASES])
def test_cost_is_sane(coll: str, name: str) -> None:
    cost = REGISTRY[coll][name].cost
    c = Cost(alpha=1e-6, beta=1e-9, gamma=1e-9)
    for p in PS:
        for S in (0.0, 8.0, float(1 << 20)):
            t = cost(p, S, c)
            assert math.isfinite(t) and t >= 0, (p, S, t)
        if p > 1 and coll != "barrier":
            assert cost(p, float(1 << 20), c) > cost(p, 8.0, c)


def test_latency_rounds() -> None:
    """The log-round algorithms really take ⌈lg p⌉-ish messages per rank."""
    ar_rd = REGISTRY["allreduce"]["recursive_doubling"].build
    ar_rab = REGISTRY["allreduce"]["rabenseifner"].build
    bruck = REGISTRY["allgather"]["bruck"].build
    bar = REGISTRY["barrier"]["dissemination"].build
    for p in (2, 4, 8, 16):
        lgp = p.bit_length() - 1
        for r in range(p):
            assert ar_rd(p, r, 10, 0).nmessages == lgp
            assert ar_rab(p, r, 10, 0).nmessages == 2 * lgp
            assert len(bruck(p, r, 10, 0).steps) == lgp
    for p in PS:
        assert all(len(bar(p, r, 0, 0).steps) == math.ceil(math.log2(p)) for r in range(p))
        assert all(len(bruck(p, r, 3, 0).steps) == max(1, math.ceil(math.log2(p)))
                   for r in range(p))


# ---------------------------------------------------------------------------
# negative tests: the simulator must catch each kind of error
# ---------------------------------------------------------------------------

N = 4


def _s(b: str, off: int = 0, n: int = N) -> Slice:
    return Slice(b, off, n)


def _good_pair() -> list[Schedule]:
    """A correct 2-rank allreduce: swap into scratch, reduce."""
    return [Schedule.build([[Send(1 - r, _s("in")), Recv(1 - r, _s("tmp"))],
                            [Reduce(_s("tmp"), _s("out"), acc=_s("in"))]], tmp=N)
            for r in range(2)]


def test_negative_control_is_correct() -> None:
    simulate("allreduce", 2, N, _good_pair())


def test_catches_deadlock() -> None:
    # both ranks receive first (rendezvous: nobody ever sends)
    sc = [Schedule.build([[Recv(1 - r, _s("tmp"))], [Send(1 - r, _s("in"))],
                          [Reduce(_s("tmp"), _s("out"), acc=_s("in"))]], tmp=N)
          for r in range(2)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate("allreduce", 2, N, sc)


def test_catches_crossed_order_deadlock() -> None:
    # three ranks in a cycle, each sending before it receives, one step each: rendezvous
    # sends block until the matching receive is posted -> a cycle of waits
    sc = [Schedule.build([[Send((r + 1) % 3, Slice("tmp", 0, 0))],
                          [Recv((r - 1) % 3, Slice("tmp", 0, 0))]]) for r in range(3)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate("barrier", 3, 0, sc)


def test_catches_size_mismatch() -> None:
    sc = _good_pair()
    sc[1] = Schedule.build([[Send(0, _s("in")), Recv(0, _s("tmp", 0, N - 1))],
                            [Reduce(_s("tmp"), _s("out"), acc=_s("in"))]], tmp=N)
    with pytest.raises(ScheduleError, match="expects"):
        simulate("allreduce", 2, N, sc)


def test_catches_unmatched_message() -> None:
    sc = _good_pair()
    sc[0] = Schedule(sc[0].steps + ((Send(1, _s("out")),),), N)
    with pytest.raises(ScheduleError, match="sends but"):
        simulate("allreduce", 2, N, sc)


def test_catches_hazard() -> None:
    # the received vector overwrites what the same step sends
    sc = [Schedule.build([[Copy(_s("in"), _s("out")),
                           Send(1 - r, _s("out")), RecvReduce(1 - r, _s("out"))]])
          for r in range(2)]
    with pytest.raises(ScheduleError, match="hazard"):
        simulate("allreduce", 2, N, sc)


def test_catches_inplace_only_hazard() -> None:
    # fine with separate buffers, but in place "in" *is* "out"
    sc = [Schedule.build([[Send(1 - r, _s("in")), RecvReduce(1 - r, _s("out", 0, N),
                                                             acc=_s("in", 0, N))]])
          for r in range(2)]
    simulate("allreduce", 2, N, sc, inplace=False)
    with pytest.raises(ScheduleError, match="hazard"):
        simulate("allreduce", 2, N, sc, inplace=True)


def test_catches_input_write() -> None:
    sc = [Schedule.build([[Send(1 - r, _s("in")), Recv(1 - r, _s("tmp"))],
                          [Reduce(_s("tmp"), _s("in"))], [Copy(_s("in"), _s("out"))]], tmp=N)
          for r in range(2)]
    with pytest.raises(ScheduleError, match="input"):
        simulate("allreduce", 2, N, sc, inplace=False)


def test_catches_double_reduction() -> None:
    # rank 1 folds rank 0's vector in twice
    s0 = Schedule.build([[Send(1, _s("in"))], [Send(1, _s("in"))], [Recv(1, _s("out"))]])
    s1 = Schedule.build([[RecvReduce(0, _s("out"), acc=_s("in"))], [RecvReduce(0, _s("out"))],
                         [Send(0, _s("out"))]])
    with pytest.raises(ScheduleError, match="twice"):
        simulate("allreduce", 2, N, [s0, s1])


def test_catches_wrong_postcondition() -> None:
    # allgather that forgets to exchange: only the own block is filled
    sc = [Schedule.build([[Copy(_s("in"), _s("out", r * N))]]) for r in range(2)]
    with pytest.raises(ScheduleError, match="expected"):
        simulate("allgather", 2, N, sc)
    # reduce where a non-root rank scribbles on its output
    s0 = Schedule.build([[RecvReduce(1, _s("out"), acc=_s("in"))]])
    s1 = Schedule.build([[Copy(_s("in"), _s("out"))], [Send(0, _s("in"))]])
    with pytest.raises(ScheduleError, match="untouched"):
        simulate("reduce", 2, N, [s0, s1], root=0, inplace=False)


def test_catches_lonely_barrier() -> None:
    # a "barrier" where rank 2 never hears from anyone
    sc = [Schedule.build([[Send(1, Slice("tmp", 0, 0))]]),
          Schedule.build([[Recv(0, Slice("tmp", 0, 0))]]),
          Schedule.build([])]
    with pytest.raises(ScheduleError, match="without hearing"):
        simulate("barrier", 3, 0, sc)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 32, 33, 40])
def test_agreement_exchange_proven(p: int) -> None:
    """The agreement check's exchange (``gpurt.comm._agreement_schedule``) is an
    allgather of every rank's header: up to 32 ranks straight from the rank's own row of
    the output (it writes its header there; the Copy in front stands for that write),
    beyond with Bruck's rounds from a separate message."""
    from gpurt.comm import _agreement_schedule
    n = 15
    scheds = []
    for r in range(p):
        s = _agreement_schedule(p, r, n)
        if p <= 32:
            assert len(s.steps) <= 1 and not any(isinstance(o, Copy) for st in s.steps
                                                 for o in st)
            s = Schedule.build([[Copy(Slice("in", 0, n), Slice("out", r * n, n))]]).then(s)
        scheds.append(s)
    simulate("allgather", p, n, scheds)


def _nodes(sizes: list[int], round_robin: bool = False) -> tuple:
    """Node -> its ranks (rank order): blocks of consecutive ranks, or dealt out one by
    one (round robin, as ``--map-by node`` places them)."""
    p = sum(sizes)
    if not round_robin:
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        return tuple(tuple(range(s, s + k)) for s, k in zip(starts, sizes))
    nodes: list[list[int]] = [[] for _ in sizes]
    q, b = 0, 0
    while q < p:
        if len(nodes[b]) < sizes[b]:
            nodes[b].append(q)
            q += 1
        b = (b + 1) % len(sizes)
    return tuple(tuple(rs) for rs in nodes)


@pytest.mark.parametrize("sizes,rr", [([5, 5], False), ([5, 5], True), ([3, 3, 3], False),
                                      ([3, 3, 3], True), ([4, 2, 3], False),
                                      ([4, 2, 3], True), ([1, 8], False), ([8, 1, 1], True),
                                      ([2] * 8, False), ([4] * 4, True), ([6, 1, 2, 7], True)])
def test_hierarchical_agreement_proven(sizes: list[int], rr: bool) -> None:
    """The agreement across nodes on more than 8 ranks (``_agreement_schedule_hier``):
    every rank's row to every rank — inside the node, then the node's rows in one message
    to a rank of every other node — on blocks and round-robin placements, nodes of unequal
    sizes; and ``covers`` (what a timeout names) says, for every receive, whose rows it
    brings: together every other rank, each once."""
    from gpurt.comm import _agreement_schedule_hier
    nodes = _nodes(sizes, rr)
    p, n = sum(sizes), 15
    scheds = []
    for r in range(p):
        s, covers = _agreement_schedule_hier(nodes, r, n)
        recvs = [op.peer for st in s.steps for op in st if isinstance(op, Recv)]
        assert len(recvs) == len(set(recvs)) == len(covers)
        brought = [q for peer in recvs for q in covers[peer]]
        assert sorted(brought) == [q for q in range(p) if q != r]
        local = len(nodes[[b for b, rs in enumerate(nodes) if r in rs][0]]) - 1
        assert len(recvs) == local + len(nodes) - 1       # not one per remote rank
        scheds.append(Schedule.build([[Copy(Slice("in", 0, n), Slice("out", r * n, n))]])
                      .then(s))
    simulate("allgather", p, n, scheds)


@pytest.mark.parametrize("sizes,rr", [([2, 2], False), ([2, 2], True), ([3, 2], False),
                                      ([2, 3], True), ([2, 2, 2], True), ([1, 3], False),
                                      ([4, 1, 1], True), ([2, 1, 2, 1, 2], False)])
def test_hierarchical_fold_exchange_proven(sizes: list[int], rr: bool) -> None:
    """The agreement with folded calls across nodes of several ranks (up to 8 ranks:
    ``_agreement_schedule_hfold``): every rank's row reaches every rank, at its
    node-major position (``_HierFold.perm``), on blocks and round-robin placements — one
    receive per local peer and one per other node, ``covers`` naming every other rank
    once; and with room for longer rows (``cap``) no receive reaches past the buffer."""
    from gpurt.comm import _agreement_schedule_hfold
    nodes = _nodes(sizes, rr)
    p, s = sum(sizes), 15
    order = [q for rs in nodes for q in rs]
    scheds = []
    for r in range(p):
        sched, covers = _agreement_schedule_hfold(nodes, r, s, s, s)
        recvs = [op.peer for st in sched.steps for op in st if isinstance(op, Recv)]
        assert len(recvs) == len(set(recvs)) == len(covers)
        assert sorted(q for peer in recvs for q in covers[peer]) == \
            [q for q in range(p) if q != r]
        local = len(nodes[[b for b, rs in enumerate(nodes) if r in rs][0]]) - 1
        assert len(recvs) == local + len(nodes) - 1
        # the rows in tmp, node-major; the Copy in front stands for the own row's write,
        # the one behind puts the rows in rank order for the check
        i = order.index(r)
        rows = sched.rebase({"out": ("tmp", 0)}, tmp=p * s)
        scheds.append(Schedule.build([[Copy(Slice("in", 0, s), Slice("tmp", i * s, s))]],
                                     tmp=p * s)
                      .then(rows)
                      .then(Schedule.build([[Copy(Slice("tmp", k * s, s),
                                                  Slice("out", q * s, s))
                                             for k, q in enumerate(order)]], tmp=p * s)))
        for cap in (s + 1, 4 * s):
            longer, _ = _agreement_schedule_hfold(nodes, r, s, s - 3, cap)
            for st in longer.steps:
                for op in st:
                    if isinstance(op, Recv):
                        assert op.upto and op.dst.off + op.dst.n <= p * cap
                    else:
                        assert op.src.off + op.src.n <= p * s
    simulate("allgather", p, s, scheds)


@pytest.mark.parametrize("sizes,rr,hier", [([2, 2], False, False), ([3, 2], False, False),
                                           ([2, 1], False, False), ([1, 1], False, False),
                                           ([2, 2, 2], True, True), ([3, 3], False, True),
                                           ([4, 4], True, True), ([2, 2, 2, 2], False, True),
                                           ([5, 4], False, False)])
def test_the_folding_agreement_goes_hierarchical_where_it_saves_two_messages_a_rank(
        sizes: list[int], rr: bool, hier: bool) -> None:
    """``_hier_fold``: up to 8 ranks, where the hierarchical exchange sends at least two
    network messages per rank fewer than the flat one (2 x 2 and 3 + 2 save one: flat);
    beyond 8 ranks the header-only hierarchical agreement (``_hier_agreement``) instead."""
    from types import SimpleNamespace
    from gpurt.comm import _hier_fold
    nodes = _nodes(sizes, rr)
    topo = SimpleNamespace(local_ranks=nodes, size=sum(sizes), nnodes=len(sizes))
    assert _hier_fold(topo) is hier


def test_upto_receive_takes_a_shorter_message_only() -> None:
    """A ``Recv(..., upto=True)`` (the agreement's receives) matches a send of at most its
    size; a longer send is a size mismatch, as for an exact receive."""
    def pair(sent: int, room: int, upto: bool) -> list[Schedule]:
        return [Schedule.build([[Send(1 - r, Slice("tmp", 0, sent)),
                                 Recv(1 - r, Slice("tmp", 8, room), upto)]], tmp=16)
                for r in range(2)]
    simulate("barrier", 2, 0, pair(3, 5, True))
    simulate("barrier", 2, 0, pair(5, 5, True))
    with pytest.raises(ScheduleError, match="sends 6 elements"):
        simulate("barrier", 2, 0, pair(6, 5, True))
    with pytest.raises(ScheduleError, match="sends 3 elements"):
        simulate("barrier", 2, 0, pair(3, 5, False))
