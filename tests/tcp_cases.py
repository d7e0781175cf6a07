"""Run under ``mpiexec -n N`` with ``GPURT_TRANSPORTS=tcp`` (driven by tests/test_tcp.py):

    python tests/tcp_cases.py p2p|mismatch|fds|strangers

Each case prints ``CASE ok on rank R`` per rank that passed (or raises).

* ``p2p``: every pair exchanges messages of many sizes (all posted at once), a burst of
  small messages, and point-to-point traffic in flight while collectives run in both
  orders (frames of one lane buffered while the other lane has receives posted).
* ``mismatch``: ranks call allreduce with different sizes, then a receive whose size
  differs from the send: CollectiveMismatchError, then the communicator is poisoned.
* ``fds``: no socket, thread or /dev/shm file of gpurt's is left after close; the socket
  options (keepalive, TCP_USER_TIMEOUT, no Nagle) are set on every connection.
* ``setupfail``: (rank 2 launched with GPURT_TIMEOUT=0, so its set-up fails at once)
  every rank raises TransportError quickly — the others are told through MPI and do not
  wait for their own deadline.
* ``strangers``: while rank 0 sets up, strangers connect to its listening port (learned
  from the debug log line): one says nothing, one sends garbage, one the right magic with
  another communicator's id, one claims to be rank 1 but cannot answer the HMAC
  challenge.  They are refused and logged; the job completes correctly.  The other ranks
  hold their set-up (in a handler of the debug line that starts it) until the strangers
  are through, so the order does not depend on scheduling.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import threading
import time

import numpy as np

import gpurt


def vec(q: int, n: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + q * 3 + salt) % 251).astype(np.float32)


def case_p2p(c: gpurt.Communicator) -> None:
    p, r = c.size, c.rank
    sizes = [0, 1, 7, 100_003, 3 << 18, (5 << 20) // 4 + 3]
    # 1. every pair, every size, all posted at once (sends first on even ranks)
    reqs, outs = [], {}
    for q in range(p):
        if q == r:
            continue
        for k, n in enumerate(sizes):
            outs[(q, k)] = np.full(n, -1, np.float32)
    for q in (range(p) if r % 2 else reversed(range(p))):
        if q == r:
            continue
        for k, n in enumerate(sizes):
            reqs.append(c.isend(vec(r * 100 + q, n, k), q, tag=k))
            reqs.append(c.irecv(outs[(q, k)], q, tag=k))
    for rq in reqs:
        rq.wait(timeout=60)
    for (q, k), got in outs.items():
        assert np.array_equal(got, vec(q * 100 + r, sizes[k], k)), (q, k)
    # 2. a burst of small messages to the right neighbour, received in order
    if p > 1:
        right, left = (r + 1) % p, (r - 1) % p
        sends = [c.isend(vec(r, 1 + i % 13, i), right, tag=i) for i in range(300)]
        for i in range(300):
            got = np.empty(1 + i % 13, np.float32)
            c.recv(got, left, tag=i, timeout=60)
            assert np.array_equal(got, vec(left, 1 + i % 13, i)), i
        for s in sends:
            s.wait(timeout=60)
    # 3. p2p in flight while collectives run: the p2p frames arrive while only a
    #    collective receive is posted (buffered), and the other way round
    if p > 1:
        big = (3 << 20) // 4
        x = np.ones(big, np.float32)
        if r == 0:
            s = c.isend(vec(7, big), 1, tag=5)             # before the collective
            c.allreduce(x)
            s.wait(timeout=60)
        elif r == 1:
            c.allreduce(x)                                 # the p2p message waits
            got = np.empty(big, np.float32)
            c.recv(got, 0, tag=5, timeout=60)
            assert np.array_equal(got, vec(7, big))
        else:
            c.allreduce(x)
        assert np.all(x == p)
        y = np.ones(1000, np.float32)
        if r == 1:
            got = np.empty(big, np.float32)
            rq = c.irecv(got, 0, tag=6)                    # posted before the collective
            c.allreduce(y)
            rq.wait(timeout=60)
            assert np.array_equal(got, vec(8, big))
        elif r == 0:
            c.allreduce(y)
            c.send(vec(8, big), 1, tag=6, timeout=60)
        else:
            c.allreduce(y)
        assert np.all(y == p)
        # both lanes busy in both directions at once
        z = np.ones(big, np.float32)
        peer = r ^ 1
        if peer < p:
            got = np.empty(big, np.float32)
            rq = [c.isend(vec(r, big, 9), peer, tag=9), c.irecv(got, peer, tag=9)]
            c.allreduce(z)
            for q in rq:
                q.wait(timeout=60)
            assert np.array_equal(got, vec(peer, big, 9))
        else:
            c.allreduce(z)
        assert np.all(z == p)


def _expect_mismatch(c: gpurt.Communicator, n: int, *needles: str) -> None:
    """An allreduce of ``n`` elements (the ranks disagree on n) must raise
    CollectiveMismatchError whose message contains every one of ``needles``."""
    try:
        c.allreduce(np.ones(n, np.float32), algo="direct", timeout=30)
    except gpurt.CollectiveMismatchError as e:
        print(f"rank {c.rank}: mismatch: {e}", flush=True)
        for text in needles:
            assert text in str(e), e
    else:
        raise AssertionError(f"rank {c.rank}: allreduce of different sizes did not fail")


def case_mismatch(c: gpurt.Communicator) -> None:
    r = c.rank
    n = 100 if r == 0 else 200
    # with the agreement check (GPURT_CHECK=1, the default): both calls named, before any
    # data moves
    _expect_mismatch(c, n, "allreduce(float32, count=100, op=SUM)",
                     "allreduce(float32, count=200, op=SUM)")
    try:
        c.allreduce(np.ones(4, np.float32), timeout=5)
    except gpurt.CommunicatorClosed:
        pass
    else:
        raise AssertionError("not poisoned")
    # without it (GPURT_CHECK=0): the frame headers are still checked by tcp itself
    from gpurt import config
    from mpi4py import MPI
    os.environ["GPURT_CHECK"] = "0"
    config.reload()
    e0 = gpurt.Communicator(MPI.COMM_WORLD)
    try:
        _expect_mismatch(e0, n, "does not match the receive posted here",
                         "tcp collective lane")
    finally:
        e0.close()
        os.environ["GPURT_CHECK"] = "1"
        config.reload()
    # point to point, on fresh communicators: 10 floats sent, 20 expected; and large
    # messages (striped, when GPURT_TCP_STRIPES > 1) whose parts do not line up
    from mpi4py import MPI
    for n_send, n_recv in ((10, 20), (1 << 20, (1 << 20) + 64)):
        d = gpurt.Communicator(MPI.COMM_WORLD)
        if r == 0:
            try:
                d.send(np.ones(n_send, np.float32), 1, tag=3, timeout=30)
            except (gpurt.PeerFailure, gpurt.CollectiveMismatchError) as e:
                # rank 1 rejected the message and closed its communicator: a large send
                # that was still being written fails with the reset, or with rank 1's
                # error (a mismatch) if that arrives first
                assert n_send > 10 and "rank 1" in str(e), e
        elif r == 1:
            try:
                d.recv(np.empty(n_recv, np.float32), 0, tag=3, timeout=30)
            except gpurt.CollectiveMismatchError as e:
                print(f"rank {r}: p2p mismatch: {e}", flush=True)
                assert f"it is {n_send * 4} bytes long, this rank expects {n_recv * 4}" \
                    in str(e), e
            else:
                raise AssertionError("recv of the wrong size did not fail")
        d.close()
    # the sender hears of the receiver's mismatch at once (the receiver stops reading the
    # connection but still sends its error notice over it), not at its own timeout: rank 1
    # keeps its communicator open for 4 s after the mismatch, so closing it cannot be what
    # tells rank 0
    d = gpurt.Communicator(MPI.COMM_WORLD)
    if r == 0:
        d.send(np.ones(10, np.float64), 1, tag=5, timeout=30)
        t0 = time.monotonic()
        try:
            d.barrier(timeout=20)
        except gpurt.CollectiveMismatchError as e:
            took = time.monotonic() - t0
            assert "rank 1" in str(e) and "does not match the receive posted here" in str(e), e
            assert took < 3, f"rank 0 heard of rank 1's mismatch only after {took:.1f} s"
            print(f"rank 0: told of the mismatch in {took:.2f} s: {e}", flush=True)
        else:
            raise AssertionError("rank 0's barrier succeeded after rank 1's mismatch")
    elif r == 1:
        try:
            d.recv(np.empty(10, np.int64), 0, tag=5, timeout=30)
        except gpurt.CollectiveMismatchError as e:
            assert "float64" in str(e) or "dtype" in str(e) or "int64" in str(e), e
        else:
            raise AssertionError("recv of the wrong dtype did not fail")
        time.sleep(4)
    d.close()


def _socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def case_fds(c: gpurt.Communicator) -> None:
    """Called after a first communicator exists (MPI initialised); makes its own."""
    before, threads = _socket_fds(), threading.active_count()
    tasks = len(os.listdir("/proc/self/task"))
    d = c.dup()
    during = _socket_fds()
    stripes = int(os.environ.get("GPURT_TCP_STRIPES", "1"))
    # a connection per peer and stripe, and one UDP socket for the heartbeats
    assert during - before == (c.size - 1) * stripes + 1, (before, during)
    assert threading.active_count() == threads + 1          # the heartbeat thread
    for ep in d.endpoints.values():
        for conn in ep.conns:
            s = conn.sock
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
    x = np.ones(1 << 18, np.float32)
    d.allreduce(x)
    assert np.all(x == c.size)
    d.close()
    d.close()                                             # twice is fine
    after = _socket_fds()
    assert after == before, (before, during, after)
    assert threading.active_count() == threads
    # a joined thread's OS task ends a moment after Python's join returns (the pthread
    # still unwinds): no task stays behind, waited for at most 2 s
    end = time.monotonic() + 2
    while len(os.listdir("/proc/self/task")) != tasks and time.monotonic() < end:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/task")) == tasks
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("gpurt-")]


# -- strangers ---------------------------------------------------------------------------
_HELLO = struct.Struct("<8sHHII16s16s")


class _Strangers(logging.Handler):
    """On rank 0: when the transport logs where it listens, strangers connect there."""

    def __init__(self, done: str):
        super().__init__(logging.DEBUG)
        self.done = done
        self.refusals: list[str] = []
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "refused a connection" in msg:
            self.refusals.append(msg)
        if "listening on" in msg and not self.threads:
            addr = msg.split("listening on ")[1].split(" ")[0]
            ip, port = addr.rsplit(":", 1)
            cid = msg.rsplit("communicator ", 1)[1]
            t = threading.Thread(target=self.attack, args=((ip, int(port)), cid))
            t.start()
            self.threads.append(t)

    def attack(self, addr, cid: str) -> None:
        from gpurt.transports import tcp

        def conn():
            s = socket.create_connection(addr, timeout=10)
            self.socks.append(s)
            return s

        silent = conn()                          # 1. connects and says nothing
        conn().sendall(b"GET / HTTP/1.0\r\n\r\n")  # 2. not gpurt at all
        hello = _HELLO.pack(tcp.HELLO_MAGIC, tcp.VERSION, 0, 1, 0,  # 3. another job's id
                            tcp._cid_digest(cid + "-other"), os.urandom(16))
        conn().sendall(hello)
        s = conn()                               # 4. claims rank 1, cannot do the HMAC
        s.sendall(_HELLO.pack(tcp.HELLO_MAGIC, tcp.VERSION, 0, 1, 0, tcp._cid_digest(cid),
                              os.urandom(16)))
        try:
            reply = s.recv(48)
            assert len(reply) == 48, reply
            s.sendall(os.urandom(32))
            s.recv(1)                            # b"": refused
        except OSError:
            pass
        del silent
        open(self.done, "w").close()


class _Hold(logging.Handler):
    """On the other ranks: when set-up starts dialing, wait until the strangers are done."""

    def __init__(self, done: str):
        super().__init__(logging.DEBUG)
        self.done = done

    def emit(self, record: logging.LogRecord) -> None:
        if "set-up: dialing" in record.getMessage():
            deadline = time.monotonic() + 30
            while not os.path.exists(self.done) and time.monotonic() < deadline:
                time.sleep(0.01)


def case_strangers(c: gpurt.Communicator | None) -> None:
    raise AssertionError("handled in main")


def case_setupfail() -> None:
    from mpi4py import MPI
    r = MPI.COMM_WORLD.Get_rank()
    t = time.monotonic()
    try:
        gpurt.init()
    except gpurt.TransportError as e:
        print(f"rank {r}: TransportError after {time.monotonic() - t:.2f}s: {e}", flush=True)
    else:
        raise AssertionError(f"rank {r}: set-up did not fail")
    print(f"setupfail ok on rank {r}", flush=True)


class _Tear:
    """A socket whose next large sendmsg (armed) hands the kernel half of the bytes and
    then raises KeyboardInterrupt — what a Ctrl-C landing between sendmsg() returning and
    tcp's record of it does (a real SIGINT hits that window only now and then: tried 20
    times it tore 4 streams; here it is made to, the kernel write itself is real)."""

    def __init__(self, sock):
        self._s, self.armed = sock, False

    def __getattr__(self, name):
        return getattr(self._s, name)

    def sendmsg(self, bufs, *rest):
        total = sum(len(b) for b in bufs)
        if not self.armed or total < (64 << 10):
            return self._s.sendmsg(bufs, *rest)
        self.armed = False
        half = b"".join(bytes(b) for b in bufs)[:total // 2]
        self._s.sendmsg([half], *rest)
        raise KeyboardInterrupt


def case_torn(c: gpurt.Communicator) -> None:
    """Rank 1's write to rank 2 is torn mid-frame by a KeyboardInterrupt inside a 24 MiB
    allreduce; rank 1 catches it and carries on for 4 s before it closes.  Ranks 0 and 2
    raise PeerFailure naming rank 1 and the KeyboardInterrupt within 2 s of it — rank 2
    (whose stream was torn: the notice cannot be framed after half a frame) by the end of
    that stream and the authenticated datagram, not a malformed-frame TransportError or a
    wait until rank 1 closes."""
    from mpi4py import MPI
    r = c.rank
    x = np.ones(3 << 21, np.float32)
    c.allreduce(x)
    tear = None
    if r == 1:
        conn = c.endpoints[2].conns[0]
        tear = conn.sock = _Tear(conn.sock)
    MPI.COMM_WORLD.Barrier()
    t = None
    outcome = "completed"
    try:
        for i in range(50):
            x[:] = 1
            if tear is not None and i == 3:
                tear.armed = True
            c.allreduce(x, timeout=30)
    except KeyboardInterrupt:
        t = time.time()
        outcome = "KeyboardInterrupt"
        time.sleep(4)
    except gpurt.GpurtError as e:
        t = time.time()
        outcome = f"{type(e).__name__}(rank={getattr(e, 'rank', None)}): {e}"
    res = MPI.COMM_WORLD.allgather((t, outcome))
    if r == 0:
        t1 = res[1][0]
        for k, (tk, what) in enumerate(res):
            print(f"rank {k}: {'+%.2fs' % (tk - t1) if tk and t1 else '-'} {what[:300]}",
                  flush=True)
    assert res[1][1] == "KeyboardInterrupt", res
    for k in (0, 2):
        tk, what = res[k]
        assert what.startswith("PeerFailure(rank=1)") and "KeyboardInterrupt" in what, res
        assert tk - res[1][0] < 2.0, f"rank {k} heard only after {tk - res[1][0]:.2f} s"


def main() -> int:
    case = sys.argv[1]
    if case == "setupfail":
        case_setupfail()
        return 0
    handler = None
    if case == "strangers":
        from mpi4py import MPI
        done = MPI.COMM_WORLD.bcast(f"/tmp/gpurt-strangers-{os.getpid()}", 0)
        lg = logging.getLogger("gpurt.tcp")
        lg.setLevel(logging.DEBUG)
        if MPI.COMM_WORLD.Get_rank() == 0:
            handler = _Strangers(done)
            lg.addHandler(handler)
        else:
            lg.addHandler(_Hold(done))
    c = gpurt.init()
    if case == "strangers":
        x = np.arange(1000, dtype=np.float32)
        c.allreduce(x)
        assert np.array_equal(x, np.arange(1000, dtype=np.float32) * c.size)
        if handler is not None:
            for t in handler.threads:
                t.join(30)
            time.sleep(0.2)
            for line in handler.refusals:
                print("REFUSED", line, flush=True)
            for s in handler.socks:
                s.close()
            os.unlink(handler.done)
    else:
        {"p2p": case_p2p, "mismatch": case_mismatch, "fds": case_fds,
         "torn": case_torn}[case](c)
    c.close()
    print(f"{case} ok on rank {c.rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
