"""`gpurt tune` writes a profile; GPURT_PROFILE makes the tuner follow it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, assert_cannot_start, run_mpi

USE_PROFILE = """
import numpy as np, gpurt, json, sys
prof = json.load(open(sys.argv[1]))
c = gpurt.init()
for S, best, times in prof["entries"]["allreduce"]:
    x = np.ones(max(1, S // 4), np.float32)
    c.allreduce(x)
    assert c.last_algorithm == best, (S, c.last_algorithm, best)
    assert "(measured: GPURT_PROFILE)" in c.explain("allreduce", S) or best == \\
        [d for d in c.candidates("allreduce", S) if d["chosen"]][0]["algorithm"]
ok = c.mpi.gather(True, 0)        # one line from rank 0: hydra interleaves ranks' output
if c.rank == 0:
    print(f"{sum(ok)} ranks followed the profile", flush=True)
"""


def test_tune_writes_a_profile_the_tuner_follows(tmp_path):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "gpurt.launch.cli", "tune", "-n", "2", "-c",
                           "allreduce", "-b", "8", "-e", "1M", "-f", "32", "-w", "1", "-i", "3",
                           "-o", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "within 10% of the best at" in proc.stdout
    prof = json.loads(out.read_text())
    assert prof["nranks"] == 2 and prof["version"] == 1
    rows = prof["entries"]["allreduce"]
    assert [r[0] for r in rows] == [8, 256, 8192, 262144]
    for S, best, times in rows:
        assert best == min(times, key=times.get) and all(t > 0 for t in times.values())
    (tmp_path / "use.py").write_text(USE_PROFILE)
    res = run_mpi(2, [str(tmp_path / "use.py"), str(out)], env={"GPURT_PROFILE": str(out)})
    assert "2 ranks followed the profile" in res.stdout, res.stdout


def test_a_profile_that_picks_shm_direct_is_followed_and_explained(tmp_path):
    """A profile whose fastest is shm_direct (decided outside the tuner's table) at sizes
    below its own threshold: the calls take it, and explain() says the profile chose it —
    it said 'S >= its threshold', with no '(measured: GPURT_PROFILE)', which failed
    test_tune_writes_a_profile_the_tuner_follows whenever a loaded machine measured
    shm_direct fastest at some size."""
    rows = [[S, "shm_direct", {"shm_direct": 1e-6, "ring": 1e-3, "shm_board": 1e-3}]
            for S in (8, 256, 8192, 262144)]
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"version": 1, "nranks": 2, "nnodes": 1,
                             "entries": {"allreduce": rows}}))
    (tmp_path / "use.py").write_text(USE_PROFILE)
    res = run_mpi(2, [str(tmp_path / "use.py"), str(f)], env={"GPURT_PROFILE": str(f)})
    assert "2 ranks followed the profile" in res.stdout, res.stdout


def test_a_handmade_profile_decides_and_a_bad_one_is_an_error(tmp_path):
    prof = {"version": 1, "nranks": 3, "nnodes": 1,
            "entries": {"allreduce": [[8, "ring", {}], [1 << 20, "recursive_doubling", {}]]}}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(prof))
    code = ("import numpy as np, gpurt\n"
            "c = gpurt.init()\n"
            "c.allreduce(np.ones(4, np.float32)); a = c.last_algorithm\n"
            "c.allreduce(np.ones(1 << 19, np.float32)); b = c.last_algorithm\n"
            "got = c.mpi.gather((a, b), 0)\n"
            "if c.rank == 0: print('got', sorted(set(got)), len(got), flush=True)\n")
    res = run_mpi(3, ["-c", code], env={"GPURT_PROFILE": str(f)})
    assert "got [('ring', 'recursive_doubling')] 3" in res.stdout, res.stdout
    # another shape (2 ranks): the profile does not apply, the model decides
    res = run_mpi(2, ["-c", code], env={"GPURT_PROFILE": str(f)})
    assert "got [('ring', 'recursive_doubling')]" not in res.stdout
    res = run_mpi(2, ["-c", code], env={"GPURT_PROFILE": str(tmp_path / "missing.json")},
                  check=False)
    assert res.returncode != 0 and "GPURT_PROFILE" in res.stderr and "rank 1" in res.stderr


CLIQUES = {"MPIR_CVAR_NUM_CLIQUES": "2"}     # two "nodes" of one rank: tcp between


def test_tune_across_nodes_times_the_fold_and_its_profile_decides_it(tmp_path):
    """Across nodes a call whose data fits the agreement's exchange is folded into it; at
    which size that stops paying differs from host to host (docs/performance.md: between
    768 KiB and 1 MiB on one, above 1 MiB on another), so `gpurt tune` times `folded`
    beside the forced algorithms (each of which pays the agreement, then its schedule),
    and a profile's row decides: fold where `folded` was fastest, else run the measured
    winner."""
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "gpurt.launch.cli", "tune", "-n", "2", "-c",
                           "allreduce", "-c", "broadcast", "-b", "4K", "-e", "2M", "-f", "512",
                           "-w", "1", "-i", "3", "-o", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **CLIQUES})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prof = json.loads(out.read_text())
    assert prof["nnodes"] == 2
    rows = {(c, r[0]): r for c, rs in prof["entries"].items() for r in rs}
    # 4 KiB fits (GPURT_NET_FOLD, GPURT_NET_FOLD_PAIR): timed folded; 2 MiB does not
    assert "folded" in rows["allreduce", 4096][2] and "folded" in rows["broadcast", 4096][2]
    assert "folded" not in rows["allreduce", 2 << 20][2]
    assert "folded" not in rows["broadcast", 2 << 20][2]
    assert {r["model"] for r in prof["model_vs_best"] if r["size"] == 4096} == {"folded"}
    (tmp_path / "use.py").write_text(USE_PROFILE)
    res = run_mpi(2, [str(tmp_path / "use.py"), str(out)],
                  env={"GPURT_PROFILE": str(out), **CLIQUES})
    assert "2 ranks followed the profile" in res.stdout, res.stdout


def test_a_profile_across_nodes_turns_the_fold_off_and_on(tmp_path):
    """A hand-made profile: at 64 KiB a schedule measured faster than folding (the
    default folds there), at 256 KiB folding did; a 4 MiB call, nearest to the 256 KiB
    row but too large for the agreement's room, runs the fastest of that row's others."""
    rows = [[65536, "direct", {"direct": 1e-4, "folded": 2e-4}],
            [262144, "folded", {"folded": 1e-4, "recursive_doubling": 3e-4, "ring": 2e-4}]]
    out = _allreduces_under(tmp_path, rows, (65536, 262144, 4 << 20), [
        "x = np.arange(S // 4, dtype=np.float32) % 7 + c.rank",
        "want = 2 * (np.arange(S // 4, dtype=np.float32) % 7) + 1",
        "c.allreduce(x); assert np.array_equal(x, want)",
        "r = c.iallreduce(x); r.wait(); assert np.array_equal(x, 2 * want)",
        "got.append((c.last_algorithm, r.algorithm))",
        "assert ('folded' in c.explain('allreduce', S)) == (S == 262144)"])
    assert "got [(('direct', 'direct'), ('folded', 'folded'), ('ring', 'ring'))] 2" in out, out


def _allreduces_under(tmp_path, rows: list, sizes: tuple, body: list[str]) -> str:
    """Run ``body`` (appending to ``got``) for each S of ``sizes`` on 2 ranks of two
    cliques under a profile whose allreduce rows are ``rows``; rank 0's line of every
    rank's distinct ``got``."""
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"version": 1, "nranks": 2, "nnodes": 2,
                             "entries": {"allreduce": rows}}))
    code = ("import numpy as np, gpurt\nc = gpurt.init()\ngot = []\n"
            f"for S in {sizes!r}:\n" + "".join(f"    {line}\n" for line in body) +
            "got = c.mpi.gather(tuple(got), 0)\n"
            "if c.rank == 0: print('got', sorted(set(got)), len(got), flush=True)\n")
    return run_mpi(2, ["-c", code], env={"GPURT_PROFILE": str(f), **CLIQUES}).stdout


