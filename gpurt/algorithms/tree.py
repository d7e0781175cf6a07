"""Binomial trees: broadcast, reduce, gather, scatter; and van de Geijn's broadcast.

How it works: ranks are renumbered *relative* to the root, v = (r - root) mod p, so the
root is 0.  In the binomial tree the *parent* of v > 0 is v with its lowest set bit
cleared; v's *subtree* is the run of relative ranks [v, v + lowbit(v)) cut at p (the
root's is all of [0, p)), and its *children* are v + m for m = lowbit(v)/2, ..., 2, 1
(root: m below the smallest power of two >= p) while v + m < p.  Data flows down the tree
(broadcast, scatter: biggest subtree first) or up (reduce, gather: smallest first).

A subtree's blocks are contiguous in relative order, but in ``in``/``out`` blocks sit in
absolute order, so a relative run may wrap past p-1 into 0; such a run travels as two
*pieces*, split identically by sender and receiver.  Non-root inner nodes of gather and
scatter stage their subtree's blocks in scratch (relative order).  Reduce accumulates in
scratch on non-root ranks and in ``out`` on the root; leaves send straight from ``in``.

broadcast "scatter_allgather" (van de Geijn): the vector is cut into p blocks
(``blocks(n, p)``, relative rank v owns block v); a binomial scatter hands each rank its
subtree's blocks, then a ring allgather (v sends to v+1) circulates the blocks.

Cost (S bytes, lg = ⌈log2 p⌉):
  broadcast binomial          lg·(α + S·β)
  broadcast scatter_allgather (lg + p - 1)·α + 2·(p-1)/p·S·β
  reduce binomial             lg·(α + S·β + S·γ)
  gather / scatter binomial   lg·α + (p-1)/p·S·β     (S: the root's p-block buffer)
"""

from __future__ import annotations

from typing import Iterator

from ..schedule import Copy, Recv, RecvReduce, Schedule, Send, Slice
from .base import blocks, lg, register

# ---------------------------------------------------------------------------
# tree shape in relative ranks
# ---------------------------------------------------------------------------


def _span(v: int, p: int) -> int:
    """lowbit(v), or for the root the smallest power of two >= p."""
    return v & -v if v else 1 << (p - 1).bit_length()


def _subtree(v: int, p: int) -> int:
    """Number of relative ranks in v's subtree [v, v + size)."""
    return min(_span(v, p), p - v)


def _parent(v: int) -> int:
    return v - (v & -v)


def _children(v: int, p: int) -> Iterator[tuple[int, int]]:
    """(child, subtree size), biggest subtree first."""
    m = _span(v, p) >> 1
    while m:
        if v + m < p:
            yield v + m, min(m, p - v - m)
        m >>= 1


def _pieces(u: int, s: int, p: int, root: int) -> list[tuple[int, int]]:
    """Relative run [u, u+s) as (first, count) runs contiguous in absolute order."""
    w = (p - root) % p  # the relative rank whose absolute rank is 0
    if u < w < u + s:
        return [(u, w - u), (w, u + s - w)]
    return [(u, s)]


# ---------------------------------------------------------------------------
# broadcast
# ---------------------------------------------------------------------------


