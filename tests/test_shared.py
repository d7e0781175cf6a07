"""Node-shared arrays (``comm.empty`` / ``gpurt.empty``, gpurt/sharedmem.py) and the
streaming copy (gpurt/memcopy.py): the allocator, the peers' mapping tables and their
errors in one process; every collective on shared arrays in real processes
(tests/shared_cases.py)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gpurt
from conftest import ROOT, is_hydra, mpiexec, rank_records, run_mpi
from gpurt import memcopy, sharedmem
from gpurt.errors import TransportError


# -- in one process --------------------------------------------------------------------

def test_empty_zeros_shapes_and_dtypes():
    for shape, dt in [(0, np.float32), (1, np.int8), (1000, np.float64), ((3, 5), np.int32),
                      ((2, 3, 4), np.complex128), ((4097,), np.uint16)]:
        a = gpurt.empty(shape, dt)
        want = (shape,) if isinstance(shape, int) else shape
        assert a.shape == want and a.dtype == np.dtype(dt)
        assert a.flags.c_contiguous and a.flags.writeable and a.flags.aligned
        z = gpurt.zeros(shape, dt)
        assert not z.any()
        if a.size:
            a[...] = 7
            assert (a == 7).all()
            assert gpurt.is_shared(a) and gpurt.is_shared(a.reshape(-1)[1:])
    assert not gpurt.is_shared(np.zeros(10))
    assert not gpurt.is_shared([1, 2])
    # a subarray dtype's dimensions join the shape, as numpy.empty makes them (it was
    # NumPy's own "Changing the dtype to a subarray type" ValueError)
    for shape, dt in [(3, (np.float32, (2,))), ((2, 2), (np.int16, (3, 2)))]:
        a, z = gpurt.empty(shape, dt), gpurt.zeros(shape, dt)
        want = np.empty(shape, dt)
        assert a.shape == z.shape == want.shape and a.dtype == z.dtype == want.dtype
        assert not z.any() and gpurt.is_shared(a)


def test_empty_bad_input():
    with pytest.raises(TypeError, match="Python objects"):
        gpurt.empty(3, object)
    with pytest.raises(ValueError, match="negative dimension"):
        gpurt.empty((2, -1))


def test_lookup_ranges():
    a = gpurt.empty(1000, np.float64)
    base = a.ctypes.data
    loc, off = sharedmem.lookup(base + 80, 800)
    assert off == 80 and loc >> sharedmem.FD_BITS > 0
    # past the end of the array's pages: not inside it
    assert sharedmem.lookup(base + 4096 * 2 - 8, 4096) is None
    assert sharedmem.lookup(np.zeros(8).ctypes.data, 64) is None


def test_more_than_the_machine_holds_is_a_resource_error():
    """A shared file reserves nothing, so an array larger than the machine's memory and
    swap came back and the job was killed when it was touched (a bug hunt: 1 TiB on a
    24 GiB machine); numpy.empty refuses such a size too."""
    room = sharedmem._memory_bytes()
    if not room:
        pytest.skip("no /proc/meminfo here")
    with pytest.raises(gpurt.ResourceError, match="more than this machine has"):
        gpurt.zeros(room + (1 << 30), np.uint8)
    assert gpurt.zeros(1 << 20, np.uint8).sum() == 0


def test_lookup_is_right_while_another_thread_allocates_and_frees():
    """lookup reads the index without the lock: another thread's allocations and frees
    meanwhile must not make it answer another array (a bug hunt: the next one up, at a
    negative offset) or None for a live one — which made a send fail, or one rank choose
    another algorithm than its peers.  ~2 s of thread switches every 10 µs."""
    import sys
    import threading
    import time

    x = gpurt.empty(1 << 16, np.uint8)
    addr = x.ctypes.data
    good = sharedmem.lookup(addr, x.nbytes)
    assert good is not None and good[1] == 0
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            held = [gpurt.empty(16, np.uint8) for _ in range(50)]
            while held:
                held.pop()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t = threading.Thread(target=churn)
    t.start()
    wrong: dict = {}
    try:
        end = time.monotonic() + 2
        while time.monotonic() < end and len(wrong) < 3:
            for _ in range(500):
                got = sharedmem.lookup(addr, x.nbytes)
                if got != good:
                    wrong[got] = wrong.get(got, 0) + 1
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert not wrong, (wrong, good)


def test_freed_array_closes_its_file_and_peers_drop_it():
    """Freeing the last view closes the file descriptor and clears the live word; a
    mapping table (here: of our own process) then drops it on sweep."""
    gc.collect()
    fds0 = len(os.listdir("/proc/self/fd"))
    a = gpurt.empty(1 << 16, np.float32)
    a[:] = 3
    loc, off = sharedmem.lookup(a.ctypes.data, a.nbytes)
    maps = sharedmem.PeerMaps(os.getpid(), 0, 0)
    v = maps.view(loc, off, a.nbytes)
    assert (v.view(np.float32) == 3).all()
    v.view(np.float32)[:4] = 9          # writes through the mapping reach the array
    assert (a[:4] == 9).all()
    assert len(os.listdir("/proc/self/fd")) == fds0 + 1
    view = a[10:20]
    del a
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds0 + 1   # a view keeps it alive
    maps.sweep()
    assert len(maps.maps) == 1
    del view, v
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds0
    maps.sweep()
    assert maps.maps == {}
    maps.close()


def _rss_of_mapping(addr: int) -> int:
    """Bytes of this process's mapping at ``addr`` resident in its page tables (smaps)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    head = f"{addr:x}-"
    for i, line in enumerate(lines):
        if line.startswith(head):
            for ln in lines[i + 1:]:
                if ln.startswith("Rss:"):
                    return int(ln.split()[1]) * 1024
    raise AssertionError(f"no mapping at {addr:#x}")


