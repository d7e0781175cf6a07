"""Cross-memory attach: read another local process's memory in one copy.

``process_vm_readv`` copies straight from a peer's address space into ours, so a large
message costs one copy instead of two (into a shared slot, out of it).  It needs the
same user and ptrace permission: Yama's ``ptrace_scope`` ≥ 1 (without a ptracer
relationship), container seccomp profiles or a missing ``CAP_SYS_PTRACE`` forbid it with
EPERM — so it is *probed* between the ranks of every node at set-up, and the rings are
used where it fails.  Where Yama's ``ptrace_scope`` is 1 (Ubuntu's default), every rank
first declares its peers as permitted ptracers (``allow_peers``; GPURT_SHM_PTRACER=0
does not), which is what that scope asks for.
"""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

from gpurt.errors import PeerFailure, TransportError
from gpurt.sharedmem import libc


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


try:
    _libc = libc()
    _readv = _libc.process_vm_readv
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                       ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    _writev = _libc.process_vm_writev
    _writev.restype = ctypes.c_ssize_t
    _writev.argtypes = _readv.argtypes
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _readv = _writev = None
try:
    _prctl = _libc.prctl
    _prctl.restype = ctypes.c_int
    _prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
except (NameError, AttributeError):  # pragma: no cover - not Linux/glibc
    _prctl = None

PR_SET_PTRACER = 0x59616D61                  # <linux/prctl.h>: "Yama"
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_ptracer_any = False     # this process has declared PR_SET_PTRACER_ANY (once: never undone)


_fast_address = None    # gpurt._fastboard.data_address, once shm_board has loaded it


def address(arr: np.ndarray) -> int:
    """The address of ``arr``'s first byte (0.1 µs through the extension for a plain
    ndarray; ``__array_interface__`` builds a dict: ~3 µs)."""
    if _fast_address is not None and type(arr) is np.ndarray:
        return _fast_address(arr)
    return arr.__array_interface__["data"][0]


def read(pid: int, remote: int, dst: np.ndarray, peer: int = -1) -> None:
    """Copy ``dst.nbytes`` bytes at ``remote`` in process ``pid`` into ``dst`` (contiguous)."""
    copy(pid, address(dst), remote, dst.nbytes, False, peer)


def copy(pid: int, local: int, remote: int, n: int, to_peer: bool, peer: int = -1) -> None:
    """Copy ``n`` bytes between ``local`` (an address here) and ``remote`` (one in process
    ``pid``): into the peer's memory (``process_vm_writev``) when ``to_peer``, else out of
    it.  The same permission as ``read`` (the set-up probe covers both directions)."""
    fn = _writev if to_peer else _readv
    if fn is None:
        raise TransportError("process_vm_readv/writev are not available")
    done = 0
    liov, riov = _IOVec(), _IOVec()
    while done < n:
        liov.iov_base, liov.iov_len = local + done, n - done
        riov.iov_base, riov.iov_len = remote + done, n - done
        got = fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if got <= 0:
            raise failure(ctypes.get_errno() if got < 0 else errno.EFAULT, pid, peer,
                          to_peer)
        done += got


def failure(e: int, pid: int, peer: int, to_peer: bool) -> Exception:
    """The error of a failed transfer with rank ``peer`` (process ``pid``), ``e`` its errno:
    ``PeerFailure`` when the process is gone, else ``TransportError``."""
    if e == errno.ESRCH:
        return PeerFailure(f"rank {peer} (pid {pid}) exited during a single-copy transfer",
                           rank=peer)
    return TransportError(f"process_vm_{'writev to' if to_peer else 'readv from'} "
                          f"rank {peer} (pid {pid}) failed: {os.strerror(e)}")


def yama_scope(path: str = YAMA_SCOPE) -> int | None:
    """Yama's ``ptrace_scope`` (0 classic, 1 restricted to descendants and declared
    ptracers, 2 CAP_SYS_PTRACE only, 3 none), or None where Yama is absent."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def ptracer_plan(scope: int | None, allowed: bool) -> str:
    """What ``allow_peers`` does for Yama ``scope`` when GPURT_SHM_PTRACER is ``allowed``:
    'declare' (PR_SET_PTRACER_ANY), or 'none'."""
    return "declare" if scope == 1 and allowed else "none"


def yama_hint(scope: int | None, allowed: bool) -> str:
    """Why Yama may be what forbids process_vm_readv here, and what would lift it ('' where
    Yama does not restrict it, or gpurt has declared what scope 1 needs)."""
    if scope is None or scope == 0:
        return ""
    if scope == 1:
        return (" (Yama ptrace_scope=1: the ranks declared each other as ptracers, so "
                "something else refuses it: a seccomp profile, or a container without "
                "CAP_SYS_PTRACE?)") if allowed else (
            " (Yama ptrace_scope=1 and GPURT_SHM_PTRACER=0: ranks do not declare each "
            "other as ptracers)")
    if scope == 2:
        return " (Yama ptrace_scope=2: only processes with CAP_SYS_PTRACE may read peers)"
    return f" (Yama ptrace_scope={scope}: no process may read another's memory)"


def allow_peers(allowed: bool, scope: int | None = None) -> str:
    """Let this process's local peers read and write its memory with
    process_vm_readv/writev where Yama's ``ptrace_scope`` is 1 (Ubuntu's default), which
    refuses them between sibling processes — MPI ranks are siblings, not each other's
    ancestors — unless the target has declared a ptracer: declare any process of this user
    (``PR_SET_PTRACER_ANY``, as Open MPI does for its CMA; one declared pid would not do,
    since a process may declare only one, and ranks have several peers and several
    communicators).  Called by every rank before the start-up probe; idempotent; never
    undone (Yama cannot tell what it was before).  GPURT_SHM_PTRACER=0 (``allowed``
    False) leaves Yama's rule alone: CMA is then off and the copies go through shared
    memory.  Returns what was done, for the log ('' if nothing)."""
    global _ptracer_any
    if scope is None:
        scope = yama_scope()
    if ptracer_plan(scope, allowed) != "declare":
        return ""
    if _ptracer_any:
        return "PR_SET_PTRACER_ANY (declared earlier)"
    if _prctl is None:   # pragma: no cover - not Linux/glibc
        return "PR_SET_PTRACER_ANY unavailable (no prctl)"
    if _prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        return f"PR_SET_PTRACER_ANY failed: {os.strerror(e)}"
    _ptracer_any = True
    return "PR_SET_PTRACER_ANY"


def probe(pid: int, remote: int, expect: bytes, peer: int = -1) -> str:
    """'' if reading ``len(expect)`` bytes at ``remote`` in ``pid`` (rank ``peer``) gives
    ``expect``, else why not."""
    if _readv is None:
        return "process_vm_readv is not available on this platform"
    buf = np.zeros(len(expect), np.uint8)
    try:
        read(pid, remote, buf, peer)
    except (TransportError, PeerFailure) as e:
        return str(e)
    return "" if buf.tobytes() == expect else "process_vm_readv read the wrong bytes"
