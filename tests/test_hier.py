"""Hierarchical schedules (``gpurt.hier``) proven by the symbolic simulator, and the
tuner's handling of them.

For every node shape the issue names (1×p, p×1, 2×2, 2×3, 3×2, 3×3, 4×4, uneven nodes
such as 3+2, and ranks placed round-robin rather than in blocks), every hierarchical
collective is built for every rank and ``simulate``d — matching, deadlock freedom under
rendezvous semantics, hazards, the read-only input, double reductions and the
postcondition, in and out of place — with the stage algorithms the tuner would pick and
with every registered algorithm forced into every stage, unpipelined and pipelined.
"""

from __future__ import annotations

import pytest

from gpurt import hier
from gpurt.algorithms import REGISTRY, Cost
from gpurt.schedule import SPECS, Recv, RecvReduce, Send, simulate
from gpurt.tuner import Tuner


def blockwise(*sizes: int) -> tuple[tuple[int, ...], ...]:
    out, r = [], 0
    for s in sizes:
        out.append(tuple(range(r, r + s)))
        r += s
    return tuple(out)


SHAPES = {
    "1x1": blockwise(1), "1x2": blockwise(2), "1x3": blockwise(3), "1x5": blockwise(5),
    "2x1": blockwise(1, 1), "3x1": blockwise(1, 1, 1), "5x1": blockwise(1, 1, 1, 1, 1),
    "2x2": blockwise(2, 2), "2x3": blockwise(3, 3), "3x2": blockwise(2, 2, 2),
    "3x3": blockwise(3, 3, 3), "4x4": blockwise(4, 4, 4, 4),
    "3+2": blockwise(3, 2), "2+3": blockwise(2, 3), "1+3": blockwise(1, 3),
    "4+2+3": blockwise(4, 2, 3),
    "2x2-round-robin": ((0, 2), (1, 3)), "3x2-round-robin": ((0, 3), (1, 4), (2, 5)),
}

LEVELS = {"node": Cost(30e-6, 1 / 2.5e9, 1 / 4e9), "net": Cost(60e-6, 1 / 0.12e9, 1 / 2e9)}


def cheapest(coll: str, p: int, S: float, level: str) -> str:
    c = LEVELS[level]
    return min(REGISTRY[coll].values(), key=lambda a: (a.cost(p, S, c), a.name)).name


def forced(i: int):
    """Every stage of a collective uses its i-th registered algorithm (cycling)."""
    def pick(coll: str, p: int, S: float, level: str) -> str:
        names = sorted(REGISTRY[coll])
        return names[i % len(names)]
    return pick


