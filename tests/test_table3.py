"""experiments.table3 on synthetic sweep indices: rows pair by seed across the profiles' indices, every interval
comes from the pooled noise (never zero-width), the words follow the rerun rule, the paper's range
carries its rounding."""

import json

import numpy as np
import pytest

from experiments import table3


def cell(level, policy, seed, ppl, tag="main", techniques="mecefo", n=32):
    return {"n": n, "level": level, "policy": policy, "seed": seed, "techniques": techniques, "tag": tag, "failable": "",
            "run": f"sweep/x-{level}-{policy}-{seed}-{tag}-{techniques}-{n}", "val_ppl": ppl,
            "config_hash": f"{n}-{level}-{policy}-{seed}-{tag}-{techniques}"}


def index(cells, profile):
    return {"profile": profile, "base_config": "sweep", "design": {"n": 32}, "last_evaluations": 2, "cells": cells,
            "git_commit": "0" * 40, "wall_time_s": 1.0}


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(table3, "RESULTS", tmp_path)
    (tmp_path / "sweep").mkdir()
    rng = np.random.default_rng(1)
    effect = {"none": 0.0, "mecefo": 3.0, "drop": 3.2, "spread-mecefo": 0.0}

    def ppl(level, policy, seed):
        return 100.0 * np.exp((seed + (effect[policy] if level != "none" else 0.0) + rng.normal(0, 0.3)) / 100)

    default = [cell("none", "none", s, ppl("none", "none", s)) for s in range(3)]
    default += [cell(lvl, p, s, ppl(lvl, p, s)) for lvl in ("low", "high") for p in ("mecefo", "drop", "spread-mecefo")
                for s in range(2)]
    long = default + [cell(lvl, p, s, ppl(lvl, p, s)) for lvl, p in (("none", "none"), ("high", "mecefo"), ("high", "drop"))
                      for s in range(3, 6)]
    (tmp_path / "sweep" / "index-default.json").write_text(json.dumps(index(default, "default")))
    return tmp_path, long


def test_rows_pair_by_seed_with_pooled_intervals(results):
    cells, meta = table3.load_cells("default")
    out = table3.decide_table(cells, meta)
    by = {r["id"]: r for r in out["rows"]}
    high = by["main:high:mecefo:mecefo/main:none:none:mecefo"]
    assert high["seeds"] == [0, 1] and high["profile"] == "default"
    assert out["noise"]["df"] > 0 and all(r["ci"][1] - r["ci"][0] > 0 for r in out["rows"])
    assert high["word"].startswith("worse")  # an effect of 3 points against a noise of ~0.4
    low = by["main:low:spread-mecefo:mecefo/main:none:none:mecefo"]
    # no effect, but with 2 seeds a rerun's interval would not lie within ±1 with probability 95%
    assert low["word"] == "not decided with 2 seeds" and low["probability"] < 0.95
    assert high["margin"] > 0 and 0.5 < high["repeat"] <= 1 and high["probability"] >= 0.95
    assert high["change_pct"] == pytest.approx(100 * np.expm1(high["mean"] / 100))
    # the log scale throughout: the mean is the mean of 100 ln(a / b)
    assert high["mean"] == pytest.approx(np.mean(high["differences"]))
    groups = out["homogeneity"]["groups"]
    assert {"low", "high"} <= set(groups) and out["homogeneity"]["bartlett"]["df"] == len(
        [g for g in groups.values() if g["df"] >= 1]) - 1
    assert all(r["word_group_noise"] is None or isinstance(r["word_group_noise"], str) for r in out["rows"])
    assert {"low", "high"} == set(out["paper"])
    rng = out["paper"]["high"]
    assert rng["with_rounding"][0] < rng["printed"][0] <= rng["printed"][1] < rng["with_rounding"][1]
    assert 0 < out["warm_start"]["lr_weighted_share"] < 1


def test_a_row_uses_every_seed_results_holds_and_names_its_profile(results):
    tmp, long = results
    (tmp / "sweep" / "index-long.json").write_text(json.dumps(index(long, "long")))
    cells, meta = table3.load_cells("default")
    out = table3.decide_table(cells, meta)
    by = {r["id"]: r for r in out["rows"]}
    high = by["main:high:mecefo:mecefo/main:none:none:mecefo"]
    assert high["seeds"] == [0, 1, 3, 4, 5] and high["profile"] == "long"  # seed 2 ran failure-free only
    assert by["main:low:mecefo:mecefo/main:none:none:mecefo"]["profile"] == "default"
    assert len(cells) == len({c["config_hash"] for c in cells})


