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
        assert b.dropped >= 1                    # the forged one
        # garbage on the port changes nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"gpurtHE1" + b"\xff" * 40, ("127.0.0.1", b.port))
        time.sleep(0.1)
        assert b.notice(0).startswith("TransportError")
    finally:
        a.close()
        b.close()


def test_heartbeats_flow_on_a_socket_above_select_limit():
    """A communicator made while over a thousand files are open gets a heartbeat socket
    above select()'s FD_SETSIZE (1024): its thread polls, so heartbeats still arrive (with
    select it stopped at once, and a live peer read as silent)."""
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
        time.sleep(0.6)
        assert a._thread.is_alive() and b._thread.is_alive()
        assert a.silent_for(1) < 0.4 and b.silent_for(0) < 0.4
    finally:
        for h in (a, b):
            if h is not None:
                h.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
