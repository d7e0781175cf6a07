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
# `gpurt info` prints for them.
PLANNED = {
    "cuda_ipc": "not in this build yet (GPU path: CuPy/PyTorch device buffers over CUDA IPC)",
}

__all__ = ["LANE_COLL", "LANE_P2P", "Completion", "Endpoint", "Transport", "register",
           "registered", "PLANNED", "selected"]


def selected() -> list[tuple[str, type]]:
    """The registry filtered and ordered by ``GPURT_TRANSPORTS``."""
    from gpurt import config

    avail = {name: loader for name, loader in registered()}
    want = config.get("GPURT_TRANSPORTS")
    if not want:
        return [(n, loader()) for n, loader in registered()]
    out = []
    for name in want:
        if name in avail:
            out.append((name, avail[name]()))
        elif name in PLANNED:
            raise ValueError(f"GPURT_TRANSPORTS names {name!r}: {PLANNED[name]}")
        else:
            known = ", ".join(list(avail) + list(PLANNED))
            raise ValueError(f"GPURT_TRANSPORTS names unknown transport {name!r} (known: {known})")
    return out
