"""Run under ``mpiexec -n N``: the device path's semantics on gpurt's host-memory
**stand-in for a GPU** (``GPURT_DEVICE_BACKEND=standin``; not a GPU: see
``gpurt/device_standin.py``).  Streams, ordering across processes, buffer reuse right
after a call returns, allocation, p2p with many messages in flight, and the errors.

    mpiexec -n 3 python tests/device_cases.py CASE [CASE ...]

Cases: endpoints=KIND[,KIND..] | streams | reuse | alloc | inflight | staging | burst | order |
errors | interfaces | ownstream | gdr_pool_release |
otherdevice | nobackend | abandoned | sticky (these two: a slow stand-in)
Prints "CASE ok" on rank 0 when every rank passed; failures are gathered to rank 0.
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("GPURT_DEVICE_BACKEND", "standin")

import numpy as np  # noqa: E402

import gpurt  # noqa: E402
from gpurt import device_standin as si  # noqa: E402
from gpurt.errors import CollectiveMismatchError, GpurtError  # noqa: E402


def expect_raises(exc, fn, what: str, contains: str = ""):
    try:
        fn()
    except exc as e:
        if contains and contains not in str(e):
            raise AssertionError(f"{what}: {type(e).__name__} without {contains!r}: {e}")
        return e
    raise AssertionError(f"{what}: no {exc.__name__} raised")


def case_endpoints(comm, want: str) -> None:
    """The device endpoint each peer gets, e.g. 'cuda_ipc' or 'shm+staged'; 'mixed'
    means: cuda_ipc to ranks on this rank's device, staged to the others."""
    kinds = {p: ep.transport for p, ep in comm.dev_endpoints.items()}
    assert set(kinds) == set(range(comm.size)) - {comm.rank}, kinds
    if want == "mixed":
        mine = comm.dev_peers[comm.rank][3]
        for p, k in kinds.items():
            exp = "cuda_ipc" if comm.dev_peers[p][3] == mine else "shm+staged"
            assert k == exp, (p, k, exp, comm.dev_peers)
    else:
        for p, k in kinds.items():
            allowed = want.split(",")
            assert k in allowed, (p, k, allowed)


def case_streams(comm) -> None:
    r, p = comm.rank, comm.size
    total = p * (p + 1) // 2
    n = 100_003
    # 1. the producer's stream from __cuda_array_interface__: the fill runs later on s
    s = si.Stream()
    x = si.zeros(n, np.float32, stream=s.ptr)
    si.fill(x, r + 1.0)
    comm.allreduce(x)
    got = x.get()
    assert (got == total).all(), ("CAI stream", got[:3])
    # 2. stream= per call (the array has no stream of its own)
    s2 = si.Stream()
    y = si.zeros(n, np.float32)
    si.fill(y, r + 1.0, stream=s2.ptr)
    comm.allreduce(y, stream=s2.ptr)
    s2.synchronize()
    assert (y.get() == total).all(), "stream= int"
    si.fill(y, 2.0 * (r + 1), stream=s2.ptr)
    comm.allreduce(y, stream=s2)          # an object with .ptr
    s2.synchronize()
    assert (y.get() == 2 * total).all(), "stream= object"
    # out=None with stream=: the result is taken for the call's stream and tagged with it
    # (so later work on it is ordered after the call), not with the current stream's
    q = 7
    yb = si.zeros(p * q, np.float32)
    si.fill(yb, r + 1.0, stream=s2.ptr)
    calls = {"allgather": (lambda: comm.allgather(yb, stream=s2.ptr),
                           np.repeat(np.arange(1.0, p + 1), p * q)),
             "reduce_scatter": (lambda: comm.reduce_scatter(yb, stream=s2.ptr),
                                np.full(q, float(total))),
             "alltoall": (lambda: comm.alltoall(yb, stream=s2.ptr),
                          np.repeat(np.arange(1.0, p + 1), q)),
             "gather": (lambda: comm.gather(yb, root=p - 1, stream=s2.ptr),
                        np.repeat(np.arange(1.0, p + 1), p * q) if r == p - 1 else None),
             "scatter": (lambda: comm.scatter(yb, root=0, stream=s2.ptr), np.full(q, 1.0))}
    for name, (call, want) in calls.items():
        res = call()
        if want is None:
            assert res is None, (name, "off the root")
            continue
        assert res.stream == s2.ptr, (name, "out=None not taken for stream=", res.stream)
        assert (res.get().reshape(-1) == want).all(), (name, res.get().reshape(-1)[:4])
        si.fill(res, -1.0)       # on the result's stream: after the call's writes
        assert (res.get() == -1.0).all(), (name, "a kernel on the result's stream")
        # one rank: the call is a copy queued on the call's stream, without the engine
        assert p > 1 or comm.last_algorithm == "local", (name, comm.last_algorithm)
    # 3. the current stream
    s3 = si.Stream()
    z = si.zeros(n, np.int64)
    with s3:
        si.fill(z, r + 1)
        comm.allreduce(z)
        z2 = comm.allgather(z)            # out=None: allocated, filled on s3
    s3.synchronize()
    assert (z.get() == total).all(), "current stream"
    assert (z2.get() == total).all() and z2.shape == (p, n), "allgather on current stream"
    # 4. the non-blocking variant: the request's result is the array
    w = si.zeros(1000, np.float64, stream=s.ptr)
    si.fill(w, float(r))
    req = comm.iallreduce(w, op=gpurt.MAX)
    assert req.wait(timeout=30) is w
    assert (w.get() == p - 1).all(), "iallreduce"