def test_a_freed_arrays_memory_goes_though_a_peer_still_maps_it():
    """A peer keeps its mapping of a freed array until it next looks (a mapping-cache
    miss, an shm_direct call); small calls never look, and the memory stayed (a bug
    hunt: six freed 64 MiB arrays held 128 MiB over 20000 small calls). The owner now
    punches the data out of the file when it frees the array: a mapping left elsewhere
    holds address space, not memory. (The peer here is a mapping table of our own
    process.)"""
    a = gpurt.empty(2 << 20, np.float32)        # 8 MiB
    a[:] = 1
    loc, off = sharedmem.lookup(a.ctypes.data, a.nbytes)
    maps = sharedmem.PeerMaps(os.getpid(), 0, 0)
    v = maps.view(loc, off, a.nbytes)
    assert int(v.view(np.float32).sum()) == 2 << 20      # (faults every page in here)
    addr = next(iter(maps.maps.values()))[0].addr
    assert _rss_of_mapping(addr) >= 8 << 20
    del a
    gc.collect()
    assert _rss_of_mapping(addr) < 1 << 20
    del v
    maps.close()


FORK_CHILD = """
import gc, os, sys
import numpy as np
import gpurt
from gpurt import sharedmem
a = gpurt.empty(1000, np.float64)
loc, off = sharedmem.lookup(a.ctypes.data, a.nbytes)
pid = os.fork()
if pid == 0:          # a data-loader worker, say: drops the array and exits normally,
    del a             # so the finalizers run in the child
    gc.collect()
    sys.exit(0)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
maps = sharedmem.PeerMaps(os.getpid(), 0, 0)
v = maps.view(loc, off, a.nbytes)      # raises if the live word was cleared
print("ok", v.nbytes)
"""


