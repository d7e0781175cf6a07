"""The ``verbs`` transport on real verbs devices: Soft-RoCE (rdma_rxe) in QEMU guests that
run Debian's Python and Debian's pyverbs (rdma-core 44), booted by ``tests/rdma/harness.py``.

* one guest: 2 and 3 ranks with every peer over ``verbs`` (``GPURT_TRANSPORTS=verbs``):
  the transport's own checks (``tests/rdma/verbs_cases.py``), every collective x every
  algorithm x sizes x roots exact (``tests/mpi_sweep.py algorithms`` on 2 ranks, its
  ``transport`` share on 3 and on device buffers), a queue pair put in
  the error state and a SIGKILLed rank (``tests/rdma/verbs_failures.py``);
* two guests joined by a virtual link, as two nodes of 2 ranks: ``shm`` inside a node,
  ``verbs`` between (``tests/multinode_check.py``: hierarchical schedules and the whole
  sweep, exact), and the transport checks over verbs on 4 ranks;
* one guest of Debian 13's user space (``RXE_VM_SUITE=trixie``: rdma-core and pyverbs
  56.1, Python 3.13, numpy 2.2), so the transport runs with a newer pyverbs than the one
  bookworm ships: the transport's checks on 2 and 3 ranks, the sweep's transport share on
  2, a queue pair error and a killed rank.

Each guest boot runs its whole suite once (``tests/rdma/guest_suite.sh``, a module-scoped
fixture); the tests below assert on its sections.  Without QEMU, root or the guest image
these tests skip, saying why — unless ``GPURT_RDMA_VM=required`` (set by ``.ci/run``),
which makes a missing guest a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# the transport share of the algorithm sweep runs 442 checks on 2 ranks and 663 on 3 over
# tcp on the host (tests/mpi_sweep.py transport); fewer than this would be a shrunk sweep
MIN_TRANSPORT_CHECKS = 300
sys.path.insert(0, str(HERE / "rdma"))
import harness  # noqa: E402

REQUIRED = os.environ.get("GPURT_RDMA_VM", "") == "required"
pytestmark = pytest.mark.rdma


def _unavailable() -> str:
    if os.environ.get("GPURT_RDMA_VM", "") == "0":
        return "GPURT_RDMA_VM=0"
    if os.geteuid() != 0:
        return "the Soft-RoCE guests need root (to build the image)"
    ok, why = harness.image_ready()     # (of the suite in RXE_VM_SUITE: see newer_guest)
    if not ok and not shutil.which("apt-get"):
        return f"no guest image ({why}) and no apt-get to build one"
    return ""


def _ready() -> None:
    """The guest image built and the project staged, or a skip saying why (a failure
    where GPURT_RDMA_VM=required)."""
    why = _unavailable()
    if why:
        if REQUIRED:
            pytest.fail(f"GPURT_RDMA_VM=required but {why}")
        pytest.skip(why)
    harness.ensure_image()
    harness.stage()


def _boot(mode: str, nodes: int) -> dict[str, tuple[int, str]]:
    _ready()
    # the command's own limit (the boot has its own, harness.BOOT_TIMEOUT, and is retried
    # once); each section inside is stopped after SECTION_TIMEOUT (600 s)
    rc, out = harness.run(f"bash tests/rdma/guest_suite.sh {mode}", nodes=nodes, timeout=1500,
                          env={"SECTION_TIMEOUT": "600"})
    sections = {}
    for m in re.finditer(r"^=== BEGIN (\S+)\n(.*?)^=== END \1 rc=(\d+) seconds=(\d+)$", out,
                         re.S | re.M):
        sections[m.group(1)] = (int(m.group(3)), m.group(2))
    if "=== DONE" not in out:
        pytest.fail(f"the guest suite did not finish (rc {rc}):\n{out[-6000:]}")
    return sections


@pytest.fixture(scope="module")
def one_guest():
    return _boot("one", 1)


@pytest.fixture(scope="module")
def two_guests():
    return _boot("two", 2)


@pytest.fixture(scope="module")
def newer_guest():
    """One guest of Debian 13's user space (pyverbs 56.1, Python 3.13, numpy 2.2): the
    transport with a newer pyverbs than bookworm's 44 (``guest_suite.sh newer``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RXE_VM_SUITE", "trixie")
        return _boot("newer", 1)


def _json_line(text: str, prefix: str) -> dict:
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            return json.loads(line[len(prefix) + 1:])
    raise AssertionError(f"no {prefix} line in:\n{text[-4000:]}")


