"""Gradient-estimate statistics, reusable for any estimator that returns a flat gradient vector.

Notation: g = grad f(x) the true (reference) gradient at a fixed point x; g~ an estimate (a random vector:
the batch, and the failure draw, are random). From K draws g~_1..g~_K with mean m:
    bias      ||E g~ - g||          estimated by ||m - g||
    variance  tr Cov(g~)           estimated by (1 / (K - 1)) sum_k ||g~_k - m||^2
    MSE       E ||g~ - g||^2       estimated by (1 / K) sum_k ||g~_k - g||^2   (= bias^2 + variance)
The plug-in bias^2 overestimates ||E g~ - g||^2 by tr Cov / K (plus the reference's own error); we also
report that debiased value. Confidence intervals: percentile bootstrap over the K draws.
Assumption 3 (the paper's theory): the relative error ||g~ - g|| / ||g|| between the MeCeFO and the
failure-free aggregated gradient on the same batch stays below a constant delta < 1.
The rate check: least-squares slope of log y against log(nT) (y: mean squared gradient norm or
suboptimality), with a t-interval; Theorem 1's O(1/sqrt(nT)) is a slope of -1/2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps


@dataclass(frozen=True)
class Reference:
    mean: np.ndarray  # the reference gradient (average over K batches)
    se_norm: float  # sqrt(tr Cov / K): the expected size of the average's own error
    draws: int


def reference_gradient(samples: np.ndarray) -> Reference:
    """Average of K gradient draws (K x d), and the size of its standard error."""
    samples = np.asarray(samples, dtype=np.float64)
    k = len(samples)
    var = samples.var(axis=0, ddof=1).sum() if k > 1 else float("nan")
    return Reference(samples.mean(axis=0), float(np.sqrt(var / k)), k)


def _moments(counts: np.ndarray, weighted_sq: float, norms_sq: np.ndarray, ref_norm: float) -> dict[str, float]:
    """The statistics of a (re)sample of the errors D_k = g~_k - g from the multiplicity c_k of each draw,
    weighted_sq = ||sum_k c_k D_k||^2 and norms_sq = (||D_k||^2)_k: bias^2 = ||mean D||^2,
    variance = (sum ||D_k||^2 - K ||mean D||^2) / (K - 1)."""
    k = counts.sum()
    bias_sq = max(weighted_sq / k ** 2, 0.0)
    sq = float(counts @ norms_sq)
    variance = max((sq - k * bias_sq) / (k - 1), 0.0)
    bias = bias_sq ** 0.5
    return {"bias": bias, "bias_sq_debiased": bias_sq - variance / k, "variance": variance, "mse": sq / k,
            "relative_bias": bias / max(ref_norm, 1e-300)}


def estimator_stats(draws: np.ndarray, ref: np.ndarray, groups: dict[str, slice] | None = None,
                    n_boot: int = 500, level: float = 0.95, seed: int = 0) -> dict:
    """Bias, relative bias, variance and MSE of K draws (K x d) against ref (d), each with a percentile
    bootstrap interval (resampling the draws), overall and per group of coordinates. A replicate costs O(K min(K, d)):
    on the errors themselves where a group has fewer coordinates d than draws K, else on their K x K Gram matrix."""
    draws = np.asarray(draws)
    ref = np.asarray(ref, dtype=draws.dtype if draws.dtype.kind == "f" else np.float64)
    if draws.ndim != 2 or len(draws) < 2:
        raise ValueError("need at least two draws, as a K x d array")
    k = len(draws)
    rng = np.random.default_rng(seed)
    resamples = [np.bincount(rng.integers(0, k, size=k), minlength=k).astype(np.float64) for _ in range(n_boot)]
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    out = {}
    for name, sl in {"all": slice(None), **(groups or {})}.items():
        err = (draws[:, sl] - ref[sl]).astype(np.float64)
        norms_sq = np.einsum("ij,ij->i", err, err)
        if err.shape[1] < k:
            def weighted_sq(c, err=err):
                return float(np.square(c @ err).sum())
        else:
            gram = err @ err.T

            def weighted_sq(c, gram=gram):
                return float(c @ gram @ c)
        ref_norm = float(np.linalg.norm(ref[sl].astype(np.float64)))
        point = _moments(np.ones(k), weighted_sq(np.ones(k)), norms_sq, ref_norm)
        boot = [_moments(c, weighted_sq(c), norms_sq, ref_norm) for c in resamples]
        out[name] = {key: {"value": v, "ci": [float(np.quantile([b[key] for b in boot], lo)),
                                              float(np.quantile([b[key] for b in boot], hi))]} for key, v in point.items()}
    return out


def relative_error(approx, exact) -> float:
    """Assumption 3's ||g~ - g|| / ||g||, for two arrays, or two sequences of arrays or torch tensors taken
    together as one vector each (FSDP2 shards are summed over the ranks: every rank must call)."""
    if isinstance(approx, np.ndarray) or np.isscalar(approx):
        approx, exact = [np.asarray(approx)], [np.asarray(exact)]
    num = sum(_squares(a - e) for a, e in zip(approx, exact))
    return float(np.sqrt(num / max(sum(_squares(e) for e in exact), 1e-300)))


def _squares(t) -> float:
    """The sum of squares of an array or tensor, in double precision."""
    if isinstance(t, np.ndarray):
        return float(np.square(t, dtype=np.float64).sum())
    s = (t.double() ** 2).sum()
    return (s.full_tensor() if hasattr(s, "full_tensor") else s).item()


@dataclass(frozen=True)
class RateFit:
    slope: float
    intercept: float
    ci: tuple[float, float]  # of the slope
    level: float
    points: int

    def contains(self, slope: float) -> bool:
        return self.ci[0] <= slope <= self.ci[1]


def fit_rate(nt: np.ndarray, y: np.ndarray, level: float = 0.95) -> RateFit:
    """OLS of log y = a + b log(nT) with a Student-t interval for b."""
    x, z = np.log(np.asarray(nt, dtype=np.float64)), np.log(np.asarray(y, dtype=np.float64))
    if len(x) < 3:
        raise ValueError("need at least three points to fit a slope with an interval")
    res = sps.linregress(x, z)
    half = sps.t.ppf(0.5 + level / 2, len(x) - 2) * res.stderr
    return RateFit(float(res.slope), float(res.intercept), (float(res.slope - half), float(res.slope + half)), level, len(x))


@dataclass(frozen=True)
class RateFitNT:
    slope_n: float
    ci_n: tuple[float, float]
    slope_t: float
    ci_t: tuple[float, float]
    level: float
    points: int


def fit_rate_n_t(n: np.ndarray, t: np.ndarray, y: np.ndarray, level: float = 0.95) -> RateFitNT:
    """OLS of log y = a + b_n log n + b_T log T with Student-t intervals (N - 3 df): the bound's 1/sqrt(nT) is
    b_n = b_T = -1/2, and the fit against nT alone assumes b_n = b_T (the step, C sqrt(n / T), does not treat them
    alike)."""
    x = np.column_stack([np.ones(len(y)), np.log(np.asarray(n, dtype=np.float64)), np.log(np.asarray(t, dtype=np.float64))])
    z = np.log(np.asarray(y, dtype=np.float64))
    if len(z) < 4 or np.linalg.matrix_rank(x) < 3:
        raise ValueError("need at least four points spanning two values of n and of T")
    coef, *_ = np.linalg.lstsq(x, z, rcond=None)
    df = len(z) - 3
    s2 = float(np.sum((z - x @ coef) ** 2) / df)
    se = np.sqrt(np.diag(s2 * np.linalg.inv(x.T @ x)))
    q = sps.t.ppf(0.5 + level / 2, df)
    return RateFitNT(float(coef[1]), (float(coef[1] - q * se[1]), float(coef[1] + q * se[1])),
                     float(coef[2]), (float(coef[2] - q * se[2]), float(coef[2] + q * se[2])), level, len(z))


@dataclass(frozen=True)
class Paired:
    mean: float
    ci: tuple[float, float]  # (nan, nan) with fewer than two pairs
    sd: float
    pairs: int


def paired_relative_change(a, b, level: float = 0.95) -> Paired:
    """The relative change of a against b in percent, paired by seed: d_i = 100 (a_i / b_i - 1), its mean
    and the Student-t interval mean -+ t_{k-1} sd / sqrt(k) over the k pairs."""
    d = 100 * (np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64) - 1)
    k = len(d)
    if k < 2:
        return Paired(float(d.mean()) if k else float("nan"), (float("nan"), float("nan")), float("nan"), k)
    sd = float(d.std(ddof=1))
    half = interval_half_width(sd, k, level)
    return Paired(float(d.mean()), (float(d.mean() - half), float(d.mean() + half)), sd, k)


def interval_half_width(sd: float, k: int, level: float = 0.95, df: int | None = None) -> float:
    """Half-width of the t-interval of a mean of k pairs whose differences have standard deviation sd:
    t_{df, (1+level)/2} sd / sqrt(k), with df = k - 1 unless the sd was pooled with another df."""
    return float(sps.t.ppf(0.5 + level / 2, k - 1 if df is None else df) * sd / np.sqrt(k))


def seeds_needed(sd: float, target: float = 1.0, level: float = 0.95) -> int | None:
    """The fewest seeds (pairs) whose interval half-width at this sd is at most target (a precision target, used
    by the variance decomposition; verdicts use decide). None: sd unknown or more than 10,000 seeds."""
    if not np.isfinite(sd):
        return None
    return next((k for k in range(2, 10_001) if interval_half_width(sd, k, level) <= target), None)


@dataclass(frozen=True)
class Noise:
    """The seed-to-seed noise of one paired difference (points of %), pooled over a randomised block design."""

    sd: float  # sqrt(2) s_e: the sd of a difference of two configurations on one seed
    df: int  # residual degrees of freedom of the pooled estimate
    upper: float  # one-sided upper confidence bound of sd at `level`
    level: float
    runs: int


def block_noise(runs: list[tuple[object, int, float]], level: float = 0.95) -> Noise:
    """Pooled noise from (configuration, seed, ppl) triples. A seed is a block: its runs share the
    initialisation, the data order and (across policies) the failure schedule. Model, y = 100 ln ppl:
        y_{c,s} = mu_c + b_s + e_{c,s},   e iid N(0, s_e^2),
    fitted by least squares; s_e^2 = RSS / df with df = N - rank(X) (configurations run with one seed add
    nothing). A paired difference of two configurations on one seed then has sd sqrt(2) s_e, in points of %
    to first order (100 (a/b - 1) = 100 ln(a/b) + O(change^2)). Upper bound: sd sqrt(df / chi2_{1-level, df})."""
    configs = sorted({c for c, _, _ in runs}, key=str)
    seeds = sorted({s for _, s, _ in runs})
    x = np.zeros((len(runs), len(configs) + len(seeds)))
    for i, (c, s, _) in enumerate(runs):
        x[i, configs.index(c)] = x[i, len(configs) + seeds.index(s)] = 1.0
    y = 100 * np.log(np.array([v for _, _, v in runs], dtype=np.float64))
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    df = len(runs) - int(np.linalg.matrix_rank(x))
    if df < 1:
        raise ValueError("no residual degrees of freedom: every configuration needs a second seed somewhere")
    sd = float(np.sqrt(2 * np.sum((y - x @ coef) ** 2) / df))
    return Noise(sd, df, float(sd * np.sqrt(df / sps.chi2.ppf(1 - level, df))), level, len(runs))


def sample_noise(differences, level: float = 0.95) -> Noise:
    """The noise of a row decided on its own: the sample sd of its k paired differences (k - 1 df), with the
    same chi-square upper bound as block_noise. For a row whose runs do not share the pooled rows' variance."""
    d = np.asarray(differences, dtype=np.float64)
    if len(d) < 2:
        raise ValueError("a row's own noise needs at least two paired differences")
    sd, df = float(d.std(ddof=1)), len(d) - 1
    return Noise(sd, df, float(sd * np.sqrt(df / sps.chi2.ppf(1 - level, df))), level, len(d))


