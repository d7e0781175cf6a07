"""Run as ``unshare -n python tests/tcp_deadlink.py`` (root; driven by tests/test_tcp.py).

Inside a private network namespace: two tcp endpoints over 127.0.0.1 with gpurt's socket
options (``GPURT_TCP_USER_TIMEOUT`` seconds), one message to prove the link works, then
loopback is throttled to 8 bit/s (``tc tbf``), which to TCP is a cut cable.  Prints, for
``busy`` (data in flight: TCP_USER_TIMEOUT) and ``idle`` (nothing in flight: keepalive),
the seconds until the endpoint raised and what it raised.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np

from gpurt import config
from gpurt.errors import GpurtError
from gpurt.transports import tcp


class _Sink:
    def __init__(self, dst):
        self.dst = dst

    def __call__(self, off, chunk):
        self.dst[off:off + chunk.nbytes] = chunk


def pair(ut: float):
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen()
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    for s in (a, b):
        tcp._liveness(s, ut)
        s.setblocking(False)
    owner = SimpleNamespace(stripes=1, smin=1 << 62)
    return tcp.TcpEndpoint(owner, 1, "peer", "127.0.0.1", [a]), b


def until_failure(ep, comps, bound: float) -> tuple[float, str]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        try:
            for c in comps:
                c.test()
            ep.check()
        except GpurtError as e:
            return time.monotonic() - t0, f"{type(e).__name__}: {e}"
        time.sleep(0.05)
    return time.monotonic() - t0, "nothing raised"


def main() -> int:
    ut = float(config.get("GPURT_TCP_USER_TIMEOUT"))
    if subprocess.run(["ip", "link", "set", "lo", "up"]).returncode != 0:
        print("SKIP: cannot bring up lo in this namespace")
        return 0
    ep_busy, peer_busy = pair(ut)
    ep_idle, peer_idle = pair(ut)
    # the links work
    for ep, peer in ((ep_busy, peer_busy), (ep_idle, peer_idle)):
        done = ep.send(np.ones(1000, np.uint8), 1, 0, 0)
        while not done.test():
            pass
        time.sleep(0.05)
        assert len(peer.recv(4096)) == 1000 + tcp.HDR
    rc = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "8bit",
                         "burst", "1600", "limit", "1600"], capture_output=True, text=True)
    if rc.returncode != 0:
        print(f"SKIP: tc tbf unavailable: {rc.stderr.strip()}")
        return 0
    # busy: 8 MiB waiting to go and a receive posted
    comps = [ep_busy.send(np.ones(8 << 20, np.uint8), 1, 1, 0),
             ep_busy.recv(8, _Sink(np.zeros(8, np.uint8)), 0, 1, 0)]
    took, what = until_failure(ep_busy, comps, 10 * ut + 30)
    print(f"busy {took:.2f} {what}", flush=True)
    # idle: only a receive posted, nothing in flight: keepalive probes go unanswered
    comps = [ep_idle.recv(8, _Sink(np.zeros(8, np.uint8)), 0, 1, 0)]
    took, what = until_failure(ep_idle, comps, 10 * ut + 30)
    print(f"idle {took:.2f} {what}", flush=True)
    for ep in (ep_busy, ep_idle):
        for c in ep.conns:
            c.close()
    peer_busy.close()
    peer_idle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
