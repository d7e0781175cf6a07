"""Memory ordering for the shared-memory protocols.

The rings and the board publish data by writing it and then storing a counter; the
reader loads the counter and then the data.  That is correct when stores become visible
in program order and loads are not reordered with loads, which x86-64 guarantees (TSO):
there ``fence`` is a no-op.  Weaker CPUs (aarch64, POWER) need real barriers between
the two, which pure Python cannot issue, so ``ORDERED`` is False there and the shm
transport declares itself unavailable rather than risk stale data.
"""

from __future__ import annotations

import platform

MACHINE = platform.machine()
ORDERED = MACHINE in ("x86_64", "AMD64", "i686", "i386", "x86")
WHY_NOT = "" if ORDERED else (
    f"the shared-memory protocols rely on x86-64 store ordering; this CPU ({MACHINE}) "
    f"needs memory barriers that pure Python cannot issue")


def fence() -> None:
    """Where a release/acquire barrier belongs (a no-op where the CPU orders for us)."""
