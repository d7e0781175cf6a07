"""`gpurt bench` (launch/bench.py): real sweeps under mpiexec, baselines, the checker.

Every real run is tiny (a few sizes, 1-3 iterations, a small ceiling buffer): the whole file
runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import (ROOT, SIGNAL_AFTER_POPEN, assert_cannot_start, is_hydra, mpiexec,
                      private_shm, run_mpi)

from gpurt.launch import bench as B

GPURT = Path(sys.executable).parent / "gpurt"


def run_bench(args: list[str], *, env: dict | None = None, timeout: float = 120,
              check: bool = True) -> subprocess.CompletedProcess:
    cmd = ([str(GPURT)] if GPURT.exists() else [sys.executable, "-m", "gpurt.launch.cli"]) + \
        ["bench"] + args
    e = dict(os.environ, GPURT_TIMEOUT="60", GPURT_MPIEXEC=shlex.join(mpiexec()))
    e.update(env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                    f"stderr:\n{proc.stderr[-6000:]}")
    return proc


QUICK = ["-w", "1", "-i", "3", "--ceiling-size", "4M"]


# -- real runs -----------------------------------------------------------------------------

def test_allreduce_sweep_json(tmp_path):
    out = tmp_path / "ar.json"
    proc = run_bench(["allreduce", "-n", "2", "-b", "8", "-e", "64K", "-f", "16", "-w", "1",
                      "-i", "3", "-c", "--json", str(out), "--ceiling-size", "4M"])
    rep = json.loads(out.read_text())
    want = B.sweep_sizes("allreduce", 2, 4, 8, 64 << 10, 16)
    assert want == [8, 128, 2048, 32768]
    assert [r["size"] for r in rep["rows"]] == want
    assert rep["config"]["sizes"] == want
    n = rep["nranks"]
    assert n == 2
    for r in rep["rows"]:
        g = r["gpurt"]
        assert g["wrong"] == 0
        assert g["p50_s"] > 0 and g["p99_s"] >= g["p50_s"] and g["mean_s"] > 0
        assert g["algbw_GBps"] == pytest.approx(r["size"] / g["p50_s"] / 1e9)
        assert g["busbw_GBps"] == pytest.approx(g["algbw_GBps"] * 2 * (n - 1) / n)
        assert g["algo"] and g["algo"] != "-"
        assert g["ceiling_fraction"] > 0
    launch = rep["libraries"]["gpurt"]["launches"][0]
    assert all(len(r["iter_max_s"]) == 3 for r in launch["rows"])
    # nccl-tests' time: the slowest rank's mean over the timed loop, never above the mean
    # of the per-iteration maxima
    for r, L in zip(rep["rows"], launch["rows"]):
        assert len(L["rank_mean_s"]) == 2
        assert L["loop_s"] == pytest.approx(max(L["rank_mean_s"]))
        assert L["loop_s"] <= L["mean_s"] * (1 + 1e-9)
        assert r["gpurt"]["loop_s"] == L["loop_s"]
    assert rep["ceiling"]["per_rank_Bps"] > 0
    assert rep["command"][1:3] == ["bench", "allreduce"]
    assert rep["machine"]["cpus"] and rep["machine"]["mpi_library"]
    # the table: a row per size on stdout, progress on stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")]
    assert [int(ln.split()[0]) for ln in rows] == want
    assert "out of bounds values : 0 OK" in proc.stdout
    assert proc.stderr.count("[gpurt 1/1] allreduce") == len(want)
    # how gpurt's waits ran (the figures depend on it), in the JSON and the header: 2
    # ranks on one node (1 or 2 of them sharing CPUs: a launcher may pin them apart);
    # none spins where those outnumber their CPUs
    info = rep["libraries"]["gpurt"]["info"]
    (ranks, cpus), spin = info["machine"], info["spin_us"]
    assert info["local_size"] == 2 and 1 <= ranks <= 2 and cpus >= 1
    assert spin == 0 or (ranks <= cpus and
                         spin == pytest.approx(float(os.environ.get("GPURT_SPIN_US", 50))))
    assert "# gpurt's waits (rank 0): " + (
        "yield at once, no spinning" if spin == 0 else f"spin {spin:g} us, then yield") \
        + f" (2 ranks on its node; {ranks} sharing its machine's CPUs, over {cpus} CPUs)" \
        in proc.stdout, proc.stdout


def test_no_check_prints_na(tmp_path):
    out = tmp_path / "b.json"
    proc = run_bench(["broadcast", "-n", "2", "-b", "1K", "-e", "1K", "--json", str(out)]
                     + QUICK)
    row = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")][0]
    assert " n/a " in row
    assert json.loads(out.read_text())["rows"][0]["gpurt"]["wrong"] is None


def test_baseline_mpi(tmp_path):
    out = tmp_path / "mpi.json"
    proc = run_bench(["allreduce", "-n", "2", "-b", "1K", "-e", "4K", "-f", "4", "-c",
                      "--baseline", "mpi", "--repeat", "2", "--json", str(out)] + QUICK)
    assert "mpi p50(us)" in proc.stdout and "ratio" in proc.stdout
    assert "loop(us)" in proc.stdout and "lratio" in proc.stdout
    rep = json.loads(out.read_text())
    assert len(rep["libraries"]["mpi"]["launches"]) == 2
    assert len(rep["libraries"]["gpurt"]["launches"]) == 2
    for r in rep["rows"]:
        m, g = r["mpi"], r["gpurt"]
        assert m["p50_s"] > 0 and m["wrong"] == 0 and g["wrong"] == 0
        assert m["algo"] == "MPI_Allreduce"
        assert r["ratio"]["mpi"] == pytest.approx(g["busbw_GBps"] / m["busbw_GBps"])
        assert r["loop_ratio"]["mpi"] == pytest.approx(m["loop_s"] / g["loop_s"])
        reps = [L["rows"][rep["rows"].index(r)]["loop_s"]
                for L in rep["libraries"]["mpi"]["launches"]]
        assert m["loop_s"] == pytest.approx(float(np.median(reps)))
        # the combined p50 is the median of the repeats' p50s
        reps = [L["rows"][rep["rows"].index(r)]["p50_s"]
                for L in rep["libraries"]["gpurt"]["launches"]]
        assert g["p50_s"] == pytest.approx(float(np.median(reps)))
    # alternation: gpurt 1, mpi 1, gpurt 2, mpi 2
    order = [ln.split("]")[0] + "]" for ln in proc.stderr.splitlines()
             if ln.startswith("[") and "allreduce" in ln]
    firsts = list(dict.fromkeys(order))
    assert firsts == ["[gpurt 1/2]", "[mpi 1/2]", "[gpurt 2/2]", "[mpi 2/2]"]


def test_baseline_nocheck_prices_the_agreement_check(tmp_path):
    """gpurt against itself with GPURT_CHECK=0, timed in gpurt's own launches (a second
    communicator, alternating blocks): exact both ways, the second communicator really
    unchecked (it says so), one launch per repeat and no launch of its own."""
    out = tmp_path / "nocheck.json"
    proc = run_bench(["allreduce", "-n", "2", "-b", "4K", "-e", "512K", "-f", "128", "-c",
                      "--baseline", "nocheck", "--repeat", "2", "--json", str(out)] + QUICK)
    assert "nocheck p50(us)" in proc.stdout and "ratio" in proc.stdout
    rep = json.loads(out.read_text())
    assert [r["size"] for r in rep["rows"]] == [4096, 512 << 10]
    for row in rep["rows"]:
        assert row["gpurt"]["wrong"] == 0 and row["nocheck"]["wrong"] == 0
        assert row["ratio"]["nocheck"] > 0 and row["loop_ratio"]["nocheck"] > 0
    assert rep["libraries"]["gpurt"]["info"]["check"] is True
    assert rep["libraries"]["nocheck"]["info"]["check"] is False
    for lib in ("gpurt", "nocheck"):
        launches = rep["libraries"][lib]["launches"]
        assert [L["repeat"] for L in launches] == [0, 1]
        assert all(L["paired_blocks"] == 3 for L in launches)    # min(-i 3, 8) blocks
    labels = {ln.split("]")[0] + "]" for ln in proc.stderr.splitlines() if ln.startswith("[")}
    assert {"[gpurt 1/2]", "[gpurt 1/2 +nocheck]", "[gpurt 2/2 +nocheck]"} <= labels
    assert not any(lb.startswith("[nocheck") for lb in labels)   # no launch of its own
    assert "nocheck" in B.BASELINES and B._LIBS["nocheck"].name == "nocheck"


def _fake_lib(calls: list[str], ctl, name: str, algo_suffix: str = "") -> B._Lib:
    """A library for _sweep's order tests: its call notes its name in ``calls`` and
    returns its name (+ ``algo_suffix``, what the algorithm column shows); ``ctl`` the
    stand-in control communicator."""

    class Fake(B._Lib):
        def __init__(self):
            self.name, self.ctl, self.rank, self.size = name, ctl, 0, 1

        def make(self, coll, x, y, op, root, algo):
            def call():
                calls.append(self.name)
                return self.name + algo_suffix
            return call

    return Fake()


def test_paired_sweep_alternates_blocks(monkeypatch):
    """Two libraries in one sweep: each size's iterations in blocks whose order turns
    (a, b, then b, a, ...), every iteration timed and counted once per library.  (Fake
    libraries and a one-process stand-in for the MPI control communicator: the order is
    what is under test, not MPI.)"""
    import types
    calls: list[str] = []

    class Ctl:
        def Barrier(self):
            calls.append("|")

        def gather(self, x, root):
            return [x]

        def reduce(self, x, root):
            return x

        def Ibarrier(self):        # (_yielding_barrier after each block: done at once)
            return types.SimpleNamespace(Test=lambda: True)

    mpi = types.SimpleNamespace(Get_library_version=lambda: "fake MPI")
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=mpi))
    cfg = {"collective": "allreduce", "sizes": [64], "dtype": "float32", "op": "sum",
           "root": 0, "warmup": 1, "iters": 7, "algo": None, "check": False,
           "memory": "host", "label": "t"}
    a, b = (_fake_lib(calls, Ctl(), n, "-algo") for n in "ab")
    res = B._sweep([a, b], cfg)
    timed = "".join(calls).split("|")[1:]         # after the warm-ups, per block
    blocks = min(7, B._BLOCKS)
    assert len(timed) == 2 * blocks
    assert [t[0] for t in timed] == (["a", "b", "b", "a"] * blocks)[:2 * blocks]
    assert "".join(calls).split("|")[0] == "ab"   # one warm-up each
    assert sum(len(t) for t in timed) == 2 * 7
    assert [r["lib"] for r in res] == ["a", "b"]
    for r in res:
        assert len(r["rows"][0]["iter_max_s"]) == 7 and r["paired_blocks"] == blocks
        assert r["rows"][0]["algo"] == r["lib"] + "-algo"


@pytest.mark.parametrize("coll", B.COLLECTIVES)
def test_every_collective_checked_on_3_ranks(coll, tmp_path):
    out = tmp_path / f"{coll}.json"
    # 96 B = 24 float32: a multiple of 3 ranks; root 1 for the rooted ones
    args = [coll, "-n", "3", "-b", "96", "-e", "96", "-w", "1", "-i", "2", "-c",
            "--ceiling-size", "0", "--json", str(out)]
    if coll in B.ROOTED:
        args += ["-r", "1"]
    proc = run_bench(args)
    rep = json.loads(out.read_text())
    assert len(rep["rows"]) == 1
    g = rep["rows"][0]["gpurt"]
    assert g["p50_s"] > 0
    if coll != "barrier":
        assert g["wrong"] == 0, rep["rows"]
        assert "out of bounds values : 0 OK" in proc.stdout
        return
    # a barrier has no output: nothing is checked (n/a, null in the JSON, not a 0), and
    # no bus bandwidth ("–", not "algbw × 0")
    assert g["wrong"] is None and g["busbw_GBps"] is None, rep["rows"]
    assert rep["busbw_factor"] is None
    row = [ln for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")][0]
    assert row.split()[-2:] == ["n/a", g["algo"]], row
    assert "busbw = – " in proc.stdout and "× 0" not in proc.stdout, proc.stdout
    assert "out of bounds values : n/a" in proc.stdout


def test_in_place_under_mpiexec():
    """Under a launcher with >1 rank, `gpurt bench` runs on the launch's ranks (and a
    collective without a root ignores -r there too: the ranks refused -r 5)."""
    cmd = [*mpiexec(), "-n", "2", sys.executable, "-m", "gpurt.launch.cli", "bench",
           "reduce_scatter", "-b", "64", "-e", "256", "-f", "4", "-c", "-w", "1", "-i", "2",
           "-r", "5", "--ceiling-size", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, GPURT_TIMEOUT="60"))
    assert proc.returncode == 0, proc.stderr
    assert "2 ranks" in proc.stdout
    assert proc.stdout.count("# gpurt bench") == 1          # rank 0 prints, once
    assert "out of bounds values : 0 OK" in proc.stdout
    bad = subprocess.run([*mpiexec(), "-n", "2", sys.executable, "-m", "gpurt.launch.cli",
                          "bench", "allreduce", "--baseline", "mpi"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "launch of their own" in bad.stderr
    # the nocheck baseline runs in place: a second communicator in the same processes
    both = subprocess.run(cmd[:-2] + ["--ceiling-size", "0", "--baseline", "nocheck"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, GPURT_TIMEOUT="60"))
    assert both.returncode == 0, both.stderr
    assert "nocheck p50(us)" in both.stdout and both.stdout.count("# gpurt bench") == 1


# -- gloo ------------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not importable: the gloo baseline cannot run")
def test_baseline_gloo(tmp_path):
    out = tmp_path / "gloo.json"
    proc = run_bench(["allreduce", "-n", "2", "-b", "1K", "-e", "1K", "-c",
                      "--baseline", "gloo", "--json", str(out)] + QUICK)
    rep = json.loads(out.read_text())
    r = rep["rows"][0]
    assert r["gloo"]["p50_s"] > 0 and r["gloo"]["wrong"] == 0 and r["ratio"]["gloo"] > 0
    assert "torch" in rep["libraries"]["gloo"]["info"]
    assert "gloo p50(us)" in proc.stdout


def test_baseline_gloo_skipped_without_torch(tmp_path):
    """A torch that cannot be imported: one clear line, and gpurt's sweep still runs."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    out = tmp_path / "skip.json"
    pp = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    proc = run_bench(["allreduce", "-n", "2", "-b", "1K", "-e", "1K", "--baseline", "gloo",
                      "--json", str(out)] + QUICK, env={"PYTHONPATH": pp})
    assert "skipping the gloo baseline" in proc.stderr
    assert "cannot import torch" in proc.stderr
    rep = json.loads(out.read_text())
    assert "gloo" in rep["skipped"] and "gloo" not in rep["libraries"]
    assert rep["rows"][0]["gpurt"]["p50_s"] > 0