@pytest.mark.parametrize("ranks", [2, 3])
def test_transport_cases_one_guest(one_guest, ranks):
    _check_cases(*one_guest[f"cases{ranks}"], ranks)


@pytest.mark.parametrize("ranks", [2, 3])
def test_transport_cases_with_a_newer_pyverbs(newer_guest, ranks):
    rc, out = newer_guest["versions"]
    assert rc == 0 and "Python 3.13" in out, out
    assert re.search(r"^python3-pyverbs\s+56\.", out, re.M), out
    _check_cases(*newer_guest[f"cases{ranks}"], ranks)


def _check_cases(rc: int, out: str, ranks: int) -> None:
    res = _json_line(out, "VERBS_CASES")
    assert rc == 0 and res["failures"] == [], out[-4000:]
    assert res["ranks"] == ranks
    assert "rxe0" in res["probe"] and "RoCE, GID index 1" in res["probe"], res["probe"]
    assert "192.168.77.1" in res["probe"]                 # the IPv4-mapped RoCE v2 GID
    assert res["reg_misses"] <= 2 and res["reg_hits"] >= 3 and res["reg_entries_freed"] >= 1
    assert res["rendezvous_in_flight"] >= 160
    assert "CollectiveMismatchError" not in res["mismatch_checked"]   # the text itself
    assert "count=4097" in res["mismatch_checked"] and "count=4096" in res["mismatch_checked"]
    if ranks == 2:   # the transport's own check, both ends of a rendezvous message
        for r in (0, 1):
            assert "verbs" in res[f"mismatch_transport_r{r}"]
        # an abort with a rendezvous write posted returns only after its completion
        assert res["abort_write_posted"] and res["abort_left_in_flight"] == 0, res
        assert res["abort_receiver"] in ("PeerFailure", "completed"), res
    # unforced allreduces: folded up to GPURT_NET_FOLD, on 2 ranks up to the pair's 1 MiB
    # (the agreement's upto receives take an 800 KB message by rendezvous), then scheduled
    algos = res[f"allreduce_algos_{ranks}"]
    assert algos["3"] == "folded" and algos[str((1 << 20) // 4 + 2)] != "folded", algos
    assert (algos["200003"] == "folded") == (ranks == 2), algos


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_collective_and_algorithm_over_verbs(one_guest, ranks):
    """2 ranks: the full algorithm sweep; 3 ranks: its transport share (every algorithm's
    messages at every size; tests/mpi_sweep.py, guest_suite.sh)."""
    _check_sweep(*one_guest[f"sweep{ranks}"], ranks, "algorithms" if ranks == 2 else "transport")


def test_every_algorithm_s_messages_over_verbs_with_a_newer_pyverbs(newer_guest):
    _check_sweep(*newer_guest["sweep2"], 2, "transport")


def _check_sweep(rc: int, out: str, ranks: int, suite: str) -> None:
    m = re.search(rf"(\d+) checks on (\d+) ranks \({suite}\): (\d+) failed", out)
    assert rc == 0 and m, out[-4000:]
    assert int(m.group(2)) == ranks and int(m.group(3)) == 0
    assert int(m.group(1)) > (500 if suite == "algorithms" else MIN_TRANSPORT_CHECKS)


def test_single_copies_under_yama_ptrace_scope_1(one_guest):
    """Ubuntu's default Yama scope (1) refuses process_vm_readv between sibling ranks: the
    ranks declare each other as ptracers, so single copies (CMA, the compiled shares) run
    for ranks without CAP_SYS_PTRACE; GPURT_SHM_PTRACER=0 leaves Yama's rule, and CMA is
    off, with the reason.  Not on the host: its kernel has no Yama (tests/yama_cases.py)."""
    rc, out = one_guest["yama"]
    cases = [json.loads(line[len("YAMA_CASE "):]) for line in out.splitlines()
             if line.startswith("YAMA_CASE ")]
    assert rc == 0 and len(cases) == 3, out[-4000:]
    for case, ranks in zip(cases[:2], (2, 3)):
        assert case["failures"] == [] and case["ranks"] == ranks, case
        assert case["scope"] == 1 and not case["cap_sys_ptrace"] and case["cma_why"] == ""
        assert case["algos"]["allreduce 8388608"] == "shm_direct", case
        assert case["algos"]["alltoall 1048576"] == "shm_direct", case
    off = cases[2]
    assert off["failures"] == [] and not off["cma_shares"], off
    assert "cannot read local rank 1 (rank 1)" in off["cma_why"], off
    assert "rank 1 (pid" in off["cma_why"] and "GPURT_SHM_PTRACER=0" in off["cma_why"], off
    assert off["algos"]["allreduce 8388608"] != "shm_direct", off


def _fail_records(out: str) -> dict[int, dict]:
    recs = {}
    for line in out.splitlines():
        if line.startswith("VERBS_FAIL "):
            rec = json.loads(line[len("VERBS_FAIL "):])
            recs[rec["rank"]] = rec
    return recs


@pytest.mark.parametrize("guest", ["one_guest", "newer_guest"])
def test_qp_error_fails_both_sides_with_the_verbs_status(guest, request):
    rc, out = request.getfixturevalue(guest)["qp_error"]
    recs = _fail_records(out)
    assert set(recs) == {0, 1}, out[-4000:]
    r1, r0 = recs[1], recs[0]
    # rank 1 broke its own queue pair: its work requests are flushed
    assert r1["exc"] == "TransportError" and "IBV_WC_WR_FLUSH_ERR" in r1["text"], r1
    assert "rank 0" in r1["text"] and r1["calls"] == 3, r1
    # rank 0 learns it within the bound, with the rank and a verbs status
    assert r0["exc"] in ("PeerFailure", "TransportError") and "IBV_WC_" in r0["text"], r0
    assert "rank 1" in r0["text"] and r0["calls"] == 3, r0
    assert r0["seconds"] < 10 and r1["seconds"] < 10, (r0, r1)


@pytest.mark.parametrize("guest", ["one_guest", "newer_guest"])
def test_killed_peer_is_a_peer_failure_on_every_survivor(guest, request):
    rc, out = request.getfixturevalue(guest)["kill"]
    recs = _fail_records(out)
    assert set(recs) == {0, 2}, out[-4000:]
    for q, rec in recs.items():
        assert rec["exc"] == "PeerFailure" and rec["blame"] == 1, rec
        assert rec["calls"] == 3, rec
        # GPURT_PEER_STOPPED=3 (heartbeats), or the dead queue pair's retries run out
        assert rec["seconds"] < 3 + 5, rec


def test_two_guests_verbs_between_shm_inside_every_collective(two_guests):
    rc, out = two_guests["multinode"]
    res = _json_line(out, "MULTINODE")
    assert rc == 0 and res["failures"] == 0, out[-4000:]
    assert res["nnodes"] == 2 and res["size"] == 4
    hosts = {r["host"] for r in res["ranks"]}
    assert len(hosts) == 2, hosts                       # node0, node1
    for r in res["ranks"]:
        assert r["transports"] == ["shm", "verbs"], r
    assert all(a == "hierarchical" for a in res["chosen"].values()), res["chosen"]
    assert res["cases"] > 500


def test_a_failure_elsewhere_is_named_at_the_deadline_over_verbs(one_guest):
    """5 ranks over verbs, GPURT_CHECK=0: rank 2 aborts, rank 4 is 6 s late, the others
    are in a ring allreduce of eager messages (timeout=4).  Rank 0 waits only on rank 4:
    at its deadline it names rank 2's failure, read from what the peers published (an
    ERROR message or a UDP notice: ``VerbsEndpoint.published``) — it timed out blaming
    rank 4 before.  And a gather rank 2 had done its part of completes, exact
    (tests/failed_elsewhere_cases.py, as on shm and tcp in test_processes.py)."""
    rc, out = one_guest["elsewhere"]
    recs, dec = {}, json.JSONDecoder()
    for m in re.finditer(r"ELSEWHERE (?=\{)", out):    # (a flight dump may precede it)
        rec = dec.raw_decode(out, m.end())[0]
        recs.setdefault(rec["rank"], []).append(rec["out"])
    assert rc == 0 and sorted(recs) == [0, 1, 2, 3, 4], out[-4000:]
    assert recs[2][0] == "aborted", recs
    for r in (0, 1, 3, 4):
        got = recs[r][0]
        assert got.startswith("PeerFailure(rank=2)") and "rank 2 gave up" in got, recs
        assert float(got.split()[1][:-2]) < 4 + 2, got      # the deadline (4 s), in TCG
    assert "until its deadline" in recs[0][0], recs
    assert all(recs[r][1:] == ["exact"] for r in (0, 1, 2)), recs


def test_upto_receives_over_verbs(one_guest):
    """The agreement check's receives (``upto``) over verbs: shorter messages arrive
    exactly (eager and rendezvous), a longer one is a CollectiveMismatchError saying "at
    most" (an eager one, and a refused rendezvous)."""
    for name in ("upto2", "upto2_big"):
        rc, out = one_guest[name]
        assert rc == 0, (name, out[-4000:])
        for r in (0, 1):
            assert f"upto ok on rank {r} (verbs)" in out, (name, out[-4000:])


def test_device_buffers_over_verbs_gpudirect_and_staged(one_guest):
    """Device buffers (gpurt's host-memory stand-in for a GPU, not a GPU) over verbs:
    GPUDirect RDMA (registered device memory, RDMA WRITE into the receiver's registered
    device scratch) and pinned staging; streams, reuse, order, errors, and the sweep."""
    for name in ("dev_gdr2", "dev_sweep_staged2"):
        rc, out = one_guest[name]
        assert rc == 0 and "ok on 2 ranks" in out, (name, out[-4000:])
    rc, out = one_guest["dev_sweep_gdr2"]
    m = re.search(r"(\d+) checks on 2 ranks \(transport, standin device buffers\): "
                  r"(\d+) failed", out)
    assert rc == 0 and m and int(m.group(2)) == 0 and int(m.group(1)) > MIN_TRANSPORT_CHECKS, \
        out[-4000:]


def test_two_guests_device_buffers_ipc_inside_gpudirect_between(two_guests):
    rc, out = two_guests["dev_2x2"]
    assert rc == 0 and "ok on 4 ranks" in out, out[-4000:]


def test_two_guests_transport_cases_over_verbs_only(two_guests):
    rc, out = two_guests["cases_2x2"]
    res = _json_line(out, "VERBS_CASES")
    assert rc == 0 and res["failures"] == [], out[-4000:]
    assert res["ranks"] == 4


def test_section_runner_stops_a_hung_section_and_goes_on():
    """guest_suite.sh's section runner, on the host (no guest): a section that outlives
    SECTION_TIMEOUT — a command or a shell function, each with a child process — ends with
    rc=124 and a line saying so, nothing of it is left running, and the next sections
    still run (so one hung section in the guests fails alone, with its output)."""
    import subprocess
    import time
    import uuid
    tag = f"gpurt-selftest-{uuid.uuid4().hex}"     # the children's name: only theirs
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(HERE / "rdma" / "guest_suite.sh"), "selftest"],
                       capture_output=True, text=True, timeout=120, start_new_session=True,
                       env=dict(os.environ, SECTION_TIMEOUT="2", SELFTEST_TAG=tag))
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "=== DONE" in out, out
    for name in ("slow_cmd", "slow_fn"):
        assert re.search(rf"^=== END {name} rc=124 seconds=[23]$", out, re.M), out
        assert f"section {name} did not end in 2 s: stopped" in out, out
    assert "=== END quick rc=0" in out, out
    assert took < 30, took
    # the children got the signal with their group; under load their exit may trail the
    # runner's by a moment, so allow them a few seconds to go.  (They are found by their
    # own name: a bare `pgrep -f "sleep 300"` also caught an unrelated `sleep 300` of
    # another shell on the machine, twice.)
    deadline = time.monotonic() + 5
    while True:
        left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True)
        if left.stdout.strip() == "" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left.stdout.strip() == "", left.stdout


