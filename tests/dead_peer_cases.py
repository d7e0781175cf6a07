"""Run under ``mpiexec -disable-auto-cleanup -n 3``: what survivors know of a local peer
that left, across communicators.  Each of ranks 0 and 1 writes ``rank<r>`` (one JSON
record) into the folder given.

    exit <dir>   rank 2 leaves without a word (os._exit) once a dup ``d`` exists; ranks 0
                 and 1 meet PeerFailure on ``c``, then rank 0 sends 16 floats to rank 2 on
                 ``d`` — which fits in the shm ring and would "complete", the data lost.
    fresh <dir>  the same send, with no failed call before it (nothing known yet).
    closed <dir> rank 2 only closes ``d`` (and stays until rank 0 has reported): the
                 send on ``d`` is as lost as to an exited peer.
    stop <dir>   rank 2 stops itself (SIGSTOP; GPURT_PEER_STOPPED=2 expected): ranks 0 and
                 1 meet PeerFailure on ``c`` after the bound, then on ``d`` at once — the
                 bound runs from when this process first saw it stopped, not once per
                 communicator.  Rank 0 SIGKILLs rank 2 at the end.

In exit and stop, ranks 0 and 1 then split one more dup and dup another: PeerFailure at
once (stop over tcp: after the bound), not a wait in MPI for ever (or until the stopped
rank wakes).

Records: {"rank", "c": outcome, "c_s": seconds, "d": outcome, "d_s": seconds, and in
exit and stop "split", "split_s", "dup", "dup_s"}."""

import json
import os
import signal
import sys
import time

import numpy as np

import gpurt

mode, outdir = sys.argv[1], sys.argv[2]
c = gpurt.init()
d = c.dup()
e, f = c.dup(), c.dup()     # exit, stop: their split and dup come after the failure
x = np.ones(16, np.float32)
c.allreduce(x)
d.allreduce(x)
if c.rank == 2 and mode == "closed":
    d.close()
    with open(os.path.join(outdir, "closed2"), "w"):
        pass
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(outdir, "rank0")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
if c.rank == 2:
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(3)


def attempt(fn):
    t = time.monotonic()
    try:
        fn()
        out = "completed"
    except gpurt.PeerFailure as e:
        out = f"PeerFailure(rank={e.rank}): {e}"
    except Exception as e:  # noqa: BLE001 - the record says what it was
        out = f"{type(e).__name__}: {e}"
    return out, time.monotonic() - t


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


rec = {"rank": c.rank}
if mode in ("fresh", "closed"):
    # until rank 2 has exited (closed d): seen, not assumed after a fixed second
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            os.path.exists(os.path.join(outdir, "closed2")) if mode == "closed"
            else gone(c.pids[2])):
        time.sleep(0.01)
    time.sleep(0.3)      # (its sockets' ends delivered, as after the second it used to be)
else:
    rec["c"], rec["c_s"] = attempt(lambda: c.allreduce(x, timeout=30))
if mode == "stop":
    rec["d"], rec["d_s"] = attempt(lambda: d.allreduce(x, timeout=30))
elif c.rank == 0:
    rec["d"], rec["d_s"] = attempt(lambda: d.send(np.ones(16, np.float32), 2, timeout=5))
if mode in ("exit", "stop"):
    # a split and a dup wait in MPI for every rank to come: one known to be gone or
    # stopped is PeerFailure at once (before: the call waited for ever, or until the
    # stopped rank woke up).  (Over tcp a stopped peer is known only to pings, each
    # communicator's own: the split's watch pings it and fails it after the bound)
    rec["split"], rec["split_s"] = attempt(lambda: e.split(0))
    rec["dup"], rec["dup_s"] = attempt(lambda: f.dup())
with open(os.path.join(outdir, f"rank{c.rank}"), "w") as out:
    json.dump(rec, out)
if mode == "stop" and c.rank == 0:
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(outdir, "rank1")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(c.pids[2], signal.SIGKILL)
os._exit(0)