# -- the checker can fail -------------------------------------------------------------------

@pytest.mark.parametrize("coll", [c for c in B.COLLECTIVES if c != "barrier"])
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("int8", "prod"),
                                      ("bfloat16", "max"), ("float16", "avg"),
                                      ("uint16", "bxor")])
def test_checker_detects_wrong_output(coll, dtype, op):
    n, c, root = 3, 5000, 1
    dt = B.parse_dtype(dtype)
    for r in range(n):
        want = B.expected_output(coll, n, r, c, dt, op, root)
        if want is None:
            assert coll in ("reduce", "gather") and r != root
            continue
        assert B.check_output(coll, n, r, c, dt, op, root, want) == 0
        bad = want.copy()
        bad[len(bad) // 2] = B.sentinel(dt)              # one element never written
        assert B.check_output(coll, n, r, c, dt, op, root, bad) == 1
        bad[:3] = want[:3] + dt.type(1)                 # three more wrong
        assert B.check_output(coll, n, r, c, dt, op, root, bad) == 4


def test_checker_against_numpy_and_chunks(monkeypatch):
    """Expected values agree with a direct NumPy computation from the inputs, also across
    the checker's chunk boundaries (shrunk here) and blocks that straddle them."""
    monkeypatch.setattr(B, "_CHUNK", 64)
    n, c, dt = 3, 1000, np.dtype(np.float32)
    xs = []
    for q in range(n):
        x = np.empty(n * c, dt)
        B.fill_input(x, q, dt, "sum", n, c)
        xs.append(x)
    total = sum(x[:c] for x in xs)
    for r in range(n):
        assert B.check_output("allreduce", n, r, c, dt, "sum", 0, total) == 0
        rs = sum(x[r * c:(r + 1) * c] for x in xs)
        assert B.check_output("reduce_scatter", n, r, c, dt, "sum", 0, rs) == 0
        other = sum(x[(r + 1) % n * c:((r + 1) % n + 1) * c] for x in xs)
        assert B.check_output("reduce_scatter", n, r, c, dt, "sum", 0, other) > 0
    # moves use another pattern (no reduction: larger modulus)
    ys = []
    for q in range(n):
        y = np.empty(n * c, dt)
        B.fill_input(y, q, dt, None, n, c)
        ys.append(y)
    for r in range(n):
        a2a = np.concatenate([ys[q][r * c:(r + 1) * c] for q in range(n)])
        assert B.check_output("alltoall", n, r, c, dt, None, 0, a2a) == 0
        s = (r + 1) % n   # the blocks meant for another rank
        assert B.check_output("alltoall", n, r, c, dt, None, 0,
                              np.concatenate([ys[q][s * c:(s + 1) * c] for q in range(n)])) > 0
        ag = np.concatenate([ys[q][:c] for q in range(n)])
        assert B.check_output("allgather", n, r, c, dt, None, 0, ag) == 0
        # swapping two ranks' blocks is caught
        swapped = np.concatenate([ys[1][:c], ys[0][:c], ys[2][:c]])
        assert B.check_output("allgather", n, r, c, dt, None, 0, swapped) > 0


def test_count_wrong_nan():
    assert B.count_wrong(np.array([1.0, np.nan, 3.0]), np.array([1.0, 2.0, 3.0])) == 1
    assert B.count_wrong(np.array([np.nan]), np.array([np.nan])) == 1


# -- -c: wrong elements fail the run -------------------------------------------------------

def _report(coll: str, wrongs: list[int | None], mpi_wrongs: list[int | None] | None = None,
            check: bool = True) -> dict:
    """A report as ``build_report`` makes it, from made-up launches: sizes 1K, 2K, ... (a
    barrier's 0) with the given #wrong per size (and an mpi baseline's)."""
    def launch(lib, ws):
        return {"lib": lib, "rows": [
            {"size": S << i, "count": S // 4 << i, "p50_s": 1e-5, "p99_s": 2e-5,
             "mean_s": 1.5e-5, "loop_s": 1.2e-5, "wrong": w, "algo": "ring"}
            for i, w in enumerate(ws)],
            "ceiling": None, "info": {}}
    S = 0 if coll == "barrier" else 1024
    launches = {"gpurt": [launch("gpurt", wrongs)]}
    if mpi_wrongs is not None:
        launches["mpi"] = [launch("mpi", mpi_wrongs)]
    cfg = {"collective": coll, "dtype": "float32", "op": "sum", "root": 0, "warmup": 1,
           "iters": 3, "algo": None, "check": check, "repeat": 1, "memory": "host",
           "baselines": ["mpi"] if mpi_wrongs is not None else [], "sizes": []}
    return B.build_report(cfg, 2, launches, {}, ["gpurt", "bench", coll])


def test_wrong_elements_are_reported_and_decide_the_exit_code(monkeypatch):
    """What decides -c's verdict, on made-up results (no ranks run: gpurt gives no wrong
    elements to order): ``wrong_sizes`` names every (library, size) with #wrong > 0, the
    table's footer says FAILED and where, and `gpurt bench` exits 1 saying where — through
    the real click command, with ``run_bench`` replaced by one returning the made-up
    report.  A clean checked run exiting 0 is real: test_allreduce_sweep_json and
    test_every_collective_checked_on_3_ranks (run_bench fails on a non-zero exit), and
    test_checked_pass_fails_for_real below runs a real failing one."""
    from click.testing import CliRunner

    bad = _report("allreduce", [0, 3, 0, 1], mpi_wrongs=[0, 0, 2, 0])
    assert B.wrong_sizes(bad) == [("gpurt", 2048, 3), ("gpurt", 8192, 1), ("mpi", 4096, 2)]
    text = B.format_table(bad)
    assert "# out of bounds values : 6 FAILED" in text
    assert "# wrong elements: gpurt at 2048 B (3 wrong), 8192 B (1 wrong)" in text
    assert "# wrong elements: mpi at 4096 B (2 wrong)" in text
    good = _report("allreduce", [0, 0], mpi_wrongs=[0, 0])
    assert B.wrong_sizes(good) == [] and "out of bounds values : 0 OK" in B.format_table(good)
    unchecked = _report("allreduce", [None, None], check=False)
    assert B.wrong_sizes(unchecked) == [] and "out of bounds" not in B.format_table(unchecked)

    for rep, code in ((bad, 1), (good, 0), (unchecked, 0)):
        monkeypatch.setattr(B, "run_bench", lambda *a, rep=rep, **k: rep)
        res = CliRunner().invoke(B.bench_command, ["allreduce", "-n", "2", "-c"])
        assert res.exit_code == code, (res.output, res.exception)
        if code:
            assert ("the checked pass (-c) found wrong elements: gpurt at 2048 B (3 wrong), "
                    "8192 B (1 wrong); mpi at 4096 B (2 wrong)") in res.output, res.output


BREAK_RANK_1 = """
import sys
import gpurt.comm
from gpurt.launch.cli import main

real = gpurt.comm.Communicator.allreduce


def allreduce(self, x, out=None, *args, **kwargs):
    # the fault under test: rank 1's result is off by one in its first element
    res = real(self, x, out, *args, **kwargs)
    if self.rank == 1:
        (x if out is None else out).reshape(-1)[0] += 1
    return res


gpurt.comm.Communicator.allreduce = allreduce
main(sys.argv[1:])
"""


def test_checked_pass_fails_for_real(tmp_path):
    """A real checked run on 2 ranks (mpiexec, in place: `gpurt bench` under the launcher)
    whose only fake part is the fault: a wrapper around Communicator.allreduce, installed
    by the script that starts the command, adds 1 to rank 1's first output element.  The
    checker finds 1 wrong element per size, and the run exits non-zero saying where."""
    script = tmp_path / "break_rank_1.py"
    script.write_text(BREAK_RANK_1)
    cmd = [*mpiexec(), "-n", "2", sys.executable, str(script), "bench", "allreduce", "-b", "64",
           "-e", "256", "-f", "4", "-c", "-w", "1", "-i", "2", "--ceiling-size", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, GPURT_TIMEOUT="60"))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "# out of bounds values : 2 FAILED" in proc.stdout, proc.stdout
    assert "# wrong elements: gpurt at 64 B (1 wrong), 256 B (1 wrong)" in proc.stdout
    assert "found wrong elements: gpurt at 64 B (1 wrong), 256 B (1 wrong)" in proc.stderr