def log_change(a, b) -> np.ndarray:
    """The paired change on the log scale, in points: 100 ln(a / b). Decisions, intervals and noise all live on this
    scale (block_noise fits it); printed changes are read back as percent with percent()."""
    return 100 * np.log(np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64))


def percent(d):
    """A change on the log scale (points) as a relative change in percent: 100 (exp(d / 100) - 1)."""
    return 100 * np.expm1(np.asarray(d, dtype=np.float64) / 100)


def log_points(pct):
    """A relative change in percent as a change on the log scale (points): 100 ln(1 + pct / 100)."""
    return 100 * np.log1p(np.asarray(pct, dtype=np.float64) / 100)


def _chi_quantiles(df: int, points: int) -> np.ndarray:
    """chi2_df / df at the midpoints of `points` equal-probability cells: a quadrature for E f(chi2_df / df)."""
    return sps.chi2.ppf((np.arange(points) + 0.5) / points, df) / df


def rerun_probability(mean: float, sd: float, pairs: int, df: int, lower: float = -np.inf, upper: float = np.inf,
                      level: float = 0.95, factor: float | None = None, points: int = 256) -> float:
    """The probability that a rerun elsewhere (new rounding: in effect new draws of every seed) gives an interval
    m' -+ c s' / sqrt(k) that lies wholly above `lower` and below `upper`, given our mean m and sd s of k pairs:
        P = E[ Phi((upper - h - m) / se) - Phi((lower + h - m) / se) ],   h = c s' / sqrt(k),  se = sigma sqrt(2 / k),
    the predictive law of the rerun's mean (m' - m ~ N(0, 2 sigma^2 / k): our mean and the rerun's each carry
    sigma^2 / k), averaged over the true sd sigma (posterior df s^2 / sigma^2 ~ chi2_df) and over the rerun's own
    estimate s' (df s'^2 / sigma^2 ~ chi2_df, independent). c = t_{df, (1+level)/2}: the rerun's `level` interval, unless
    `factor` gives another c. Both averages by quadrature over chi2's quantiles (points x points cells)."""
    if not (np.isfinite(sd) and np.isfinite(mean) and sd >= 0 and df >= 1 and pairs >= 1):
        raise ValueError(f"rerun_probability needs a finite mean and sd >= 0, df >= 1 and pairs >= 1 "
                         f"(got mean {mean}, sd {sd}, df {df}, pairs {pairs})")
    if sd == 0:
        return float(lower < mean < upper)
    c = sps.t.ppf(0.5 + level / 2, df) if factor is None else factor
    q = _chi_quantiles(df, points)
    sigma = sd / np.sqrt(q)[:, None]  # rows: the true sd
    half = c * sigma * np.sqrt(q)[None, :] / np.sqrt(pairs)  # columns: the rerun's estimate of it
    se = sigma * np.sqrt(2 / pairs)
    with np.errstate(invalid="ignore"):
        p = sps.norm.cdf((upper - half - mean) / se) - sps.norm.cdf((lower + half - mean) / se)
    return float(np.clip(np.nan_to_num(p), 0, 1).mean())


