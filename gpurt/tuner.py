"""Picks an algorithm per (collective, size, group) from an α-β-γ cost model.

Each transport brings cost constants (α seconds per message, β seconds per byte moved,
γ seconds per byte reduced); a group's constants are those of the slowest transport its
ranks use (``GPURT_COST`` overrides them).  For a call, every registered algorithm of the
collective is costed with its formula (``gpurt.algorithms``) and the cheapest wins;
``GPURT_ALGO`` forces a choice.  Plans — the algorithm and the built, relabelled
schedule — are cached per (collective, algorithm, count, root).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from . import config, hier
from .algorithms import ALIASES, REGISTRY, Algorithm, Cost, lookup
from .schedule import SPECS, Schedule

# defaults per transport, fitted roughly to `gpurt tune` runs on 2-vCPU VMs (noisy; a
# profile from `gpurt tune` on the target machine beats them); `GPURT_COST` overrides.
# When a node runs more ranks than it has CPUs, α grows by that factor (every step
# waits for the scheduler to run the peers), see ``oversubscribed``.
DEFAULT_COSTS: dict[str, Cost] = {
    # α is dominated by Python: ~30 µs per step of a schedule (posting, polling, binding);
    # β is a message's cost per byte: a copy into a ring slot and one out (single-copy
    # halves it for large messages, which the model ignores); γ a NumPy add
    "shm": Cost(alpha=30e-6, beta=1 / 2.5e9, gamma=1 / 4e9),
    # tcp: ~140 µs for an 8-byte allreduce on 2 ranks over loopback (vs ~85 µs on shm
    # rings), ~1 GB/s per stream
    "tcp": Cost(alpha=60e-6, beta=1 / 1e9, gamma=1 / 2e9),
    # verbs: a few Python steps per message (post, poll, RTS/CTS for large ones); the
    # wire of an EDR/HDR-class HCA (Soft-RoCE is ~500x slower: set GPURT_COST there)
    "verbs": Cost(alpha=40e-6, beta=1 / 10e9, gamma=1 / 2e9),
    "self": Cost(alpha=1e-6, beta=1 / 8e9, gamma=1 / 2e9),
    # cuda_ipc: per message a descriptor over shm, an event recorded and waited on, the
    # receiver's kernel polled to completion and acknowledged (~60 µs of Python and CUDA
    # calls); the bytes move at device-copy speed (HBM-class, shared by the ranks on one
    # GPU).  Estimates until measured on a GPU: GPURT_COST=cuda_ipc=... overrides.
    "cuda_ipc": Cost(alpha=60e-6, beta=1 / 1.0e12, gamma=1 / 1.0e12),
}


# protocols that transports provide only on some communicators (GPURT_ALGO may name them
# everywhere; where they are not available the tuner chooses)
# protocols of the transports rather than schedules: shm_direct is decided per call by
# the communicator (gpurt/comm.py), from the buffers every rank publishes
NATIVE_NAMES = frozenset({"shm_board", "shm_direct"})


#: the transports' native protocols, and what a communicator needs to have them
_NATIVE_NEEDS = {"shm_board": "needs a communicator of 2 or more ranks on one node (the "
                              "shm transport's board)",
                 "shm_direct": "needs a communicator of 2 or more ranks on one node (the "
                               "shm transport)"}


def check_forced(forced: dict[str, str]) -> None:
    """GPURT_ALGO's names without a communicator: every collective exists, and every
    algorithm is one of its registered schedules, a compiled one (``NATIVE_NAMES``: where
    it does not apply the tuner chooses) or the hierarchical one; ValueError otherwise."""
    for coll, name in forced.items():
        if coll not in SPECS:
            raise ValueError(f"GPURT_ALGO names unknown collective {coll!r} "
                             f"(known: {', '.join(SPECS)})")
        if name == "shm_direct":
            from gpurt.transports import shm_direct

            if coll not in shm_direct.COLLS:
                raise ValueError(f"GPURT_ALGO={coll}:{name}: shm_direct is for "
                                 f"{', '.join(shm_direct.COLLS)}")
        elif name not in NATIVE_NAMES and name not in (hier.HIER, "hier"):
            try:
                lookup(coll, name)
            except ValueError as e:
                raise ValueError(f"GPURT_ALGO: {e}; also {', '.join(sorted(NATIVE_NAMES))}, "
                                 f"{hier.HIER}") from None


@dataclass(frozen=True)
class Native:
    """A collective a transport runs by its own protocol rather than as a schedule (e.g.
    the shm board); ``fits(p, S)`` says whether it can take a call of size S."""

    coll: str
    name: str
    cost: Callable[[int, float, Cost], float]
    fits: Callable[[int, float], bool]
    doc: str = ""


@dataclass(frozen=True)
class Hierarchical:
    """The hierarchical schedule of ``coll`` (``gpurt.hier``) as a tuner candidate: its
    cost is that of its stages, each costed with its own level's constants and with the
    best number of pipeline fragments."""

    coll: str
    cost: Callable[[int, float, Cost], float]
    name: str = hier.HIER
    doc: str = "stages on the node, rail and net subgroups, pipelined"


# pipeline fragments the tuner tries, and the smallest fragment worth its extra steps
FRAGS = (1, 2, 4, 8, 16)
MIN_FRAG_BYTES = 256 << 10


#: a call whose data rides in the agreement's exchange across nodes (``Communicator._folds``):
#: not an algorithm, but a profile row may name it as the fastest at its size
FOLD = "folded"


def _row_times(row: list) -> dict:
    """A profile row's measured times by name ({} for a hand-made row without them)."""
    return row[2] if len(row) > 2 and isinstance(row[2], dict) else {}