def test_barrier_table_says_na():
    """A barrier moves no data and has no output: busbw is "–" in the header (not
    "algbw × 0"), null in the JSON, and a -c run's #wrong is n/a, not 0 (made-up rows;
    the real run is test_every_collective_checked_on_3_ranks[barrier])."""
    rep = _report("barrier", [None])
    text = B.format_table(rep)
    assert "busbw = – (no data moves)" in text and "× 0" not in text, text
    assert rep["busbw_factor"] is None and json.loads(json.dumps(rep))["busbw_factor"] is None
    row = [ln for ln in text.splitlines() if not ln.startswith("#")][0]
    assert row.split()[-2:] == ["n/a", "ring"], row
    assert "out of bounds values : n/a" in text
    assert "busbw = algbw × 1;" in B.format_table(_report("allreduce", [0]))   # 2(n-1)/n


# -- usage errors: refused before any rank starts -----------------------------------------

class _Launched(Exception):
    pass


def _invoke(args: list[str], monkeypatch, env: dict | None = None):
    """`gpurt bench ARGS` in this process (click's CliRunner) with the launches replaced:
    ``_launch`` (mpiexec) and ``worker`` (in place under a launcher) raise _Launched, so
    a usage error must come before them (and ``_fail``, which would MPI_Abort this
    process, passes it on).  SIGALRM bounds it: a sweep that never ends fails the test in
    20 s instead of hanging it."""
    import signal

    from click.testing import CliRunner

    def launched(*a, **k):
        raise _Launched()

    def reraise(cfg, e):
        raise e

    def too_long(*a):
        raise TimeoutError("gpurt bench did not return within 20 s")

    monkeypatch.setattr(B, "_launch", launched)
    monkeypatch.setattr(B, "worker", launched)
    monkeypatch.setattr(B, "_fail", reraise)
    old = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(20)
    try:
        return CliRunner().invoke(B.bench_command, args, env=env)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _usage_error(res, option: str, *words: str) -> None:
    assert res.exit_code == 2, (res.output, repr(res.exception))
    assert f"Invalid value for {option}" in res.output, res.output
    for w in words:
        assert w in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("args,option,words", [
    (["-b", "0"], "'-b' / '--minbytes'", ["'0': must be at least 1 byte"]),
    (["-b", "0.5"], "'-b' / '--minbytes'", ["0.5 bytes is not a whole number"]),
    (["-b", "inf"], "'-b' / '--minbytes'", ["'inf': not a finite number"]),
    (["-e", "nan"], "'-e' / '--maxbytes'", ["'nan': not a finite number"]),
    (["-e", "0"], "'-e' / '--maxbytes'", ["at least 1 byte"]),
    (["-b", "4M", "-e", "1K"], "'-b' / '--minbytes'", ["4M is larger than -e 1K"]),
    (["-f", "1"], "'-f' / '--stepfactor'", ["1: must be 2 or more when -b is smaller"]),
    (["-b", "8", "-e", "16", "-f", "1"], "'-f' / '--stepfactor'", ["2 or more"]),
    (["-f", "0.5"], "'-f' / '--stepfactor'", ["0.5"]),
    (["-f", "0"], "'-f' / '--stepfactor'", []),
])
def test_bad_sizes_are_usage_errors(args, option, words, monkeypatch):
    """-b 0 (or 0.5, which truncated to 0) made the size loop spin forever, -b inf raised
    OverflowError: usage errors naming the option now, before any launch."""
    for coll in ("allreduce", "barrier"):
        _usage_error(_invoke([coll, "-n", "2"] + args, monkeypatch), option, *words)


