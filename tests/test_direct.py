"""``shm_direct`` (transports/shm_direct.py): large one-node collectives as loads and
stores straight into every rank's buffers.  The block split and thresholds in one
process; every collective, dtype, op, root and buffer kind in real processes
(tests/direct_cases.py), with the path that ran checked on every rank."""

from __future__ import annotations

import pytest

from conftest import is_hydra, rank_records, run_mpi
from gpurt.transports import shm_direct


# -- in one process --------------------------------------------------------------------

@pytest.mark.parametrize("count", [0, 1, 5, 1023, 1024, 1025, 4097, 1 << 20, (1 << 20) + 13])
@pytest.mark.parametrize("p", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("isz", [1, 2, 4, 8, 16])
def test_blocks_cover_the_range_on_page_boundaries(count, p, isz):
    bl = shm_direct.blocks(count, p, isz)
    assert len(bl) == p and bl[0][0] == 0 and bl[-1][1] == count
    for (a, b), (c, _d) in zip(bl, bl[1:]):
        assert a <= b == c
    for a, _b in bl:
        assert a == count or (a * isz) % 4096 == 0
    if count >= 4096 * p:                 # every rank gets a share of a large call
        assert all(b > a for a, b in bl)


def test_thresholds():
    auto = shm_direct.thresholds("auto", shm_direct.AUTO_MAP)
    assert auto == shm_direct.AUTO_MAP and auto["broadcast"] == 4 << 20
    assert set(auto) == set(shm_direct.COLLS)
    assert shm_direct.thresholds(0, shm_direct.AUTO_MAP) == {c: 0 for c in shm_direct.COLLS}
    assert shm_direct.thresholds(1 << 20, shm_direct.AUTO_CMA)["alltoall"] == 1 << 20


def test_collective_bytes():
    assert shm_direct.collective_bytes("allreduce", 4, 10, 8) == 80
    assert shm_direct.collective_bytes("allgather", 4, 10, 8) == 320
    assert shm_direct.collective_bytes("reduce_scatter", 4, 10, 8) == 320


# -- real processes ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_direct_on_shared_arrays(n):
    """comm.empty buffers: every collective by shm_direct (forced), exact; the default
    thresholds choose it for a 2 MiB allreduce and not for 64 KiB; a mismatch raises on
    every rank before anything is written."""
    out = run_mpi(n, ["tests/direct_cases.py", "shared"], timeout=400).stdout
    assert out.startswith("ok") and f"on {n} ranks" in out, out


@pytest.mark.parametrize("n,mode,env,direct", [
    (3, "numpy", {}, True),                                    # CMA (readv/writev)
    (2, "numpy", {"DIRECT_MISMATCH": "auto"}, True),           # ... the inline path's
    (5, "shared", {"DIRECT_MISMATCH": "auto"}, True),          #     mismatch
    (2, "mixed", {}, True),                                    # mapped and CMA in one call
    (3, "numpy", {"GPURT_SHM_DIRECT_CMA": "0"}, False),        # NumPy buffers out of reach
    (3, "mixed", {"GPURT_SHM_DIRECT_CMA": "0"}, False),        # one rank's out of reach
    (3, "shared", {"GPURT_SHM_SHARED": "0"}, True),            # shared arrays by address
    (2, "shared", {"GPURT_TEST_FORBID_CMA": "1"}, True),       # mappings need no CMA
    (3, "numpy", {"GPURT_TEST_FORBID_CMA": "1"}, False),       # ... NumPy arrays do
    (3, "shared", {"GPURT_TEST_DIRECT_OPEN_FAIL": "1"}, False),  # one rank cannot open
    (2, "shared", {"GPURT_SHM_DIRECT": "0", "GPURT_SHM_DIRECT_CMA": "0"}, False),  # off
])
def test_direct_reach_and_fallback(n, mode, env, direct):
    """Which buffers shm_direct can reach decides, identically on every rank, whether it
    runs or every rank takes the tuner's schedule — exact results either way.
    GPURT_TEST_FORBID_CMA stands in for Yama's ptrace_scope=1 (not reproducible as root);
    GPURT_TEST_DIRECT_OPEN_FAIL for a mapping that cannot be made on one rank."""
    env = dict(env, DIRECT_EXPECT="yes" if direct else "no")
    out = run_mpi(n, ["tests/direct_cases.py", mode], env=env, timeout=400).stdout
    assert out.startswith("ok") and f"on {n} ranks" in out, out


_ENV_FORCED = """
import numpy as np, gpurt
from mpi4py import MPI
c = gpurt.init()
got = []
for n in (1000, 300000):                      # board-sized and large, NumPy buffers
    x = np.arange(n, dtype=np.float64) + c.rank
    c.allreduce(x)
    ok = np.array_equal(x, (np.arange(n) * c.size + c.size * (c.size - 1) // 2))
    got.append((c.last_algorithm, bool(ok)))
y = np.ones(64)
c.allgather(y)                                # not forced: the tuner's choice
got.append((c.last_algorithm, True))
every = MPI.COMM_WORLD.gather(got, 0)      # one writer: the launcher interleaves stdout
if c.rank == 0:
    for k, g in enumerate(every):
        print(k, g)
"""


def test_direct_forced_by_gpurt_algo():
    """GPURT_ALGO=allreduce:shm_direct forces it at every size (the board's inline path
    steps aside; where a staging room is in use — GPURT_SHM_STAGE given — a call that
    fits it on NumPy arrays is its staged variant); other collectives keep the tuner's
    choice."""
    out = run_mpi(3, ["-c", _ENV_FORCED], env={"GPURT_ALGO": "allreduce:shm_direct"}).stdout
    lines = sorted(out.strip().splitlines())
    assert len(lines) == 3, out
    for line in lines:
        assert "[('shm_direct', True), ('shm_direct', True), ('shm_board', True)]" in line, out
    out = run_mpi(3, ["-c", _ENV_FORCED], env={"GPURT_ALGO": "allreduce:shm_direct",
                                               "GPURT_SHM_STAGE": "2M"}).stdout
    for line in sorted(out.strip().splitlines()):
        assert "[('shm_staged', True), ('shm_direct', True), ('shm_board', True)]" in line, out


_DIES_MID_SHARE = """
import numpy as np, gpurt, os, sys, threading, time
mode, outdir = sys.argv[1], sys.argv[2]
c = gpurt.init()
def report(text):   # one file per rank: the launcher interleaves stdout
    with open(os.path.join(outdir, f"rank{c.rank}"), "w") as f:
        f.write(text)
# 64 MiB of float32: each share takes milliseconds; staged: 1 MiB, through the board
n = 16 << 20 if mode != "staged" else 1 << 18
x = c.empty(n, np.float32) if mode == "shared" else np.empty(n, np.float32)
x[:] = 1
c.allreduce(x)
want = "shm_staged" if mode == "staged" else "shm_direct"
assert c.last_algorithm == want, c.last_algorithm
if c.rank == 2:
    def die():
        with open(os.path.join(outdir, "killed"), "w") as f:
            f.write(repr(time.time()))
        os._exit(3)     # at once, from this thread: mid-share (hydra would kill the
                        # survivors for a death by signal, even without auto clean-up)
    threading.Timer(0.3, die).start()
try:
    for i in range(100000):
        c.allreduce(x, timeout=30)
    report("no error")
except gpurt.PeerFailure as e:
    report(f"PeerFailure rank={e.rank} at {time.time()!r}: {e}")
# stay until the other survivor has reported (our exit would be its failure), then go
# without MPI_Finalize (it would wait for the dead rank)
other = os.path.join(outdir, f"rank{1 - c.rank}")
deadline = time.monotonic() + 20
while not os.path.exists(other) and time.monotonic() < deadline:
    time.sleep(0.05)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["shared", "numpy", "staged"])
def test_a_rank_dying_mid_share_is_a_peer_failure(mode, tmp_path):
    """One rank dies at once (``os._exit`` from a timer thread, so mid-share) while the
    others loop over 64 MiB shm_direct allreduces whose shares read and write its memory
    (mapped, or through process_vm_readv/writev) — or 1 MiB ones staged through the
    board (``shm_staged``), waiting for its reduced block: every survivor raises
    PeerFailure(rank=2) within a second, and nothing is left in /dev/shm."""
    from conftest import gpurt_shm_files, mpiexec
    import subprocess
    import sys

    if not is_hydra():
        pytest.skip("uses MPICH hydra's -disable-auto-cleanup; this launcher is not hydra")
    before = set(gpurt_shm_files())
    import os
    env = dict(os.environ, GPURT_SHM_STAGE="2M") if mode == "staged" else None
    proc = subprocess.run([*mpiexec(), "-disable-auto-cleanup", "-n", "3", sys.executable, "-c",
                           _DIES_MID_SHARE, mode, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    got = {f.name: f.read_text() for f in tmp_path.iterdir()}
    killed = float(got.get("killed", "nan"))
    for r in (0, 1):
        line = got.get(f"rank{r}", "")
        assert line.startswith("PeerFailure rank=2 "), (got, proc.stdout, proc.stderr[-3000:])
        at = float(line.split(" at ")[1].split(":")[0])
        assert 0 <= at - killed < 1.0, (at - killed, line)
    assert set(gpurt_shm_files()) - before == set()


_ABANDONED = """
import os, sys, time
import numpy as np, gpurt
from gpurt.transports import shm_direct
mode = sys.argv[1]
c = gpurt.init()
r = c.rank
x = c.empty(1 << 20, np.float32) if mode == "shared" else np.empty(1 << 20, np.float32)
x[:] = 1
c.allreduce(x, algo="shm_direct")
x[:] = 1
if r == 1:             # a slow rank (descheduled, oversubscribed): its share starts late
    share = shm_direct._SHARES["allreduce"]
    shm_direct._SHARES["allreduce"] = lambda d: (time.sleep(2.0), share(d))
try:
    c.allreduce(x, algo="shm_direct", timeout=0.5 if r == 0 else 20)
    out = f"ok {np.unique(x)}"
except gpurt.GpurtError as e:
    out = type(e).__name__
    if r == 0:         # the call failed: the buffer is the caller's again, untouched
        x[:] = -1
        time.sleep(2.5)
        out += f" rewritten={int(np.count_nonzero(x != -1))}"
every = c.mpi.gather(f"rank {r}: {out}", 0)
if r == 0:
    print("\\n".join(every), flush=True)
c.mpi.Barrier()
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["shared", "numpy"])
def test_a_rank_that_gives_up_gets_its_buffers_back_untouched(mode):
    """Rank 0 times out while rank 1's share has not started: rank 0's error is published
    before its caller gets the buffers back, and its call waits (bounded) until the peers
    have stopped, so no peer writes into them afterwards; no rank reports success (the
    peers raise PeerFailure instead of finishing on data that may have changed)."""
    # (the ranks leave by os._exit, without MPI_Finalize: an error status for Open MPI's
    # mpirun; for hydra none, or 9 where the first rank to leave made it SIGKILL the
    # others still on their way out after the barrier — a clean-clone CI run met that
    # once; the lines say what happened)
    proc = run_mpi(3, ["-c", _ABANDONED, mode], timeout=120, check=False)
    out = proc.stdout
    assert proc.returncode in (0, 9) or not is_hydra(), proc.stderr[-3000:]
    lines = sorted(ln for ln in out.splitlines() if ln.startswith("rank "))
    assert lines == ["rank 0: CollectiveTimeout rewritten=0", "rank 1: PeerFailure",
                     "rank 2: PeerFailure"], out


