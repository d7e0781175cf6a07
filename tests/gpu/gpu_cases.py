"""Run by every rank under ``mpiexec -n K`` (all ranks may share one GPU): gpurt's public API
on CUDA device arrays, exact checks.

    mpiexec -n 4 python tests/gpu/gpu_cases.py [collectives] [nonblocking] [streams] [p2p]
                                               [ipc] [all]

* ``collectives``: every collective x dtype (int32, int64, float16, float32, float64,
  complex64 as CuPy arrays and torch CUDA tensors; bfloat16 as torch.bfloat16 tensors)
  x every op the dtype allows, with ``out=None`` (in place, or a result allocated on the
  same device and of the same type) and with ``out=`` given; one large float32 case;
* ``nonblocking``: the i-variants return Requests whose ``wait()`` returns the result,
  several in flight at once;
* ``streams``: inputs produced on a non-default (non-blocking) stream behind a 20 ms
  sleep kernel, reduced with ``stream=s.ptr``, with ``s`` current (``with s:``), with
  ``iallreduce(stream=...)`` and with a torch stream object (``.cuda_stream``); checked
  after ``s.synchronize()`` — a call that did not order itself on ``s`` reads stale data;
* ``p2p``: send/recv and isend/irecv around a ring;
* ``ipc``: the CUDA backend itself across two processes (IPC memory and event handles,
  base + offset views, event waits and queries), without the collectives.

Inputs are small integers, so every reduction order gives the same exact result (AVG inputs
are chosen so that the sum divides by the rank count).  The first failure stops every rank
(they agree after each case over MPI_COMM_WORLD); rank 0 prints one line per rank —
``rank R: N checks passed`` or ``rank R: FAILED ...`` naming the collective, array kind,
dtype and op — so hydra cannot interleave them.  Exit status 1 on any failure.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import gpurt
from gpurt.ops import _ALLOWED, BFLOAT16, Op

import cupy

try:
    import torch
except ImportError:   # torch cases are then skipped (and said so)
    torch = None

WORLD = MPI.COMM_WORLD
SIZES = (1, 4099)
BIG = (1 << 22) + 3            # float32 elements: 16 MiB, not a round number
SENTINEL = 101                 # exact in every tested dtype, never a result
OPS = (Op.SUM, Op.PROD, Op.MIN, Op.MAX, Op.AVG, Op.BAND, Op.BOR, Op.BXOR)
DTYPES = [np.dtype(t) for t in ("int32", "int64", "float16", "float32", "float64")] + \
    ([BFLOAT16] if BFLOAT16 is not None else []) + [np.dtype("complex64")]


class Failure(Exception):
    pass


class Stop(Exception):
    """Some rank failed: every rank stops at the same case."""


# -- inputs and expected results -------------------------------------------------------------
def gen_wide(q: int, n: int, dtype: np.dtype, op: Op | None, p: int) -> np.ndarray:
    """Rank q's input as int64 / complex128 (exact), before the cast to ``dtype``."""
    i = np.arange(n, dtype=np.int64)
    if op is Op.PROD:
        v = (i * 5 + q) % 2 + 1                          # products up to 2^p
    elif op in (Op.BAND, Op.BOR, Op.BXOR):
        v = (i * 7 + q * 13) % 61
    else:
        v = (i * 7 + q * 3) % 9
        if dtype.kind == "i":
            v = v - 4                                    # negative values too
    im = None
    if dtype.kind == "c":
        im = (i + q) % 2 if op is Op.PROD else (i * 3 + q) % 5
    if op is Op.AVG:
        # rank 0 adds what makes the sum a multiple of p: the mean is an exact integer
        total = sum((i * 7 + k * 3) % 9 for k in range(p))
        if q == 0:
            v = v + (-total) % p
        if im is not None:
            itot = sum((i * 3 + k) % 5 for k in range(p))
            if q == 0:
                im = im + (-itot) % p
    return v if im is None else v + 1j * im