def test_a_forked_child_does_not_free_the_parents_arrays():
    """A forked child that exits normally runs the arrays' finalizers too: they must not
    mark the parent's arrays freed for the peers."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FORK_CHILD], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("ok 8000"), proc.stdout + proc.stderr


FORK_KEEPS = """
import gc, os
import numpy as np
from gpurt import sharedmem
a = sharedmem.empty(1 << 20, np.float64)
a[:] = 1.0
r, w = os.pipe()
pid = os.fork()
if pid == 0:                        # a worker that still reads the array it was handed
    os.close(w)
    os.read(r, 1)                   # (once the parent has dropped it)
    os._exit(0 if a.sum() == 1 << 20 else 3)
os.close(r)
del a
gc.collect()
os.write(w, b"x")
_, status = os.waitpid(pid, 0)
print("child", os.WEXITSTATUS(status))
"""


def test_an_array_alive_across_a_fork_keeps_its_memory_for_the_child():
    """The owner punches a freed array's data out of its file — not one that lived
    across a fork: the child maps the same memory and may still use it (a review: a
    worker read zeros once the parent dropped its array)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FORK_KEEPS], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.strip() == "child 0", (proc.stdout, proc.stderr)


def test_peer_maps_errors_name_both_ranks():
    a = gpurt.empty(100, np.float64)
    loc, off = sharedmem.lookup(a.ctypes.data, a.nbytes)
    serial, fd = loc >> sharedmem.FD_BITS, loc & ((1 << sharedmem.FD_BITS) - 1)
    maps = sharedmem.PeerMaps(os.getpid(), 3, 1)
    with pytest.raises(TransportError, match=r"rank 1: rank 3 announced bytes"):
        maps.view(loc, off, 10 << 20)
    with pytest.raises(TransportError, match=r"rank 1: .*not rank 3's live shared array"):
        maps.view(((serial + 1000) << sharedmem.FD_BITS) | fd, 0, 8)
    r, w = os.pipe()
    try:
        with pytest.raises(TransportError, match=r"rank 1: .*rank 3"):
            maps.view((5 << sharedmem.FD_BITS) | r, 0, 8)
    finally:
        os.close(r)
        os.close(w)
    gone = sharedmem.PeerMaps(2 ** 22 + 12345, 4, 0)     # no such process
    with pytest.raises(TransportError, match=r"rank 0: cannot open rank 4's shared array"):
        gone.view(loc, 0, 8)
    maps.close()