_HITS_ONLY = """
import gc, numpy as np, gpurt
c = gpurt.init()
def mapped_mib():
    tot = 0
    for line in open("/proc/self/maps"):
        if "gpurt-array" in line or "memfd:" in line:
            a, b = (int(v, 16) for v in line.split()[0].split("-"))
            tot += b - a
    return tot >> 20
small = c.empty(1 << 18, np.float32)
big = c.empty(16 << 20, np.float32)       # 64 MiB
big[:] = 1
c.allreduce(big)
del big
gc.collect()
c.mpi.Barrier()
for _ in range(20):                       # every call hits the peers' mapping tables
    c.allreduce(small, algo="shm_direct")
got = c.mpi.gather(mapped_mib(), 0)
if c.rank == 0:
    print("mapped MiB", got, flush=True)
"""


def test_freed_peer_arrays_are_unmapped_in_a_loop_of_cache_hits():
    out = run_mpi(3, ["-c", _HITS_ONLY]).stdout
    mib = eval(out.split("mapped MiB")[1])
    assert len(mib) == 3 and max(mib) < 16, out        # not 2 x 64 MiB of freed arrays


def test_shm_direct_forced_for_a_collective_it_does_not_run_is_an_error_at_creation():
    code = "import gpurt\ngpurt.init()\n"
    res = run_mpi(2, ["-c", code], env={"GPURT_ALGO": "gather:shm_direct"}, check=False)
    assert res.returncode != 0 and res.stderr.count("shm_direct is for allreduce") == 2, \
        res.stderr[-2000:]