@register("broadcast", "binomial", cost=lambda p, S, c: lg(p) * (c.alpha + S * c.beta))
def broadcast_binomial(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Receive the vector from the parent, forward it to each child, biggest subtree first."""
    v = (r - root) % p
    vec = Slice("out", 0, n)
    steps: list[list] = []
    if v:
        steps.append([Recv((_parent(v) + root) % p, vec)])
    for c, _ in _children(v, p):
        steps.append([Send((c + root) % p, vec)])
    return Schedule.build(steps)


@register("broadcast", "scatter_allgather",
          cost=lambda p, S, c: (lg(p) + p - 1) * c.alpha + 2 * (p - 1) / p * S * c.beta)
def broadcast_scatter_allgather(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Binomial scatter of p blocks from the root, then a ring allgather of the blocks."""
    v = (r - root) % p
    offs = [o for o, _ in blocks(n, p)] + [n]

    def run(a: int, b: int) -> Slice:  # blocks a..b-1 (relative ranks' blocks)
        return Slice("out", offs[a], offs[b] - offs[a])

    steps: list[list] = []
    if v:
        steps.append([Recv((_parent(v) + root) % p, run(v, v + _subtree(v, p)))])
    for c, s in _children(v, p):
        steps.append([Send((c + root) % p, run(c, c + s))])
    right, left = (r + 1) % p, (r - 1) % p
    for k in range(p - 1):
        sb, rb = (v - k) % p, (v - k - 1) % p
        steps.append([Send(right, run(sb, sb + 1)), Recv(left, run(rb, rb + 1))])
    return Schedule.build(steps)


# ---------------------------------------------------------------------------
# reduce
# ---------------------------------------------------------------------------


@register("reduce", "binomial",
          cost=lambda p, S, c: lg(p) * (c.alpha + S * c.beta + S * c.gamma))
def reduce_binomial(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Reduce the children's partial sums (smallest subtree first), pass the sum up."""
    v = (r - root) % p
    acc_role = "out" if v == 0 else "tmp"
    vin, acc = Slice("in", 0, n), Slice(acc_role, 0, n)
    have = "in"
    steps: list[list] = []
    for c, _ in reversed(list(_children(v, p))):
        steps.append([RecvReduce((c + root) % p, acc, acc=vin if have == "in" else None)])
        have = acc_role
    if v:
        steps.append([Send((_parent(v) + root) % p, Slice(have, 0, n))])
    elif have == "in":  # p == 1
        steps.append([Copy(vin, acc)])
    return Schedule.build(steps, tmp=n if v and have != "in" else 0)


# ---------------------------------------------------------------------------
# gather / scatter
# ---------------------------------------------------------------------------


@register("gather", "binomial",
          cost=lambda p, S, c: lg(p) * c.alpha + (p - 1) / p * S * c.beta)
def gather_binomial(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Children's subtrees gather into scratch (relative order), then go up as one run."""
    v = (r - root) % p
    kids = list(_children(v, p))
    if v == 0:  # everything lands in place in out (absolute order)
        step: list = [Copy(Slice("in", 0, n), Slice("out", r * n, n))]
        for c, s in reversed(kids):
            step += [Recv((c + root) % p, Slice("out", ((a + root) % p) * n, k * n))
                     for a, k in _pieces(c, s, p, root)]
        return Schedule.build([step])
    parent = (_parent(v) + root) % p
    if not kids:
        return Schedule.build([[Send(parent, Slice("in", 0, n))]])
    size = _subtree(v, p)
    step = [Copy(Slice("in", 0, n), Slice("tmp", 0, n))]
    for c, s in reversed(kids):
        step += [Recv((c + root) % p, Slice("tmp", (a - v) * n, k * n))
                 for a, k in _pieces(c, s, p, root)]
    up = [Send(parent, Slice("tmp", (a - v) * n, k * n)) for a, k in _pieces(v, size, p, root)]
    return Schedule.build([step, up], tmp=size * n)


@register("scatter", "binomial",
          cost=lambda p, S, c: lg(p) * c.alpha + (p - 1) / p * S * c.beta)
def scatter_binomial(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """The root sends each child its subtree's blocks; inner nodes stage them in scratch."""
    v = (r - root) % p
    kids = list(_children(v, p))
    if v == 0:
        def src(a: int, k: int) -> Slice:
            return Slice("in", ((a + root) % p) * n, k * n)
        pre: list = [Copy(Slice("in", r * n, n), Slice("out", 0, n))]
        steps: list[list] = []
    else:
        parent = (_parent(v) + root) % p
        if not kids:
            return Schedule.build([[Recv(parent, Slice("out", 0, n))]])

        def src(a: int, k: int) -> Slice:
            return Slice("tmp", (a - v) * n, k * n)
        steps = [[Recv(parent, src(a, k)) for a, k in _pieces(v, _subtree(v, p), p, root)]]
        pre = [Copy(Slice("tmp", 0, n), Slice("out", 0, n))]
    for c, s in kids:
        steps.append(pre + [Send((c + root) % p, src(a, k)) for a, k in _pieces(c, s, p, root)])
        pre = []
    if pre:  # p == 1
        steps.append(pre)
    return Schedule.build(steps, tmp=_subtree(v, p) * n if v else 0)
