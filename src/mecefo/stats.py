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


def interval_half_width(sd: float, k: int, level: float = 0.95) -> float:
    """Half-width of the t-interval of a mean of k pairs whose differences have standard deviation sd:
    t_{k-1, (1+level)/2} sd / sqrt(k) (the power curve: how many seeds a target width needs)."""
    return float(sps.t.ppf(0.5 + level / 2, k - 1) * sd / np.sqrt(k))


def seeds_needed(sd: float, target: float = 1.0, level: float = 0.95) -> int | None:
    """The fewest seeds (pairs) whose interval half-width at this sd is at most target (None: sd unknown or
    more than 10,000 seeds)."""
    if not np.isfinite(sd):
        return None
    return next((k for k in range(2, 10_001) if interval_half_width(sd, k, level) <= target), None)


def verdict_word(ci: tuple[float, float], tolerance: float = 1.0) -> str:
    """From an interval of a change in ppl (lower is better): 'equal' if it lies within +-tolerance,
    'better' / 'worse' if it excludes 0 on that side (and is not within the tolerance), else 'unresolved'."""
    lo, hi = ci
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "unresolved"
    if -tolerance <= lo and hi <= tolerance:
        return f"equal within ±{tolerance:g}"
    if hi < 0:
        return "better"
    if lo > 0:
        return "worse"
    return "unresolved"
