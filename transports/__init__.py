"""Transports, in order of preference (``GPURT_TRANSPORTS`` filters and reorders).

Installed as ``gpurt.transports``.  Each transport lives in its own module and imports
its optional dependencies lazily, so ``import gpurt`` never needs CuPy or pyverbs.
"""

from __future__ import annotations

from .base import LANE_COLL, LANE_P2P, Completion, Endpoint, Transport, register, registered


def _shm():
    from .shm import ShmTransport
    return ShmTransport


def _tcp():
    from .tcp import TcpTransport
    return TcpTransport


def _verbs():
    from .verbs import VerbsTransport
    return VerbsTransport


register("shm", _shm)
register("verbs", _verbs)  # RDMA: ahead of tcp for the peers it can reach (other nodes)
register("tcp", _tcp)      # the fallback: reaches every peer, so it comes last

# Transports the design has but this build does not ship yet, with the reason
# `gpurt info` prints for them (none at present).
PLANNED: dict[str, str] = {}

# Device-only transports: not in the host registry (they carry device buffers between
# peers that a host transport already connects), but GPURT_TRANSPORTS may name them.
DEVICE = ("cuda_ipc",)

__all__ = ["LANE_COLL", "LANE_P2P", "Completion", "Endpoint", "Transport", "register",
           "registered", "PLANNED", "DEVICE", "selected", "check_names", "device_ipc_enabled"]


def device_ipc_enabled() -> bool:
    """``cuda_ipc`` may carry device buffers: GPURT_TRANSPORTS is unset or names it (set
    without it, device buffers are staged through pinned host memory everywhere)."""
    from gpurt import config

    want = config.get("GPURT_TRANSPORTS")
    return not want or "cuda_ipc" in want


def selected() -> list[tuple[str, type]]:
    """The registry filtered and ordered by ``GPURT_TRANSPORTS``."""
    from gpurt import config

    avail = {name: loader for name, loader in registered()}
    want = config.get("GPURT_TRANSPORTS")
    if not want:
        return [(n, loader()) for n, loader in registered()]
    check_names(want)
    return [(name, avail[name]()) for name in want if name not in DEVICE]


def check_names(want) -> None:
    """Every name in ``want`` (GPURT_TRANSPORTS) is a transport gpurt has: ValueError
    naming the first that is not (planned, or unknown)."""
    avail = {name for name, _ in registered()}
    for name in want:
        if name in DEVICE or name in avail:
            continue
        if name in PLANNED:
            raise ValueError(f"GPURT_TRANSPORTS names {name!r}: {PLANNED[name]}")
        known = ", ".join(sorted(avail) + list(DEVICE) + list(PLANNED))
        raise ValueError(f"GPURT_TRANSPORTS names unknown transport {name!r} (known: {known})")
