"""Recursive doubling and halving: allreduce, reduce-scatter and allgather in ⌊lg p⌋ rounds.

How it works: with p' = 2^L ranks, round k pairs rank j with its *partner* j XOR 2^k
(doubling: distance 1, 2, 4, ...; halving: distance p'/2, ..., 1).

- allreduce "recursive_doubling": partners swap their whole vector and both reduce it,
  L rounds of n elements.  The incoming vector lands in scratch and is reduced into
  ``out`` at the start of the next step (a step's local ops run before its sends).
- allreduce "rabenseifner": reduce-scatter by recursive halving (each round a rank keeps
  the half of its *window* of blocks on its side of the partner, sends the other half
  and reduces what the partner sends for the kept half; after L rounds rank j owns the
  reduced block j of ``blocks(n, p')``), then allgather by recursive doubling (windows
  grow back 1, 2, 4, ... blocks).  Bandwidth-optimal, 2L messages.
- reduce_scatter "recursive_halving": the halving half of Rabenseifner on the p blocks of
  the p·n input, partial sums in scratch; the last round reduces straight into ``out``.
- allgather "recursive_doubling": the doubling half, windows of finished blocks.
- allgather "bruck": rank r sends its first min(2^k, p-2^k) blocks (counted from its
  own, cyclically) to r-2^k and receives as many from r+2^k, for any p in ⌈lg p⌉
  rounds.  Blocks land straight at their place in ``out``: a cyclic run of blocks is
  at most two contiguous *pieces*, and sender and receiver split the run identically.

The *fold* handles p that is not a power of two (p' = pof2_floor(p), rem = p - p'):
ranks 0..2·rem-1 pair up, each even one sends its input to its odd neighbour and sits
out; the p' survivors get *new ranks* (odd r < 2·rem -> r // 2, r >= 2·rem -> r - rem)
and run the power-of-two algorithm; finally each odd rank sends the result back.  For
reduce-scatter and allgather a survivor with new rank j < rem stands for the two old
blocks 2j, 2j+1 (a *super-block*); super-blocks are contiguous and in order.

Cost (S bytes, L = ⌊lg p⌋, f = 1 when p is not a power of two, else 0):
  allreduce recursive_doubling  (L+2f)·α + (L+2f)·S·β + (L+f)·S·γ
  allreduce rabenseifner        (2L+2f)·α + (2(p'-1)/p' + 2f)·S·β + ((p'-1)/p' + f)·S·γ
  reduce_scatter halving        (L+2f)·α + (p'-1)/p'·S·(β+γ) + f·(S·(β+γ) + S/p·β)
  allgather recursive_doubling  (L+2f)·α + ((p'-1)/p' + f·(1 + 1/p))·S·β
  allgather bruck               ⌈lg p⌉·α + (p-1)/p·S·β
"""

from __future__ import annotations

from ..schedule import Copy, Recv, RecvReduce, Reduce, Schedule, Send, Slice
from .base import Cost, blocks, lg, pof2_floor, register

# ---------------------------------------------------------------------------
# the fold for p that is not a power of two
# ---------------------------------------------------------------------------


def _fold(p: int) -> tuple[int, int]:
    """(p', rem): the power-of-two core and the number of folded pairs."""
    p2 = pof2_floor(p)
    return p2, p - p2


def _new_rank(r: int, rem: int) -> int:
    """r's rank among the p' survivors, or -1 if r is folded away (even r < 2·rem)."""
    if r < 2 * rem:
        return r // 2 if r % 2 else -1
    return r - rem


def _old_rank(j: int, rem: int) -> int:
    return 2 * j + 1 if j < rem else j + rem


def _super_lo(j: int, rem: int) -> int:
    """First old block of super-block j (j = p' gives p)."""
    return 2 * j if j < rem else j + rem


def _fold_terms(p: int) -> tuple[int, int, int]:
    """(p', L = lg p', f = 1 if p is not a power of two)."""
    p2 = pof2_floor(p)
    return p2, p2.bit_length() - 1, int(p != p2)


# ---------------------------------------------------------------------------
# allreduce
# ---------------------------------------------------------------------------


def _rd_allreduce_cost(p: int, S: float, c: Cost) -> float:
    _, L, f = _fold_terms(p)
    return (L + 2 * f) * c.alpha + (L + 2 * f) * S * c.beta + (L + f) * S * c.gamma


