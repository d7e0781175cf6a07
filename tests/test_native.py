"""The shm board's compiled inline round (gpurt._fastboard) against NumPy, bit for bit,
and the Python round it replaces (GPURT_NATIVE=0) against the same reference.  Real
processes; tests/board_bits.py says what is checked."""

from __future__ import annotations

import os

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
    out = run_mpi(n, ["tests/help_cases.py"]).stdout
    mode = "off" if oversubscribed(n) else "on"
    assert out.startswith("ok") and f"cooperative copy {mode}" in out, out


def test_cooperative_copy_off():
    """GPURT_SHM_HELP=0: the receiver copies everything (the same cases, exact)."""
    out = run_mpi(2, ["tests/help_cases.py"], env={"GPURT_SHM_HELP": "0"}).stdout
    assert out.startswith("ok") and "cooperative copy off" in out, out


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
    raises PeerFailure(rank=0) within the liveness bound, not at its 30 s deadline."""
    _need_native()
    from conftest import ROOT, is_hydra, mpiexec
    import subprocess
    import sys

    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup; this launcher is not hydra")
    proc = subprocess.run([mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable, "-c",
                           SENDER_DIES, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    text = (tmp_path / "rank1").read_text() if (tmp_path / "rank1").exists() else ""
    line = next((ln for ln in text.splitlines() if "PeerFailure" in ln), None)
    assert line is not None, (text, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "rank=0 " in line, line
    assert "has exited" in line, line          # found by the liveness check, not a readv
    assert float(line.split(" after ")[1].split("s:")[0]) < 2.5, line
