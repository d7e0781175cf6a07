"""The ``verbs`` transport against perftest's ``ib_write_bw`` on the same Soft-RoCE device, in
the same guest boot, alternating (this machine is shared and noisy; rxe is software, so
only the ratio means anything).

    python3 benchmarks/verbs.py [--size-mib 8] [--iters 20] [--rounds 3] [--window 1]

Boots one guest (``tests/rdma/harness.py``; root, the guest image is built on first use),
then ROUNDS times: ``ib_write_bw`` (one process writes SIZE to another, ITERS times, its
send queue kept full) and ``benchmarks/verbs_bw.py`` (rank 0 sends ITERS messages of SIZE
to rank 1 through ``GPURT_TRANSPORTS=verbs``: zero-copy rendezvous, one RDMA WRITE per
message, WINDOW messages in flight).  Prints both per round, the medians and their ratio
(the issue's target: gpurt ≥ 0.8 × ib_write_bw); ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "rdma"))
import harness  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    size = a.size_mib << 20
    steps = []
    for _ in range(a.rounds):
        steps.append(harness.ib_write_bw_command(size, a.iters))
        steps.append(f"GPURT_TRANSPORTS=verbs $GUEST_MPIEXEC -n 2 python3 benchmarks/verbs_bw.py "
                      f"{a.size_mib} {a.iters} {a.window}")
    harness.ensure_image()
    harness.stage()
    rc, out = harness.run("; ".join(steps), nodes=1, timeout=1500)
    ib = [float(x) for x in re.findall(r"^IB_WRITE_BW_MIBS ([\d.]+)", out, re.M)]
    gp = [float(x) for x in re.findall(r"^GPURT_VERBS_BW_MIBS ([\d.]+)", out, re.M)]
    wrong = "WRONG" in out
    if rc != 0 or len(ib) != a.rounds or len(gp) != a.rounds or wrong:
        print(out[-6000:])
        print(f"benchmark failed (rc {rc}, {len(ib)}/{len(gp)} results, data wrong: {wrong})")
        return 1
    print(f"{a.size_mib} MiB x {a.iters} messages, one guest (rxe0, TCG), window {a.window}")
    print(f"{'round':>5}  {'ib_write_bw MiB/s':>18}  {'gpurt verbs MiB/s':>18}  {'ratio':>6}")
    for i, (x, y) in enumerate(zip(ib, gp)):
        print(f"{i + 1:>5}  {x:>18.2f}  {y:>18.2f}  {y / x:>6.2f}")
    mi, mg = statistics.median(ib), statistics.median(gp)
    print(f"{'median':>6} {mi:>18.2f}  {mg:>18.2f}  {mg / mi:>6.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"size": size, "iters": a.iters, "window": a.window,
                                            "ib_write_bw_mibs": ib, "gpurt_mibs": gp,
                                            "ratio_of_medians": mg / mi}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
