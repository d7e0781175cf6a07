"""The flight recorder: each rank remembers its last calls, and tells them on failure.

Every collective and point-to-point call appends a record (call number, kind, arguments,
algorithm, start and end times, state) to a bounded ring per communicator
(``GPURT_FLIGHT``, 64 by default; 0 turns it off).  When the communicator fails — a
timeout, a dead or stopped peer, a mismatch — the rank prints its last few records to
stderr and, with ``GPURT_FLIGHT_DIR`` set, writes them all as JSON there.
``python -m gpurt.flight DIR`` (or ``gpurt flight DIR``) then lines the ranks' records
up and says who is missing from which call.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections import deque

import numpy as np

from . import callsite, config

# record fields (a list, so the hot path only appends and assigns); SITE: the call site's
# id (gpurt.callsite), turned into text only when the records are shown
SEQ, KIND, ARGS, ALGO, T0, T1, STATE, SITE = range(8)


class FlightRecorder:
    """``events``: the last ``n`` calls.  A call still running when the ring pushes it out
    (many requests in flight) moves to ``held`` — the oldest unfinished call is the one a
    hang is about — up to ``4 n`` of them; beyond that they are not shown, only counted
    (``lost``: those still unfinished when the records are dumped — a call that was
    pushed out and completed later is not lost; it was counted so, and a dump claimed
    unfinished calls that were not)."""

    __slots__ = ("rank", "size", "cid", "events", "dumped", "held", "over", "over_cap")

    def __init__(self, rank: int, size: int, cid: str, n: int):
        self.rank, self.size, self.cid = rank, size, cid
        self.events: deque = deque(maxlen=max(1, n))
        self.dumped = False
        self.held: list = []
        self.over: list = []        # running calls beyond ``held``'s room (not shown)
        self.over_cap = 4 * self.events.maxlen

    def start(self, seq: int, kind: str, args: tuple, algo: str, site: int = 0) -> list:
        rec = [seq, kind, args, algo, time.time(), 0.0, "running", site]
        self._append(rec)
        return rec

    def _append(self, rec: list) -> None:
        """``rec`` into the ring; a running call it pushes out goes to ``held``."""
        ev = self.events
        if len(ev) == ev.maxlen and ev[0][STATE] == "running":
            self._hold(ev[0])
        ev.append(rec)

    def finished(self, seq: int, kind: str, args: tuple, algo: str, tag: int = -1) -> None:
        """Record a call that completed as it was made (a quick send or receive): one
        record, done.  With ``tag``, the algorithm's text is ``"{algo} tag {tag}"``, made
        only if the records are shown (the quick path's cost is the record's)."""
        t = time.time()
        self._append([seq, kind, args, algo if tag < 0 else (algo, tag), t, t, "done", 0])

    def _hold(self, rec: list) -> None:
        held, cap = self.held, 4 * self.events.maxlen
        if len(held) >= cap:        # (pruned only when full: amortised O(1) per call)
            held[:] = [e for e in held if e[STATE] == "running"]
        if len(held) < cap:
            held.append(rec)
            return
        over = self.over
        if len(over) >= self.over_cap:     # (amortised: pruned when it has doubled)
            over[:] = [e for e in over if e[STATE] == "running"]
            self.over_cap = max(4 * self.events.maxlen, 2 * len(over))
        over.append(rec)

    @property
    def lost(self) -> int:
        """Unfinished calls pushed out beyond ``held``'s room (not in the records)."""
        return sum(1 for e in self.over if e[STATE] == "running")

    def _all(self) -> list:
        """The held calls still running (oldest first), then the ring."""
        return [e for e in self.held if e[STATE] != "done"] + list(self.events)

    def running(self) -> bool:
        """A call recorded as started has not completed (nor failed)."""
        return any(e[STATE] == "running" for e in self._all())

    def name_site(self, sid: int) -> None:
        """Give the calls still running that recorded no call site this one (the failing
        call's, found when it failed)."""
        for e in self._all():
            if e[STATE] == "running" and not e[SITE]:
                e[SITE] = sid

    @staticmethod
    def done(rec: list) -> None:
        rec[T1] = time.time()
        rec[STATE] = "done"

    def records(self) -> list[dict]:
        return [{"seq": e[SEQ], "kind": e[KIND], "args": "" if e[KIND] == "barrier" else
                 _args(e[ARGS]), "algorithm": e[ALGO] if type(e[ALGO]) is not tuple else
                 f"{e[ALGO][0]} tag {e[ALGO][1]}",
                 "t_start": e[T0], "t_end": e[T1] or None, "state": e[STATE],
                 "site": callsite.decode(callsite.words(e[SITE])) if len(e) > SITE else ""}
                for e in self._all()]

    def dump(self, reason: BaseException) -> str | None:
        """Once per communicator: the last records to stderr, all of them to
        GPURT_FLIGHT_DIR (returns the file written, if any)."""
        if self.dumped:
            return None
        self.dumped = True
        for e in self._all():
            if e[STATE] == "running":
                e[STATE] = f"failed: {type(reason).__name__}"
        recs = self.records()
        lines = [f"gpurt flight recorder, rank {self.rank}/{self.size} (communicator "
                 f"{self.cid}): {type(reason).__name__}: {reason}"]
        if self.lost:
            lines.append(f"  ({self.lost} older unfinished call(s) not recorded: more in "
                         f"flight than 4 x GPURT_FLIGHT={self.events.maxlen})")
        shown = recs[-8:]
        first = next((i for i, r in enumerate(recs) if r["state"] != "done"), len(recs))
        if first < len(recs) - 8:       # the oldest unfinished call, if the last 8 lack it
            shown = [recs[first], None] + shown
        for r in shown:
            if r is None:
                lines.append("  ...")
                continue
            took = f"{(r['t_end'] - r['t_start']) * 1e3:.1f} ms" if r["t_end"] else "-"
            # (a send/recv is not a numbered call: its tag is in its arguments; '#7 p2p'
            # for tag 7 after calls #1-#6 read as call #7)
            num = "-" if r["kind"] == "p2p" else f"#{r['seq']}"
            lines.append(f"  {num:<7} {r['kind']:<16} {r['args']:<36} "
                         f"{r['algorithm']:<18} {took:>10}  {r['state']}"
                         + (f"  ({r['site']})" if r["site"] else ""))
        print("\n".join(lines), file=sys.stderr, flush=True)
        d = str(config.get("GPURT_FLIGHT_DIR"))
        if not d:
            return None
        try:
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"flight-{self.cid}-rank{self.rank}.json")
            tmp = f"{path}.{os.getpid()}.tmp"     # (whole or not at all: a rank killed
            with open(tmp, "w") as f:             # while writing left half a file)
                json.dump({"rank": self.rank, "size": self.size, "communicator": self.cid,
                           "pid": os.getpid(), "host": os.uname().nodename,
                           "lost": self.lost, "time": time.time(),
                           "reason": f"{type(reason).__name__}: {reason}", "records": recs},
                          f, indent=1)
            os.replace(tmp, path)
            return path
        except OSError as e:
            print(f"gpurt flight recorder: cannot write {d}: {e}", file=sys.stderr)
            return None


