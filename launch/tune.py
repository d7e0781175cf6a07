"""``gpurt tune``: measure every algorithm, write a profile the tuner reads.

The tuner's α-β-γ model ranks algorithms from constants; on a given machine the ranking
can be wrong (Python overheads, oversubscribed cores, caches).  ``gpurt tune`` runs, for
each collective and size, every candidate the tuner knows (schedules and native
protocols such as ``shm_board``), forced one after another inside one launch, takes the
median over iterations of the slowest rank's time, and writes the winner per size to a
JSON profile.  With ``GPURT_PROFILE=FILE`` the tuner then picks, for a communicator of
the same shape (ranks and nodes), the measured winner at the nearest measured size
(log scale); ``GPURT_ALGO`` and ``algo=`` still override it.

It also prints, per size, the model's own choice against the measured best, so
``gpurt tune`` doubles as the check that the model picks within 10 % of the best.

    gpurt tune -n 4 -o profile.json                 # allreduce, broadcast, allgather, ...
    gpurt tune -n 2 -c allreduce -b 8 -e 16M -f 4 -o p2.json
    GPURT_PROFILE=profile.json mpiexec -n 4 python train.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from time import perf_counter

import numpy as np

DEFAULT_COLLS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall",
                 "reduce", "barrier")


def _layout(coll: str, p: int, S: int, itemsize: int) -> tuple[int, int, int]:
    """(per-rank count n, input elements, output elements) for size S (nccl-tests S)."""
    if coll in ("allgather", "gather"):
        n = max(0, S // itemsize // p)
        return n, n, p * n
    if coll in ("reduce_scatter", "scatter"):
        n = max(0, S // itemsize // p)
        return n, p * n, n
    if coll == "alltoall":
        n = max(0, S // itemsize // p)
        return n, p * n, p * n
    if coll == "barrier":
        return 0, 0, 0
    n = max(0, S // itemsize)
    return n, n, n


def _call(comm, coll: str, x, y, algo: str):
    if coll == "allreduce":
        return lambda: comm.allreduce(x, y, algo=algo)
    if coll == "reduce":
        return lambda: comm.reduce(x, y, algo=algo)
    if coll == "broadcast":
        return lambda: comm.broadcast(x, algo=algo)
    if coll == "allgather":
        return lambda: comm.allgather(x, y, algo=algo)
    if coll == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, y, algo=algo)
    if coll == "alltoall":
        return lambda: comm.alltoall(x, y, algo=algo)
    if coll == "barrier":
        return lambda: comm.barrier(algo=algo)
    raise ValueError(f"gpurt tune does not time {coll}")


#: what -d offers: bench's dtypes but bool (every reduction here is a SUM, which bool has not)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "complex64", "complex128")

DIRECT = "shm_direct"
DIRECT_COLLS = ("allreduce", "reduce", "reduce_scatter", "allgather", "alltoall", "broadcast")


def worker(cfg: dict) -> dict | None:
    """Runs on every rank; rank 0 returns the profile."""
    import gpurt
    from mpi4py import MPI

    # (parse_dtype: bfloat16 through ml_dtypes)
    from gpurt.launch.bench import _yielding_barrier, parse_dtype, size_unit
    from gpurt.tuner import FOLD

    comm = gpurt.init()
    ctl = comm.mpi
    p, r = comm.size, comm.rank
    dtype = parse_dtype(cfg.get("dtype", "float32"))
    entries: dict = {}
    report = []
    for coll in cfg["collectives"]:
        rows = []
        # each size a whole number of elements (per rank, for the blocked kinds), as in
        # `gpurt bench`: below one it was measured, and written, as 0 bytes
        unit = size_unit(coll, p, dtype.itemsize)
        sizes = [0] if coll == "barrier" else \
            list(dict.fromkeys(max(unit, S // unit * unit) for S in cfg["sizes"]))
        for S in sizes:
            n, nin, nout = _layout(coll, p, S, dtype.itemsize)
            x = np.zeros(nin, dtype)
            y = np.zeros(nout, dtype)
            Sreal = S if coll == "barrier" else (
                p * n * dtype.itemsize if coll in ("allgather", "gather", "reduce_scatter",
                                                   "scatter", "alltoall") else n * dtype.itemsize)
            cands = comm.candidates(coll, Sreal)
            model = next(c["algorithm"] for c in cands if c["chosen"])
            # shm_direct (one node): decided per call from the buffers, beside the tuner
            if getattr(comm, "_direct", None) is not None and coll in DIRECT_COLLS:
                cands = cands + [{"algorithm": DIRECT, "chosen": False}]
                if comm.direct_choice(coll, Sreal):
                    model = DIRECT
            # several nodes: a call whose data fits the agreement's exchange rides in it
            # (no algo=); every forced candidate pays the agreement, then its schedule
            if comm.fold_choice(coll, Sreal):
                cands = cands + [{"algorithm": FOLD, "chosen": False}]
                model = FOLD
            times = {}
            for c in cands:
                name = c["algorithm"]
                call = _call(comm, coll, x, y, None if name == FOLD else name)
                for _ in range(cfg["warmup"]):
                    call()
                t = np.empty(cfg["iters"])
                ctl.Barrier()
                for i in range(cfg["iters"]):
                    t0 = perf_counter()
                    call()
                    t[i] = perf_counter() - t0
                # (first: a rank spinning in the Allreduce below took the CPU from one
                # still in its last timed call when ranks outnumber cores; bench's
                # _yielding_barrier says more)
                _yielding_barrier(ctl)
                if name == FOLD and comm.last_algorithm != FOLD:
                    raise RuntimeError(f"gpurt tune: {coll} of {Sreal} B was to fold, but "
                                       f"ran {comm.last_algorithm}")
                worst = np.empty_like(t)
                ctl.Allreduce(t, worst, op=MPI.MAX)
                times[name] = float(np.median(worst))
            best = min(times, key=times.get)
            rows.append([Sreal, best, times])
            report.append((coll, Sreal, model, times[model], best, times[best]))
            if r == 0:
                print(f"[tune] {coll:<14} {Sreal:>10} B  best {best:<20} "
                      f"{times[best] * 1e6:9.1f} us   model {model:<20} "
                      f"{times[model] * 1e6:9.1f} us  ({times[model] / times[best]:.2f}x)",
                      file=sys.stderr, flush=True)
        entries[coll] = rows
    if r != 0:
        return None
    return {"version": 1, "nranks": p, "nnodes": comm.nnodes, "local_size": comm.local_size,
            "dtype": str(dtype), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": os.uname().nodename, "entries": entries,
            "model_vs_best": [{"collective": c, "size": s, "model": m, "model_s": mt,
                               "best": b, "best_s": bt} for c, s, m, mt, b, bt in report]}


def run(nranks: int, collectives: list[str], sizes: list[int], out: str, warmup: int,
        iters: int, dtype: str) -> dict:
    """Launch the tuning ranks and write the profile to ``out``."""
    # the bench's launcher discovery, start and stop (a signal stops the whole launch)
    from gpurt.launch.bench import _run_launch, _stop_on_signals, launch_command
    from gpurt.launch.launcher import _mpi_shm_files

    cfg = {"collectives": collectives, "sizes": sizes, "warmup": warmup, "iters": iters,
           "dtype": dtype}
    with _stop_on_signals(), tempfile.TemporaryDirectory(prefix="gpurt-tune-") as d:
        cpath, rpath = os.path.join(d, "cfg.json"), os.path.join(d, "profile.json")
        with open(cpath, "w") as f:
            json.dump({**cfg, "result": rpath}, f)
        env = dict(os.environ)
        env.pop("GPURT_PROFILE", None)   # measure the candidates, not a previous profile
        env.pop("GPURT_ALGO", None)
        cmd = launch_command(nranks, [sys.executable, "-m", "gpurt.launch.tune", cpath])
        # (a bad $GPURT_MPIEXEC: one line; SIGINT/SIGTERM: the job is stopped, not left running)
        rc = _run_launch(cmd, env, cpath, set(_mpi_shm_files()))
        if rc != 0:
            raise SystemExit(f"gpurt tune: the tuning launch failed (exit {rc})")
        with open(rpath) as f:
            prof = json.load(f)
    with open(out, "w") as f:
        json.dump(prof, f, indent=1)
    return prof


def _main(path: str) -> int:
    with open(path) as f:
        cfg = json.load(f)
    prof = worker(cfg)
    if prof is not None:
        with open(cfg["result"], "w") as f:
            json.dump(prof, f)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], max(1, lo)
    while s <= hi:
        out.append(s)
        if factor <= 1:
            break
        s *= factor
    return out


def tune_command():
    import click

    from gpurt.launch.bench import (_SizeType, check_sweep_options, check_writable_path,
                                    launcher_rank, launcher_size, parse_dtype)

    @click.command("tune", context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("-n", "--nranks", type=click.IntRange(1), default=2, show_default=True,
                  help="Ranks to launch (the profile applies to communicators of this size).")
    @click.option("-c", "--collective", "colls", multiple=True,
                  type=click.Choice(DEFAULT_COLLS), help="Repeatable; default: all of them.")
    @click.option("-b", "--minbytes", type=_SizeType(1), default="8", show_default=True,
                  help="Smallest size (K/M/G suffixes; at least 1 byte).")
    @click.option("-e", "--maxbytes", type=_SizeType(1), default="16M", show_default=True,
                  help="Largest size (at least -b).")
    @click.option("-f", "--stepfactor", "factor", type=click.IntRange(1), default=8,
                  show_default=True, help="Size factor (2 or more unless -b equals -e).")
    @click.option("-w", "--warmup", type=click.IntRange(0), default=3, show_default=True)
    @click.option("-i", "--iters", type=click.IntRange(1), default=10, show_default=True)
    @click.option("-d", "--datatype", "dtype", type=click.Choice(DTYPES), default="float32",
                  show_default=True)
    @click.option("-o", "--out", "out", required=True, type=click.Path(dir_okay=False),
                  help="Where to write the profile (JSON).")
    def tune(nranks, colls, minbytes, maxbytes, factor, warmup, iters, dtype, out):
        """Time every algorithm per collective and size; write the winners to a profile
        that the tuner reads when GPURT_PROFILE points to it.

        \b
        Examples:
          gpurt tune -n 4 -o profile.json
          gpurt tune -n 2 -c allreduce -b 1K -e 64M -f 4 -o p2.json
          GPURT_PROFILE=profile.json mpiexec -n 4 python train.py
        """
        # under an MPI launcher (`mpiexec -n 2 gpurt tune ...`) every rank started a tuning
        # launch of its own, all at once, each writing -o: gpurt tune launches its ranks
        # itself.  (Before anything else: the -o check below is a collective there.)
        here = launcher_size()
        if here > 1:
            if launcher_rank() != 0:
                raise SystemExit(2)      # rank 0 says why, once
            raise click.UsageError(
                f"running under an MPI launcher with {here} ranks: gpurt tune launches its "
                f"own ranks (-n); run it once, not under mpiexec/srun (e.g. gpurt tune -n "
                f"{here} -o {out})")
        # refused here, before the launch: -b above -e measured nothing and wrote an empty
        # profile; a dtype the ranks cannot make failed on every rank with a traceback
        check_sweep_options(minbytes, maxbytes, factor)
        check_writable_path(out, "'-o' / '--out'")
        try:
            parse_dtype(dtype)
        except ValueError as e:      # bfloat16 without ml_dtypes
            raise click.BadParameter(str(e), param_hint="'-d' / '--datatype'") from None
        from gpurt.launch.bench import _Stopped
        try:
            prof = run(nranks, list(colls or DEFAULT_COLLS), _sizes(minbytes, maxbytes, factor),
                       out, warmup, iters, dtype)
        except _Stopped as e:    # (SIGINT/SIGTERM while it ran: the job is stopped)
            from gpurt.launch.launcher import _signame
            click.echo(f"gpurt tune: {_signame(e.signum)}: stopped every rank", err=True)
            raise SystemExit(128 + e.signum) from None
        rows = prof["model_vs_best"]
        off = [r for r in rows if r["model_s"] > 1.1 * r["best_s"]]
        click.echo(f"wrote {out}: {len(rows)} (collective, size) points on {nranks} ranks; "
                   f"the model's own choice was within 10% of the best at "
                   f"{len(rows) - len(off)}/{len(rows)}")
        for r in off:
            click.echo(f"  {r['collective']:<14} {r['size']:>10} B: model {r['model']} "
                       f"{r['model_s'] * 1e6:.1f} us, best {r['best']} {r['best_s'] * 1e6:.1f} us")

    return tune
