"""GPU tests (marker ``gpu``): skipped, with the reason, unless ``CudaBackend.probe()`` finds
CuPy and a CUDA device.  Run on a machine with a GPU as

    python -m pytest -m gpu tests/gpu -x -q

* the CUDA backend in this process: reductions of every dtype x op against NumPy
  (bfloat16 bit-exact against ml_dtypes, NaN and infinities included), AVG's scaling,
  copies, host staging with pinned memory, events (a pending one is not ready), views,
  address ranges, empty-like for CuPy and torch, errors wrapped as gpurt errors;
* ``tests/gpu/gpu_cases.py`` under ``mpiexec -n K`` for K = 1..4, every rank on the one GPU
  (or local rank modulo the visible GPUs): every collective through the public API.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpurt.device_cuda import CudaBackend
from gpurt.errors import TransportError
from gpurt.ops import _ALLOWED, BFLOAT16, Op

OK, WHY = CudaBackend.probe()
if not OK and os.environ.get("GPURT_GPU_REQUIRED") == "1":   # set by device_check.sh
    raise RuntimeError(f"GPURT_GPU_REQUIRED=1 but no usable GPU: {WHY}")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not OK, reason=f"needs CuPy and a CUDA GPU: {WHY}")]

NUMPY_UF = {Op.SUM: np.add, Op.AVG: np.add, Op.PROD: np.multiply, Op.MIN: np.minimum,
            Op.MAX: np.maximum, Op.BAND: np.bitwise_and, Op.BOR: np.bitwise_or,
            Op.BXOR: np.bitwise_xor}
DTYPES = [np.dtype(t) for t in ("bool", "int8", "uint8", "int32", "int64", "uint64",
                                "float16", "float32", "float64", "complex64", "complex128")] + \
    ([BFLOAT16] if BFLOAT16 is not None else [])


@pytest.fixture(scope="module")
def be():
    b = CudaBackend()
    b.bind(0)
    return b


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def _values(rng, dtype: np.dtype, n: int) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), n).astype(dtype)
    if dtype.kind == "c":
        return (rng.integers(-20, 20, n) + 1j * rng.integers(-20, 20, n)).astype(dtype)
    # floats on a grid: sums and products exact in every float type tested
    return (rng.integers(-64, 64, n) / 8).astype(np.float64).astype(dtype)


def _to_device(be, cp, host: np.ndarray):
    """host bytes -> a uint8 device view (the backend's currency)."""
    raw = host.reshape(-1).view(np.uint8)
    v = be.alloc(raw.nbytes)
    if raw.nbytes:
        v.set(raw)
    return v


def _from_device(v, dtype) -> np.ndarray:
    return v.view(np.uint8).get().view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_every_dtype_and_op_matches_numpy(be, cp, dtype):
    rng = np.random.default_rng(7)
    n = 10007
    a, b = _values(rng, dtype, n), _values(rng, dtype, n)
    stream = cp.cuda.Stream(non_blocking=True)
    for op in Op:
        if dtype not in _ALLOWED[op]:
            continue
        va, vb, vo = _to_device(be, cp, a), _to_device(be, cp, b), be.alloc(a.nbytes)
        cp.cuda.runtime.deviceSynchronize()
        # uint8 views + the logical dtype, as the device path passes them
        be.reduce(op, be.typed(va, dtype), be.typed(vb, dtype), be.typed(vo, dtype),
                  stream.ptr, dtype=dtype)
        be.reduce(op, va, vb, va, stream.ptr, dtype=dtype)            # out aliases acc
        be.synchronize(stream.ptr)
        uf = NUMPY_UF[op]
        if dtype == np.bool_ and op in (Op.MIN, Op.MAX):
            uf = np.logical_and if op is Op.MIN else np.logical_or
        want = uf(a, b)
        got = _from_device(vo, dtype)
        if dtype.kind == "c" and op is Op.PROD:
            np.testing.assert_allclose(got, want, rtol=1e-6)   # fma may contract on device
        else:
            assert np.array_equal(got, want), (op, dtype)
        assert np.array_equal(_from_device(va, dtype), got), (op, dtype, "in place")


def test_bfloat16_kernels_are_bit_exact_with_ml_dtypes(be, cp):
    if BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    rng = np.random.default_rng(3)
    n = 1 << 20
    # every bit pattern class: random bits (NaNs, infinities, denormals, both zeros)
    a = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    a[:4], b[:4] = [0x0000, 0x8000, 0x7f80, 0x0001], [0x8000, 0x0000, 0xff80, 0x8001]
    for op in (Op.SUM, Op.PROD, Op.MIN, Op.MAX):
        va, vb = _to_device(be, cp, a), _to_device(be, cp, b)
        vo = be.alloc(a.nbytes)
        be.reduce(op, be.typed(va, BFLOAT16), be.typed(vb, BFLOAT16), be.typed(vo, BFLOAT16),
                  0, dtype=BFLOAT16)
        be.synchronize(0)
        got = _from_device(vo, np.uint16)
        with np.errstate(all="ignore"):
            want = NUMPY_UF[op](a.view(BFLOAT16), b.view(BFLOAT16)).view(np.uint16)
        gnan = np.isnan(got.view(BFLOAT16).astype(np.float32))
        wnan = np.isnan(want.view(BFLOAT16).astype(np.float32))
        assert np.array_equal(gnan, wnan), op
        # NaN payloads differ between x86 and the GPU (which makes canonical NaNs)
        bad = (got != want) & ~wnan
        assert not bad.any(), (op, np.flatnonzero(bad)[:5], got[bad][:5], want[bad][:5])
    # AVG's division
    for d in (2, 3, 4, 7):
        v = _to_device(be, cp, a)
        be.scale(be.typed(v, BFLOAT16), d, 0, dtype=BFLOAT16)
        be.synchronize(0)
        got = _from_device(v, np.uint16)
        with np.errstate(all="ignore"):
            want = np.divide(a.view(BFLOAT16), BFLOAT16.type(d)).view(np.uint16)
        wnan = np.isnan(want.view(BFLOAT16).astype(np.float32))
        assert not ((got != want) & ~wnan).any(), d


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "complex64", "complex128"])
def test_scale_matches_numpy(be, cp, dtype):
    dtype = np.dtype(dtype)
    a = _values(np.random.default_rng(5), dtype, 4099)
    for d in (1, 2, 3, 4, 5):
        v = _to_device(be, cp, a)
        be.scale(v, d, 0, dtype=dtype)
        be.synchronize(0)
        want = np.divide(a, dtype.type(d))
        np.testing.assert_allclose(_from_device(v, dtype), want, rtol=2e-7 if
                                   dtype.itemsize >= 8 else 1e-3)
        if dtype.kind == "f" and dtype.itemsize >= 4:
            assert np.array_equal(_from_device(v, dtype), want), d


