"""Ring algorithms: reduce-scatter, allgather and allreduce (= the two in sequence).

How it works: the vector is cut into p *blocks* (``blocks(n, p)``, uneven when p does not
divide n).  Rank r sends to r+1 and receives from r-1.  In reduce-scatter step k
(k = 0..p-2) rank r sends block (r-k-1) mod p — the partial sum it received in step
k-1, or its own input at k = 0 — and reduces the incoming block (r-k-2) mod p into
place; after p-1 steps it owns the full reduction of block r.  Allgather passes the
finished blocks around the same ring for p-1 more steps.  Bandwidth-optimal: each rank
sends 2n(p-1)/p bytes; latency-poor: 2(p-1) messages.

Cost (S bytes): allreduce 2(p-1)·α + 2S(p-1)/p·β + S(p-1)/p·γ;
allgather and reduce-scatter (S = the whole p-block buffer) (p-1)·α + S(p-1)/p·β (+ S(p-1)/p·γ).
"""

from __future__ import annotations

from ..schedule import Copy, Recv, RecvReduce, Schedule, Send, Slice
from .base import blocks, register


def _rs_steps(p: int, r: int, blk: list[tuple[int, int]], src: str, work: str,
              final: tuple[str, int] | None) -> list[list]:
    """Ring reduce-scatter over blocks ``blk``: input role ``src`` (read only), partial
    sums in role ``work`` at the blocks' offsets; the finished block r lands in
    ``final = (role, offset)`` (or stays in ``work`` when None)."""
    right, left = (r + 1) % p, (r - 1) % p
    steps = []
    for k in range(p - 1):
        sb = (r - k - 1) % p
        rb = (r - k - 2) % p
        s_off, s_len = blk[sb]
        r_off, r_len = blk[rb]
        send = Send(right, Slice(src if k == 0 else work, s_off, s_len))
        if k == p - 2 and final is not None:
            dst = Slice(final[0], final[1], r_len)
        else:
            dst = Slice(work, r_off, r_len)
        steps.append([send, RecvReduce(left, dst, acc=Slice(src, r_off, r_len))])
    return steps


def _ag_steps(p: int, r: int, blk: list[tuple[int, int]], role: str, base: int = 0) -> list[list]:
    """Ring allgather of the blocks ``blk`` living in ``role`` at ``base``: rank r holds
    block r, and after p-1 steps every block."""
    right, left = (r + 1) % p, (r - 1) % p
    steps = []
    for k in range(p - 1):
        sb = (r - k) % p
        rb = (r - k - 1) % p
        steps.append([Send(right, Slice(role, base + blk[sb][0], blk[sb][1])),
                      Recv(left, Slice(role, base + blk[rb][0], blk[rb][1]))])
    return steps


def _ring_ar(p: int, S: float, c) -> float:
    return 2 * (p - 1) * c.alpha + 2 * S * (p - 1) / p * c.beta + S * (p - 1) / p * c.gamma


@register("allreduce", "ring", cost=_ring_ar)
def allreduce_ring(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Ring reduce-scatter then ring allgather, in the output buffer."""
    if p == 1:
        return Schedule.build([[Copy(Slice("in", 0, n), Slice("out", 0, n))]])
    blk = blocks(n, p)
    # Reduce-scatter reads "in" for every block's first contribution and accumulates in
    # "out"; the block it sends at step k>0 is one it reduced into "out" at step k-1.
    # In place, "in" and "out" alias: a block of "in" is read (as acc) exactly once,
    # before the same block of "out" is written, so aliasing is safe.
    steps = _rs_steps(p, r, blk, "in", "out", None)
    # the finished block r is in "out"; pass the blocks around the ring
    steps += _ag_steps(p, r, blk, "out")
    return Schedule.build(steps)


@register("reduce_scatter", "ring",
          cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) / p * (c.beta + c.gamma))
def reduce_scatter_ring(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Ring reduce-scatter; partial sums in scratch, the final block straight into out."""
    if p == 1:
        return Schedule.build([[Copy(Slice("in", 0, n), Slice("out", 0, n))]])
    blk = [(i * n, n) for i in range(p)]
    return Schedule.build(_rs_steps(p, r, blk, "in", "tmp", ("out", 0)), tmp=p * n)


@register("allgather", "ring", cost=lambda p, S, c: (p - 1) * c.alpha + S * (p - 1) / p * c.beta)
def allgather_ring(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Own block into place, then p-1 ring steps."""
    blk = [(i * n, n) for i in range(p)]
    steps = [[Copy(Slice("in", 0, n), Slice("out", r * n, n))]] + _ag_steps(p, r, blk, "out")
    return Schedule.build(steps)