def prove(coll: str, nodes, n: int, pick, frags: int) -> None:
    shape = hier.Shape(nodes)
    p = shape.p
    roots = sorted({0, p // 2, p - 1}) if SPECS[coll].root else [0]
    for root in roots:
        scheds = [hier.build(coll, shape, r, n, root, 4, pick, frags) for r in range(p)]
        simulate(coll, p, n, scheds, root)


def _cases():
    for sname, nodes in SHAPES.items():
        for coll in hier.COLLS:
            if hier.supports(coll, hier.Shape(nodes)):
                yield sname, coll


@pytest.mark.parametrize("sname,coll", list(_cases()), ids=[f"{s}-{c}" for s, c in _cases()])
def test_hierarchical_schedule_proven(sname: str, coll: str) -> None:
    nodes = SHAPES[sname]
    p = sum(len(x) for x in nodes)
    counts = (0, 1, 7, 37) if p <= 9 else (1, 5)
    picks = [cheapest] + [forced(i) for i in range(4 if p <= 9 else 2)]
    for n in counts:
        for frags in (1, 3):
            for pick in picks:
                prove(coll, nodes, n, pick, frags)


def test_uneven_nodes_have_no_hierarchical_reduce_scatter_or_allgather() -> None:
    shape = hier.Shape(blockwise(3, 2))
    assert hier.supports("allreduce", shape) and hier.supports("broadcast", shape)
    assert not hier.supports("reduce_scatter", shape)
    assert not hier.supports("allgather", shape)


def _inter_node_bytes(coll: str, nodes, n: int, pick, frags: int = 1) -> int:
    shape = hier.Shape(nodes)
    node_of = {r: k for k, rs in enumerate(nodes) for r in rs}
    total = 0
    for r in range(shape.p):
        for st in hier.build(coll, shape, r, n, 0, 4, pick, frags).steps:
            total += sum(o.src.n for o in st if isinstance(o, Send)
                         and node_of[o.peer] != node_of[r])
    return total


def test_each_byte_crosses_the_network_as_few_times_as_possible() -> None:
    """2 nodes x 2 ranks, allreduce of n elements: every element must leave each node once
    and arrive once — n elements per direction, 2n in all (the flat ring sends 3n)."""
    n = 1000
    ring = lambda coll, p, S, level: "ring"   # noqa: E731
    assert _inter_node_bytes("allreduce", blockwise(2, 2), n, ring) == 2 * n
    assert _inter_node_bytes("allreduce", blockwise(2, 2), n, ring, frags=4) == 2 * n
    flat = 0
    for r in range(4):
        sc = REGISTRY["allreduce"]["ring"].build(4, r, n, 0)
        flat += sum(o.src.n for st in sc.steps for o in st
                    if isinstance(o, Send) and (o.peer // 2) != (r // 2))
    assert flat == 3 * n


def test_pipelining_overlaps_the_stages() -> None:
    """With step-synchronous stages (ring), fragments overlap: fewer super-steps than the
    fragments run one after the other, and some step mixes intra- and inter-node traffic."""
    nodes = blockwise(2, 2)
    shape = hier.Shape(nodes)
    ring = lambda coll, p, S, level: "ring"   # noqa: E731
    seq = sum(len(hier.build("allreduce", shape, 0, 400, 0, 4, ring, 1).steps) for _ in range(4))
    piped = hier.build("allreduce", shape, 0, 1600, 0, 4, ring, 4)
    assert len(piped.steps) < seq
    mixed = [st for st in piped.steps
             if {o.peer // 2 for o in st if isinstance(o, (Send, Recv, RecvReduce))} == {0, 1}]
    assert mixed, "no step carries intra- and inter-node messages at once"


def test_unsynchronous_stages_compose_in_sequence() -> None:
    """A binomial broadcast is not step-synchronous: fragments then run one after the
    other (still proven), never interleaved."""
    nodes = blockwise(3, 3)
    tree = lambda coll, p, S, level: "binomial"   # noqa: E731
    assert not hier._group_facts("broadcast", "binomial", 3, 10, 0)[1]
    prove("broadcast", nodes, 12, tree, 3)


def test_degenerate_shapes_are_the_flat_schedule() -> None:
    """One rank per node: the hierarchical allreduce's only stage is the rail — the flat
    allreduce over every rank; one node: reduce-scatter + allgather on the node."""
    pick = lambda coll, p, S, level: "ring"   # noqa: E731
    shape = hier.Shape(blockwise(1, 1, 1))
    for r in range(3):
        mine = hier.build("allreduce", shape, r, 30, 0, 4, pick, 1)
        flat = REGISTRY["allreduce"]["ring"].build(3, r, 30, 0)
        comm = lambda s: [o for st in s.steps for o in st if isinstance(o, (Send, Recv, RecvReduce))]  # noqa: E731,E501
        assert [(type(o), o.peer) for o in comm(mine)] == [(type(o), o.peer) for o in comm(flat)]


def _tuner(nodes, rank=0) -> Tuner:
    shape = hier.Shape(nodes)
    return Tuner(shape.p, rank, tuple(range(shape.p)), LEVELS["net"], nnodes=shape.nnodes,
                 forced={}, profile={}, shape=shape, levels=LEVELS)


def test_tuner_picks_hierarchical_for_large_multi_node_calls() -> None:
    t = _tuner(blockwise(2, 2))
    for coll in hier.COLLS:
        assert t.choose(coll, 16 << 20, 1).name == "hierarchical", coll
    text = t.explain("allreduce", 64 << 20)
    assert "hierarchical" in text and "<- chosen" in text and "net allreduce" in text
    _, frags, _ = t.hier_plan("allreduce", 64 << 20)
    assert frags > 1                          # large calls are pipelined
    assert t.hier_plan("allreduce", 4096)[1] == 1


def test_tuner_offers_no_hierarchical_on_one_node_and_falls_back_when_forced() -> None:
    one = _tuner(blockwise(4))
    assert all(a.name != "hierarchical" for _, a in one.candidates("allreduce", 1 << 24))
    shape = hier.Shape(blockwise(3, 2))
    t = Tuner(5, 0, tuple(range(5)), LEVELS["net"], nnodes=2, profile={}, shape=shape,
              levels=LEVELS, forced={"reduce_scatter": "hierarchical", "allreduce": "hier"})
    assert t.choose("allreduce", 10, 4).name == "hierarchical"
    assert t.choose("reduce_scatter", 10, 4).name != "hierarchical"
    with pytest.raises(ValueError, match="equal size"):
        t.choose("allgather", 10, 4, "hierarchical")


def test_tuner_plan_is_a_proven_schedule() -> None:
    nodes = blockwise(2, 3)
    # 4096 elements of 512 bytes: 2 MiB, large enough to be pipelined
    assert _tuner(nodes).hier_plan("allreduce", 4096 * 512)[1] > 1
    for coll, n in (("allreduce", 4096), ("broadcast", 4096), ("reduce", 1000)):
        scheds = [_tuner(nodes, r).plan(coll, n, 512, 0, "hierarchical")[1] for r in range(5)]
        simulate(coll, 5, n, scheds, 0, inplace=None if coll != "broadcast" else True)
