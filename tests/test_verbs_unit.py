"""The ``verbs`` transport's logic that needs no RDMA device: device/port/GID selection,
the registry position, what ``gpurt info`` says without pyverbs, the heartbeat notices it
uses to tell a peer whose queue pair broke.  Everything that needs verbs runs for real in
a Soft-RoCE guest (``tests/test_verbs.py``)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from gpurt import config
from gpurt.errors import TransportError
from gpurt.transports import registered, selected
from gpurt.transports import verbs
from gpurt.transports.heartbeat import Heartbeat


def test_hca_spec_parsing_and_port_choice():
    ports = [("mlx5_0", 1, False), ("mlx5_0", 2, True), ("mlx5_1", 1, True), ("rxe0", 1, True)]
    assert verbs.pick_port("", ports) == ("mlx5_0", 2)           # first ACTIVE
    assert verbs.pick_port("mlx5_1", ports) == ("mlx5_1", 1)
    assert verbs.pick_port("mlx5", ports) == ("mlx5_0", 2)        # a prefix
    assert verbs.pick_port("mlx5_0:1,rxe", ports) == ("rxe0", 1)  # port 1 of mlx5_0 is down
    assert verbs.pick_port("^mlx5", ports) == ("rxe0", 1)
    assert verbs.pick_port("=rxe0", ports) == ("rxe0", 1)
    with pytest.raises(TransportError, match="GPURT_IB_HCA='=rxe'.*rxe0:1 \\(ACTIVE\\)"):
        verbs.pick_port("=rxe", ports)                            # exact: no prefix match
    with pytest.raises(TransportError, match="no active RDMA port"):
        verbs.pick_port("", [("mlx5_0", 1, False)])
    with pytest.raises(ValueError, match="port after ':' must be a number"):
        verbs.parse_hca("mlx5_0:x")
    assert verbs.parse_hca("^=a:1, b") == (True, True, [("a", 1), ("b", None)])


def test_roce_gid_choice():
    v4 = "0000:0000:0000:0000:0000:ffff:c0a8:4d01"
    ll = "fe80:0000:0000:0000:44eb:93ff:fe2b:3c54"
    assert verbs.ipv4_of_gid(v4) == "192.168.77.1"
    assert verbs.ipv4_of_gid(ll) == ""
    # RoCE v2 with an IPv4 address first; v1 entries of the same address are passed over
    ents = [(0, ll, "IB/RoCE v1"), (1, ll, "RoCE v2"), (2, v4, "IB/RoCE v1"), (3, v4, "RoCE v2")]
    assert verbs.pick_gid(ents) == 3
    assert verbs.pick_gid(ents[:3]) == 1          # no IPv4 v2: any v2
    assert verbs.pick_gid(ents[:1]) == 0          # only v1
    assert verbs.pick_gid(ents, want=2) == 2      # GPURT_IB_GID_INDEX
    assert verbs.pick_gid([(1, v4, "")]) == 1     # types unknown (no sysfs): the first
    with pytest.raises(TransportError, match="no GID"):
        verbs.pick_gid([])


def test_settings_are_checked(monkeypatch):
    monkeypatch.setenv("GPURT_IB_EAGER", "100")
    config.reload()
    try:
        with pytest.raises(ValueError, match="GPURT_IB_EAGER=100 must be a multiple of 64"):
            verbs._settings()
        monkeypatch.setenv("GPURT_IB_EAGER", "8K")
        monkeypatch.setenv("GPURT_IB_SLOTS", "1")
        config.reload()
        with pytest.raises(ValueError, match="GPURT_IB_SLOTS=1"):
            verbs._settings()
    finally:
        monkeypatch.undo()
        config.reload()


def test_registry_order_and_info_without_pyverbs(monkeypatch):
    assert [n for n, _ in registered()] == ["shm", "verbs", "tcp"]
    try:
        import pyverbs  # noqa: F401
        pytest.skip("pyverbs is installed here: the no-pyverbs message is not shown")
    except ImportError:
        pass
    ok, why = verbs.VerbsTransport.probe()
    assert not ok and "pyverbs is not installed" in why and "python3-pyverbs" in why
    t = verbs.VerbsTransport()
    assert t.can_connect(None, 0, 1) is False        # so tcp takes the peer
    monkeypatch.setenv("GPURT_TRANSPORTS", "verbs,tcp")
    config.reload()
    try:
        assert [n for n, _ in selected()] == ["verbs", "tcp"]
    finally:
        monkeypatch.undo()
        config.reload()


def test_gpudirect_detection_says_why(monkeypatch):
    mode, why = verbs.gpudirect()
    assert mode in ("peermem", "dmabuf", "staged")
    assert why
    try:
        monkeypatch.setenv("GPURT_IB_GDR", "1")
        config.reload()
        assert verbs.gpudirect()[0] == "forced"
        monkeypatch.setenv("GPURT_IB_GDR", "0")
        config.reload()
        mode, why = verbs.gpudirect()
        assert mode == "staged" and "GPURT_IB_GDR=0" in why
    finally:
        monkeypatch.undo()
        config.reload()


def test_cuda_ipc_is_a_device_transport_gpurt_transports_may_name(monkeypatch):
    from gpurt.transports import device_ipc_enabled
    try:
        assert device_ipc_enabled()
        monkeypatch.setenv("GPURT_TRANSPORTS", "shm,cuda_ipc")
        config.reload()
        assert device_ipc_enabled() and [n for n, _ in selected()] == ["shm"]
        monkeypatch.setenv("GPURT_TRANSPORTS", "shm")
        config.reload()
        assert not device_ipc_enabled()
    finally:
        monkeypatch.undo()
        config.reload()


def test_heartbeat_notice_reaches_the_peer_and_strangers_are_ignored():
    from gpurt.transports import heartbeat as hb_mod
    a, b = Heartbeat("127.0.0.1"), Heartbeat("127.0.0.1")
    secret = b"s" * 32
    try:
        a.start(0, secret, {1: ("127.0.0.1", b.port)}, 0.05)
        b.start(1, secret, {0: ("127.0.0.1", a.port)}, 0.05)
        # a forged notice (wrong secret) is dropped
        forger = Heartbeat("127.0.0.1")
        forger.me, forger._secret, forger.peers = 0, b"x" * 32, {1: ("127.0.0.1", b.port)}
        forger.notify("forged")
        forger.close()
        a.notify("TransportError: rank 0: the verbs queue pair broke")
        deadline = time.monotonic() + 5
        while b.notice(0) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.notice(0) == "TransportError: rank 0: the verbs queue pair broke"
        assert a.notice(1) is None
        b.notify("not for rank 0", only=(7,))           # addressed to another rank only
        time.sleep(0.2)
        assert a.notice(1) is None
        # the forged one: refused by the socket's filter (another address), or where no
        # filter could be attached by the thread
        assert b.dropped >= 1 or (b.filtered and hb_mod._kernel_drops(b.sock) >= 1)
        # garbage on the port changes nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"gpurtHE1" + b"\xff" * 40, ("127.0.0.1", b.port))
        time.sleep(0.1)
        assert b.notice(0).startswith("TransportError")
    finally:
        a.close()
        b.close()


def _until(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_heartbeats_answer_on_a_socket_above_select_limit():
    """A communicator made while over a thousand files are open gets a heartbeat socket
    above select()'s FD_SETSIZE (1024): its thread polls, so pings are still answered
    (with select it stopped at once, and a live peer read as silent)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard open-file limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if soft !=
                                                resource.RLIM_INFINITY else soft, hard))
    held = [os.open(os.devnull, os.O_RDONLY)]
    a = b = None
    try:
        while held[-1] < 1100:
            held.append(os.dup(held[0]))
        a, b = Heartbeat("127.0.0.1"), Heartbeat("127.0.0.1")
        assert a.sock.fileno() > 1024 and b.sock.fileno() > 1024
        secret = b"s" * 32
        a.start(0, secret, {1: ("127.0.0.1", b.port)}, 0.05)
        b.start(1, secret, {0: ("127.0.0.1", a.port)}, 0.05)
        time.sleep(0.1)
        a.ping(1)
        b.ping(0)
        assert _until(lambda: a._answered.get(1) == 1 and b._answered.get(0) == 1)
        assert a._thread.is_alive() and b._thread.is_alive()
        assert a.silent_for(1) < 1.0 and b.silent_for(0) < 1.0   # (answered: not silent)
    finally:
        for h in (a, b):
            if h is not None:
                h.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _waiting(h, peer, seconds, every=0.02):
    """What ``stopped`` says while ``h`` waits ``seconds`` for ``peer``, asked as the
    executor asks (every 0.2 s there; faster here)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        why = h.stopped(peer, "host", "stopped")
        if why:
            return why
        time.sleep(every)
    return None


def test_a_peer_is_asked_only_while_waited_for_and_a_stopped_one_fails_after_the_bound(
        monkeypatch):
    """Nobody waits: no datagram at all, however long.  Waiting for a live peer: pings,
    answered, never a failure.  Waiting for one that cannot answer (its thread is not
    running, as in a stopped process): PeerFailure's text once GPURT_PEER_STOPPED has
    passed since the first unanswered ping, not before."""
    monkeypatch.setenv("GPURT_PEER_STOPPED", "0.6")
    config.reload()
    secret = b"s" * 32
    a, b, frozen = Heartbeat("127.0.0.1"), Heartbeat("127.0.0.1"), Heartbeat("127.0.0.1")
    try:
        a.start(0, secret, {1: ("127.0.0.1", b.port), 2: ("127.0.0.1", frozen.port)}, 0.1)
        b.start(1, secret, {0: ("127.0.0.1", a.port)}, 0.1)
        frozen.me, frozen._secret = 2, secret          # bound, never started: no answers
        time.sleep(0.5)                                 # idle: longer than the bound
        assert a.pings == b.pings == 0 and not b._pinged and not a._pinged
        assert a.stopped(1, "host", "stopped") is None  # quiet for an interval: asks
        assert a.pings == 1
        assert _waiting(a, 1, 1.5) is None              # a live peer: never failed
        # answered all along (a ping goes out each quiet interval, 0.1 s): silent for less
        # than the bound, with room for a loaded machine's scheduling
        assert a._answered.get(1, 0) >= 5 and a.silent_for(1) < 0.6
        assert b.pings == 0                             # b waited for nobody
        t = time.monotonic()
        why = _waiting(a, 2, 5.0)
        took = time.monotonic() - t
        assert why and "rank 2 (host) has not answered heartbeat pings for" in why, why
        assert "GPURT_PEER_STOPPED=0.6 s" in why and 0.55 <= took < 2.0, took
        assert frozen.sock.recv(64, socket.MSG_DONTWAIT)[:8] == b"gpurtHQ1"   # was asked
    finally:
        for h in (a, b, frozen):
            h.close()
        config.reload()


def test_a_short_freeze_and_an_old_question_are_not_failures(monkeypatch):
    """A peer whose thread answers only after a pause shorter than the bound (a short
    SIGSTOP) is not a failure; nor is a question left unanswered by an earlier wait (it
    ended when the data came): the next wait asks again instead of counting from it."""
    monkeypatch.setenv("GPURT_PEER_STOPPED", "0.8")
    config.reload()
    secret = b"s" * 32
    a, b = Heartbeat("127.0.0.1"), Heartbeat("127.0.0.1")
    try:
        a.start(0, secret, {1: ("127.0.0.1", b.port)}, 0.1)
        b.me, b._secret, b.peers = 1, secret, {0: ("127.0.0.1", a.port)}
        b.last = {0: time.monotonic()}
        assert _waiting(a, 1, 0.4) is None              # b "stopped": pings queue up
        b.start(1, secret, {0: ("127.0.0.1", a.port)}, 0.1)   # continued: answers them
        assert _waiting(a, 1, 1.0) is None and a.silent_for(1) < 0.8   # (below the bound)
        # an earlier wait's question, never answered (the data came), long ago: the gap
        # since counts for three intervals, not for 100 s of silence
        b.close()
        a.stopped(1, "host", "stopped")
        a.last[1] -= 200
        a.asked[1] = a.sent[1] = a.called[1] = time.monotonic() - 100
        a.waited[1] = 0.2
        assert a.stopped(1, "host", "stopped") is None
        assert 0.5 <= a.waited[1] < 0.6
    finally:
        a.close()
        b.close()
        config.reload()


def test_heartbeat_replays_and_strangers_prove_nothing():
    """An authentic ping replayed, an answer to a ping never sent, and a datagram under
    another secret do not make a silent peer look alive; close() is immediate."""
    import struct

    from gpurt.transports import heartbeat as hb

    secret = b"s" * 32
    a = Heartbeat("127.0.0.1")
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)    # rank 1's socket (its
        s.bind(("127.0.0.1", 0))        # datagrams alone are read: the others are refused)
        a.start(0, secret, {1: s.getsockname()}, 0.1)
        a.last[1] -= 100
        before = a.last[1]

        def dgram(magic, frm, seq, key=secret):
            return struct.pack("<8sII", magic, frm, seq) + hb._mac(key, magic, frm, 0, seq)

        with s:
            s.sendto(dgram(b"gpurtHQ1", 1, 7), ("127.0.0.1", a.port))     # a real ping
            assert _until(lambda: a._pinged.get(1) == 7)
            heard = a.last[1]
            assert heard > before
            s.sendto(dgram(b"gpurtHQ1", 1, 7), ("127.0.0.1", a.port))     # replayed
            s.sendto(dgram(b"gpurtHB1", 1, 3), ("127.0.0.1", a.port))     # unasked answer
            assert _until(lambda: a.stale == 2)
            s.sendto(dgram(b"gpurtHQ1", 1, 8, b"x" * 32), ("127.0.0.1", a.port))  # stranger
            s.sendto(b"gpurtHQ1" + b"\0" * 4, ("127.0.0.1", a.port))     # garbage
            assert _until(lambda: a.dropped == 2)
            assert a.last[1] == heard
        t = time.monotonic()
        a.close()
        assert time.monotonic() - t < 0.8      # not the thread's 1 s poll timeout
    finally:
        a.close()


def test_a_heartbeat_dropped_without_close_stops_its_thread_and_closes_its_socket():
    """A communicator that is forgotten rather than closed must not leave its heartbeat
    thread and socket behind for the life of the process (a subcommunicator made per
    step: one thread and one descriptor each, before)."""
    import gc
    import threading

    h = Heartbeat("127.0.0.1")
    h.start(0, b"s" * 32, {1: ("127.0.0.1", 9)}, 0.1)
    t, fd = h._thread, h.sock.fileno()
    assert t.is_alive()
    del h
    gc.collect()
    t.join(2.0)
    assert not t.is_alive()
    assert not any(th is t for th in threading.enumerate())
    assert _until(lambda: not os.path.exists(f"/proc/self/fd/{fd}") or
                  "socket" not in os.readlink(f"/proc/self/fd/{fd}"), 2.0)


def test_a_stopped_peer_is_found_by_waits_retried_after_timeouts(monkeypatch):
    """Request.wait(timeout=...) in a loop with other work between the waits, each wait
    shorter than the bound: the waiting with the ping unanswered adds up (each gap counts
    for at most three intervals) and the silent peer fails — it did not while every wait
    started its question afresh."""
    monkeypatch.setenv("GPURT_PEER_STOPPED", "1.0")
    config.reload()
    a, silent = Heartbeat("127.0.0.1"), Heartbeat("127.0.0.1")
    try:
        a.start(0, b"s" * 32, {1: ("127.0.0.1", silent.port)}, 0.1)
        a.last[1] -= 1
        why, t = None, time.monotonic()
        for _ in range(10):
            why = _waiting(a, 1, 0.25)          # a wait that times out
            if why:
                break
            time.sleep(0.6)                     # other work: counts for 0.3 s
        assert why and "of waiting (more than GPURT_PEER_STOPPED=1 s)" in why, why
        assert time.monotonic() - t < 4.0
    finally:
        a.close()
        silent.close()
        config.reload()


def test_published_reads_the_peers_error_message_or_notice_without_asking():
    """``VerbsEndpoint.published`` (what ``Communicator._check_peers`` reads of every peer
    at a collective's deadline): nothing while the peer published nothing; its UDP notice;
    its ERROR message (kept even after the endpoint failed), a relayed failure blaming the
    rank it names, a mismatch as a mismatch.  The guest test runs the whole case
    (test_verbs.py::test_a_failure_elsewhere_is_named_at_the_deadline_over_verbs)."""
    from gpurt.errors import CollectiveMismatchError, PeerFailure

    class Beat:
        notices: dict = {}

        def notice(self, peer):
            return self.notices.get(peer)

    class Owner:
        heartbeat = Beat()

    ep = verbs.VerbsEndpoint(Owner(), 3, 0, None)
    ep.host = "node7"
    assert ep.published() is None
    Owner.heartbeat.notices[3] = "RuntimeError: out of coffee"
    e = ep.published()
    assert isinstance(e, PeerFailure) and e.rank == 3, e
    assert str(e) == "rank 3 (node7) failed: RuntimeError: out of coffee"
    Owner.heartbeat.notices.clear()
    ep.peer_error("PeerFailure[rank=1]: rank 3: rank 1 was killed")
    ep.peer_error("TransportError: a later, different text")    # the first one counts
    e = ep.published()
    assert isinstance(e, PeerFailure) and e.rank == 1 and "rank 1 was killed" in str(e), e
    ep2 = verbs.VerbsEndpoint(Owner(), 4, 1, None)
    ep2.peer_error("CollectiveMismatchError: rank 4: count 8 here, 9 at rank 0")
    assert isinstance(ep2.published(), CollectiveMismatchError)


def test_a_failing_rank_waits_for_its_data_writes_to_complete(caplog):
    """``publish_error``'s last step (``_reap_data``): after the queue pairs go to the
    error state, the RDMA WRITEs that read user buffers are polled until their (flushed)
    completions arrive, bounded, and what is left after the bound is logged by peer.  A
    stand-in for the completion queue (no RDMA device here: the whole case runs in the
    Soft-RoCE guest, ``tests/rdma/verbs_cases.py::in_flight_abort``)."""
    import logging

    class Ep:
        def __init__(self, peer):
            self.peer = peer

    t = object.__new__(verbs.VerbsTransport)
    t.rank = 0
    a, b = Ep(1), Ep(2)
    t.wr = {(1 << 8) | verbs._W_DATA: a, (2 << 8) | verbs._W_SLOT: (b, 0, None),
            (3 << 8) | verbs._W_DATA: b, (4 << 8) | verbs._W_DATA: b}
    assert t.data_in_flight() == {1: 1, 2: 2}
    polls = []

    def poll():                 # one flushed completion per pass
        polls.append(1)
        data = [w for w in t.wr if w & 0xFF == verbs._W_DATA]
        if data:
            del t.wr[data[0]]
        return bool(data)

    t.poll = poll
    t._reap_data(5.0)
    assert t.data_in_flight() == {} and len(polls) == 3
    assert (2 << 8) | verbs._W_SLOT in t.wr          # a staging slot is not user memory
    t.wr[(5 << 8) | verbs._W_DATA] = b
    t.poll = lambda: False                           # a completion that never comes
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gpurt.verbs"):
        t._reap_data(0.2)
    assert 0.2 <= time.monotonic() - start < 2
    assert "1 RDMA WRITE(s) of message data still in flight" in caplog.text
    assert "to rank(s) 2" in caplog.text