def test_a_profile_that_never_timed_folding_leaves_the_fold_to_its_limits(tmp_path):
    """A profile written before `gpurt tune` timed 'folded' (or a row of a size too large
    to fold then) names only algorithms: it must not turn folding off (review: every
    older profile made small calls across nodes pay the agreement's round, then the
    algorithm's)."""
    rows = [[4096, "recursive_doubling", {"recursive_doubling": 1e-4, "ring": 2e-4}],
            [65536, "ring", {"ring": 1e-4, "direct": 2e-4}]]
    out = _allreduces_under(tmp_path, rows, (1024, 4096, 65536), [
        "x = np.ones(S // 4, np.float32); c.allreduce(x); assert (x == 2).all()",
        "got.append(c.last_algorithm)"])
    assert "got [('folded', 'folded', 'folded')] 2" in out, out


def _invoke_tune(args: list[str], monkeypatch, tmp_path):
    """`gpurt tune ARGS -o FILE` in this process (click's CliRunner) with ``run`` (the
    launch) replaced: what it would have launched is returned beside the result, so a
    usage error is seen to come before any rank starts."""
    from click.testing import CliRunner

    from gpurt.launch import tune as T

    launched = []

    def run(nranks, colls, sizes, out, warmup, iters, dtype):
        launched.append((sizes, dtype))
        return {"model_vs_best": []}

    monkeypatch.setattr(T, "run", run)
    res = CliRunner().invoke(T.tune_command(), args + ["-o", str(tmp_path / "p.json")])
    return res, launched


