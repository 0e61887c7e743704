"""mecefo.train's warm start (a run continuing from the failure-free first steps another run trained, as the sweep's
cells of one seed share them) against the same run trained from step 0: equal bit for bit, under every policy kind
the sweep trains; refused where it could not be equal."""

import json

import pytest
import torch

from mecefo import config as config_mod
from mecefo.errors import UsageError
from mecefo.train import run, warm_config
from tests.conftest import metrics, model_params

W = 4  # cluster.failure_free_steps: failures (Table 1's high scenario at 1 h per step) begin at step 4; evaluated every
# 2 steps (at W too, as the sweep's W = 100 with evaluations every 50); V1 refreshed every 3 steps (low_rank_tau)
CELLS = [("mecefo", "mecefo", "", "high"), ("drop", "mecefo", "", "high"), ("spread-mecefo", "mecefo", "", "high"),
         ("ndb-exact", "mecefo", "", "high"), ("spread", "mecefo", "", "custom:1:2"),
         ("mecefo", "skip_attention", "0,1", "high"), ("mecefo", "skip_ffn", "", "custom:1:2")]  # policy, techniques, failable, failures
TIMES = ("wall_time_s", "timing", "tokens_per_s")  # measured, not computed


def cell(nano_cfg, policy="mecefo", techniques="mecefo", failable="", failures="high", **cluster):
    return config_mod.with_overrides(nano_cfg, train={"steps": 12, "eval_every": 2},
                                     cluster={"ranks": 4, "failures": failures, "seconds_per_step": 3600.0,
                                              "failure_free_steps": W, "low_rank_tau": 3, "policy": policy, "techniques": techniques,
                                              "failable": failable, **cluster})


def computed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMES} for row in rows]


def test_a_warm_started_run_equals_the_run_trained_from_step_0_under_every_policy(nano_cfg, tmp_path):
    warm = tmp_path / "warm"
    run(warm_config(cell(nano_cfg)), warm, quiet=True, stop_after=W)
    for i, (policy, techniques, failable, failures) in enumerate(CELLS):
        cfg = cell(nano_cfg, policy, techniques, failable, failures)
        assert warm_config(cfg).hash() == warm_config(cell(nano_cfg)).hash()  # one warm start for the seed's cells
        cold, hot = run(cfg, tmp_path / f"cold{i}", quiet=True), run(cfg, tmp_path / f"hot{i}", quiet=True, warm_start=warm)
        rows = metrics(tmp_path / f"hot{i}")
        assert [r["step"] for r in rows] == list(range(13)) and any(r["down"] for r in rows[W + 1:]), policy
        assert [r["step"] for r in rows if "val_loss" in r] == list(range(0, 13, 2))  # W's evaluation once
        assert computed(rows) == computed(metrics(tmp_path / f"cold{i}")), (policy, techniques, failable)
        a, b = model_params(tmp_path / f"cold{i}"), model_params(tmp_path / f"hot{i}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (policy, techniques, failable)
        assert hot["final_val_loss"] == cold["final_val_loss"] and hot["config_hash"] == cold["config_hash"]
        assert hot["warm_start"] == {"run": str(warm), "step": W} and cold["warm_start"] is None


def test_a_warm_start_is_refused_where_it_could_not_equal_training_from_step_0(nano_cfg, tmp_path):
    warm = tmp_path / "warm"
    run(warm_config(cell(nano_cfg)), warm, quiet=True, stop_after=W)
    with pytest.raises(UsageError, match="holds state at a warm start"):  # checkpoint-restart's snapshot at step W
        run(cell(nano_cfg, "checkpoint-restart"), tmp_path / "a", quiet=True, warm_start=warm)
    with pytest.raises(UsageError, match="not this run's warm start"):  # another seed
        run(config_mod.with_overrides(cell(nano_cfg), train={"seed": 1}), tmp_path / "b", quiet=True, warm_start=warm)
    early = tmp_path / "early"  # a warm start past the first failure
    run(warm_config(cell(nano_cfg)), early, quiet=True, stop_after=W + 2)
    with pytest.raises(UsageError, match="failures begin before"):
        run(cell(nano_cfg), tmp_path / "c", quiet=True, warm_start=early)
    assert json.loads((warm / "config.json").read_text())["config"]["cluster"]["failures"] == "none"
