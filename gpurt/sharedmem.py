"""Host arrays that the other ranks of the node read and write directly.

``comm.empty(shape, dtype)`` / ``comm.zeros(...)`` (or ``gpurt.empty`` / ``gpurt.zeros``)
return ordinary, writable, C-contiguous NumPy arrays whose memory is an anonymous shared
file (``memfd_create``).  When such an array is the source of a large intra-node message
(``shm`` transport, single copy), the receiver maps the sender's file once — through
``/proc/<pid>/fd/<n>``, which the kernel allows to the same user with ptrace *read*
permission (so also where Yama forbids ``process_vm_readv``) — and copies with
``memcpy`` from it, or reduces straight out of it, instead of ``process_vm_readv``
(about a third of ``memcpy``'s speed).  When such an array is the destination of a
large receive, a waiting sender copies its chunks of the message straight into it.

Nothing here has a name in a file system: the file lives as long as some process holds
it (an array, or a peer's mapping), so no exit — SIGKILL included — can leave anything
behind in ``/dev/shm``; and memfd memory is not bounded by the size of ``/dev/shm``
(containers' 64 MiB default).

One file (and one file descriptor) per array: meant for the few large buffers a code
allocates once and reuses — gradients, activations, halos.  Each file carries one page
more than the array: a trailer with a magic word, the allocating process's serial
number for it and a *live* word that the owner clears when the array is freed, so the
peers drop their mappings of freed arrays (``PeerMaps``) instead of keeping the memory.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import itertools
import mmap
import operator
import os
import struct
import threading
import weakref

import numpy as np

from .errors import ResourceError, TransportError

_PAGE = mmap.PAGESIZE
_MAGIC = 0x67707572745F6D66  # "gpurt_mf"
_TRAILER = struct.Struct("<QQQQ")   # magic, serial, data bytes, live
_LIVE_OFF = 24                      # byte offset of the live word in the trailer
FD_BITS = 24                        # a location word: serial << FD_BITS | fd

_lock = threading.Lock()
_serials = itertools.count(1)
#: the live arenas: (sorted start addresses, (start, end, serial, fd) in the same order),
#: replaced whole under _lock, so that ``lookup`` reads one consistent pair without it
_index: tuple[tuple[int, ...], tuple[tuple[int, int, int, int], ...]] = ((), ())


def libc() -> ctypes.CDLL:
    """The C library, with errno: by its usual name first (``ctypes.util.find_library``
    imports subprocess and runs ``ldconfig -p``: ~15 ms of every rank's start)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:     # (not glibc)
        from ctypes.util import find_library
        return ctypes.CDLL(find_library("c") or None, use_errno=True)


_libc = libc()
_mmap, _munmap, _madvise = _libc.mmap, _libc.munmap, _libc.madvise
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_PUNCH = 0x02 | 0x01        # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class _Mapping:
    """A shared mapping of a whole file, unmapped when the last array on it is freed.
    (Not ``mmap.mmap``: that keeps a duplicate of the file descriptor per mapping, and
    with many local peers the descriptors would run out.)"""

    __slots__ = ("addr", "size", "__array_interface__", "__weakref__")

    def __init__(self, fd: int, size: int):
        addr = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self.addr, self.size = addr, size
        self.__array_interface__ = {"data": (addr, False), "shape": (size,),
                                    "typestr": "|u1", "version": 3}
        weakref.finalize(self, _munmap, addr, size)

    def u8(self) -> np.ndarray:
        """The whole mapping as bytes (the array keeps the mapping alive)."""
        return np.asarray(self)


def _data_bytes(nbytes: int) -> int:
    return max(_PAGE, -(-nbytes // _PAGE) * _PAGE)


# forks made by this process so far: an array that lived across one may still be used by a
# child (a data-loader worker shares the mapping), so its memory is not punched out
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_parent=_count_fork)


def _replace_index(change) -> None:
    """Replace the index by ``change(starts, arenas)``: the new tuples are built outside
    the lock (building them allocates objects the garbage collector tracks, and a
    collection that frees a shared array runs its finalizer, ``_free``, which comes here
    too: under the lock, which is not reentrant, that thread waited for itself for
    ever), then swapped in under it if nobody replaced the index meanwhile, else built
    again."""
    global _index
    while True:
        snap = _index
        new = change(*snap)
        with _lock:
            if _index is snap:
                _index = new
                return


def _with(starts: tuple, arenas: tuple, arena: tuple) -> tuple:
    i = bisect.bisect_left(starts, arena[0])
    return starts[:i] + (arena[0],) + starts[i:], arenas[:i] + (arena,) + arenas[i:]


def _without(starts: tuple, arenas: tuple, start: int, serial: int) -> tuple:
    i = bisect.bisect_left(starts, start)
    if i < len(starts) and starts[i] == start and arenas[i][2] == serial:
        return starts[:i] + starts[i + 1:], arenas[:i] + arenas[i + 1:]
    return starts, arenas


def _free(start: int, serial: int, fd: int, size: int, owner: int, forks: int = 0) -> None:
    """Finalizer of one arena's mapping: tell the peers (live word), forget, close.  In a
    forked child (a data-loader worker, say) only its inherited descriptor is closed: the
    array is still the parent's."""
    if os.getpid() != owner:
        try:
            os.close(fd)
        except OSError:
            pass
        return
    _replace_index(lambda starts, arenas: _without(starts, arenas, start, serial))
    try:
        os.pwrite(fd, b"\0" * 8, size + _LIVE_OFF)
    except OSError:
        pass
    if _fallocate is not None and forks == _forks:
        # the data's memory back at once: peers keep their mapping of a freed array until
        # they next look (a mapping-cache miss, an shm_direct call), and small calls on
        # the board or the rings never look (a bug hunt: 6 freed 64 MiB arrays held 128
        # MiB over 20000 calls).  Nobody reads a freed array; the trailer (its live
        # word) stays.  (An error — a kernel without holes in shmem — changes nothing.
        # Not after a fork: a child may still use the array through its mapping.)
        _fallocate(fd, _PUNCH, 0, size)
    try:
        os.close(fd)
    except OSError:
        pass


def empty(shape, dtype=np.float32) -> np.ndarray:
    """A new uninitialised C-contiguous array in node-shared memory (see the module
    docstring).  Its memory is freed when the array and every view of it are."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"gpurt.empty: {e}") from None
    if dt.hasobject:
        raise TypeError(f"gpurt.empty: dtype {dt} holds Python objects; shared memory "
                        f"takes plain data only")
    dims = (shape,) if np.ndim(shape) == 0 else tuple(shape)
    try:
        if any(isinstance(s, (bool, np.bool_)) for s in dims):
            raise TypeError
        shp = tuple(operator.index(s) for s in dims)    # (as numpy.empty: no floats)
    except TypeError:
        raise TypeError(f"gpurt.empty: shape {shape!r} must be integers (as numpy.empty "
                        f"takes)") from None
    if any(s < 0 for s in shp):
        raise ValueError(f"gpurt.empty: negative dimension in shape {shp}")
    if dt.subdtype is not None:     # (float32, (2,)): its dimensions join the shape, as
        shp, dt = shp + dt.shape, dt.base    # numpy.empty makes them
    count = 1
    for s in shp:       # (Python integers: np.prod wraps around past int64)
        count *= s
    if count * dt.itemsize >= 1 << 62:
        raise ValueError(f"gpurt.empty: shape {shp} of {dt} is {count * dt.itemsize} "
                         f"bytes, more than any machine holds")
    size = _data_bytes(count * dt.itemsize)
    room = _memory_bytes()
    if room and size > room:
        # (a shared file reserves nothing: the array would come back and the job be
        # killed when its pages are touched; numpy.empty refuses such a size too)
        raise ResourceError(f"gpurt.empty: {size / 2**30:.1f} GiB of shared memory is more "
                            f"than this machine has ({room / 2**30:.1f} GiB of memory and "
                            f"swap)")
    try:
        fd = os.memfd_create("gpurt-array", os.MFD_CLOEXEC)
    except AttributeError:
        raise ResourceError("gpurt.empty needs memfd_create (Linux)") from None
    except OSError as e:
        raise ResourceError(f"gpurt.empty: memfd_create failed: {e.strerror}"
                            + (" (one file descriptor per shared array: raise ulimit -n)"
                               if e.errno in (errno.EMFILE, errno.ENFILE) else "")) from None
    serial = next(_serials)
    try:
        os.ftruncate(fd, size + _PAGE)
        os.pwrite(fd, _TRAILER.pack(_MAGIC, serial, size, 1), size)
        mm = _Mapping(fd, size + _PAGE)
    except OSError as e:
        os.close(fd)
        hint = ""
        if e.errno == errno.ENOMEM:
            try:
                with open("/proc/sys/vm/max_map_count") as f:
                    limit = int(f.read())
                with open("/proc/self/maps") as f:
                    used = sum(1 for _ in f)
                if used >= limit - 16:
                    hint = (f" (this process has {used} memory maps of vm.max_map_count="
                            f"{limit}: free arrays or raise the limit)")
            except (OSError, ValueError):
                pass
        amount = f"{size / 2**20:.1f} MiB" if size >= 1 << 20 else f"{size} bytes"
        raise ResourceError(f"gpurt.empty: cannot allocate {amount} of shared memory: "
                            f"{e.strerror}{hint}") from None
    if fd >> FD_BITS:
        os.close(fd)
        raise ResourceError(f"gpurt.empty: file descriptor {fd} is too large")
    if size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        # huge pages where shmem allows them (transparent_hugepage/shmem_enabled); no error
        _madvise(mm.addr, size, mmap.MADV_HUGEPAGE)
    arr = mm.u8()[:count * dt.itemsize].view(dt)
    start = mm.addr
    _replace_index(lambda starts, arenas: _with(starts, arenas,
                                                (start, start + size, serial, fd)))
    weakref.finalize(mm, _free, start, serial, fd, size, os.getpid(), _forks)
    return arr.reshape(shp)


def _memory_bytes() -> int:
    """MemTotal + SwapTotal of this machine (0: unknown)."""
    global _MEMORY
    if _MEMORY is None:
        total = 0
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("MemTotal", "SwapTotal"):
                        total += int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            total = 0
        _MEMORY = total
    return _MEMORY


_MEMORY: int | None = None


def zeros(shape, dtype=np.float32) -> np.ndarray:
    """Like ``empty``; a new shared file reads as zeros (its pages are not touched)."""
    return empty(shape, dtype)


def lookup(addr: int, nbytes: int) -> tuple[int, int] | None:
    """(location word, offset) of ``[addr, addr + nbytes)`` if it lies inside one live
    shared array of this process, else None.  Reads one snapshot of the index without
    the lock (which a collection freeing an array here would take): another thread's
    allocation or free meanwhile replaces the index, never changes the one read (it was
    two lists, and a free between two reads of them shifted one: a bug hunt found the
    next array up returned, at a negative offset, or None for a live array)."""
    starts, arenas = _index
    if not starts:
        return None
    i = bisect.bisect_right(starts, addr) - 1
    if i < 0:
        return None
    start, end, serial, fd = arenas[i]
    if addr + nbytes > end:
        return None
    return (serial << FD_BITS) | fd, addr - start


def is_shared(a) -> bool:
    """Is ``a`` (an array) inside memory from ``gpurt.empty``/``zeros`` of this process?"""
    try:
        ai = a.__array_interface__
    except AttributeError:
        return False
    return lookup(ai["data"][0], max(1, a.nbytes)) is not None


class PeerMaps:
    """One local peer's shared arrays, mapped here on first use and dropped once the peer
    frees them (its live word) or beyond ``limit`` mappings (least recently used)."""

    def __init__(self, pid: int, rank: int, me: int, limit: int = 64):
        self.pid, self.rank, self.me, self.limit = pid, rank, me, limit
        self.maps: dict[int, tuple[_Mapping, np.ndarray, int]] = {}   # serial -> ...

    def view(self, loc: int, offset: int, nbytes: int) -> np.ndarray:
        """uint8 view of ``nbytes`` at ``offset`` in the peer's array ``loc``."""
        serial, fd = loc >> FD_BITS, loc & ((1 << FD_BITS) - 1)
        hit = self.maps.pop(serial, None)
        if hit is None:
            self.sweep()
            hit = self._map(serial, fd, self.me)
        self.maps[serial] = hit          # most recently used last
        u8, size = hit[1], hit[2]
        if offset + nbytes > size:
            raise TransportError(f"rank {self.me}: rank {self.rank} announced bytes "
                                 f"[{offset}, {offset + nbytes}) of its shared array "
                                 f"{serial}, which has {size}")
        return u8[offset:offset + nbytes]

    def _map(self, serial: int, fd: int, me: int):
        path = f"/proc/{self.pid}/fd/{fd}"
        try:
            f = os.open(path, os.O_RDWR)
        except OSError as e:
            raise TransportError(f"rank {me}: cannot open rank {self.rank}'s shared array "
                                 f"({path}): {e.strerror}") from None
        try:
            total = os.fstat(f).st_size
            if total < 2 * _PAGE:
                raise TransportError(f"rank {me}: {path} of rank {self.rank} is not a "
                                     f"gpurt shared array ({total} bytes)")
            mm = _Mapping(f, total)
        except OSError as e:
            raise TransportError(f"rank {me}: cannot map rank {self.rank}'s shared array "
                                 f"({path}): {e.strerror}") from None
        finally:
            os.close(f)
        u8 = mm.u8()
        magic, ser, size, live = _TRAILER.unpack_from(u8, total - _PAGE)
        if magic != _MAGIC or ser != serial or size != total - _PAGE or not live:
            raise TransportError(f"rank {me}: {path} is not rank {self.rank}'s live shared "
                                 f"array {serial} (found serial {ser}, live {live})")
        while len(self.maps) >= self.limit:
            self._drop(next(iter(self.maps)))
        return mm, u8, size

    def _drop(self, serial: int) -> None:
        # unmapped once no view of it is left (a message in flight may still hold one)
        del self.maps[serial]

    def sweep(self) -> None:
        """Drop the mappings of arrays the peer has freed."""
        for serial in [s for s, (mm, u8, size) in self.maps.items()
                       if not struct.unpack_from("<Q", u8, size + _LIVE_OFF)[0]]:
            self._drop(serial)

    def close(self) -> None:
        for serial in list(self.maps):
            self._drop(serial)