_MIXED_FORCE = """
import numpy as np, gpurt
c = gpurt.init()
x = c.empty(1 << 19, np.float32)           # 2 MiB broadcast: below its 4 MiB threshold
x[:] = c.rank + 5
c.broadcast(x, root=0, algo="shm_direct" if c.rank == 0 else None, timeout=20)
every = c.mpi.gather((c.last_algorithm, bool(np.all(x == 5))), 0)
if c.rank == 0:
    print("ran", every, flush=True)
"""


def test_one_rank_forcing_shm_direct_takes_every_rank_along():
    """algo='shm_direct' on one rank only: the forced flag travels in the header, so every
    rank ignores the thresholds and the call runs direct everywhere (not a hang)."""
    out = run_mpi(2, ["-c", _MIXED_FORCE]).stdout
    assert "ran " + str([("shm_direct", True)] * 2) in out, out


def test_a_profile_that_measured_shm_direct_fastest_is_followed(tmp_path):
    prof = {"version": 1, "nranks": 2, "nnodes": 1,
            "entries": {"allreduce": [[262144, "shm_direct", {}], [524288, "ring", {}]]}}
    f = tmp_path / "p.json"
    f.write_text(__import__("json").dumps(prof))
    code = ("import numpy as np, gpurt\nc = gpurt.init()\nran = []\n"
            "for n in (1 << 16, 1 << 17):\n"
            "    x = np.ones(n, np.float32)\n    c.allreduce(x)\n"
            "    ran.append((c.last_algorithm, bool(np.all(x == 2))))\n"
            "every = c.mpi.gather(ran, 0)\n"
            "if c.rank == 0: print('ran', every, flush=True)\n")
    out = run_mpi(2, ["-c", code], env={"GPURT_PROFILE": str(f)}).stdout
    # (shm_direct on NumPy arrays: the compiled shares by CMA; GPURT_SHM_STAGE=auto
    # stages only where they cannot run)
    assert "ran " + str([[("shm_direct", True), ("ring", True)]] * 2) in out, out