def test_copies_staging_and_events(be, cp):
    n = (8 << 20) + 5
    src_h = be.pinned(n)
    assert isinstance(src_h, np.ndarray) and src_h.dtype == np.uint8 and src_h.size == n
    src_h[...] = np.arange(n) % 251
    s = cp.cuda.Stream(non_blocking=True)
    d1, d2 = be.alloc(n), be.alloc(n)
    be.from_host(d1, src_h, s.ptr)
    be.copy(d2, d1, s.ptr)
    back = be.pinned(n)
    back[...] = 0
    be.to_host(back, d2, s.ptr)
    ev = be.event(False)
    assert ev.handle is None
    be.record(ev, s.ptr)
    while not be.query(ev):
        pass
    assert np.array_equal(back, src_h)
    # a second stream ordered after the first by wait_event
    s2 = cp.cuda.Stream(non_blocking=True)
    _sleep(cp, s.ptr, 50_000_000)
    be.record(ev, s.ptr)
    assert not be.query(ev), "an event behind a 50 ms sleep is not ready yet"
    be.wait_event(s2.ptr, ev)
    be.copy(d1, d2, s2.ptr)
    be.synchronize(s2.ptr)
    assert be.query(ev)
    ev.close()
    ev.close()                                     # idempotent
    ipc_ev = be.event(True)
    assert isinstance(ipc_ev.handle, bytes) and len(ipc_ev.handle) == 64
    with pytest.raises(ValueError):
        be.copy(d1[:10], d2[:11], 0)


def test_pinned_buffers_are_page_locked_and_freed(be, cp):
    """Staging's page-locked buffers are cudaHostAlloc'd outside CuPy's pinned pool, so
    that dropping one (the staging pool releases idle buffers) frees it: CuPy's pool
    would keep it for ever."""
    pool = cp.get_default_pinned_memory_pool()
    free0 = pool.n_free_blocks()
    h = be.pinned(3 << 20)
    attrs = cp.cuda.runtime.pointerGetAttributes(h.ctypes.data)
    assert attrs.type == 1, attrs.type                  # cudaMemoryTypeHost: page-locked
    d = be.alloc(3 << 20)
    h[...] = 7
    s = cp.cuda.Stream(non_blocking=True)
    be.from_host(d, h, s.ptr)
    be.synchronize(s.ptr)
    del h
    assert pool.n_free_blocks() == free0                # not parked in CuPy's pool
    assert (_from_device(d, np.uint8) == 7).all()