def test_tune_refuses_bad_sizes_and_dtypes_before_the_launch(monkeypatch, tmp_path):
    """-b above -e measured 0 points and wrote a useless profile; -d took any text, which
    failed on every rank with a traceback: both usage errors naming the option now (exit
    2, nothing launched), sizes validated as in `gpurt bench`, -d a choice of the dtypes
    the ranks can sum."""
    for args, option, words in (
            (["-b", "4M", "-e", "1K"], "'-b' / '--minbytes'", "4M is larger than -e 1K"),
            (["-b", "0"], "'-b' / '--minbytes'", "at least 1 byte"),
            (["-e", "inf"], "'-e' / '--maxbytes'", "not a finite number"),
            (["-d", "float33"], "'-d' / '--datatype'", "'float33' is not one of"),
            (["-d", "bool"], "'-d' / '--datatype'", "'bool' is not one of")):
        res, launched = _invoke_tune(args, monkeypatch, tmp_path)
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert f"Invalid value for {option}" in res.output and words in res.output, res.output
        assert not launched
    res, launched = _invoke_tune(["-b", "1K", "-e", "1K", "-d", "bfloat16"], monkeypatch,
                                 tmp_path)
    assert res.exit_code == 0, (res.output, res.exception)
    assert launched == [([1024], "bfloat16")]


def test_tune_refuses_an_output_it_cannot_write_and_takes_f_1_for_one_size(monkeypatch,
                                                                          tmp_path):
    """-o into a missing directory ran the whole sweep, then lost it in a traceback: a
    usage error now, before the launch. -f 1 with -b equal to -e is one size, as in
    `gpurt bench` (it was refused)."""
    from click.testing import CliRunner

    from gpurt.launch import tune as T

    launched = []
    monkeypatch.setattr(T, "run", lambda *a: launched.append(a) or {"model_vs_best": []})
    res = CliRunner().invoke(T.tune_command(), ["-o", str(tmp_path / "no" / "p.json")])
    assert res.exit_code == 2 and "Invalid value for '-o' / '--out'" in res.output and \
        "no directory" in res.output, res.output
    assert not launched
    res, launched = _invoke_tune(["-b", "8", "-e", "8", "-f", "1"], monkeypatch, tmp_path)
    assert res.exit_code == 0, (res.output, res.exception)
    assert launched == [([8], "float32")]


