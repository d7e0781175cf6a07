"""The exception hierarchy.  Messages name this rank, the peer, the transport and the call."""

from __future__ import annotations


class GpurtError(RuntimeError):
    """Base class of every error gpurt raises on purpose (besides ValueError/TypeError
    for bad arguments, which are raised as themselves)."""


class CollectiveTimeout(GpurtError, TimeoutError):
    """A call did not complete within its deadline.

    ``collective``, ``seq`` (the communicator's call number; -1 for a ``send``/``recv``,
    whose message names its tag) and ``missing`` (the ranks this rank was still waiting
    for) say where it stopped — for a request queued behind an earlier collective that
    has not completed, that earlier call (the text names both).  Where one message brings
    several ranks' parts (the agreement check across nodes on more than 8 ranks: a node's
    headers come together), ``missing`` holds all of them, the absent rank among ranks
    that did call; the absent rank's node mates name it alone.
    """

    def __init__(self, msg: str, *, collective: str = "", seq: int = -1,
                 missing: tuple[int, ...] = ()) -> None:
        super().__init__(msg)
        self.collective, self.seq, self.missing = collective, seq, tuple(missing)


class PeerFailure(GpurtError):
    """A peer died, froze past the bound, or raised; ``rank`` is that peer."""

    def __init__(self, msg: str, *, rank: int = -1) -> None:
        super().__init__(msg)
        self.rank = rank


def relay_text(exc: BaseException) -> str:
    """What a rank whose communicator failed tells its peers.  A ``PeerFailure`` it only
    learned of is relayed as ``PeerFailure[rank=N]: ...``, so that the peers blame rank N,
    not the messenger (``relayed_rank``)."""
    if isinstance(exc, PeerFailure) and exc.rank >= 0:
        return f"PeerFailure[rank={exc.rank}]: {exc}"
    return f"{type(exc).__name__}: {exc}"


def fit_text(text: str, limit: int) -> bytes:
    """``text`` as UTF-8 in at most ``limit`` bytes, for a failure published in a bounded
    record: where too long, its head (the class, and the ``PeerFailure[rank=N]`` that
    ``relayed_rank`` reads) and its tail (a relayed chain ends with the reason the failed
    rank gave) around " ... " — cutting only the tail off lost that reason after a few
    relays."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data
    gap = " ... ".encode()
    head = limit // 3
    tail = limit - head - len(gap)
    return (data[:head].decode("utf-8", "ignore").encode() + gap +
            data[len(data) - tail:].decode("utf-8", "ignore").encode())


def relayed_rank(text: str, sender: int) -> int:
    """The rank a published error text blames: the one in ``PeerFailure[rank=N]`` when the
    sender relays a failure it saw, else the sender itself."""
    if text.startswith("PeerFailure[rank="):
        head = text[len("PeerFailure[rank="):].split("]", 1)[0]
        if head.isdigit():
            return int(head)
    return sender


class CollectiveMismatchError(GpurtError):
    """Ranks called different collectives, or the same one with different arguments."""


def published_class(text: str) -> type:
    """The class this rank raises for the failure a peer published (``text``, as
    ``relay_text`` wrote it): ``CollectiveMismatchError`` where the peer found that the
    calls differ — every rank of the call hears it as that, whether its own comparison
    comes first or the peer's notice does (on verbs the notice, a datagram, can overtake
    the call's last completions) — else ``PeerFailure``."""
    if text.startswith(f"{CollectiveMismatchError.__name__}: "):
        return CollectiveMismatchError
    return PeerFailure


def from_peer(text: str, msg: str, rank: int) -> GpurtError:
    """The error for the failure a peer published (``text``; ``msg``, the message here):
    of ``published_class(text)``, a ``PeerFailure`` blaming ``rank``."""
    if published_class(text) is PeerFailure:
        return PeerFailure(msg, rank=rank)
    return CollectiveMismatchError(msg)


class TransportError(GpurtError):
    """A transport failed (a segment could not be mapped, a message was malformed...)."""


class ResourceError(GpurtError):
    """Out of a resource: shared memory, file descriptors, registrations."""


class CommunicatorClosed(GpurtError):
    """The communicator was closed (or poisoned by an earlier failure)."""
