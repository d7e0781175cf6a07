#!/usr/bin/env python3
"""guest_agent.py -- the "sshd" of the two-guest rxe fabric (tests/rdma/harness.py).

Runs inside a guest (Debian's python3, standard library only).  Node 1 of a two-node run
executes ``guest_agent.py --host 192.168.78.2 --token-file TOKEN``; ``guest_rsh.py`` on
node 0 (hydra's ``-launcher-exec``) connects to it to start hydra's proxy -- or any command
-- on node 1, and relays its stdout/stderr, stdin and exit status.

Protocol (TCP, one command per connection).  Every message after the greeting is a frame:
one type byte, a 4-byte big-endian length, the payload (at most ``MAX_FRAME`` bytes).

1. agent -> client: ``MAGIC`` + 32 random bytes (the nonce).
2. client -> agent: HMAC-SHA256(token, b"client" + nonce), 32 bytes.  A wrong MAC closes the
   connection: without the run's token (a file on the shared folder, readable by root only)
   nobody on the network can run anything; the nonce makes a recorded login useless.
3. agent -> client: HMAC-SHA256(token, b"server" + nonce): the client knows it reached the
   agent of its own run.
4. client -> agent, one request frame: ``C`` (JSON ``{"argv": [...]}`` -- run it),
   ``P`` (ping: answered ``X`` 0) or ``Q`` (quit: answered ``X`` 0, then the agent kills
   what it still runs and exits, so the guest powers off).
5. While a command runs: agent -> client ``O`` (stdout bytes), ``E`` (stderr bytes) and
   finally ``X`` (4-byte signed exit status; a command killed by signal N gives 128+N);
   client -> agent ``I`` (stdin bytes), ``D`` (end of stdin), ``K`` (4-byte signal number
   for the command's process group).  If the connection drops (the client was killed), the
   agent kills the command's whole process group (SIGTERM, SIGKILL 2 s later).

The command runs in its own session (process group) with the agent's environment, cwd
``--cwd`` (default /mnt/host), like sshd's ``sh -c`` of the joined words (the client sends
``["sh", "-c", "WORDS JOINED"]``).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time

MAGIC = b"GPURT-RXE-AGENT-1\n"
NONCE = 32
MAX_FRAME = 1 << 20
DEFAULT_PORT = 7777
HEADER = struct.Struct(">cI")


# -- the shared framing (guest_rsh.py imports these) ----------------------------------------

def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes, or ConnectionError at EOF."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, size = HEADER.unpack(recv_exact(sock, HEADER.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"frame of {size} bytes")
    return kind, recv_exact(sock, size) if size else b""


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"",
               lock: threading.Lock | None = None) -> None:
    data = HEADER.pack(kind, len(payload)) + payload
    if lock is None:
        sock.sendall(data)
    else:
        with lock:
            sock.sendall(data)


def mac(token: bytes, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, who + nonce, hashlib.sha256).digest()


def read_token(path: str) -> bytes:
    with open(path, "rb") as f:
        token = f.read().strip()
    if len(token) < 16:
        raise ValueError(f"{path}: token too short")
    return token


def exit_status(returncode: int) -> int:
    """Popen's returncode as a shell would report it (signal N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


# -- the agent ---------------------------------------------------------------------------------

class Agent(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, token: bytes, cwd: str):
        super().__init__(addr, Handler)
        self.token = token
        self.cwd = cwd
        self.quit = threading.Event()
        self.procs: set[subprocess.Popen] = set()
        self.procs_lock = threading.Lock()

    def kill_all(self) -> None:
        with self.procs_lock:
            procs = list(self.procs)
        for p in procs:
            kill_group(p)