def _bisect(f, lo: float, hi: float, iters: int = 40) -> float:
    """The root of a function that changes sign once on [lo, hi], f(lo) < 0 <= f(hi) or the reverse."""
    flo = f(lo) < 0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) < 0) == flo:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def direction_threshold(sd: float, pairs: int, df: int, level: float = 0.95, agree: float = 0.95) -> float:
    """The smallest |mean| (points, log scale) whose direction a rerun's `level` interval repeats with probability
    >= agree. rerun_probability depends on m sqrt(k) / s alone, so this is r*(df) s / sqrt(k)."""
    return sd / np.sqrt(pairs) * _direction_r(df, level, agree)


@functools.lru_cache(maxsize=None)
def _direction_r(df: int, level: float, agree: float) -> float:
    f = lambda r: rerun_probability(r, 1.0, 1, df, lower=0.0, level=level) - agree  # noqa: E731
    hi = 1.0
    while f(hi) < 0:
        hi *= 2
    return _bisect(f, 0.0, hi)


def within_threshold(sd: float, pairs: int, df: int, bounds: tuple[float, float], level: float = 0.95,
                     agree: float = 0.95) -> float | None:
    """The largest |mean| (points, log scale, measured from the bounds' centre) at which a rerun's `level` interval
    lies within `bounds` with probability >= agree; None if no mean does (the interval is too wide)."""
    centre = (bounds[0] + bounds[1]) / 2
    f = lambda x: agree - rerun_probability(centre + x, sd, pairs, df, *bounds, level=level)  # noqa: E731
    if f(0.0) > 0:
        return None
    return _bisect(f, 0.0, (bounds[1] - bounds[0]) / 2)


