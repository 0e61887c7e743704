"""Goodput (experiments.goodput): quality-equivalent steps against an independent computation, the quality per
trained token that keeps a dropping policy from being charged twice, exact policies at q = 1, and a policy
new to the registry in the table and the frontier without a change to either."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from experiments import goodput, goodput_runs
from experiments import goodput_envelope as envelope
from mecefo.stats import Noise
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
    return {p: {lv: {"q": {"mean": value, "ci95": [value - 0.05, value + 0.05], "values": [value, value]}, "seeds": [0, 1],
                     "failed_fraction": f}
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


def _result(names, eff):
    """A goodput result with every block the report reads, for the figure code."""
    sized = {p: {"mean": 1.0, "goodput": 1.0} for p in names}
    lead = {"best": names[0], "leads": True, "tied": [], "second": names[1], "goodput": {p: 1.0 for p in names},
            "margin": {p: {"d": 1.0, "lo": 0.5, "hi": 1.5, "seeds": [0]} for p in names[1:]}}
    level = {"by_reading": {"simulated": lead, "spares": lead}, "verdict": {"leader": names[0], "outcomes": {names[0]: ["simulated", "spares"]}}}
    return {"effective": eff, "quality": {}, "transfer": {}, "null_control": {}, "noise": None, "n": 32, "profile": "test",
            "levels": list(goodput.LEVELS), "readings": list(envelope.READINGS), "tolerance": envelope.TOLERANCE,
            "curves": {"0": {"lengths": [1, 2], "max_residual": 0.0}},
            "envelope": {"llama-7b": {lv: level for lv in goodput.LEVELS}},
            "drop_readings": {lv: {"measured": None} for lv in goodput.LEVELS},
            "comparability": {lv: {"cpu_failed_fraction": 0.1, "simulated_failed_fraction": 0.1} for lv in goodput.LEVELS},
            "scale": {"scenario": {"name": "x", "interval_h": 1.0, "recovery_h": 1.0}, "run_failed_fraction": 0.0, "max_q_gap": 0.0,
                      "sizes": {"32": {"policies": sized, "leaders": lead, "clamped": {}}}},
            "map": [{"gpus": 32, "gpu_mtbf_h": 10.0, "recovery_h": 1.0, "failed_fraction": 0.01, "best": names[0], "leads": False,
                     "tied": names[1:2], "equal": [], "group": names[:2], "next": names[2], "goodput": {p: 1.0 for p in names},
                     "margin": {"d": 1.0, "lo": -0.5, "hi": 2.5}, "clamped": {}}],
            "map_grid": {"gpus": [32], "gpu_mtbf_h": [10.0], "recovery_h": [1.0]}}


def test_a_new_registry_policy_appears_in_the_table_and_the_frontier(example):  # noqa: F811
    from paper_figures import goodput as figure

    names = policies.simulator_policies()
    assert NAME in names
    eff = goodput.effective(_throughput(names), _measured(["mecefo", "drop", "spread-mecefo", NAME]))
    result = _result(names, eff)
    assert sum(f"| `{NAME}` |" in line for line in figure.table(result)) == 3  # low, mid, high
    figure.frontier_figure(result)  # drawn without a change to the figure code
    figure.rate_figure(result)
    figure.map_figure(result)
    assert NAME in figure.report(result)[1]


class Cfg:
    class cluster:
        failure_free_steps = 0

    class train:
        steps = 100


def _scaling(names, retained=0.9):
    return _throughput(names) | {"scaling": {"scenario": {"name": "s", "interval_h": 48.0, "recovery_h": 3.0},
                                             "results": {"32": {p: {"retained": retained, "ci95": [retained - 0.1, retained + 0.1]}
                                                                for p in names}}}}


def test_q_at_scale_is_interpolated_in_the_failed_fraction():
    names = policies.simulator_policies()
    throughput, own = _scaling(names), {"32": {p: 100.0 for p in names}}
    out = goodput.at_scale(throughput, _measured(["mecefo"], 0.8), Cfg, own, None)
    f = out["run_failed_fraction"]
    assert f == pytest.approx(3.0 / (32 * 48.0))
    q = out["sizes"]["32"]["policies"]["mecefo"]["goodput"] / 0.9
    assert q == pytest.approx(math.exp(f / 0.02 * math.log(0.8)))  # log q linear between failure-free and low
    assert "goodput" not in out["sizes"]["32"]["policies"]["drop"]  # not measured
    assert out["sizes"]["32"]["clamped"] == {} and "Beyond" not in figure_scale_answer(out)
    throughput["scaling"]["scenario"]["recovery_h"] = 48.0 * 32 * 0.2  # 20% failed
    out = goodput.at_scale(throughput, _measured(["mecefo"], 0.8), Cfg, own, None)
    assert out["run_failed_fraction"] > 0.1 and out["sizes"]["32"]["clamped"] == {"mecefo": 0.1}  # beyond the measured high
    assert out["sizes"]["32"]["policies"]["mecefo"]["goodput"] == pytest.approx(0.9 * 0.8)
    assert "Beyond the largest failed fraction measured for `mecefo` (10.0%) q is held" in figure_scale_answer(out)


def test_each_scaling_job_has_its_own_failure_free_overhead():
    """Bamboo's redundancy costs a job with 16 micro-batches per replica other than Table 2's 7B job (64): G at scale
    must put each policy on the failure-free job's throughput with the overhead of that scaling job, not Table 2's."""
    names = policies.simulator_policies()
    throughput = _scaling(names, retained=1.0)
    throughput["table2"]["llama-7b"]["none"]["bamboo"]["mean"] = 50.0  # Table 2's job: Bamboo at half the throughput
    own = {"32": {p: 100.0 for p in names} | {"bamboo": 80.0}}  # the scaling job's own: Bamboo at 0.8
    out = goodput.at_scale(throughput, _measured([]), Cfg, own, None)
    assert out["sizes"]["32"]["policies"]["bamboo"]["failure_free_kept"] == pytest.approx(0.8)
    assert out["sizes"]["32"]["policies"]["bamboo"]["goodput"] == pytest.approx(0.8)


def figure_scale_answer(scale: dict) -> str:
    from paper_figures import goodput as figure

    return figure.scale_answer(scale)


def _cell(kept, log_q=None, se=0.0):
    return {"kept": kept, "se": se, "log_q": log_q}


def test_a_single_seed_without_pooled_noise_never_leads():
    """One seed has no interval of its own: without pooled noise its difference is unbounded, so it neither leads nor
    lets another policy lead (the old comparison with ci95's NaN was always False: a single-seed cell printed 'leads')."""
    cells = {"a": _cell(0.9, {0: 0.0}), "b": _cell(0.5), "c": _cell(0.4)}
    c = envelope.compare(cells, None)
    assert (c["best"], c["leads"], c["tied"]) == ("a", False, ["b", "c"])
    cells = {"a": _cell(0.9), "b": _cell(0.5, {0: 0.0})}
    assert envelope.compare(cells, None)["leads"] is False
    noise = Noise(sd=1.0, df=10, upper=2.0, level=0.95, runs=20)  # pooled from other cells: one seed is bounded
    assert envelope.compare(cells, noise)["leads"] is True


def test_a_throughput_from_one_seed_is_unbounded():
    """The single-seed bug on the throughput side: a simulated cell without an interval has no standard error, so it
    can neither lead nor let another lead."""
    one = {"mean": 0.9, "ci95": [float("nan"), float("nan")], "seeds": 1}
    assert envelope._se(one, 1.0) == math.inf
    assert envelope._se({"mean": 0.9, "ci95": [0.8, 1.0], "seeds": 5}, 1.0) == pytest.approx(
        100 * 0.2 / (2 * 2.7764451 * 0.9), rel=1e-6)  # t(0.975, 4)
    c = envelope.compare({"a": _cell(0.9, se=math.inf), "b": _cell(0.5, se=0.1)}, None)
    assert c["best"] == "a" and not c["leads"]


def test_a_lead_wholly_within_the_tolerance_is_no_lead():
    """Ahead at 95% by less than 1% for sure is equal for an operator's choice; ahead with room above 1% leads."""
    cells = {"a": _cell(1.004, se=0.05), "b": _cell(1.0, se=0.05)}  # +0.4% [+0.26, +0.54]
    c = envelope.compare(cells, None)
    assert (c["leads"], c["equal"], c["tied"]) == (False, ["b"], [])
    assert envelope.verdict({"spares": c})["outcomes"] == {"tied: a, b": ["spares"]}
    cells["a"]["kept"] = 1.009  # +0.9% [+0.76, +1.03]: ahead at 95%, but by less than 1%
    assert envelope.compare(cells, None)["leads"] is False
    cells["a"]["kept"] = 1.02  # +2.0%
    assert envelope.compare(cells, None)["leads"] is True
    cells["a"]["se"] = 1.5  # +2.0% [-0.9, +5.0]: not decided
    c = envelope.compare(cells, None)
    assert (c["leads"], c["equal"], c["tied"]) == (False, [], ["b"])


def test_the_paired_difference_against_an_independent_computation():
    from scipy import stats

    noise = Noise(sd=2.0, df=17, upper=3.0, level=0.95, runs=40)
    a = _cell(0.8, {0: -1.0, 1: -3.0, 2: 5.0}, se=0.4)
    b = _cell(0.7, {0: -2.0, 1: -2.5, 3: 9.0}, se=0.3)  # seeds 0 and 1 in common
    x = envelope.paired(a, b, noise)
    d = 100 * math.log(0.8 / 0.7) + ((-1.0 + 2.0) + (-3.0 + 2.5)) / 2
    half = stats.t.ppf(0.975, 17) * math.sqrt(0.4 ** 2 + 0.3 ** 2 + 2.0 ** 2 / 2)
    assert (x["d"], x["half"], x["seeds"]) == (pytest.approx(d), pytest.approx(half), [0, 1])
    x = envelope.paired(a, _cell(0.7), noise)  # one trained: 100 ln q is a run against its failure-free run: sd^2 / k
    assert x["d"] == pytest.approx(100 * math.log(0.8 / 0.7) + 1 / 3)
    assert x["half"] == pytest.approx(stats.t.ppf(0.975, 17) * math.sqrt(0.4 ** 2 + 2.0 ** 2 / 3))
    assert envelope.paired(_cell(0.8, {0: 1.0}), _cell(0.7, {1: 1.0}), noise)["half"] == math.inf  # no common seed
    near = a | {"q_var": 0.01}  # q interpolated close to failure-free: a tenth of the noise
    assert envelope.paired(near, _cell(0.7), noise)["half"] == pytest.approx(stats.t.ppf(0.975, 17) * math.sqrt(0.4 ** 2 + 0.01 * 2.0 ** 2 / 3))


def test_a_policy_leads_only_where_every_reading_agrees():
    lead_a = {"best": "a", "leads": True, "tied": []}
    assert envelope.verdict({"simulated": lead_a, "spares": lead_a}) == {"leader": "a", "outcomes": {"a": ["simulated", "spares"]}}
    v = envelope.verdict({"simulated": lead_a, "no-barrier": {"best": "b", "leads": True, "tied": []},
                          "spares": {"best": "a", "leads": False, "tied": ["b"]}})
    assert v == {"leader": None, "outcomes": {"a": ["simulated"], "b": ["no-barrier"], "tied: a, b": ["spares"]}}
    from paper_figures.goodput import job_sentence

    levels = {"low": {"verdict": {"leader": "a", "outcomes": {}}}, "mid": {"verdict": {"leader": "a", "outcomes": {}}},
              "high": {"verdict": v}}
    said = job_sentence("llama-7b", levels, ["low", "mid", "high"])
    assert said.startswith("**llama-7b**: `a` leads at low and mid under every reading; at high the reading decides")
    assert "`b` under no-barrier" in said and "no lead under spares" in said


def test_the_readings_of_the_throughput():
    """no-barrier: 1 - 2 f (1 - 1/alpha) for a neighbour's policy; fitted: the baseline variants; provisioned:
    checkpoint-restart per provisioned GPU; paper: the paper's drops on each policy's own failure-free throughput."""
    from experiments.throughput import FITTED, PAPER_JOBS
    from mecefo.failures import SCENARIOS
    from mecefo.simulator import CostModel

    names = policies.simulator_policies()
    t = _throughput(names)
    for lv in ("low", "mid", "high"):
        t["table2"]["llama-7b"][lv][FITTED] = {"mean": 11.0, "ci95": [10.0, 12.0]}
    sim = {"spares": {"llama-7b": {lv: {p: {"mean": 99.0, "ci95": [98.0, 100.0]} for p in names} for lv in ("low", "mid", "high")}}}
    r = envelope.kept_readings(t, sim, "llama-7b", "high", {"llama-7b": {"high": {"mecefo": 0.04, "bamboo": 0.2}}})
    f, alpha = SCENARIOS["high"].expected_failed_fraction(), CostModel(PAPER_JOBS["llama-7b"]).alpha(1)
    assert r["no-barrier"]["mecefo"]["kept"] == pytest.approx(1 - 2 * f * (1 - 1 / alpha))
    assert r["no-barrier"]["ndb-exact"]["kept"] == pytest.approx(1 - f)  # alpha = 2
    assert r["no-barrier"]["drop"] == r["simulated"]["drop"]
    assert r["fitted"]["bamboo"]["kept"] == pytest.approx(0.11) and r["fitted"]["mecefo"] == r["simulated"]["mecefo"]
    assert r["spares"]["drop"]["kept"] == pytest.approx(0.99)
    ckpt = r["simulated"]["checkpoint-restart"]["kept"]
    assert r["provisioned"]["checkpoint-restart"]["kept"] == pytest.approx(ckpt / (1 + f))
    assert r["paper"]["mecefo"]["kept"] == pytest.approx(0.96) and r["paper"]["drop"] == r["simulated"]["drop"]
    assert "paper" not in envelope.kept_readings(t, sim, "llama-7b", "low", {"llama-7b": {"high": {"mecefo": 0.04}}})


@given(st.floats(0.1, 0.5), st.sampled_from(["low", "mid", "high"]))
def test_drop_is_trained_at_the_lost_fraction_it_is_read_at(target, level):
    """The transfer runs' scenario puts `target` of the ranks down in steady state (Little's law), with the level's
    recovery time."""
    from mecefo import failures

    sc = failures.scenario(goodput_runs.transfer_spec(level, target))
    assert sc.recovery_h == failures.SCENARIOS[level].recovery_h
    assert sc.expected_failed_fraction() == pytest.approx(round(target, 3), rel=1e-5)


def test_q_is_interpolated_per_seed_and_held_beyond_the_measured():
    points = [(0.1, {0: -10.0, 1: -20.0}), (0.4, {0: -40.0, 2: 0.0})]
    assert envelope.interp_log_q(points, 0.05) == ({0: -5.0, 1: -10.0}, False, 0.25)  # half way from q = 1: w^2
    v, held, factor = envelope.interp_log_q(points, 0.25)
    assert v == pytest.approx({0: -25.0}) and not held  # seeds both bracketing points have
    assert factor == pytest.approx(0.75)  # (1 - w)^2 + w^2 + w (1 - w): the two share the seed's failure-free run
    assert envelope.interp_log_q(points, 0.5) == ({0: -40.0, 2: 0.0}, True, 1.0)


def test_the_null_control_fails_on_a_biased_pipeline():
    noise = Noise(sd=0.5, df=20, upper=1.0, level=0.95, runs=30)
    fair = goodput.pooled_interval({"q": {"values": [1.002, 0.997, 1.001]}}, noise)
    biased = goodput.pooled_interval({"q": {"values": [0.97, 0.975, 0.968]}}, noise)
    assert fair["ci95"][0] <= 1 <= fair["ci95"][1] and not biased["ci95"][0] <= 1 <= biased["ci95"][1]
    assert goodput.pooled_interval({"q": {"values": [0.97]}}, None)["ci95"] == [-math.inf, math.inf]


def test_the_envelope_reads_q_at_each_readings_failed_fraction():
    """Under every reading but `spares` q is the level's (drop on 7B: its runs at 7B's lost fraction); under `spares`
    a failed GPU's place is empty for a spare's wait only, so q is read near failure-free."""
    names = policies.simulator_policies()
    t = _throughput(names)
    sim = {"spares": {"llama-7b": {lv: {p: {"mean": 99.0, "ci95": [98.0, 100.0]} for p in names} for lv in goodput.LEVELS}}}
    measured = _measured(["mecefo", "drop"], 0.9)
    transfer = {"drop": {lv: m | {"failed_fraction": 4 * m["failed_fraction"]} for lv, m in _measured(["drop"], 0.7)["drop"].items()}}
    noise = Noise(sd=1.0, df=20, upper=2.0, level=0.95, runs=30)
    read_at = {"low": 0.08, "mid": 0.2, "high": 0.4}  # drop on 7B: at its runs near 7B's lost fraction
    env = goodput.envelope(t, sim, measured, transfer, noise, 1.0, read_at)["llama-7b"]
    high = env["high"]
    assert list(high["by_reading"]) == list(envelope.READINGS)  # the paper's reading at high
    assert "paper" not in env["low"]["by_reading"]
    sim_g = high["by_reading"]["simulated"]["goodput"]
    assert sim_g["mecefo"] == pytest.approx(high["readings"]["simulated"]["mecefo"]["kept"] * 0.9)
    assert sim_g["drop"] == pytest.approx(high["readings"]["simulated"]["drop"]["kept"] * 0.7)  # the transfer runs
    assert env["high"]["clamped"] == [] and goodput.envelope(t, sim, measured, transfer, noise, 1.0, {
        lv: 0.5 for lv in goodput.LEVELS})["llama-7b"]["high"]["clamped"] == ["drop"]  # beyond its runs: said
    spares_g = high["by_reading"]["spares"]["goodput"]
    from experiments.goodput_sim import with_spares
    from experiments.throughput import PAPER_JOBS

    f = with_spares("high", PAPER_JOBS["llama-7b"]).expected_failed_fraction()  # _measured's low level: 2% at q 0.9
    assert spares_g["mecefo"] == pytest.approx(0.99 * math.exp(f / 0.02 * math.log(0.9)))
    assert high["verdict"]["leader"] is None or all(c["leads"] for c in high["by_reading"].values())