def test_good_sizes_are_launched(monkeypatch):
    """What is fine gets to the launch: one size with -f 1 (as nccl-tests), a fraction
    that makes whole bytes."""
    for args in (["-b", "1K", "-e", "1K", "-f", "1"], ["-b", "1.5K", "-e", "3K"],
                 ["-b", "1", "-e", "1"]):
        res = _invoke(["allreduce", "-n", "2"] + args, monkeypatch)
        assert isinstance(res.exception, _Launched), (args, res.output, res.exception)
    assert B.parse_size("1.5K") == 1536 and B.parse_size("0") == 0   # --ceiling-size 0
    for bad in ("inf", "-inf", "nan", "0.5", "1.3K"):
        with pytest.raises(ValueError):
            B.parse_size(bad)
    with pytest.raises(ValueError):                 # not a loop that never ends
        B.sweep_sizes("allreduce", 2, 4, 0, 64, 2)


def test_root_and_algo_are_checked_before_the_launch(monkeypatch):
    """A root beyond the ranks and an algorithm the collective does not have were found
    only on the ranks, after the launch: now usage errors naming the option — the root
    against -n, the default 2 ranks, or the launch's size when running in place (only
    rank 0 says so); the algorithm against gpurt/algorithms' REGISTRY (aliases, and the
    native protocols and hierarchical form where the collective has them, accepted)."""
    _usage_error(_invoke(["reduce", "-r", "5"], monkeypatch), "'-r' / '--root'",
                 "5 is not a rank of the 2 ranks launched (-n defaults to 2)")
    _usage_error(_invoke(["scatter", "-r", "2"], monkeypatch), "'-r' / '--root'")
    _usage_error(_invoke(["gather", "-n", "3", "-r", "3"], monkeypatch), "'-r' / '--root'",
                 "3 is not a rank of -n 3")
    # in place under an MPI launcher of 3 ranks: its size decides; rank 1 exits quietly
    under = {"PMI_SIZE": "3", "PMI_RANK": "0"}
    _usage_error(_invoke(["broadcast", "-r", "3"], monkeypatch, under), "'-r' / '--root'",
                 "3 is not a rank of this launch's 3 ranks")
    res = _invoke(["broadcast", "-r", "3"], monkeypatch, dict(under, PMI_RANK="1"))
    assert res.exit_code == 2 and res.output == "", res.output
    res = _invoke(["broadcast", "-r", "2"], monkeypatch, under)
    assert isinstance(res.exception, _Launched), (res.output, res.exception)
    for args in (["reduce", "-r", "1"], ["reduce", "-n", "4", "-r", "3"],
                 ["barrier", "-r", "7"]):           # not rooted: -r does not apply
        res = _invoke(args, monkeypatch)
        assert isinstance(res.exception, _Launched), (args, res.output, res.exception)

    _usage_error(_invoke(["allreduce", "--algo", "nosuch"], monkeypatch), "'--algo'",
                 "'nosuch' is not an algorithm of allreduce", "ring", "recursive_doubling")
    _usage_error(_invoke(["gather", "--algo", "shm_direct"], monkeypatch), "'--algo'")
    _usage_error(_invoke(["barrier", "--algo", "ring"], monkeypatch), "'--algo'")
    for coll, algo in (("allreduce", "ring"), ("allreduce", "rd"), ("reduce", "tree"),
                       ("allreduce", "shm_direct"), ("barrier", "shm_board"),
                       ("allgather", "hierarchical"), ("broadcast", "hier")):
        res = _invoke([coll, "--algo", algo], monkeypatch)
        assert isinstance(res.exception, _Launched), (coll, algo, res.output, res.exception)