def gen(q: int, n: int, dtype: np.dtype, op: Op | None, p: int) -> np.ndarray:
    return cast(gen_wide(q, n, dtype, op, p), dtype)


def gen_move(q: int, n: int, dtype: np.dtype) -> np.ndarray:
    """Block q of a moving collective: distinct for every q < 127 from the first element
    on (a block delivered to the wrong place shows), exact in every dtype."""
    i = np.arange(n, dtype=np.int64)
    v = (i * 7 + q * 37) % 127 - 63
    if dtype.kind == "c":
        v = v + 1j * ((i + q * 5) % 17)
    return cast(v, dtype)


def cast(wide: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if BFLOAT16 is not None and dtype == BFLOAT16:
        return wide.astype(np.float64).astype(BFLOAT16)
    return wide.astype(dtype)


def expect(op: Op, n: int, dtype: np.dtype, p: int) -> np.ndarray:
    """The reduction over all p ranks, computed exactly in int64/complex128."""
    xs = [gen_wide(q, n, dtype, op, p) for q in range(p)]
    acc = xs[0].copy()
    for x in xs[1:]:
        if op in (Op.SUM, Op.AVG):
            acc = acc + x
        elif op is Op.PROD:
            acc = acc * x
        elif op is Op.MIN:
            acc = np.minimum(acc, x)
        elif op is Op.MAX:
            acc = np.maximum(acc, x)
        elif op is Op.BAND:
            acc = acc & x
        elif op is Op.BOR:
            acc = acc | x
        elif op is Op.BXOR:
            acc = acc ^ x
    if op is Op.AVG:
        acc = acc / p                    # exact: the sums divide by p
    return cast(acc, dtype)


# -- array kinds ---------------------------------------------------------------------------------
def is_bf16(dtype) -> bool:
    return BFLOAT16 is not None and np.dtype(dtype) == BFLOAT16


def torch_dtype(dtype: np.dtype):
    if is_bf16(dtype):
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype)).dtype


class Kinds:
    """Moves NumPy data to and from CuPy arrays / torch CUDA tensors on this rank's GPU."""

    def __init__(self, device: int):
        self.device = device
        cupy.cuda.Device(device).use()
        self.tdev = None
        self.torch_bf16 = ""
        if torch is not None and torch.cuda.is_available():
            torch.cuda.set_device(device)
            self.tdev = torch.device("cuda", device)
            try:   # older torch has no typestr for bfloat16 in __cuda_array_interface__
                torch.zeros(1, dtype=torch.bfloat16, device=self.tdev).__cuda_array_interface__
            except Exception as e:  # noqa: BLE001
                self.torch_bf16 = (f"torch {torch.__version__} cannot export bfloat16 "
                                   f"through __cuda_array_interface__ ({type(e).__name__}: "
                                   f"{e}): bfloat16 cases skipped")

    def kinds_for(self, dtype: np.dtype) -> list[str]:
        out = [] if is_bf16(dtype) else ["cupy"]
        if self.tdev is not None and not (is_bf16(dtype) and self.torch_bf16):
            out.append("torch")
        return out

    def dev(self, kind: str, host: np.ndarray):
        host = np.ascontiguousarray(host)
        if kind == "cupy":
            return cupy.asarray(host)
        if is_bf16(host.dtype):
            t = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(host.copy())
        return t.to(self.tdev)

    def full(self, kind: str, shape, dtype: np.dtype, value=SENTINEL):
        return self.dev(kind, cast(np.full(shape, value, np.int64), dtype))

    def host(self, kind: str, obj) -> np.ndarray:
        if kind == "cupy":
            return cupy.asnumpy(obj)
        if obj.dtype == torch.bfloat16:
            return obj.view(torch.int16).cpu().numpy().view(BFLOAT16)
        return obj.cpu().numpy()

    def same_kind(self, kind: str, y, like) -> str | None:
        """Why ``y`` is not a device array of ``like``'s kind, device and dtype (or None)."""
        if kind == "cupy":
            if not isinstance(y, cupy.ndarray):
                return f"result is a {type(y).__module__}.{type(y).__name__}, not a CuPy array"
            if y.device.id != like.device.id:
                return f"result on device {y.device.id}, input on {like.device.id}"
        else:
            if not isinstance(y, torch.Tensor):
                return f"result is a {type(y).__module__}.{type(y).__name__}, not a torch tensor"
            if y.device != like.device:
                return f"result on {y.device}, input on {like.device}"
        if y.dtype != like.dtype:
            return f"result dtype {y.dtype}, input {like.dtype}"
        return None


