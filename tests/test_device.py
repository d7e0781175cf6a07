"""The device path (``cuda_ipc``, pinned staging, streams) on gpurt's host-memory
**stand-in for a GPU** (``gpurt/device_standin.py``).  These tests do not use a GPU: the
stand-in models CUDA's allocation/IPC/stream/event semantics in host memory so that the
protocol logic — handle exchange, base + offset, the opened-handle cache, cross-process
ordering by events, acknowledgements, staging, stream selection — runs here on real
processes.  The GPU itself is tested by ``tests/gpu/`` (marker ``gpu``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import is_hydra, run_mpi

STANDIN = {"GPURT_DEVICE_BACKEND": "standin"}
CASES = ["streams", "reuse", "alloc", "inflight", "burst", "order", "errors", "interfaces", "ownstream"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_sweep_algorithms_standin(n):
    """Every collective x every algorithm x sizes (to 3 MiB) x roots on stand-in device
    arrays sharing one device: cuda_ipc between all ranks, exact."""
    out = run_mpi(n, ["tests/mpi_sweep.py", "--device", "standin", "algorithms"],
                  env=STANDIN).stdout
    assert " 0 failed" in out and "standin device buffers" in out, out


@pytest.mark.parametrize("n", [2, 3])
def test_sweep_dtypes_standin(n):
    """Every dtype (float16, bfloat16 as 16-bit storage, complex, bool ...) x every op it
    supports, on the device path."""
    out = run_mpi(n, ["tests/mpi_sweep.py", "--device", "standin", "dtypes"],
                  env=STANDIN).stdout
    assert " 0 failed" in out, out


def test_sweep_with_slow_device_standin():
    """Every stand-in device operation held back 200 µs: a transfer not ordered after
    the producer's event, or a result read before its event fired, shows as wrong data
    (checked: removing the receiver's wait on the sender's event fails this sweep)."""
    out = run_mpi(3, ["tests/mpi_sweep.py", "--device", "standin", "algorithms"],
                  env={**STANDIN, "GPURT_STANDIN_DELAY_US": "200"}).stdout
    assert " 0 failed" in out, out


def test_sweep_without_p2p_standin():
    """Two devices without P2P: ranks on the same device use cuda_ipc, the others are
    staged through pinned host memory over shm in 64 KiB pipelined chunks."""
    env = {**STANDIN, "GPURT_STANDIN_DEVICES": "2", "GPURT_STANDIN_P2P": "0",
           "GPURT_DEVICE_STAGE": "64K"}
    out = run_mpi(3, ["tests/device_cases.py", "endpoints=mixed"], env=env).stdout
    assert "ok on 3 ranks" in out, out
    out = run_mpi(3, ["tests/mpi_sweep.py", "--device", "standin", "algorithms"],
                  env=env).stdout
    assert " 0 failed" in out, out


def test_a_large_staged_message_has_bounded_events_and_scratch_standin():
    """24 MiB in 4 KiB chunks between two devices without P2P (shm+staged): exact, with
    a bounded number of events and chunks of device scratch (see case_staging)."""
    env = {**STANDIN, "GPURT_STANDIN_DEVICES": "2", "GPURT_STANDIN_P2P": "0",
           "GPURT_DEVICE_STAGE": "4096"}
    out = run_mpi(2, ["tests/device_cases.py", "endpoints=shm+staged", "staging"],
                  env=env).stdout
    assert "ok on 2 ranks" in out, out


def test_staging_pool_releases_idle_buffers_standin():
    """A burst of staged messages (3 ranks over tcp: every pair staged) leaves its
    pinned buffers pooled; after GPURT_DEVICE_STAGE_KEEP seconds idle the next staged
    message releases them (see case_pool_release)."""
    env = {**STANDIN, "GPURT_TRANSPORTS": "tcp", "GPURT_DEVICE_STAGE_KEEP": "0.5",
           "GPURT_DEVICE_STAGE": "256K"}
    out = run_mpi(3, ["tests/device_cases.py", "endpoints=tcp+staged", "pool_release"],
                  env=env).stdout
    assert "ok on 3 ranks" in out, out


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_device_cases_standin(n):
    """Streams (the array's, stream=, the current one), a buffer overwritten right after
    the call returns, out=None allocation, 40 p2p messages in flight, errors."""
    out = run_mpi(n, ["tests/device_cases.py", "endpoints=cuda_ipc"] + CASES,
                  env={**STANDIN, "GPURT_STANDIN_DELAY_US": "50"}).stdout
    assert f"ok on {n} ranks" in out, out


def test_close_with_a_copy_still_reading_a_peer_allocation_standin():
    """A receive abandoned after its timeout while its own stream is busy, then close():
    the mapping its queued copy reads is closed only after the copy (it was unmapped
    under it: a segmentation fault); abandoned while the sender's stream is busy: nothing
    was queued (the read waits for the sender's event on the host), nothing lingers."""
    out = run_mpi(2, ["tests/device_cases.py", "abandoned"],
                  env={**STANDIN, "GPURT_STANDIN_DELAY_US": "200000"}).stdout
    assert "ok on 2 ranks" in out, out


@pytest.mark.parametrize("n", [2, 3])
def test_a_kernel_failing_after_the_call_began_fails_it_at_once_standin(n):
    """The stand-in's event query raises for a stream that failed (as CUDA's sticky
    error does): the rank raises its stream's error, the others PeerFailure, in seconds."""
    out = run_mpi(n, ["tests/device_cases.py", "sticky"],
                  env={**STANDIN, "GPURT_STANDIN_DELAY_US": "200000"}).stdout
    assert f"ok on {n} ranks" in out, out


def test_device_cases_without_p2p_standin():
    env = {**STANDIN, "GPURT_STANDIN_DEVICES": "2", "GPURT_STANDIN_P2P": "0",
           "GPURT_STANDIN_DELAY_US": "100"}
    out = run_mpi(3, ["tests/device_cases.py", "endpoints=mixed"] + CASES + ["otherdevice"],
                  env=env).stdout
    assert "ok on 3 ranks" in out, out


@pytest.mark.skipif(not is_hydra(), reason="MPICH cliques need the MPICH hydra mpiexec")
def test_device_two_nodes_standin():
    """2 nodes x 2 ranks (MPICH cliques): cuda_ipc inside a node, device buffers staged
    through pinned host memory over tcp between nodes; hierarchical schedules included."""
    env = {**STANDIN, "MPIR_CVAR_NUM_CLIQUES": "2", "GPURT_TEST_NNODES": "2",
           "GPURT_DEVICE_STAGE": "256K"}
    out = run_mpi(4, ["tests/device_cases.py", "endpoints=cuda_ipc,tcp+staged"] + CASES,
                  env={**env, "GPURT_STANDIN_DELAY_US": "100"}).stdout
    assert "ok on 4 ranks" in out, out
    out = run_mpi(4, ["tests/mpi_sweep.py", "--device", "standin", "algorithms"],
                  env=env).stdout
    assert " 0 failed" in out, out


def test_device_cases_with_stream_waits_standin():
    """GPURT_IPC_STREAM_WAIT=1: the receiver's stream waits on the sender's event (the
    read queued before the sender's producer is done) — ordering still exact under a
    slow stand-in."""
    out = run_mpi(3, ["tests/device_cases.py", "endpoints=cuda_ipc", "streams", "reuse",
                      "order", "inflight"],
                  env={**STANDIN, "GPURT_IPC_STREAM_WAIT": "1",
                       "GPURT_STANDIN_DELAY_US": "100"}).stdout
    assert "ok on 3 ranks" in out, out
    out = run_mpi(3, ["tests/mpi_sweep.py", "--device", "standin", "algorithms"],
                  env={**STANDIN, "GPURT_IPC_STREAM_WAIT": "1",
                       "GPURT_STANDIN_DELAY_US": "200"}).stdout
    assert " 0 failed" in out, out


def test_transports_without_cuda_ipc_stage_everything():
    """GPURT_TRANSPORTS=shm (cuda_ipc not named): device buffers are staged over shm."""
    out = run_mpi(3, ["tests/device_cases.py", "endpoints=shm+staged", "streams", "order",
                      "reuse"], env={**STANDIN, "GPURT_TRANSPORTS": "shm",
                                     "GPURT_STANDIN_DELAY_US": "100"}).stdout
    assert "ok on 3 ranks" in out, out


@pytest.mark.skipif(not is_hydra(), reason="an MPMD launch with per-rank -env (hydra)")
def test_ranks_with_and_without_a_device_backend():
    """One rank without a device backend: no hang at creation (both set-up exchanges
    are made by every rank), host calls work, a device call fails on every rank."""
    import subprocess
    import sys

    from conftest import ROOT, mpiexec

    env = dict(os.environ, GPURT_TIMEOUT="60")
    cmd = [*mpiexec(), "-n", "1", "-env", "GPURT_DEVICE_BACKEND", "none", sys.executable,
           "tests/device_cases.py", "mixed", ":", "-n", "2", "-env", "GPURT_DEVICE_BACKEND",
           "standin", sys.executable, "tests/device_cases.py", "mixed"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "mixed ok on 3 ranks" in proc.stdout, \
        (proc.stdout[-3000:], proc.stderr[-3000:])


_SETTINGS = r"""
import sys
import numpy as np, gpurt
from gpurt import device_standin as si
from mpi4py import MPI
try:
    c = gpurt.init()
except ValueError as e:
    got = MPI.COMM_WORLD.gather(f"REFUSED {e}", 0)
else:
    x = si.asarray(np.ones(1 << 18, np.float32))
    c.allreduce(x, timeout=30)
    assert (x.get() == c.size).all()
    got = c.mpi.gather(f"SUMMED {c.rank} {sorted({ep.chunk for ep in c.dev_endpoints.values()})}", 0)
if MPI.COMM_WORLD.rank == 0:
    sys.stdout.write("".join(g + "\n" for g in got))
"""


@pytest.mark.parametrize("value", ["abc", "-1", "7"])
def test_a_gpurt_device_that_names_no_device_is_refused_on_every_rank(value):
    """GPURT_DEVICE that is not an index, or names a device that is not there: a
    ValueError on every rank when the communicator is made (README, Configuration).
    Before: the communicator came up without a device, and the first device call was a
    TypeError about a missing backend."""
    out = run_mpi(2, ["-c", _SETTINGS], env={**STANDIN, "GPURT_DEVICE": value}).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("REFUSED")]
    assert len(lines) == 2, out
    assert all("gpurt settings not valid on rank(s) every rank: GPURT_DEVICE" in ln
               for ln in lines), out


@pytest.mark.skipif(not is_hydra(), reason="an MPMD launch with per-rank -env (hydra)")
def test_a_staging_chunk_set_on_one_rank_only_holds_for_the_whole_communicator():
    """GPURT_DEVICE_STAGE set on rank 0 only: both ranks cut staged messages into rank 0's
    chunks (before: a CollectiveMismatchError about message lengths on identical calls)."""
    import subprocess
    import sys

    from conftest import ROOT, mpiexec

    env = dict(os.environ, **STANDIN, GPURT_TRANSPORTS="tcp", GPURT_TIMEOUT="60")
    cmd = [*mpiexec(), "-n", "1", "-env", "GPURT_DEVICE_STAGE", "4096", sys.executable, "-c",
           _SETTINGS, ":", "-n", "1", sys.executable, "-c", _SETTINGS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    got = [ln for ln in proc.stdout.splitlines() if ln.startswith("SUMMED")]
    assert got == ["SUMMED 0 [4096]", "SUMMED 1 [4096]"], (proc.stdout, proc.stderr[-3000:])


def test_no_backend_is_a_clear_error():
    out = run_mpi(2, ["tests/device_cases.py", "nobackend"],
                  env={"GPURT_DEVICE_BACKEND": "none"}).stdout
    assert "ok on 2 ranks" in out, out


# -- the stand-in's own semantics (in this process) -------------------------------------
@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv("GPURT_DEVICE_BACKEND", "standin")
    from gpurt import device
    device._reset_for_tests()
    yield device.get()
    device._reset_for_tests()


def test_standin_event_semantics(standin):
    """CUDA's rules: a wait issued before any record waits for nothing; a wait issued
    after a record holds the stream until that record has run; query is true once the
    latest record has run; queued work runs later, in order."""
    import time

    from gpurt import device_standin as si

    be = standin
    ev = be.event(True)
    assert be.query(ev)                        # never recorded: complete
    s = si.Stream()
    x = si.zeros(4, np.float32, stream=s.ptr)
    be.wait_event(s.ptr, ev)                   # before any record: waits for nothing
    si.fill(x, 3.0)
    s.synchronize()
    assert (x.get() == 3).all()
    # another process's record, issued but not yet run (its issued count is ahead)
    words, i = ev.table.words, 2 * ev.slot
    words[i] += 1
    assert not be.query(ev)
    be.wait_event(s.ptr, ev)
    si.fill(x, 5.0)
    time.sleep(0.05)
    assert (x._view()._np() == 3).all(), "the stream ran past a wait on an unfinished record"
    words[i + 1] = words[i]                    # that record runs
    s.synchronize()
    assert be.query(ev) and (x.get() == 5).all()


def test_standin_ipc_rules(standin):
    from gpurt.errors import TransportError

    be = standin
    v = be.alloc(1000)
    base, size = be.address_range(be.ptr(v[100:200]))
    assert base == be.ptr(v) and size == 1000
    h = be.ipc_handle(base)
    with pytest.raises(TransportError, match="process that made it"):
        be.ipc_open(h)
    with pytest.raises(TypeError, match="not stand-in device memory"):
        be.device_of(np.zeros(4).ctypes.data)


def test_standin_bfloat16_kernel_matches_ml_dtypes(standin):
    """The bfloat16 reduction (16-bit storage widened to float32, rounded to nearest
    even) equals ml_dtypes' on random bit patterns, NaN for NaN."""
    from gpurt import device_standin as si
    from gpurt.ops import BFLOAT16, Op

    be = standin
    rng = np.random.default_rng(7)
    bits_a = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    bits_b = rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    a, b = bits_a.view(BFLOAT16), bits_b.view(BFLOAT16)
    for op, uf in ((Op.SUM, np.add), (Op.PROD, np.multiply), (Op.MAX, np.maximum),
                   (Op.MIN, np.minimum)):
        da, db = si.asarray(a), si.asarray(b)
        be.reduce(op, da._view(), db._view(), da._view(), si.LEGACY, dtype=BFLOAT16)
        got = da.get().astype(np.float32)
        with np.errstate(all="ignore"):
            want = uf(a.astype(np.float32), b.astype(np.float32)).astype(BFLOAT16) \
                .astype(np.float32)
        nan = np.isnan(want)
        assert (np.isnan(got) == nan).all(), op
        assert (got[~nan] == want[~nan]).all(), op


def test_standin_leaves_no_files(standin):
    """Stand-in allocations are memfds: nothing in /dev/shm, freed with the array."""
    from gpurt import device_standin as si

    before = set(os.listdir("/dev/shm"))
    a = si.zeros(1 << 20, np.uint8)
    assert set(os.listdir("/dev/shm")) == before
    fd_count = len(os.listdir("/proc/self/fd"))
    del a
    import gc
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fd_count - 1


EXITED_PEER = """
import os, sys, time
import numpy as np, gpurt
from gpurt import device_standin as si
outdir = sys.argv[1]
c = gpurt.init()
def report(text):   # one file per rank: the launcher interleaves stdout
    with open(os.path.join(outdir, f"rank{c.rank}"), "w") as f:
        f.write(text)
x = si.asarray(np.ones(1 << 18, np.float32))
for i in range(3):
    c.allreduce(x)
if c.rank == 1:
    os._exit(3)     # gone without a word, between two device collectives (hydra would
                    # take the whole job down at once if its child died of a signal)
t = time.monotonic()
try:
    for i in range(50):
        c.allreduce(x, timeout=60)
    report(f"rank {c.rank}: no failure")
except gpurt.PeerFailure as e:
    report(f"rank {c.rank}: PeerFailure rank={e.rank} after {time.monotonic() - t:.2f}s: {e}")
os._exit(0)
"""


EXITED_SENDER = """
import os, sys, time
import numpy as np, gpurt
from gpurt import device_standin as si
c = gpurt.init()
c.allreduce(si.asarray(np.ones(10, np.float32)))
if c.rank == 0:
    big = si.asarray(np.full(1 << 16, 5.0, np.float32))  # an allocation never sent before
    q = c.isend(big, 1)
    time.sleep(0.3)
    os._exit(3)     # gone with its message in flight: its allocation and events with it
o = si.zeros(1 << 16, np.float32)
time.sleep(1.0)
t = time.monotonic()
try:
    c.recv(o, 0, timeout=30)
    print("RECV got", o.get()[0], flush=True)
except Exception as e:
    print(f"RECV {type(e).__name__} rank={getattr(e, 'rank', None)} "
          f"after {time.monotonic() - t:.2f}s: {e}", flush=True)
os._exit(0)
"""


def test_a_sender_that_exits_with_a_device_message_in_flight_is_a_peer_failure():
    """The receiver opens the allocation (or the event) of a sender that has exited: a
    PeerFailure naming it (before: a TransportError about a file of the stand-in; on a
    GPU, cudaIpcOpenMemHandle's error), at once."""
    import subprocess
    import sys

    from conftest import ROOT, mpiexec

    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup; this launcher is not hydra")
    env = dict(os.environ, **STANDIN, GPURT_TIMEOUT="60")
    proc = subprocess.run([*mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable,
                           "-c", EXITED_SENDER], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECV")]
    assert len(lines) == 1, (proc.stdout, proc.stderr[-3000:])
    assert lines[0].startswith("RECV PeerFailure rank=0 "), lines
    assert float(lines[0].split(" after ")[1].split("s:")[0]) < 2.0, lines


@pytest.mark.parametrize("path", ["cuda_ipc", "staged"])
def test_exited_peer_during_device_calls_is_a_peer_failure(path, tmp_path):
    """A rank that exits between device allreduces (the launcher's clean-up off): both
    survivors raise PeerFailure(rank=1) within a second, over cuda_ipc (acknowledgement
    words) and over staging; no gpurt file is left in /dev/shm."""
    from conftest import gpurt_shm_files, run_mpi_leaving

    env = dict(STANDIN)
    if path == "staged":
        env.update(GPURT_STANDIN_DEVICES="3", GPURT_STANDIN_P2P="0")
    before = set(gpurt_shm_files())
    proc, got = run_mpi_leaving(3, ["-c", EXITED_PEER], tmp_path, env=env)
    for r in (0, 2):
        text = got.get(f"rank{r}", "")
        assert "PeerFailure rank=1 " in text, (got, proc.stdout[-3000:], proc.stderr[-3000:])
        assert float(text.split(" after ")[1].split("s:")[0]) < 1.0, text
    assert set(gpurt_shm_files()) - before == set()


_SLOT_REUSE = r"""
import gc, os, time
import numpy as np
from gpurt import device
from gpurt import device_standin as si
be = device.get()
slow, fast = si.Stream(), si.Stream()
a = si.zeros(10, np.float32, stream=slow.ptr)
b = si.zeros(10, np.float32, stream=fast.ptr)
for _ in range(3):
    si.fill(a, 1.0)                  # 'slow' busy for ~0.15 s
old = be.event(False)
be.record(old, slow.ptr)             # its mark runs after the fills
del old
gc.collect()                         # dropped with its record still queued
new = be.event(False)
for _ in range(10):
    si.fill(b, 2.0)                  # 'fast' busy for ~0.5 s
be.record(new, fast.ptr)
t0 = time.monotonic()
while not be.query(new):
    time.sleep(0.005)
left = len(si._worker().queue(fast.ptr).ops)
print("LEFT", left, round(time.monotonic() - t0, 2))
"""


def test_a_dropped_events_queued_record_never_completes_the_next_event_standin():
    """An event dropped while its record is still queued keeps its slot until the record
    ran (CUDA defers an event's destruction so): the stand-in handed the slot out again
    at once, and the stale mark then completed the new event while 10 operations were
    still queued before that one's record (a receive's acknowledgement sent early)."""
    import subprocess
    import sys

    env = dict(os.environ, GPURT_DEVICE_BACKEND="standin", GPURT_STANDIN_DELAY_US="50000")
    out = subprocess.run([sys.executable, "-c", _SLOT_REUSE], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    assert out.startswith("LEFT 0 "), out


def test_a_peer_that_dies_leaves_the_callers_stream_usable_standin():
    """Rank 1 dies with its device allreduce posted and its input still being produced;
    rank 0 raises PeerFailure naming it, and the stream of its call still runs what it
    queues next (its read waited for rank 1's event on the host, not on the stream:
    a stream wait on a peer's event that never fires cannot be cancelled)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, mpiexec

    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup; this launcher is not hydra")
    env = dict(os.environ, GPURT_DEVICE_BACKEND="standin", GPURT_STANDIN_DELAY_US="100000",
               GPURT_TIMEOUT="60")
    proc = subprocess.run([*mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable,
                           "tests/device_dead_peer_cases.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DEAD_PEER ")]
    assert len(lines) == 1, (proc.stdout, proc.stderr)
    rec = json.loads(lines[0].split(" ", 1)[1])
    assert rec["outcome"].startswith("PeerFailure(rank=1)"), rec
    assert rec["seconds"] < 10, rec
    assert rec["after"] == [5.0] * 10, rec