def test_algo_names_run_on_the_ranks():
    """Every name algo_names lets through is one the ranks take: on 2 ranks of one node,
    each collective forced to each of its names through bench's own calls runs (bench's
    check refuses only what is no algorithm of the collective, never one the ranks would
    run; hierarchical on one node is a single-stage plan)."""
    code = ("import numpy as np\n"
            "from gpurt.launch import bench as B\n"
            "lib = B._GpurtLib()\n"
            "n, r, runs, bad = lib.size, lib.rank, 0, []\n"
            "for coll in B.COLLECTIVES:\n"
            "    if coll == 'sendrecv':\n"
            "        continue\n"
            "    c, nin, nout = B.layout(coll, n, r, 0 if coll == 'barrier' else 16 * n, 4)\n"
            "    for a in B.algo_names(coll):\n"
            "        x, y = np.ones(nin, np.float32), np.zeros(nout, np.float32)\n"
            "        try:\n"
            "            lib.make(coll, x, y, 'sum', 0, a)()\n"
            "            runs += 1\n"
            "        except ValueError as e:\n"
            "            bad.append((coll, a, str(e)))\n"
            "lib.close()\n"
            "if r == 0:\n"
            "    print('ran', runs, 'refused', bad, flush=True)\n")
    out = run_mpi(2, ["-c", code], timeout=120).stdout
    names = sum(len(B.algo_names(c)) for c in B.COLLECTIVES if c != "sendrecv")
    assert f"ran {names} refused []" in out, out


# -- pure helpers -------------------------------------------------------------------------

def test_sizes_and_formulas():
    assert B.parse_size("8") == 8 and B.parse_size("64K") == 65536
    assert B.parse_size("256M") == 256 << 20 and B.parse_size("1G") == 1 << 30
    assert B.parse_size("4KiB") == 4096 and B.parse_size("2kb") == 2048
    with pytest.raises(ValueError):
        B.parse_size("lots")
    # blocked collectives round down to itemsize x nranks; zero becomes one unit
    assert B.sweep_sizes("allgather", 3, 4, 8, 100, 2) == [12, 24, 60]
    assert B.sweep_sizes("allreduce", 3, 4, 8, 64, 2) == [8, 16, 32, 64]
    assert B.sweep_sizes("barrier", 3, 4, 8, 1 << 20, 2) == [0]
    with pytest.raises(ValueError):
        B.sweep_sizes("allreduce", 2, 4, 8, 64, 1)
    assert B.busbw_factor("allreduce", 4) == pytest.approx(1.5)
    assert B.busbw_factor("alltoall", 4) == pytest.approx(0.75)
    assert B.busbw_factor("broadcast", 4) == 1.0
    # nccl-tests' GatherGetBw / ScatterGetBw: (n-1)/n, the root's own block never moves
    assert B.busbw_factor("gather", 4) == pytest.approx(0.75)
    assert B.busbw_factor("scatter", 3) == pytest.approx(2 / 3)
    assert B.min_bytes_per_rank("allreduce", 4, 1000) == 2000
    assert B.min_bytes_per_rank("allgather", 4, 1000) == 1250
    assert B.min_bytes_per_rank("gather", 4, 1000) == 500
    assert B.ceiling_busbw("allreduce", 4, 10e9) == pytest.approx(7.5)
    assert B.layout("scatter", 3, 0, 96, 4, root=0) == (8, 24, 8)
    assert B.layout("scatter", 3, 1, 96, 4, root=0) == (8, 0, 8)
    assert B.launcher_size({"PMI_SIZE": "4"}) == 4
    assert B.launcher_size({"OMPI_COMM_WORLD_SIZE": "3"}) == 3
    assert B.launcher_size({}) == 1


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"size": s, "p50_s": 1e-4 * (i + 1), "busbw_GBps": 0.1 * (i + 1)}
            for i, s in enumerate([8, 1024, 1 << 20])]
    rep = {"collective": "allreduce", "nranks": 2, "config": {"dtype": "float32"},
           "machine": {"hostname": "h"}, "rows": rows,
           "ceiling": {"busbw_equivalent_GBps": 2.0},
           "libraries": {"gpurt": {"rows": rows}, "mpi": {"rows": rows}}}
    B.plot(rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("coll", B.COLLECTIVES)
def test_every_collective_on_device_buffers_standin(coll, tmp_path):
    """--memory standin: the same checked sweep through the device path on gpurt's
    host-memory stand-in for a GPU (not a GPU: only #wrong and the plumbing count here),
    with the device-copy ceiling."""
    out = tmp_path / f"{coll}-dev.json"
    args = [coll, "-n", "3", "-b", "96", "-e", "96K", "-f", "1024", "-w", "1", "-i", "2",
            "-c", "--memory", "standin", "--ceiling-size", "1M", "--json", str(out)]
    if coll in B.ROOTED:
        args += ["-r", "2"]
    run_bench(args)
    rep = json.loads(out.read_text())
    assert rep["config"]["memory"] == "standin"
    assert rep["ceiling"]["best"]["memory"] == "standin"
    assert len(rep["rows"]) == (1 if coll == "barrier" else 2)
    for row in rep["rows"]:
        assert row["gpurt"]["wrong"] == (None if coll == "barrier" else 0), rep["rows"]


def test_device_memory_refuses_host_only_baselines():
    proc = run_bench(["allreduce", "-n", "2", "--memory", "standin", "--baseline", "mpi"],
                     check=False)
    assert proc.returncode != 0 and "host buffers only" in proc.stderr, proc.stderr


def test_direct_ab_script_runs():
    """benchmarks/direct_ab.py (how shm_direct's thresholds were chosen) runs and times
    both variants, each taking the path it names."""
    out = run_mpi(2, ["benchmarks/direct_ab.py", "reduce_scatter", "1M", "shared,numpy",
                      "--rounds", "1"]).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("reduce_scatter 2 ranks")]
    assert len(lines) == 4, out
    for ln in lines:
        want = "ran shm_direct" if " shm_direct " in ln else "ran "
        assert want in ln and ("shm_direct" in ln.split("ran ")[1]) == (" shm_direct " in ln), ln