# -- staged through the board (shm_staged) ----------------------------------------------

_STAGED = """
import os, sys
import numpy as np, gpurt
c = gpurt.init()
r, p = c.rank, c.size
mixed, late = sys.argv[1] == "mixed", sys.argv[1] == "late"
# the staging room in use (GPURT_SHM_STAGE=auto stages only without the compiled CMA shares)
stage = c.board.stage if c._direct_min["allreduce"][2] else 0
bad = []
codes = []
sys.path.insert(0, "tests")
import casekit
if late and r == 1:
    # this rank runs the Python round, 20 ms late before publishing and before reducing:
    # the peers' compiled rounds give up waiting (after ~2 ms) and hand the call to
    # DirectRun both after publishing (1) and after reducing their block (4)
    import time
    casekit.slow_python_staging(c, 0.02)
elif c.board.fast is not None:
    codes = casekit.spy_compiled(c, "staged")
for n in (65537, 100003, 262144, 262145):   # S just above the board .. just above the room
    for dt, op in ((np.float32, "sum"), (np.float64, "avg"), (np.int32, "max"),
                   (np.int64, "prod")):
        dt = np.dtype(dt)
        ins = [((np.arange(n) * 7 + k * 5) % 3 + 1).astype(dt) for k in range(p)]
        want = ins[0].copy()
        for a in ins[1:]:
            want = {"sum": np.add, "avg": np.add, "max": np.maximum,
                    "prod": np.multiply}[op](want, a)
        if op == "avg":
            want = want / p
        alloc = c.empty if mixed and r == 0 else np.empty
        x, y = alloc(n, dt), alloc(n, dt)
        nb = x.nbytes
        expect = "shm_direct" if mixed or nb > stage else "shm_staged"
        if expect == "shm_direct" and os.environ.get("GPURT_TEST_FORBID_CMA") == "1":
            expect = "rabenseifner"       # the tuner's schedule: NumPy arrays out of reach
        for how in ("out", "in place", "request"):
            x[:] = ins[r]
            y[:] = -1
            if how == "out":
                if late and r == 1:
                    time.sleep(0.02)
                c.allreduce(x, y, op)
                got = y
            elif how == "in place":
                c.allreduce(x, op=op)
                got = x
            else:
                got = c.iallreduce(x, y, op).wait()
            if not np.array_equal(got, want):
                bad.append(f"{how} n={n} {dt} {op}: wrong")
            if c.last_algorithm != expect:
                bad.append(f"{how} n={n} {dt} {op} ({nb} B): ran {c.last_algorithm}, "
                           f"expected {expect}")
if late and r != 1 and not {1, 4} <= set(codes):
    bad.append(f"the compiled round answered only {sorted(set(codes))}, never both 1 "
               f"(published) and 4 (reduced)")
if stage and not late and not mixed and c.board.fast is not None and 0 not in codes:
    bad.append(f"the compiled staged round never finished a call: {sorted(set(codes))}")
every = c.mpi.gather(bad, 0)
if r == 0:
    errs = [f"rank {k}: {b}" for k, bs in enumerate(every) for b in bs]
    print("\\n".join(errs) if errs else f"ok staged={stage} on {p} ranks", flush=True)
"""


