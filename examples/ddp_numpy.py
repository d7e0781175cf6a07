"""Data-parallel training of a small NumPy MLP, gradients averaged with gpurt.

    gpurt launch -n 4 examples/ddp_numpy.py [--steps 150] [--lr 0.1] [--bucket-kib 16]
    mpiexec -n 4 python examples/ddp_numpy.py

What it shows (the pattern of PyTorch's DistributedDataParallel, in NumPy):

* every rank holds the same model (rank 0's initial parameters are broadcast) and its own
  shard of a synthetic regression data set (a fixed "teacher" network plus noise);
* the backward pass produces gradients last layer first; they are copied into a few flat
  *buckets* (``--bucket-kib`` each, parameters in backward order), and each bucket is
  ``iallreduce``-d with ``op=gpurt.AVG`` as soon as its last gradient is ready, while the
  backward pass goes on; the update waits for all buckets;
* rank 0 prints the loss averaged over all ranks' shards (it decreases);
* at the end every rank hashes its parameters, the hashes are allgathered, and the program
  exits non-zero unless they are bitwise identical everywhere;
* rank 0 then replays the training on one process with the combined batch and exits
  non-zero unless the loss curves match (relative difference < 1e-3: float32 rounding).

gpurt progresses requests only inside gpurt calls (no background thread), so the
backward pass calls ``Reducer.poke()`` (a non-blocking ``test()``) between layers to move
the buckets already posted along.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

# One BLAS thread per rank (as torchrun does): N ranks x all-cores BLAS pools oversubscribe
# the CPUs and make this ~30x slower.  Must be set before NumPy is imported.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

import gpurt  # noqa: E402


class Reducer:
    """Averages gradients over ranks in buckets, each posted as soon as it is complete."""

    def __init__(self, comm: gpurt.Communicator, params: list[np.ndarray], bucket_bytes: int):
        self.comm = comm
        self.where: dict[int, tuple[int, int]] = {}   # param index -> (bucket, offset)
        sizes: list[list[int]] = [[]]
        for i in reversed(range(len(params))):       # backward order: last layer first
            cur = sizes[-1]
            used = sum(params[j].size for j in cur)
            if cur and (used + params[i].size) * params[i].itemsize > bucket_bytes:
                sizes.append(cur := [])
                used = 0
            self.where[i] = (len(sizes) - 1, used)
            cur.append(i)
        self.members = sizes
        dtype = params[0].dtype
        self.buffers = [np.empty(sum(params[j].size for j in b), dtype) for b in sizes]
        self.shapes = [p.shape for p in params]
        self.reset()

    def reset(self) -> None:
        self.missing = [len(b) for b in self.members]
        self.requests: list[gpurt.Request | None] = [None] * len(self.members)

    def ready(self, i: int, grad: np.ndarray) -> None:
        """The gradient of parameter ``i`` is final: copy it in; post its bucket if full."""
        b, off = self.where[i]
        self.buffers[b][off:off + grad.size] = grad.ravel()
        self.missing[b] -= 1
        if self.missing[b] == 0:
            self.requests[b] = self.comm.iallreduce(self.buffers[b], op=gpurt.AVG)

    def poke(self) -> None:
        """Let gpurt progress the buckets in flight (non-blocking)."""
        for r in self.requests:
            if r is not None:
                r.test()
                return

    def wait(self) -> list[np.ndarray]:
        """Wait for every bucket; the averaged gradients, in parameter order (views)."""
        for r in self.requests:
            assert r is not None, "a parameter's gradient was never marked ready"
            r.wait(timeout=60)
        out = []
        for i, shape in enumerate(self.shapes):
            b, off = self.where[i]
            n = int(np.prod(shape))
            out.append(self.buffers[b][off:off + n].reshape(shape))
        self.reset()
        return out


def make_data(rank: int, n: int, d: int, rng_seed: int = 1234):
    """This rank's shard: inputs from its own stream, targets from a shared teacher."""
    teacher = np.random.default_rng(rng_seed)
    w1 = teacher.standard_normal((d, 16)) / np.sqrt(d)
    w2 = teacher.standard_normal((16, 1)) / 4
    rng = np.random.default_rng(rng_seed + 1 + rank)
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (np.tanh(x @ w1) @ w2 + 0.01 * rng.standard_normal((n, 1))).astype(np.float32)
    return x, y


def init_params(d: int, h: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
            np.zeros(h, np.float32),
            (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32),
            np.zeros(h, np.float32),
            (rng.standard_normal((h, 1)) / np.sqrt(h)).astype(np.float32),
            np.zeros(1, np.float32)]


