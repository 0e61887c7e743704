"""experiments.common.in_parallel: independent runs two at a time (spawned processes of one torch thread each)."""

import math

import pytest

from experiments.common import default_jobs, in_order, in_parallel


def test_every_item_comes_back_once_with_its_index():
    items = [-3, 4, -5, 6]
    assert sorted(in_parallel(abs, items, 2)) == [(0, 3), (1, 4), (2, 5), (3, 6)]
    assert list(in_parallel(abs, items, 1)) == [(0, 3), (1, 4), (2, 5), (3, 6)]  # here, in order
    assert in_order(abs, items, 2, "abs") == in_order(abs, items, 1, "abs") == [3, 4, 5, 6]


def test_an_error_in_a_process_is_raised_here():
    with pytest.raises(ValueError):
        list(in_parallel(math.sqrt, [4.0, -1.0], 2))


def test_mecefo_jobs_overrides_the_callers_choice(monkeypatch):
    monkeypatch.setenv("MECEFO_JOBS", "3")
    assert default_jobs(1) == 3
    monkeypatch.delenv("MECEFO_JOBS")
    assert default_jobs(1) == 1 and 1 <= default_jobs(2) <= 2
