"""The algorithm registry and the helpers every algorithm module shares.

An algorithm is a pure function ``build(p, r, n, root) -> Schedule``: the schedule
of group index ``r`` out of ``p`` for a collective of per-rank count ``n`` (see
``gpurt.schedule.SPECS`` for what ``n`` means per collective), with peers as
group indices.  Next to it sits its α-β-γ cost formula, used by the tuner.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2
from typing import Callable

from ..schedule import Schedule


@dataclass(frozen=True)
class Cost:
    """α: seconds per message; β: seconds per byte moved; γ: seconds per byte reduced."""

    alpha: float
    beta: float
    gamma: float


@dataclass(frozen=True)
class Algorithm:
    coll: str
    name: str
    build: Callable[[int, int, int, int], Schedule]
    # (p, nbytes, cost) -> predicted seconds.  nbytes is the collective's size S
    # as nccl-tests counts it: the vector for allreduce/reduce/broadcast, the
    # whole p-block buffer for allgather/reduce_scatter/alltoall/gather/scatter.
    cost: Callable[[int, float, Cost], float]
    doc: str = ""


REGISTRY: dict[str, dict[str, Algorithm]] = {}

# names people type in GPURT_ALGO, mapped to the registry's names
ALIASES = {
    "tree": "binomial",
    "rd": "recursive_doubling",
    "rh": "recursive_halving",
    "halving_doubling": "rabenseifner",
    "rhd": "rabenseifner",
    "scatter_ag": "scatter_allgather",
    "linear": "direct",
}


def register(coll: str, name: str, cost: Callable[[int, float, Cost], float], doc: str = ""):
    """Decorator: ``@register("allreduce", "ring", cost=...)`` on a build function."""

    def deco(fn: Callable[[int, int, int, int], Schedule]):
        if name in REGISTRY.setdefault(coll, {}):
            raise ValueError(f"algorithm {coll}:{name} registered twice")
        REGISTRY[coll][name] = Algorithm(coll, name, fn, cost, doc or (fn.__doc__ or "").strip())
        return fn

    return deco


def lookup(coll: str, name: str) -> Algorithm:
    name = ALIASES.get(name, name)
    try:
        return REGISTRY[coll][name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY.get(coll, {})))
        raise ValueError(f"unknown algorithm {name!r} for {coll} (known: {known})") from None


def blocks(n: int, k: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``k`` contiguous blocks ``(offset, length)``.

    The first ``n % k`` blocks get one element more; blocks may be empty.
    """
    q, rem = divmod(n, k)
    out, off = [], 0
    for i in range(k):
        ln = q + (1 if i < rem else 0)
        out.append((off, ln))
        off += ln
    return out


def lg(p: int) -> int:
    """⌈log2 p⌉ (0 for p = 1)."""
    return ceil(log2(p)) if p > 1 else 0


def pof2_floor(p: int) -> int:
    """Largest power of two ≤ p."""
    return 1 << (p.bit_length() - 1)
