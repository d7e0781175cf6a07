"""Device bandwidth on one GPU: a plain device-to-device copy, and gpurt's allreduce of CuPy
arrays when run under mpiexec (all ranks on the one GPU, or local rank modulo the GPUs).

    python tests/gpu/bench_device.py --json copy.json                  # the copy only
    mpiexec -n 2 python tests/gpu/bench_device.py --json ar2.json      # copy + allreduce
    mpiexec -n 4 python tests/gpu/bench_device.py --json ar4.json

Conventions (GB = 1e9 bytes):

* copy: ``cudaMemcpyAsync`` device-to-device of a 256 MiB buffer, timed with CUDA events,
  median of 10 after 3 warm-ups.  ``copy_rw_GBps`` = (bytes read + bytes written) / time
  = 2 * bytes / time — the memory-bandwidth convention; ``copy_GBps`` = bytes / time.
* allreduce: float32 CuPy arrays of 64 MiB and 256 MiB, ``out=`` a separate array, on the
  current (default) stream; each iteration is a barrier, the call, a stream synchronize;
  its time is the slowest rank's; median of 10 after 3 warm-ups.  algbw = bytes / time,
  busbw = bytes * 2(n-1)/n / time (nccl-tests).  ``ratio_busbw_to_copy_rw`` = busbw /
  copy_rw_GBps: the fraction of the GPU's copy bandwidth the collective achieves.  With
  all ranks on one GPU they share its memory bandwidth, so this is the figure of merit.

Rank 0 prints a table and writes everything as JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MIB = 1 << 20


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": MIB, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mult)


def copy_bandwidth(cupy, nbytes: int, iters: int, warmup: int) -> dict:
    src = cupy.arange(nbytes, dtype=cupy.uint8)
    dst = cupy.empty(nbytes, dtype=cupy.uint8)
    s = cupy.cuda.Stream(non_blocking=True)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(warmup + iters):
        start.record(s)
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, s.ptr)  # D2D
        end.record(s)
        end.synchronize()
        if i >= warmup:
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e-3)
    if not bool((dst[:4096] == src[:4096]).all()):
        raise SystemExit("copy benchmark: the copy is wrong")
    t = statistics.median(times)
    return {"bytes": nbytes, "iters": iters, "warmup": warmup, "times_s": times,
            "time_s_median": t, "copy_GBps": nbytes / t / 1e9,
            "copy_rw_GBps": 2 * nbytes / t / 1e9,
            "convention": "copy_rw_GBps = (bytes read + bytes written) / time = 2*bytes/time; "
                          "copy_GBps = bytes/time; GB = 1e9"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here (rank 0)")
    ap.add_argument("--sizes", default="64M,256M", help="allreduce sizes in bytes (K/M/G)")
    ap.add_argument("--copy-bytes", default="256M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    import cupy
    from mpi4py import MPI

    import gpurt

    comm = gpurt.init()
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    ndev = cupy.cuda.runtime.getDeviceCount()
    forced = os.environ.get("GPURT_DEVICE", "").strip()
    dev = int(forced) if forced else comm.local_rank % ndev     # as gpurt binds
    cupy.cuda.Device(dev).use()
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    result: dict = {
        "ranks": size, "gpus_visible": ndev, "device": dev,
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "cupy": cupy.__version__,
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
    }
    copy = None
    if rank == 0:
        copy = copy_bandwidth(cupy, _parse_size(args.copy_bytes), args.iters, args.warmup)
        result["copy"] = copy
        print(f"D2D copy {copy['bytes'] / MIB:.0f} MiB: {copy['time_s_median'] * 1e3:.3f} ms, "
              f"{copy['copy_rw_GBps']:.1f} GB/s read+written ({copy['copy_GBps']:.1f} GB/s "
              f"copied)", flush=True)
    world.Barrier()

    rows = []
    if size > 1 or any(a.startswith("--sizes") for a in sys.argv):
        result["device_endpoints"] = {
            str(p): getattr(ep, "transport", type(ep).__name__)
            for p, ep in (getattr(comm, "dev_endpoints", None) or {}).items()}
        stream = cupy.cuda.get_current_stream()
        for nbytes in [_parse_size(s) for s in args.sizes.split(",") if s.strip()]:
            n = nbytes // 4
            x = cupy.full(n, rank + 1, dtype=cupy.float32)
            out = cupy.empty_like(x)
            times = []
            for i in range(args.warmup + args.iters):
                world.Barrier()
                t0 = time.perf_counter()
                comm.allreduce(x, out)
                stream.synchronize()
                t = time.perf_counter() - t0
                t = world.allreduce(t, op=MPI.MAX)
                if i == 0:
                    want = size * (size + 1) / 2
                    ok = bool((out == want).all())
                    if not world.allreduce(ok, op=MPI.LAND):
                        if rank == 0:
                            print(f"allreduce {nbytes} bytes: WRONG RESULT (expected {want})",
                                  flush=True)
                        return 1
                if i >= args.warmup:
                    times.append(t)
            tm = statistics.median(times)
            algbw = nbytes / tm / 1e9
            busbw = algbw * 2 * (size - 1) / size
            row = {"bytes": nbytes, "dtype": "float32", "iters": args.iters,
                   "warmup": args.warmup, "times_s": times, "time_s_median": tm,
                   "algbw_GBps": algbw, "busbw_GBps": busbw,
                   "algorithm": getattr(comm, "last_algorithm", None)}
            if copy is not None:
                row["ratio_busbw_to_copy_rw"] = busbw / copy["copy_rw_GBps"]
                row["ratio_busbw_to_copy"] = busbw / copy["copy_GBps"]
            rows.append(row)
            if rank == 0:
                ratio = f", busbw/copy_rw {row['ratio_busbw_to_copy_rw']:.3f}" if copy else ""
                print(f"allreduce {nbytes / MIB:.0f} MiB float32 on {size} ranks: "
                      f"{tm * 1e3:.3f} ms, algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s"
                      f"{ratio} [{row['algorithm']}]", flush=True)
            del x, out
        result["allreduce"] = rows
    if rank == 0:
        result["endpoints_note"] = "device endpoint per peer of rank 0 (cuda_ipc or staged)"
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
