"""A forked child of a rank (a DataLoader worker, a plain ``os.fork()``) must not touch
its parent's communicator: ``mpiexec -n 2 python tests/fork_cases.py MODE OUTDIR``.

Rank 0 forks after its first collective.  The child:

- ``use``: calls ``allreduce`` on the inherited communicator — it must raise
  ``CommunicatorClosed`` (the communicator is the parent's), not speak for rank 0;
- ``ends``: goes through every ending a child may have — an unhandled exception's hook
  (``sys.excepthook``), ``abort()``, ``close()``, gpurt's exit handler — none of which may
  tell rank 0's peers anything or release what the parent uses.

It leaves with ``os._exit`` (an MPI program's child must not run MPI_Finalize: that is
MPI's rule, not gpurt's).  Then both ranks run small and large allreduces, exact results,
and each writes ``OUTDIR/rankN`` (and the child ``OUTDIR/child``): "ok", or the error.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpurt  # noqa: E402
from gpurt import comm as gcomm  # noqa: E402


def child(c, mode: str, outdir: str) -> None:
    text = "?"
    try:
        if mode == "use":
            try:
                c.allreduce(np.ones(16, np.float32))
                text = "allreduce ran in the child"
            except gpurt.CommunicatorClosed as e:
                text = f"CommunicatorClosed: {e}"
        else:
            try:
                raise RuntimeError("the worker failed")
            except RuntimeError:
                sys.excepthook(*sys.exc_info())     # what an unhandled one would run
            c.abort("the worker aborts")
            c.close()
            gcomm._close_all()                       # gpurt's exit handler
            text = "ended"
    finally:
        with open(os.path.join(outdir, "child"), "w") as f:
            f.write(text)
        os._exit(0)


def main() -> int:
    mode, outdir = sys.argv[1], sys.argv[2]
    c = gpurt.init()
    c.allreduce(np.ones(1024, np.float32))
    if c.rank == 0:
        pid = os.fork()
        if pid == 0:
            child(c, mode, outdir)
        os.waitpid(pid, 0)
    time.sleep(0.3)
    text = "ok"
    try:
        want = c.size * (c.size + 1) / 2
        for n in (1024, 1 << 20):
            for _ in range(3):
                y = c.allreduce(np.full(n, c.rank + 1, np.float32))
                if not (y == want).all():
                    text = f"wrong result at {n}"
    except Exception as e:  # noqa: BLE001 - reported
        text = f"{type(e).__name__}: {e}"
    with open(os.path.join(outdir, f"rank{c.rank}"), "w") as f:
        f.write(text)
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
