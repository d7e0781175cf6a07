"""The shm board's compiled inline round (gpurt._fastboard) against NumPy, bit for bit,
and the Python round it replaces (GPURT_NATIVE=0) against the same reference.  Real
processes; tests/board_bits.py says what is checked."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import run_mpi
from gpurt.transports import shm_board


def _need_native() -> None:
    if shm_board.NATIVE is None:
        if os.environ.get("GPURT_TEST_REQUIRE_NATIVE") == "1":   # set by .ci/run
            pytest.fail(f"gpurt._fastboard must be built here: {shm_board.NATIVE_WHY}")
        pytest.skip(f"gpurt._fastboard is not built: {shm_board.NATIVE_WHY}")


@pytest.mark.parametrize("n", [2, 3, 5])
def test_board_bits_native(n):
    """Every dtype x op (NaN, ±inf, -0.0, integer extremes that wrap), broadcast from every
    root, barrier, in place / into out / non-blocking in between: the compiled round gives
    NumPy's rank-order bits on every rank (NaN payloads aside)."""
    _need_native()
    out = run_mpi(n, ["tests/board_bits.py", "native"]).stdout
    assert f"checks on {n} ranks (native)" in out and out.startswith("ok"), out


@pytest.mark.parametrize("n", [2, 3])
def test_board_bits_python(n):
    """The same cases with the compiled round switched off (GPURT_NATIVE=0)."""
    out = run_mpi(n, ["tests/board_bits.py", "python"]).stdout
    assert f"checks on {n} ranks (python)" in out and out.startswith("ok"), out


def test_native_built_and_in_info(monkeypatch):
    """``gpurt info`` says whether the compiled round is in use, and why not."""
    from click.testing import CliRunner

    from gpurt.launch.cli import main

    res = CliRunner().invoke(main, ["info"])
    assert res.exit_code == 0, res.output
    line = next(l for l in res.output.splitlines() if l.startswith("compiled board round:"))
    if shm_board.NATIVE is None:
        assert "no" in line and shm_board.NATIVE_WHY.split(" ")[0] in line
        _need_native()
    else:
        assert "yes" in line
    from gpurt import config

    monkeypatch.setenv("GPURT_NATIVE", "0")
    config.reload()
    try:
        res = CliRunner().invoke(main, ["info"])
    finally:
        monkeypatch.delenv("GPURT_NATIVE")
        config.reload()
    assert "compiled board round: no   built; off (GPURT_NATIVE=0)" in res.output, res.output


# -- the shm transport's cooperative single copy (needs the extension's claim word) ----------

@pytest.mark.parametrize("n", [2, 3])
def test_cooperative_copy(n):
    """Large plain receives shared between receiver (readv) and waiting sender (writev):
    broadcast/gather/allgather from every root around the chunk boundaries, a busy sender
    (the receiver finishes alone, before the sender's wait), a slow receiver, 20 messages
    back to back; both sides copied chunks (tests/help_cases.py).  With more ranks than
    CPUs the sharing is off (no core to spare): then the same cases run receiver-only."""
    from gpurt.wait import oversubscribed

    _need_native()
    # (single copy from 128 KiB, not the cache-derived default: the cases around 1 MiB
    # must go single-copy)
    out = run_mpi(n, ["tests/help_cases.py"], env={"GPURT_SHM_CMA": "128K"}).stdout
    mode = "off" if oversubscribed(n) else "on"
    assert out.startswith("ok") and f"cooperative copy {mode}" in out, out


def test_cooperative_copy_off():
    """GPURT_SHM_HELP=0: the receiver copies everything (the same cases, exact)."""
    out = run_mpi(2, ["tests/help_cases.py"],
                  env={"GPURT_SHM_HELP": "0", "GPURT_SHM_CMA": "128K"}).stdout
    assert out.startswith("ok") and "cooperative copy off" in out, out