_2M = {"GPURT_SHM_STAGE": "2M"}    # staging asked for although CMA is there


@pytest.mark.parametrize("n,mode,env", [
    (2, "numpy", _2M), (3, "numpy", _2M), (5, "numpy", _2M),
    (3, "mixed", _2M),                             # rank 0's arrays shared: not staged
    (3, "late", _2M),  # rank 1 in Python and late: the compiled rounds hand over midway
    (3, "numpy", {"GPURT_SHM_STAGE": "512K"}),     # 1 MiB then by process_vm_readv/writev
    (2, "numpy", {"GPURT_TEST_FORBID_CMA": "1"}),  # staging needs no CMA (auto: staged)
    (3, "numpy", {}),       # auto with CMA: never staged, the compiled shares instead
])
def test_staged_allreduce(n, mode, env):
    """An allreduce on NumPy arrays that fits GPURT_SHM_STAGE is staged through the board
    (``shm_staged``: the input rides with the agreement's header, each rank reduces its
    block of every board buffer and copies the others' out): exact for SUM, AVG, MAX and
    PROD in four dtypes, into ``out``, in place and on a request, from just above the
    board's one-round limit to just above the staging room (then ``shm_direct``); not
    staged where a rank's arrays are shared (``comm.empty``: mapped directly), nor with
    GPURT_SHM_STAGE=auto where CMA reaches the peers (the compiled shares run instead)."""
    out = run_mpi(n, ["-c", _STAGED, mode], env=env, timeout=300).stdout
    stage = {"512K": 512 << 10, "2M": 2 << 20}.get(env.get("GPURT_SHM_STAGE"), 0)
    if env.get("GPURT_TEST_FORBID_CMA") == "1":
        stage = 2 << 20
    assert out.startswith(f"ok staged={stage} on {n} ranks"), out