def repeat_probability(mean: float, sd: float, pairs: int, df: int, level: float = 0.95, agree: float = 0.95) -> float:
    """The probability that a rerun which decides by this same rule (decide) prints this mean's direction again:
    it does so when its own mean clears its own threshold, m' >= r*(df) s' / sqrt(k); rerun_probability with c = r*.
    About 0.5 for a mean at the threshold, as for any rule that prints above a threshold."""
    r = _direction_r(df, level, agree)
    m = abs(mean)
    return rerun_probability(m, sd, pairs, df, lower=0.0, factor=r)


@dataclass(frozen=True)
class Verdict:
    """A paired comparison on the log scale (points: 100 ln(a / b)), decided so that a rerun elsewhere would say
    the same: a word is printed only where a rerun's 95% interval gives it with probability >= agree
    (rerun_probability). ci: mean -+ t_{df} sd / sqrt(k)."""

    mean: float  # points, log scale
    pairs: int
    ci: tuple[float, float]  # points, log scale
    word: str
    claim: str  # what the word (or, undecided, the cheapest word to decide) claims: direction, within or both
    probability: float  # that a rerun's interval gives that claim
    claims: dict  # the probability of each claim: direction, within, both
    threshold: float | None  # |mean| at which the direction's probability is `agree`; for 'within', the largest |mean|
    #                          (from the bounds' centre) at which it is; for 'both', the nearer of the two
    margin: float | None  # how far the mean lies inside (+) or outside (-) that threshold, points; None: at these
    #                       seeds no mean decides a size within the tolerance (the interval is too wide for it)
    repeat: float | None  # that a rerun deciding by this rule prints the direction again (direction claims only)
    seeds_needed: int | None  # fewest seeds at which the current mean decides a word, at the sd's upper bound
    needed_for: str  # what those seeds would decide: a direction ('worse', 'better') or a size ('within ±1')


