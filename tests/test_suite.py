"""The suite's own arrangements (tests/conftest.py): the longest files are collected first, and each
pytest-xdist worker takes its share of the cores."""

from __future__ import annotations

from pathlib import Path

from conftest import LONGEST_FIRST, xdist_threads


def test_every_longest_first_name_is_a_test_file():
    """A file renamed or split would drop out of the order without a word."""
    here = Path(__file__).parent
    assert [name for name in LONGEST_FIRST if not (here / name).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_the_longest_files_are_collected_first_and_handed_out_in_that_order(request):
    order = list(dict.fromkeys(item.path.name for item in request.session.items))
    ran = [name for name in LONGEST_FIRST if name in order]  # those this session collected
    assert order[: len(ran)] == ran
    # pytest-xdist's loadfile would otherwise hand the files out by their count of tests, most first
    if request.config.pluginmanager.hasplugin("xdist") and request.config.getoption("numprocesses"):
        assert request.config.getoption("loadscopereorder") is False


def test_each_worker_takes_its_share_of_the_cores():
    assert [
        xdist_threads(cpus=2, workers=2),
        xdist_threads(cpus=16, workers=14),
        xdist_threads(cpus=2, workers=4),
    ] == [1, 1, 1]
    assert xdist_threads(cpus=16, workers=2) == 8 and xdist_threads(cpus=4, workers=0) == 4
