"""Shared helpers: find mpiexec, run a command under it with a deadline.

Tests in ``tests/mpi/`` are pytest-mpi tests: they run *inside* ``mpiexec -n N python -m
pytest --with-mpi tests/mpi``, launched by ``tests/test_processes.py``; the outer pytest
does not collect them itself.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

collect_ignore = [] if "--with-mpi" in sys.argv else ["mpi"]


def pytest_sessionstart(session):
    """Write the bytecode of the sources once, before the tests start their hundreds of
    ranks: where PYTHONDONTWRITEBYTECODE is set (this machine's image sets it) nothing
    writes it, and every rank compiled every module of an editable install from source
    again, ~0.2 s of CPU a process (Python still checks each file's mtime, so an edited
    source is never run from stale bytecode).  A read-only checkout just skips it."""
    if "--with-mpi" in sys.argv:
        return          # (the ranks of tests/mpi: the outer session did it)
    import compileall
    for d in ("gpurt", "transports", "launch", "tests"):
        compileall.compile_dir(str(ROOT / d), quiet=2, workers=1)


def mpiexec() -> list[str]:
    """The launcher's command: $GPURT_MPIEXEC (which may carry flags, as for `gpurt
    launch`: ``mpirun --oversubscribe``), else the one beside this Python (the mpich
    wheel's), else the first on PATH."""
    env = os.environ.get("GPURT_MPIEXEC")
    if env:
        return shlex.split(env)
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return [str(here)]
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        pytest.fail("no mpiexec found: pip install mpich (or set GPURT_MPIEXEC)")
    return [found]


def run_mpi(n: int, args: list[str], *, env: dict | None = None, timeout: float = 240,
            check: bool = True) -> subprocess.CompletedProcess:
    """``mpiexec -n n python ARGS`` from the repository root; output captured."""
    e = dict(os.environ)
    e.setdefault("GPURT_TIMEOUT", "60")   # a hung case fails in a minute, not in five
    e.update(env or {})
    if "MPIR_CVAR_NUM_CLIQUES" in (env or {}) and not is_hydra():
        # (another MPI ignores it: the "several nodes" case would quietly run on one)
        pytest.skip("MPICH cliques (MPIR_CVAR_NUM_CLIQUES) need MPICH's hydra mpiexec")
    cmd = [*mpiexec(), "-n", str(n), sys.executable] + args
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s\n"
                    f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n"
                    f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


def run_mpi_leaving(n: int, args: list[str], outdir: Path, *, env: dict | None = None,
                    timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """``mpiexec -disable-auto-cleanup -n n python ARGS OUTDIR``, for cases in which a rank
    leaves (exits, dies) while the others go on: hydra then takes no one down for it, and
    each rank that stays writes its record into a file of ``OUTDIR`` (output printed late
    may be lost with the job).  Returns the process and {file name: text}.  Skips where
    the launcher is not hydra."""
    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup; this launcher is not hydra")
    e = dict(os.environ, GPURT_TIMEOUT="60")
    e.update(env or {})
    proc = subprocess.run([*mpiexec(), "-disable-auto-cleanup", "-n", str(n), sys.executable,
                           *args, str(outdir)], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)
    return proc, {f.name: f.read_text() for f in outdir.iterdir()}


def rank_records(out: str, prefix: str, ranks: int) -> dict[int, dict]:
    """The JSON record each rank printed after ``prefix`` (``PREFIX {json}``), by its
    "rank"; asserts every one of ``ranks`` printed one."""
    import json
    recs = {}
    dec = json.JSONDecoder()
    # (mpiexec forwards each rank's output as it comes: two ranks printing at once can
    # land on one line, one record right after the other, the newlines after both)
    for piece in out.split(prefix + " ")[1:]:
        if not piece.startswith("{"):
            continue        # (the print in a traceback's source line)
        rec = dec.raw_decode(piece)[0]
        recs[rec["rank"]] = rec
    assert sorted(recs) == list(range(ranks)), out
    return recs


def gpurt_shm_files() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("gpurt-"))


def assert_cannot_start(proc, exe: str, nranks: int) -> None:
    """``proc`` (gpurt bench or tune run with GPURT_MPIEXEC=``exe``, which does not exist)
    said so in one line, as `gpurt launch` does, and exited 1."""
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith(f"Error: cannot start {exe} -n {nranks} "), proc.stderr
    assert proc.stderr.endswith(f": [Errno 2] No such file or directory: '{exe}'\n") and \
        proc.stderr.count("\n") == 1, proc.stderr


def private_shm(tmp_path: Path) -> Path | None:
    """A directory to bind over /dev/shm in a private mount namespace (``unshare -m``), so
    that what a job leaves there is told apart from other jobs' segments on this machine;
    None where that cannot be done (not root, no unshare)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "mount", "--bind", str(tmp_path), "/dev/shm"],
            capture_output=True).returncode != 0:
        return None
    shm = tmp_path / "shm"
    shm.mkdir()
    return shm


@functools.lru_cache(maxsize=None)
def is_hydra() -> bool:
    """Is the launcher MPICH's hydra (whose flags some tests use)?"""
    try:
        out = subprocess.run([*mpiexec(), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in out.upper()


def remove_leaked_mpich_segments(before: set[str]) -> list[str]:
    """MPICH leaks its own ``mpich_shm_*`` segments when ranks are killed (FIELD-NOTES),
    Open MPI its ``sm_segment.*`` ones; gpurt's never leak.  Remove those that appeared
    since ``before`` and that no live process maps any more — never a segment some
    running job still uses (``gpurt launch``'s own removal: launcher._remove_segments)."""
    from gpurt.launch.launcher import _remove_segments

    return _remove_segments(set(os.listdir("/dev/shm")) - before)


@pytest.fixture(scope="session", autouse=True)
def _no_mpich_garbage_left():
    """The failure tests kill ranks on purpose; leave the machine's /dev/shm as found."""
    before = set(os.listdir("/dev/shm"))
    yield
    remove_leaked_mpich_segments(before)


# (a child's prelude for the tests of a signal that comes while a launcher starts: the
# window is microseconds wide, so Popen itself sends it, right after the fork)
SIGNAL_AFTER_POPEN = """
import os, signal, subprocess, sys, time
real = subprocess.Popen
def popen(*a, **k):
    p = real(*a, **k)
    os.kill(os.getpid(), signal.SIGTERM)
    return p
subprocess.Popen = popen
"""
