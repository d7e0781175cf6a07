"""What liveness across nodes costs a rank with P remote peers (``transports/heartbeat.py``).

    python benchmarks/heartbeat.py [P=10,100,1000] [seconds=5]

Per P, one ``Heartbeat`` with P remote peers (their addresses are a few plain UDP sockets
that drop what they get: the cost measured is this rank's), three phases of ``seconds``:

* ``idle``: nobody waits for anybody (a rank computing between collectives): the process
  CPU while the main thread sleeps — the heartbeat thread alone;
* ``waiting``: the rank waits for all P peers at once and asks as the executor does
  (``stopped(peer)`` for every peer every 0.2 s): the pings' CPU (silent peers: the worst
  case, a ping every interval each);
* the longest stall a busy main thread sees while the thread runs (idle phase).

Until 2026-12-02 every rank sent every remote peer a signed datagram twice a second and
verified as many (``git show 180e0ca:transports/heartbeat.py``): 2.5 % of a core at
P = 1000 for the sending alone, measured here; now an idle rank sends nothing.
"""

from __future__ import annotations

import socket
import sys
import time

from gpurt.transports.heartbeat import Heartbeat


def one(P: int, seconds: float) -> str:
    sinks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(20)]
    for s in sinks:
        s.bind(("127.0.0.1", 0))
    peers = {q + 1: ("127.0.0.1", sinks[q % 20].getsockname()[1]) for q in range(P)}
    h = Heartbeat("127.0.0.1")
    h.start(0, b"s" * 32, peers, 0.5)
    c0 = time.process_time()
    time.sleep(seconds)
    idle = (time.process_time() - c0) / seconds
    t0 = time.monotonic()
    worst, last = 0.0, time.perf_counter()
    while time.monotonic() - t0 < seconds:
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
        sum(range(200))
    c0 = time.process_time()
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for q in peers:
            h.stopped(q, "host", "stopped")
        time.sleep(0.2)
    waiting = (time.process_time() - c0) / seconds
    pings = getattr(h, "pings", 0)
    t = time.monotonic()
    h.close()
    closing = time.monotonic() - t
    for s in sinks:
        s.close()
    return (f"P={P}: idle {idle * 100:.2f} % of a core; waiting on all P {waiting * 100:.2f} % "
            f"({pings} pings in {seconds:g} s); longest main-thread stall {worst * 1e3:.2f} ms; "
            f"close {closing * 1e3:.1f} ms")


def main() -> None:
    ps = [int(p) for p in (sys.argv[1] if len(sys.argv) > 1 else "10,100,1000").split(",")]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    for P in ps:
        print(one(P, seconds), flush=True)


if __name__ == "__main__":
    main()