def _args(a: tuple) -> str:
    """A call's arguments as the user wrote them: ``float32 x 4 SUM root=1``."""
    if not a:
        return ""
    dtype, n, op, root = a
    text = f"{_dtype_name(dtype)} x {n}"
    if op is not None:
        text += f" {op.name if hasattr(op, 'name') else op}"
    if root is not None:
        text += f" root={root}"
    return text


def _dtype_name(text: str) -> str:
    """NumPy's name of a dtype given as ``dtype.str`` ('<f4': float32; ml_dtypes'
    bfloat16, '<V2' to NumPy, by its own name)."""
    if text[1:] == "V2":
        return "bfloat16"
    try:
        return np.dtype(text).name
    except TypeError:
        return text


def _what(r: dict) -> str:
    return ", ".join(x for x in (r["args"], r.get("algorithm")) if x)


_RECORD_KEYS = (("seq", int), ("kind", str), ("state", str), ("args", str))


def _check_dump(d) -> None:
    """A rank's dump as ``dump`` writes it, or ValueError/TypeError/KeyError saying what
    is not (a file edited, cut short or of something else is skipped with that, not a
    traceback half way through the line-up)."""
    if not isinstance(d, dict):
        raise TypeError(f"a JSON {type(d).__name__}, not an object")
    if not isinstance(d["communicator"], str):
        raise TypeError("'communicator' is not a string")
    size, rank = d["size"], d["rank"]
    if type(size) is not int or type(rank) is not int or size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank!r} of size {size!r} is not a rank of a communicator")
    if not isinstance(d["records"], list):
        raise TypeError("'records' is not a list")
    for r in d["records"]:
        if not isinstance(r, dict):
            raise TypeError(f"a record is a {type(r).__name__}, not an object")
        for key, typ in _RECORD_KEYS:
            if not isinstance(r[key], typ) or isinstance(r[key], bool):
                raise TypeError(f"a record's {key!r} is {r[key]!r}")
        if not isinstance(r.get("algorithm"), (str, type(None))):
            raise TypeError(f"a record's 'algorithm' is {r['algorithm']!r}")


