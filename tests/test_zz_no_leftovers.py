"""Runs last (file order): after everything above, /dev/shm holds nothing of gpurt's."""

from conftest import gpurt_shm_files


def test_dev_shm_holds_nothing_of_gpurt():
    assert gpurt_shm_files() == []
