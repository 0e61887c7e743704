"""Goodput (experiments.goodput): quality-equivalent steps against an independent computation, the quality per
trained token that keeps a dropping policy from being charged twice, exact policies at q = 1, and a policy
new to the registry in the table and the frontier without a change to either."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments import goodput
from mecefo import policies
from tests.test_policy_registry import NAME, example  # noqa: F401  (the fixture)


@given(st.floats(3.0, 9.0), st.floats(-1.0, -0.05), st.floats(25.0, 400.0))
def test_the_fit_recovers_its_curve_and_inverts_it(a, b, s):
    points = [{"steps": n, "val_loss": a + b * math.log(n)} for n in (20, 30, 45, 60)]
    curve = goodput.fit(points)
    assert curve["a"] == pytest.approx(a, rel=1e-6) and curve["b"] == pytest.approx(b, rel=1e-6)
    assert curve["max_residual"] < 1e-8
    assert goodput.equivalent_steps(curve, a + b * math.log(s)) == pytest.approx(s, rel=1e-6)


def test_a_curve_that_does_not_fall_is_refused():
    with pytest.raises(ValueError, match="does not fall"):
        goodput.fit([{"steps": 10, "val_loss": 3.0}, {"steps": 20, "val_loss": 3.1}])


def _run(root, name, loss, steps=100, seen=1000, trained=1000, failed=0.1):
    (root / name).mkdir(parents=True)
    (root / name / "summary.json").write_text(json.dumps({
        "final_val_loss": loss, "steps": steps, "tokens_seen": steps * seen, "tokens_trained": steps * trained,
        "failure_schedule": {"fraction_failed": failed}}))
    return name


def test_quality_per_trained_token_charges_a_dropping_policy_once(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "RESULTS", tmp_path)
    curve = {"a": 8.0, "b": -0.6, "lengths": [60, 100], "full_loss": 8.0 - 0.6 * math.log(100) + 0.01}
    own = math.exp(0.01 / -0.6) * 100  # the seed's failure-free run, as the fit reads it: the runs are measured against it
    at = {s: 8.0 - 0.6 * math.log(s) for s in (95, 90, 80, 70)}
    cells = [
        {"tag": "main", "n": 32, "level": "high", "policy": "mecefo", "seed": 0, "run": _run(tmp_path, "m0", at[95])},
        {"tag": "main", "n": 32, "level": "high", "policy": "mecefo", "seed": 1, "run": _run(tmp_path, "m1", at[90])},
        {"tag": "main", "n": 32, "level": "high", "policy": "drop", "seed": 0, "run": _run(tmp_path, "d0", at[80], trained=880)},
        {"tag": "main", "n": 32, "level": "high", "policy": "drop", "seed": 1, "run": _run(tmp_path, "d1", at[70], trained=880)},
        {"tag": "main", "n": 4, "level": "high", "policy": "drop", "seed": 0, "run": "elsewhere"},  # another n: not read
    ]
    q = goodput.quality({"design": {"n": 32}, "cells": cells}, {0: curve, 1: curve})
    m, d = [95 / own, 90 / own], [80 / own, 70 / own]
    assert q["mecefo"]["high"]["steps_fraction"]["values"] == pytest.approx(m)
    assert q["mecefo"]["high"]["q"]["values"] == pytest.approx(m)  # every sample trained
    assert q["drop"]["high"]["steps_fraction"]["values"] == pytest.approx(d)
    assert q["drop"]["high"]["q"]["values"] == pytest.approx([v / 0.88 for v in d])  # per token it trained
    assert q["drop"]["high"]["extrapolated"] is False
    mean, lo, hi = q["mecefo"]["high"]["q"]["mean"], *q["mecefo"]["high"]["q"]["ci95"]
    half = 12.706 * np.std(m, ddof=1) / math.sqrt(2)  # t(0.975, 1 df)
    assert mean == pytest.approx(np.mean(m)) and (lo, hi) == pytest.approx((mean - half, mean + half), rel=1e-3)


def _throughput(names, levels=("low", "mid", "high")):
    row = {"none": {p: {"mean": 100.0, "ci95": [100.0, 100.0]} for p in names}}
    for i, level in enumerate(levels):
        row[level] = {p: {"mean": 90.0 - 10 * i - j, "ci95": [85.0 - 10 * i - j, 95.0 - 10 * i - j]}
                      for j, p in enumerate(names)}
    return {"table2": {"llama-7b": row}}


def _measured(names, value=0.9):
    return {p: {lv: {"q": {"mean": value, "ci95": [value - 0.05, value + 0.05]}, "failed_fraction": f}
                for lv, f in zip(("low", "mid", "high"), (0.02, 0.05, 0.1))} for p in names}


def test_exact_policies_are_worth_every_step_and_unmeasured_ones_are_said_so():
    names = policies.simulator_policies()
    eff = goodput.effective(_throughput(names), _measured(["mecefo"]))
    high = eff["llama-7b"]["levels"]["high"]
    for p in names:
        if policies.get(p).exact:
            assert high[p]["q"]["mean"] == 1.0 and high[p]["goodput"] == pytest.approx(high[p]["kept"])
    assert high["mecefo"]["goodput"] == pytest.approx(high["mecefo"]["kept"] * 0.9)
    assert high["mecefo"]["time_to_quality"] == pytest.approx(1 / high["mecefo"]["goodput"])
    assert high["drop"]["q"] is None and "goodput" not in high["drop"]  # trained by nobody here: not measured
    w = goodput.winners(eff)["llama-7b"]["high"]
    assert "drop" in w["not_measured"]
    g = {p: c["goodput_range"] for p, c in high.items() if "goodput" in c}
    assert w["leads"] == all(g[w["best"]][0] > g[p][1] for p in g if p != w["best"])
    assert w["tied"] == [p for p in sorted(g, key=lambda p: -high[p]["goodput"]) if p != w["best"] and g[p][1] >= g[w["best"]][0]]


def test_a_new_registry_policy_appears_in_the_table_and_the_frontier(example):  # noqa: F811
    from paper_figures import goodput as figure

    names = policies.simulator_policies()
    assert NAME in names
    eff = goodput.effective(_throughput(names), _measured(["mecefo", "drop", "spread-mecefo", NAME]))
    sized = {p: {"goodput": 1.0, "goodput_range": [1.0, 1.0]} for p in names}
    result = {"effective": eff, "winners": goodput.winners(eff), "quality": {}, "n": 32, "profile": "test",
              "curves": {"0": {"lengths": [1, 2], "max_residual": 0.0}},
              "comparability": {lv: {"cpu_failed_fraction": 0.1, "simulated_failed_fraction": 0.1, "drop_samples_lost_cpu": 0.1,
                                     "drop_samples_lost_7b": 0.4} for lv in goodput.LEVELS},
              "scale": {"scenario": {"name": "x", "interval_h": 1.0, "recovery_h": 1.0}, "run_failed_fraction": 0.0,
                        "q": {p: {"mean": 1.0} for p in names},
                        "sizes": {"32": {"policies": sized, "leaders": goodput.leaders(sized)}}}}
    assert sum(f"| `{NAME}` |" in line for line in figure.table(result)) == 3  # low, mid, high
    figure.frontier_figure(result)  # drawn without a change to the figure code
    figure.rate_figure(result)
    assert NAME in figure.report(result)[1]


def test_q_at_scale_is_interpolated_in_the_failed_fraction():
    names = policies.simulator_policies()
    throughput = _throughput(names) | {"scaling": {"scenario": {"name": "s", "interval_h": 48.0, "recovery_h": 3.0},
                                                   "results": {"32": {p: {"retained": 0.9, "ci95": [0.8, 1.0]} for p in names}}}}

    class Cfg:
        class cluster:
            failure_free_steps = 0

        class train:
            steps = 100

    out = goodput.at_scale(throughput, _measured(["mecefo"], 0.8), Cfg)
    f = out["run_failed_fraction"]
    assert f == pytest.approx(3.0 / (32 * 48.0))
    assert out["q"]["mecefo"]["mean"] == pytest.approx(1 - 0.2 * f / 0.02)  # between failure-free and low
    assert out["sizes"]["32"]["policies"]["mecefo"]["goodput"] == pytest.approx(0.9 * out["q"]["mecefo"]["mean"])
    assert "drop" not in out["q"]  # not measured at every level
    assert out["q"]["mecefo"]["clamped_at"] is None and "is beyond" not in figure_scale_answer(out)
    Cfg.cluster.failure_free_steps, throughput["scaling"]["scenario"]["recovery_h"] = 0, 48.0 * 32 * 0.2  # 20% failed
    out = goodput.at_scale(throughput, _measured(["mecefo"], 0.8), Cfg)
    assert out["run_failed_fraction"] > 0.1 and out["q"]["mecefo"]["clamped_at"] == 0.1  # beyond the measured high
    assert out["q"]["mecefo"]["mean"] == pytest.approx(0.8)
    assert "is beyond the largest measured for `mecefo` (10.0%): their q is held" in figure_scale_answer(out)


def figure_scale_answer(scale: dict) -> str:
    from paper_figures import goodput as figure

    return figure.scale_answer(scale)


def test_a_policy_leads_only_where_every_range_is_bounded_and_below_its_own():
    """One seed gives no interval (ci95's NaN): such a range is unbounded, so it never lets a policy lead, nor leads
    itself (the old comparison with NaN was always False: a single-seed cell printed 'leads')."""
    nan = float("nan")
    cells = {"a": {"goodput": 0.9, "goodput_range": [0.85, 0.95]}, "b": {"goodput": 0.7, "goodput_range": [0.65, 0.75]},
             "c": {}}
    w = goodput.leaders(cells)
    assert (w["best"], w["second"], w["leads"], w["tied"], w["not_measured"]) == ("a", "b", True, [], ["c"])
    cells["b"]["goodput_range"] = [nan, nan]  # the runner-up from one seed
    w = goodput.leaders(cells)
    assert (w["leads"], w["tied"], w.get("unbounded")) == (False, ["b"], ["b"])
    cells["b"]["goodput_range"], cells["a"]["goodput_range"] = [0.65, 0.75], [nan, nan]  # the leader from one seed
    w = goodput.leaders(cells)
    assert (w["leads"], w["tied"], w.get("unbounded")) == (False, ["b"], ["a"])
