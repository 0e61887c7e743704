"""The sweep's designs: every comparison can be paired by seed, the deciding rows have their seeds, the extra
rows keep what the paper's runs keep."""

import pytest

from experiments import sweep
from mecefo import failures


@pytest.mark.parametrize("profile", sorted(sweep.DESIGNS))
def test_every_failure_cell_at_the_main_n_pairs_with_a_failure_free_run_of_its_seed(profile):
    d, grid = sweep.DESIGNS[profile], sweep.cells(profile)
    assert len(grid) == len(set(grid))
    free = {c.seed for c in grid if c.n == d.n and c.level == "none"}
    assert {c.seed for c in grid if c.n == d.n and c.level != "none"} <= free
    high = lambda p: {c.seed for c in grid if (c.n, c.level, c.policy, c.tag) == (d.n, "high", p, "main")}
    assert high("mecefo") == high("drop") == free == set(range(d.high_seeds))
    assert {c.n for c in grid} == set(d.ns)
    assert any(c.n == 1 and c.level == "none" for c in grid)  # the n-sweep's reference


@pytest.mark.parametrize("profile", sorted(sweep.DESIGNS))
def test_the_extra_rows_keep_the_high_scenarios_failed_fraction_or_its_arrival_rate(profile):
    d, grid = sweep.DESIGNS[profile], sweep.cells(profile)
    high = failures.SCENARIOS["high"]
    for c in grid:
        if c.tag == "frequency":
            s = failures.scenario(c.level)
            assert s.recovery_h / s.interval_h == high.recovery_h / high.interval_h
            assert s.expected_failed_fraction() == pytest.approx(high.expected_failed_fraction())
            assert s.interval_h in {high.interval_h / k for k in sweep.FREQUENCIES}
        if c.tag == "asymmetric":
            assert c.level == "high" and c.failable == ",".join(str(r) for r in range(d.node))
            assert sweep.cell_config(d.base, c).cluster.failable_ranks() == tuple(range(d.node))


def test_the_long_profile_only_adds_cells_to_the_default():
    assert set(sweep.cells("default")) < set(sweep.cells("long"))
    extra = set(sweep.cells("long")) - set(sweep.cells("default"))
    deciding = {("none", "none", "main"), ("high", "mecefo", "main"), ("high", "drop", "main"), ("high", "mecefo", "cold")}
    assert {(c.level, c.policy, c.tag) for c in extra} <= deciding | {("high", p, "main") for p in sweep.OTHER_POLICIES}


def test_a_cell_at_n_32_holds_one_sequence_per_rank_after_the_shared_warm_start():
    cfg = sweep.cell_config("sweep", sweep.Cell(32, "high", "mecefo", 3))
    assert (cfg.cluster.ranks, cfg.data.micro_batch_size, cfg.train.seed) == (32, 1, 3)
    assert cfg.cluster.failure_free_steps == 100 and cfg.data.val_windows == 0
    cold = sweep.cell_config("sweep", sweep.Cell(32, "high", "mecefo", 3, tag="cold"))
    assert cold.cluster.failure_free_steps == 0 and cold.hash() != cfg.hash()  # the estimate without the warm start
    free = sweep.cell_config("sweep", sweep.Cell(32, "none", "none", 3))
    assert free.cluster.failures == "none"
    with pytest.raises(ValueError, match="does not split"):
        sweep.cell_config("sweep", sweep.Cell(3, "high", "mecefo", 0))
