"""Cross-memory attach: read another local process's memory in one copy.

``process_vm_readv`` copies straight from a peer's address space into ours, so a large
message costs one copy instead of two (into a shared slot, out of it).  It needs the
same user and ptrace permission: Yama's ``ptrace_scope`` ≥ 1 (without a ptracer
relationship), container seccomp profiles or a missing ``CAP_SYS_PTRACE`` forbid it with
EPERM — so it is *probed* between the ranks of every node at set-up, and the rings are
used where it fails.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

import numpy as np

from gpurt.errors import PeerFailure, TransportError


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _readv = _libc.process_vm_readv
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                       ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    _writev = _libc.process_vm_writev
    _writev.restype = ctypes.c_ssize_t
    _writev.argtypes = _readv.argtypes
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _readv = _writev = None


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


def probe(pid: int, remote: int, expect: bytes) -> str:
    """'' if reading ``len(expect)`` bytes at ``remote`` in ``pid`` gives ``expect``,
    else why not."""
    if _readv is None:
        return "process_vm_readv is not available on this platform"
    buf = np.zeros(len(expect), np.uint8)
    try:
        read(pid, remote, buf)
    except (TransportError, PeerFailure) as e:
        return str(e)
    return "" if buf.tobytes() == expect else "process_vm_readv read the wrong bytes"
