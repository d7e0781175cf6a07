#!/usr/bin/env python3
"""guest_rsh.py -- the "ssh" of the two-guest rxe fabric: MPICH hydra's ``-launcher-exec``.

Hydra's ssh launcher runs it exactly like ssh (see launch/vcluster_exec.sh)::

    guest_rsh.py [-x] HOST COMMAND...

Like sshd, the COMMAND words are joined with spaces and handed to ``sh -c``, so hydra's
quoting is interpreted as on a real remote host.  HOST is an address or a host name: if it
is this guest, the command runs here (exec, so the exit status and signals pass through
untouched); otherwise it goes to ``guest_agent.py`` on HOST, which is authenticated with the
run's token (``$RXE_AGENT_TOKEN_FILE``, port ``$RXE_AGENT_PORT``, default 7777), and this
process relays its stdout/stderr and our stdin, and exits with its exit status -- 255 if
the connection fails, as ssh does.  SIGTERM/SIGINT/SIGHUP are forwarded to the remote
command's process group; if this process is killed outright, the dropped connection makes
the agent kill the remote command.  Hydra's proxy connects back to mpiexec over TCP by
itself: the rsh only starts it and relays.

Extra modes (the harness uses them; not ssh options):
    guest_rsh.py --wait HOST SECONDS   wait until HOST's agent answers (exit 0) or give up (255)
    guest_rsh.py --quit HOST           tell HOST's agent to exit (its guest then powers off)
(``GUEST_RSH_FORCE_REMOTE=1`` sends even a local HOST to its agent: for testing.)
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from guest_agent import (DEFAULT_PORT, MAGIC, NONCE, mac, read_token,  # noqa: E402
                         recv_exact, recv_frame, send_frame)

CONNECT_RETRY_S = float(os.environ.get("RXE_AGENT_CONNECT_TIMEOUT", "20"))
RETRYABLE = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT,
             errno.ECONNRESET, errno.EAGAIN}


def fail(msg: str, code: int = 255) -> NoReturn:
    print(f"guest_rsh: {msg}", file=sys.stderr, flush=True)
    os._exit(code)


def is_local(host: str) -> bool:
    """True if HOST names this guest: localhost, our host name, or an address we own."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    for a in addrs:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((a, 0))                      # only an address of ours can be bound
            return True
        except OSError:
            pass
        finally:
            s.close()
    return False


class Unreachable(Exception):
    """The agent could not be reached or did not complete the handshake."""


def connect(host: str, request: bytes, retry_s: float = CONNECT_RETRY_S) -> socket.socket:
    """An authenticated connection to HOST's agent with ``request`` (a frame) sent; exits
    255 (as ssh does) if there is none within ``retry_s``."""
    try:
        return try_connect(host, request, retry_s)
    except Unreachable as exc:
        fail(str(exc))


def try_connect(host: str, request: bytes, retry_s: float) -> socket.socket:
    """connect(), raising Unreachable instead of exiting."""
    path = os.environ.get("RXE_AGENT_TOKEN_FILE")
    if not path:
        fail("RXE_AGENT_TOKEN_FILE is not set (not inside a harness run?)")
    try:
        token = read_token(path)
    except (OSError, ValueError) as exc:
        fail(f"cannot read the token: {exc}")
    port = int(os.environ.get("RXE_AGENT_PORT", DEFAULT_PORT))
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError as exc:
            if exc.errno not in RETRYABLE and not isinstance(exc, socket.timeout) \
                    or time.monotonic() > deadline:
                raise Unreachable(f"cannot connect to the agent on {host}:{port}: {exc}") from None
            time.sleep(0.2)
    try:
        sock.settimeout(15)
        greeting = recv_exact(sock, len(MAGIC) + NONCE)
        if not greeting.startswith(MAGIC):
            fail(f"{host}:{port} is not a guest agent")
        nonce = greeting[len(MAGIC):]
        sock.sendall(mac(token, b"client", nonce))
        if recv_exact(sock, 32) != mac(token, b"server", nonce):
            fail(f"the agent on {host}:{port} does not know this run's token")
        sock.sendall(request)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, ConnectionError) as exc:
        sock.close()
        raise Unreachable(f"handshake with {host}:{port} failed: {exc}") from None
    return sock


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">cI", kind, len(payload)) + payload


