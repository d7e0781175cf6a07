"""Large host copies with non-temporal stores.

On this kind of machine a collective on large host buffers is bound by memory traffic,
not by the CPU: every byte is read once and written once, and an ordinary store also
*reads* the destination line first (read-for-ownership) and pushes useful lines out of
the cache.  ``memcpy`` in glibc switches to non-temporal (streaming) stores only for
copies far larger than the last-level cache, so a 16 MiB copy is done with cached
stores.  Measured here (2-core EPYC VM, 32 MiB L3): both ranks copying 8 MiB at once,
1175 µs with ``np.copyto`` against 700 µs streamed; 16 MiB, 3364 against 2652 µs; one
process alone, 16 MiB 2353 against 1568 µs; below the cache's share (4 MiB with two
ranks) cached stores win (229 against 270 µs).

So a copy of at least ``threshold()`` bytes — by default the last-level cache divided
by twice the number of ranks sharing it (source and destination of every rank fit
below that), at least 1 MiB; ``GPURT_NT_COPY`` overrides, 0 turns it off — goes through
``gpurt._fastboard.stream_copy``; smaller ones, and everything when the extension is
not built, through ``np.copyto``.  The result is the same bytes either way.

The cache counted is at most ``LLC_MAX`` (128 MiB): a virtual machine may report its
host's whole L3, shared with every other guest — 300 MiB on one host of this VM (Xeon),
which put the threshold at 75 MiB for 2 ranks.  Measured there (2 ranks, allreduce on
``comm.empty`` arrays, the settings alternating in one launch): 64 MiB took 14225 µs
with cached stores against 12811–12982 streamed, 32 MiB 6446 against 5834–5931, while
16 MiB was better cached (2524–2604 against 2693–2717); 4 ranks, 16 MiB: 7630 cached
against 6276 streamed.  With 128 MiB counted the thresholds are 32 MiB (2 ranks) and
16 MiB (4 ranks); on a machine whose whole L3 is at most that, nothing changes.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import config

LLC_MAX = 128 << 20   # the most last-level cache the streaming threshold counts on
_local = 1          # the most ranks of one node seen sharing the cache (transports set it)


@functools.lru_cache(maxsize=1)
def llc_bytes() -> int:
    """The last-level cache of CPU 0 (sysfs), 0 if unknown."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    txt = f.read().strip().upper()
                with open(os.path.join(base, d, "type")) as f:
                    if f.read().strip() == "Instruction":
                        continue
            except OSError:
                continue
            try:
                best = max(best, config.parse_bytes(txt))     # sysfs: "32768K"
            except ValueError:
                continue
    except OSError:
        return 0
    return best


def set_local_ranks(n: int) -> None:
    """A communicator with ``n`` ranks on this node exists: they share the cache."""
    global _local
    if n > _local:
        _local = n
        _threshold.cache_clear()


@functools.lru_cache(maxsize=1)
def _threshold() -> int:
    fixed = config.get("GPURT_NT_COPY")
    if fixed != "auto":
        return int(fixed)
    llc = min(llc_bytes() or (32 << 20), LLC_MAX)
    return max(1 << 20, llc // (2 * _local))


def threshold() -> int:
    """Copies of at least this many bytes stream (0: never)."""
    global _stream
    if _stream is False:
        _stream = _load()
    if _stream is None:
        return 0
    return _threshold()


def streaming_why() -> str:
    """'' if large copies stream here, else why not."""
    from gpurt.transports import shm_board
    fb = shm_board.NATIVE
    if fb is None:
        return f"gpurt._fastboard: {shm_board.NATIVE_WHY}"
    if not getattr(fb, "STREAMING", 0):
        return "no streaming stores on this CPU (x86-64 only)"
    if not config.get("GPURT_NATIVE"):
        return "GPURT_NATIVE=0"
    if not _threshold():
        return "GPURT_NT_COPY=0"
    return ""


def _load():
    from gpurt.transports import shm_board     # (not at import: gpurt.transports imports us)
    fb = shm_board.NATIVE
    if fb is None or not getattr(fb, "STREAMING", 0) or not config.get("GPURT_NATIVE"):
        return None
    return fb.stream_copy


_stream = False      # not looked up yet


def _addr(a: np.ndarray) -> int:
    from gpurt.transports import cma
    return cma.address(a)


def copyto(dst: np.ndarray, src: np.ndarray, nbytes_hint: int = 0) -> None:
    """``np.copyto(dst, src)`` for two C-contiguous arrays of the same dtype and size;
    streamed when the copy — or the whole transfer it is a piece of, ``nbytes_hint`` —
    is at least ``threshold()`` bytes and the two do not overlap."""
    n = dst.nbytes
    t = threshold()
    if t and max(n, nbytes_hint) >= t and n == src.nbytes and dst.dtype == src.dtype \
            and dst.flags.c_contiguous and src.flags.c_contiguous:
        d, s = _addr(dst), _addr(src)
        if d + n <= s or s + n <= d:
            _stream(d, s, n)
            return
    np.copyto(dst, src)
