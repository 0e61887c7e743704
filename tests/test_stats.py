"""The estimators against closed forms: a linear-Gaussian estimator g~ = A z + b, z ~ N(mu, S), has
E g~ = A mu + b and Cov g~ = A S A^T, so bias, variance and MSE are known exactly."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo.stats import estimator_stats, fit_rate, reference_gradient, relative_error


def linear_gaussian(seed, d=6):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(d, d)) / np.sqrt(d), rng.normal(size=d) * 0.3
    mu, l = rng.normal(size=d), rng.normal(size=(d, d)) / np.sqrt(d)
    s = l @ l.T + 0.1 * np.eye(d)
    ref = rng.normal(size=d)
    mean, cov = a @ mu + b, a @ s @ a.T
    truth = {"bias": np.linalg.norm(mean - ref), "variance": np.trace(cov),
             "mse": np.linalg.norm(mean - ref) ** 2 + np.trace(cov)}

    def draw(k, rng):
        return rng.multivariate_normal(mu, s, size=k) @ a.T + b

    return ref, truth, draw


def test_intervals_cover_the_truth_at_about_their_level():
    hits, trials = {"bias": 0, "variance": 0, "mse": 0}, 60
    for seed in range(trials):
        ref, truth, draw = linear_gaussian(seed)
        out = estimator_stats(draw(200, np.random.default_rng(1000 + seed)), ref, n_boot=300, seed=seed)["all"]
        for k in hits:
            lo, hi = out[k]["ci"]
            hits[k] += lo <= truth[k] <= hi
    for k, h in hits.items():  # 95% intervals: at least ~85% coverage over 60 problems (binomial slack)
        assert h >= 0.85 * trials, (k, h)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_estimates_converge_and_mse_decomposes(seed):
    ref, truth, draw = linear_gaussian(seed)
    out = estimator_stats(draw(20_000, np.random.default_rng(seed)), ref, n_boot=20)["all"]
    assert out["variance"]["value"] == pytest.approx(truth["variance"], rel=0.06)
    assert out["mse"]["value"] == pytest.approx(truth["mse"], rel=0.06)
    assert out["bias"]["value"] == pytest.approx(truth["bias"], rel=0.1, abs=0.03)
    # MSE = bias^2 + variance up to the (K-1)/K factor of the variance estimate
    k = 20_000
    assert out["mse"]["value"] == pytest.approx(out["bias"]["value"] ** 2 + out["variance"]["value"] * (k - 1) / k, rel=1e-9)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_estimators_are_invariant_to_the_order_of_the_draws(seed):
    ref, _, draw = linear_gaussian(seed)
    draws = draw(50, np.random.default_rng(seed))
    perm = np.random.default_rng(seed + 1).permutation(50)
    a = estimator_stats(draws, ref, n_boot=10)["all"]
    b = estimator_stats(draws[perm], ref, n_boot=10)["all"]
    for k in ("bias", "variance", "mse", "relative_bias"):
        assert a[k]["value"] == pytest.approx(b[k]["value"], rel=1e-12)


def test_groups_partition_the_mse():
    ref, _, draw = linear_gaussian(3)
    out = estimator_stats(draw(100, np.random.default_rng(0)), ref, {"first": slice(0, 2), "rest": slice(2, None)}, n_boot=10)
    assert out["first"]["mse"]["value"] + out["rest"]["mse"]["value"] == pytest.approx(out["all"]["mse"]["value"])


def test_unbiased_estimator_has_debiased_bias_near_zero():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=8)
    draws = ref + rng.normal(size=(4000, 8))
    out = estimator_stats(draws, ref, n_boot=50)["all"]
    assert abs(out["bias_sq_debiased"]["value"]) < 0.01
    assert out["bias_sq_debiased"]["ci"][0] <= 0.0 <= out["bias"]["ci"][1] ** 2


def test_reference_gradient_standard_error():
    rng = np.random.default_rng(1)
    r = reference_gradient(rng.normal(size=(400, 10)) * 2.0)
    assert r.se_norm == pytest.approx(np.sqrt(10 * 4 / 400), rel=0.1)
    assert np.linalg.norm(r.mean) < 4 * r.se_norm


@settings(max_examples=30, deadline=None)
@given(slope=st.floats(-2, 1), intercept=st.floats(-3, 3), seed=st.integers(0, 1000))
def test_fitter_recovers_known_slopes(slope, intercept, seed):
    nt = np.logspace(2, 5, 12)
    noise = np.random.default_rng(seed).normal(scale=0.05, size=nt.size)
    fit = fit_rate(nt, np.exp(intercept + slope * np.log(nt) + noise))
    assert fit.contains(slope) or abs(fit.slope - slope) < 0.03
    assert fit.ci[1] - fit.ci[0] < 0.2


def test_fitter_rejects_a_wrong_slope_and_bad_input():
    nt = np.logspace(2, 5, 10)
    assert not fit_rate(nt, nt ** -1.0).contains(-0.5)
    with pytest.raises(ValueError):
        fit_rate([1, 2], [1, 2])
    with pytest.raises(ValueError):
        estimator_stats(np.zeros((1, 3)), np.zeros(3))


def test_relative_error():
    assert relative_error(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(1.0)
    assert relative_error(np.array([2.0]), np.array([2.0])) == 0.0


def test_paired_relative_change_and_its_verdict():
    from mecefo.stats import interval_half_width, paired_relative_change, verdict_word

    a, b = [101.0, 102.0, 103.0, 101.5], [100.0, 100.0, 100.0, 100.0]
    p = paired_relative_change(a, b)
    d = np.array([1.0, 2.0, 3.0, 1.5])
    assert p.mean == pytest.approx(d.mean()) and p.sd == pytest.approx(d.std(ddof=1)) and p.pairs == 4
    half = 3.182446305284263 * d.std(ddof=1) / 2  # t_{3, 0.975}
    assert p.ci == pytest.approx((d.mean() - half, d.mean() + half))
    assert interval_half_width(p.sd, 4) == pytest.approx(half)
    assert interval_half_width(1.0, 100) < interval_half_width(1.0, 10) < interval_half_width(1.0, 3)
    assert verdict_word(p.ci) == "worse"
    assert verdict_word((-0.5, 0.8)) == "equal within ±1" and verdict_word((-3.0, -1.5)) == "better"
    assert verdict_word((-2.0, 0.5)) == "unresolved"
    assert verdict_word(paired_relative_change([1.0], [2.0]).ci) == "unresolved"


def test_sweep_pairs_by_seed_and_reads_the_power_curve():
    import pandas as pd

    from mecefo.stats import seeds_needed
    from paper_figures.sweep import paired, paired_table

    rows = [{"tag": "main", "n": 8, "level": "none", "policy": "none", "seed": s, "val_ppl": 100.0 + s} for s in range(3)]
    rows += [{"tag": "main", "n": 8, "level": "high", "policy": "mecefo", "seed": s, "val_ppl": (100.0 + s) * 1.02}
             for s in (2, 0, 1)]  # another order: pairing is by seed
    rows += [{"tag": "fig3", "n": 8, "level": "high", "policy": "mecefo", "seed": 0, "val_ppl": 50.0, "techniques": "skip_ffn"}]
    df = pd.DataFrame(rows).fillna({"techniques": "mecefo"})
    r = paired(df, 8, "high", "mecefo", "none")
    assert r.pairs == 3 and r.mean == pytest.approx(2.0) and r.sd == pytest.approx(0.0, abs=1e-9)
    assert paired(df, 8, "high", "drop", "none") is None
    assert "worse" in "\n".join(paired_table(df, 8)) or "equal" in "\n".join(paired_table(df, 8))
    assert seeds_needed(float("nan")) is None and seeds_needed(1.0) == 7  # t_{6} / sqrt(7) = 0.92 <= 1
    assert paired(df[df["tag"] == "main"], 8, "high", "mecefo", "none") == r  # the Figure 3 run is not a main cell


def test_the_reported_perplexity_is_the_mean_loss_of_the_last_evaluations():
    import math

    from experiments.sweep import last_evaluations_ppl

    rows = [{"step": s, "val_loss": 5.0 - s / 100} for s in range(0, 101, 25)] + [{"step": 101, "loss": 1.0}]
    rows.insert(3, {"step": 50, "val_loss": 0.0, "replay": True})  # replayed evaluations (checkpoint-restart) are not counted
    assert last_evaluations_ppl(rows, 2) == pytest.approx(math.exp((4.25 + 4.0) / 2))
    assert last_evaluations_ppl(rows, 99) == pytest.approx(math.exp(sum(5.0 - s / 100 for s in range(0, 101, 25)) / 5))
    with pytest.raises(ValueError, match="no validation"):
        last_evaluations_ppl([{"step": 1, "loss": 2.0}])