def test_harness_boot_that_does_not_come_up_is_retried_then_reported():
    """A boot whose guests do not start the command in time (here: a 3 s limit, far below
    a TCG boot) is stopped with a diagnosis of each guest (markers, console, qemu log),
    booted again once, then reported as rc 125 — never a silent wait for the whole run's
    timeout — and nothing of either boot is left (qemu, run folders, sockets)."""
    import subprocess
    import tempfile
    import time
    _ready()
    t0 = time.monotonic()
    rc, out = harness.run("echo never", nodes=2, timeout=60, boot_timeout=3)
    took = time.monotonic() - t0
    assert rc == 125, out
    assert out.count("did not start the command within the boot's 3 s") == 2, out
    assert "boot 1 failed" in out and "node1: runner" in out and "never" not in out, out
    assert harness.LAST_RUN.get("boots") == 2, harness.LAST_RUN
    assert took < 60, took
    mine = list(Path(tempfile.gettempdir()).glob(f"gpurt-rxe-{os.getpid()}-*"))
    assert mine == [], mine
    assert not list((harness.ROOT / ".rxe" / "runs").glob(f"{os.getpid()}-*"))
    q = subprocess.run(["pgrep", "-f", f"gpurt-rxe-{os.getpid()}-"], capture_output=True,
                       text=True)
    assert q.stdout.strip() == "", q.stdout