@pytest.mark.parametrize("coll,op", [("reduce_scatter", "sum"), ("alltoall", None),
                                     ("scatter", None)])
@pytest.mark.parametrize("dtype", ["float32", "int8", "uint8", "float16"])
def test_checker_tells_a_ranks_blocks_apart_at_every_count(coll, op, dtype):
    """A collective that delivers another block of the right rank is caught whatever the
    per-rank count: with the pattern indexed over the whole buffer, block b was block 0
    shifted by b·(7c + 3) — a whole period when 7c + 3 ≡ 0 (mod M), e.g. c = 3 for the
    reductions' M = 8 (reduce_scatter -n 5 at 60 B, 1020 B, ... 64 MiB), c = 54 for int8."""
    dt = B.parse_dtype(dtype)
    for n in (2, 3, 5):
        for c in list(range(1, 60)) + [1169]:
            ys = []
            for q in range(n):
                y = np.empty(n * c, dt)
                B.fill_input(y, q, dt, op, n, c)
                ys.append(y)
            r, s = 0, 1           # rank 0 gets the block meant for rank 1
            if coll == "reduce_scatter":
                got = ys[0][s * c:(s + 1) * c].copy()
                for q in range(1, n):
                    got = (got + ys[q][s * c:(s + 1) * c]).astype(dt)
            elif coll == "alltoall":
                got = np.concatenate([ys[q][s * c:(s + 1) * c] for q in range(n)])
            else:
                got = ys[0][s * c:(s + 1) * c].copy()
            assert B.check_output(coll, n, r, c, dt, op, 0, got) > 0, (n, c)


def test_baseline_mpi_reduces_bools_with_the_logical_ops(tmp_path):
    """MPI_C_BOOL takes only MPI's logical ops: a bool max/min/bor/band/bxor through
    MPI_MAX... ended the mpi run with mpi4py's traceback ('MPI_Op operation not defined
    for this datatype') and the sweep's results lost; the baseline now maps them to
    LOR/LAND/LXOR, which compute on bools what gpurt's ops do — checked (-c) on 3 ranks."""
    for op in ("max", "bxor"):
        out = tmp_path / f"{op}.json"
        run_bench(["allreduce", "-n", "3", "-d", "bool", "-o", op, "-b", "8", "-e", "1K",
                   "-f", "16", "-c", "--baseline", "mpi", "--json", str(out)] + QUICK)
        rows = json.loads(out.read_text())["rows"]
        assert rows and all(r["mpi"]["wrong"] == 0 and r["gpurt"]["wrong"] == 0
                            for r in rows), rows


def test_baseline_refusals_are_before_the_launch(monkeypatch):
    """What a baseline cannot run is a usage error before any rank starts (gloo: no
    int16/uint16/uint32/uint64, complex reductions only with sum; before, a traceback
    after gpurt's whole sweep, its results lost); nocheck is gpurt itself, so avg and
    bfloat16 are not refused with it (they were, as 'MPI and gloo have no AVG op');
    --json/--plot into a missing directory is refused first (it was a FileNotFoundError
    after the sweep)."""
    for args, words in ((["alltoall", "-d", "uint32", "--baseline", "gloo"], "gloo has no uint32"),
                        (["allreduce", "-d", "complex64", "-o", "prod", "--baseline", "gloo"],
                         "gloo reduces complex tensors with sum only"),
                        (["allreduce", "-o", "avg", "--baseline", "mpi"], "no AVG op")):
        res = _invoke(args, monkeypatch)
        assert res.exit_code == 2 and words in res.output, (args, res.output)
        assert "Traceback" not in res.output
    for args in (["allreduce", "-o", "avg", "--baseline", "nocheck"],
                 ["allreduce", "-d", "bfloat16", "--baseline", "nocheck"],
                 ["allgather", "-d", "complex64", "--baseline", "gloo"]):
        res = _invoke(args, monkeypatch)
        assert isinstance(res.exception, _Launched), (args, res.output, res.exception)
    for opt in ("--json", "--plot"):
        _usage_error(_invoke(["allgather", opt, "/nonexistent/dir/x.out"], monkeypatch),
                     f"'{opt}'", "no directory /nonexistent/dir")


def _mpich_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("mpich_shm_")}


def test_a_bad_argument_on_every_rank_ends_the_job_without_a_leftover_segment():
    """--algo shm_board past the board's size: every rank raises the same ValueError.
    They now all end normally (exit 1, one line each) instead of MPI_Abort, which left
    MPICH's shared-memory segment in /dev/shm every time (bug hunt)."""
    before = _mpich_segments()
    proc = run_bench(["allreduce", "-n", "2", "-b", "1M", "-e", "1M", "--algo", "shm_board",
                      *QUICK], check=False)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "shm_board cannot take 1048576 bytes" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    from gpurt.launch.launcher import _orphaned

    new = _orphaned(sorted(_mpich_segments() - before))   # (not another live job's)
    assert not new, f"left in /dev/shm: {new}"


def test_a_memory_error_is_one_line_not_a_traceback(capsys):
    """A size of the sweep this host cannot allocate: a line saying so and what to do
    (the whole NumPy traceback of every rank before; the bug hunt's -e 1T)."""
    B._fail({"lib": "gpurt"}, MemoryError("Unable to allocate 1.00 TiB"), together=0.5)
    err = capsys.readouterr().err
    assert "cannot allocate the buffers of a size of the sweep (Unable to allocate 1.00 " \
           "TiB): a smaller -e" in err and "Traceback" not in err, err