def load_profile(path: str, p: int, nnodes: int) -> dict:
    """The entries of a ``gpurt tune`` profile that apply to a communicator of ``p`` ranks
    on ``nnodes`` nodes ({} when none: no file, another shape).  A profile that cannot be
    read is an error: silently ignoring it would hide a typo in GPURT_PROFILE."""
    if not path:
        return {}
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"GPURT_PROFILE={path!r} cannot be read: {e}") from None
    if not isinstance(prof, dict):
        raise ValueError(f"GPURT_PROFILE={path!r} is not a gpurt profile (a JSON object "
                         f"written by `gpurt tune`; this one is a {type(prof).__name__})")
    entries = prof.get("entries") or {}
    _check_entries(path, entries)
    if prof.get("version") != 1 or prof.get("nranks") != p or prof.get("nnodes") != nnodes:
        return {}
    return entries


def _check_entries(path: str, entries) -> None:
    """A profile's entries are ``{collective: [[bytes, algorithm, ...], ...]}`` with names
    gpurt knows: anything else is an error naming the file and the entry (a malformed
    row failed inside the first collective; an unknown name turned shm_direct off while
    the tuner ignored it)."""
    from gpurt.transports import shm_board, shm_direct

    def bad(what: str) -> ValueError:
        return ValueError(f"GPURT_PROFILE={path!r}: {what} (write it with `gpurt tune`)")

    if not isinstance(entries, dict):
        raise bad(f"'entries' is a {type(entries).__name__}, not an object")
    for coll, rows in entries.items():
        if coll not in REGISTRY:
            raise bad(f"entry {coll!r} is not a collective ({', '.join(REGISTRY)})")
        if not isinstance(rows, list):
            raise bad(f"entry {coll!r} is a {type(rows).__name__}, not a list of rows")
        known = set(REGISTRY[coll]) | {a for a, t in ALIASES.items() if t in REGISTRY[coll]}
        known |= {"shm_board"} if coll in shm_board.COLLS else set()
        known |= {shm_direct.NAME} if coll in shm_direct.COLLS else set()
        known |= {hier.HIER, "hier"} if coll in hier.COLLS else set()
        known |= {FOLD}
        for row in rows:
            if not (isinstance(row, list) and len(row) >= 2 and
                    isinstance(row[0], (int, float)) and not isinstance(row[0], bool) and
                    math.isfinite(row[0]) and row[0] >= 0 and isinstance(row[1], str)):
                raise bad(f"{coll} row {row!r} is not [bytes, algorithm, ...]")
            if row[1] not in known:
                raise bad(f"{coll} row {row!r} names {row[1]!r}, which {coll} does not "
                          f"have (known: {', '.join(sorted(known))})")


def oversubscribed(cost: Cost, ranks_on_node: int, cpus: int) -> Cost:
    f = max(1.0, ranks_on_node / max(1, cpus))
    return Cost(cost.alpha * f, cost.beta, cost.gamma)


def transport_cost(name: str) -> Cost:
    over = config.get("GPURT_COST")
    if name in over:
        a, b, g = over[name]
        return Cost(a, b, g)
    return DEFAULT_COSTS.get(name, DEFAULT_COSTS["tcp"])