@register("allreduce", "recursive_doubling", cost=_rd_allreduce_cost)
def allreduce_recursive_doubling(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Partners swap whole vectors for ⌊lg p⌋ rounds (fold for p not a power of two)."""
    vin, vout, vtmp = Slice("in", 0, n), Slice("out", 0, n), Slice("tmp", 0, n)
    if p == 1:
        return Schedule.build([[Copy(vin, vout)]])
    p2, rem = _fold(p)
    j = _new_rank(r, rem)
    if j < 0:  # folded away: hand the input over, get the result back
        return Schedule.build([[Send(r + 1, vin)], [Recv(r + 1, vout)]])
    steps: list[list] = []
    have = "in"  # where my partial sum is now
    if r < 2 * rem:
        steps.append([RecvReduce(r - 1, vout, acc=vin)])
        have = "out"
    pending: list = []  # the reduction of the last incoming vector, run at the next step
    mask = 1
    while mask < p2:
        peer = _old_rank(j ^ mask, rem)
        steps.append(pending + [Send(peer, Slice(have, 0, n)), Recv(peer, vtmp)])
        # both partners compute (lower's partial) op (higher's partial): the same bits on
        # both, as on every rank in the end — NumPy's complex multiply (SIMD, FMA) and the
        # MIN/MAX of +0.0 and -0.0 depend on the operands' order, and "mine op yours" left
        # the ranks holding different results (NaN payloads excepted: NumPy's in-place and
        # out-of-place loops may keep different ones of two NaNs — architecture.md)
        if (j ^ mask) < j:
            pending = [Reduce(Slice(have, 0, n), vout, acc=vtmp)]
        else:
            pending = [Reduce(vtmp, vout, acc=vin if have == "in" else None)]
        have = "out"
        mask <<= 1
    last = list(pending)
    if r < 2 * rem:
        last.append(Send(r - 1, vout))
    steps.append(last)
    return Schedule.build(steps, tmp=n)


def _rabenseifner_cost(p: int, S: float, c: Cost) -> float:
    p2, L, f = _fold_terms(p)
    frac = (p2 - 1) / p2
    return ((2 * L + 2 * f) * c.alpha + (2 * frac + 2 * f) * S * c.beta
            + (frac + f) * S * c.gamma)


@register("allreduce", "rabenseifner", cost=_rabenseifner_cost)
def allreduce_rabenseifner(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Reduce-scatter by recursive halving, allgather by recursive doubling, in ``out``."""
    vin, vout = Slice("in", 0, n), Slice("out", 0, n)
    if p == 1:
        return Schedule.build([[Copy(vin, vout)]])
    p2, rem = _fold(p)
    j = _new_rank(r, rem)
    if j < 0:
        return Schedule.build([[Send(r + 1, vin)], [Recv(r + 1, vout)]])
    offs = [o for o, _ in blocks(n, p2)] + [n]

    def span(role: str, a: int, b: int) -> Slice:  # blocks a..b-1
        return Slice(role, offs[a], offs[b] - offs[a])

    steps: list[list] = []
    first = True  # the first reduction reads "in" (both what is sent and the accumulator)
    if r < 2 * rem:
        steps.append([RecvReduce(r - 1, vout, acc=vin)])
        first = False
    # reduce-scatter: recursive halving of the window [lo, hi) of blocks
    lo, hi, mask = 0, p2, p2 >> 1
    while mask:
        peer = _old_rank(j ^ mask, rem)
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if j & mask else ((lo, mid), (mid, hi))
        src = "in" if first else "out"
        acc = span("in", *keep) if first else None
        steps.append([Send(peer, span(src, *give)),
                      RecvReduce(peer, span("out", *keep), acc=acc)])
        first = False
        lo, hi = keep
        mask >>= 1
    # allgather: recursive doubling; my window is the aligned run of `mask` blocks holding j
    mask = 1
    while mask < p2:
        peer = _old_rank(j ^ mask, rem)
        mine = j & ~(mask - 1)
        theirs = mine ^ mask
        steps.append([Send(peer, span("out", mine, mine + mask)),
                      Recv(peer, span("out", theirs, theirs + mask))])
        mask <<= 1
    if r < 2 * rem:
        steps.append([Send(r - 1, vout)])
    return Schedule.build(steps)


# ---------------------------------------------------------------------------
# reduce-scatter
# ---------------------------------------------------------------------------


def _rh_rs_cost(p: int, S: float, c: Cost) -> float:
    p2, L, f = _fold_terms(p)
    return ((L + 2 * f) * c.alpha + (p2 - 1) / p2 * S * (c.beta + c.gamma)
            + f * (S * (c.beta + c.gamma) + S / p * c.beta))


@register("reduce_scatter", "recursive_halving", cost=_rh_rs_cost)
def reduce_scatter_recursive_halving(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Recursive halving over (super-)blocks; partial sums in scratch, block r into out."""
    N = p * n
    if p == 1:
        return Schedule.build([[Copy(Slice("in", 0, n), Slice("out", 0, n))]])
    p2, rem = _fold(p)
    j = _new_rank(r, rem)
    if j < 0:
        return Schedule.build([[Send(r + 1, Slice("in", 0, N))],
                               [Recv(r + 1, Slice("out", 0, n))]])

    def span(role: str, a: int, b: int) -> Slice:  # super-blocks a..b-1
        lo_e, hi_e = _super_lo(a, rem) * n, _super_lo(b, rem) * n
        return Slice(role, lo_e, hi_e - lo_e)

    def old_blocks(sb: int) -> range:
        return range(_super_lo(sb, rem), _super_lo(sb + 1, rem))

    steps: list[list] = []
    first = True
    if r < 2 * rem:
        steps.append([RecvReduce(r - 1, Slice("tmp", 0, N), acc=Slice("in", 0, N))])
        first = False
    lo, hi, mask = 0, p2, p2 >> 1
    while mask:
        peer = _old_rank(j ^ mask, rem)
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if j & mask else ((lo, mid), (mid, hi))
        src = "in" if first else "tmp"
        if mask > 1:
            acc = span("in", *keep) if first else None
            steps.append([Send(peer, span(src, *give)),
                          RecvReduce(peer, span("tmp", *keep), acc=acc)])
        else:
            # last round: one message per old block of the receiver's super-block, so
            # that my own block reduces straight into "out"
            ops: list = [Send(peer, Slice(src, b * n, n)) for b in old_blocks(give[0])]
            for b in old_blocks(keep[0]):
                blk_in = Slice(src, b * n, n)
                if b == r:
                    ops.append(RecvReduce(peer, Slice("out", 0, n), acc=blk_in))
                else:
                    ops.append(RecvReduce(peer, Slice("tmp", b * n, n),
                                          acc=blk_in if first else None))
            steps.append(ops)
        first = False
        lo, hi = keep
        mask >>= 1
    if r < 2 * rem:
        steps.append([Send(r - 1, Slice("tmp", (r - 1) * n, n))])
    return Schedule.build(steps, tmp=N)


# ---------------------------------------------------------------------------
# allgather
# ---------------------------------------------------------------------------


def _rd_ag_cost(p: int, S: float, c: Cost) -> float:
    p2, L, f = _fold_terms(p)
    return (L + 2 * f) * c.alpha + ((p2 - 1) / p2 + f * (1 + 1 / p)) * S * c.beta


@register("allgather", "recursive_doubling", cost=_rd_ag_cost)
def allgather_recursive_doubling(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Windows of finished (super-)blocks double each round (fold for p not a power of two)."""
    N = p * n
    own = Copy(Slice("in", 0, n), Slice("out", r * n, n))
    if p == 1:
        return Schedule.build([[own]])
    p2, rem = _fold(p)
    j = _new_rank(r, rem)
    if j < 0:
        return Schedule.build([[Send(r + 1, Slice("in", 0, n))],
                               [Recv(r + 1, Slice("out", 0, N))]])

    def span(a: int, b: int) -> Slice:  # super-blocks a..b-1 of out
        lo_e, hi_e = _super_lo(a, rem) * n, _super_lo(b, rem) * n
        return Slice("out", lo_e, hi_e - lo_e)

    steps: list[list] = []
    pre: list = [own]  # local ops for the next step
    if r < 2 * rem:
        steps.append(pre + [Recv(r - 1, Slice("out", (r - 1) * n, n))])
        pre = []
    mask = 1
    while mask < p2:
        peer = _old_rank(j ^ mask, rem)
        mine = j & ~(mask - 1)
        theirs = mine ^ mask
        steps.append(pre + [Send(peer, span(mine, mine + mask)),
                            Recv(peer, span(theirs, theirs + mask))])
        pre = []
        mask <<= 1
    if r < 2 * rem:
        steps.append([Send(r - 1, Slice("out", 0, N))])
    return Schedule.build(steps)


def _pieces(start: int, count: int, p: int) -> list[tuple[int, int]]:
    """Blocks start, start+1, ... (count of them, mod p) as contiguous (first, count) runs."""
    if start + count <= p:
        return [(start, count)]
    return [(start, p - start), (0, count - (p - start))]


@register("allgather", "bruck",
          cost=lambda p, S, c: lg(p) * c.alpha + (p - 1) / p * S * c.beta)
def allgather_bruck(p: int, r: int, n: int, root: int = 0) -> Schedule:
    """Bruck's allgather: ⌈lg p⌉ rounds for any p, blocks placed directly in out."""
    steps: list[list] = [[Copy(Slice("in", 0, n), Slice("out", r * n, n))]]
    d = 1
    while d < p:
        c = min(d, p - d)
        to, frm = (r - d) % p, (r + d) % p
        steps[-1] += [Send(to, Slice("out", a * n, k * n)) for a, k in _pieces(r, c, p)]
        steps[-1] += [Recv(frm, Slice("out", a * n, k * n)) for a, k in _pieces(frm, c, p)]
        steps.append([])
        d <<= 1
    return Schedule.build(steps)
