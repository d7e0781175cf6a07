"""Run under ``mpiexec -disable-auto-cleanup -n 3``: rank 2 leaves without a word
(os._exit, as a kill would end it) after a first allreduce; ranks 0 and 1 meet
PeerFailure in the next one, catch it and end *normally*.  Each writes ``caught<r>``
once it has caught it and ``atexit<r>`` from its own exit handler (registered after
gpurt's, so it runs first).  Before, their MPI_Finalize waited for rank 2 for ever."""

import atexit
import os
import sys
import time

import numpy as np

import gpurt

outdir = sys.argv[1]
c = gpurt.init()
c.allreduce(np.ones(4, np.float32))
if c.rank == 2:
    time.sleep(0.3)
    os._exit(3)
try:
    c.allreduce(np.ones(4, np.float32), timeout=30)
except gpurt.PeerFailure as e:
    with open(os.path.join(outdir, f"caught{c.rank}"), "w") as f:
        f.write(f"{e.rank} {e}")
atexit.register(lambda: open(os.path.join(outdir, f"atexit{c.rank}"), "w").close())
