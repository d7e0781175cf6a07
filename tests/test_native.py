"""The shm board's compiled inline round (gpurt._fastboard) against NumPy, bit for bit,
and the Python round it replaces (GPURT_NATIVE=0) against the same reference.  Real
processes; tests/board_bits.py says what is checked."""

from __future__ import annotations

import os

import pytest

from conftest import run_mpi
from gpurt.transports import shm_board


def _need_native() -> None:
    if shm_board.NATIVE is None:
        if os.environ.get("GPURT_TEST_REQUIRE_NATIVE") == "1":   # set by .ci/run
            pytest.fail(f"gpurt._fastboard must be built here: {shm_board.NATIVE_WHY}")
        pytest.skip(f"gpurt._fastboard is not built: {shm_board.NATIVE_WHY}")


@pytest.mark.parametrize("n", [2, 3, 5])
def test_board_bits_native(n):
    """Every dtype x op (NaN, ±inf, -0.0, integer extremes that wrap), broadcast from every
    root, barrier, in place / into out / non-blocking in between: the compiled round gives
    NumPy's rank-order bits on every rank (NaN payloads aside)."""
    _need_native()
    out = run_mpi(n, ["tests/board_bits.py", "native"]).stdout
    assert f"checks on {n} ranks (native)" in out and out.startswith("ok"), out


@pytest.mark.parametrize("n", [2, 3])
def test_board_bits_python(n):
    """The same cases with the compiled round switched off (GPURT_NATIVE=0)."""
    out = run_mpi(n, ["tests/board_bits.py", "python"]).stdout
    assert f"checks on {n} ranks (python)" in out and out.startswith("ok"), out


def test_native_built_and_in_info(monkeypatch):
    """``gpurt info`` says whether the compiled round is in use, and why not."""
    from click.testing import CliRunner

    from gpurt.launch.cli import main

    res = CliRunner().invoke(main, ["info"])
    assert res.exit_code == 0, res.output
    line = next(l for l in res.output.splitlines() if l.startswith("compiled board round:"))
    if shm_board.NATIVE is None:
        assert "no" in line and shm_board.NATIVE_WHY.split(" ")[0] in line
        _need_native()
    else:
        assert "yes" in line
    from gpurt import config

    monkeypatch.setenv("GPURT_NATIVE", "0")
    config.reload()
    try:
        res = CliRunner().invoke(main, ["info"])
    finally:
        monkeypatch.delenv("GPURT_NATIVE")
        config.reload()
    assert "compiled board round: no   built; off (GPURT_NATIVE=0)" in res.output, res.output
