"""Run under ``mpiexec -disable-auto-cleanup -n N``: a communicator's creation
(``gpurt.init()``, ``gpurt.Communicator(mpi_comm)``) whose ranks do not all come.

    python tests/init_wait_cases.py MODE DIR

MODE (with GPURT_INIT_TIMEOUT=1 unless said):
``late``   the last rank calls ``gpurt.init()`` 2.5 s after the others: they raise
           CollectiveTimeout at their deadline; the late rank PeerFailure(rank=0) at once.
``raise``  (GPURT_INIT_TIMEOUT=20) rank 0's wait is left by an exception (a SIGALRM handler's,
           0.3 s in) while the last rank is 1.5 s late: every other rank raises
           PeerFailure(rank=0) — the on-time ones when the late rank comes.
``ontime`` (GPURT_INIT_TIMEOUT=5) the last rank is 0.5 s late: made on every rank.
``wrap``   ``gpurt.Communicator(c)`` over MPI_COMM_WORLD split in even and odd ranks; the
           even ranks' last is 2.5 s late: the even ranks fail as in ``late`` (the lowest
           even rank gave up), the odd ones make theirs.
``never``  the last rank never calls it (it ends normally after 3 s): the others raise
           CollectiveTimeout at their deadline and end normally.
``stuck``  (GPURT_PEER_STOPPED=2) as ``never``, but the last rank stays away (it comes to
           nothing, MPI_Finalize included, until the others have exited): they catch
           the CollectiveTimeout and end normally, and their MPI_Finalize, which waited
           for it for ever, leaves after 2 s (status 1, saying why).  The last rank
           records when it saw them gone, then leaves without MPI_Finalize.
Before, every such wait stayed in MPI for ever (or, for a late rank, in the blocking
exchanges after the barrier).  Except in ``never`` and ``stuck``, every rank then makes a communicator
over MPI_COMM_WORLD again, all on time, and runs an allreduce (the failed creation left
nothing behind).  Each rank writes ``rank<r>``: one JSON record {"rank", "outcome",
"blamed", "seconds", "again"}."""

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import gpurt

mode, outdir = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
r, n = world.Get_rank(), world.Get_size()


class Interrupted(Exception):
    pass


def alarm(*_):
    raise Interrupted("rank 0's alarm went off in the wait")


def gone_or_zombie(pid: int) -> bool:
    """(hydra's proxy reaps an exited rank only later, with -disable-auto-cleanup)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


mpi_comm, late = world, n - 1
if mode == "wrap":
    mpi_comm = world.Split(r % 2, r)
    late = max(k for k in range(n) if k % 2 == r % 2) if r % 2 == 0 else -1
if r == late and mode not in ("never", "stuck"):
    time.sleep({"late": 2.5, "wrap": 2.5, "raise": 1.5, "ontime": 0.5}[mode])
if mode == "raise" and r == 0:
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.3)

rec = {"rank": r}
if mode == "never" and r == late:
    time.sleep(3)
    rec["outcome"] = "never came"
elif mode == "stuck" and r == late:
    t = time.monotonic()
    pids, left = {}, 30.0
    while time.monotonic() - t < left:
        for k in range(n - 1):
            if k not in pids and os.path.exists(os.path.join(outdir, f"rank{k}")):
                with open(os.path.join(outdir, f"rank{k}")) as f:
                    pids[k] = json.load(f)["pid"]
        gone = [k for k, pid in pids.items() if gone_or_zombie(pid)]
        if len(gone) == n - 1:
            break
        time.sleep(0.05)
    rec["outcome"] = f"saw {len(gone)} ranks gone"
    rec["seconds"] = time.monotonic() - t
    with open(os.path.join(outdir, f"rank{r}"), "w") as f:
        json.dump(rec, f)
    os._exit(0)
else:
    t = time.monotonic()
    try:
        c = gpurt.init() if mpi_comm is world else gpurt.Communicator(mpi_comm)
        rec["outcome"] = f"made: {c.size} ranks"
        got = c.allreduce(np.full(3, c.rank + 1, np.int64))
        rec["outcome"] += f", allreduce {got.tolist()}"
        c.close()
    except Exception as e:  # noqa: BLE001 - the record says what it was
        rec["outcome"] = f"{type(e).__name__}: {e}"
        rec["blamed"] = getattr(e, "rank", None)
    rec["seconds"] = time.monotonic() - t
    rec["pid"] = os.getpid()
    if mode not in ("never", "stuck"):
        world.Barrier()     # (MPI's own: the late rank is here too)
        c = gpurt.init()
        rec["again"] = c.allreduce(np.full(2, r, np.int64)).tolist()
        c.close()
with open(os.path.join(outdir, f"rank{r}"), "w") as f:
    json.dump(rec, f)
