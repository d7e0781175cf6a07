"""Run under ``mpiexec -n N``: communicators made and closed (init, split, dup), each with
its own shared-memory segment, and exact results on each; rank r prints "r ok"."""

import numpy as np

import gpurt

c = gpurt.init()
p = c.size
t = p * (p + 1) / 2
ok = True
for _ in range(3):
    x = np.full(1000, c.rank + 1.0)
    c.allreduce(x)
    y = c.allreduce(np.full(3 << 18, c.rank + 1.0, np.float32), algo="ring")
    d = c.split(c.rank % 2)
    z = d.allreduce(np.ones(5))
    e = c.dup()
    w = e.allgather(np.array([c.rank]))
    ok &= bool((x == t).all() and (y == t).all() and (z == d.size).all()
               and (w.ravel() == np.arange(p)).all())
    d.close()
    e.close()
print(f"{c.rank} {'ok' if ok else 'BAD'}", flush=True)   # (one write)
c.close()
