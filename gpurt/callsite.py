"""Where the application made a call: ``file.py:LINE in function``, for error messages.

Each collective carries its call site in its header (the shm board's, or the multi-node
agreement's), so a ``CollectiveMismatchError`` names the line on every rank that took part,
and the flight recorder keeps it.  The site is *shown*, never compared: ranks may call the
same collective from different lines (``if rank == 0: ... else: ...``) and that is fine.

``here()`` walks out of gpurt's own frames (a few frames, a string prefix test each) and
caches the text and its header encoding per (code object, line): a few hundred
nanoseconds per call.
"""

from __future__ import annotations

import os
import sys

WORDS = 8                                   # header words: 64 bytes of UTF-8 text
_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CACHE: dict = {}
_NONE = (0,) * WORDS


def here(depth: int = 2) -> tuple[int, ...]:
    """The header words of the first frame outside gpurt, from ``depth`` frames up."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return _NONE
    while f is not None and f.f_code.co_filename.startswith(_PKG):
        f = f.f_back
    if f is None:
        return _NONE
    key = (f.f_code, f.f_lineno)
    words = _CACHE.get(key)
    if words is None:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        code = f.f_code
        name = getattr(code, "co_qualname", code.co_name)
        words = _CACHE[key] = encode(f"{os.path.basename(code.co_filename)}:{f.f_lineno}"
                                     f" in {name}")
    return words


def encode(text: str) -> tuple[int, ...]:
    raw = text.encode("utf-8", "replace")[:8 * WORDS].ljust(8 * WORDS, b"\0")
    return tuple(int.from_bytes(raw[i:i + 8], "little") for i in range(0, 8 * WORDS, 8))


def decode(words) -> str:
    raw = b"".join(int(w).to_bytes(8, "little") for w in words)
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def at(words) -> str:
    """`` at FILE:LINE in F`` (or '' when unknown), to append to a call's description."""
    text = decode(words) if len(words) else ""
    return f" at {text}" if text else ""