def test_a_failure_after_mpi_ended_in_the_process_is_reported_not_aborted():
    """_fail in a process whose MPI was finalized (a pytest process that ran another
    test's communicators first): it reports and returns; the barrier it used to try
    raised there and its MPI_Abort killed the whole process."""
    code = ("from mpi4py import MPI; MPI.Finalize()\n"
            "from launch import bench\n"
            "bench._fail({'lib': 'gpurt'}, ValueError('bad -b'), together=0.5)\n"
            "print('returned')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=str(ROOT))
    assert proc.returncode == 0 and "returned" in proc.stdout, (proc.returncode, proc.stderr)
    assert "gpurt bench: gpurt on rank 0: ValueError: bad -b" in proc.stderr, proc.stderr


def test_an_output_path_that_cannot_be_written_is_refused_before_the_launch(tmp_path):
    """--json into /proc (os.access says yes to root there): the write is tried before
    the sweep, not after it (the measurements were lost to a FileNotFoundError)."""
    proc = run_bench(["allreduce", "-n", "1", "-e", "64", "--json", "/proc/gpurt-x.json"],
                     check=False)
    assert proc.returncode == 2 and "not writable here" in proc.stderr, proc.stderr
    ok = tmp_path / "r.json"
    B.check_writable_path(str(ok), "--json")       # creatable: passes, leaves nothing
    assert not ok.exists()
    ok.write_text("keep")
    B.check_writable_path(str(ok), "--json")       # existing: passes, untouched
    assert ok.read_text() == "keep"
    fifo = tmp_path / "fifo"                        # no reader: not opened (it would block)
    os.mkfifo(fifo)
    B.check_writable_path(str(fifo), "--json")
    link = tmp_path / "link.json"                   # dangling: where the write would go
    link.symlink_to(tmp_path / "target.json")
    B.check_writable_path(str(link), "--json")
    assert not (tmp_path / "target.json").exists()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["fifo", "link.json", "r.json"]


def test_an_unwritable_output_path_ends_every_rank_in_place(tmp_path):
    """In place under mpiexec, a --json rank 0 cannot write: rank 0 refused it and left,
    the other ranks (which never checked) went into the sweep and waited for it forever
    (bug hunt).  Rank 0's verdict is every rank's now: all exit 2 at once, one message.
    And it is rank 0's, not each rank's own (rank 0 writes the file; other nodes may not
    even have its directory): with working directories that differ per rank, the
    directory on rank 0's side only runs and writes there; on the other side only, every
    rank is refused."""
    bench = [sys.executable, "-m", "gpurt.launch.cli", "bench", "allreduce", "-b", "64",
             "-e", "64", "-w", "1", "-i", "2", "--ceiling-size", "0"]
    env = dict(os.environ, GPURT_TIMEOUT="60")
    before = _mpich_segments()
    proc = subprocess.run([*mpiexec(), "-n", "2", *bench, "--json", "/nonexistent/dir/x.json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.count("Error: Invalid value for '--json': /nonexistent/dir/x.json: "
                             "no directory /nonexistent/dir\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "[gpurt" not in proc.stderr, proc.stderr
    from gpurt.launch.launcher import _orphaned

    new = _orphaned(sorted(_mpich_segments() - before))   # (not another live job's)
    assert not new, f"left in /dev/shm: {new}"            # (every rank ended MPI normally)
    if not is_hydra():
        return            # (a working directory per rank: hydra's MPMD -wdir below)
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "out").mkdir(parents=True)
    b.mkdir()

    def per_rank_cwd() -> subprocess.CompletedProcess:
        cmd = [*mpiexec(), "-n", "1", "-wdir", str(a), *bench, "--json", "out/r.json", ":",
               "-n", "1", "-wdir", str(b), *bench, "--json", "out/r.json"]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)

    ok = per_rank_cwd()           # rank 0's directory is there, rank 1's is not
    assert ok.returncode == 0, ok.stderr
    assert json.loads((a / "out" / "r.json").read_text())["nranks"] == 2
    (a / "out" / "r.json").unlink()
    (a / "out").rename(b / "out")
    bad = per_rank_cwd()          # rank 1's is, rank 0's is not
    assert bad.returncode == 2, (bad.returncode, bad.stderr)
    assert bad.stderr.count(f"no directory {a / 'out'}\n") == 1, bad.stderr
    assert list((b / "out").iterdir()) == []


def test_no_rank_spins_in_mpi_while_another_still_times(monkeypatch):
    """With more ranks than cores, a rank done with its timed loop spun in MPI (the next
    block's Barrier, the gather of the times) and took the CPU from a rank still in its
    last timed call: that iteration came out 200-3900 us against ~20 (3 ranks on 2
    cores), dragging loop, mean, p99 and lratio with it (bug hunt).  Every timed loop — a
    library alone in its launch (gpurt, mpi, gloo), or gpurt and its paired nocheck — now
    ends in a yielding barrier before any other control call, and so does each timed copy
    of the memory ceiling.  (The order is under test, with fakes: timings would be flaky.)"""
    import types
    calls: list[str] = []

    class Ctl:
        def Barrier(self):
            calls.append("|")

        def gather(self, x, root):
            calls.append("g")
            return [x]

        def reduce(self, x, root):
            calls.append("r")
            return x

        def allreduce(self, x, op):
            calls.append("a")
            return x

        def bcast(self, x, root):
            calls.append("b")
            return x

        def Get_rank(self):
            return 0

    yielding = B._yielding_barrier
    monkeypatch.setattr(B, "_yielding_barrier", lambda comm: calls.append("y"))
    monkeypatch.setattr(B, "_quiet_barrier", lambda comm: calls.append("q"))
    mpi = types.SimpleNamespace(Get_library_version=lambda: "fake MPI", MAX="max")
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=mpi))
    cfg = {"collective": "allreduce", "sizes": [64, 128], "dtype": "float32", "op": "sum",
           "root": 0, "warmup": 1, "iters": 3, "algo": None, "check": True,
           "memory": "host", "label": "t"}
    # warm-up, timed loop, then the times and the check pass
    B._sweep([_fake_lib(calls, Ctl(), "m")], cfg)
    assert "".join(calls) == "m|mmmyg|mr" * 2
    calls.clear()
    B._sweep([_fake_lib(calls, Ctl(), n) for n in "ab"],
             dict(cfg, check=False))       # 3 blocks of 1 iteration
    assert "".join(calls) == ("ab" + "|ay|by" + "|by|ay" + "|ay|by" + "gg") * 2
    calls.clear()
    B.measure_ceiling(Ctl(), 1024, reps=2)     # (then rank 0 alone: others sleep there)
    assert "".join(calls) == "|ya|yaqqb"
    # the barrier gives its CPU away between polls and never sleeps: ranks that slept
    # (_quiet_barrier) ran the next timed block slower, every call of it
    polls = iter([False, False, True])
    yields: list[int] = []
    monkeypatch.setattr(B.os, "sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(B.time, "sleep", lambda s: pytest.fail("slept"))
    yielding(types.SimpleNamespace(Ibarrier=lambda: types.SimpleNamespace(
        Test=lambda: next(polls))))
    assert yields == [1, 1]


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (a zombie's is empty)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and text.encode() in Path(f"/proc/{d}/cmdline").read_bytes():
                out.append(int(d))
        except OSError:
            pass
    return out


def test_a_signal_while_the_launch_starts_stops_it(tmp_path):
    """A SIGTERM that came inside `subprocess.Popen` (after the fork) or before its result
    was assigned raised `_Stopped` where no one knew the launch: mpiexec ran on until
    PR_SET_PDEATHSIG ended it with bench, its MPICH segment unremoved (tools gap of an
    earlier session). `_run_launch` holds the signal while the launch starts, then stops
    the launch and raises. (Popen is wrapped in the child process to send the signal
    right after the fork; the process sleeps a while after `_Stopped` so that a launch
    left running shows.)"""
    token = str(tmp_path / "bench-under-signal")
    prog = SIGNAL_AFTER_POPEN + textwrap.dedent(f"""
        from gpurt.launch import bench as B
        token = os.environ["TOKEN"]      # (not in this process's own command line)
        cmd = [sys.executable, "-c", "import time; time.sleep(60)", token]
        try:
            with B._stop_on_signals():
                B._run_launch(cmd, dict(os.environ), token, set())
        except B._Stopped as e:
            print("stopped", e.signum, flush=True)
            time.sleep(3)
        """)
    p = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, TOKEN=token))
    assert p.returncode == 0 and p.stdout == f"stopped {int(signal.SIGTERM)}\n", \
        (p.returncode, p.stdout, p.stderr)
    assert _processes_with(token) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_signal_stops_the_whole_job_and_leaves_nothing(sig, tmp_path):
    """SIGTERM to `gpurt bench` ended it alone (rc -15, no word): its mpiexec, both ranks,
    its /tmp/gpurt-bench-* directory and MPICH's segment in /dev/shm stayed (bug hunt).
    Now, as `gpurt launch`: the job is stopped, 128 + N, one line; and the directory and
    the segment are removed.  The job runs with a /dev/shm of its own (a directory bound
    over it in a private mount namespace), so that what it leaves is told apart from
    other jobs' segments on this machine."""
    shm = private_shm(tmp_path)
    if shm is None:
        pytest.skip("needs root and unshare -m (a private /dev/shm)")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), GPURT_TIMEOUT="60",
               GPURT_MPIEXEC=shlex.join(mpiexec()))
    cmd = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /dev/shm && exec "$@"', str(shm),
           str(GPURT) if GPURT.exists() else sys.executable, *([] if GPURT.exists() else
                                                              ["-m", "gpurt.launch.cli"]),
           "bench", "allreduce", "-n", "2", "-b", "8", "-e", "64M", "-i", "2000",
           "--ceiling-size", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    running = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            err.append(line)
            if line.startswith("[gpurt 1/1] allreduce"):   # (a size measured: MPI is up)
                running.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert running.wait(60), "".join(err)
        job = _processes_with(str(tmp))         # mpiexec and the two ranks
        assert len(job) == 3, job
        assert [f for f in os.listdir(shm) if f.startswith("mpich_shm_")], os.listdir(shm)
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_with(str(tmp)):
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=10)
    text = "".join(err)
    assert rc == 128 + sig, (rc, text[-3000:])
    assert text.endswith(f"gpurt bench: {signal.Signals(sig).name}: stopped every rank\n")
    assert "Traceback" not in text, text[-3000:]
    assert _processes_with(str(tmp)) == []
    assert os.listdir(tmp) == []
    assert os.listdir(shm) == []


