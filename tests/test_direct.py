"""``shm_direct`` (transports/shm_direct.py): large one-node collectives as loads and
stores straight into every rank's buffers.  The block split and thresholds in one
process; every collective, dtype, op, root and buffer kind in real processes
(tests/direct_cases.py), with the path that ran checked on every rank."""

from __future__ import annotations

import pytest

from conftest import run_mpi
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
print(c.rank, got)
"""


def test_direct_forced_by_gpurt_algo():
    """GPURT_ALGO=allreduce:shm_direct forces it at every size (the board's inline path
    steps aside); other collectives keep the tuner's choice."""
    out = run_mpi(3, ["-c", _ENV_FORCED], env={"GPURT_ALGO": "allreduce:shm_direct"}).stdout
    lines = sorted(out.strip().splitlines())
    assert len(lines) == 3, out
    for line in lines:
        assert "[('shm_direct', True), ('shm_direct', True), ('shm_board', True)]" in line, out


_DIES_MID_SHARE = """
import numpy as np, gpurt, os, sys, threading, time
mode, outdir = sys.argv[1], sys.argv[2]
c = gpurt.init()
def report(text):   # one file per rank: the launcher interleaves stdout
    with open(os.path.join(outdir, f"rank{c.rank}"), "w") as f:
        f.write(text)
n = 16 << 20                         # 64 MiB of float32: each share takes milliseconds
x = c.empty(n, np.float32) if mode == "shared" else np.empty(n, np.float32)
x[:] = 1
c.allreduce(x)
assert c.last_algorithm == "shm_direct", c.last_algorithm
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


@pytest.mark.parametrize("mode", ["shared", "numpy"])
def test_a_rank_dying_mid_share_is_a_peer_failure(mode, tmp_path):
    """One rank dies at once (``os._exit`` from a timer thread, so mid-share) while the
    others loop over 64 MiB shm_direct allreduces whose shares read and write its memory
    (mapped, or through process_vm_readv/writev): every survivor raises
    PeerFailure(rank=2) within a second, and nothing is left in /dev/shm."""
    from conftest import gpurt_shm_files, mpiexec
    import subprocess
    import sys

    before = set(gpurt_shm_files())
    proc = subprocess.run([mpiexec(), "-disable-auto-cleanup", "-n", "3", sys.executable, "-c",
                           _DIES_MID_SHARE, mode, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    got = {f.name: f.read_text() for f in tmp_path.iterdir()}
    killed = float(got.get("killed", "nan"))
    for r in (0, 1):
        line = got.get(f"rank{r}", "")
        assert line.startswith("PeerFailure rank=2 "), (got, proc.stdout, proc.stderr[-3000:])
        at = float(line.split(" at ")[1].split(":")[0])
        assert 0 <= at - killed < 1.0, (at - killed, line)
    assert set(gpurt_shm_files()) - before == set()
