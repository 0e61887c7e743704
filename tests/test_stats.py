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


@settings(max_examples=25, deadline=None)  # 20,000 draws of 6 coordinates: the bootstrap on the errors, ~15 ms each
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


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(2, 40), d=st.integers(1, 8))
def test_few_coordinates_and_many_give_the_same_statistics(seed, k, d):
    """Fewer coordinates than draws take the errors' path, as many or more the Gram matrix's: zero coordinates
    appended (errors unchanged) move a problem from one to the other, with the same bootstrap resamples."""
    rng = np.random.default_rng(seed)
    ref, draws = rng.normal(size=d), rng.normal(size=(k, d)) * rng.uniform(0.1, 3) + rng.normal(size=d)
    pad = max(k - d, 0)
    a = estimator_stats(draws, ref, n_boot=15, seed=seed)["all"]
    b = estimator_stats(np.pad(draws, ((0, 0), (0, pad))), np.pad(ref, (0, pad)), n_boot=15, seed=seed)["all"]
    for key in a:
        assert a[key]["value"] == pytest.approx(b[key]["value"], rel=1e-9, abs=1e-12)
        assert a[key]["ci"] == pytest.approx(b[key]["ci"], rel=1e-9, abs=1e-12)


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
    assert out["bias_sq_debiased"]["ci"][0] <= 0.0 <= out["bias_sq_debiased"]["ci"][1]


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


def test_paired_relative_change():
    from mecefo.stats import interval_half_width, paired_relative_change

    a, b = [101.0, 102.0, 103.0, 101.5], [100.0, 100.0, 100.0, 100.0]
    p = paired_relative_change(a, b)
    d = np.array([1.0, 2.0, 3.0, 1.5])
    assert p.mean == pytest.approx(d.mean()) and p.sd == pytest.approx(d.std(ddof=1)) and p.pairs == 4
    half = 3.182446305284263 * d.std(ddof=1) / 2  # t_{3, 0.975}
    assert p.ci == pytest.approx((d.mean() - half, d.mean() + half))
    assert interval_half_width(p.sd, 4) == pytest.approx(half)
    assert interval_half_width(1.0, 4, df=30) < interval_half_width(1.0, 4)  # a pooled sd's df narrows t
    assert interval_half_width(1.0, 100) < interval_half_width(1.0, 10) < interval_half_width(1.0, 3)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-1.5, 1.5), min_size=2, max_size=8), st.floats(-2.0, 2.0), st.floats(1.0, 2.0))
def test_block_noise_with_two_configurations_is_the_sd_of_the_paired_log_differences(noise, shift, base):
    """Two configurations on S seeds: the additive model's residual, times sqrt 2, is the sample sd of the paired
    differences of 100 ln ppl (an independent computation), with S - 1 df; its upper bound lies above it."""
    from mecefo.stats import block_noise

    seeds = range(len(noise))
    a = [base * 10 + s for s in seeds]
    b = [v * np.exp((shift + e) / 100) for v, e in zip(a, noise)]
    d = 100 * (np.log(b) - np.log(a))
    if d.std(ddof=1) < 1e-6:
        return
    got = block_noise([("a", s, a[s]) for s in seeds] + [("b", s, b[s]) for s in seeds])
    assert got.df == len(noise) - 1 and got.runs == 2 * len(noise)
    assert got.sd == pytest.approx(d.std(ddof=1), rel=1e-6) and got.upper > got.sd


def test_block_noise_pools_every_configuration_and_refuses_no_residual():
    from mecefo.stats import block_noise

    rng = np.random.default_rng(0)
    truth = 0.8  # sd of one paired difference: s_e = 0.8 / sqrt 2
    runs = [(c, s, float(np.exp((10 * c + s + rng.normal(0, truth / np.sqrt(2))) / 100))) for c in range(6) for s in range(40)]
    got = block_noise(runs)
    assert got.df == 240 - 6 - 40 + 1 and got.sd == pytest.approx(truth, rel=0.1)
    runs.append((99, 0, 1.0))  # a configuration with one seed adds a run and a parameter, no df
    assert block_noise(runs).df == got.df
    with pytest.raises(ValueError, match="degrees of freedom"):
        block_noise([("a", 0, 1.0), ("b", 0, 2.0)])


def _simulated_reruns(mean, sd, pairs, df, draws, rng, own=False):
    """Reruns drawn as the rule models them, by hand: the true sd from its posterior (df s^2 / sigma^2 ~ chi2_df),
    the true mean from N(m, sigma^2 / k), the rerun's k paired differences from N(mu, sigma^2), and the rerun's sd
    either pooled with its own df (an independent chi2_df draw) or, for a row on its own noise, their sample sd."""
    sigma = sd * np.sqrt(df / rng.chisquare(df, draws))
    mu = mean + sigma / np.sqrt(pairs) * rng.standard_normal(draws)
    d = mu[:, None] + sigma[:, None] * rng.standard_normal((draws, pairs))
    s = d.std(axis=1, ddof=1) if own else sigma * np.sqrt(rng.chisquare(df, draws) / df)
    return d.mean(axis=1), s