BIG_RECV_SHORT_TIMEOUT = r"""
import time
import numpy as np
import gpurt
c = gpurt.init()
nb = 1 << 30
if c.rank == 0:
    x = np.full(nb, 7, np.uint8)
    c.barrier()
    try:
        c.send(x, 1, timeout=30)
        got = "sent"
    except gpurt.GpurtError as e:
        got = type(e).__name__
else:
    out = np.zeros(nb, np.uint8)
    c.barrier()
    time.sleep(0.05)
    t = time.monotonic()
    try:
        c.recv(out, 0, timeout=0.005)
        got = "received"
    except gpurt.CollectiveTimeout:
        got = "timeout"
    took = time.monotonic() - t
    snap = int(np.count_nonzero(out))
    time.sleep(0.5)
    got += f" after {took:.3f} s; changed after: {int(np.count_nonzero(out)) - snap}"
print(f"BIGRECV {c.rank} {got}", flush=True)
"""


def test_a_large_receive_with_a_short_timeout_keeps_its_deadline():
    """A 1 GiB receive with a 5 ms timeout through the cooperative copy: the receiver
    copies at most 16 MiB between deadline checks, so it times out in milliseconds and
    nothing lands in its buffer afterwards. Before, it copied every chunk in one step,
    overshot by 1–9 s, and then timed out anyway, blaming a sender whose bytes had all
    arrived (a bug hunt)."""
    _need_native()
    out = run_mpi(2, ["-c", BIG_RECV_SHORT_TIMEOUT], timeout=180).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("BIGRECV 1 ")), "")
    assert line.startswith("BIGRECV 1 timeout after "), out
    took = float(line.split(" after ")[1].split(" s;")[0])
    assert took < 1.0 and line.endswith("changed after: 0"), line


SENDER_DIES = """
import os, sys, time
import numpy as np
import gpurt
from gpurt.transports import cma, shm
c = gpurt.init()
def report(text):   # one file per rank: the launcher interleaves stdout
    with open(os.path.join(sys.argv[1], f"rank{c.rank}"), "a") as f:
        f.write(text + "\\n")
n = 64 << 20
x = np.zeros(n, np.uint8)
if c.rank == 0:
    real = cma.copy
    def dying(pid, local, remote, nbytes, to_peer, peer=-1):
        if to_peer:            # a chunk taken for the peer, never copied: gone, once the
            time.sleep(0.5)    # receiver has copied all the others and waits for this one
            os._exit(3)
        return real(pid, local, remote, nbytes, to_peer, peer)
    shm.cma.copy = dying
    x[:] = 7
t = time.monotonic()
try:
    c.broadcast(x, root=0, timeout=30)
    report(f"rank {c.rank}: no error")
except gpurt.PeerFailure as e:
    report(f"rank {c.rank}: PeerFailure rank={e.rank} after {time.monotonic() - t:.2f}s: {e}")
os._exit(0)
"""