def kill_group(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """SIGTERM the command's process group, SIGKILL it after ``grace`` s if the leader lives."""
    if proc.poll() is not None:
        try:                                    # the leader is gone; its group may not be
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except OSError:
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def log(msg: str) -> None:
    print(f"guest_agent[{socket.gethostname()}]: {msg}", file=sys.stderr, flush=True)


class Handler(socketserver.BaseRequestHandler):
    server: Agent

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(15)                     # the handshake; no limit once authenticated
        nonce = secrets.token_bytes(NONCE)
        try:
            sock.sendall(MAGIC + nonce)
            got = recv_exact(sock, 32)
            if not hmac.compare_digest(got, mac(self.server.token, b"client", nonce)):
                log(f"rejected {self.client_address[0]}: bad token")
                return
            sock.sendall(mac(self.server.token, b"server", nonce))
            kind, payload = recv_frame(sock)
        except (OSError, ConnectionError, struct.error) as exc:
            log(f"handshake with {self.client_address[0]} failed: {exc}")
            return
        sock.settimeout(None)
        if kind == b"P":
            send_frame(sock, b"X", struct.pack(">i", 0))
        elif kind == b"Q":
            send_frame(sock, b"X", struct.pack(">i", 0))
            self.server.quit.set()
        elif kind == b"C":
            self.run_command(sock, payload)
        else:
            log(f"unknown request {kind!r}")

    def run_command(self, sock: socket.socket, payload: bytes) -> None:
        try:
            argv = json.loads(payload)["argv"]
            assert isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)
        except Exception:                       # noqa: BLE001 - a malformed request
            send_frame(sock, b"E", b"guest_agent: malformed request\n")
            send_frame(sock, b"X", struct.pack(">i", 255))
            return
        send_lock = threading.Lock()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=self.server.cwd,
                                    start_new_session=True, bufsize=0)
        except OSError as exc:
            send_frame(sock, b"E", f"guest_agent: cannot run {argv[0]}: {exc}\n".encode())
            send_frame(sock, b"X", struct.pack(">i", 127))
            return
        with self.server.procs_lock:
            self.server.procs.add(proc)
        gone = threading.Event()                # the client hung up

        def pump(fd: int, kind: bytes) -> None:
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    return
                if not gone.is_set():
                    try:
                        send_frame(sock, kind, data, send_lock)
                    except OSError:
                        gone.set()

        def client_frames() -> None:
            try:
                while True:
                    kind, data = recv_frame(sock)
                    if kind == b"I" and proc.stdin:
                        try:
                            proc.stdin.write(data)
                        except OSError:
                            pass
                    elif kind == b"D" and proc.stdin:
                        try:
                            proc.stdin.close()
                        except OSError:
                            pass
                    elif kind == b"K" and len(data) == 4:
                        try:
                            os.killpg(proc.pid, struct.unpack(">i", data)[0])
                        except OSError:
                            pass
            except (OSError, ConnectionError, struct.error):
                pass
            gone.set()
            if proc.poll() is None:             # the client died: so does its command
                kill_group(proc)

        pumps = [threading.Thread(target=pump, args=(proc.stdout.fileno(), b"O"), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr.fileno(), b"E"), daemon=True)]
        for t in pumps:
            t.start()
        threading.Thread(target=client_frames, daemon=True).start()
        rc = proc.wait()
        for t in pumps:                         # like sshd: until the command's output closes
            t.join()
        with self.server.procs_lock:
            self.server.procs.discard(proc)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        if not gone.is_set():
            try:
                send_frame(sock, b"X", struct.pack(">i", exit_status(rc)), send_lock)
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--host", default="0.0.0.0", help="address to listen on (node's eth0)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("RXE_AGENT_PORT", DEFAULT_PORT)))
    ap.add_argument("--cwd", default="/mnt/host" if os.path.isdir("/mnt/host") else "/")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="exit after this long even if nobody says quit (0: never)")
    args = ap.parse_args(argv)
    token = read_token(args.token_file)
    agent = Agent((args.host, args.port), token, args.cwd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: agent.quit.set())
    threading.Thread(target=agent.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    deadline = time.monotonic() + args.max_seconds if args.max_seconds > 0 else None
    while not agent.quit.wait(0.5):
        if deadline is not None and time.monotonic() > deadline:
            log(f"no quit after {args.max_seconds:.0f} s: exiting")
            break
    agent.shutdown()
    agent.server_close()
    agent.kill_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
