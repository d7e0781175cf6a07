"""Pairwise exchange (alltoall) and the dissemination barrier.

How it works:
- alltoall "pairwise": rank r copies its own block, then in step k = 1..p-1 sends block
  (r+k) mod p of ``in`` to rank r+k and receives block (r-k) mod p of ``out`` from rank
  r-k.  Each step is a permutation of the ranks, so every link carries one block at a
  time and no rank is a hot spot.  Cost (S: the whole p-block buffer):
  (p-1)·α + (p-1)/p·S·β.
- barrier "dissemination" (Hensgen, Finkel & Manber): in round k = 0..⌈lg p⌉-1 rank r
  sends an empty message to r + 2^k and receives one from r - 2^k.  After round k a rank
  has heard, transitively, from the 2^(k+1) - 1 ranks before it, so after ⌈lg p⌉ rounds
  from all.  Cost: ⌈lg p⌉·α.
"""

from __future__ import annotations

from ..schedule import Copy, Recv, Schedule, Send, Slice
from .base import lg, register


@register("alltoall", "pairwise",
          cost=lambda p, S, c: (p - 1) * c.alpha + (p - 1) / p * S * c.beta)
def alltoall_pairwise(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Own block by copy, then p-1 steps: send to r+k, receive from r-k."""
    steps: list[list] = [[Copy(Slice("in", r * n, n), Slice("out", r * n, n))]]
    for k in range(1, p):
        to, frm = (r + k) % p, (r - k) % p
        steps[-1] += [Send(to, Slice("in", to * n, n)), Recv(frm, Slice("out", frm * n, n))]
        steps.append([])
    return Schedule.build(steps)


@register("barrier", "dissemination", cost=lambda p, S, c: lg(p) * c.alpha)
def barrier_dissemination(p: int, r: int, n: int = 0, root: int = 0) -> Schedule:
    """⌈lg p⌉ rounds of empty messages to r + 2^k, from r - 2^k."""
    none = Slice("tmp", 0, 0)
    steps: list[list] = []
    d = 1
    while d < p:
        steps.append([Send((r + d) % p, none), Recv((r - d) % p, none)])
        d <<= 1
    return Schedule.build(steps)
