"""Run by every rank of a communicator on several "nodes" (MPICH cliques) with several
ranks on a node, where the agreement check gathers the calls' headers hierarchically
(inside each node, then one message per other node): on more than 8 ranks headers only
(``gpurt.comm._agreement_schedule_hier``), on up to 8 with the folded calls' data inside
(``gpurt.comm._HierFold``):

* every collective exact, blocking and not, rooted at the last rank too;
* a call whose count differs on rank 3, and one that rank 2 rejects as bad input (a
  read-only output), each on a duplicate (a mismatch ends a communicator): every rank
  raises (``CollectiveMismatchError`` naming the rank; the rejecting rank its own
  ``ValueError``), at once, the rejecting rank then idle in an MPI barrier;
* a call that rank ``ABSENT`` never makes, on a duplicate: the ranks of its node name
  exactly it when they time out; the other nodes' ranks name ranks of its node, it
  among them (their headers come in one message from that node).

    MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n 10 python tests/agreement_cases.py ABSENT

Each rank prints ``AGREE {json}``.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import gpurt
from gpurt.comm import _hier_agreement, _hier_fold

c = gpurt.init()
p, r = c.size, c.rank
absent = int(sys.argv[1])
rec = {"rank": r, "node": c.node, "nodes": [list(rs) for rs in c.topo.local_ranks],
       "hier": _hier_agreement(c.topo), "hier_fold": _hier_fold(c.topo)}
checks = 0
for n in (1, 1000, 300_000):
    x = np.full(n, r + 1, np.float64)
    c.allreduce(x)
    assert (x == p * (p + 1) / 2).all()
    req = c.iallgather(np.full(n, r, np.int32))
    g = req.wait()
    assert (g == np.arange(p, dtype=np.int32)[:, None]).all()
    y = c.broadcast(np.full(n, r, np.int32), root=p - 1)
    assert (y == p - 1).all()
    z = c.reduce_scatter(np.tile(np.arange(p, dtype=np.int64), n).reshape(n, p).T.copy()
                         .reshape(-1))
    assert (z == p * r).all()
    w = c.alltoall(np.repeat(np.arange(p, dtype=np.int16) * 100 + r, n))
    assert (w == np.repeat(r * 100 + np.arange(p, dtype=np.int16), n)).all()
    checks += 5
# a mismatch on rank 3: every rank raises, naming it
d = c.dup()
try:
    d.allreduce(np.ones(3000 if r == 3 else 3001, np.float32))
    rec["mismatch"] = "no error"
except gpurt.CollectiveMismatchError as e:
    # every rank names the other side's call exactly (up to 8 ranks the calls fold, and
    # rank 3's rows have another stride than the others': the headers come again)
    rec["mismatch"] = ("rank 3 called allreduce(float32, count=3000" in str(e)) if r != 3 \
        else ("but rank 0 called allreduce(float32, count=3001" in str(e))
    if not rec["mismatch"]:
        rec["mismatch_text"] = str(e)
# bad input on rank 2 (a read-only output): its ValueError, the others' mismatch
out = np.zeros(4, np.float32)
if r == 2:
    out.flags.writeable = False
d = c.dup()
t0 = time.monotonic()
try:
    d.allreduce(np.ones(4, np.float32), out)
    rec["rejected"] = "no error"
except ValueError:
    rec["rejected"] = r == 2
except gpurt.CollectiveMismatchError as e:
    rec["rejected"] = r != 2 and "rank 2" in str(e)
rec["rejected_s"] = time.monotonic() - t0
# (the rejecting rank then does no gpurt call: it relays its node's headers to the other
# nodes' ranks, which waited for them until their deadline when it returned at once)
c.mpi.Barrier()
# the communicator they were duplicated from goes on
x = np.ones(5, np.float32)
c.allreduce(x)
assert (x == p).all()
checks += 1
# rank ABSENT does not call: who names whom
d = c.dup()
if r != absent:
    try:
        d.allreduce(np.ones(1000, np.float32), timeout=3)
        rec["missing"] = "no error"
    except gpurt.CollectiveTimeout as e:
        rec["missing"] = list(e.missing)
    except gpurt.PeerFailure as e:     # (a peer's timeout came first: it names one too)
        rec["missing"] = "relayed: " + str(e)
c.mpi.Barrier()
rec["checks"] = checks
print("AGREE " + json.dumps(rec), flush=True)
