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


def _moments(gram: np.ndarray, counts: np.ndarray, ref_norm: float) -> dict[str, float]:
    """The statistics of a (re)sample from the Gram matrix of the errors D_k = g~_k - g (K x K) and the
    multiplicity of each draw: bias^2 = ||mean D||^2, variance = (sum ||D_k||^2 - K ||mean D||^2) / (K - 1)."""
    k = counts.sum()
    bias_sq = max(float(counts @ gram @ counts) / k ** 2, 0.0)
    sq = float(counts @ np.diag(gram))
    variance = max((sq - k * bias_sq) / (k - 1), 0.0)
    bias = bias_sq ** 0.5
    return {"bias": bias, "bias_sq_debiased": bias_sq - variance / k, "variance": variance, "mse": sq / k,
            "relative_bias": bias / max(ref_norm, 1e-300)}


def estimator_stats(draws: np.ndarray, ref: np.ndarray, groups: dict[str, slice] | None = None,
                    n_boot: int = 500, level: float = 0.95, seed: int = 0) -> dict:
    """Bias, relative bias, variance and MSE of K draws (K x d) against ref (d), each with a percentile
    bootstrap interval (resampling the draws), overall and per group of coordinates. Works on the K x K
    Gram matrix of the errors, so the bootstrap costs O(K^2) per replicate whatever d is."""
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
        gram = err @ err.T
        ref_norm = float(np.linalg.norm(ref[sl].astype(np.float64)))
        point = _moments(gram, np.ones(k), ref_norm)
        boot = [_moments(gram, c, ref_norm) for c in resamples]
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


@dataclass(frozen=True)
class Verdict:
    """A paired comparison decided so that a rerun elsewhere (new rounding: in effect new draws of every seed)
    would say the same. ci: mean -+ t_{df} sd / sqrt(k). A rerun's mean m' is predicted as N(m, 2 sd^2 / k)
    (ours and the rerun's each carry sd^2 / k), so the word is read from the replication interval
        mean -+ (t_{df} sd / sqrt(k) + z_{agree} sd sqrt(2 / k)):
    a word it gives, a rerun's interval gives too with probability >= agree."""

    mean: float
    pairs: int
    ci: tuple[float, float]
    replication: tuple[float, float]
    word: str
    seeds_needed: int | None  # fewest seeds at which the current mean decides a word, at the sd's upper bound
    needed_for: str  # what those seeds would decide: a direction ('worse', 'better') or a size ('within ±1')


def interval_word(lo: float, hi: float, pairs: int, tolerance: float = 1.0) -> str:
    """The word of an interval of a change in ppl (lower is better): the direction when it excludes 0, and 'by less
    than' the tolerance when it also lies within it. 'worse by less than 1 point' is a significant
    degradation smaller than the tolerance, never hidden as 'equal'."""
    direction = "worse" if lo > 0 else "better" if hi < 0 else ""
    within = -tolerance <= lo and hi <= tolerance
    unit = f"{tolerance:g} point" + ("" if tolerance == 1 else "s")
    if direction:  # no "by more than" tier: a rerun flipped it at the tolerance's edge (experiments.float_check)
        return f"{direction} by less than {unit}" if within else direction
    return f"equal within ±{tolerance:g}" if within else f"not decided with {pairs} seed{'s' if pairs != 1 else ''}"


def replication_factor(df: int, level: float = 0.95, agree: float = 0.95) -> float:
    """t_{df, (1+level)/2} + z_{agree} sqrt 2: the replication half-width of k pairs is this times sd / sqrt(k)."""
    return float(sps.t.ppf(0.5 + level / 2, df) + sps.norm.ppf(agree) * np.sqrt(2))


def seeds_to_clear(distance: float, sd: float, df: int, level: float = 0.95, agree: float = 0.95) -> int | None:
    """The fewest seeds whose replication half-width is strictly below `distance` at this sd (None: distance <= 0)."""
    if distance <= 0:
        return None
    return int(np.floor((replication_factor(df, level, agree) * sd / distance) ** 2)) + 1


def seeds_to_clear_own(distance: float, sd: float, level: float = 0.95, agree: float = 0.95,
                       max_seeds: int = 10_000) -> int | None:
    """For a row decided on its own noise (sample_noise), whose degrees of freedom grow with its seeds: the
    fewest k whose replication half-width (t_{k-1} + z sqrt 2) sd / sqrt(k) is strictly below `distance`,
    at the row's sample sd (None: distance <= 0, or more than max_seeds)."""
    if distance <= 0:
        return None
    for k in range(2, max_seeds + 1):
        if replication_factor(k - 1, level, agree) * sd / np.sqrt(k) < distance:
            return k
    return None


def decide(mean: float, pairs: int, noise: Noise, tolerance: float = 1.0, level: float = 0.95,
           agree: float = 0.95, max_seeds: int = 10_000, own: bool = False) -> Verdict:
    """The verdict of a mean of `pairs` paired changes (points of %) under the pooled noise (see Verdict).
    Seeds needed: the word is decided once its distance d from the boundary it must clear satisfies
    d >= (t_{df} + z_{agree} sqrt 2) sd_upper / sqrt(k), i.e. k = floor(((t + z sqrt 2) sd_upper / d)^2) + 1 (seeds_to_clear),
    with d = |mean| for a direction and tolerance - |mean| for a size within the tolerance ('equal within ±1', or
    'worse/better by less than 1 point' if the direction is decided too); the smaller of the two. own=True: the
    noise is the row's own (sample_noise), and the seeds are counted with its df growing (seeds_to_clear_own)."""
    t, z = sps.t.ppf(0.5 + level / 2, noise.df), sps.norm.ppf(agree)
    half, margin = t * noise.sd / np.sqrt(pairs), z * noise.sd * np.sqrt(2 / pairs)
    ci = (mean - half, mean + half)
    rep = (mean - half - margin, mean + half + margin)
    options = [(abs(mean), "direction")] + ([(tolerance - abs(mean), f"within ±{tolerance:g}")]
                                            if abs(mean) < tolerance else [])
    best = None
    for d, what in options:
        k = (seeds_to_clear_own(d, noise.sd, level, agree, max_seeds) if own else
             seeds_to_clear(d, noise.upper, noise.df, level, agree))
        if k is not None and k <= max_seeds and (best is None or k < best[0]):
            best = (max(k, 1), ("worse" if mean > 0 else "better") if what == "direction" else what)
    return Verdict(float(mean), pairs, (float(ci[0]), float(ci[1])), (float(rep[0]), float(rep[1])),
                   interval_word(*rep, pairs, tolerance), *(best or (None, "")))


def bonferroni_level(level: float, family: int) -> float:
    """The per-comparison level that holds the family-wise level over `family` comparisons."""
    return 1 - (1 - level) / max(family, 1)