def step(params, x, y, reducer: Reducer) -> float:
    """Forward, backward (gradients handed to the reducer as they are ready); local loss."""
    w1, b1, w2, b2, w3, b3 = params
    n = x.shape[0]
    z1 = x @ w1 + b1
    a1 = np.tanh(z1)
    z2 = a1 @ w2 + b2
    a2 = np.tanh(z2)
    out = a2 @ w3 + b3
    diff = out - y
    loss = float(np.mean(diff * diff))
    g = (2.0 / n) * diff                          # dL/dout
    reducer.ready(5, g.sum(0))                    # b3
    reducer.ready(4, a2.T @ g)                    # w3
    g = (g @ w3.T) * (1 - a2 * a2)
    reducer.poke()
    reducer.ready(3, g.sum(0))                    # b2
    reducer.ready(2, a1.T @ g)                    # w2
    g = (g @ w2.T) * (1 - a1 * a1)
    reducer.poke()
    reducer.ready(1, g.sum(0))                    # b1
    reducer.ready(0, x.T @ g)                     # w1
    return loss


class LocalGrads:
    """The reducer interface for one process: keeps the gradients as they come."""

    def __init__(self, n: int):
        self.grads: list = [None] * n

    def ready(self, i: int, grad: np.ndarray) -> None:
        self.grads[i] = grad

    def poke(self) -> None:
        pass


def serial_losses(args, nranks: int, d: int, record: list[int]) -> dict[int, float]:
    """The same training on one process with the combined batch (every rank's minibatch
    of every step, concatenated): data-parallel SGD with averaged gradients must follow
    the same loss curve, up to float32 rounding."""
    shards = [make_data(r, args.batch * 4, d) for r in range(nranks)]
    rngs = [np.random.default_rng(99 + r) for r in range(nranks)]
    params = init_params(d, args.hidden, args.seed)      # rank 0's, as broadcast
    out = {}
    for it in range(args.steps):
        idx = [rng.choice(args.batch * 4, args.batch, replace=False) for rng in rngs]
        xb = np.concatenate([sx[i] for (sx, _), i in zip(shards, idx)])
        yb = np.concatenate([sy[i] for (_, sy), i in zip(shards, idx)])
        g = LocalGrads(len(params))
        loss = step(params, xb, yb, g)
        for p, grad in zip(params, g.grads):
            p -= args.lr * grad.reshape(p.shape)
        if it in record:
            out[it] = loss
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--bucket-kib", type=float, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check-serial", dest="check_serial", action="store_false",
                    help="skip replaying the training on one process to compare loss curves")
    args = ap.parse_args()

    comm = gpurt.init()
    d = 32
    x, y = make_data(comm.rank, args.batch * 4, d)
    params = init_params(d, args.hidden, args.seed + comm.rank)   # deliberately different...
    for p in params:                                              # ...until rank 0's win
        comm.broadcast(p, root=0)
    reducer = Reducer(comm, params, int(args.bucket_kib * 1024))
    if comm.rank == 0:
        print(f"{comm.size} ranks, {sum(p.size for p in params)} parameters in "
              f"{len(reducer.members)} buckets, {args.steps} steps", flush=True)

    rng = np.random.default_rng(99 + comm.rank)
    loss_buf = np.zeros(1, np.float64)
    first = last = None
    curve: dict[int, float] = {}
    t0 = time.perf_counter()
    for it in range(args.steps):
        idx = rng.choice(x.shape[0], args.batch, replace=False)
        loss = step(params, x[idx], y[idx], reducer)
        grads = reducer.wait()
        for p, g in zip(params, grads):
            p -= args.lr * g
        if it == 0 or it == args.steps - 1 or it % 25 == 0:
            loss_buf[0] = loss
            comm.allreduce(loss_buf, op=gpurt.AVG)
            last = float(loss_buf[0])
            first = last if first is None else first
            curve[it] = last
            if comm.rank == 0:
                print(f"step {it:4d}  loss {last:.6f}", flush=True)
    elapsed = time.perf_counter() - t0

    digest = hashlib.sha256(b"".join(p.tobytes() for p in params)).digest()
    mine = np.frombuffer(digest[:8], np.uint64).copy()
    every = comm.allgather(mine).ravel()
    identical = bool(np.all(every == every[0]))
    if comm.rank == 0:
        print(f"initial loss {first:.6f}  final loss {last:.6f}  ({elapsed:.2f} s)")
        if identical:
            print(f"parameters bitwise identical on all {comm.size} ranks "
                  f"(sha256 {digest[:8].hex()})")
        else:
            print("parameters DIFFER between ranks: " +
                  ", ".join(f"rank {r}: {int(h):016x}" for r, h in enumerate(every)))
    matches = True
    if comm.rank == 0 and args.check_serial:
        ref = serial_losses(args, comm.size, d, sorted(curve))
        worst = max(abs(curve[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in curve)
        matches = worst < 1e-3
        print(f"one process, combined batch: final loss {ref[max(ref)]:.6f}; loss curves "
              f"{'match' if matches else 'DIFFER'} (largest relative difference "
              f"{worst:.1e} over {len(curve)} points)")
    matches = bool(comm.mpi.bcast(matches, 0))
    ok = identical and last < first and matches
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