def case_reuse(comm) -> None:
    """A buffer may be overwritten by device work queued right after the call returns:
    peers must have finished reading it (the acknowledgement) before the call returns."""
    r, p = comm.rank, comm.size
    n = 300_000
    s = si.Stream()
    for rep in range(3):
        x = si.asarray(np.full(n, r + 10.0 * rep, np.float32), stream=s.ptr)
        out = comm.allgather(x)
        si.fill(x, -1.0)                   # queued at once on the same stream
        got = out.get()
        for q in range(p):
            assert (got[q] == q + 10.0 * rep).all(), ("allgather then overwrite", rep, q,
                                                       got[q][:3])
    if p >= 2:
        peer = (r + 1) % p
        src = (r - 1) % p
        for rep in range(3):
            a = si.asarray(np.full(n, 100.0 * r + rep, np.float32), stream=s.ptr)
            b = si.zeros(n, np.float32, stream=s.ptr)
            rq = comm.irecv(b, src, tag=rep)
            if rep == 2:   # like MPI_Isend: the buffer is the caller's again after wait()
                sq = comm.isend(a, peer, tag=rep)
                sq.wait(timeout=30)
                si.fill(a, -7.0)
            else:
                comm.send(a, peer, tag=rep)
                si.fill(a, -7.0)
            rq.wait(timeout=30)
            assert (b.get() == 100.0 * src + rep).all(), ("send then overwrite", rep, b.get()[:2], b.get()[-2:], comm.dev_endpoints[src].transport)