def tolerance_bounds(tolerance: float) -> tuple[float, float]:
    """'Equal within ±T percent' on the log scale: [100 ln(1 - T/100), 100 ln(1 + T/100)]."""
    return float(log_points(-tolerance)), float(log_points(tolerance))


def _claims(mean: float, sd: float, pairs: int, df: int, tolerance: float, level: float) -> dict[str, float]:
    """The probabilities that a rerun's interval gives the mean's direction, a size within the tolerance, and both."""
    lo, hi = tolerance_bounds(tolerance)
    side = {"lower": 0.0} if mean > 0 else {"upper": 0.0}
    both = {"lower": max(lo, side.get("lower", lo)), "upper": min(hi, side.get("upper", hi))}
    return {"direction": rerun_probability(mean, sd, pairs, df, level=level, **side),
            "within": rerun_probability(mean, sd, pairs, df, lo, hi, level),
            "both": rerun_probability(mean, sd, pairs, df, level=level, **both)}


def word_of(mean: float, sd: float, pairs: int, df: int, tolerance: float = 1.0, level: float = 0.95,
            agree: float = 0.95) -> tuple[str, dict[str, float]]:
    """The strongest word whose claim a rerun's interval repeats with probability >= agree, in this order: 'worse/better
    by less than T%' (direction and size together), 'worse/better', 'equal within ±T%', else 'not decided with k
    seeds'. A direction and a size can each reach agree while both together do not: the direction is then printed."""
    p = _claims(mean, sd, pairs, df, tolerance, level)
    direction = "worse" if mean > 0 else "better"
    if p["both"] >= agree:  # precedence: both, then the direction, then the size alone
        return f"{direction} by less than {tolerance:g}%", p
    if p["direction"] >= agree:
        return direction, p
    if p["within"] >= agree:
        return f"equal within ±{tolerance:g}%", p
    return f"not decided with {pairs} seed{'s' if pairs != 1 else ''}", p