def test_sender_that_dies_holding_a_chunk_is_a_peer_failure(tmp_path):
    """The sender takes a chunk of the receiver's buffer and exits (0.5 s later) without
    copying it: the receiver, which has copied every other chunk and waits for that one,
    raises PeerFailure(rank=0) within the liveness bound, not at its 30 s deadline.
    (GPURT_SHM_DIRECT_CMA=0: the broadcast takes the schedule over the shm transport,
    whose cooperative copy this is, not shm_direct's compiled shares.)"""
    _need_native()
    from conftest import ROOT, is_hydra, mpiexec
    import os
    import subprocess
    import sys

    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup; this launcher is not hydra")
    proc = subprocess.run([*mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable, "-c",
                           SENDER_DIES, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, GPURT_SHM_DIRECT_CMA="0"))
    text = (tmp_path / "rank1").read_text() if (tmp_path / "rank1").exists() else ""
    line = next((ln for ln in text.splitlines() if "PeerFailure" in ln), None)
    assert line is not None, (text, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "rank=0 " in line, line
    assert "has exited" in line, line          # found by the liveness check, not a readv
    assert float(line.split(" after ")[1].split("s:")[0]) < 2.5, line


SIGNAL_IN_ROUND = """
import signal, sys
import numpy as np
from mpi4py import MPI
import gpurt
c = gpurt.Communicator(MPI.COMM_WORLD)
class Boom(Exception):
    pass
def boom(*a):
    raise Boom()
c.allreduce(np.ones(4))
MPI.COMM_WORLD.Barrier()
if c.rank == 0:
    signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, 0.0004)   # fires while it waits for rank 1
    try:
        c.allreduce(np.ones(4))
        print("rank 0: no Boom", flush=True)
    except Boom:
        print(f"rank 0: Boom, poisoned={c.engine.poisoned is not None}", flush=True)
    MPI.COMM_WORLD.send(None, 1, tag=5)             # rank 1 may come now
    try:
        c.allreduce(np.ones(4))
        print("rank 0: next call returned", flush=True)
    except gpurt.CommunicatorClosed:
        print("rank 0: next call CommunicatorClosed", flush=True)
else:
    MPI.COMM_WORLD.recv(source=0, tag=5)   # (not a fixed sleep: a late rank 0 would find
    for i in range(2):                     # rank 1's header there, and no wait to break)
        try:
            c.allreduce(np.ones(4))
        except gpurt.PeerFailure:
            print(f"rank 1: PeerFailure at call {i}", flush=True)
            break
"""


def test_signal_in_the_compiled_round_poisons():
    """An exception from a signal handler surfacing while (or right after) the compiled
    round waits leaves the call half done on the board: the communicator is poisoned on
    that rank (its next call raises CommunicatorClosed) and its peer gets PeerFailure —
    as on the Python path — instead of carrying on out of step."""
    _need_native()
    out = run_mpi(2, ["-c", SIGNAL_IN_ROUND]).stdout
    assert "rank 0: Boom, poisoned=True" in out, out
    assert "rank 0: next call CommunicatorClosed" in out, out
    assert "rank 1: PeerFailure" in out, out


INLINE_CHECKS = """
import numpy as np
from mpi4py import MPI
import gpurt
c = gpurt.Communicator(MPI.COMM_WORLD)
def attempt(name, f):
    try:
        f()
        print(f"rank {c.rank} {name}: ok", flush=True)
    except Exception as e:
        print(f"rank {c.rank} {name}: {type(e).__name__}", flush=True)
attempt("stream", lambda: c.allgather(np.ones(4), stream=1))
attempt("stream-allreduce", lambda: c.allreduce(np.ones(4), stream=1))
bad = np.empty(8)[::2] if c.rank == 1 else None      # ireduce checks out= off the root too
attempt("reduce-out", lambda: c.reduce(np.ones(4), out=bad, root=0))
"""


def test_inline_paths_keep_the_general_checks():
    """The inline board paths raise what the i-variants raise: ``stream=`` with host
    arrays is a ValueError on every rank (for allgather and allreduce alike); a
    non-contiguous ``out`` off the root of a reduce is that rank's ValueError and its
    peer's CollectiveMismatchError (the rejection is announced), as on the general path."""
    out = run_mpi(2, ["-c", INLINE_CHECKS]).stdout
    for r in (0, 1):
        assert f"rank {r} stream: ValueError" in out, out
        assert f"rank {r} stream-allreduce: ValueError" in out, out
    assert "rank 1 reduce-out: ValueError" in out, out
    assert "rank 0 reduce-out: CollectiveMismatchError" in out, out


RECEIVER_GIVES_UP = """
import os, sys, time
import numpy as np
import gpurt
from gpurt.errors import TransportError
from gpurt.transports import cma
c = gpurt.init()
def report(text):
    with open(os.path.join(sys.argv[1], f"rank{c.rank}"), "a") as f:
        f.write(text + "\\n")
n = 64 << 20
if c.rank == 0:
    try:
        c.send(np.full(n, 7, np.uint8), 1, tag=3, timeout=20)
        report("rank 0: sent")
    except gpurt.GpurtError as e:
        report(f"rank 0: {type(e).__name__}")
else:
    real, mine = cma.copy, [0]
    def failing(pid, local, remote, nbytes, to_peer, peer=-1):
        if not to_peer:
            mine[0] += 1
            if mine[0] == 4:          # this rank's 4th chunk: an error mid-receive
                raise TransportError("injected failure")
        return real(pid, local, remote, nbytes, to_peer, peer)
    cma.copy = failing
    buf = np.zeros(n, np.uint8)
    time.sleep(0.2)                   # the sender is waiting (and helping) by now
    try:
        c.recv(buf, 0, tag=3, timeout=20)
        report("rank 1: received")
    except gpurt.GpurtError as e:
        buf[:] = 0xAB                 # the caller has its buffer back: nobody writes now
        time.sleep(1.0)
        late = int(np.count_nonzero(buf != 0xAB))
        report(f"rank 1: {type(e).__name__}; bytes written after: {late}")
os._exit(0)
"""


def test_a_receiver_that_gives_up_is_not_written_into(tmp_path):
    """The receiver fails in the middle of a cooperative receive (an injected readv
    error): it seals the claim word and waits for the chunks the sender holds before it
    raises, so that no byte of its buffer is written once the caller has it back, while
    the waiting sender would otherwise go on copying chunks into it.  (Checked: without
    the seal this test sees tens of MiB written late.)"""
    _need_native()
    from conftest import ROOT, is_hydra, mpiexec
    import subprocess
    import sys

    from gpurt.wait import oversubscribed
    if oversubscribed(2):
        pytest.skip("the cooperative copy is off with more ranks than CPUs")
    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup; this launcher is not hydra")
    proc = subprocess.run([*mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable, "-c",
                           RECEIVER_GIVES_UP, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    text = "".join(f.read_text() for f in sorted(tmp_path.iterdir()))
    assert "rank 1: TransportError; bytes written after: 0" in text, \
        (text, proc.stdout[-3000:], proc.stderr[-3000:])


def test_close_waits_for_a_round_running_without_the_gil():
    """Closing the board from another thread while a compiled round waits with the GIL
    released (here for a peer that never publishes) waits for that round to end before
    the tables go — the segment is unmapped next —, the round stops waiting at once (not
    at the end of its 5 s budget), and a later call says the board is closed instead of
    touching freed memory.  (One process, a board in a NumPy buffer.)"""
    _need_native()
    import threading
    import time

    import numpy as np

    from gpurt.ops import Op
    from gpurt.transports import shm_board

    slot = 4096
    u8 = np.zeros(shm_board.region_bytes(2, slot), np.uint8)
    bd = shm_board.Board(memoryview(u8).cast("Q"), u8, 0, 2, 0, slot)
    assert bd.fast is not None
    bd.fast.set_wait(0, 5_000_000_000)        # the round waits 5 s for rank 1's flag
    f32 = np.dtype(np.float32)
    meta = shm_board.meta_of("allreduce", f32, 4, Op.SUM, 0)
    plan = bd.fast_plan("allreduce", 1234, meta, f32, 4, Op.SUM, 0)
    x, out = np.ones(4, np.float32), np.zeros(4, np.float32)
    got = []
    snap = u8.copy()
    t = threading.Thread(target=lambda: got.append(bd.fast.run(plan, 1, 0, x, out)))
    t.start()
    t0 = time.monotonic()           # until the round has published (it then waits), cap 5 s
    while np.array_equal(u8, snap) and time.monotonic() - t0 < 5:
        time.sleep(1e-3)
    time.sleep(0.01)
    t0 = time.monotonic()
    fast = bd.fast
    bd.close()
    waited = time.monotonic() - t0
    t.join()
    assert got == [1]                         # published; the peer never came
    assert waited < 2.0, waited               # not the 5 s budget
    with pytest.raises(RuntimeError, match="closed"):
        fast.run(plan, 2, 0, x, out)



def test_plain_agrees_with_the_python_check():
    """``_fastboard.plain`` (allreduce's quick path reads NumPy's flags, dtype and shape
    from the array struct) answers as the Python check it stands in for
    (``Communicator._inline_res``): True only where that takes x and out as they are —
    and never for an out that is read-only, strided, of another dtype or size, or
    overlapping x by a single byte."""
    _need_native()
    from gpurt.comm import Communicator

    assert shm_board.PLAIN is not None, "the import's self-check turned plain() off"
    base = np.arange(64, dtype=np.float64)
    ro = np.ones(8)
    ro.flags.writeable = False
    bytes_ = np.zeros(8 * 8 + 1, np.uint8)
    xs = [base[:8], base[8:16], base.reshape(8, 8)[0], base[::2][:8], base[:8].reshape(2, 4),
          ro, np.float64(3.0) * np.ones(()), np.zeros(0), np.zeros(8, np.float32),
          np.zeros(8, np.dtype("<f8").newbyteorder("=")), bytes_[1:].view(np.float64)]
    outs = xs + [base[4:12], base[7:15], base[16:24][::-1], base.reshape(8, 8)[:, 0],
                 np.zeros((2, 2, 2)), np.zeros(9)[:8], bytes_[:64].view(np.float64)]
    seen = {True: 0, False: 0}
    for x in xs:
        for o in outs + [None]:
            want = Communicator._inline_res(x, o) is not None
            res = x if o is None else o
            got = shm_board.PLAIN(x, res, x.nbytes)
            if got:       # (False may also mean "not the same dtype object": Python decides)
                assert want, (x, o)
            elif want:
                assert o is not None and o.dtype is not x.dtype, (x, o)
            seen[got] += 1
    assert seen[True] > 10 and seen[False] > 10, seen
    assert shm_board.PLAIN(base, base.tolist(), 8) is False     # not an ndarray
    with pytest.raises(TypeError):
        shm_board.PLAIN(base, base)


@pytest.mark.parametrize("mode", ["quick", "mixed", "nocma"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_quick_send_recv_against_the_ring_protocol(n, mode):
    """send/recv's quick path (the compiled shm ring end) moves messages exactly as the
    ring's Python protocol does and interoperates with it (``mixed``: the odd ranks use
    the Python protocol only): every size class and dtype, blocking and non-blocking in
    several orders, bursts that fill the ring, receives posted before their message and
    a larger one queued behind them, shared arrays past the mapping threshold (not
    quick); a receive posted early advanced by a wait on another communicator (it hung:
    the progress rule); a Ctrl-C right after the compiled end moved a message (send,
    receive, a posted receive's wait) poisons the communicator (it delivered a message
    twice); after it is warm, every mismatch kind still raises
    on the receiver and poisons it, a receive posted early times out (and then
    completes), and test() polls one to completion.  tests/quick_p2p_cases.py; the quick
    path must have carried messages (counted), messages of several slots among them,
    some partly (``nocma``: GPURT_SHM_CMA=0, no single copy, so messages of every size
    are the compiled ends', with 3 and 5 ranks too).  With more ranks than cores a
    blocking receive does not spin: it is posted, then waited (the case that once
    returned before its message had come)."""
    _need_native()
    env = {"GPURT_SHM_CMA": "0"} if mode == "nocma" else None
    mode = "quick" if mode == "nocma" else mode
    out = run_mpi(n, ["tests/quick_p2p_cases.py", mode], timeout=300, env=env).stdout
    assert f"checks on {n} ranks ({mode})" in out and "\nok " in "\n" + out, out