def case_alloc(comm) -> None:
    r, p = comm.rank, comm.size
    x = si.asarray(np.arange(p * 4, dtype=np.int32) + r)
    y = comm.reduce_scatter(x)
    assert isinstance(y, si.Array), type(y)
    want = (np.arange(p * 4, dtype=np.int32) * p + p * (p - 1) // 2)[r * 4:(r + 1) * 4]
    assert (y.get() == want).all(), (y.get(), want)
    g = comm.gather(si.asarray(np.array([r, r], np.int16)), root=p - 1)
    if r == p - 1:
        assert isinstance(g, si.Array) and g.shape == (p, 2)
        assert (g.get() == np.repeat(np.arange(p), 2).reshape(p, 2)).all()
    else:
        assert g is None
    a = comm.alltoall(si.asarray(np.arange(p, dtype=np.float64).reshape(p, 1) + 10 * r))
    assert (a.get().reshape(-1) == np.arange(p) * 10 + r).all(), a.get()


def case_inflight(comm) -> None:
    """More p2p messages in flight than the sender has IPC event slots (16)."""
    r, p = comm.rank, comm.size
    if p < 2:
        return
    peer, src = (r + 1) % p, (r - 1) % p
    k = 40
    sends = [comm.isend(si.asarray(np.full(257, r * 1000 + i, np.int64)), peer, tag=i)
             for i in range(k)]
    outs = [si.zeros(257, np.int64) for _ in range(k)]
    recvs = [comm.irecv(outs[i], src, tag=i) for i in range(k)]
    for q in recvs + sends:
        q.wait(timeout=60)
    for i in range(k):
        assert (outs[i].get() == src * 1000 + i).all(), i


def case_staging(comm) -> None:
    """A staged message of thousands of chunks (run with a small GPURT_DEVICE_STAGE):
    exact, with a bounded number of events — at most ``_EVENTS`` on the sender (one per
    group of chunks), ``_WINDOW`` on the receiver — and at most ``_WINDOW`` chunks of
    device scratch on the receiver.  Before, every chunk had its event and its scratch at
    once: the stand-in's 4096 events ran out at 20 MiB of 4 KiB chunks (ResourceError),
    and a 64 MiB message held 64 MiB of device scratch."""
    r, p = comm.rank, comm.size
    if p < 2:
        return
    import time

    from gpurt.transports import cuda_ipc
    # every chunk's copy is queued at the call: work the caller queues on the stream
    # afterwards (3 s of it here) does not hold the send up (chunks past a window of
    # four were queued later, behind it: the send took the 3 s)
    m = 1 << 20                     # 4 MiB
    if r == 0:
        s = si.Stream()
        x = si.asarray(np.arange(m, dtype=np.float32))
        x.get()
        t0 = time.monotonic()
        q = comm.isend(x, 1, stream=s.ptr)
        si._worker().put(s.ptr, ("work", lambda: time.sleep(3)))
        q.wait(timeout=60)
        took = time.monotonic() - t0
        assert took < 2, took
        s.synchronize()
    elif r == 1:
        out = si.zeros(m, np.float32)
        comm.recv(out, 0, timeout=60)
        assert (out.get() == np.arange(m, dtype=np.float32)).all()
    n = 6 << 20                     # 24 MiB of float32
    if r == 0:
        ep = comm.dev_endpoints[1]
        assert ep.transport.endswith("+staged"), ep.transport
        x = si.asarray(np.arange(n, dtype=np.float32))
        comm.send(x, 1, timeout=120)
        assert len(ep.events.free) <= cuda_ipc._EVENTS, len(ep.events.free)
    elif r == 1:
        ep = comm.dev_endpoints[0]
        out = si.zeros(n, np.float32)
        comm.recv(out, 0, timeout=120)
        assert (out.get() == np.arange(n, dtype=np.float32)).all()
        held = sum(c * len(v) for c, v in ep.pool.dev.items())
        assert held <= cuda_ipc._WINDOW * ep.chunk, (held, ep.chunk)
        assert len(ep.events.free) <= cuda_ipc._WINDOW, len(ep.events.free)
    comm.barrier()


def _burst(comm, peer: int, src: int, k: int, m: int) -> None:
    """k device messages of m float32 to ``peer`` and from ``src``, all in flight at
    once, then waited for; exact data."""
    r = comm.rank
    xs = [si.asarray(np.full(m, r * 100 + i, np.float32)) for i in range(k)]
    outs = [si.zeros(m, np.float32) for _ in range(k)]
    reqs = [comm.irecv(outs[i], src, tag=i) for i in range(k)] + \
        [comm.isend(xs[i], peer, tag=i) for i in range(k)]
    for q in reqs:
        q.wait(timeout=120)
    for i in range(k):
        assert (outs[i].get() == src * 100 + i).all(), i


def case_pool_release(comm) -> None:
    """Staging's pool gives back what stays idle (run with GPURT_DEVICE_STAGE_KEEP=0.5):
    a burst of concurrent staged messages leaves its page-locked buffers pooled for
    reuse; once they have been idle longer than the limit, the next staged message
    releases them, and the pool holds only what that message used.  Before, the pool
    kept the burst's peak for the communicator's life (40 messages of 1 MiB in flight:
    208 MiB pinned per rank)."""
    r, p = comm.rank, comm.size
    if p < 2:
        return
    import time
    peer, src = (r + 1) % p, (r - 1) % p
    ep = comm.dev_endpoints[peer]
    if not ep.transport.endswith("+staged"):
        return
    pool = ep.pool
    assert pool.keep == 0.5, pool.keep
    m = 1 << 18
    _burst(comm, peer, src, 12, m)      # 12 messages of 1 MiB each way, all in flight
    burst = pool.idle_bytes()
    assert burst >= 2 * 12 * (m * 4), burst     # every message's buffer, pooled for reuse
    before = pool.released
    comm.barrier()
    time.sleep(0.7)
    small = si.asarray(np.full(1024, r, np.float32))
    got = si.zeros(1024, np.float32)
    q = comm.irecv(got, src, tag=99)
    comm.send(small, peer, tag=99, timeout=60)
    q.wait(timeout=60)
    assert (got.get() == src).all()
    left = pool.idle_bytes()
    # the small message's own buffers only (a page-locked one each way, and its scratch)
    assert left <= 3 * pool._cls(4096), (left, burst)
    assert pool.released - before >= burst - left, (pool.released, before, burst, left)
    comm.barrier()


def case_gdr_pool_release(comm) -> None:
    """GPUDirect's registered bounce and scratch buffers are given back once idle (run
    with GPURT_DEVICE_STAGE_KEEP=0.5 over verbs with GPURT_IB_GDR=1): a burst of large
    messages in flight leaves them pooled; after the limit, the next large message
    deregisters and frees them, and the pool holds only what that message used.  Before,
    every registered buffer stayed for the communicator's life."""
    r, p = comm.rank, comm.size
    if p < 2:
        return
    import time
    peer, src = (r + 1) % p, (r - 1) % p
    ep = comm.dev_endpoints[peer]
    if ep.transport != "verbs+gdr":
        return
    assert ep.keep == 0.5, ep.keep
    m = 1 << 18
    _burst(comm, peer, src, 6, m)       # 6 messages of 1 MiB each way, all in flight
    mine = comm.dev_endpoints[src] if src != peer else ep
    burst = ep.idle_bytes() + (mine.idle_bytes() if mine is not ep else 0)
    # (pooled for reuse: at least a bounce and a scratch buffer — as many as were in
    # use at once, which depends on how fast the link drained the sends)
    assert burst >= 2 * (m * 4), burst
    comm.barrier()
    time.sleep(0.7)
    big = si.asarray(np.full(m, r, np.float32))
    got = si.zeros(m, np.float32)
    q = comm.irecv(got, src, tag=99)
    comm.send(big, peer, tag=99, timeout=60)
    q.wait(timeout=60)
    assert (got.get() == src).all()
    left = ep.idle_bytes() + (mine.idle_bytes() if mine is not ep else 0)
    assert left <= 2 * (m * 4), (left, burst)   # that message's own bounce and scratch
    released = ep.released + (mine.released if mine is not ep else 0)
    assert released >= burst - left, (released, burst, left)
    comm.barrier()


def case_burst(comm) -> None:
    """More messages from distinct allocations in flight than the receiver keeps peer
    allocations open (64): once they are read the cache is back at its bound (it grew to
    146 of 200 and stayed there, holding memory the sender had freed)."""
    r, p = comm.rank, comm.size
    if p < 2:
        return
    from gpurt.transports import cuda_ipc
    peer, src = (r + 1) % p, (r - 1) % p
    k = 100
    xs = [si.asarray(np.full(1 << 16, r * 1000 + i, np.float32)) for i in range(k)]
    outs = [si.zeros(1 << 16, np.float32) for _ in range(k)]
    sends = [comm.isend(xs[i], peer, tag=i) for i in range(k)]
    recvs = [comm.irecv(outs[i], src, tag=i) for i in range(k)]
    for q in recvs + sends:
        q.wait(timeout=120)
    for i in range(k):
        assert (outs[i].get() == src * 1000 + i).all(), i
    if comm.dev_ipc is not None and comm.dev_endpoints[src].transport == "cuda_ipc":
        assert len(comm.dev_ipc.opened) <= cuda_ipc._OPEN_MAX, len(comm.dev_ipc.opened)


def case_abandoned(comm) -> None:
    """A receive abandoned after its timeout, its copy queued behind work on the
    receiver's busy stream, then the communicator closed: the peer's allocation stays
    mapped until the copy has run (closing it under the copy was a segmentation fault),
    the copy lands, and the mapping is closed after it.  Then a receive abandoned while
    the *sender's* stream is busy: nothing was queued on the receiver's stream (its read
    waits for the sender's event on the host, not on the stream), so nothing lingers.
    Needs a slow stand-in (GPURT_STANDIN_DELAY_US=200000: twenty fills take ~4 s)."""
    r, p = comm.rank, comm.size
    from gpurt.transports import cuda_ipc
    n = 1 << 18
    for busy in ("receiver", "sender"):
        c = comm.dup()
        if r == 1:
            s = si.Stream()
            a = si.zeros(n, np.float32, stream=s.ptr)
            for i in range(20 if busy == "sender" else 1):
                si.fill(a, 42.0)
            expect_raises(GpurtError, lambda: c.send(a, 0, tag=1, timeout=60),
                          "a send whose receiver closed", "rank 0")
            s.synchronize()
        elif r == 0 and p > 1:
            s = si.Stream()
            out = si.zeros(n, np.float32, stream=s.ptr)
            for i in range(20 if busy == "receiver" else 0):
                si.fill(out, float(i + 1))
            q = c.irecv(out, 1, tag=1)
            expect_raises(GpurtError, lambda: q.wait(timeout=1.5), f"a receive, the "
                          f"{busy}'s stream busy", "1.5 s")
            c.close()
            if busy == "receiver":
                assert cuda_ipc._LINGER, "the mapping a queued copy reads was closed at once"
                s.synchronize()          # the copy ran, from a mapping still there
                assert (out.get() == 42).all(), out.get()[:4]
            else:
                assert not cuda_ipc._LINGER, cuda_ipc._LINGER
                s.synchronize()
                assert (out.get() == 0).all(), out.get()[:4]    # (nothing was read)
        if not c.closed:
            c.close()
        c2 = comm.dup()              # (a communicator's close or open reaps)
        c2.close()
        assert not cuda_ipc._LINGER, cuda_ipc._LINGER
        comm.barrier()


def case_sticky(comm) -> None:
    """A kernel that fails on one rank's stream after its collective was queued: that rank
    raises the stream's error as soon as it looks (the stand-in's event query ignored the
    failed stream and every rank waited until its deadline), its peers PeerFailure naming
    it.  Needs a slow stand-in (GPURT_STANDIN_DELAY_US=200000) so that the kernel fails
    after the call began."""
    import time

    from gpurt.errors import PeerFailure, TransportError
    r, p = comm.rank, comm.size
    if p < 2:          # (one rank's in-place allreduce queues nothing to wait for)
        return
    c = comm.dup()
    s = si.Stream()
    x = si.asarray(np.ones(1000, np.float32), stream=s.ptr)
    if r == p - 1:
        si.fill(x, "not a number")     # fails on the stand-in's 'GPU', after the delay
    t0 = time.monotonic()
    if r == p - 1:
        expect_raises(TransportError, lambda: c.allreduce(x, timeout=60),
                      "a collective behind a failing kernel", "stream")
    else:
        e = expect_raises(PeerFailure, lambda: c.allreduce(x, timeout=60),
                          "a collective with a peer whose kernel failed", "stream")
        assert e.rank == p - 1, e
    took = time.monotonic() - t0
    assert took < 20, f"the failure took {took:.1f} s to show"
    c.close()
    comm.barrier()


def case_order(comm) -> None:
    """Two isends on different streams, the first one's stream busy: the messages still
    arrive in call order (tags 1 then 2), over cuda_ipc and staged alike."""
    r, p = comm.rank, comm.size
    if p < 2:
        return
    peer, src = (r + 1) % p, (r - 1) % p
    s1, s2 = si.Stream(), si.Stream()
    a = si.zeros(5000, np.float32, stream=s1.ptr)
    for i in range(30):                     # s1 is busy for a while
        si.fill(a, float(r + 1))
    b = si.asarray(np.full(5000, 100.0 + r, np.float32), stream=s2.ptr)
    q1 = comm.isend(a, peer, tag=1)
    q2 = comm.isend(b, peer, tag=2)
    o1, o2 = si.zeros(5000, np.float32), si.zeros(5000, np.float32)
    r1 = comm.irecv(o1, src, tag=1)
    r2 = comm.irecv(o2, src, tag=2)
    for q in (r2, r1, q2, q1):
        q.wait(timeout=60)
    assert (o1.get() == src + 1).all() and (o2.get() == 100 + src).all()
    # a small device message on a busy stream, then a large one (over verbs: staged, then
    # GPUDirect), then a host message: still in call order
    small = si.zeros(1000, np.float32, stream=s1.ptr)
    for i in range(30):
        si.fill(small, float(r + 7))
    large = si.asarray(np.full(8192, 200.0 + r, np.float32), stream=s2.ptr)
    host = np.full(16, 300.0 + r, np.float32)
    qs = [comm.isend(small, peer, tag=3), comm.isend(large, peer, tag=4),
          comm.isend(host, peer, tag=5)]
    o3, o4, o5 = si.zeros(1000, np.float32), si.zeros(8192, np.float32), np.zeros(16, np.float32)
    rs = [comm.irecv(o3, src, tag=3), comm.irecv(o4, src, tag=4), comm.irecv(o5, src, tag=5)]
    for q in rs + qs:
        q.wait(timeout=60)
    assert (o3.get() == src + 7).all() and (o4.get() == 200 + src).all() and \
        (o5 == 300 + src).all()


def case_errors(comm) -> None:
    r, p = comm.rank, comm.size
    host = np.ones(10, np.float32)
    dev = si.asarray(host)
    # stream= with host buffers: refused on the calling rank, before anything moves
    expect_raises(ValueError, lambda: comm.iallreduce(host, stream=5).wait(),
                  "stream= on host", "stream=")
    # x on the device, out on the host
    expect_raises(TypeError, lambda: comm.allreduce(dev, host), "mixed x/out", "host")
    # a bad stream object; the per-thread default stream
    expect_raises(TypeError, lambda: comm.allreduce(dev, stream="fast"), "bad stream", "stream")
    expect_raises(ValueError, lambda: comm.allreduce(dev, stream=2), "stream 2", "per-thread")
    # ranks mixing host and device memory in one call: every rank raises, naming both
    if p > 1:
        c = comm.dup()
        expect_raises(CollectiveMismatchError,
                      lambda: c.allreduce(host if r == 0 else si.asarray(host), timeout=30),
                      "host on rank 0, device elsewhere", "device")
        c.close()
        # a rank whose call is empty (0 elements: no schedule) against full ones: it went
        # without the agreement and the others waited for its header until the deadline
        c = comm.dup()
        expect_raises(CollectiveMismatchError,
                      lambda: c.allreduce(si.asarray(np.ones(0 if r == p - 1 else 3,
                                                            np.float32)),
                                          algo="hierarchical", timeout=30),
                      "an empty device allreduce against full ones", "count=0")
        c.close()
    # scatter: the root's x and out of different kinds, either way round, are refused
    # there (a host out was written by the device stream after the call returned; a host
    # x died inside the device path), and the other ranks are told
    for x_root, out_root in ((si.asarray(np.full(4 * p, 9, np.float32)), np.zeros(4, np.float32)),
                             (np.full(4 * p, 9, np.float32), si.zeros(4, np.float32))):
        c = comm.dup()
        if r == 0:
            expect_raises(TypeError, lambda: c.scatter(x_root, out_root, timeout=30),
                          f"scatter of {type(x_root).__name__} into "
                          f"{type(out_root).__name__} on the root", "memory")
        else:
            expect_raises(GpurtError, lambda: c.scatter(None, si.zeros(4, np.float32),
                                                        timeout=30),
                          "a scatter whose root refused its call", "rank 0")
        c.close()
    # p2p of different sizes on the device: both ends raise
    if p >= 2 and r < 2:
        c = comm.split(0)
        if r == 0:
            send = lambda: c.send(si.asarray(np.ones(10, np.float32)), 1, timeout=30)  # noqa
            if c.dev_endpoints[1].transport == "cuda_ipc":   # the receiver refuses it
                expect_raises(CollectiveMismatchError, send, "device send of 10 to a "
                              "receive of 12")
            else:   # staged: an eager host message, gone before the receiver looks
                send()
        else:
            expect_raises(CollectiveMismatchError,
                          lambda: c.recv(si.zeros(12, np.float32), 0, timeout=30),
                          "device receive of 12 from a send of 10", "bytes")
        c.close()
    elif p >= 2:
        comm.split(None)
    comm.barrier()


class _Foreign:
    """An object with only a ``__cuda_array_interface__``: a stand-in array's, with some
    fields replaced."""

    def __init__(self, arr, **over):
        self.arr = arr
        self.__cuda_array_interface__ = {**arr.__cuda_array_interface__, **over}


def case_interfaces(comm) -> None:
    """What an array interface says, checked: a shape that claims more than the
    allocation holds is a ValueError on its rank before anything moves (before: the peer
    read past the allocation — a crash there, on a GPU an illegal address), a mask is a
    TypeError (it would be ignored), a host protocol forced on device buffers says so;
    the peers are told at once.  Then the buffers' own streams: out's fill queued on its
    stream lands before the result (before: after it, on a call ordered on x's stream),
    and the result is ready on out's stream."""
    r, p = comm.rank, comm.size
    n = 1 << 12
    bad = r == p - 1
    for what, make, exc, text in (
            ("an overlong shape", lambda a: _Foreign(a, shape=(64 * n,)), ValueError,
             "run past the end of its device allocation"),
            ("a mask", lambda a: _Foreign(a, mask=si.zeros(n, np.bool_)), TypeError,
             "mask would be ignored"),
            ("algo=shm_board", None, ValueError, "not one for device buffers")):
        c = comm.dup()
        a = si.asarray(np.ones(n, np.float32))
        if bad:
            call = (lambda: c.allreduce(a, algo="shm_board", timeout=30)) if make is None \
                else (lambda: c.allreduce(make(a), timeout=30))
            e = expect_raises(exc, call, what, text)
            assert str(e).startswith(f"rank {r}: "), (what, str(e))
        else:
            expect_raises(CollectiveMismatchError, lambda: c.allreduce(a, timeout=30),
                          f"a peer's {what}", f"rank {p - 1}")
        c.close()
    s1, s2 = si.Stream(), si.Stream()
    x = si.asarray(np.full(1000, r + 1.0, np.float32), stream=s1.ptr)
    for trial in range(2):
        out = si.zeros(1000, np.float32, stream=s2.ptr)
        for _ in range(5):
            si.fill(out, -5.0)       # producer work on out's own stream
        if trial:
            comm.allreduce(x, out)
        else:                        # stream= names a third one
            s3 = si.Stream()
            comm.allreduce(x, out, stream=s3.ptr)
        si.fill(x, r + 1.0)          # (x's stream: after the call read x)
        s2.synchronize()             # out's stream alone: the result is ready there
        got = out.get()
        assert (got == p * (p + 1) / 2).all(), ("out's stream", trial, got[:3])
    if p > 1:                        # p2p: the receive after its buffer's stream too
        o = si.zeros(1000, np.float32, stream=s2.ptr)
        for _ in range(5):
            si.fill(o, -5.0)
        if r == 0:
            comm.send(si.asarray(np.full(1000, 7.0, np.float32)), 1, stream=s1.ptr)
        elif r == 1:
            comm.recv(o, 0, stream=s1.ptr)
            s1.synchronize()
            assert (o.get() == 7.0).all(), ("recv after its buffer's stream", o.get()[:3])
    comm.barrier()


def case_ownstream(comm) -> None:
    """Rank 0's stream busy for 2 s with work queued before its calls: a wait that times
    out there says it waits for its own stream and names no peer (before: it named the
    peers, which were waiting for rank 0), the peers' waits name a peer; waited again,
    the calls complete with exact data."""
    import time

    from gpurt.errors import CollectiveTimeout
    r, p = comm.rank, comm.size
    if p < 2:
        return
    c = comm.dup()
    s = si.Stream()
    a = si.zeros(50_000, np.float32, stream=s.ptr)
    if r == 0:
        si._worker().put(s.ptr, ("work", lambda: time.sleep(2)))
    si.fill(a, r + 1.0)
    reqs = [c.iallreduce(a)]
    if r < 2:
        o = si.zeros(1000, np.float32)
        reqs.append(c.isend(si.asarray(np.full(1000, 3.0, np.float32)), 1, stream=s.ptr)
                    if r == 0 else c.irecv(o, 0))
    for q in reqs:
        e = expect_raises(CollectiveTimeout, lambda: q.wait(timeout=0.5), "a wait on rank 0")
        if r == 0:
            assert "still waiting for this rank's own device stream" in str(e), str(e)
            assert e.missing == (), (str(e), e.missing)
        else:
            # (a peer it receives from, which may itself wait for rank 0)
            assert e.missing and "own device stream" not in str(e), str(e)
    for q in reqs:
        q.wait(timeout=30)
    assert (a.get() == p * (p + 1) / 2).all(), a.get()[:3]
    if r == 1:
        assert (o.get() == 3.0).all(), o.get()[:3]
    c.close()


def case_otherdevice(comm) -> None:
    """An array on a device this rank does not use (GPURT_STANDIN_DEVICES=2)."""
    cur = comm.dev.current()
    other = 1 - cur
    a = si.Array((8,), np.float32, device=other)
    expect_raises(ValueError, lambda: comm.allreduce(a), "other device",
                  f"is on device {other}")
    comm.barrier()


def case_mixed(comm) -> None:
    """Rank 0 without a device backend (MPMD launch), the others with the stand-in: the
    communicator comes up, host calls work, a device call fails on every rank."""
    r, p = comm.rank, comm.size
    assert (comm.dev is None) == (r == 0), (r, comm.dev, comm.dev_why)
    x = np.ones(4, np.float32)
    comm.allreduce(x)
    assert (x == p).all()
    d = si.asarray(np.ones(4, np.float32))
    if r == 0:
        expect_raises(TypeError, lambda: comm.allreduce(d, timeout=30), "no backend here",
                      "no device backend")
    else:
        expect_raises(GpurtError, lambda: comm.allreduce(d, timeout=30),
                      "a peer without a device", "rank 0")


def case_nobackend(comm) -> None:
    """GPURT_DEVICE_BACKEND=none: a device array is a clear TypeError on the caller."""
    assert comm.dev is None
    os.environ["GPURT_DEVICE_BACKEND"] = "standin"   # only to make the array
    from gpurt import device
    device._reset_for_tests()
    a = si.asarray(np.ones(4, np.float32))
    expect_raises(TypeError, lambda: comm.allreduce(a), "no backend", "no device backend")
    comm.barrier()


def main() -> int:
    comm = gpurt.init()
    fails = []
    for arg in sys.argv[1:]:
        name, _, param = arg.partition("=")
        try:
            fn = globals()[f"case_{name}"]
            fn(comm, param) if param else fn(comm)
        except (AssertionError, GpurtError, Exception):  # noqa: BLE001 - reported
            fails.append(f"rank {comm.rank}: {arg}: {traceback.format_exc()}")
            break
    every = comm.mpi.gather(fails, 0)
    if comm.rank == 0:
        flat = [f for fs in every for f in fs]
        sys.stdout.write("".join(f"FAIL {f}\n" for f in flat) or
                         f"{' '.join(sys.argv[1:])} ok on {comm.size} ranks\n")
        sys.stdout.flush()
    bad = comm.mpi.allreduce(len(fails))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
