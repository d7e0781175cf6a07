"""Waiting without burning the CPU that the peer needs.

Spin (a few tens of µs: the common case on an idle core), then ``sched_yield`` (lets a
peer rank on the same core run, which is what oversubscribed runs need), then sleep with
exponential backoff up to 1 ms.  Any progress resets the backoff.
"""

from __future__ import annotations

import os
import time

from . import config

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class Backoff:
    __slots__ = ("spin_until", "yield_until", "sleep", "start")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        now = time.perf_counter()
        self.start = now
        spin = float(config.get("GPURT_SPIN_US")) * 1e-6
        self.spin_until = now + spin
        self.yield_until = now + spin + 2e-3
        self.sleep = 5e-6

    def pause(self) -> None:
        now = time.perf_counter()
        if now < self.spin_until:
            return
        if now < self.yield_until:
            _yield()
            return
        time.sleep(self.sleep)
        self.sleep = min(self.sleep * 2, 1e-3)
