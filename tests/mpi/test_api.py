"""The public API under real MPI (pytest-mpi): run by tests/test_processes.py as

    mpiexec -n N python -m pytest --with-mpi tests/mpi

Every test runs on every rank; bad-input tests make the same bad call on every rank (an
argument error is raised before anything moves, so the ranks stay in step).
"""

from __future__ import annotations

import array
import contextlib
import datetime
import inspect
import os
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import gpurt
from gpurt import config

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture(scope="module")
def comm():
    return gpurt.init()


@contextlib.contextmanager
def scratch(comm):
    """A communicator of its own for a test that breaks it on purpose (mismatch, timeout);
    closed afterwards, and every rank waits for the others before the next test."""
    c = comm.dup()
    try:
        yield c
    finally:
        c.close()
        comm.mpi.Barrier()


@contextlib.contextmanager
def _env(env: dict):
    """gpurt's settings read with ``env`` set (restored afterwards): for communicators
    created inside."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config.reload()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
        config.reload()


def test_init_is_idempotent_and_describes_the_world(comm):
    assert gpurt.init() is comm
    w = MPI.COMM_WORLD
    assert (comm.rank, comm.size) == (w.rank, w.size)
    nnodes = int(os.environ.get("GPURT_TEST_NNODES", "1"))   # cliques make several
    assert comm.nnodes == nnodes
    if nnodes == 1:
        assert comm.node == 0 and comm.local_size == w.size and comm.local_rank == w.rank
    assert "rank" in repr(comm)


def test_wrap_an_application_communicator(comm):
    """Embedding: any mpi4py intracommunicator, e.g. one the application split itself."""
    w = MPI.COMM_WORLD
    app = w.Split(w.rank % 2, w.rank)
    with gpurt.Communicator(app) as c:
        assert (c.rank, c.size) == (app.rank, app.size)
        x = np.full(3, w.rank, np.int64)
        c.allreduce(x)
        assert (x == sum(q for q in range(w.size) if q % 2 == w.rank % 2)).all()
    assert c.closed
    with pytest.raises(gpurt.CommunicatorClosed):
        c.allreduce(x)
    app.Free()


def test_wrap_rejects_non_communicators():
    me = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(TypeError, match=rf"rank {me} of MPI_COMM_WORLD: .*intracommunicator"):
        gpurt.Communicator("COMM_WORLD")
    with pytest.raises(TypeError, match=rf"rank {me} of MPI_COMM_WORLD: .*MPI.COMM_NULL"):
        gpurt.Communicator(MPI.COMM_NULL)


def test_out_none_semantics(comm):
    p, r = comm.size, comm.rank
    x = np.arange(6, dtype=np.float64).reshape(2, 3) + r
    y = comm.allreduce(x)
    assert y is x and y.shape == (2, 3)
    g = comm.allgather(np.array([r, r], np.int32))
    assert g.shape == (p, 2) and g.dtype == np.int32 and (g[:, 0] == np.arange(p)).all()
    rs = comm.reduce_scatter(np.ones((p, 4), np.float32))
    assert rs.shape == (4,) and (rs == p).all()
    rs1 = comm.reduce_scatter(np.ones(p * 2, np.float32))
    assert rs1.shape == (2,)
    a = comm.alltoall(np.arange(p, dtype=np.int16) + 10 * r)
    assert a.shape == (p,) and (a == np.arange(p) * 10 + r).all()
    gat = comm.gather(np.array([r]), root=0)
    assert (gat is None) == (r != 0)
    sc = comm.scatter(np.arange(p * 2).reshape(p, 2), root=p - 1)   # x gives shape off root
    assert (sc == [2 * r, 2 * r + 1]).all()


def test_explicit_out_and_x_unchanged(comm):
    p = comm.size
    x = np.arange(5, dtype=np.int32)
    out = np.empty_like(x)
    assert comm.allreduce(x, out) is out
    assert (x == np.arange(5)).all() and (out == np.arange(5) * p).all()


def test_buffer_kinds(comm):
    """array.array, memoryview, bytearray, a DLPack-only object, 0-d arrays."""
    p = comm.size
    a = array.array("d", [1.0, 2.0])
    comm.allreduce(a)
    assert list(a) == [p, 2.0 * p]
    ba = bytearray(b"\x01\x02")
    comm.allreduce(memoryview(ba), op="max")
    assert list(ba) == [1, 2]

    class DLOnly:   # what a PyTorch CPU tensor looks like to gpurt
        def __init__(self, arr):
            self._a = arr

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    base = np.ones(4, np.float32)
    comm.allreduce(DLOnly(base))
    assert (base == p).all()
    z = np.array(3, np.int64)
    comm.allreduce(z)
    assert int(z) == 3 * p


@pytest.mark.parametrize("count", [3, 100003])
def test_ndarray_subclasses(comm, count, tmp_path):
    """np.memmap, np.recarray, np.matrix work as the arrays they are (a bug hunt: the
    compiled board refused them — "out must be a numpy.ndarray" — mid-call, and the
    communicator was unusable afterwards); a masked array is refused (its mask would be
    ignored) and the communicator goes on."""
    p, r = comm.size, comm.rank
    tri = p * (p + 1) / 2
    mm = np.memmap(tmp_path / f"mm{r}.bin", dtype=np.float64, mode="w+", shape=(count,))
    mm[:] = r + 1
    assert comm.allreduce(mm) is mm and isinstance(mm, np.memmap)
    assert (np.asarray(mm) == tri).all()
    g = comm.allgather(mm[:3])
    assert g.shape == (p, 3) and (g == tri).all()
    m = np.matrix([[r + 1.0, 1.0]])
    assert isinstance(comm.allreduce(m), np.matrix) and m.tolist() == [[tri, p]]
    rec = np.arange(4.0).view(np.recarray)
    comm.allreduce(rec, op="max")
    assert rec.tolist() == [0.0, 1.0, 2.0, 3.0]
    out = np.zeros(count).view(np.recarray)
    comm.allreduce(np.full(count, r + 1.0), out)
    assert (np.asarray(out) == tri).all()
    with pytest.raises(TypeError, match=f"rank {r}: x: a masked array: its mask would be "
                                        f"ignored"):
        comm.allreduce(np.ma.array([1.0, 2.0], mask=[0, 1]))
    assert comm.allreduce(np.ones(2)).tolist() == [p, p]
    del mm


def test_ops_as_strings_and_avg(comm):
    p, r = comm.size, comm.rank
    x = np.array([float(r)], np.float64)
    comm.allreduce(x, op="avg")
    assert x[0] == sum(range(p)) / p
    y = np.array([r + 1], np.int64)
    comm.allreduce(y, op="PROD")
    assert y[0] == np.prod(np.arange(1, p + 1))
    b = np.array([r % 2 == 0, True])
    comm.allreduce(b, op=gpurt.BAND)
    assert b.tolist() == [p == 1, True]
    # complex AVG: each part correctly rounded, as a real one (NumPy's complex division,
    # used before, is 1 ulp off for about a third of the integers over 3: a bug hunt)
    for dt in (np.complex64, np.complex128):
        rt = np.dtype(dt).char.lower()
        vals = np.arange(-40, 41)
        z = (vals * (r + 1) + r * r + 1j * (vals * (r - 2) - r ** 3)).astype(dt)
        comm.allreduce(z, op="avg")
        s = sum(vals * (q + 1) + q * q + 1j * (vals * (q - 2) - q ** 3) for q in range(p))
        want_re = (s.real.astype(np.float64) / p).astype(rt)   # exact sums: one rounding
        want_im = (s.imag.astype(np.float64) / p).astype(rt)
        if rt == "d":
            want_re, want_im = s.real / np.float64(p), s.imag / np.float64(p)
        assert np.array_equal(z.real, want_re) and np.array_equal(z.imag, want_im), dt


def test_bad_input_raises_before_anything_moves(comm):
    p, r = comm.size, comm.rank
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(ValueError, match=rf"rank {r}: x is not C-contiguous"):
        comm.allreduce(x[::2])
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        comm.allreduce(np.ones(4, np.float32), ro)
    with pytest.raises(ValueError, match="x is read-only"):
        comm.allreduce(ro)
    with pytest.raises(ValueError, match="out has 3 elements, 8 expected"):
        comm.allreduce(x, np.empty(3, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        comm.allreduce(x, np.empty(8, np.float64))
    with pytest.raises(ValueError, match=f"root {p} is not a rank"):
        comm.broadcast(x, root=p)
    with pytest.raises(ValueError, match="root -1 is not a rank"):
        comm.reduce(x, root=-1)
    with pytest.raises(ValueError, match="root True is not a rank"):   # (was root 1)
        comm.broadcast(x, root=True)
    with pytest.raises(ValueError, match="root 0.0 is not a rank"):
        comm.broadcast(x, root=0.0)
    # an integral object (a 0-d integer array or tensor: torch.tensor(k)) is a rank
    y = np.full(8, float(r), np.float32)
    comm.broadcast(y, root=np.array(p - 1))
    assert (y == p - 1).all(), y
    # ... but not one of one element and one dimension, nor a bool
    with pytest.raises(ValueError, match=r"root array\(\[0\]\) is not a rank"):
        comm.broadcast(x, root=np.array([0]))
    with pytest.raises(ValueError, match=r"root array\(False\) is not a rank"):
        comm.broadcast(x, root=np.array(False))
    with pytest.raises(TypeError, match="dtype <U3 is not supported"):
        comm.allreduce(np.array(["abc"]))
    with pytest.raises(TypeError, match="op BAND is not defined for dtype float32"):
        comm.allreduce(x, op=gpurt.BAND)
    with pytest.raises(TypeError, match="op AVG is not defined for dtype int32"):
        comm.allreduce(np.ones(2, np.int32), op="avg")
    with pytest.raises(ValueError, match="unknown reduction op 'median'"):
        comm.allreduce(x, op="median")
    # op=None on a reduction, small and large (the inline paths must not take it)
    for n in (8, 300000):
        big = np.ones(n * p, np.float32)
        with pytest.raises(ValueError, match="unknown reduction op None"):
            comm.allreduce(big[:n], op=None)
        with pytest.raises(ValueError, match="unknown reduction op None"):
            comm.reduce(big[:n], np.empty(n, np.float32), op=None)
        with pytest.raises(ValueError, match="unknown reduction op None"):
            comm.reduce_scatter(big, np.empty(n, np.float32), op=None)
    with pytest.raises(TypeError, match="is not an array"):
        comm.allreduce([1, 2, 3])
    same = np.zeros(p, np.int32)
    with pytest.raises(ValueError, match="alltoall: out overlaps x"):
        comm.alltoall(same, same)
    if p > 1:
        with pytest.raises(ValueError, match="not a multiple of the communicator size"):
            comm.alltoall(np.zeros(p + 1, np.int32))
        with pytest.raises(ValueError, match="not a multiple"):
            comm.reduce_scatter(np.zeros(p * 2 + 1, np.float32))
    with pytest.raises(ValueError, match=f"peer {p} is not a rank"):
        comm.send(x, p)
    with pytest.raises(ValueError, match="to itself"):
        comm.send(x, r)
    for bad in (-1, 2**64, 2**64 + 5, True, 1.0):   # (2**64 + 5 wrapped to tag 5 before)
        with pytest.raises(ValueError, match=r"tag must be an int from 0 to 2\*\*64-1"):
            comm.isend(x, (r + 1) % p, tag=bad) if p > 1 else \
                comm._p2p("send", comm._in(x), 0, bad)

    class FakeDevice:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (1234, False),
                                    "version": 3, "strides": None}

    with pytest.raises(TypeError, match="device buffer.*no device backend"):
        comm.allreduce(FakeDevice())
    # the communicator is still healthy after all that
    y = np.ones(3, np.int32)
    comm.allreduce(y)
    assert (y == p).all()


def test_nonblocking_variants(comm):
    p, r = comm.size, comm.rank
    xs = [np.full(1000 * (i + 1), i + r, np.int64) for i in range(3)]
    reqs = [comm.iallreduce(x) for x in xs]
    for i in reversed(range(3)):         # wait in any order
        assert reqs[i].wait() is xs[i]
        assert (xs[i] == sum(i + q for q in range(p))).all()
    req = comm.ibroadcast(np.full(10, r, np.float32), root=0)
    while not req.test():
        pass
    assert (req.result == 0).all()
    # small calls, several in flight, waited in reverse order: each keeps its own data
    # (across nodes they fold, one after the other through the agreement's buffers)
    ns = (3, 64, 1, 200, 17)
    xs = [np.arange(n, dtype=np.float64) * (i + 1) + r for i, n in enumerate(ns)]
    reqs = [comm.iallreduce(x.copy()) for x in xs] + \
        [comm.iallgather(x) for x in xs] + [comm.ibroadcast(xs[1].copy(), root=p - 1)]
    for req in reversed(reqs):
        req.wait(timeout=60)
    for i, n in enumerate(ns):
        assert np.array_equal(reqs[i].result, sum(np.arange(n) * (i + 1) + q for q in range(p)))
        assert np.array_equal(np.asarray(reqs[len(ns) + i].result).reshape(p, n),
                              [np.arange(n) * (i + 1) + q for q in range(p)])
    assert np.array_equal(reqs[-1].result, np.arange(64) * 2 + p - 1)
    req = comm.ibroadcast(np.full(10, r, np.float32), root=0)
    while not req.test():
        pass
    assert (req.result == 0).all()
    bar = comm.ibarrier()
    bar.wait(timeout=30)
    assert bar.done
    for make in (lambda: comm.iallgather(np.ones(2)), lambda: comm.ireduce_scatter(np.ones(2 * p)),
                 lambda: comm.ialltoall(np.ones(p)), lambda: comm.igather(np.ones(1)),
                 lambda: comm.iscatter(np.ones(p), np.empty(1)),
                 lambda: comm.ireduce(np.ones(1))):
        make().wait()


def test_a_zero_timeout_wait_names_who_is_missing_or_completes(comm):
    """``wait(timeout=0)`` right after posting: it completes where the call can complete
    without waiting, else its CollectiveTimeout names a rank that was missing (a third of
    them named nobody, "still waiting for rank(s) []": the peer's part came between the
    last step and the naming); a later wait completes the call, exact."""
    p, r = comm.size, comm.rank
    timeouts = 0
    for i in range(150):
        x = np.full(8, r + i, np.float32)
        q = comm.iallreduce(x)
        try:
            q.wait(timeout=0)
        except gpurt.CollectiveTimeout as e:
            timeouts += 1
            assert p > 1 and e.missing and all(0 <= k < p and k != r for k in e.missing), \
                (str(e), e.missing)
            assert f"still waiting for rank(s) {list(e.missing)}" in str(e), str(e)
            q.wait(timeout=30)
        assert q.done and (x == sum(q_ + i for q_ in range(p))).all(), (i, x[:2])
    if p == 1:
        assert timeouts == 0


def test_point_to_point(comm):
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("point-to-point needs 2 ranks")
    right, left = (r + 1) % p, (r - 1) % p
    # large messages both ways at once: isend/irecv must not deadlock
    big = np.arange(1 << 20, dtype=np.float64) + r
    got = np.empty_like(big)
    # (peers given as 0-d integer arrays: integral, so ranks — as torch.tensor(k) is)
    reqs = [comm.isend(big, np.array(right), tag=5), comm.irecv(got, np.array(left), tag=5)]
    for q in reqs:
        q.wait(timeout=60)
    assert (got == np.arange(1 << 20) + left).all()
    # blocking small messages around the ring, in order
    if r == 0:
        comm.send(np.array([7], np.int32), right, tag=1)
        v = comm.recv(np.empty(1, np.int32), left, tag=1)
        assert v[0] == 7 + p - 1
    else:
        v = comm.recv(np.empty(1, np.int32), left, tag=1)
        comm.send(v + 1, right, tag=1)


def test_p2p_mismatch_is_an_error_not_garbage(comm):
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        if r == 0:
            c.send(np.ones(4, np.float32), 1, tag=3)
        elif r == 1:
            with pytest.raises(gpurt.CollectiveMismatchError, match="rank 0.*tag 3.*tag 4"):
                c.recv(np.empty(4, np.float32), 0, tag=4)
            with pytest.raises(gpurt.CommunicatorClosed):
                c.recv(np.empty(4, np.float32), 0, tag=4)
    with scratch(comm) as c:      # the same tag and bytes, another dtype: both named
        if r == 0:
            c.send(np.ones(4, np.float32), 1, tag=3)
        elif r == 1:
            with pytest.raises(gpurt.CollectiveMismatchError,
                               match=r"rank 0.*tag 3 but the message is float32 x 4 "
                                     r"\(16 bytes\) and the receive int32 x 4 \(16 bytes\)"):
                c.recv(np.empty(4, np.int32), 0, tag=3)


@pytest.mark.parametrize("algo", [None, "hierarchical"])
def test_an_empty_call_against_a_full_one_is_a_mismatch_on_every_rank(comm, algo):
    """A rank whose call moves nothing (0 elements: an empty schedule) skipped the
    agreement, returned at once, and left the others waiting for its header until their
    deadline — across nodes, and on one node with algo='hierarchical' (review finding).
    Every rank now raises CollectiveMismatchError at once, and a 0-element call that every
    rank makes still completes."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        x = np.ones(0 if r == p - 1 else 3, np.float32)
        t0 = time.monotonic()
        with pytest.raises(gpurt.CollectiveMismatchError, match="count=0"):
            c.allreduce(x, algo=algo, timeout=20)
        assert time.monotonic() - t0 < 10
    with scratch(comm) as c:
        x = np.ones(0, np.float32)
        assert c.allreduce(x, algo=algo, timeout=20).size == 0
        y = np.full(3, r + 1.0)
        c.allreduce(y, algo=algo, timeout=20)
        assert (y == p * (p + 1) / 2).all()


