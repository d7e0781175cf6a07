"""`gpurt tune` writes a profile; GPURT_PROFILE makes the tuner follow it."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, run_mpi

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