_STAGED_GIVES_UP = """
import sys, time
import numpy as np, gpurt
c = gpurt.init()
r = c.rank
x = np.ones(1 << 18, np.float32)            # 1 MiB: staged
c.allreduce(x)
assert c.last_algorithm == "shm_staged", c.last_algorithm
x[:] = 1
if r == 1:             # a slow rank: its reduction starts late (the Python round's)
    sys.path.insert(0, "tests")
    import casekit
    casekit.slow_python_staging(c, 2.0)
try:
    c.allreduce(x, timeout=0.5 if r == 0 else 20)
    out = f"ok {np.unique(x)}"
except gpurt.GpurtError as e:
    out = type(e).__name__
    if r == 0:         # the call failed: the buffer is the caller's again, untouched
        x[:] = -1
        time.sleep(2.5)
        out += f" rewritten={int(np.count_nonzero(x != -1))}"
try:
    c.barrier(timeout=20)
    out += ", then barrier ok"
except gpurt.GpurtError as e:
    out += f", then {type(e).__name__}"
every = c.mpi.gather(f"rank {r}: {out}", 0)
if r == 0:
    print("\\n".join(every), flush=True)
c.mpi.Barrier()
"""


def test_a_staged_call_that_gives_up_leaves_the_peers_right_or_failing():
    """Rank 0 times out waiting for rank 1's reduced block: nothing writes into rank 0's
    arrays afterwards (no rank touches another's arrays in a staged call), and the peers
    either finish with the exact sum (every input was in the board) or raise PeerFailure
    — never a wrong answer — and their next call raises PeerFailure."""
    out = run_mpi(3, ["-c", _STAGED_GIVES_UP], env=_2M, timeout=120).stdout
    lines = sorted(ln for ln in out.splitlines() if ln.startswith("rank "))
    assert lines[0].startswith("rank 0: CollectiveTimeout rewritten=0, then ") and \
        not lines[0].endswith("barrier ok"), out
    for ln in lines[1:]:
        head = ln.split(": ", 1)[1]
        assert head in ("ok [3.], then PeerFailure", "PeerFailure, then PeerFailure"), out


# -- the compiled shares by CMA (gpurt._fastboard's direct) -------------------------------

@pytest.mark.parametrize("n,mode", [(2, "numpy"), (3, "numpy"), (5, "numpy"), (2, "late"),
                                    (3, "late"), (5, "late"), (3, "mixed"), (3, "unaligned")])
def test_compiled_shares(n, mode):
    """Blocking collectives on NumPy arrays whose buffers are all reached by CMA run the
    compiled round (header round, READY, share, FINISHED without the GIL): exact for
    every collective shm_direct runs, odd counts, four dtype/op pairs, both root kinds, in
    place; with one rank on the Python round and late at each phase, the others hand
    their calls to DirectRun where they are (answers 1, 5, 6); with one rank's arrays
    shared, after the header round; on arrays at odd addresses
    (tests/direct_compiled_cases.py)."""
    out = run_mpi(n, ["tests/direct_compiled_cases.py", mode], timeout=400).stdout
    assert out.startswith("ok") and f"on {n} ranks" in out, out