@pytest.mark.parametrize("how", ["wait", "test"])
@pytest.mark.parametrize("n", [10, 300000])
def test_a_completed_request_is_not_failed_by_the_next_calls_mismatch(comm, how, n):
    """q0 completes; q1's counts differ on the last rank.  Waiting on q0 (or polling its
    test()) began q1 in the same pass, and q1's mismatch came out of q0's wait on some
    rank, although q0 had its exact result (a second wait returned it: one request, two
    answers; review finding).  q0 now gives its result on every rank, q1 raises the
    mismatch, the next call finds the communicator closed."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        x = np.full(n, r + 1, np.int64)
        q0 = c.iallreduce(x)
        q1 = c.iallreduce(np.zeros(n + (r == p - 1), np.int64))
        if how == "wait":
            q0.wait(timeout=30)
        else:
            deadline = time.monotonic() + 30
            while not q0.test():
                assert time.monotonic() < deadline
        assert (x == p * (p + 1) // 2).all()
        with pytest.raises(gpurt.CollectiveMismatchError):
            q1.wait(timeout=30)
        with pytest.raises(gpurt.CommunicatorClosed):
            c.barrier()


def test_collective_size_mismatch_is_detected(comm):
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    t0 = time.monotonic()
    with scratch(comm) as c:
        with pytest.raises((gpurt.CollectiveMismatchError, gpurt.CollectiveTimeout)) as ei:
            c.allreduce(np.ones(4 + (r == 0), np.float32), algo="direct", timeout=10)
        kinds = comm.mpi.allgather(type(ei.value).__name__)
        assert "CollectiveMismatchError" in kinds
        assert time.monotonic() - t0 < 15


def test_timeout_names_the_missing_ranks(comm):
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        if r == 0:
            t0 = time.monotonic()
            with pytest.raises(gpurt.CollectiveTimeout) as ei:
                c.allreduce(np.ones(4, np.float32), timeout=0.5, algo="direct")
            assert 0.4 < time.monotonic() - t0 < 5
            assert ei.value.collective == "allreduce" and ei.value.seq == 1
            assert set(ei.value.missing) == set(range(1, p))
            assert "rank 0: allreduce (call #1) did not complete within 0.5 s" in str(ei.value)
            with pytest.raises(gpurt.CommunicatorClosed):   # poisoned
                c.barrier()
        comm.mpi.Barrier()     # the others keep the communicator open until then


def test_a_call_a_rank_gave_up_is_a_peer_failure_for_the_late_ranks(comm):
    """Rank 0's blocking allreduce times out before the others come: they raise
    PeerFailure in that call, carrying rank 0's error, with their buffers untouched.
    Before, on the board, rank 0's published contribution made the late ranks' call
    complete and return a result of a call rank 0 had given up (they learnt of it at
    their next call; a bug hunt)."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        x = np.full(10, r + 1.0)
        if r == 0:
            with pytest.raises(gpurt.CollectiveTimeout):
                c.allreduce(x, timeout=0.3)
            comm.mpi.Barrier()      # (the others come once rank 0 has given up)
        else:
            comm.mpi.Barrier()
            with pytest.raises(gpurt.PeerFailure) as ei:
                c.allreduce(x, timeout=30)
            assert ei.value.rank == 0 and "in allreduce (call #1)" in str(ei.value), \
                str(ei.value)
            assert "rank 0: allreduce (call #1) did not complete within 0.3 s" in \
                str(ei.value), str(ei.value)
            assert (x == r + 1.0).all()