@pytest.mark.parametrize("mean,sd,pairs,df,own", [(2.6, 0.83, 3, 17, False), (1.0, 0.83, 2, 17, False),
                                                    (-0.3, 0.5, 8, 30, False), (7.0, 4.7, 3, 2, True),
                                                    (0.2, 0.4, 20, 19, True)])
def test_the_stated_rerun_probability_is_what_simulated_reruns_give(mean, sd, pairs, df, own):
    """rerun_probability (quadrature) against reruns drawn independently: the direction, the size within ±1 and both,
    within Monte-Carlo error (200k reruns: se <= 0.0011) plus the quadrature's own (< 0.004)."""
    from scipy import stats as sps

    from mecefo.stats import rerun_probability, tolerance_bounds

    rng = np.random.default_rng(7)
    m, s = _simulated_reruns(mean, sd, pairs, df, 200_000, rng, own)
    h = sps.t.ppf(0.975, df) * s / np.sqrt(pairs)
    lo, hi = tolerance_bounds(1.0)
    cases = {(0.0, np.inf): m - h > 0, (-np.inf, 0.0): m + h < 0, (lo, hi): (m - h > lo) & (m + h < hi),
             (0.0, hi): (m - h > 0) & (m + h < hi)}
    for (a, b), hit in cases.items():
        assert rerun_probability(mean, sd, pairs, df, a, b) == pytest.approx(hit.mean(), abs=0.006), (a, b)


def test_a_printed_direction_is_repeated_by_a_reruns_interval_with_the_stated_probability_and_by_the_rule_about_half_the_time_at_its_threshold():
    """At the threshold (the smallest mean decide prints 'worse' for), simulated reruns' intervals exclude 0 in 95% of
    reruns, and reruns that decide by the same rule print 'worse' again in about half: what any threshold rule
    guarantees, and why each word carries its repeat probability."""
    from mecefo.stats import Noise, decide, direction_threshold, repeat_probability
    from scipy import stats as sps

    noise = Noise(0.83, 17, 1.16, 0.95, 47)
    thr = direction_threshold(noise.sd, 3, noise.df)
    assert decide(thr * 1.001, 3, noise).word == "worse" and decide(thr * 0.999, 3, noise).word.startswith("not decided")
    rng = np.random.default_rng(3)
    m, s = _simulated_reruns(thr, noise.sd, 3, noise.df, 200_000, rng)
    assert (m - sps.t.ppf(0.975, 17) * s / np.sqrt(3) > 0).mean() == pytest.approx(0.95, abs=0.005)
    reprinted = (m >= direction_threshold(s, 3, noise.df)).mean()
    assert reprinted == pytest.approx(0.5, abs=0.03)
    assert repeat_probability(thr, noise.sd, 3, noise.df) == pytest.approx(reprinted, abs=0.006)
    far = decide(2 * thr, 3, noise)
    assert far.repeat > 0.95 and far.margin == pytest.approx(thr) and far.probability > 0.999


def test_a_size_word_reports_the_nearer_of_its_two_thresholds_and_bad_noise_is_refused():
    from mecefo.stats import Noise, decide, rerun_probability

    tight = Noise(0.1, 50, 0.12, 0.95, 100)
    v = decide(0.5, 10, tight)
    assert v.claim == "both" and v.probability == v.claims["both"] <= min(v.claims["direction"], v.claims["within"])
    assert v.margin > 0 and v.repeat is not None
    undecided = decide(0.2, 3, Noise(0.83, 17, 1.16, 0.95, 47))
    assert undecided.claim == "within" and undecided.margin is None  # no mean decides a size at 3 seeds
    with pytest.raises(ValueError):
        decide(1.0, 3, Noise(float("nan"), 17, 1.0, 0.95, 10))
    with pytest.raises(ValueError):
        rerun_probability(float("nan"), 1.0, 3, 17)


def test_the_words_never_hide_a_significant_difference_and_say_the_strongest_claim_a_rerun_repeats():
    from mecefo.stats import Noise, decide

    tight = Noise(0.1, 50, 0.12, 0.95, 100)
    assert decide(0.5, 10, tight).word == "worse by less than 1%"  # not "equal"
    assert decide(-0.5, 10, tight).word == "better by less than 1%"
    assert decide(0.01, 10, tight).word == "equal within ±1%"
    assert decide(3.0, 10, tight).word == "worse"
    wide = Noise(1.0, 17, 1.3, 0.95, 40)
    assert decide(0.3, 3, wide).word == "not decided with 3 seeds"
    v = decide(0.3, 3, wide)
    assert v.margin is None or v.margin < 0
    assert decide(0.0, 4, wide).needed_for == "within ±1%"