# -- the cases ------------------------------------------------------------------------------------
class Cases:
    def __init__(self, comm: gpurt.Communicator, kinds: Kinds):
        self.comm, self.k = comm, kinds
        self.p, self.r = comm.size, comm.rank
        self.checks = 0
        self.failure: str | None = None
        self.notes: list[str] = []
        self.ncase = 0

    # checking
    def eq(self, what: str, got_obj, want: np.ndarray, kind: str) -> None:
        got = self.k.host(kind, got_obj)
        want = np.asarray(want)
        if got.shape != want.shape:
            raise Failure(f"{what}: shape {got.shape}, expected {want.shape}")
        if got.dtype != want.dtype:
            raise Failure(f"{what}: dtype {got.dtype}, expected {want.dtype}")
        if not np.array_equal(got, want):
            g, w = got.reshape(-1), want.reshape(-1)
            bad = np.flatnonzero(g != w)
            k = int(bad[0])
            raise Failure(f"{what}: {bad.size} of {g.size} elements wrong, first at [{k}]: "
                          f"got {g[k]!r}, expected {w[k]!r}")
        self.checks += 1

    def true(self, what: str, cond: bool, detail: str = "") -> None:
        if not cond:
            raise Failure(f"{what}{': ' + detail if detail else ''}")
        self.checks += 1

    def kind_ok(self, what: str, y, like, kind: str) -> None:
        why = self.k.same_kind(kind, y, like)
        self.true(what, why is None, why or "")

    def case(self, tag: str, fn, *args) -> None:
        """Run one case; then every rank learns whether any failed (and all stop if so)."""
        self.ncase += 1
        if self.failure is None:
            try:
                fn(*args)
            except Failure as e:
                self.failure = f"{tag}: {e}"
            except Exception:  # noqa: BLE001 - reported with the case's name
                self.failure = f"{tag}: raised\n{traceback.format_exc()}"
        if WORLD.allreduce(1 if self.failure else 0, op=MPI.MAX):
            raise Stop()

    def root(self) -> int:
        return self.ncase % self.p

    # -- collectives ------------------------------------------------------------------------
    def collectives(self) -> None:
        for dtype in DTYPES:
            ops = [o for o in OPS if dtype in _ALLOWED[o]]
            for kind in self.k.kinds_for(dtype):
                for n in SIZES:
                    for op in ops:
                        for coll in ("allreduce", "reduce", "reduce_scatter"):
                            for given in (False, True):
                                root = self.root()
                                tag = (f"{coll} {kind} {dtype} {op.name} n={n} root={root} "
                                       f"out={'given' if given else 'None'}")
                                self.case(tag, self.reducing, coll, kind, dtype, op, n, root,
                                          given)
                    for coll in ("broadcast", "allgather", "alltoall", "gather", "scatter"):
                        for given in (False, True):
                            root = self.root()
                            tag = (f"{coll} {kind} {dtype} n={n} root={root} "
                                   f"out={'given' if given else 'None'}")
                            self.case(tag, self.moving, coll, kind, dtype, n, root, given)
                self.case(f"barrier ({kind} {dtype} done)", self.comm.barrier)
        f32 = np.dtype(np.float32)
        for coll in ("allreduce", "reduce_scatter"):
            for given in (False, True):
                n = BIG // (self.p if coll == "reduce_scatter" else 1)
                self.case(f"{coll} cupy float32 SUM n={n} (large) out={given}", self.reducing,
                          coll, "cupy", f32, Op.SUM, n, 0, given)
        for coll in ("broadcast", "allgather"):
            n = BIG // (self.p if coll == "allgather" else 1)
            self.case(f"{coll} cupy float32 n={n} (large)", self.moving, coll, "cupy", f32, n,
                      self.p - 1, False)

    def reducing(self, coll: str, kind: str, dtype: np.dtype, op: Op, n: int, root: int,
                 given: bool) -> None:
        c, p, r, k = self.comm, self.p, self.r, self.k
        if coll == "allreduce":
            x0 = gen(r, n, dtype, op, p)
            x = k.dev(kind, x0)
            want = expect(op, n, dtype, p)
            if given:
                out = k.full(kind, n, dtype)
                y = c.allreduce(x, out, op=op)
                self.true("returns out", y is out)
                self.eq("x unchanged", x, x0, kind)
                self.eq("out", out, want, kind)
            else:
                y = c.allreduce(x, op=op)
                self.true("returns x (in place)", y is x)
                self.eq("x", x, want, kind)
        elif coll == "reduce":
            x0 = gen(r, n, dtype, op, p)
            x = k.dev(kind, x0)
            want = expect(op, n, dtype, p)
            if given:
                out = k.full(kind, n, dtype)
                y = c.reduce(x, out, op=op, root=root)
                self.eq("x unchanged", x, x0, kind)
                if r == root:
                    self.true("returns out on the root", y is out)
                    self.eq("out on the root", out, want, kind)
                else:
                    self.eq("out off the root untouched", out, cast(np.full(n, SENTINEL), dtype),
                            kind)
            else:
                y = c.reduce(x, op=op, root=root)
                self.eq("x on the root" if r == root else "x off the root untouched", x,
                        want if r == root else x0, kind)
        elif coll == "reduce_scatter":
            x0 = gen(r, p * n, dtype, op, p).reshape(p, n)
            x = k.dev(kind, x0)
            want = expect(op, p * n, dtype, p).reshape(p, n)[r]
            if given:
                out = k.full(kind, n, dtype)
                y = c.reduce_scatter(x, out, op=op)
                self.true("returns out", y is out)
                self.eq("out", out, want, kind)
            else:
                y = c.reduce_scatter(x, op=op)
                self.kind_ok("allocated result", y, x, kind)
                self.eq("result", y, want, kind)
            self.eq("x unchanged", x, x0, kind)
        else:
            raise ValueError(coll)

    def moving(self, coll: str, kind: str, dtype: np.dtype, n: int, root: int,
               given: bool) -> None:
        c, p, r, k = self.comm, self.p, self.r, self.k
        g = [gen_move(q, n, dtype) for q in range(p)]
        if coll == "broadcast":
            x = k.dev(kind, g[root] if r == root else cast(np.full(n, SENTINEL), dtype))
            y = c.ibroadcast(x, root=root).wait() if given else c.broadcast(x, root=root)
            self.true("returns x", y is x)
            self.eq("x", x, g[root], kind)
        elif coll == "allgather":
            x = k.dev(kind, g[r])
            want = np.stack(g)
            if given:
                out = k.full(kind, (p, n), dtype)
                y = c.allgather(x, out)
                self.true("returns out", y is out)
                self.eq("out", out, want, kind)
            else:
                y = c.allgather(x)
                self.kind_ok("allocated result", y, x, kind)
                self.eq("result", y, want, kind)
        elif coll == "alltoall":
            blocks = [gen_move(q * p + d, n, dtype) for q in range(p) for d in range(p)]
            x = k.dev(kind, np.stack(blocks[r * p:(r + 1) * p]))
            want = np.stack([blocks[q * p + r] for q in range(p)])
            if given:
                out = k.full(kind, (p, n), dtype)
                y = c.alltoall(x, out)
                self.true("returns out", y is out)
                self.eq("out", out, want, kind)
            else:
                y = c.alltoall(x)
                self.kind_ok("allocated result", y, x, kind)
                self.eq("result", y, want, kind)
        elif coll == "gather":
            x = k.dev(kind, g[r])
            want = np.stack(g)
            if given:
                out = k.full(kind, (p, n), dtype)
                y = c.gather(x, out, root=root)
                if r == root:
                    self.true("returns out on the root", y is out)
                    self.eq("out on the root", out, want, kind)
                else:
                    self.true("None off the root", y is None, f"got {type(y).__name__}")
                    self.eq("out off the root untouched", out,
                            cast(np.full((p, n), SENTINEL), dtype), kind)
            else:
                y = c.gather(x, root=root)
                if r == root:
                    self.kind_ok("allocated result", y, x, kind)
                    self.eq("result on the root", y, want, kind)
                else:
                    self.true("None off the root", y is None, f"got {type(y).__name__}")
        elif coll == "scatter":
            full = np.stack(g)
            if given:
                x = k.dev(kind, full) if r == root else None
                out = k.full(kind, n, dtype)
                y = c.scatter(x, out, root=root)
                self.true("returns out", y is out)
                self.eq("out", out, g[r], kind)
            else:
                # off the root x only tells the shape and dtype of the block to allocate
                x = k.dev(kind, full if r == root else cast(np.full((p, n), SENTINEL), dtype))
                y = c.scatter(x, root=root)
                self.kind_ok("allocated result", y, x, kind)
                self.eq("result", y, g[r], kind)
        else:
            raise ValueError(coll)

    # -- i-variants ------------------------------------------------------------------------------
    def nonblocking(self) -> None:
        for kind in ("cupy", "torch"):
            if kind == "torch" and self.k.tdev is None:
                continue
            for dtype in (np.dtype(np.float32), np.dtype(np.int64)):
                self.case(f"i-variants {kind} {dtype}", self._nonblocking, kind, dtype)

    def _nonblocking(self, kind: str, dtype: np.dtype) -> None:
        c, p, r, k = self.comm, self.p, self.r, self.k
        n = 1000
        xs = [k.dev(kind, gen(r, n, dtype, op, p)) for op in (Op.SUM, Op.MAX, Op.PROD)]
        reqs = [c.iallreduce(x, op=op) for x, op in zip(xs, (Op.SUM, Op.MAX, Op.PROD))]
        for x, op, req in zip(xs, (Op.SUM, Op.MAX, Op.PROD), reqs):
            self.true(f"iallreduce {op.name} returns a Request", isinstance(req, gpurt.Request),
                      type(req).__name__)
            y = req.wait()
            self.true(f"iallreduce {op.name}: wait() returns x", y is x)
            self.eq(f"iallreduce {op.name}", y, expect(op, n, dtype, p), kind)
        g = [gen_move(q, n, dtype) for q in range(p)]
        root = p - 1
        x = k.dev(kind, g[r])
        y = c.iallgather(x).wait()
        self.kind_ok("iallgather result", y, x, kind)
        self.eq("iallgather", y, np.stack(g), kind)
        x0 = gen(r, n, dtype, Op.SUM, p)
        x = k.dev(kind, x0)
        y = c.ireduce(x, op=Op.SUM, root=root).wait()
        self.eq("ireduce", x, expect(Op.SUM, n, dtype, p) if r == root else x0, kind)
        x = k.dev(kind, gen(r, p * n, dtype, Op.SUM, p))
        y = c.ireduce_scatter(x).wait()
        self.eq("ireduce_scatter", y, expect(Op.SUM, p * n, dtype, p)[r * n:(r + 1) * n], kind)
        x = k.dev(kind, np.stack([g[(r + d) % p] for d in range(p)]))
        y = c.ialltoall(x).wait()
        self.eq("ialltoall", y, np.stack([g[(q + r) % p] for q in range(p)]), kind)
        x = k.dev(kind, g[r])
        y = c.igather(x, root=0).wait()
        if r == 0:
            self.eq("igather", y, np.stack(g), kind)
        else:
            self.true("igather: None off the root", y is None)
        out = k.full(kind, n, dtype)
        y = c.iscatter(k.dev(kind, np.stack(g)) if r == 0 else None, out, root=0).wait()
        self.eq("iscatter", out, g[r], kind)
        c.ibarrier().wait()
        self.checks += 1

    # -- streams ---------------------------------------------------------------------------------
    def streams(self) -> None:
        for variant in ("stream=s.ptr", "with s:", "stream=s (object)", "iallreduce stream=",
                        "reduce_scatter stream=", "allgather with s:"):
            self.case(f"streams cupy float32 [{variant}]", self._stream_cupy, variant)
        if self.k.tdev is not None:
            for variant in ("stream=torch.cuda.Stream", "torch.cuda.stream() current"):
                self.case(f"streams torch float32 [{variant}]", self._stream_torch, variant)

    def _produce(self, stream_ptr: int, dst, host: np.ndarray) -> None:
        """Behind a 20 ms sleep on ``stream_ptr``, write ``host`` into ``dst``: a call that
        does not order itself after this stream reads the stale contents."""
        sleep_on(stream_ptr)
        cupy.cuda.runtime.memcpyAsync(dst_ptr(dst), host.ctypes.data, host.nbytes, 1,
                                      stream_ptr)

    def _stream_cupy(self, variant: str) -> None:
        c, p, r = self.comm, self.p, self.r
        f32 = np.dtype(np.float32)
        n = 1 << 16
        s = cupy.cuda.Stream(non_blocking=True)
        host = cupy.cuda.alloc_pinned_memory(p * n * 4)
        h = np.frombuffer(host, np.float32, p * n)
        if variant.startswith("reduce_scatter"):
            h[...] = gen(r, p * n, f32, Op.SUM, p)
            x = cupy.full(p * n, -7, np.float32)
            cupy.cuda.runtime.deviceSynchronize()
            self._produce(s.ptr, x, h)
            y = c.reduce_scatter(x, stream=s.ptr)
            s.synchronize()
            self.eq("reduce_scatter on s", y, expect(Op.SUM, p * n, f32, p)[r * n:(r + 1) * n],
                    "cupy")
            return
        h = h[:n]
        h[...] = gen(r, n, f32, Op.SUM, p)
        x = cupy.full(n, -7, np.float32)
        cupy.cuda.runtime.deviceSynchronize()
        if variant == "allgather with s:":
            with s:
                self._produce(s.ptr, x, h)
                y = c.allgather(x)
            s.synchronize()
            self.eq("allgather on the current stream s", y,
                    np.stack([gen(q, n, f32, Op.SUM, p) for q in range(p)]), "cupy")
            return
        want = expect(Op.SUM, n, f32, p)
        if variant == "with s:":
            with s:
                self._produce(s.ptr, x, h)
                y = c.allreduce(x)
        else:
            self._produce(s.ptr, x, h)
            if variant == "stream=s.ptr":
                y = c.allreduce(x, stream=s.ptr)
            elif variant == "stream=s (object)":
                y = c.allreduce(x, stream=s)
            else:
                req = c.iallreduce(x, stream=s.ptr)
                self.true("iallreduce returns a Request", isinstance(req, gpurt.Request))
                y = req.wait()
        s.synchronize()
        self.true("returns x", y is x)
        self.eq(f"allreduce [{variant}] after s.synchronize()", x, want, "cupy")

    def _stream_torch(self, variant: str) -> None:
        c, p, r, k = self.comm, self.p, self.r, self.k
        f32 = np.dtype(np.float32)
        n = 1 << 16
        ts = torch.cuda.Stream(device=k.tdev)
        h = torch.from_numpy(gen(r, n, f32, Op.SUM, p)).pin_memory()
        x = torch.full((n,), -7.0, dtype=torch.float32, device=k.tdev)
        torch.cuda.synchronize()
        sleep_on(ts.cuda_stream)
        with torch.cuda.stream(ts):
            x.copy_(h, non_blocking=True)
            if variant == "torch.cuda.stream() current":
                # no stream= given: gpurt orders a torch tensor on torch's current stream
                y = c.allreduce(x)
            else:
                y = None
        if y is None:
            y = c.allreduce(x, stream=ts)
        ts.synchronize()
        self.true("returns x", y is x)
        self.eq(f"allreduce [{variant}] after ts.synchronize()", x,
                expect(Op.SUM, n, f32, p), "torch")

    # -- point to point ------------------------------------------------------------------------------
    def p2p(self) -> None:
        if self.p < 2:
            self.notes.append("p2p: skipped on 1 rank")
            return
        for dtype in DTYPES:
            for kind in self.k.kinds_for(dtype):
                for n in SIZES:
                    self.case(f"send/recv ring {kind} {dtype} n={n}", self._ring, kind, dtype, n)

    def _ring(self, kind: str, dtype: np.dtype, n: int) -> None:
        c, p, r, k = self.comm, self.p, self.r, self.k
        right, left = (r + 1) % p, (r - 1) % p
        x = k.dev(kind, gen_move(r, n, dtype))
        out = k.full(kind, n, dtype)
        req = c.isend(x, right, tag=7)
        y = c.recv(out, left, tag=7)
        req.wait()
        self.true("recv returns out", y is out)
        self.eq("recv from the left", out, gen_move(left, n, dtype), kind)
        out2 = k.full(kind, n, dtype)
        rreq = c.irecv(out2, right, tag=8)
        c.send(x, left, tag=8)
        y = rreq.wait()
        self.eq("irecv from the right", out2, gen_move(right, n, dtype), kind)

    # -- the backend across processes ------------------------------------------------------------------
    def ipc(self) -> None:
        if self.p < 2:
            self.notes.append("ipc: skipped on 1 rank")
            return
        self.case("backend ipc: memory + event handles, rank 0 -> 1", self._ipc)

    def _ipc(self) -> None:
        from gpurt import device

        be = device.loaded() or device.get()
        r = self.r
        n, off = (1 << 20) + 17, 4096 + 8
        stream = cupy.cuda.Stream(non_blocking=True)
        if r == 0:
            buf = be.alloc(off + n + 64)
            base, size = be.address_range(be.ptr(buf) + off)
            self.true("address_range covers the view", base <= be.ptr(buf) + off and
                      be.ptr(buf) + off + n <= base + size, f"{base:#x}+{size}")
            self.true("device_of", be.device_of(be.ptr(buf)) == be.current())
            src = be.pinned(n)
            src[...] = np.arange(n, dtype=np.int64).astype(np.uint8)
            sleep_on(stream.ptr)
            be.from_host(buf[off:off + n], src, stream.ptr)
            ev = be.event(True)
            be.record(ev, stream.ptr)
            self.true("event handle is 64 bytes", isinstance(ev.handle, bytes) and
                      len(ev.handle) == 64)
            mem = be.ipc_handle(base)
            # the event is still pending (20 ms sleep): rank 1 must wait on it, not on us
            WORLD.send((mem, be.ptr(buf) + off - base, ev.handle, be.uuid(be.current())),
                       dest=1, tag=77)
            WORLD.recv(source=1, tag=78)       # rank 1 is done with the memory
            be.synchronize(stream.ptr)
            self.true("query after synchronize", be.query(ev))
            ev.close()
            del buf
        elif r == 1:
            mem, offset, evh, uuid0 = WORLD.recv(source=0, tag=77)
            self.true("same GPU uuid as rank 0", uuid0 == be.uuid(be.current()),
                      f"{uuid0} vs {be.uuid(be.current())}")
            base = be.ipc_open(mem)
            v = be.view(base + offset, n, None)
            pev = be.event_open(evh)
            be.wait_event(stream.ptr, pev)
            dst = be.pinned(n)
            dst[...] = 0
            be.to_host(dst, v, stream.ptr)
            done = be.event(False)
            be.record(done, stream.ptr)
            t0 = time.monotonic()
            while not be.query(done):
                if time.monotonic() - t0 > 30:
                    raise Failure("event never completed")
                time.sleep(1e-4)
            want = np.arange(n, dtype=np.int64).astype(np.uint8)
            if not np.array_equal(dst, want):
                bad = np.flatnonzero(dst != want)
                raise Failure(f"{bad.size} bytes wrong through IPC, first at {bad[0]}: "
                              f"{dst[bad[0]]} != {want[bad[0]]}")
            self.checks += 1
            # a reduction reading the peer's memory directly, into local scratch
            acc = be.alloc(n)
            be.copy(acc, v, stream.ptr)
            be.reduce(Op.BXOR, acc, v, acc, stream.ptr, dtype=np.uint8)
            be.to_host(dst, acc, stream.ptr)
            be.synchronize(stream.ptr)
            self.true("reduce over peer memory (x ^ x == 0)", not dst.any())
            del v
            pev.close()
            done.close()
            be.ipc_close(base)
            WORLD.send(True, dest=0, tag=78)