def test_a_launcher_that_cannot_start_is_one_line(tmp_path):
    """$GPURT_MPIEXEC that does not exist: a FileNotFoundError traceback before; one line
    now, as `gpurt launch` says it, and no directory left behind."""
    proc = run_bench(["allreduce", "-e", "64", "--ceiling-size", "0"], check=False,
                     env={"GPURT_MPIEXEC": "/nonexistent/mpiexec", "TMPDIR": str(tmp_path)})
    assert_cannot_start(proc, "/nonexistent/mpiexec", 2)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_json_that_fails_at_the_end_is_one_line_after_the_table():
    """--json /dev/full passes the check before the sweep (a device: asked, not opened)
    and its write fails after it: an OSError traceback before, the numbers lost; now the
    table is printed (stdout) and one line says which file could not be written, why."""
    proc = run_bench(["allreduce", "-n", "2", "-b", "8", "-e", "64", "-f", "8", "-w", "1",
                      "-i", "2", "--ceiling-size", "0", "--json", "/dev/full"], check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    rows = [ln.split()[0] for ln in proc.stdout.splitlines() if ln and ln[0] != "#"]
    assert rows == ["8", "64"], proc.stdout
    assert proc.stderr.endswith("\nError: could not write --json /dev/full (No space left "
                                "on device); the numbers are in the table printed to "
                                "stdout\n"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_plot_file_matplotlib_cannot_write_is_refused_before_the_launch(monkeypatch,
                                                                          tmp_path):
    """--plot plot.txt ran the whole sweep, then ended in matplotlib's traceback; --plot
    NAME (no extension) logged 'wrote NAME' but wrote NAME.png (bug hunt). An extension
    matplotlib cannot write is a usage error now, before the launch; no extension is a PNG
    written to NAME itself."""
    pytest.importorskip("matplotlib")
    for name in ("plot.txt", "plot.json", "plot.pgf" if not __import__("shutil").which(
            __import__("matplotlib").rcParams["pgf.texsystem"]) else "plot.xyz"):
        res = _invoke(["allreduce", "-n", "2", "--plot", str(tmp_path / name)], monkeypatch)
        _usage_error(res, "'--plot'", "matplotlib cannot write", ".png")
        assert not isinstance(res.exception, _Launched)
    assert B.plot_format("p") == "png" and B.plot_format("d.x/p") == "png"
    assert B.plot_format("p.SVG") == "svg" and B.plot_format("p.pdf") == "pdf"
    res = _invoke(["allreduce", "-n", "2", "--plot", str(tmp_path / "p.svg")], monkeypatch)
    assert isinstance(res.exception, _Launched), (res.output, res.exception)
    rows = [{"size": s, "p50_s": 1e-4, "busbw_GBps": 0.1} for s in (8, 1024)]
    rep = {"collective": "allreduce", "nranks": 2, "config": {"dtype": "float32"},
           "machine": {"hostname": "h"}, "rows": rows, "ceiling": {},
           "libraries": {"gpurt": {"rows": rows}}}
    B.plot(rep, str(tmp_path / "noext"))
    assert (tmp_path / "noext").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "noext.png").exists()
    B.plot(rep, str(tmp_path / "p.svg"))
    assert b"<svg" in (tmp_path / "p.svg").read_bytes()[:500]


def test_log_writes_each_line_in_one_write(monkeypatch):
    """print() wrote the message and its newline separately: with PYTHONUNBUFFERED=1 the
    lines of ranks writing at once ran into each other (bug hunt)."""
    writes = []

    class Err:
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Err())
    B._log("gpurt bench: a line")
    assert writes == ["gpurt bench: a line\n"]