@settings(max_examples=15, deadline=None)
@given(st.floats(-3.0, 3.0).filter(lambda m: abs(m) > 0.1 and abs(abs(m) - 1) > 0.1), st.floats(0.2, 2.0),
       st.integers(3, 60))
def test_the_seeds_a_verdict_needs_decide_it_at_the_upper_bound(mean, sd, df):
    """At the seeds it names, a mean that stays where it is decides the word it names even with the sd at its
    upper bound; one seed fewer does not."""
    from mecefo.stats import Noise, decide

    upper = Noise(sd * 1.3, df, sd * 1.3, 0.95, 0)
    v = decide(mean, 2, Noise(sd, df, sd * 1.3, 0.95, 0))
    if v.seeds_needed is None:
        return

    def decided(k: int) -> bool:  # the claim it names reaches 95% (a direction's word may take precedence over a size)
        w = decide(mean, k, upper)
        return w.claims["within" if v.needed_for.startswith("within") else "direction"] >= 0.95

    assert decided(v.seeds_needed)
    if v.seeds_needed > 1:
        assert not decided(v.seeds_needed - 1)


def test_the_reported_perplexity_is_the_mean_loss_of_the_last_evaluations():
    import math

    from experiments.sweep import last_evaluations_ppl

    rows = [{"step": s, "val_loss": 5.0 - s / 100} for s in range(0, 101, 25)] + [{"step": 101, "loss": 1.0}]
    rows.insert(3, {"step": 50, "val_loss": 0.0, "replay": True})  # replayed evaluations (checkpoint-restart) are not counted
    assert last_evaluations_ppl(rows, 2) == pytest.approx(math.exp((4.25 + 4.0) / 2))
    assert last_evaluations_ppl(rows, 99) == pytest.approx(math.exp(sum(5.0 - s / 100 for s in range(0, 101, 25)) / 5))
    with pytest.raises(ValueError, match="no validation"):
        last_evaluations_ppl([{"step": 1, "loss": 2.0}])


def test_a_rows_own_noise_is_its_sample_sd_with_a_chi_square_upper_bound():
    from scipy import stats as sps

    from mecefo.stats import sample_noise

    noise = sample_noise([1.0, 2.0, 4.0])
    sd = np.std([1.0, 2.0, 4.0], ddof=1)
    assert noise.df == 2 and np.isclose(noise.sd, sd)
    assert np.isclose(noise.upper, sd * np.sqrt(2 / sps.chi2.ppf(0.05, 2))) and noise.upper > sd
    with pytest.raises(ValueError):
        sample_noise([1.0])


@settings(max_examples=10, deadline=None)
@given(mean=st.floats(0.5, 20), sd=st.floats(0.3, 5))
def test_seeds_for_a_row_on_its_own_noise_count_the_df_that_each_seed_adds(mean, sd):
    from mecefo.stats import rerun_probability, seeds_to_decide

    k = seeds_to_decide(mean, sd, None, "direction")
    if k is None:
        return
    p = lambda j: rerun_probability(mean, sd, j, j - 1, lower=0.0)  # noqa: E731
    assert p(k) >= 0.95 and (k == 2 or p(k - 1) < 0.95)


def test_bartlett_from_variances_equals_scipys_from_the_samples():
    from scipy import stats as sps

    from mecefo.stats import bartlett

    rng = np.random.default_rng(5)
    samples = [rng.normal(0, sd, size=k) for sd, k in ((1.0, 4), (1.5, 7), (0.6, 3), (1.0, 12))]
    got = bartlett([x.var(ddof=1) for x in samples], [len(x) - 1 for x in samples])
    want = sps.bartlett(*samples)
    assert got["statistic"] == pytest.approx(want.statistic, rel=1e-10) and got["p"] == pytest.approx(want.pvalue, rel=1e-10)
    with pytest.raises(ValueError):
        bartlett([1.0], [3])


def test_the_two_slope_rate_fit_recovers_separate_exponents_and_matches_the_nt_fit_when_they_agree():
    from mecefo.stats import fit_rate, fit_rate_n_t

    rng = np.random.default_rng(2)
    n, t = np.meshgrid([1, 2, 4, 8, 16], [40, 126, 400])
    n, t = n.ravel().astype(float), t.ravel().astype(float)
    y = 3.0 * n ** -0.2 * t ** -0.6 * np.exp(rng.normal(0, 0.02, n.size))
    f = fit_rate_n_t(n, t, y)
    assert f.ci_n[0] < -0.2 < f.ci_n[1] and f.ci_t[0] < -0.6 < f.ci_t[1] and f.points == 15
    same = 2.0 * (n * t) ** -0.5 * np.exp(rng.normal(0, 0.02, n.size))
    g, h = fit_rate_n_t(n, t, same), fit_rate(n * t, same)
    assert abs(g.slope_n - h.slope) < 0.05 and abs(g.slope_t - h.slope) < 0.05
    with pytest.raises(ValueError):
        fit_rate_n_t([1, 1, 1, 1], [1, 2, 3, 4], [1, 2, 3, 4])