def test_views_ranges_and_devices(be, cp):
    a = cp.arange(1 << 20, dtype=cp.float32)
    p = a.data.ptr + 4096
    v = be.view(p, 1000, a)
    assert v.dtype == np.uint8 and v.nbytes == 1000 and be.ptr(v) == p
    assert be.ptr(v[10:20]) == p + 10 and v[10:20].nbytes == 10
    assert be.typed(v, np.float32).size == 250 and be.typed(v, BFLOAT16).dtype == np.uint16
    base, size = be.address_range(p)
    assert base <= a.data.ptr and a.data.ptr + a.nbytes <= base + size
    assert be.device_of(p) == 0 == be.current()
    assert be.count() >= 1
    u = be.uuid(0)
    assert u.startswith(("GPU-", "PCI-")) and u == CudaBackend().uuid(0)
    assert be.can_access_peer(0, 0)
    assert be.view(0, 0, None).nbytes == 0
    h = be.ipc_handle(base)
    assert isinstance(h, bytes) and len(h) == 64
    # the allocation's id (the receivers' IPC cache key): one per allocation, not per size
    # (CU_POINTER_ATTRIBUTE_BUFFER_ID; the attribute 18 that was asked for is the mapping
    # size, which two allocations of one size share)
    p1, p2 = cp.cuda.runtime.malloc(1 << 20), cp.cuda.runtime.malloc(1 << 20)
    try:
        assert be.alloc_id(p1) != be.alloc_id(p2)
        assert be.alloc_id(p1 + 4096) == be.alloc_id(p1)
    finally:
        cp.cuda.runtime.free(p1)
        cp.cuda.runtime.free(p2)
    with pytest.raises(TransportError):
        be.ipc_open(h)                # CUDA refuses a handle in the process that made it
    with pytest.raises(TransportError):
        be.ipc_open(b"\0" * 64)
    with pytest.raises(TransportError, match="not device memory"):
        be.device_of(be.pinned(64).ctypes.data)
    assert isinstance(be.current_stream(), int)
    with cp.cuda.Stream(non_blocking=True) as s:
        assert be.current_stream() == s.ptr


def test_driver_calls_from_a_fresh_thread(be, cp):
    """A thread that never used CUDA has no current context, and its current device (0)
    is the bound one, so the backend switches nothing: its driver API calls (the IPC
    cache's allocation id, the address range, the GPUDirect RDMA flush) still work there
    (CUDA_ERROR_INVALID_CONTEXT otherwise; the flush would have been switched off for
    good), and leaving a call never sets a device whose primary context does not exist."""
    import threading

    a = cp.arange(1 << 16, dtype=cp.float32)
    want = (be.alloc_id(a.data.ptr), be.address_range(a.data.ptr + 64),
            be.device_of(a.data.ptr), True)
    be.rdma_flush()             # (here: whether this device takes the flush at all)
    refused = be._no_flush
    ev = be.event(False)
    be.record(ev, cp.cuda.get_current_stream().ptr)
    be.synchronize(cp.cuda.get_current_stream().ptr)
    got, errors = [], []

    def fresh():
        try:
            got.append((be.alloc_id(a.data.ptr), be.address_range(a.data.ptr + 64),
                        be.device_of(a.data.ptr), be.query(ev)))
            be.rdma_flush()
            ev.close()              # (a collection on another thread: with its device)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert not errors and got == [want], errors
    assert be._no_flush == refused      # (taken here, taken there too)
    from gpurt.device_cuda import _driver
    assert _driver().primary_active(0)


def test_query_of_an_unfinished_event_leaves_no_error_behind(be, cp):
    """``query`` of an event not reached yet says False, and leaves no "last error" on
    the thread: the runtime's cudaEventQuery left cudaErrorNotReady, which PyTorch's check
    after its next kernel launch raises ("CUDA error: device not ready") where CuPy and
    PyTorch share one runtime library. The query goes through the driver now."""
    spin = cp.RawKernel(r"""
        extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64();
            while (clock64() - t0 < cycles) { }
        }""", "spin")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        spin((1,), (1,), (np.int64(1_500_000_000),))     # (~1 s at 1.5 GHz)
    ev = be.event(False)
    be.record(ev, s.ptr)
    assert be.query(ev) is False
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        t = torch.ones(16, device="cuda:0")
        assert float((t + 1).sum()) == 32.0        # (a launch check after the query)
    be.synchronize(s.ptr)
    assert be.query(ev) is True


