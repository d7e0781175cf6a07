"""Who is where: nodes, local ranks, rails and leaders, from the MPI control plane.

A *node* is what ``MPI_Comm_split_type(COMM_TYPE_SHARED)`` groups together (not the
host name: MPICH's clique settings and containers make the two differ).  Nodes are
numbered by their lowest rank.  A *rail* is the set of ranks with the same local rank
on every node (each would use its own NIC); *leaders* are the local ranks 0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    size: int
    node_of: tuple[int, ...]                   # rank -> node index
    local_ranks: tuple[tuple[int, ...], ...]   # node -> its ranks, in rank order
    hosts: tuple[str, ...]                     # node -> a host name (for messages)

    @property
    def nnodes(self) -> int:
        return len(self.local_ranks)

    def local_rank(self, rank: int) -> int:
        return self.local_ranks[self.node_of[rank]].index(rank)

    def rail(self, local_rank: int) -> tuple[int, ...]:
        return tuple(rs[local_rank] for rs in self.local_ranks if len(rs) > local_rank)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(rs[0] for rs in self.local_ranks)

    @staticmethod
    def from_ids(node_ids: list[int], hosts: list[str]) -> "Topology":
        """``node_ids[r]``: any id shared by exactly the ranks of one node (here: the
        lowest rank of the node); nodes are numbered in order of their lowest rank."""
        order: dict[int, int] = {}
        for nid in node_ids:
            order.setdefault(nid, len(order))
        node_of = tuple(order[n] for n in node_ids)
        local: list[list[int]] = [[] for _ in order]
        for r, n in enumerate(node_of):
            local[n].append(r)
        host_of = [""] * len(order)
        for r, n in enumerate(node_of):
            host_of[n] = host_of[n] or hosts[r]
        return Topology(len(node_ids), node_of, tuple(tuple(x) for x in local), tuple(host_of))


def rank_ranges(xs: list[int]) -> str:
    """[0,1,2,5] -> "0-2,5" (sorted ranks; "-" for none)."""
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts) or "-"
