"""What a job pays before its first collective: launch N ranks that import gpurt, create
the communicator and close it, against the same launch with only mpi4py (the floor).

    python benchmarks/startup.py [ranks=3] [rounds=5]

Variants, alternating round by round (the order turning every round), wall time of the
whole ``mpiexec`` launch, median per variant:

* ``gpurt``: ``import gpurt; gpurt.init().close()`` as it is now;
* ``gpurt+ml_dtypes``: the same with ``ml_dtypes`` imported first — what every rank paid
  before gpurt imported it only for bfloat16 arrays (1.3 s of CPU with ml_dtypes 0.7);
* ``gpurt, no bytecode``: the same with gpurt's bytecode out of the way (its
  ``__pycache__`` folders moved aside for that launch, ``PYTHONDONTWRITEBYTECODE=1``): an
  editable install where nothing writes bytecode compiles every module in every rank;
* ``gpurt, rings unbounded``: the same with ``GPURT_SHM_RING_MEM=0``: every pair of local
  ranks gets the full rings (256 KiB x 12 slots), as before the per-rank bound — the
  segment local rank 0 creates and reserves grows with the square of the ranks (3 GiB
  for 32), which shows from about 16 ranks on;
* ``mpi4py``: ``from mpi4py import MPI`` and MPI_Init only.

Prints one line per variant: median seconds, its ratio to ``gpurt``, and the median of
``gpurt.init()`` alone (from a barrier to the slowest rank's return).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# gpurt.init() alone is timed too: from a barrier to the slowest rank's return
_INIT = ("import gpurt, time; from mpi4py import MPI; w = MPI.COMM_WORLD; w.Barrier(); "
         "t = time.perf_counter(); c = gpurt.init(); "
         "t = w.allreduce(time.perf_counter() - t, op=MPI.MAX); c.close(); "
         "w.rank == 0 and print('INIT', t)")
CODE = {
    "gpurt": _INIT,
    "gpurt+ml_dtypes": "import ml_dtypes; " + _INIT,
    "gpurt, no bytecode": _INIT,
    "gpurt, rings unbounded": _INIT,
    "mpi4py": "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()",
}
CACHES = [ROOT / d / "__pycache__" for d in ("gpurt", "transports", "launch")] + \
    [p / "__pycache__" for p in (ROOT / "gpurt").iterdir() if p.is_dir() and
     (p / "__init__.py").exists()]


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


def launch(n: int, variant: str) -> tuple[float, float | None]:
    """(wall seconds of the launch, gpurt.init() seconds or None)."""
    env = dict(os.environ)
    aside = []
    if variant == "gpurt, rings unbounded":
        env["GPURT_SHM_RING_MEM"] = "0"
    if variant == "gpurt, no bytecode":
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        tmp = Path(tempfile.mkdtemp(prefix="gpurt-startup-"))
        for i, c in enumerate(CACHES):
            if c.exists():
                aside.append((c, tmp / str(i)))
                c.rename(tmp / str(i))
    try:
        t = time.perf_counter()
        out = subprocess.run([mpiexec(), "-n", str(n), sys.executable, "-c", CODE[variant]],
                             cwd=ROOT, env=env, check=True, capture_output=True,
                             text=True).stdout
        wall = time.perf_counter() - t
        init = [float(w.split()[1]) for w in out.splitlines() if w.startswith("INIT ")]
        return wall, (init[0] if init else None)
    finally:
        for c, moved in aside:
            moved.rename(c)
        if aside:
            shutil.rmtree(aside[0][1].parent, ignore_errors=True)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    names = list(CODE)
    import compileall           # gpurt's bytecode, as a regular (non-editable) install has it
    for d in ("gpurt", "transports", "launch"):
        compileall.compile_dir(str(ROOT / d), quiet=2)
    launch(n, "gpurt")          # the page cache warm
    times: dict[str, list[float]] = {v: [] for v in names}
    inits: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for v in order:
            wall, init = launch(n, v)
            times[v].append(wall)
            if init is not None:
                inits[v].append(init)
    base = statistics.median(times["gpurt"])
    print(f"{n} ranks, {rounds} rounds, median wall time of the launch (and of gpurt.init(), "
          f"the slowest rank):")
    for v in names:
        m = statistics.median(times[v])
        init = f"   init {statistics.median(inits[v]):5.2f} s" if inits[v] else ""
        print(f"  {v:24s} {m:6.2f} s   {m / base:5.2f} x gpurt{init}   "
              f"(all: {', '.join(f'{t:.2f}' for t in times[v])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