_SHARE_RAISES = """
import sys, time
import numpy as np, gpurt
from gpurt.transports import shm_direct
sys.path.insert(0, "tests")
import casekit
c = gpurt.init()
r = c.rank
x = np.ones(3 << 22, np.float32)            # 48 MiB: each rank's share takes milliseconds
y = np.empty_like(x)
c.alltoall(x, out=y)
assert c.last_algorithm == "shm_direct", c.last_algorithm
if r == 1:             # the Python round, whose share fails a moment after it started
    casekit.python_direct(c)
    def boom(run):
        time.sleep(0.002)
        raise RuntimeError("boom in the share")
    shm_direct._SHARES["alltoall"] = boom
t0 = time.monotonic()
try:
    c.alltoall(x, out=y, timeout=20)
    out = "ok"
except gpurt.PeerFailure as e:
    out = f"PeerFailure rank={e.rank} {'RuntimeError' in str(e)}"
except RuntimeError as e:
    out = f"RuntimeError {e}"
took = time.monotonic() - t0
every = c.mpi.gather((r, out, took), 0)
if r == 0:
    for k, o, t in every:
        print(f"rank {k}: {o} in {'<1s' if t < 1.0 else f'{t:.1f}s'}", flush=True)
"""


def test_an_exception_in_a_peers_share_fails_the_compiled_rounds():
    """Rank 1 (on the Python round) raises in its share of a 48 MiB alltoall while the
    others' compiled rounds copy: they stop (between pieces, or waiting for its FINISHED)
    and raise PeerFailure(rank=1) naming the exception, within a second."""
    out = run_mpi(3, ["-c", _SHARE_RAISES], timeout=120).stdout
    lines = sorted(ln for ln in out.splitlines() if ln.startswith("rank "))
    assert lines == ["rank 0: PeerFailure rank=1 True in <1s",
                     "rank 1: RuntimeError boom in the share in <1s",
                     "rank 2: PeerFailure rank=1 True in <1s"], out


_ROOM = """
import numpy as np, gpurt
c = gpurt.init()
r, p = c.rank, c.size
bad, ran = [], set()
n = (1 << 18) // p + 3                       # ~1 MiB of float32 per call
for k in range(2):
    mine = (np.arange(p * n, dtype=np.float32) * (r + 2) + k) % 1000
    every = [(np.arange(p * n, dtype=np.float32) * (j + 2) + k) % 1000 for j in range(p)]
    out = c.alltoall(mine)
    ran.add(("alltoall", c.last_algorithm))
    want = np.concatenate([every[j][r * n:(r + 1) * n] for j in range(p)])
    bad += [] if np.array_equal(out, want) else ["alltoall"]
    out = c.allgather(mine[:n])
    ran.add(("allgather", c.last_algorithm))
    bad += [] if np.array_equal(out.reshape(-1), np.concatenate([e[:n] for e in every])) \
        else ["allgather"]
    b = mine.copy()
    c.broadcast(b, root=p - 1)
    ran.add(("broadcast", c.last_algorithm))
    bad += [] if np.array_equal(b, every[p - 1]) else ["broadcast"]
    out = c.reduce_scatter(mine)
    ran.add(("reduce_scatter", c.last_algorithm))
    bad += [] if np.array_equal(out, sum(every)[r * n:(r + 1) * n]) else ["reduce_scatter"]
got = c.mpi.gather((bad, sorted(ran)), 0)
if r == 0:
    print("bad", [b for b, _ in got], "ran", got[0][1], flush=True)
"""