@pytest.mark.parametrize("n", [0, 1, 15, 63, 64, 65, 4096 + 7, (3 << 20) + 5])
@pytest.mark.parametrize("shift", [0, 1, 9])
def test_stream_copy_exact(n, shift):
    """The streaming copy gives the bytes of np.copyto at any length and alignment and
    writes nothing around the destination."""
    if memcopy.threshold() == 0:
        pytest.skip(f"no streaming copy here: {memcopy.streaming_why()}")
    rng = np.random.default_rng(n + shift)
    src = rng.integers(0, 256, n + 16, dtype=np.uint8)[shift:shift + n]
    buf = np.full(n + 32, 0xA5, np.uint8)
    dst = buf[16 - shift // 2:16 - shift // 2 + n]
    memcopy.copyto(dst, src, 1 << 40)       # the hint forces the streamed path
    assert np.array_equal(dst, src)
    assert (buf[:16 - shift // 2] == 0xA5).all() and (buf[16 - shift // 2 + n:] == 0xA5).all()


def test_stream_copy_overlap_and_types_fall_back():
    a = np.arange(1 << 20, dtype=np.uint8)
    want = a[:-100].copy()
    memcopy.copyto(a[100:], a[:-100], 1 << 40)      # overlapping: np.copyto's semantics
    assert np.array_equal(a[100:], want)
    f = np.zeros(1000, np.float32)
    memcopy.copyto(f, np.arange(1000, dtype=np.float64), 1 << 40)   # a cast: np.copyto
    assert f[999] == 999.0


def test_threshold_rule(monkeypatch):
    from gpurt import config
    monkeypatch.setenv("GPURT_NT_COPY", "0")
    config.reload()
    memcopy._threshold.cache_clear()
    try:
        assert memcopy.threshold() == 0
        monkeypatch.setenv("GPURT_NT_COPY", "auto")
        config.reload()
        memcopy._threshold.cache_clear()
        if memcopy.streaming_why():
            pytest.skip(memcopy.streaming_why())
        llc = min(memcopy.llc_bytes() or (32 << 20), 128 << 20)
        assert memcopy.threshold() == max(1 << 20, llc // (2 * memcopy._local))
        # a cache reported larger than 128 MiB (a VM may show its host's whole shared L3)
        # counts as 128 MiB; none reported counts as 32 MiB
        for reported, local, want in [(300 << 20, 2, 32 << 20), (300 << 20, 4, 16 << 20),
                                      (32 << 20, 2, 8 << 20), (0, 2, 8 << 20),
                                      (4 << 20, 4, 1 << 20)]:
            monkeypatch.setattr(memcopy, "llc_bytes", lambda v=reported: v)
            monkeypatch.setattr(memcopy, "_local", local)
            memcopy._threshold.cache_clear()
            assert memcopy.threshold() == want, (reported, local)
    finally:
        monkeypatch.delenv("GPURT_NT_COPY")
        config.reload()
        memcopy._threshold.cache_clear()


# -- real processes ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shared_arrays_every_collective(n):
    """Shared in/out, shared in / NumPy out and the reverse; 128 KiB - 8 .. 9 MiB; every
    root; a view at an offset; 40 arrays allocated and freed (mappings dropped, no fd
    left); the mapping path really taken."""
    out = run_mpi(n, ["tests/shared_cases.py"], timeout=400).stdout
    assert out.startswith("ok") and f"on {n} ranks" in out, out


def test_shared_arrays_off():
    """GPURT_SHM_SHARED=0: the same results, nothing mapped."""
    out = run_mpi(2, ["tests/shared_cases.py"], env={"GPURT_SHM_SHARED": "0"}).stdout
    assert out.startswith("ok"), out


def test_shared_arrays_without_cma():
    """Where process_vm_readv is forbidden (a container without CAP_SYS_PTRACE, Yama scope
    2 or 3, or 1 with GPURT_SHM_PTRACER=0; simulated here — as root
    it cannot be forbidden — by GPURT_TEST_FORBID_CMA): shared arrays still go single
    copy through mappings, helped by the sender only into shared destinations; every
    other message goes through the rings.  Streaming copies forced from 4 KiB."""
    out = run_mpi(3, ["tests/shared_cases.py"],
                  env={"GPURT_TEST_FORBID_CMA": "1", "GPURT_NT_COPY": "4K"}).stdout
    assert out.startswith("ok"), out


NO_FD = """
import json, os, resource, numpy as np, gpurt
comm = gpurt.init()
r = comm.rank
rec = {"rank": r}
ep = comm.endpoints[1 - r]
if ep.owner.cma_why:
    rec["skip"] = ep.owner.cma_why
    print("NOFD " + json.dumps(rec), flush=True)
    raise SystemExit(0)
N = 1 << 20
x = comm.empty(N, np.float32)
x[:] = r + 1
hog = []
if r == 1:      # every file descriptor taken (sockets, files, other arrays)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
try:
    if r == 0:
        comm.send(x, 1, timeout=30)
    else:
        d = np.empty(N, np.float32)
        comm.recv(d, 0, timeout=30)
        rec["recv"] = bool((d == 1).all())
    g = comm.allgather(x)       # (shm_direct's maps, then its fallback schedule's)
    rec["allgather"] = bool((g[0] == 1).all() and (g[1] == 2).all())
except Exception as e:  # noqa: BLE001 - the record says what it was
    rec["error"] = f"{type(e).__name__}: {e}"
for f in hog:
    os.close(f)
print("NOFD " + json.dumps(rec), flush=True)
"""


def test_a_shared_array_that_cannot_be_mapped_is_read_by_address():
    """A rank with no file descriptor left cannot map its peer's shared array: the
    message is read with process_vm_readv from the address the sender also published
    (a warning says so once), exact — the send and an allgather (shm_direct and its
    fallback schedule).  Before: TransportError, and the communicator failed."""
    res = run_mpi(2, ["-c", NO_FD], timeout=120)
    recs = rank_records(res.stdout, "NOFD", 2)
    if "skip" in recs[0]:
        pytest.skip(f"process_vm_readv not allowed here: {recs[0]['skip']}")
    assert recs[1] == {"rank": 1, "recv": True, "allgather": True}, recs
    assert recs[0] == {"rank": 0, "allgather": True}, recs
    assert "reading rank 0's shared arrays with process_vm_readv instead" in res.stderr, \
        res.stderr


DEAD_SENDER = """
import json, os, sys, time, numpy as np, gpurt
comm = gpurt.init()
r = comm.rank
x = comm.empty(1 << 18, np.float32)     # 1 MiB: single copy through a mapping of it
x[:] = 7
if r == 0:
    req = comm.isend(x, 1)
    time.sleep(0.05)
    os._exit(3)                         # without a word, as a crash
pid = comm.pids[0]
deadline = time.monotonic() + 20
while time.monotonic() < deadline:      # until rank 0 is gone (or a zombie)
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                break
    except OSError:
        break
    time.sleep(0.01)
rec = {"rank": 1}
try:
    comm.recv(np.empty(1 << 18, np.float32), 0, timeout=10)
    rec["got"] = "completed"
except Exception as e:  # noqa: BLE001
    rec["got"] = f"{type(e).__name__} rank={getattr(e, 'rank', None)}: {e}"
with open(sys.argv[1], "w") as f:       # (a file: hydra may end the job's output early)
    json.dump(rec, f)
os._exit(0)
"""


def test_a_sender_that_died_with_a_shared_array_in_flight_is_a_peer_failure(tmp_path):
    """A rank that dies (without a word) with a send from its shared array in flight: the
    receiver gets PeerFailure(rank=0) that says it exited (before: TransportError 'cannot
    open rank 0's shared array ... No such file or directory', which programs catching
    PeerFailure miss)."""
    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup")
    out = tmp_path / "rec"
    proc = subprocess.run([*mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable,
                           "-c", DEAD_SENDER, str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, GPURT_TIMEOUT="60"))
    assert out.exists(), (proc.stdout, proc.stderr)
    rec = json.loads(out.read_text())
    assert rec["got"].startswith("PeerFailure rank=0: rank 1: in recv from rank 0 (tag 0): "
                                 "rank 0 (pid "), rec
    assert "has exited with its 1048576-byte message to this rank unread" in rec["got"], rec


GC_UNDER_THE_LOCK = """
import faulthandler, sys, time
faulthandler.dump_traceback_later(60, exit=True)
from gpurt import sharedmem
class Holder:
    pass
keep = [sharedmem.empty(16) for _ in range(200)]     # live arrays: long index tuples
for trial in range(8000):
    h = Holder()
    h.me, h.arr = h, sharedmem.empty(1024)          # an array in a reference cycle
    del h                                           # freed by a collection, whenever
    a = sharedmem.empty(1024)
    del a
print("done", flush=True)
"""


def test_a_collection_that_frees_an_array_while_the_index_changes_does_not_deadlock():
    """Allocating or freeing a shared array rebuilds the index (tuples the garbage
    collector tracks); a collection triggered there that frees an array in a reference
    cycle runs its finalizer, which changes the index too.  Built under the lock (not
    reentrant), that thread waited for itself for ever (a review); now built outside."""
    res = subprocess.run([sys.executable, "-c", GC_UNDER_THE_LOCK], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "done" in res.stdout, (res.stdout, res.stderr[-3000:])