def test_reduce_with_src_and_out_one_range(be, cp):
    """Recursive doubling's acc op out -> out: ``src`` and ``out`` are two objects over one
    range (exact, and no copy of ``src`` first)."""
    x = cp.arange(4096, dtype=cp.float32)
    acc = cp.full(4096, 2, dtype=cp.float32)
    v = x.view(cp.uint8)
    src, out = v[:], v[:]
    assert src is not out and src.data.ptr == out.data.ptr
    stream = cp.cuda.Stream(non_blocking=True)
    be.reduce(Op.SUM, be.typed(acc.view(cp.uint8), np.float32), src, out, stream.ptr,
              dtype=np.float32)
    be.synchronize(stream.ptr)
    assert np.array_equal(cp.asnumpy(x), np.arange(4096, dtype=np.float32) + 2)


def test_empty_like_cupy_and_torch(be, cp):
    x = cp.zeros((3, 4), cp.int32)
    y = be.empty((2, 5), np.dtype(np.int32), x)
    assert isinstance(y, cp.ndarray) and y.shape == (2, 5) and y.dtype == np.int32
    assert y.device.id == x.device.id
    with pytest.raises(TypeError, match="bfloat16"):
        be.empty((4,), BFLOAT16, x)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.zeros(4, dtype=torch.bfloat16, device="cuda:0")
    u = be.empty((3, 2), BFLOAT16, t)
    assert isinstance(u, torch.Tensor) and u.dtype == torch.bfloat16 and u.device == t.device
    assert u.shape == (3, 2)
    w = be.empty((7,), np.dtype(np.float64), torch.zeros(1, device="cuda:0"))
    assert w.dtype == torch.float64


def test_empty_is_taken_for_the_calls_stream(be, cp):
    """An out=None result comes from the pool for the stream the call writes on (CuPy's
    and PyTorch's pools are stream-ordered), not for whatever stream is current."""
    seen = []
    pool = cp.get_default_memory_pool()

    def alloc(nbytes):
        seen.append(cp.cuda.get_current_stream().ptr)
        return pool.malloc(nbytes)

    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(8, cp.float32)
    cur = cp.cuda.get_current_stream().ptr
    assert cur != s.ptr
    prev = cp.cuda.get_allocator()
    cp.cuda.set_allocator(alloc)
    try:
        be.empty((8,), np.dtype(np.float32), x, s.ptr)
        be.empty((8,), np.dtype(np.float32), x)
        be.empty((8,), np.dtype(np.float32), x, cur)
    finally:
        cp.cuda.set_allocator(prev)
    assert seen == [s.ptr, cur, cur]
    assert cp.cuda.get_current_stream().ptr == cur
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    ts = torch.cuda.Stream()
    t = torch.zeros(4, device="cuda:0")
    u = be.empty((1 << 20,), np.dtype(np.float32), t, ts.cuda_stream)
    assert torch.cuda.current_stream().cuda_stream != ts.cuda_stream   # (restored)
    ptr = u.data_ptr()
    del u          # back to the free blocks of ts: taken again on ts, not on another stream
    w = torch.empty(1 << 20, device="cuda:0")
    assert w.data_ptr() != ptr
    with torch.cuda.stream(ts):
        v = torch.empty(1 << 20, device="cuda:0")
    assert v.data_ptr() == ptr


def test_info_never_raises(be):
    info = be.info()
    assert info["available"] and info["gpus"] and len(info["p2p"]) == len(info["gpus"])
    assert "cuda_runtime" in info and "cupy" in info


def test_backend_through_gpurt_device():
    from gpurt import device

    if device.backend_name() != "cuda":
        pytest.skip(f"GPURT_DEVICE_BACKEND selects {device.backend_name()!r}")
    device._reset_for_tests()
    try:
        assert device.probe()[0]
        assert isinstance(device.get(), CudaBackend)
    finally:
        device._reset_for_tests()


def _sleep(cp, stream_ptr: int, ns: int) -> None:
    k = cp.RawKernel(r"""
extern "C" __global__ void gpurt_unit_sleep(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { __nanosleep(100000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    while (t - t0 < ns);
}""", "gpurt_unit_sleep")
    with cp.cuda.ExternalStream(stream_ptr):
        k((1,), (1,), (np.uint64(ns),))


# -- the public API under mpiexec, all ranks on the GPU(s) -----------------------------------------
def _run_cases(n: int, suites: list[str], timeout: float = 240):
    from conftest import run_mpi

    proc = run_mpi(n, ["tests/gpu/gpu_cases.py"] + suites, timeout=timeout, check=False)
    out = proc.stdout
    summary = f"\nstdout:\n{out[-8000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"gpu_cases {suites} on {n} rank(s) failed:{summary}"
    for r in range(n):
        assert f"rank {r}: " in out and "checks passed" in out, summary
    assert "FAILED" not in out, summary
    return out


def test_backend_ipc_between_two_processes():
    _run_cases(2, ["ipc"])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_public_api_on_device_arrays(n):
    print(_run_cases(n, ["all"], timeout=300))
