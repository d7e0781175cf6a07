"""Direct algorithms: every rank talks to every rank it needs in a single step.

How it works: all messages of the collective are posted at once (p-1 sends and/or
receives per rank), so latency is one message time however large p is; the price is
bandwidth (a rank sends its whole vector p-1 times for allreduce).  This is the
small-message path: over ``shm`` each message is one eager slot write and read.
Reductions happen locally in global rank order (x0 op x1 op ... op x_{p-1}), so every
rank computes bitwise the same result.

Cost (S bytes): allreduce / allgather / reduce_scatter / alltoall / gather / scatter
(p-1)·α + S·(p-1)·β (+ S·(p-1)·γ for the reductions); broadcast / reduce the same with the
root doing all the work.
"""

from __future__ import annotations

from ..schedule import Copy, Recv, Reduce, Schedule, Send, Slice
from .base import register


def _reduce_in_order(p: int, r: int, n: int, dst: str, tmp_of) -> list:
    """Local reduction x0 op x1 op ... in rank order into ``dst`` (role), where
    ``tmp_of(q)`` is the slice that holds rank q's vector (``in`` for r itself)."""
    if p == 1:
        return [Copy(tmp_of(0), Slice(dst, 0, n))]
    first = [Reduce(tmp_of(1), Slice(dst, 0, n), acc=tmp_of(0))]
    return first + [Reduce(tmp_of(q), Slice(dst, 0, n)) for q in range(2, p)]


def _slot(r: int, n: int, src: str = "in", base: int = 0):
    """Rank q's vector: my own input for q == r, else slot q of tmp (slot r unused)."""
    return lambda q: Slice(src, base, n) if q == r else Slice("tmp", q * n, n)


@register("allreduce", "direct",
          cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) * (c.beta + c.gamma))
def allreduce_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Send the vector to all, receive all, reduce in rank order."""
    if p == 1:      # one copy out of place, nothing in place (not two through tmp)
        return _one_copy(n)
    others = [q for q in range(p) if q != r]
    exch = [Send(q, Slice("in", 0, n)) for q in others] + \
           [Recv(q, Slice("tmp", q * n, n)) for q in others]
    # in place, "out" aliases "in", which the rank-order reduce reads for slot r:
    # reduce into tmp slot r first... slot r of tmp is free, so accumulate there
    # and copy out.  Out of place we could skip the copy, but schedules are built
    # once for both cases and the copy is of a small vector.
    red = _reduce_in_order(p, r, n, "tmp", _slot(r, n))
    acc = Slice("tmp", r * n, n)
    red = [_retarget(o, acc) for o in red]
    return Schedule.build([exch, red + [Copy(acc, Slice("out", 0, n))]], tmp=p * n)


def _one_copy(n: int) -> Schedule:
    """One rank: ``out`` = ``in`` (the executor skips the copy when they alias)."""
    return Schedule.build([[Copy(Slice("in", 0, n), Slice("out", 0, n))]])


def _retarget(op, dst: Slice):
    if isinstance(op, Copy):
        return Copy(op.src, dst)
    return Reduce(op.src, dst, op.acc)


@register("reduce", "direct",
          cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) * (c.beta + c.gamma))
def reduce_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Everyone sends to the root, which reduces in rank order."""
    if p == 1:
        return _one_copy(n)
    if r != root:
        return Schedule.build([[Send(root, Slice("in", 0, n))]])
    others = [q for q in range(p) if q != r]
    recv = [Recv(q, Slice("tmp", q * n, n)) for q in others]
    red = [_retarget(o, Slice("tmp", r * n, n)) for o in _reduce_in_order(p, r, n, "tmp", _slot(r, n))]
    return Schedule.build([recv, red + [Copy(Slice("tmp", r * n, n), Slice("out", 0, n))]],
                          tmp=p * n)


@register("broadcast", "direct", cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) * c.beta)
def broadcast_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """The root sends the vector to every other rank."""
    if r == root:
        return Schedule.build([[Send(q, Slice("out", 0, n)) for q in range(p) if q != r]])
    return Schedule.build([[Recv(root, Slice("out", 0, n))]])


@register("allgather", "direct", cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) / p * c.beta)
def allgather_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Send my block to all, receive every block into place."""
    others = [q for q in range(p) if q != r]
    return Schedule.build([[Copy(Slice("in", 0, n), Slice("out", r * n, n))]
                           + [Send(q, Slice("in", 0, n)) for q in others]
                           + [Recv(q, Slice("out", q * n, n)) for q in others]])


@register("reduce_scatter", "direct",
          cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) / p * (c.beta + c.gamma))
def reduce_scatter_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Send block q to rank q, receive block r from all, reduce in rank order."""
    others = [q for q in range(p) if q != r]
    exch = [Send(q, Slice("in", q * n, n)) for q in others] + \
           [Recv(q, Slice("tmp", q * n, n)) for q in others]
    return Schedule.build([exch, _reduce_in_order(p, r, n, "out", _slot(r, n, "in", r * n))],
                          tmp=p * n if p > 1 else 0)


@register("alltoall", "direct", cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) / p * c.beta)
def alltoall_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Post every block's send and receive at once."""
    others = [q for q in range(p) if q != r]
    return Schedule.build([[Copy(Slice("in", r * n, n), Slice("out", r * n, n))]
                           + [Send(q, Slice("in", q * n, n)) for q in others]
                           + [Recv(q, Slice("out", q * n, n)) for q in others]])


@register("gather", "direct", cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) / p * c.beta)
def gather_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Everyone sends its block to the root."""
    if r != root:
        return Schedule.build([[Send(root, Slice("in", 0, n))]])
    return Schedule.build([[Copy(Slice("in", 0, n), Slice("out", r * n, n))]
                           + [Recv(q, Slice("out", q * n, n)) for q in range(p) if q != r]])


@register("scatter", "direct", cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) / p * c.beta)
def scatter_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """The root sends block q to rank q."""
    if r != root:
        return Schedule.build([[Recv(root, Slice("out", 0, n))]])
    return Schedule.build([[Copy(Slice("in", r * n, n), Slice("out", 0, n))]
                           + [Send(q, Slice("in", q * n, n)) for q in range(p) if q != r]])


@register("barrier", "direct", cost=lambda p, S, c: 2 * (p - 1) * c.alpha)
def barrier_direct(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Gather-to-0 then release: two steps of empty messages."""
    z = Slice("tmp", 0, 0)
    if r == 0:
        return Schedule.build([[Recv(q, z) for q in range(1, p)], [Send(q, z) for q in range(1, p)]])
    return Schedule.build([[Send(0, z)], [Recv(0, z)]])
