"""Hierarchical schedules: ordinary schedules composed on the node, rail and net groups.

Between nodes the network is the bottleneck, so a hierarchical schedule sends each byte
across it as few times as possible and keeps every node's ranks (rails) busy at once.
Nothing here is a new algorithm: every stage is a registered algorithm (``gpurt.algorithms``)
built for a *subgroup* — the ranks of one node, one rail, or one representative per node —
chosen by the tuner for that subgroup's size and that level's cost constants (``pick``),
then relabelled to communicator ranks and rebased onto the right slices of the user's
buffers or of scratch.

Shapes.  ``nodes[k]`` lists the ranks of node k (rank order).  ``R`` = the smallest node's
size: local ranks ``0..R-1`` of every node are its *core* ranks, and rail ``j`` is core rank
``j`` of every node (so every rail has one rank per node).  Ranks of a bigger node beyond R
(*extras*, only with uneven nodes such as 3+2) hand their data to a *partner* core rank of
their node (local rank ``j mod R``) first and get the result back last.

    allreduce       [fold extras] → reduce_scatter on the node's core → allreduce along the
                    rail (one shard per rail) → allgather on the node's core → [unfold];
                    the n mod R tail elements by a flat allreduce
    reduce_scatter  permute blocks rail-major → reduce_scatter on the node → reduce_scatter
                    along the rail                               (nodes of equal size)
    allgather       allgather along the rail → allgather on the node → permute back
                                                                 (nodes of equal size)
    broadcast       broadcast among one representative per node (the root on its node)
                    → broadcast inside every node
    reduce          reduce inside every node to its representative → reduce among them

One node (rails of one rank) or one rank per node (nodes of one rank) leaves only the
stages whose groups have more than one rank: the flat schedule, with no special case.

Pipelining.  The vector is cut into ``frags`` fragments; fragment f runs the same stages
on its own slices and scratch.  When every stage is *step-synchronous* (each message is
sent and received at the same step index, true of ring, recursive doubling/halving,
Bruck, pairwise, direct), fragment f's stage s is placed at super-step
``f·D + P_s + i`` (P_s = the steps of the stages before s, D = the longest stage), so the
inter-node stage of fragment f overlaps the intra-node stages of fragments f±1.  Every
rank derives the same timeline from global facts, so each message is still matched in
the same super-step on both sides (FIFO per pair holds, nothing can deadlock); a stage
that is not step-synchronous (binomial trees, non-power-of-two folds) makes the
composition sequential instead.  The symbolic simulator proves the result for every
shape the tests name.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from .algorithms import REGISTRY
from .algorithms.base import blocks
from .schedule import COMM_OPS, Copy, Recv, RecvReduce, Schedule, Send, Slice

HIER = "hierarchical"
#: collectives with a hierarchical schedule; reduce_scatter/allgather need equal nodes
COLLS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
EVEN_ONLY = ("reduce_scatter", "allgather")

# pick(coll, group_size, nbytes, level) -> algorithm name; level is "node" or "net"
Pick = Callable[[str, int, float, str], str]


@dataclass(frozen=True)
class Shape:
    nodes: tuple[tuple[int, ...], ...]     # ranks of each node, in rank order

    @property
    def p(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def R(self) -> int:
        return min(len(n) for n in self.nodes)

    @property
    def even(self) -> bool:
        return len({len(n) for n in self.nodes}) == 1

    def where(self, rank: int) -> tuple[int, int]:
        for k, rs in enumerate(self.nodes):
            if rank in rs:
                return k, rs.index(rank)
        raise ValueError(f"rank {rank} is on no node of {self.nodes}")

    def rail(self, j: int) -> tuple[int, ...]:
        return tuple(rs[j] for rs in self.nodes)

    @staticmethod
    def of(local_ranks: Sequence[Sequence[int]]) -> "Shape":
        return Shape(tuple(tuple(rs) for rs in local_ranks))


def supports(coll: str, shape: Shape) -> bool:
    return coll in COLLS and (coll not in EVEN_ONLY or shape.even)


# ---------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """One registered algorithm on one subgroup, for one rank: its steps (global peers,
    rebased slices), the scratch it needs past its base, and the stage's length and
    synchrony over the whole subgroup (the same on every member)."""

    steps: tuple
    tmp_end: int
    length: int
    synchronous: bool


@lru_cache(maxsize=1024)
def _group_facts(coll: str, name: str, p: int, n: int, root: int) -> tuple[int, bool]:
    """(max step count over the group's ranks, is it step-synchronous?)"""
    build = REGISTRY[coll][name].build
    scheds = [build(p, r, n, root) for r in range(p)]
    length = max((len(s.steps) for s in scheds), default=0)
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for r, sc in enumerate(scheds):
        for k, st in enumerate(sc.steps):
            for o in st:
                if isinstance(o, Send):
                    sends.setdefault((r, o.peer), []).append(k)
                elif isinstance(o, COMM_OPS):
                    recvs.setdefault((o.peer, r), []).append(k)
    sync = all(sends.get(ch, []) == recvs.get(ch, []) for ch in set(sends) | set(recvs))
    return length, sync


@lru_cache(maxsize=4096)
def _built(coll: str, name: str, p: int, r: int, n: int, root: int) -> Schedule:
    return REGISTRY[coll][name].build(p, r, n, root)


def stage(coll: str, name: str, group: Sequence[int], me: int, n: int, root: int,
          roles: dict[str, tuple[str, int]], tmp_base: int) -> Stage:
    """``coll`` by algorithm ``name`` on ``group`` (global ranks), as rank ``me``, with
    count ``n``; ``roles`` maps the algorithm's in/out to slices of this rank's buffers,
    its scratch starts at ``tmp[tmp_base]``."""
    p = len(group)
    length, sync = _group_facts(coll, name, p, n, root)
    if me not in group:
        return Stage((), tmp_base, length, sync)
    sc = _built(coll, name, p, group.index(me), n, root)
    m = dict(roles)
    m["tmp"] = ("tmp", tmp_base)
    sc = sc.relabel(tuple(group)).rebase(m)
    return Stage(sc.steps, tmp_base + sc.tmp, length, sync)


def local(ops: list) -> Stage:
    """Local copies (permutations) as a one-step stage (zero steps when there are none)."""
    return Stage((tuple(ops),) if ops else (), 0, 1 if ops else 0, True)


def compose(frags: list[list[Stage]], tmp: int) -> Schedule:
    """Sequential stages per fragment, fragments pipelined when every stage is
    step-synchronous (see the module docstring), else one after the other."""
    if len(frags) > 1 and all(s.synchronous for f in frags for s in f):
        nst = max(len(f) for f in frags)
        L = [max((f[s].length for f in frags if s < len(f)), default=0) for s in range(nst)]
        P = [sum(L[:s]) for s in range(nst)]
        D = max(L, default=0)
        timeline: dict[int, list] = {}
        for fi, f in enumerate(frags):
            for si, st in enumerate(f):
                for i, step in enumerate(st.steps):
                    timeline.setdefault(fi * D + P[si] + i, []).extend(step)
        steps = [tuple(timeline[t]) for t in sorted(timeline)]
        return Schedule(tuple(s for s in steps if s), tmp)
    steps = [step for f in frags for st in f for step in st.steps]
    return Schedule(tuple(s for s in steps if s), tmp)


# ---------------------------------------------------------------------------
# the collectives
# ---------------------------------------------------------------------------

def _frag_blocks(q: int, frags: int) -> list[tuple[int, int]]:
    return [b for b in blocks(q, max(1, min(frags, q))) if b[1] > 0] or [(0, q)]


def build(coll: str, shape: Shape, rank: int, n: int, root: int, itemsize: int,
          pick: Pick, frags: int = 1) -> Schedule:
    """This rank's hierarchical schedule for ``coll`` (peers are communicator ranks)."""
    if coll == "allreduce":
        return _allreduce(shape, rank, n, itemsize, pick, frags)
    if coll == "reduce_scatter":
        return _reduce_scatter(shape, rank, n, itemsize, pick, frags)
    if coll == "allgather":
        return _allgather(shape, rank, n, itemsize, pick, frags)
    if coll == "broadcast":
        return _broadcast(shape, rank, n, root, itemsize, pick, frags)
    if coll == "reduce":
        return _reduce(shape, rank, n, root, itemsize, pick, frags)
    raise ValueError(f"no hierarchical schedule for {coll}")


def _allreduce(shape: Shape, rank: int, n: int, isz: int, pick: Pick, frags: int) -> Schedule:
    k, j = shape.where(rank)
    R, N = shape.R, shape.nnodes
    q = n // R
    main = q * R
    core = shape.nodes[k][:R]
    pre: list = []     # fold: extras' vectors into their partners
    post: list = []    # unfold: the result back to the extras
    src = "in"
    if main:
        if j >= R:
            partner = shape.nodes[k][j % R]
            pre.append((Send(partner, Slice("in", 0, main)),))
            post.append((Recv(partner, Slice("out", 0, main)),))
        else:
            mine = [e for i, e in enumerate(shape.nodes[k]) if i >= R and i % R == j]
            for i, e in enumerate(mine):
                pre.append((RecvReduce(e, Slice("out", 0, main),
                                       acc=Slice("in", 0, main) if i == 0 else None),))
                post.append((Send(e, Slice("out", 0, main)),))
            if mine:
                src = "out"
    fr: list[list[Stage]] = []
    tmp = 0
    if main and j < R:
        for off, qf in _frag_blocks(q, frags):
            a = R * off                       # this fragment: [a, a + R*qf) of the vector
            t0 = tmp                           # its scratch: my shard, then the stages'
            rs = stage("reduce_scatter", pick("reduce_scatter", R, R * qf * isz, "node"), core,
                       rank, qf, 0, {"in": (src, a), "out": ("tmp", t0)}, t0 + qf)
            ar = stage("allreduce", pick("allreduce", N, qf * isz, "net"), shape.rail(j),
                       rank, qf, 0, {"in": ("tmp", t0), "out": ("tmp", t0)}, t0 + qf)
            ag = stage("allgather", pick("allgather", R, R * qf * isz, "node"), core,
                       rank, qf, 0, {"in": ("tmp", t0), "out": ("out", a)}, t0 + qf)
            fr.append([rs, ar, ag])
            tmp = max(rs.tmp_end, ar.tmp_end, ag.tmp_end)
    sched = Schedule(tuple(pre), 0).then(compose(fr, tmp)).then(Schedule(tuple(post), 0))
    tail = n - main
    if tail:
        everyone = tuple(sorted(r for rs in shape.nodes for r in rs))
        st = stage("allreduce", pick("allreduce", shape.p, tail * isz, "net"), everyone, rank,
                   tail, 0, {"in": ("in", main), "out": ("out", main)}, sched.tmp)
        sched = sched.then(Schedule(st.steps, st.tmp_end))
    return sched


def _reduce_scatter(shape: Shape, rank: int, n: int, isz: int, pick: Pick,
                    frags: int) -> Schedule:
    k, j = shape.where(rank)
    R, N = shape.R, shape.nnodes
    core, rail = shape.nodes[k], shape.rail(j)
    fr, tmp = [], 0
    for off, nf in _frag_blocks(n, frags):
        A = tmp                      # rail-major copy of my input: (rail, node) blocks of nf
        B = A + R * N * nf           # the node's partial sums of my rail's blocks
        perm = [Copy(Slice("in", g * n + off, nf), Slice("tmp", A + (jj * N + kk) * nf, nf))
                for kk, rs in enumerate(shape.nodes) for jj, g in enumerate(rs)]
        rs1 = stage("reduce_scatter", pick("reduce_scatter", R, R * N * nf * isz, "node"), core,
                    rank, N * nf, 0, {"in": ("tmp", A), "out": ("tmp", B)}, B + N * nf)
        rs2 = stage("reduce_scatter", pick("reduce_scatter", N, N * nf * isz, "net"), rail,
                    rank, nf, 0, {"in": ("tmp", B), "out": ("out", off)}, B + N * nf)
        fr.append([local(perm), rs1, rs2])
        tmp = max(rs1.tmp_end, rs2.tmp_end)
    return compose(fr, tmp)


def _allgather(shape: Shape, rank: int, n: int, isz: int, pick: Pick, frags: int) -> Schedule:
    k, j = shape.where(rank)
    R, N = shape.R, shape.nnodes
    core, rail = shape.nodes[k], shape.rail(j)
    fr, tmp = [], 0
    for off, nf in _frag_blocks(n, frags):
        B = tmp                      # my rail's blocks, by node
        C = B + N * nf               # every block, rail-major
        ag1 = stage("allgather", pick("allgather", N, N * nf * isz, "net"), rail, rank, nf, 0,
                    {"in": ("in", off), "out": ("tmp", B)}, C + R * N * nf)
        ag2 = stage("allgather", pick("allgather", R, R * N * nf * isz, "node"), core, rank,
                    N * nf, 0, {"in": ("tmp", B), "out": ("tmp", C)}, C + R * N * nf)
        perm = [Copy(Slice("tmp", C + (jj * N + kk) * nf, nf), Slice("out", g * n + off, nf))
                for kk, rs in enumerate(shape.nodes) for jj, g in enumerate(rs)]
        fr.append([ag1, ag2, local(perm)])
        tmp = max(ag1.tmp_end, ag2.tmp_end)
    return compose(fr, tmp)


def _rooted(shape: Shape, rank: int, root: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(the root's node, one representative per node — the root on its node, local rank 0
    elsewhere —, this rank's node)."""
    kr, _ = shape.where(root)
    reps = tuple(root if kk == kr else rs[0] for kk, rs in enumerate(shape.nodes))
    return kr, reps, shape.nodes[shape.where(rank)[0]]


def _broadcast(shape: Shape, rank: int, n: int, root: int, isz: int, pick: Pick,
               frags: int) -> Schedule:
    k, reps, node = _rooted(shape, rank, root)
    mine = reps[shape.nodes.index(node)]
    fr, tmp = [], 0
    for off, nf in _frag_blocks(n, frags):
        roles = {"in": ("in", off), "out": ("out", off)}
        net = stage("broadcast", pick("broadcast", len(reps), nf * isz, "net"), reps, rank,
                    nf, k, roles, tmp)
        loc = stage("broadcast", pick("broadcast", len(node), nf * isz, "node"), node, rank,
                    nf, node.index(mine), roles, net.tmp_end)
        fr.append([net, loc])
        tmp = max(net.tmp_end, loc.tmp_end)
    return compose(fr, tmp)


def _reduce(shape: Shape, rank: int, n: int, root: int, isz: int, pick: Pick,
            frags: int) -> Schedule:
    k, reps, node = _rooted(shape, rank, root)
    rep = reps[shape.nodes.index(node)]
    fr, tmp = [], 0
    for off, nf in _frag_blocks(n, frags):
        P = tmp                      # a representative's node sum (the root: its out)
        Q = P + nf                   # where non-roots' unused "out" points
        part = ("out", off) if rank == root else ("tmp", P)
        loc = stage("reduce", pick("reduce", len(node), nf * isz, "node"), node, rank, nf,
                    node.index(rep), {"in": ("in", off),
                                      "out": part if rank == rep else ("tmp", Q)}, Q + nf)
        net = stage("reduce", pick("reduce", len(reps), nf * isz, "net"), reps, rank, nf, k,
                    {"in": part, "out": ("out", off) if rank == root else ("tmp", Q)},
                    loc.tmp_end)
        fr.append([loc, net])
        tmp = max(loc.tmp_end, net.tmp_end)
    return compose(fr, tmp)