_SLEEP = None


def sleep_kernel():
    """A one-thread kernel that spins ``ns`` nanoseconds (globaltimer + __nanosleep)."""
    global _SLEEP
    if _SLEEP is None:
        _SLEEP = cupy.RawKernel(r"""
extern "C" __global__ void gpurt_test_sleep(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(100000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
""", "gpurt_test_sleep")
    return _SLEEP


def sleep_on(stream_ptr: int, ns: int = 20_000_000) -> None:
    """Queue a ``ns`` sleep on the stream ``stream_ptr`` (of the current device)."""
    with cupy.cuda.ExternalStream(stream_ptr):
        sleep_kernel()((1,), (1,), (np.uint64(ns),))


def dst_ptr(x) -> int:
    return x.data.ptr if isinstance(x, cupy.ndarray) else x.data_ptr()


def main() -> int:
    suites = sys.argv[1:] or ["all"]
    if "all" in suites:
        # ipc first: its allocation must not be one gpurt's own transport already opened
        suites = ["ipc", "collectives", "nonblocking", "streams", "p2p"]
    comm = gpurt.init()
    ndev = cupy.cuda.runtime.getDeviceCount()
    forced = os.environ.get("GPURT_DEVICE", "").strip()
    device = int(forced) if forced else comm.local_rank % ndev
    cases = Cases(comm, Kinds(device))
    if torch is None or cases.k.tdev is None:
        cases.notes.append("torch with CUDA unavailable: torch cases skipped")
    elif cases.k.torch_bf16:
        cases.notes.append(cases.k.torch_bf16)
    t0 = time.perf_counter()
    try:
        for s in suites:
            getattr(cases, s)()
    except Stop:
        pass
    except Exception:  # noqa: BLE001 - outside any case: still report through rank 0
        cases.failure = cases.failure or f"outside a case:\n{traceback.format_exc()}"
    where = getattr(comm, "dev_endpoints", None)
    desc = {p: getattr(ep, "transport", type(ep).__name__) for p, ep in (where or {}).items()}
    rows = WORLD.gather((cases.checks, cases.failure, cases.notes, desc), root=0)
    if WORLD.rank == 0:
        lines = []
        for q, (nchk, fail, notes, d) in enumerate(rows):
            if fail:
                lines.append(f"rank {q}: FAILED after {nchk} checks: {fail}")
            else:
                lines.append(f"rank {q}: {nchk} checks passed")
            for note in notes:
                lines.append(f"rank {q}: note: {note}")
            if d:
                lines.append(f"rank {q}: device endpoints {d}")
        nfail = sum(1 for row in rows if row[1])
        total = sum(row[0] for row in rows)
        lines.append(f"gpu_cases {' '.join(suites)} on {WORLD.size} rank(s): {total} checks, "
                     f"{nfail} rank(s) failed, {time.perf_counter() - t0:.1f} s")
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    bad = WORLD.allreduce(1 if cases.failure else 0, op=MPI.MAX)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
