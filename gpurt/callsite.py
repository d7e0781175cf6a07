"""Where the application made a call: ``file.py:LINE in function``, for error messages.

Each collective carries its call site in its header (the shm board's, or the multi-node
agreement's), so a ``CollectiveMismatchError`` names the line on every rank that took part,
and the flight recorder keeps it.  The site is *shown*, never compared: ranks may call the
same collective from different lines (``if rank == 0: ... else: ...``) and that is fine.

``site()`` walks out of gpurt's own frames (a few frames, a string prefix test each) and
interns the site: a small integer per (file, line, function), numbered in order of first
use in this process, whose text ``words(id)`` gives.  The shm board publishes a rank's site
texts once, in a table of its own, and each call's header carries just the number; the
multi-node agreement header carries the text.
"""

from __future__ import annotations

import itertools
import os
import sys

WORDS = 8                                   # header words: 64 bytes of UTF-8 text
# gpurt's own code: the package, and gpurt.transports (a directory of its own in a
# development install)
_PKG: tuple[str, ...] = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                         os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
                             __file__))), "transports") + os.sep)
_NONE = (0,) * WORDS
_MAX = 1 << 16                              # distinct sites remembered (then: unknown)
_MAX_CODES = 1 << 12            # code objects remembered at once (then: forgotten, all)
_IDS: dict = {}                 # id(code) -> (code, is gpurt's, {instruction offset: id})
_BYLINE: dict = {}              # (file, line, function) -> id
_TEXTS: dict[int, tuple[int, ...]] = {}     # id -> header words (id 0: unknown)
_NEXT = itertools.count(1)      # ids: taken whole (threads, a signal handler's call)


def site(depth: int = 2) -> int:
    """The interned id (>= 1) of the first frame outside gpurt, from ``depth`` frames up;
    0 if there is none.  Per code object (keyed by id, checked by identity: hashing a code
    object hashes its contents) it remembers whether it is gpurt's and, per instruction
    offset, the id — line numbers and text only on first sight."""
    try:
        f = sys._getframe(depth)
    except ValueError:
        return 0
    while True:
        code = f.f_code
        ent = _IDS.get(id(code))
        if ent is None or ent[0] is not code:
            if len(_IDS) >= _MAX_CODES:
                # (a cache, which holds its code objects alive: code made anew per step —
                # exec, a notebook cell run again — kept every one, ~2 KB a step, for
                # ever; a bug hunt.  The sites themselves stay: keyed by their text's
                # parts, they are found again)
                _IDS.clear()
            ent = _IDS[id(code)] = (code, code.co_filename.startswith(_PKG), {})
        if not ent[1]:
            break
        f = f.f_back
        if f is None:
            return 0
    sid = ent[2].get(f.f_lasti)
    if sid is None:
        line = f.f_lineno
        name = getattr(code, "co_qualname", code.co_name)
        key = (code.co_filename, line, name)
        sid = _BYLINE.get(key)
        if sid is None:
            if len(_TEXTS) > _MAX:
                return 0
            # (no lock: a signal handler's call may come in here.  An id is taken whole,
            # its text stored before it is published, and of two threads that meet the
            # same new site at once the first to publish wins — the other id is unused)
            text = encode(f"{os.path.basename(code.co_filename)}:{line} in {name}")
            sid = next(_NEXT)
            _TEXTS[sid] = text
            sid = _BYLINE.setdefault(key, sid)
        ent[2][f.f_lasti] = sid
    return sid


def words(sid: int) -> tuple[int, ...]:
    """The header words of site ``sid`` (zeros when unknown)."""
    return _TEXTS.get(sid, _NONE)


def encode(text: str) -> tuple[int, ...]:
    raw = text.encode("utf-8", "replace")[:8 * WORDS].ljust(8 * WORDS, b"\0")
    return tuple(int.from_bytes(raw[i:i + 8], "little") for i in range(0, 8 * WORDS, 8))


def decode(ws) -> str:
    raw = b"".join(int(w).to_bytes(8, "little") for w in ws)
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def at(ws) -> str:
    """`` at FILE:LINE in F`` (or '' when unknown), to append to a call's description."""
    text = decode(ws) if len(ws) else ""
    return f" at {text}" if text else ""
