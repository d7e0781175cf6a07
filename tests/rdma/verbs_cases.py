"""Run inside a Soft-RoCE guest under ``mpiexec -n P`` with ``GPURT_TRANSPORTS=verbs``
(every peer over the ``verbs`` transport, even on one node): what the transport itself
must do, beyond the collective sweeps (``tests/mpi_sweep.py``).

* every peer is reached over verbs, the probe names the device, GID and address;
* point-to-point messages on both sides of the eager/rendezvous boundary, both ways,
  exact; 200 eager messages in a row (more than the credits: the backlog and the
  receiver's unexpected queue carry them); twice as many rendezvous messages in flight as
  the send queue holds (their RDMA WRITEs wait for room);
* the registration cache: a buffer reused by a rendezvous collective is registered once;
  freeing it deregisters it; a read-only send buffer goes (registered read-only);
* mismatches: with the agreement check (default) every rank raises
  ``CollectiveMismatchError``; with ``GPURT_CHECK=0`` the transport's own header check
  raises it on both ends of a rendezvous message (the receiver's NAK), before any byte
  of the user's buffer is written;
* an abort with a 32 MiB rendezvous write posted returns only once the write has its
  completion (``in_flight_abort``), and the receiver never takes bytes written after it.

Rank 0 prints ``VERBS_CASES {json}`` -- into the file ``$VERBS_CASES_OUT`` when that is
set (``guest_suite.sh``'s ``cases`` prints it after mpiexec has ended: across two guests,
mpiexec forwards a remote rank's late output into the middle of rank 0's line); exit status
non-zero if any rank failed.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

import numpy as np

import gpurt
from gpurt.errors import CollectiveMismatchError, PeerFailure


def verbs_of(comm):
    return next(t for t in comm._transports if t.name == "verbs")


def in_flight_abort(r, check, facts) -> None:
    """Rank 0 aborts with the RDMA WRITE of a 32 MiB send posted (read straight from its
    buffer), its drain of the send queue cut to nothing (``_PUBLISH_S = 0``): abort() must
    not return — handing the buffer back — before that write has its (flushed)
    completion, and rank 1 must never complete the receive with the bytes rank 0 writes
    into the buffer afterwards: it raises ``PeerFailure``, or has the exact bytes if the
    write and its FIN landed first.  ``VERBS_CASES_NO_REAP=1`` skips the wait for the
    completion (to show the case fails without it)."""
    from gpurt.transports import verbs as vmod

    c3 = gpurt.Communicator()
    vt = verbs_of(c3)
    n = 32 << 20
    pattern = (np.arange(n // 8, dtype=np.int64) * 7 + 3)
    if r == 0:
        src = pattern.copy()
        req = c3.isend(src, 1, tag=9)
        deadline = time.monotonic() + 60
        while not vt.data_in_flight() and not req.test() and time.monotonic() < deadline:
            time.sleep(1e-4)
        posted = bool(vt.data_in_flight())
        facts["abort_write_posted"] = posted
        check(posted, "the 32 MiB send completed or never posted its RDMA WRITE")
        old = vmod._PUBLISH_S
        vmod._PUBLISH_S = 0.0
        if os.environ.get("VERBS_CASES_NO_REAP") == "1":
            vt._reap_data = lambda seconds: None
        t = time.monotonic()
        try:
            c3.abort("aborted with a write in flight")
        finally:
            vmod._PUBLISH_S = old
        facts["abort_seconds"] = round(time.monotonic() - t, 3)
        left = vt.data_in_flight()
        facts["abort_left_in_flight"] = sum(left.values())
        check(not left, f"abort() returned with RDMA WRITEs still reading the buffer: {left}")
        src[:] = -7                     # the program reuses its buffer at once
        try:
            req.wait(timeout=30)
            check(False, "the aborted send completed")
        except gpurt.errors.GpurtError:
            pass
    else:
        dst = np.zeros(n // 8, np.int64)
        try:
            c3.recv(dst, 0, tag=9, timeout=60)
            facts["abort_receiver"] = "completed"
            check(np.array_equal(dst, pattern), "the receive completed with changed bytes")
        except PeerFailure as e:
            facts["abort_receiver"] = "PeerFailure"
            check(e.rank == 0, f"blames rank {e.rank}: {e}")
            check(not (dst == -7).any(), "bytes written after the abort reached the receiver")
    c3.close()


def main() -> int:
    fails: list[str] = []
    facts: dict = {}
    comm = gpurt.init()
    r, p = comm.rank, comm.size

    def check(cond, what):
        if not cond:
            fails.append(f"rank {r}: {what}")

    try:
        check(set(comm.transport_of.values()) == {"verbs"}, f"transports {comm.transport_of}")
        vt = verbs_of(comm)
        ok, why = type(vt).probe()
        check(ok and "rxe0" in why and "RoCE" in why, f"probe: {why}")
        facts["probe"] = why
        eager = vt.eager
        # -- point to point around the eager/rendezvous boundary, both directions --------
        for n in (0, 1, eager - 1, eager, eager + 1, 3 * eager + 5, 1 << 20):
            for a, b in ((0, p - 1), (p - 1, 0)):
                if r == a:
                    comm.send((np.arange(n, dtype=np.int64) * 3 + a).astype(np.uint8), b, tag=n)
                elif r == b:
                    got = comm.recv(np.empty(n, np.uint8), a, tag=n)
                    check(np.array_equal(got, (np.arange(n, dtype=np.int64) * 3 + a)
                                         .astype(np.uint8)), f"p2p {n} B {a}->{b}")
        # -- more eager messages than credits, receiver late ------------------------------
        many = 200
        if r == 0 and p > 1:
            for i in range(many):
                comm.send(np.full(10, i, np.int32), 1, tag=7)
        elif r == 1:
            time.sleep(0.5)         # let the sender run out of credits first
            for i in range(many):
                got = comm.recv(np.empty(10, np.int32), 0, tag=7)
                if not (got == i).all():
                    check(False, f"message {i} of {many} arrived as {got[:3]}")
                    break
        facts["credits"] = vt.slots
        # -- more rendezvous messages in flight than the send queue holds -------------------
        k = 2 * vt.sq_depth
        if r == 0 and p > 1:
            srcs = [np.full(1 << 14, i, np.float32) for i in range(k)]       # 64 KiB each
            reqs = [comm.isend(srcs[i], 1, tag=1000 + i) for i in range(k)]
            for q in reqs:
                q.wait(timeout=120)
        elif r == 1:
            dsts = [np.zeros(1 << 14, np.float32) for _ in range(k)]
            reqs = [comm.irecv(dsts[i], 0, tag=1000 + i) for i in range(k)]
            for q in reqs:
                q.wait(timeout=120)
            bad = [i for i in range(k) if not (dsts[i] == i).all()]
            check(not bad, f"{len(bad)} of {k} queued rendezvous messages wrong, first {bad[:3]}")
        facts["rendezvous_in_flight"] = k
        # -- registration cache ------------------------------------------------------------
        buf = np.zeros(1 << 18, np.float64)          # 2 MiB: rendezvous
        m0, h0 = vt.reg.misses, vt.reg.hits
        for it in range(5):
            if r == 0:
                buf[:] = it
            comm.broadcast(buf, root=0)
            check((buf == it).all(), f"broadcast round {it}")
        facts["reg_misses"] = vt.reg.misses - m0
        facts["reg_hits"] = vt.reg.hits - h0
        check(vt.reg.misses - m0 <= 2, f"{vt.reg.misses - m0} registrations for one buffer")
        check(vt.reg.hits - h0 >= 3, f"only {vt.reg.hits - h0} cache hits")
        n_before = len(vt.reg.entries)
        del buf
        gc.collect()
        facts["reg_entries_freed"] = n_before - len(vt.reg.entries)
        check(len(vt.reg.entries) < n_before, "freeing the buffer left its registration")
        # a read-only send buffer (bytes): registered without write access, or bounced
        ro = np.frombuffer(bytes(range(256)) * 4096, np.uint8)     # 1 MiB, read-only
        if r == 0:
            for q in range(1, p):
                comm.send(ro, q, tag=99)
        else:
            got = comm.recv(np.empty(ro.nbytes, np.uint8), 0, tag=99)
            check(np.array_equal(got, ro), "read-only send buffer")
        comm.barrier()
        # -- folded allreduces: up to GPURT_NET_FOLD, and on 2 ranks GPURT_NET_FOLD_PAIR ----
        # (the agreement's upto receives then take messages far above the eager size: one
        # rendezvous each into the agreement's rows)
        pair = comm._fold_pair
        check(pair == (1 << 20 if p == 2 else 0), f"pair fold room {pair}")
        ran = {}
        for n in (3, 20_000, 200_003, (1 << 20) // 4, (1 << 20) // 4 + 2):
            x = np.arange(n, dtype=np.float32) % 977 + r
            comm.allreduce(x, timeout=60)
            check(np.array_equal(x, (np.arange(n, dtype=np.float32) % 977) * p
                                 + p * (p - 1) // 2), f"allreduce of {n} floats")
            ran[n] = comm.last_algorithm
            folds = 4 * n <= max(pair, comm._fold)
            check((ran[n] == "folded") == folds, f"allreduce of {n} floats ran {ran[n]}")
        facts[f"allreduce_algos_{p}"] = ran
        if p == 2:      # a pair-folded 800 KB call meets a small folded one: both raise
            c3 = comm.dup()
            x = np.ones(200_003 if r else 4096, np.float32)
            try:
                c3.allreduce(x, timeout=60)
                check(False, "mismatched pair-folded allreduce returned")
            except CollectiveMismatchError as e:
                check("count=200003" in str(e) and "count=4096" in str(e), f"pair mismatch: {e}")
            c3.close()
        # -- mismatch with the agreement check: every rank raises ---------------------------
        n = 4096 if r != p - 1 else 4097
        try:
            comm.allreduce(np.ones(n, np.float32), timeout=60)
            check(False, "mismatched allreduce (checked) returned")
        except CollectiveMismatchError as e:
            facts.setdefault("mismatch_checked", str(e)[:300])
        except PeerFailure as e:
            check(False, f"checked mismatch gave PeerFailure, not a mismatch: {e}")
        comm.close()
        # -- mismatch without it: the transport's header check (rendezvous NAK) ------------
        if p == 2:
            os.environ["GPURT_CHECK"] = "0"
            gpurt.config.reload()
            c2 = gpurt.Communicator()
            out = np.full(1 << 16, -1.0, np.float32)
            n = 1 << 16 if r == 0 else (1 << 16) - 16
            try:
                if r == 0:
                    c2.recv(out, 1, tag=5, timeout=60)
                else:
                    c2.send(np.ones(n, np.float32), 0, tag=5, timeout=60)
                check(False, "mismatched p2p (unchecked) completed")
            except CollectiveMismatchError as e:
                facts[f"mismatch_transport_r{r}"] = str(e)[:300]
                check("verbs" in str(e), f"transport mismatch text: {e}")
            if r == 0:
                check((out == -1).all(), "the mismatched receive wrote the user's buffer")
            c2.close()
            in_flight_abort(r, check, facts)
    except Exception:  # noqa: BLE001 - report, the launcher collects
        fails.append(f"rank {r}: {traceback.format_exc()}")
    from mpi4py import MPI
    w = MPI.COMM_WORLD
    allf = w.gather(fails, 0)
    allfacts = w.gather(facts, 0)
    if r == 0:
        merged: dict = {}
        for f in allfacts:
            merged.update(f)
        flat = [x for fl in allf for x in fl]
        line = "VERBS_CASES " + json.dumps({"ranks": p, "failures": flat, **merged})
        dest = os.environ.get("VERBS_CASES_OUT")
        if dest:
            with open(dest, "w") as f:
                f.write(line + "\n")
        else:
            print(line, flush=True)
    return 1 if w.allreduce(len(fails)) else 0


if __name__ == "__main__":
    sys.exit(main())