def test_tune_measures_whole_elements(tmp_path):
    """-b below one element (8 bytes of complex128) was measured and written as 0 bytes;
    each size is now a whole number of elements (per rank for the blocked kinds), as in
    `gpurt bench`."""
    out = tmp_path / "c16.json"
    proc = subprocess.run([sys.executable, "-m", "gpurt.launch.cli", "tune", "-n", "2", "-c",
                           "allreduce", "-c", "allgather", "-b", "8", "-e", "8", "-f", "1",
                           "-w", "0", "-i", "1", "-d", "complex128", "-o", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prof = json.loads(out.read_text())
    assert [r[0] for r in prof["entries"]["allreduce"]] == [16]
    assert [r[0] for r in prof["entries"]["allgather"]] == [32]


def test_tune_bfloat16_runs(tmp_path):
    """A dtype of -d's choice really runs on the ranks: bfloat16 (NumPy has no such name;
    the worker makes it as bench does, through ml_dtypes)."""
    pytest.importorskip("ml_dtypes")
    out = tmp_path / "bf16.json"
    proc = subprocess.run([sys.executable, "-m", "gpurt.launch.cli", "tune", "-n", "2", "-c",
                           "allreduce", "-b", "64", "-e", "64", "-w", "0", "-i", "1", "-d",
                           "bfloat16", "-o", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prof = json.loads(out.read_text())
    assert prof["dtype"] == "bfloat16" and [r[0] for r in prof["entries"]["allreduce"]] == [64]


def test_a_launcher_that_cannot_start_is_one_line(tmp_path):
    """$GPURT_MPIEXEC that does not exist: a FileNotFoundError traceback before (bug
    hunt); one line now, as `gpurt launch` says it, and nothing written or left."""
    proc = subprocess.run([sys.executable, "-m", "gpurt.launch.cli", "tune", "-n", "2", "-e",
                           "64", "-o", str(tmp_path / "p.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, GPURT_MPIEXEC="/nonexistent/mpiexec",
                                   TMPDIR=str(tmp_path)))
    assert_cannot_start(proc, "/nonexistent/mpiexec", 2)
    assert os.listdir(tmp_path) == []


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if d.isdigit() and text.encode() in f.read():
                    out.append(int(d))
        except OSError:
            pass
    return out


def test_sigterm_stops_the_whole_tuning_launch(tmp_path):
    """SIGTERM to `gpurt tune` ended it alone: its mpiexec and ranks ran on, orphaned,
    beside its directory (as bench's did). Now the job is stopped, 143, one line, and
    nothing of it is left (bench's stopping: MPICH's segments included, tested there)."""
    import signal
    import time

    out = tmp_path / "p.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "gpurt.launch.cli", "tune", "-n", "2",
                             "-c", "allreduce", "-b", "64M", "-e", "64M", "-i", "500", "-o",
                             str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp)))
    try:
        deadline = time.monotonic() + 60
        while len(_processes_with(str(tmp))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)             # mpiexec and the two ranks
        assert len(_processes_with(str(tmp))) >= 3, _processes_with(str(tmp))
        time.sleep(1.0)                 # (the ranks in their sweep)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _processes_with(str(tmp)):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    assert err.endswith("gpurt tune: SIGTERM: stopped every rank\n") and \
        "Traceback" not in err, err[-3000:]
    assert _processes_with(str(tmp)) == [] and os.listdir(tmp) == [] and not out.exists()


def test_tune_under_a_launcher_is_refused(monkeypatch, tmp_path):
    """`mpiexec -n 2 gpurt tune -n 2 -o F` ran two tuning launches at once, both writing F
    (bug hunt): gpurt tune launches its own ranks, so under a launcher of more than one
    rank it is a usage error (exit 2), said once (by rank 0), before anything starts."""
    from click.testing import CliRunner

    from gpurt.launch import tune as T

    launched = []
    monkeypatch.setattr(T, "run", lambda *a: launched.append(a) or {"model_vs_best": []})
    for k in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
              "PMIX_RANK", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    out = str(tmp_path / "p.json")
    res = CliRunner().invoke(T.tune_command(), ["-n", "2", "-o", out],
                             env={"PMI_SIZE": "2", "PMI_RANK": "0"})
    assert res.exit_code == 2 and "gpurt tune launches its own ranks" in res.output and \
        "run it once" in res.output, res.output
    res = CliRunner().invoke(T.tune_command(), ["-n", "2", "-o", out],
                             env={"PMI_SIZE": "2", "PMI_RANK": "1"})
    assert res.exit_code == 2 and res.output == "", res.output
    assert not launched and not os.path.exists(out)
    res = CliRunner().invoke(T.tune_command(), ["-o", out], env={"PMI_SIZE": "1",
                                                                "PMI_RANK": "0"})
    assert res.exit_code == 0 and len(launched) == 1, res.output     # (one rank: tunes)


def test_tune_under_mpiexec_says_so_once(tmp_path):
    from conftest import mpiexec

    out = tmp_path / "p.json"
    proc = subprocess.run([*mpiexec(), "-n", "2", sys.executable, "-m", "gpurt.launch.cli",
                           "tune", "-n", "2", "-c", "barrier", "-i", "1", "-w", "0", "-o",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("gpurt tune launches its own ranks") == 1, proc.stderr
    assert not out.exists() and "wrote" not in proc.stdout
