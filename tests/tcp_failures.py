"""Run under ``mpiexec -disable-auto-cleanup -n 3`` with ``GPURT_TRANSPORTS=tcp`` (driven by
tests/test_tcp.py; the launcher must not kill the survivors for us — hydra's proxy still
SIGKILLs the whole job within milliseconds when one of *its* children dies of a signal,
so the driver runs each rank under ``sh -c 'trap true USR1; python ...'``):

    python tests/tcp_failures.py kill|raise OUTDIR

Each rank writes ``OUTDIR/pidR`` (its pid) once running and ``OUTDIR/rankR`` (one line:
what happened) at the end, with wall-clock times so the driver can measure.

* ``kill``: allreduces of 4 MiB in a loop (``direct``: every rank waits on every other, so
  every survivor talks to the victim); the driver SIGKILLs rank 2 mid-loop.
* ``raise``: rank 1 raises ValueError, unhandled (the excepthook publishes it, unless
  GPURT_EXCEPTHOOK=0).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import gpurt


def main() -> None:
    mode, outdir = sys.argv[1], sys.argv[2]
    c = gpurt.init()

    def report(text: str) -> None:
        with open(os.path.join(outdir, f"rank{c.rank}.tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(outdir, f"rank{c.rank}.tmp"), os.path.join(outdir, f"rank{c.rank}"))

    def linger() -> None:
        # stay connected until the other survivors have reported too, so none of them
        # sees this rank leave before it has seen the victim fail
        deadline = time.monotonic() + 15
        others = [q for q in range(c.size) if q != c.rank and q != victim]
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(outdir, f"rank{q}")) for q in others):
            time.sleep(0.05)

    x = np.ones(1 << 20 if mode == "kill" else 10, np.float32)
    c.allreduce(x, algo="direct")
    with open(os.path.join(outdir, f"pid{c.rank}"), "w") as f:
        f.write(str(os.getpid()))
    victim = 2 if mode == "kill" else 1
    if mode == "raise" and c.rank == 1:
        time.sleep(0.5)
        raise ValueError("bad batch 17")          # unhandled
    t = time.monotonic()
    try:
        while True:
            x[:] = 1
            c.allreduce(x, algo="direct", timeout=30)
            t = time.monotonic()
            if mode == "raise":
                break
        report("no error")
    except gpurt.GpurtError as e:
        report(f"{type(e).__name__} rank={getattr(e, 'rank', None)} at={time.time():.3f} "
               f"after={time.monotonic() - t:.3f}: {e}")
        linger()
    if mode == "raise":
        sys.exit(0)     # MPI_Finalize together with rank 1, which is finalizing too
    os._exit(0)         # MPI_Finalize would wait for the killed rank


if __name__ == "__main__":
    main()