@pytest.mark.parametrize("n,cma", [(2, False), (3, False), (2, True)])
def test_the_board_takes_the_copies_where_no_cma_shares_run(n, cma):
    """With process_vm_readv forbidden (GPURT_TEST_FORBID_CMA stands in for a container
    without CAP_SYS_PTRACE), the one-round board takes the copy collectives up to its
    whole buffer (the 2 MiB staging room), not only GPURT_SHM_BOARD's 256 KiB: exact
    alltoall, allgather, broadcast and reduce_scatter of ~1 MiB run on the board instead
    of a schedule.  With CMA the compiled shares run them (shm_direct)."""
    env = {} if cma else {"GPURT_TEST_FORBID_CMA": "1"}
    out = run_mpi(n, ["-c", _ROOM], env=env).stdout
    assert f"bad {[[]] * n}" in out, out
    want = "shm_direct" if cma else "shm_board"
    for coll in ("allgather", "alltoall", "broadcast", "reduce_scatter"):
        assert f"('{coll}', '{want}')" in out, out



def _close_race(mode: str) -> dict[int, dict]:
    out = run_mpi(2, ["tests/close_race_cases.py", mode], env={"GPURT_TIMEOUT": "20"},
                  timeout=120).stdout
    return rank_records(out, "CLOSE_RACE", 2)


@pytest.mark.parametrize("mode", ["before", "before_fast"])
def test_close_from_another_thread_stops_a_direct_call_before_peers_come_in(mode):
    """close() from another thread while rank 0's blocking shm_direct call (the compiled
    round) waits for rank 1's header: the call stops before READY — CommunicatorClosed on
    rank 0 at once, PeerFailure naming the close on rank 1, and nothing written into rank
    0's output after its call returned (before the fix: a ValueError from the released
    segment, then rank 1's whole block written into the returned array)."""
    recs = _close_race(mode)
    r0, r1 = recs[0], recs[1]
    assert r0["outcome"] == ("CommunicatorClosed: rank 0 closed the communicator during "
                             "allgather (call #2)"), r0
    assert r0["written_after"] == 0 and r0["close_seconds"] < 5 and r0["seconds"] < 5, r0
    assert r1["outcome"].startswith("PeerFailure: ") and \
        "rank 0 closed the communicator during allgather (call #2)" in r1["outcome"], r1
    assert r1["seconds"] < 10, r1          # not the 20 s deadline


def test_close_from_another_thread_stops_a_direct_call_moving_data_safely():
    """The close comes once rank 0 has stored READY (rank 1, on the Python round, is
    still sleeping before its share): rank 0's call ends with CommunicatorClosed, its error
    published only once its own share is done (it might be writing into rank 1's arrays
    until then), and its caller has the arrays back only after rank 1 stopped — close()
    waits for that; rank 1 raises PeerFailure naming the close; nothing is written into
    rank 0's output after the call returned."""
    recs = _close_race("after")
    r0, r1 = recs[0], recs[1]
    assert r0["outcome"] == ("CommunicatorClosed: rank 0 closed the communicator during "
                             "allgather (call #2)"), r0
    assert r0["written_after"] == 0 and r0["codes"] and r0["codes"][-1] >= \
        shm_direct.D_READY, r0
    assert r0["close_seconds"] > 0.1, r0     # it waited for rank 1 to stop
    assert r1["outcome"].startswith("PeerFailure: ") and \
        "rank 0 closed the communicator during allgather (call #2)" in r1["outcome"], r1


def test_a_child_forked_during_a_compiled_round_closes_at_once():
    """A thread forks while the compiled round runs without the GIL: the child inherits
    the round's busy count but not the round, and its FastBoard.close() (the atexit
    hook's too) must not wait for it (it waited forever)."""
    recs = _close_race("fork")
    assert recs[0]["child"] == {"exit": 0, "seconds": recs[0]["child"]["seconds"]}, recs[0]
    assert recs[0]["child"]["seconds"] < 5 and recs[0]["exact"] and recs[1]["exact"], recs