def collective_bytes(coll: str, p: int, n: int, itemsize: int) -> int:
    """S as nccl-tests counts it (the whole p-block buffer for the gathering kinds)."""
    if coll in ("allgather", "reduce_scatter", "alltoall", "gather", "scatter"):
        return p * n * itemsize
    return n * itemsize


class Tuner:
    """Every input that decides a choice — costs, forced names, the profile — must be the
    same on every rank of the group (the communicator broadcasts them from rank 0), or
    ranks would run different algorithms for the same call."""

    def __init__(self, p: int, rank_index: int, group: tuple[int, ...], cost: Cost,
                 natives: list[Native] | tuple = (), nnodes: int = 1,
                 forced: dict[str, str] | None = None, profile: dict | None = None,
                 shape: "hier.Shape | None" = None, levels: dict[str, Cost] | None = None):
        self.p, self.r, self.group, self.cost = p, rank_index, group, cost
        # hierarchical schedules: the node shape (communicator ranks per node) and the
        # cost constants of each level ("node": inside a node, "net": between nodes)
        self.shape = shape
        self.levels = dict(levels or {})
        self.levels.setdefault("node", cost)
        self.levels.setdefault("net", cost)
        self.hier: dict[str, Hierarchical] = {}
        if shape is not None:
            for coll in hier.COLLS:
                if hier.supports(coll, shape):
                    self.hier[coll] = Hierarchical(
                        coll, (lambda c: lambda p_, S, _c: self.hier_plan(c, S)[0])(coll))
        self._pick = lru_cache(maxsize=2048)(self._pick_uncached)
        self.hier_plan = lru_cache(maxsize=512)(self._hier_plan)  # type: ignore[method-assign]
        self.natives: dict[str, dict[str, Native]] = {}
        for nat in natives:
            self.natives.setdefault(nat.coll, {})[nat.name] = nat
        self.forced: dict[str, str] = {}
        if forced is None:
            forced = config.get("GPURT_ALGO")
        check_forced(forced)
        for coll, name in forced.items():
            if name in NATIVE_NAMES and name not in self.natives.get(coll, {}):
                continue   # e.g. shm_board on a communicator spanning nodes: tuner's choice
            if name in (hier.HIER, "hier") and coll not in self.hier:
                continue   # e.g. reduce_scatter on uneven nodes: the tuner's choice
            self.forced[coll] = self._lookup(coll, name).name  # raises on unknown names
        self.profile = profile if profile is not None else \
            load_profile(str(config.get("GPURT_PROFILE")), p, nnodes)
        self._plan = lru_cache(maxsize=512)(self._plan_uncached)
        self.choose = lru_cache(maxsize=512)(self._choose)  # type: ignore[method-assign]

    def _lookup(self, coll: str, name: str) -> "Algorithm | Native | Hierarchical":
        nat = self.natives.get(coll, {}).get(name)
        if nat is not None:
            return nat
        if name in (hier.HIER, "hier"):
            if coll in self.hier:
                return self.hier[coll]
            why = "nodes of equal size" if coll in hier.EVEN_ONLY else "a collective it has"
            raise ValueError(f"no hierarchical {coll} here (it needs {why}; hierarchical "
                             f"collectives: {', '.join(hier.COLLS)})")
        try:
            return lookup(coll, name)
        except ValueError as e:
            if name in _NATIVE_NEEDS:
                # a native protocol this communicator lacks: say so, not "unknown" (the
                # name is right; the communicator is one rank, or spans several nodes)
                raise ValueError(f"algorithm {name!r} is not available here: it "
                                 f"{_NATIVE_NEEDS[name]}") from None
            if self.natives.get(coll):
                raise ValueError(f"{e}; here also: {', '.join(self.natives[coll])}") from None
            raise

    def candidates(self, coll: str, nbytes: float) -> list[tuple[float, "Algorithm | Native"]]:
        algs: list = list(REGISTRY[coll].values())
        algs += [n for n in self.natives.get(coll, {}).values() if n.fits(self.p, nbytes)]
        if coll in self.hier and self.shape is not None and self.shape.nnodes > 1:
            algs.append(self.hier[coll])
        return sorted(((a.cost(self.p, nbytes, self.cost), a) for a in algs),
                      key=lambda t: (t[0], t[1].name))

    def _choose(self, coll: str, n: int, itemsize: int, algo: str | None = None
                ) -> "Algorithm | Native":
        name = algo or self.forced.get(coll)
        S = collective_bytes(coll, self.p, n, itemsize)
        if name:
            alg = self._lookup(coll, name)
            if isinstance(alg, Native) and not alg.fits(self.p, S):
                raise ValueError(f"{coll}:{alg.name} cannot take {S} bytes on {self.p} ranks "
                                 f"(too large for it)")
            return alg
        measured = self._measured(coll, S)
        if measured is not None:
            return measured
        return self.candidates(coll, S)[0][1]

    def profile_row(self, coll: str, S: int) -> list | None:
        """The profile's row at the size nearest to S (log scale), or None where it has
        nothing for ``coll``."""
        rows = self.profile.get(coll) if self.profile else None
        if not rows:
            return None
        return min(rows, key=lambda row: abs(math.log2(max(row[0], 1)) -
                                             math.log2(max(S, 1))))

    def profile_winner(self, coll: str, S: int) -> str | None:
        """The name the profile measured fastest at the size nearest to S (log scale), or
        None where it has nothing for ``coll``."""
        row = self.profile_row(coll, S)
        return row[1] if row is not None else None

    def profile_folds(self, coll: str, S: int) -> bool | None:
        """Did the profile's row nearest S measure folding fastest (True) or slower (False)?
        None where that row never timed it (an older profile, a size beyond the room
        then): the fold limits decide."""
        row = self.profile_row(coll, S)
        if row is None:
            return None
        if row[1] == FOLD:
            return True
        return False if FOLD in _row_times(row) else None

    def _measured(self, coll: str, S: int) -> "Algorithm | Native | None":
        """The profile's winner at the measured size nearest to S (log scale), if the
        profile covers ``coll`` and that algorithm can take S here."""
        best = self.profile_row(coll, S)
        if best is None:
            return None
        name = best[1]
        if name == FOLD:   # a call that does not fold: the fastest of the rest measured there
            rest = [(t, a) for a, t in _row_times(best).items() if a != FOLD and
                    isinstance(t, (int, float)) and not isinstance(t, bool)]
            if not rest:
                return None
            name = min(rest)[1]
        try:
            alg = self._lookup(coll, name)
        except ValueError:
            return None
        if isinstance(alg, Native) and not alg.fits(self.p, S):
            return None
        return alg

    def plan(self, coll: str, n: int, itemsize: int, root: int = 0,
             algo: str | None = None) -> "tuple[Algorithm | Native, Schedule | None]":
        """The algorithm and this rank's schedule (None for a native protocol)."""
        alg = self.choose(coll, n, itemsize, algo)
        if isinstance(alg, Native):
            return alg, None
        if isinstance(alg, Hierarchical):
            return alg, self._plan(coll, alg.name, n, root, itemsize)
        return alg, self._plan(coll, alg.name, n, root)

    def _plan_uncached(self, coll: str, name: str, n: int, root: int,
                       itemsize: int = 0) -> Schedule:
        if name == hier.HIER:
            assert self.shape is not None
            frags = self.hier_plan(coll, collective_bytes(coll, self.p, n, itemsize))[1]
            return hier.build(coll, self.shape, self.group[self.r], n, root, itemsize,
                              self.pick, frags)
        alg = REGISTRY[coll][name]
        return alg.build(self.p, self.r, n, root).relabel(self.group)

    # -- hierarchical ------------------------------------------------------------
    def pick(self, coll: str, p: int, nbytes: float, level: str) -> str:
        """The registered algorithm for one stage: cheapest on a group of ``p`` ranks with
        ``level``'s constants (a pure function of global facts: the same on every rank)."""
        return self._pick(coll, p, int(nbytes), level)

    def _pick_uncached(self, coll: str, p: int, nbytes: int, level: str) -> str:
        c = self.levels[level]
        # on a tie, a step-synchronous algorithm (it lets the stages pipeline)
        return min(REGISTRY[coll].values(), key=lambda a: (
            a.cost(p, nbytes, c), not hier._group_facts(coll, a.name, p, 2 * p + 1, 0)[1],
            a.name)).name

    def _stages(self, coll: str, S: float) -> list[tuple[str, int, float, str]]:
        """(stage collective, group size, its bytes, level) of one hierarchical call of S
        bytes, unpipelined (the shapes of ``gpurt.hier``)."""
        sh = self.shape
        assert sh is not None
        R, N, big = sh.R, sh.nnodes, max(len(n) for n in sh.nodes)
        if coll == "allreduce":
            return [("reduce_scatter", R, S, "node"), ("allreduce", N, S / R, "net"),
                    ("allgather", R, S, "node")]
        if coll == "reduce_scatter":
            return [("reduce_scatter", R, S, "node"), ("reduce_scatter", N, S / R, "net")]
        if coll == "allgather":
            return [("allgather", N, S / R, "net"), ("allgather", R, S, "node")]
        if coll == "broadcast":
            return [("broadcast", N, S, "net"), ("broadcast", big, S, "node")]
        return [("reduce", big, S, "node"), ("reduce", N, S, "net")]

    def _hier_plan(self, coll: str, S: float) -> tuple[float, int, str]:
        """(predicted seconds, pipeline fragments, a description of the stages) for the
        hierarchical ``coll`` of S bytes: stages costed at their level, fragments chosen
        among ``FRAGS`` (pipelined: Σ stages + (F-1)·slowest stage)."""
        sh = self.shape
        assert sh is not None
        best: tuple[float, int, str] | None = None
        node_c = self.levels["node"]
        extra = 0.0
        if coll == "allreduce" and not sh.even:   # extras fold into partners and back
            e = -(-(max(len(n) for n in sh.nodes) - sh.R) // sh.R)
            extra = e * (2 * node_c.alpha + 2 * S * node_c.beta + S * node_c.gamma)
        if coll in ("reduce_scatter", "allgather"):  # the rail-major permutation
            extra = S * node_c.beta / 2
        for F in FRAGS:
            if F > 1 and S / F < MIN_FRAG_BYTES:
                break
            times, names, sync = [], [], True
            for sc, gp, b, level in self._stages(coll, S / F):
                name = self.pick(sc, gp, b, level)
                times.append(REGISTRY[sc][name].cost(gp, b, self.levels[level]))
                names.append(f"{level} {sc}:{name}" + ("" if gp > 1 else " (1 rank)"))
                sync = sync and hier._group_facts(sc, name, gp, 2 * gp + 1, 0)[1]
            if F > 1 and not sync:
                break
            t = sum(times) + (F - 1) * max(times) + extra
            if best is None or t < best[0]:
                best = (t, F, ", ".join(names))
        assert best is not None
        return best

    def table(self, coll: str, nbytes: int) -> list[dict]:
        if coll not in REGISTRY:
            raise ValueError(f"unknown collective {coll!r} (known: {', '.join(REGISTRY)})")
        cands = self.candidates(coll, nbytes)
        measured = self._measured(coll, nbytes)
        chosen = self.forced.get(coll) or (measured.name if measured else cands[0][1].name)
        return [{"algorithm": a.name, "predicted_s": t, "chosen": a.name == chosen}
                for t, a in cands]

    def explain(self, coll: str, nbytes: int) -> str:
        """The candidates for ``coll`` at size ``nbytes`` (S, as ``gpurt bench`` and
        nccl-tests count it), their predicted times, and the choice."""
        if coll not in REGISTRY:
            raise ValueError(f"unknown collective {coll!r} (known: {', '.join(REGISTRY)})")
        cands = self.candidates(coll, nbytes)
        forced = self.forced.get(coll)
        measured = None if forced else self._measured(coll, nbytes)
        chosen = forced or (measured.name if measured else cands[0][1].name)
        why = " (GPURT_ALGO)" if forced else " (measured: GPURT_PROFILE)" if measured else ""
        c = self.cost
        lines = [f"{coll} of {nbytes} bytes on {self.p} ranks "
                 f"(α={c.alpha * 1e6:.2f} µs, β={1 / c.beta / 1e9:.2f} GB/s, "
                 f"γ={1 / c.gamma / 1e9:.2f} GB/s)",
                 f"  {'algorithm':<20} {'predicted':>12}"]
        for t, a in cands:
            mark = ("  <- chosen" + why) if a.name == chosen else ""
            lines.append(f"  {a.name:<20} {t * 1e6:>9.1f} µs{mark}")
        if coll in self.hier and (self.shape.nnodes > 1 or chosen == hier.HIER):
            _, F, stages = self.hier_plan(coll, nbytes)
            sh = self.shape
            lines.append(f"  hierarchical on {sh.nnodes} node(s) of "
                         f"{'+'.join(str(len(n)) for n in sh.nodes)} ranks, {sh.R} rail(s), "
                         f"{F} pipeline fragment(s): {stages}")
        return "\n".join(lines)