def test_no_index_is_a_usage_error(tmp_path, monkeypatch):
    from mecefo.errors import UsageError

    monkeypatch.setattr(table3, "RESULTS", tmp_path)
    with pytest.raises(UsageError, match="experiments.sweep"):
        table3.load_cells("default")


def test_where_against_the_paper_is_decided_like_the_words():
    """'above', 'below', 'within' only where a rerun's interval would say so with probability >= 95%."""
    from mecefo.stats import Noise, log_points

    tight, wide = Noise(0.1, 40, 0.12, 0.95, 100), Noise(0.83, 17, 1.16, 0.95, 47)
    rng = [1.5, 2.26]
    assert table3.where(float(log_points(3.5)), tight, 5, rng)["where"] == "above the paper's range"
    assert table3.where(float(log_points(0.5)), tight, 5, rng)["where"] == "below the paper's range"
    assert table3.where(float(log_points(1.9)), Noise(0.05, 40, 0.06, 0.95, 100), 20, rng)["where"] == "within the paper's range"
    wide_word = table3.where(float(log_points(3.5)), wide, 3, rng)
    assert wide_word["where"] == "not distinguished from the paper's range" and wide_word["probability"] < 0.95


def test_two_configs_for_one_cell_are_refused(results):
    """An index written by an older sweep config holds other runs under the same (row, seed): refused, not mixed."""
    from mecefo.errors import UsageError

    tmp, long = results
    stale = [dict(c, config_hash=c["config_hash"] + "-old") for c in long]
    (tmp / "sweep" / "index-long.json").write_text(json.dumps(index(stale, "long")))
    cells, meta = table3.load_cells("default")
    with pytest.raises(UsageError, match="different configs"):
        table3.decide_table(cells, meta)


def test_the_cold_start_row_is_decided_on_its_own_noise_and_left_out_of_the_pooled_one(results):
    tmp, _ = results
    path = tmp / "sweep" / "index-default.json"
    base = json.loads(path.read_text())
    before = table3.decide_table(*table3.load_cells("default"))["noise"]
    none = {c["seed"]: c["val_ppl"] for c in base["cells"] if c["level"] == "none"}
    swings = {0: 1.0, 1: 9.0, 2: 3.0}  # a chaotic early plateau: differences far noisier than the pooled rows'
    base["cells"] += [cell("high", "mecefo", s, none[s] * (1 + swings[s] / 100), tag="cold") for s in range(3)]
    path.write_text(json.dumps(base))
    out = table3.decide_table(*table3.load_cells("default"))
    assert out["noise"] == before  # the pooled noise does not see the cold runs
    row = {r["id"]: r for r in out["rows"]}["cold:high:mecefo:mecefo/main:none:none:mecefo"]
    logs = [100 * np.log1p(v / 100) for v in (1.0, 9.0, 3.0)]  # its differences on the log scale
    assert row["noise"]["df"] == 2 and abs(row["noise"]["sd"] - np.std(logs, ddof=1)) < 1e-9
    assert row["ci"][1] - row["ci"][0] > 10  # its own wide interval, not the pooled one


def test_the_n_sweep_pairs_every_n_with_failure_free_at_n1_by_seed():
    ref = {0: 100.0, 1: 110.0, 2: 90.0}
    cells = [cell("none", "none", s, v, n=1) for s, v in ref.items()]
    cells += [cell("high", "mecefo", s, ref[s] * (1 + (2.0 + s) / 100), n=4) for s in range(3)]
    cells += [cell("high", "drop", 0, ref[0] * 1.05, n=4)]
    rows = {r["n"]: r for r in table3.n_sweep(cells)}
    assert set(rows) == {1, 4} and rows[4]["failure_free_ppl"] == 100.0
    geometric = 100 * np.expm1(np.mean(np.log1p([0.02, 0.03, 0.04])))  # the log scale's mean, read as percent
    assert abs(rows[4]["mecefo"] - geometric) < 1e-9 and rows[4]["mecefo_seeds"] == 3
    lo, hi = rows[4]["mecefo_ci"]
    assert lo < 3.0 < hi
    assert abs(rows[4]["drop"] - 5.0) < 1e-9 and rows[4]["drop_ci"] is None  # one seed: a point, no interval