def line_up(paths: list[str]) -> str:
    """Who is missing from which call, from the ranks' dumps (one communicator each): the
    first collective not completed everywhere (each rank's own call where they differ),
    who entered it and who did not, point-to-point calls that did not complete, and the
    ranks that wrote nothing."""
    by_comm: dict[str, list[dict]] = {}
    out = []
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
            _check_dump(d)
        except (OSError, ValueError, KeyError, TypeError) as e:
            out.append(f"skipped {p}: not a flight record ({type(e).__name__}: {e})")
            continue
        by_comm.setdefault(d["communicator"], []).append(d)
    for cid, dumps in sorted(by_comm.items()):
        size = dumps[0]["size"]
        have = sorted(d["rank"] for d in dumps)
        out.append(f"communicator {cid}: {size} ranks, dumps from {len(have)}: {have}")
        state = {d["rank"]: {r["seq"]: r for r in d["records"] if r["kind"] != "p2p"}
                 for d in dumps}
        last_done = {rk: max([s for s, r in recs.items() if r["state"] == "done"],
                             default=None) for rk, recs in state.items()}
        first_open = min((s for recs in state.values() for s, r in recs.items()
                          if r["state"] != "done"), default=None)
        if first_open is None:
            out.append("  every recorded collective completed on every rank that dumped")
        else:
            calls = {rk: recs[first_open] for rk, recs in state.items() if first_open in recs}
            inside = sorted(calls)
            shapes = {(r["kind"], r["args"]) for r in calls.values()}
            rec = calls[inside[0]]
            if len(shapes) == 1:
                out.append(f"  first call not completed everywhere: #{first_open} "
                           f"{rec['kind']} ({_what(rec)})")
            else:
                differ = "called different collectives" if \
                    len({k for k, _ in shapes}) > 1 else "made this call with different arguments"
                out.append(f"  first call not completed everywhere: #{first_open}, and the "
                           f"ranks {differ} there:")
                for rk in inside:
                    r = calls[rk]
                    out.append(f"      rank {rk}: {r['kind']} ({_what(r)})")
            out.append(f"    entered by rank(s) {inside}")
            # each rank's state in it and when it came (a rank that came after others had
            # given up shows as late: it may even have completed it, from what they had
            # published; the line-up said only that every rank entered it)
            dumped = {d["rank"]: d.get("time") for d in dumps}
            starts = [r["t_start"] for r in calls.values()
                      if isinstance(r.get("t_start"), (int, float))]
            t0 = min(starts) if starts else None
            for rk in inside:
                r = calls[rk]
                ts = r.get("t_start")
                when = f", entered at +{ts - t0:.3f} s" \
                    if t0 is not None and isinstance(ts, (int, float)) else ""
                late = sorted(o for o in inside if o != rk and
                              calls[o]["state"].startswith("failed") and
                              isinstance(dumped.get(o), (int, float)) and
                              isinstance(ts, (int, float)) and ts > dumped[o])
                out.append(f"      rank {rk}: {r['state']}{when}" +
                           (f" (late: after rank(s) {late} had given up on it)" if late
                            else ""))
            for rk in inside:
                site = calls[rk].get("site")
                if site:
                    out.append(f"      rank {rk} from {site}")
            for rk in sorted(set(state) - set(inside)):
                last = last_done[rk]
                out.append(f"    rank {rk} never entered it; its last completed call: " +
                           (f"#{last}" if last is not None else
                            "not among its records (none, or older than they reach)"))
        for d in sorted(dumps, key=lambda d: d["rank"]):
            for r in d["records"]:
                if r["kind"] == "p2p" and r["state"] != "done":
                    out.append(f"  rank {d['rank']}: {r.get('algorithm')} ({r['args']}) did not "
                               f"complete: {r['state']}"
                               + (f"  ({r['site']})" if r.get("site") else ""))
        silent = sorted(set(range(size)) - set(have))
        if silent:
            out.append(f"  no dump from rank(s) {silent} (dead, ended without a failure "
                       f"of this communicator, or GPURT_FLIGHT_DIR not shared)")
        for d in sorted(dumps, key=lambda d: d["rank"]):
            if d.get("lost"):
                out.append(f"  rank {d['rank']}: {d['lost']} older unfinished call(s) not "
                           f"recorded (more in flight than its records hold): the first "
                           f"call above may be later than the first that hung")
            out.append(f"  rank {d['rank']} (pid {d.get('pid', '?')} on {d.get('host', '?')}): "
                       f"{d.get('reason', '(no reason recorded)')}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m gpurt.flight DIR   (the GPURT_FLIGHT_DIR of a failed job)",
              file=sys.stderr)
        return 2
    paths = sorted(glob.glob(os.path.join(argv[0], "flight-*-rank*.json")))
    if not paths:
        print(f"no flight records in {argv[0]}", file=sys.stderr)
        return 1
    text = line_up(paths)
    print(text)
    return 0 if "\ncommunicator " in "\n" + text else 1


if __name__ == "__main__":
    sys.exit(main())