def simple(host: str, kind: bytes, retry_s: float = CONNECT_RETRY_S) -> int:
    """One request without a command (P: ping, Q: quit) and its status.  Every step is
    bounded: a connection, handshake or reply that fails or stalls (a guest link that stops
    passing packets leaves a TCP connection hanging for many minutes) is retried until
    ``retry_s`` has passed, then this exits 255."""
    deadline = time.monotonic() + retry_s
    while True:
        left = max(0.0, deadline - time.monotonic())
        try:
            sock = try_connect(host, frame(kind), left)
            try:
                sock.settimeout(max(1.0, min(15.0, deadline - time.monotonic())))
                k, data = recv_frame(sock)
            finally:
                sock.close()
            return struct.unpack(">i", data)[0] if k == b"X" else 255
        except (Unreachable, OSError, ConnectionError, struct.error) as exc:
            if time.monotonic() >= deadline:
                fail(f"{host}: {exc}")
            time.sleep(0.5)


def remote(host: str, command: str, forward_stdin: bool) -> int:
    sock = connect(host, frame(b"C", json.dumps({"argv": ["sh", "-c", command]}).encode()))
    lock = threading.Lock()

    def on_signal(signum, _frame):
        try:
            send_frame(sock, b"K", struct.pack(">i", signum), lock)
        except OSError:
            os._exit(128 + signum)
        signal.alarm(5)                         # the remote gets 5 s to exit, then we go

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGALRM, lambda *_: os._exit(255))

    def stdin_pump():
        try:
            while forward_stdin:
                data = os.read(0, 65536)
                if not data:
                    break
                send_frame(sock, b"I", data, lock)
            send_frame(sock, b"D", b"", lock)
        except OSError:
            try:
                send_frame(sock, b"D", b"", lock)
            except OSError:
                pass

    threading.Thread(target=stdin_pump, daemon=True).start()
    out, err = sys.stdout.buffer, sys.stderr.buffer
    while True:
        try:
            kind, data = recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            fail(f"lost the connection to {host}: {exc}")
        if kind == b"X":
            return struct.unpack(">i", data)[0]
        stream = out if kind == b"O" else err
        try:
            stream.write(data)
            stream.flush()
        except (OSError, ValueError):
            pass


def main(argv: list[str]) -> int:
    if argv[:1] == ["--wait"] and len(argv) == 3:
        return simple(argv[1], b"P", float(argv[2]))
    if argv[:1] == ["--quit"] and len(argv) == 2:
        return simple(argv[1], b"Q", 2)
    forward_stdin = True
    while argv:                                 # the ssh options a launcher may pass
        a = argv[0]
        if a == "-n":
            forward_stdin = False
            argv = argv[1:]
        elif a in ("-x", "-X", "-Y", "-q", "-T", "-t", "-tt", "-a", "-A", "-C", "-4", "-6"):
            argv = argv[1:]
        elif a in ("-o", "-p", "-l", "-i", "-F", "-E", "-J"):
            argv = argv[2:]
        elif a == "--":
            argv = argv[1:]
            break
        elif a.startswith("-"):
            fail(f"unsupported ssh option {a}")
        else:
            break
    if not argv:
        fail("usage: guest_rsh.py [-x] HOST COMMAND...")
    host, words = argv[0], argv[1:]
    if not words:
        fail(f"no command for {host} (interactive logins are not supported)")
    command = " ".join(words)
    if is_local(host) and not os.environ.get("GUEST_RSH_FORCE_REMOTE"):
        sys.stdout.flush()
        os.execvp("sh", ["sh", "-c", command])
    return remote(host, command, forward_stdin)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