def seeds_to_decide(mean: float, sd: float, df: int | None, claim: str, tolerance: float = 1.0, level: float = 0.95,
                    agree: float = 0.95, max_seeds: int = 10_000) -> int | None:
    """The fewest seeds k at which a mean that stays where it is decides `claim` ('direction' or 'within') at this sd;
    df None: the row's own noise, whose df k - 1 grows with its seeds. None: more than max_seeds."""
    bounds = tolerance_bounds(tolerance)
    if claim == "within" and not bounds[0] < mean < bounds[1]:
        return None

    def ok(k: int) -> bool:
        d = k - 1 if df is None else df
        if claim == "direction":
            return mean != 0 and rerun_probability(mean, sd, k, d, **({"lower": 0.0} if mean > 0 else {"upper": 0.0}),
                                                   level=level) >= agree
        return rerun_probability(mean, sd, k, d, *bounds, level=level) >= agree

    if not ok(max_seeds):
        return None
    lo, hi = (1 if df is None else 0), max_seeds  # not ok(lo) (own noise needs 2 seeds), ok(hi); P grows with k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def decide(mean: float, pairs: int, noise: Noise, tolerance: float = 1.0, level: float = 0.95,
           agree: float = 0.95, max_seeds: int = 10_000, own: bool = False) -> Verdict:
    """The verdict of a mean of `pairs` paired changes (points, log scale) under the pooled noise (see Verdict and
    word_of), with its margin from the threshold of the claim it makes (or needs) and, for a direction, the
    probability that a rerun deciding by this rule prints it again. Seeds needed: for each claim not yet decided,
    the fewest seeds that decide it at the sd's upper bound (seeds_to_decide); the smaller of the two. own=True: the
    noise is the row's own (sample_noise), whose df grows with its seeds."""
    half = sps.t.ppf(0.5 + level / 2, noise.df) * noise.sd / np.sqrt(pairs)
    word, p = word_of(mean, noise.sd, pairs, noise.df, tolerance, level, agree)
    best = None
    if word.startswith("not decided"):
        for claim, what in (("direction", "worse" if mean > 0 else "better"), ("within", f"within ±{tolerance:g}%")):
            k = seeds_to_decide(mean, noise.upper, None if own else noise.df, claim, tolerance, level, agree, max_seeds)
            if k is not None and (best is None or k < best[0]):
                best = (k, what)
    if "by less than" in word:
        claim = "both"
    elif word.startswith("equal") or (best and best[1].startswith("within")):
        claim = "within"
    else:
        claim = "direction"
    bounds = tolerance_bounds(tolerance)
    margins, thresholds = {}, {}
    if claim in ("direction", "both"):
        thresholds["direction"] = direction_threshold(noise.sd, pairs, noise.df, level, agree)
        margins["direction"] = abs(mean) - thresholds["direction"]
    if claim in ("within", "both"):
        thresholds["within"] = within_threshold(noise.sd, pairs, noise.df, bounds, level, agree)
        if thresholds["within"] is not None:
            margins["within"] = thresholds["within"] - abs(mean - (bounds[0] + bounds[1]) / 2)
    nearer = min(margins, key=margins.get) if margins and len(margins) == len(thresholds) else None
    threshold = thresholds[nearer] if nearer else None
    margin = margins[nearer] if nearer else None
    repeat = repeat_probability(mean, noise.sd, pairs, noise.df, level, agree) if claim != "within" else None
    return Verdict(float(mean), pairs, (float(mean - half), float(mean + half)), word, claim, float(p[claim]),
                   {k: float(v) for k, v in p.items()}, None if threshold is None else float(threshold),
                   None if margin is None else float(margin), None if repeat is None else float(repeat),
                   *(best or (None, "")))


def bonferroni_level(level: float, family: int) -> float:
    """The per-comparison level that holds the family-wise level over `family` comparisons."""
    return 1 - (1 - level) / max(family, 1)


def bartlett(variances, dfs) -> dict:
    """Bartlett's test that g variance estimates s_i^2 (with nu_i df each) share one variance:
        T = (N ln s_p^2 - sum nu_i ln s_i^2) / C,   N = sum nu_i,  s_p^2 = sum nu_i s_i^2 / N,
        C = 1 + (sum 1/nu_i - 1/N) / (3 (g - 1)),   T ~ chi2_{g-1} under equal variances."""
    v, nu = np.asarray(variances, dtype=np.float64), np.asarray(dfs, dtype=np.float64)
    if len(v) < 2 or np.any(nu < 1) or np.any(v <= 0):
        raise ValueError("Bartlett's test needs two or more positive variances with at least one df each")
    big, g = nu.sum(), len(v)
    pooled = float((nu * v).sum() / big)
    c = 1 + ((1 / nu).sum() - 1 / big) / (3 * (g - 1))
    stat = float((big * np.log(pooled) - (nu * np.log(v)).sum()) / c)
    return {"statistic": stat, "df": g - 1, "p": float(sps.chi2.sf(stat, g - 1)), "pooled_sd": pooled ** 0.5}