def test_a_timeout_names_the_ranks_its_own_request_waits_for(comm):
    """Rank 0 waits on a receive from rank 2 while one from rank 1 is in flight too: the
    timeout names rank 2 alone (it named every request's peers, [1, 2]: a bug hunt);
    both receives then complete."""
    p, r = comm.size, comm.rank
    if p < 3:
        pytest.skip("needs 3 ranks")
    with scratch(comm) as c:
        if r == 0:
            o1, o2 = np.zeros(4), np.zeros(4)
            q1, q2 = c.irecv(o1, 1), c.irecv(o2, 2)
            with pytest.raises(gpurt.CollectiveTimeout) as ei:
                q2.wait(timeout=0.3)
            assert ei.value.missing == (2,), str(ei.value)
            assert str(ei.value).endswith("still waiting for rank(s) [2]"), str(ei.value)
        comm.mpi.Barrier()
        if r in (1, 2):
            c.send(np.full(4, float(r)), 0)
        elif r == 0:
            q1.wait(timeout=30)
            q2.wait(timeout=30)
            assert o1.tolist() == [1.0] * 4 and o2.tolist() == [2.0] * 4


def test_a_receive_that_times_out_names_its_tag_and_can_wait_again(comm):
    """A point-to-point wait past its timeout: CollectiveTimeout naming the peer and the
    tag ("(tag 5)", seq -1 — the message has no call number; it said "call #5"), the
    request still in flight: the next wait completes with the data."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        if r == 1:
            got = np.zeros(3, np.int64)
            req = c.irecv(got, 0, tag=5)
            with pytest.raises(gpurt.CollectiveTimeout) as ei:
                req.wait(timeout=0.3)
            assert "rank 1: recv from rank 0 (tag 5) did not complete within 0.3 s" \
                in str(ei.value), str(ei.value)
            assert ei.value.seq == -1 and ei.value.missing == (0,)
        comm.mpi.Barrier()
        if r == 0:
            c.send(np.arange(3, dtype=np.int64), 1, tag=5)
        elif r == 1:
            req.wait(timeout=30)
            assert got.tolist() == [0, 1, 2]


def test_split_dup_close(comm):
    p, r = comm.size, comm.rank
    sub = comm.split(r % 2, key=-r)          # reversed order inside each half
    members = [q for q in range(p) if q % 2 == r % 2]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, reverse=True).index(r)
    x = np.array([r], np.int64)
    sub.allreduce(x)
    assert x[0] == sum(members)
    none = comm.split(None if r == 0 else 1)
    assert (none is None) == (r == 0)
    if none is not None:
        none.close()
    d = comm.dup()
    assert d is not comm and d.size == p
    y = np.array([1.0])
    d.allreduce(y)
    assert y[0] == p
    d.close()
    d.close()   # idempotent
    sub.close()


def test_explain_and_forced_algorithm(comm):
    text = comm.explain("allreduce", 1 << 20)
    assert "chosen" in text and "ring" in text and "direct" in text
    os.environ["GPURT_ALGO"] = "allreduce:ring,broadcast:tree"
    config.reload()
    try:
        d = comm.dup()
        assert "(GPURT_ALGO)" in d.explain("allreduce", 8)
        req = d.iallreduce(np.ones(2))
        req.wait()
        assert req.algorithm == "ring"
        req = d.ibroadcast(np.ones(2))
        req.wait()
        assert req.algorithm == "binomial"
        d.close()
    finally:
        del os.environ["GPURT_ALGO"]
        config.reload()
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        comm.allreduce(np.ones(2), algo="nope")


def test_tcp_settings_do_not_matter_without_tcp(comm):
    """An invalid tcp setting is an error only where tcp is set up: a communicator with
    GPURT_TRANSPORTS=shm is created as before (rank 0 reads the stripe threshold only to
    keep the pair fold's messages one tcp frame, where tcp carries them)."""
    if comm.nnodes > 1:
        pytest.skip("several nodes need tcp")
    with _env({"GPURT_TCP_STRIPES": "0", "GPURT_TRANSPORTS": "shm"}):
        c = comm.dup()
    x = np.ones(3, np.int64)
    c.allreduce(x)
    assert (x == comm.size).all()
    c.close()
    comm.barrier()


@pytest.mark.parametrize("var,value", [("GPURT_NET_FOLD", "-8"), ("GPURT_NET_FOLD", "1M"),
                                       ("GPURT_NET_FOLD_PAIR", "-8"),
                                       ("GPURT_NET_FOLD_PAIR", "8M")])
def test_net_fold_out_of_range_is_an_error_at_creation(comm, var, value):
    """GPURT_NET_FOLD outside 0..64K or GPURT_NET_FOLD_PAIR outside 0..4M (they size the
    agreement's messages) fail communicator creation on every rank with a ValueError
    naming the variable (read as a settings problem, so `gpurt info --env` flags it
    too), not the first call."""
    with _env({var: value}), \
            pytest.raises(ValueError, match=var + r"='[^']*' is not valid: (a size cannot be "
                                                  r"negative|\d+ bytes: must be between 0 and)"):
        comm.dup()
    comm.barrier()


def test_large_and_odd_counts(comm):
    p, r = comm.size, comm.rank
    for n in (0, 1, 2, 3, 97, 65537, (1 << 21) + 3):
        x = (np.arange(n) % 5 + r).astype(np.float32)
        comm.allreduce(x)
        want = sum((np.arange(n) % 5 + q).astype(np.float32) for q in range(p))
        assert np.array_equal(x, want), n


def test_torch_cpu_tensors(comm):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    t = torch.ones(4) * (comm.rank + 1)
    comm.allreduce(t)
    assert t.tolist() == [sum(range(1, comm.size + 1))] * 4
    g = comm.allgather(torch.ones(2))
    assert isinstance(g, torch.Tensor) and tuple(g.shape) == (comm.size, 2)
    # a 0-d integer tensor is a rank number (as NumPy's); a bool tensor and a tensor of
    # one element in one dimension are not (torch's __index__ takes both: they were root 1)
    comm.broadcast(t, root=torch.tensor(comm.size - 1))
    for bad in (torch.tensor(True), torch.tensor([0])):
        with pytest.raises(ValueError, match=f"rank {comm.rank}: root .* is not a rank"):
            comm.broadcast(t, root=bad)
    if comm.size > 1:
        with pytest.raises(ValueError, match="peer .* is not a rank"):
            comm.send(t, torch.tensor(True))
        with pytest.raises(ValueError, match="tag"):
            comm.send(t, (comm.rank + 1) % comm.size, tag=torch.tensor([1]))


def test_torch_tensors_written_by_a_call_tell_autograd(comm):
    """A tensor gpurt writes (in place, out=, a broadcast's or a recv's buffer) has its
    version counter bumped as torch's own in-place operations do: a backward that saved
    it (here through p.detach(), as the README advises) raises autograd's "modified by an
    inplace operation" instead of using the overwritten values without a word (bug hunt);
    a tensor only read keeps its version."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    r, p = comm.rank, comm.size
    w = torch.ones(3, requires_grad=True)
    a = torch.ones(3) * (r + 1)
    z = w * a                       # autograd saves a
    comm.allreduce(a.detach())
    assert a.tolist() == [p * (p + 1) / 2] * 3 and a._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
    x, out = torch.ones(4), torch.zeros(4)
    comm.allreduce(x, out)
    assert (x._version, out._version) == (0, 1) and out.tolist() == [p] * 4
    comm.broadcast(x)
    assert x._version == 1
    if p > 1 and r < 2:
        b = torch.zeros(5)
        if r == 0:
            comm.send(torch.ones(5), 1)
        else:
            comm.recv(b, 0)
            assert b.tolist() == [1.0] * 5 and b._version == 1


def test_torch_lazily_negated_views_are_refused_not_read_as_their_storage(comm):
    """z.conj().imag is a view with torch's negative bit: its storage holds -imag, which
    DLPack hands over as it is (allreduce MAX of -1 and -5 gave -5 before; an allgather
    lost the sign).  Refused with the fix in the message; resolve_neg() works, exact."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    r, p = comm.rank, comm.size
    z = torch.tensor([1 - (4 * r + 1) * 1j], dtype=torch.complex64)   # imag: -1, -5, ...
    v = z.conj().imag
    assert v.is_neg() and v.tolist() == [4 * r + 1]
    with pytest.raises(TypeError, match=r"lazily negated view .*resolve_neg\(\)"):
        comm.allreduce(v, torch.empty(1), op=gpurt.MAX)
    with pytest.raises(TypeError, match="lazily negated"):
        comm.allgather(v)
    m = comm.allreduce(v.resolve_neg(), torch.empty(1), op=gpurt.MAX)
    assert m.tolist() == [4 * (p - 1) + 1]
    with pytest.raises(TypeError, match=r"lazily conjugated view .*resolve_conj\(\)"):
        comm.allreduce(z.conj())
    c = comm.allreduce(z.conj().resolve_conj())
    assert c.tolist() == [complex(p, sum(4 * q + 1 for q in range(p)))]


def test_torch_cpu_bfloat16_tensors(comm):
    """PyTorch bfloat16 CPU tensors (NumPy's DLPack import has none: viewed through int16),
    in place, into a new tensor, gathered; small integers, so the sums are exact."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
    p, r = comm.size, comm.rank
    t = torch.arange(6, dtype=torch.bfloat16) + (r + 1)
    assert comm.allreduce(t) is t
    assert t.tolist() == [float(i * p + p * (p + 1) // 2) for i in range(6)]
    x = torch.full((3,), float(r), dtype=torch.bfloat16)
    m = comm.allreduce(x, torch.empty_like(x), op=gpurt.MAX)
    assert m.dtype == torch.bfloat16 and m.tolist() == [float(p - 1)] * 3 and x.tolist() == [r] * 3
    g = comm.allgather(torch.full((2,), float(r), dtype=torch.bfloat16))
    assert isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16
    assert g.tolist() == [[float(q)] * 2 for q in range(p)]


@pytest.mark.parametrize("what", ["count", "op", "dtype"])
def test_board_mismatch_names_both_calls(comm, what):
    """Small collectives use the one-round shm board; ranks whose calls differ all raise
    CollectiveMismatchError naming both calls (never a wrong answer)."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        n = 5 if (what == "count" and r == 0) else 4
        dt = np.float64 if (what == "dtype" and r == 0) else np.float32
        op = gpurt.MAX if (what == "op" and r == 0) else gpurt.SUM
        x = np.ones(n, dt)
        if c.board is not None:     # one node; on several the agreement check says the same
            assert c.explain("allreduce", x.nbytes).split("\n")[2].split()[0] == "shm_board"
        here = inspect.currentframe().f_lineno
        with pytest.raises(gpurt.CollectiveMismatchError) as ei:
            if r == 0:
                c.allreduce(x, op=op, timeout=20)          # here + 3
            else:
                c.allreduce(x, op=op, timeout=20)          # here + 5
        msg = str(ei.value)
        mine = f"allreduce({np.dtype(dt)}, count={n}, op={op.name})"
        assert f"rank {r}: in allreduce (call #1): call #1: rank " in msg
        assert mine in msg, msg
        other = "allreduce(float32, count=4, op=SUM)" if r == 0 else \
            {"count": "allreduce(float32, count=5, op=SUM)",
             "op": "allreduce(float32, count=4, op=MAX)",
             "dtype": "allreduce(float64, count=4, op=SUM)"}[what]
        assert other in msg, msg
        # both call sites (shown, not compared): rank 0's line and the others'; the inline
        # round publishes no site, a rank that finds the mismatch does (it failed before)
        for line in (here + 3, here + 5):
            assert f"test_api.py:{line} in test_board_mismatch_names_both_calls" in msg, msg
        assert (x == 1).all()                 # nothing written into the user's buffer


def test_single_copy_is_probed_and_used(comm):
    """Every local rank can read every other's memory here (same user, no Yama), so the
    probe enables single-copy; a 4 MiB exchange then goes through it, exactly.  (The
    threshold is set to 1 MiB: ``auto`` follows the last-level cache, which on some hosts
    of this VM is 300 MiB, and would keep 4 MiB messages double-copy.)"""
    p, r = comm.size, comm.rank
    if p == 1 or comm.nnodes > 1:
        pytest.skip("needs 2 ranks on one node")
    os.environ["GPURT_SHM_CMA"] = "1M"
    config.reload()
    try:
        c = comm.dup()
    finally:
        del os.environ["GPURT_SHM_CMA"]
        config.reload()
    try:
        shm = c._shm()
        if shm is None:
            pytest.skip("no shm transport on this communicator (GPURT_TRANSPORTS)")
        assert shm.cma_why == "", shm.cma_why
        ep = shm.endpoints[(r + 1) % p]
        before = ep.tx[0].acks
        big = np.arange(1 << 19, dtype=np.float64) * (r + 1)
        out = c.allgather(big, algo="ring")
        for q in range(p):
            assert (out[q] == np.arange(1 << 19) * (q + 1)).all()
        assert ep.tx[0].acks > before        # the ring steps went single-copy
    finally:
        c.close()
        comm.mpi.Barrier()


def test_pending_isend_does_not_block_a_small_blocking_collective(comm):
    """A small blocking collective may run inline on the board; a send/recv posted before
    it must still make progress (review finding: it used to deadlock)."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    right, left = (r + 1) % p, (r - 1) % p
    req = comm.isend(np.full(4, r, np.float32), right, tag=9)
    got = comm.recv(np.empty(4, np.float32), left, tag=9, timeout=20)
    x = np.ones(2, np.float32)
    comm.allreduce(x, timeout=20)
    req.wait(timeout=20)
    assert (got == left).all() and (x == p).all()
    # the other order: isend, then the collective, then the matching receive
    req = comm.isend(np.full(3, r, np.int64), right)
    comm.barrier(timeout=20)
    got = comm.recv(np.empty(3, np.int64), left, timeout=20)
    req.wait(timeout=20)
    assert (got == left).all()


def test_bad_timeout_and_dtype_are_rejected_before_the_call_counts(comm):
    p, r = comm.size, comm.rank
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=rf"rank {r}: timeout must be a number"):
        comm.allreduce(x, timeout="5s")
    for bad in ("5", True):     # (float() took them: an unparsed option, a flag)
        with pytest.raises(ValueError, match=rf"rank {r}: timeout must be a number"):
            comm.allreduce(x, timeout=bad)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        comm.allreduce(x, timeout=datetime.timedelta(seconds=-1))
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        comm.barrier(timeout=-1)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        comm.iallreduce(np.ones(2)).wait(timeout=float("nan"))
    with pytest.raises(TypeError, match="dtype >f8 is not supported"):
        comm.broadcast(np.ones(3, ">f8"))
    with pytest.raises(ValueError, match=rf"rank {r}: unknown algorithm 'nope'"):
        comm.allreduce(x, algo="nope")
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="x is read-only"):
        comm.broadcast(ro, root=0)      # the root's x too: algorithms may write through it
    seq = comm._seq
    comm.allreduce(x, timeout=20)       # still in step with every rank
    assert (x == p).all() and comm._seq == seq + 1
    # a timedelta, as torch.distributed takes it
    comm.allreduce(x, timeout=datetime.timedelta(seconds=20))
    assert (x == p * p).all() and comm._seq == seq + 2


def test_a_timeout_too_large_for_a_float_on_one_rank_is_a_rejection(comm):
    """timeout=10**400 (a Python int no float holds) on the last rank only: there a
    ValueError naming the rank, on the others a CollectiveMismatchError, and the next
    call is an error on every rank.  (float() raised OverflowError, which escaped the
    check: the call was neither counted nor announced, and that rank's next allreduce
    summed with the others' current one: 21 on both of 2 ranks, a silent wrong result.)"""
    p, r = comm.size, comm.rank
    with scratch(comm) as c:
        a = np.full(4, 10.0 * (r + 1), np.float32)
        if r == p - 1:
            with pytest.raises(ValueError, match=rf"rank {r}: timeout must be a number"):
                c.allreduce(a, timeout=10**400)
        elif p > 1:
            with pytest.raises(gpurt.CollectiveMismatchError, match=f"rank {p - 1} rejected"):
                c.allreduce(a, timeout=30)
        b = np.full(4, 1.0, np.float32)
        if p > 1:       # (the peers' communicator failed with the mismatch)
            with pytest.raises(gpurt.GpurtError):
                c.allreduce(b, timeout=30)
    b = np.full(4, 1.0, np.float32)
    req = comm.iallreduce(b)
    with pytest.raises(ValueError, match=rf"rank {r}: timeout must be a number"):
        req.wait(timeout=10**400)
    req.wait(timeout=30)                              # the request is still good
    assert (b == p).all(), b


def test_argument_errors_name_the_rank_and_the_argument(comm):
    """Bad arguments found by a review: algo= of the wrong type was a bare 'unhashable
    type: list' from the tuner's cache; barrier(algo='nope') passed on one rank;
    send(peer=True) went to rank 1; Request.wait's timeout, explain()/candidates() and
    comm.empty/zeros errors did not name the rank.  Every rank makes the same bad calls:
    the communicator stays in step and usable."""
    p, r = comm.size, comm.rank
    x = np.ones(4, np.float32)
    for call in (lambda: comm.allreduce(x, algo=["ring"]),
                 lambda: comm.iallgather(x, algo=3),
                 lambda: comm.barrier(algo=b"ring")):
        with pytest.raises(TypeError, match=rf"rank {r}: \w+: algo= is an algorithm's "
                                            r"name \(a str\) or None, got"):
            call()
    with pytest.raises(ValueError, match=rf"rank {r}: unknown algorithm 'nope'"):
        comm.barrier(algo="nope")                   # on 1 rank too
    if comm.board is None:      # (one rank, or several nodes: no board; it was "unknown")
        with pytest.raises(ValueError, match=rf"rank {r}: algorithm 'shm_board' is not "
                                             r"available here: it needs a communicator of "
                                             r"2 or more ranks on one node"):
            comm.allreduce(x, algo="shm_board")
    with pytest.raises(ValueError, match=rf"rank {r}: send peer True is not a rank"):
        comm.send(x, True)
    with pytest.raises(ValueError, match=rf"rank {r}: recv peer np.True_|rank {r}: recv "
                                         rf"peer True is not a rank"):
        comm.recv(x, np.True_)
    req = comm.iallreduce(x)
    with pytest.raises(ValueError, match=rf"rank {r}: timeout must be >= 0"):
        req.wait(timeout=-1)
    req.wait(timeout=30)                            # the request is still good
    assert (x == p).all()
    for call in (lambda: comm.explain("bogus", 1), lambda: comm.candidates("bogus", 1)):
        with pytest.raises(ValueError, match=rf"rank {r}: unknown collective 'bogus'"):
            call()
    with pytest.raises(ValueError, match=rf"rank {r}: gpurt.empty: negative dimension"):
        comm.empty(-1)
    with pytest.raises(TypeError, match=rf"rank {r}: gpurt.empty: data type 'nope' not "
                                        r"understood"):
        comm.zeros(4, "nope")
    # (more than the machine's memory and swap; where /proc/meminfo cannot say, the
    # allocation fails instead)
    with pytest.raises(gpurt.ResourceError, match=rf"rank {r}: gpurt.empty: (4194304.0 GiB "
                                                  r"of shared memory is more than this "
                                                  r"machine has|cannot allocate )"):
        comm.empty(2 ** 50)                         # 4 PiB
    with pytest.raises(ValueError, match=rf"rank {r}: nbytes must be >= 0, got -5"):
        comm.explain("allreduce", -5)
    with pytest.raises(TypeError, match=rf"rank {r}: nbytes must be an integer, got 1.5"):
        comm.candidates("allreduce", 1.5)
    y = np.full(3, r + 1.0)
    comm.allreduce(y, timeout=30)                   # in step
    assert (y == p * (p + 1) / 2).all()


@pytest.mark.parametrize("coll", ["broadcast", "scatter", "reduce", "gather"])
def test_root_disagreement_is_an_error_on_every_rank(comm, coll):
    """Ranks that disagree on the root (small calls: the board on one node, the agreement
    check on several): every rank raises CollectiveMismatchError naming the roots — the
    ranks in between too, although their own call's root did answer — and no output
    buffer is written."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        root = p - 1 if r == p - 1 else 0    # the last rank thinks it is the root
        n = 4
        x = np.full(n * (p if coll == "scatter" else 1), r, np.float32)
        out = np.full(n * (p if coll == "gather" else 1), -1, np.float32)
        with pytest.raises(gpurt.CollectiveMismatchError) as ei:
            if coll == "broadcast":
                c.broadcast(x, root=root, timeout=20)
            elif coll == "scatter":
                c.scatter(x, out, root=root, timeout=20)
            elif coll == "reduce":
                c.reduce(x, out, root=root, timeout=20)
            else:
                c.gather(x, out, root=root, timeout=20)
        assert "root=" in str(ei.value), str(ei.value)
        assert (out == -1).all()
        if coll == "broadcast":
            assert (x == r).all()


@pytest.mark.parametrize("case", ["kind", "count", "root"])
def test_every_rank_detects_a_mismatch_before_data_moves(comm, case):
    """Large collectives (schedules, not the board) first agree on the call: every rank
    raises CollectiveMismatchError naming both calls, and no output buffer is written."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    n = 1 << 17                                   # 512 KiB of float32: past the board
    with scratch(comm) as c:
        x = np.ones(n, np.float32)
        out = np.full(n, -1, np.float32)
        odd = r == p - 1
        with pytest.raises(gpurt.CollectiveMismatchError) as ei:
            if case == "kind" and odd:
                c.broadcast(x, root=0, timeout=20)
            elif case == "count" and odd:
                c.allreduce(x[:-p], out[:-p], timeout=20)
            elif case == "root":
                c.reduce(x, out, root=1 if odd else 0, timeout=20)
            else:
                c.allreduce(x, out, timeout=20)
        msg = str(ei.value)
        assert "called" in msg and msg.count("(") >= 2, msg
        lines = set(re.findall(r"test_api\.py:(\d+) in test_every_rank", msg))
        if case == "kind":          # the odd rank called from another line: both are named
            assert len(lines) == 2, msg
        else:
            assert len(lines) >= 1, msg
        assert (out == -1).all() and (x == 1).all()     # nothing written anywhere


def _folds(c) -> bool:
    """Do small calls on ``c`` run inside the agreement's exchange (several nodes or no
    board, checking on, GPURT_NET_FOLD > 0, up to 8 ranks)?"""
    return c.size > 1 and c.board is None and config.get("GPURT_CHECK") and \
        config.get("GPURT_NET_FOLD") > 0 and c.size <= 8


def _fold_room(c, coll: str = "") -> int:
    """The most bytes of one rank's contribution that fold: GPURT_NET_FOLD is what a rank
    may send to all the others, one message each (whole 8-byte words); an allreduce on two
    ranks folds up to GPURT_NET_FOLD_PAIR."""
    room = config.get("GPURT_NET_FOLD") // max(1, c.size - 1) // 8 * 8
    if coll == "allreduce" and c.size == 2:
        room = max(room, config.get("GPURT_NET_FOLD_PAIR") // 8 * 8)
    return room


@pytest.mark.parametrize("dt", [np.float32, np.int64, np.float64])
def test_small_calls_fold_into_the_agreement_exactly(comm, dt):
    """Across nodes, a checked collective whose data fits the agreement's messages
    (GPURT_NET_FOLD) runs in that one exchange: every collective, every root, counts 1 to
    the limit, exact results (reductions in rank order: the same bits everywhere), and the
    algorithm says ``folded``.  On one node (the board) the same calls run as before."""
    p, r = comm.size, comm.rank
    fold = _folds(comm)
    isz = np.dtype(dt).itemsize
    lim = _fold_room(comm) // isz
    bad = []

    def want(ok, what):
        if not ok:
            bad.append(what)
        if fold and comm.last_algorithm != "folded":
            bad.append(f"{what}: ran {comm.last_algorithm}")

    def v(k, n, base=7):
        return (np.arange(n) + base * k).astype(dt)

    for n in sorted({1, 3, 17, max(1, lim // p), lim}):
        x = v(r, n)
        tot = sum(v(k, n) for k in range(p))
        y = comm.allreduce(x.copy())
        want(np.array_equal(y, tot), f"allreduce n={n}")
        o = np.empty(n, dt)
        comm.allreduce(x, o, op=gpurt.Op.MAX)
        want(np.array_equal(o, v(p - 1, n)), f"allreduce MAX n={n}")
        if n * p <= lim:
            g = comm.allgather(x)
            want(np.array_equal(np.asarray(g).reshape(p, n),
                                np.stack([v(k, n) for k in range(p)])), f"allgather n={n}")
            xs = v(r, p * n, 100)
            o = comm.reduce_scatter(xs)
            want(np.array_equal(np.asarray(o).reshape(-1),
                                sum(v(k, p * n, 100) for k in range(p))[r * n:(r + 1) * n]),
                 f"reduce_scatter n={n}")
            o = comm.alltoall(xs)
            want(np.array_equal(np.asarray(o).reshape(-1), np.concatenate(
                [v(k, p * n, 100)[r * n:(r + 1) * n] for k in range(p)])), f"alltoall n={n}")
        for root in range(p):
            y = x.copy()
            comm.broadcast(y, root=root)
            want(np.array_equal(y, v(root, n)), f"broadcast n={n} root={root}")
            o = np.full(n, -1, dt)
            comm.reduce(x, o, root=root)
            want(np.array_equal(o, tot) if r == root else (o == -1).all(),
                 f"reduce n={n} root={root}")
            if n * p <= lim:
                g = comm.gather(x, root=root)
                want(r != root or np.array_equal(np.asarray(g).reshape(p, n), np.stack(
                    [v(k, n) for k in range(p)])), f"gather n={n} root={root}")
                o = np.empty(n, dt)
                comm.scatter(v(r, p * n, 100), o, root=root)
                want(np.array_equal(o, v(root, p * n, 100)[r * n:(r + 1) * n]),
                     f"scatter n={n} root={root}")
    comm.barrier()
    want(True, "barrier")
    assert not bad, bad[:10]
    # explain says which calls fold (an empty one too: its exchange is still the check)
    assert ("folded:" in comm.explain("allreduce", 64)) == fold
    assert "folded:" not in comm.explain("allreduce", _fold_room(comm, "allreduce") + 8)
    assert "folded:" not in comm.explain("allgather", (_fold_room(comm) + 8) * p)
    comm.allreduce(np.empty(0, dt))
    assert ("folded:" in comm.explain("allreduce", 0)) == (comm.last_algorithm == "folded")


@contextlib.contextmanager
def _across_pairs(comm, env: dict | None = None):
    """Communicators of two ranks on two nodes (world rank r with r + p/2, when the world
    is 2 nodes x p/2 by block), created with ``env`` set; None where there is no such
    pair (one node, an odd world)."""
    p, r = comm.size, comm.rank
    half = p // 2
    if comm.nnodes != 2 or p % 2 or comm.topo.node_of[0] == comm.topo.node_of[half]:
        yield None
        return
    sub = comm.mpi.Split(r % half, r)
    with _env(env or {}):
        c = gpurt.Communicator(sub)
    try:
        yield c
    finally:
        c.close()
        sub.Free()
        comm.mpi.Barrier()


def test_pair_across_nodes_folds_allreduce_up_to_the_pair_limit(comm):
    """Two ranks on two nodes: an allreduce of up to GPURT_NET_FOLD_PAIR bytes (default
    1 MiB, far above GPURT_NET_FOLD) runs inside the agreement's exchange — exact results
    in rank order for SUM, MAX, AVG, in place and into ``out`` — and just above it runs
    the schedule after the agreement; other collectives keep GPURT_NET_FOLD.  A folded
    1 MiB call against a small one is a mismatch on both ranks, nothing written.  With tcp
    striping on, the limit stays below the stripe threshold (an agreement message is one
    frame) and an upto receive that large is refused."""
    with _across_pairs(comm) as c:
        if c is None:
            pytest.skip("needs 2 nodes x an equal number of ranks (block cliques)")
        r = c.rank
        pair = config.get("GPURT_NET_FOLD_PAIR")
        assert c._fold_pair == pair and pair > c._fold
        lim = pair // 4
        for n in (1, c._fold // 4 + 1, lim - 1, lim, lim + 2):
            x = (np.arange(n, dtype=np.float32) % 1000) * (r + 1) + r
            want = (np.arange(n, dtype=np.float32) % 1000) * 3 + 1
            y = c.allreduce(x.copy())
            assert np.array_equal(y, want), n
            assert (c.last_algorithm == "folded") == (n <= lim), (n, c.last_algorithm)
            o = np.full(n, -1, np.float32)
            c.allreduce(x, o, op=gpurt.Op.MAX)
            assert np.array_equal(o, (np.arange(n, dtype=np.float32) % 1000) * 2 + 1), n
            xa = np.arange(n // 2, dtype=np.float64) * (r + 2)      # (the same bytes)
            c.allreduce(xa, op=gpurt.Op.AVG)
            assert np.array_equal(xa, np.arange(n // 2, dtype=np.float64) * 2.5), n
        assert "GPURT_NET_FOLD_PAIR" in c.explain("allreduce", pair)
        assert "folded:" not in c.explain("allreduce", pair + 8)
        n = (c._fold + 8) // 4          # an allgather above GPURT_NET_FOLD does not fold
        g = c.allgather(np.full(n, r, np.int32))
        assert np.array_equal(np.asarray(g).reshape(2, n), np.repeat([[0], [1]], n, 1))
        assert c.last_algorithm != "folded"
        # a folded 1 MiB call meets a small one: both raise, nothing written
        x = np.ones(lim if r else 8, np.float32)
        out = np.full(x.size, -1, np.float32)
        with pytest.raises(gpurt.CollectiveMismatchError) as ei:
            c.allreduce(x, out, timeout=20)
        assert f"count={lim}" in str(ei.value) and "count=8" in str(ei.value), ei.value
        assert (out == -1).all()
    # GPURT_NET_FOLD=0 still means that nothing else folds (a barrier, an allgather)
    with _across_pairs(comm, {"GPURT_NET_FOLD": "0"}) as c:
        c.barrier()
        assert c.last_algorithm != "folded"
        c.allgather(np.ones(4, np.float32))
        assert c.last_algorithm != "folded"
        y = c.allreduce(np.ones(1000, np.float32))
        assert c.last_algorithm == "folded" and (y == 2).all()
    smin = 256 << 10
    with _across_pairs(comm, {"GPURT_TCP_STRIPES": "2",
                              "GPURT_TCP_STRIPE_MIN": str(smin)}) as c:
        if "tcp" not in c.transport_of.values():
            pytest.skip("the pair is not connected by tcp")
        assert 0 < c._fold_pair < smin - 64
        for n in (c._fold_pair // 4, c._fold_pair // 4 + 2, (1 << 20) // 4):
            x = np.full(n, c.rank + 1, np.float32)
            c.allreduce(x)
            assert (x == 3).all(), n
            assert (c.last_algorithm == "folded") == (n * 4 <= c._fold_pair), n
        with pytest.raises(ValueError, match="upto receive"):
            c.endpoints[1 - c.rank].recv(smin, lambda o, b: None, 0, 1, 1, upto=True)


@pytest.mark.parametrize("dt", [np.float32, np.int32, np.float64])
def test_blocking_calls_inline_match_the_general_path(comm, dt):
    """Across nodes a blocking collective on NumPy arrays runs inline (no Request: the
    plan cached per call shape).  Each call below first runs as the i-variant on every
    rank (the reference), then with even ranks blocking (inline) and odd ranks on the
    i-variant, so the two paths meet in one call and must agree on the signature: exact
    results, in place and into out (allocated when out=None), for folded,
    agreed-then-scheduled and several-step calls, every op (AVG too), every root, the
    other ranks' buffers of a rooted call left alone, and the same algorithm recorded.
    (On one node the blocking calls run the board's inline path, against the same
    i-variants.)"""
    p, r = comm.size, comm.rank
    inline = comm.board is None and p > 1
    blocking = r % 2 == 0
    flt = np.dtype(dt).kind == "f"
    ops = [gpurt.Op.SUM, gpurt.Op.MAX, gpurt.Op.MIN, "prod"] + ([gpurt.Op.AVG] if flt else [])

    def mixed(block, ivar):
        """This rank's half of a call where even ranks block and odd ranks wait."""
        return block() if blocking else ivar().wait(timeout=60)

    with scratch(comm) as c:
        for n in (1, 7, 1000, 20000, 300000):
            for op in ops:
                x = ((np.arange(n) % 5) + r + 1).astype(dt)
                want = c.iallreduce(x.copy(), op=op).wait(timeout=60)
                alg = c.last_algorithm
                got = x.copy()
                mixed(lambda: c.allreduce(got, op=op, timeout=60),
                      lambda: c.iallreduce(got, op=op))                   # in place
                assert np.array_equal(got, want), (n, op)
                assert c.last_algorithm == alg, (n, op, alg, c.last_algorithm)
                out = np.full(n, -1, dt)
                assert mixed(lambda: c.allreduce(x, out, op=op, timeout=60),
                             lambda: c.iallreduce(x, out, op=op)) is out
                assert np.array_equal(out, want), (n, op)
                assert (x == ((np.arange(n) % 5) + r + 1).astype(dt)).all()   # input kept
        # broadcast (every root) and barrier
        for n in (1, 1000, 300000):
            for root in range(p):
                want = c.ibroadcast(((np.arange(n) % 7) + r).astype(dt), root=root).wait(
                    timeout=60)
                alg = c.last_algorithm
                got = ((np.arange(n) % 7) + r).astype(dt)
                assert mixed(lambda: c.broadcast(got, root=root, timeout=60),
                             lambda: c.ibroadcast(got, root=root)) is got
                assert np.array_equal(got, want) and \
                    np.array_equal(got, ((np.arange(n) % 7) + root).astype(dt)), (n, root)
                assert c.last_algorithm == alg, (n, root, alg, c.last_algorithm)
        c.ibarrier().wait(timeout=60)
        alg = c.last_algorithm
        mixed(lambda: c.barrier(timeout=60), c.ibarrier)
        assert c.last_algorithm == alg
        # reduce (every root, into out and in place), gather, allgather, reduce_scatter,
        # alltoall
        rops = [gpurt.Op.SUM, gpurt.Op.MAX] + ([gpurt.Op.AVG] if flt else [])
        for n in (1, 1000, 100000):
            x = ((np.arange(n) % 5) + r + 1).astype(dt)
            xs = ((np.arange(p * n) % 11) + 3 * r).astype(dt)
            for root in range(p):
                for op in rops:
                    want = np.full(n, -1, dt)
                    c.ireduce(x, want, op=op, root=root).wait(timeout=60)
                    alg = c.last_algorithm
                    out = np.full(n, -1, dt)
                    assert mixed(lambda: c.reduce(x, out, op=op, root=root, timeout=60),
                                 lambda: c.ireduce(x, out, op=op, root=root)) is out
                    assert np.array_equal(out, want), (n, root, op)   # (-1 off the root)
                    assert c.last_algorithm == alg, (n, root, alg, c.last_algorithm)
                    y = x.copy()
                    assert mixed(lambda: c.reduce(y, op=op, root=root, timeout=60),
                                 lambda: c.ireduce(y, op=op, root=root)) is y
                    assert np.array_equal(y, want if r == root else x), (n, root, op)
                want = c.igather(x, root=root).wait(timeout=60)
                alg = c.last_algorithm
                got = mixed(lambda: c.gather(x, root=root, timeout=60),
                            lambda: c.igather(x, root=root))
                assert (got is None) == (r != root) and c.last_algorithm == alg
                if r == root:
                    assert np.asarray(got).shape == (p, n), (n, root)
                    assert np.array_equal(got, want), (n, root)
            want = c.iallgather(x).wait(timeout=60)
            alg = c.last_algorithm
            got = mixed(lambda: c.allgather(x, timeout=60), lambda: c.iallgather(x))
            assert np.asarray(got).shape == (p, n) and np.array_equal(got, want), n
            assert c.last_algorithm == alg
            for op in rops:
                want = c.ireduce_scatter(xs, op=op).wait(timeout=60)
                alg = c.last_algorithm
                out = np.full(n, -1, dt)
                assert mixed(lambda: c.reduce_scatter(xs, out, op=op, timeout=60),
                             lambda: c.ireduce_scatter(xs, out, op=op)) is out
                assert np.array_equal(out, want) and c.last_algorithm == alg, (n, op)
            want = c.ialltoall(xs).wait(timeout=60)
            alg = c.last_algorithm
            out = np.full(p * n, -1, dt)
            assert mixed(lambda: c.alltoall(xs, out, timeout=60),
                         lambda: c.ialltoall(xs, out)) is out
            assert np.array_equal(out, want) and c.last_algorithm == alg, n
            # scatter: every root; x read on the root only (None elsewhere with out=, or
            # the full shape to allocate out from)
            x2 = xs.reshape(p, n)
            for root in range(p):
                want = c.iscatter(x2, root=root).wait(timeout=60)
                alg = c.last_algorithm
                assert want.shape == (n,) and np.array_equal(
                    want, ((np.arange(p * n) % 11) + 3 * root).astype(dt)[r * n:(r + 1) * n])
                got = mixed(lambda: c.scatter(x2, root=root, timeout=60),
                            lambda: c.iscatter(x2, root=root))
                assert got.shape == (n,) and np.array_equal(got, want), (n, root)
                assert c.last_algorithm == alg, (n, root, alg, c.last_algorithm)
                out = np.full(n, -1, dt)
                xr = xs if r == root else None
                assert mixed(lambda: c.scatter(xr, out, root=root, timeout=60),
                             lambda: c.iscatter(xr, out, root=root)) is out
                assert np.array_equal(out, want) and c.last_algorithm == alg, (n, root)
        # the blocking ranks ran every collective inline: a plan (not False) for each
        plans = {k[0] for k, v in c._netplans.items() if v}
        if inline and blocking:
            assert plans == {"allreduce", "broadcast", "barrier", "reduce", "gather",
                             "allgather", "reduce_scatter", "alltoall", "scatter"}, plans
        elif not inline:
            assert not plans
        if c.flight is not None:
            recs = c.flight.records()
            assert recs and all(e["state"] == "done" for e in recs[-6:])


@pytest.mark.parametrize("case", ["count", "dtype", "root", "unfolded"])
def test_folded_call_mismatch_names_both_calls_and_writes_nothing(comm, case):
    """A mismatch in a folded call is found from the headers before any result is
    computed: every rank raises CollectiveMismatchError naming the differing field, and no
    output is written (the data rode along, unused).  ``unfolded``: the last rank's call
    is too large to fold, so its agreement message is a header alone while the others'
    carry data — the receives take messages up to their room, so the headers still
    meet and name both counts."""
    p, r = comm.size, comm.rank
    if not _folds(comm):
        pytest.skip("no folding on this communicator (one node, or checking off)")
    odd = r == p - 1
    with scratch(comm) as c:
        x = np.ones(8, np.float32)
        out = np.full(8, -1, np.float32)
        with pytest.raises(gpurt.CollectiveMismatchError) as ei:
            if case == "count":
                c.allreduce(x[:7] if odd else x, out[:7] if odd else out, timeout=20)
            elif case == "dtype":
                xd = x.astype(np.float64) if odd else x
                c.allreduce(xd, np.full(8, -1, xd.dtype) if odd else out, timeout=20)
            elif case == "root":
                c.reduce(x, out, root=1 if odd else 0, timeout=20)
            else:
                big = np.ones(1 << 20, np.float32)
                c.allreduce(big if odd else x, np.full(1 << 20, -1, np.float32) if odd
                            else out, timeout=20)
        msg = str(ei.value)
        field = {"count": "count=7", "dtype": "float64", "root": "root=1",
                 "unfolded": "count=1048576"}[case]
        assert field in msg and "test_api.py:" in msg, msg
        assert (out == -1).all()


def _colliding_calls(tag: str, p: int, limit: int) -> tuple[tuple, tuple]:
    """Two different calls with at most ``limit`` bytes of input per rank whose 32-bit
    signatures (with algorithm ``tag``) are equal: the first such pair in a fixed order.
    (crc32 never confuses strings that differ in a short run of bits, so the pair differs
    in more than the count: another collective or dtype.)"""
    from gpurt.comm import _signature
    seen: dict[int, tuple] = {}
    ops = (gpurt.Op.SUM, gpurt.Op.MAX, gpurt.Op.MIN, gpurt.Op.PROD)
    bit = (gpurt.Op.BAND, gpurt.Op.BOR, gpurt.Op.BXOR)
    for dt in ("float32", "float64", "int32", "int64", "int16", "uint8", "int8", "uint16",
               "uint32", "uint64"):
        d = np.dtype(dt)
        kinds = [(c, op, root) for c in ("allreduce", "reduce", "reduce_scatter")
                 for op in ops + (bit if d.kind in "iu" else ())
                 for root in ((0, 1) if c == "reduce" else (0,))]
        kinds += [("broadcast", None, 0), ("broadcast", None, 1), ("allgather", None, 0),
                  ("alltoall", None, 0)]
        for coll, op, root in kinds:
            per = p if coll in ("reduce_scatter", "alltoall") else 1
            for n in range(1, limit // (d.itemsize * per) + 1):
                call = (coll, dt, n, op, root)
                sig = _signature(coll, d.str, n, op, root, tag)
                if sig in seen:
                    return seen[sig], call
                seen[sig] = call
    raise AssertionError("no colliding pair found")


def test_calls_whose_signatures_collide_are_still_a_mismatch(comm):
    """The signature is a 32-bit hash: two different calls can share it.  Every rank still
    compares the arguments themselves (the board on one node, the agreement across nodes,
    where a folded call computes straight from the rows), so such a pair is a
    CollectiveMismatchError on every rank, nothing written — never a result built from
    data of another shape."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        c.allreduce(np.ones(4, np.float32))
        tag = c.last_algorithm            # shm_board on one node, folded across nodes
        if tag not in ("shm_board", "folded"):
            pytest.skip(f"small calls run {tag} here")
        a, b = _colliding_calls(tag, p, 4096)
        coll, dt, n, op, root = b if r == p - 1 else a
        per = p if coll in ("reduce_scatter", "alltoall") else 1
        x = np.full(n * per, 3, dt)
        out = np.full(n * {"allgather": p, "alltoall": p}.get(coll, 1), 7, dt)
        with pytest.raises(gpurt.CollectiveMismatchError) as ei:
            if coll == "broadcast":
                out = x
                x[:] = 7
                c.broadcast(x, root=root, timeout=20)
            elif coll in ("allgather", "alltoall"):
                getattr(c, coll)(x, out, timeout=20)
            elif coll == "reduce":
                c.reduce(x, out, op=op, root=root, timeout=20)
            else:
                getattr(c, coll)(x, out, op=op, timeout=20)
        msg = str(ei.value)
        assert "called" in msg and msg.count("(") >= 2, (a, b, msg)
        assert (out == 7).all(), (a, b)


@pytest.mark.parametrize("size", [16, 1 << 18])
@pytest.mark.parametrize("algos", [("ring", "recursive_doubling"), (None, "ring"),
                                   ("shm_direct", "ring")])
def test_different_algorithms_are_a_mismatch_on_every_rank(comm, size, algos):
    """The last rank passes another ``algo=`` than the others for the same call (or none,
    where the others take the board, shm_direct or the tuner's pick): the algorithm is part
    of what the ranks agree on, so every rank raises CollectiveMismatchError naming both
    algorithms, and no output buffer is written — no wait for messages that never come, no
    result read from a board slot that holds none."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        x = np.arange(size, dtype=np.float32)
        out = np.full(size, -1, np.float32)
        names = []
        for a in algos:        # what each side runs (the same on every rank, for a test)
            try:
                c.allreduce(x.copy(), algo=a, timeout=30)
            except ValueError:         # shm_direct where it cannot be forced: skip
                pytest.skip(f"algo={a} is not available here")
            # (shm_staged is shm_direct's variant, chosen after the agreement: the
            # headers name shm_direct)
            names.append(c.last_algorithm.replace("shm_staged", "shm_direct"))
        if names[0] == names[1]:
            pytest.skip(f"both run {names[0]} on this communicator")
        mine = algos[1] if r == p - 1 else algos[0]
        t0 = time.monotonic()
        with pytest.raises(gpurt.CollectiveMismatchError) as ei:
            c.allreduce(x, out, algo=mine, timeout=30)
        assert time.monotonic() - t0 < 10
        msg = str(ei.value)
        assert all(f"algorithm {a}" in msg for a in names), (names, msg)
        assert msg.count(f"count={size}") >= 2, msg
        assert (out == -1).all() and (x == np.arange(size, dtype=np.float32)).all()


@pytest.mark.parametrize("size", [16, 1 << 17])
def test_bad_input_on_one_rank_is_an_error_on_the_others(comm, size):
    """One rank passes bad input (here: a read-only output): it raises ValueError, and the
    ranks that made a valid call raise CollectiveMismatchError at once (board protocol for
    small calls, the agreement check for large ones) instead of waiting for it."""
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        x = np.ones(size, np.float32)
        out = np.empty(size, np.float32)
        bad = r == p - 1
        if bad:
            out.flags.writeable = False
        t0 = time.monotonic()
        if bad:
            with pytest.raises(ValueError, match="out is read-only"):
                c.allreduce(x, out, timeout=30)
        else:
            with pytest.raises(gpurt.CollectiveMismatchError,
                               match=rf"rank {p - 1} rejected its own allreduce call"):
                c.allreduce(x, out, timeout=30)
        assert time.monotonic() - t0 < 10


def test_the_same_bad_call_everywhere_keeps_ranks_in_step(comm):
    """Every rank rejects the same call: they all skip it together and the communicator
    goes on working."""
    p = comm.size
    with scratch(comm) as c:
        for _ in range(3):
            with pytest.raises(TypeError):
                c.allreduce(np.ones(4, np.float32), op="band")
        x = np.ones(4, np.float32)
        c.allreduce(x, timeout=30)
        assert (x == p).all()


def test_a_bad_timeout_on_one_rank_is_announced_too(comm):
    p, r = comm.size, comm.rank
    if p == 1:
        pytest.skip("needs 2 ranks")
    with scratch(comm) as c:
        x = np.ones(8, np.float32)
        if r == 0:
            with pytest.raises(ValueError, match="timeout must be"):
                c.allreduce(x, timeout="soon")
        else:
            with pytest.raises(gpurt.CollectiveMismatchError, match="rank 0 rejected"):
                c.allreduce(x, timeout=30)



@pytest.mark.parametrize("count", [2048, 1 << 20])
def test_waits_on_two_communicators_in_opposite_orders_complete(comm, count):
    """MPI's progress rule across communicators: a rank blocked on one communicator still
    advances its requests on the others.  Even ranks wait c2's request first, odd ranks
    c1's; then a blocking call on c2 while c1's request is outstanding on even ranks only;
    then the first again, polling test() instead of waiting.
    (Before: each wait advanced its own communicator alone — a deadlock at 8 KB.)"""
    r, p = comm.rank, comm.size
    c1, c2 = comm.dup(), comm.dup()
    try:
        a = np.full(count, r + 1, np.float32)
        b = np.full(count, 2 * (r + 1), np.float64)
        qa, qb = c1.iallreduce(a), c2.iallreduce(b)
        for q in ((qb, qa) if r % 2 == 0 else (qa, qb)):
            q.wait(timeout=30)
        total = p * (p + 1) // 2
        assert np.all(a == total) and np.all(b == 2 * total)
        x = np.full(count, r, np.int32)
        y = np.full(count, 1, np.int64)
        qx = c1.iallreduce(x)
        if r % 2 == 0:
            c2.allreduce(y, timeout=30)
            qx.wait(timeout=30)
        else:
            qx.wait(timeout=30)
            c2.allreduce(y, timeout=30)
        assert np.all(x == p * (p - 1) // 2) and np.all(y == p)
        # polling test() in opposite orders (bounded: a deadlock fails, it does not hang)
        a[:], b[:] = r + 1, 2 * (r + 1)
        qa, qb = c1.iallreduce(a), c2.iallreduce(b)
        deadline = time.monotonic() + 30
        for q in ((qb, qa) if r % 2 == 0 else (qa, qb)):
            while not q.test():
                assert time.monotonic() < deadline, f"rank {r}: polling test() never completed"
        assert np.all(a == total) and np.all(b == 2 * total)
    finally:
        c1.close()
        c2.close()
        comm.mpi.Barrier()


def test_split_and_explain_refuse_bad_arguments_on_every_rank(comm):
    """split(): a color outside a C int (or negative, or not an integer) was a raw
    OverflowError/MPI error on its rank while the others sat in MPI_Comm_split; now every
    rank raises ValueError naming the rank with the bad argument — also when only one rank
    has it.  explain()/candidates(): a negative or non-integer size is refused."""
    r, p = comm.rank, comm.size
    with pytest.raises(ValueError, match=rf"rank {r}: split: rank 0: color={2**40} is outside"):
        comm.split(2**40)
    with pytest.raises(ValueError, match=rf"rank {r}: split: rank {p - 1}: color=-3"):
        comm.split(-3 if r == p - 1 else 0)
    with pytest.raises(ValueError, match=r"split: rank 0: key=.* does not fit a C int"):
        comm.split(0, key=-2**40)
    with pytest.raises(ValueError, match=r"split: rank 0: color and key must be integers"):
        comm.split(1.5)
    with pytest.raises(ValueError, match=r"split: rank 0: color and key must be integers, "
                                         r"got color=True"):     # (was color 1)
        comm.split(True)
    # an array as color on one rank: its == is an array whose truth raised NumPy's own
    # ValueError on that rank before the exchange, and the others waited in MPI for ever
    with pytest.raises(ValueError, match=rf"rank {r}: split: rank {p - 1}: color and key "
                                         rf"must be integers, got color=array\(\[1, 2\]\)"):
        comm.split(np.array([1, 2]) if r == p - 1 else 0)
    s = comm.split(np.int64(1), key=np.int32(-r))     # NumPy integers are integers
    assert s.size == p and s.rank == p - 1 - r
    s.close()
    assert comm.split(MPI.UNDEFINED) is None          # MPI's way of opting out
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        comm.explain("allreduce", -1)
    with pytest.raises(TypeError, match="nbytes must be an integer, got 1.5"):
        comm.candidates("allreduce", 1.5)
    assert comm.explain("allreduce", 1e6) == comm.explain("allreduce", 1000000)
    assert "chosen" in comm.explain("allreduce", np.int64(4096))


def test_direct_choice_says_what_a_call_does(comm):
    """``direct_choice`` (what `gpurt tune` and ``explain`` report) against what calls on
    NumPy arrays (those `gpurt tune` times with) then run: below the board's limit the board keeps a call whatever
    shm_direct's thresholds say — it said shm_direct there from 64 KiB, so `gpurt tune`
    compared the best with an algorithm never run (review of the tuner)."""
    if comm.board is None or comm._direct is None or comm._shm().cma_why:
        pytest.skip("shm_direct on NumPy arrays needs one node and process_vm_readv")
    p = comm.size
    wrong = []
    for coll in ("allreduce", "allgather", "alltoall", "reduce_scatter", "broadcast"):
        for S in (64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20):
            n = S // 4 // p if coll in ("allgather", "alltoall", "reduce_scatter") else S // 4
            S = n * 4 * (p if coll in ("allgather", "alltoall", "reduce_scatter") else 1)
            if coll == "allgather":
                x, out = np.zeros(n, np.float32), np.zeros(p * n, np.float32)
                comm.allgather(x, out)
            elif coll == "alltoall":
                x, out = np.zeros(p * n, np.float32), np.zeros(p * n, np.float32)
                comm.alltoall(x, out)
            elif coll == "reduce_scatter":
                x, out = np.zeros(p * n, np.float32), np.zeros(n, np.float32)
                comm.reduce_scatter(x, out)
            elif coll == "broadcast":
                comm.broadcast(np.zeros(n, np.float32))
            else:
                x, out = np.zeros(n, np.float32), np.zeros(n, np.float32)
                comm.allreduce(x, out)
            said = comm.direct_choice(coll, S)
            if said != (comm.last_algorithm == "shm_direct"):
                wrong.append((coll, S, said, comm.last_algorithm))
    assert not wrong, wrong


def test_a_repeated_small_allreduce_takes_the_quick_path_with_every_check(comm):
    """The small in-place allreduce a loop repeats skips re-deciding its plan (allreduce's
    quick path: ~2.2 -> ~1.2 µs on 2 ranks): results stay exact whatever alternates (ops,
    dtypes, counts), a read-only or strided array of the same shape is still refused,
    every call is in the flight recorder, and a rank whose call differs still makes every
    rank raise."""
    p, r = comm.size, comm.rank
    with scratch(comm) as c:
        x = np.empty(3, np.float32)
        for i in range(50):
            x[:] = r + i
            c.allreduce(x)
            assert (x == p * i + p * (p - 1) / 2).all(), (i, x)
            y = np.full(3, r, np.int64)
            c.allreduce(y, op=gpurt.MAX)
            assert (y == p - 1).all()
            z = np.zeros(3, np.int64)                       # out of place
            assert c.allreduce(y, z, op=gpurt.MAX) is z and (z == p - 1).all()
        if c.board is not None:   # (both shapes, alternating: both taken quickly)
            assert [(q[0], q[1], q[2]) for q in c._quick] == [(gpurt.MAX, y.dtype, 3),
                                                               (gpurt.SUM, x.dtype, 3)]
        recs = c.flight.records()
        assert recs[-1]["state"] == "done" and recs[-1]["kind"] == "allreduce"
        assert recs[-1]["seq"] == c._seq == 150
        with pytest.raises(ValueError):              # an out that overlaps x
            w = np.zeros(6, np.int64)
            c.allreduce(w[:3], w[1:4], op=gpurt.MAX)
        with pytest.raises((ValueError, TypeError)):   # an out of another dtype
            c.allreduce(y, np.zeros(3, np.int32), op=gpurt.MAX)
        rout = np.zeros(3, np.int64)
        rout.flags.writeable = False
        with pytest.raises(ValueError, match="read-only|writable"):   # a read-only out
            c.allreduce(y, rout, op=gpurt.MAX)
        with pytest.raises(ValueError, match="contiguous"):            # a strided out
            c.allreduce(y, np.zeros(6, np.int64)[::2], op=gpurt.MAX)
        with pytest.raises(ValueError):                                # an out too small
            c.allreduce(y, np.zeros(2, np.int64), op=gpurt.MAX)
        # an out of an equal dtype that is another object, and of another shape
        for o in (np.zeros(3, np.dtype("<i8").newbyteorder("=")), np.zeros((3, 1), np.int64)):
            assert c.allreduce(y, o, op=gpurt.MAX) is o and (o == p - 1).all()
        ro = np.ones(3, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only|writable"):
            c.allreduce(ro)
        with pytest.raises(ValueError, match="contiguous"):
            c.allreduce(np.ones(6, np.float32)[::2])
        x[:] = 1
        c.allreduce(x)                              # still in step
        assert (x == p).all()
        if p > 1:   # one rank's differing count, after the others took the quick path
            with pytest.raises(gpurt.CollectiveMismatchError):
                c.allreduce(x if r != p - 1 else np.ones(4, np.float32))
    c.close()
    with pytest.raises(gpurt.CommunicatorClosed):
        c.allreduce(x)
