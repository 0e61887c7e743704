"""The goodput envelope: G = throughput kept x q for every policy under each reading of the throughput that the
repository holds, policies compared by paired differences with pooled noise, and the verdict an operator can act
on: a policy leads a job and level only if it leads under every reading; elsewhere the readings that decide it
are named.

Readings of the throughput kept (tokens/s under the failures against the failure-free job's):
    simulated    Table 2's simulation: a synchronous step waits for its slowest GPU; checkpoint-restart's
                 spare GPUs come free and without limit
    fitted       the same with the fitted baseline variants: Bamboo's reconfiguration fitted to the paper's 7B
                 Bamboo column, Oobleck's recovered GPUs rejoining at the next failure
    no-barrier   Table 2's reading A: a neighbour slows only itself, so a policy that covers a failed GPU with a
                 neighbour at step-time factor alpha keeps 1 - 2 f (1 - 1/alpha) of its failure-free throughput
                 at the failed fraction f; the others as simulated (a policy that spreads the work slows every
                 survivor alike, so a barrier costs it nothing more; one that pauses or drops has no slow GPU)
    spares       Table 2's reading B for every policy: each failed GPU replaced by a spare after the wait
                 checkpoint-restart gets (experiments.goodput_sim): the same spare pool for all
    provisioned  simulated, per provisioned GPU: checkpoint-restart holds f of the job's GPUs as spares on
                 average (Little's law), so its G is divided by 1 + f
    paper        the paper's Table 2 drops where it gives them (high: MeCeFO, Bamboo, Oobleck), each on that
                 policy's simulated failure-free throughput; the others as simulated

Paired difference of policies P and Q (in log points, the scale Table 3 decides on):
    d = 100 ln(G_P / G_Q) = 100 ln(kept_P / kept_Q) + mean over common seeds s of 100 ln(q_P,s / q_Q,s)
Var d = the pooled noise of q over the k seeds, sd^2 / k (sd: a paired difference's; 100 ln q is one, a run
against its seed's failure-free run, and two trained policies' failure-free runs cancel) + each simulated
throughput's squared standard error; a 95% t-interval with the pooled df. P leads when, against every other policy, the interval's lower bound is above 0 and the difference above
TOLERANCE (an interval wholly within +-TOLERANCE: equal for an operator's choice, no lead). A difference whose q
noise is unknown (no pooled df) is unbounded: it never gives a lead.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

from mecefo import policies
from mecefo.failures import SCENARIOS
from mecefo.simulator import CostModel
from mecefo.stats import log_points

from .throughput import FITTED, PAPER_JOBS, VARIANTS

LEVELS = ("low", "mid", "high")  # Table 1's failure levels that goodput compares at
READINGS = ("simulated", "fitted", "no-barrier", "spares", "provisioned", "paper")
REFERENCE = "mecefo"  # whose failure-free throughput is the job's (no failure: every policy trains alike)
PAPER_SYSTEMS = {"mecefo": "MeCeFO", "bamboo": "Bamboo", "oobleck": "Oobleck"}  # Table 2's columns
NEIGHBOUR = {"mecefo": False, "ndb-exact": True}  # policies whose neighbour covers a failed GPU: exact computation?
SPARES = ("checkpoint-restart",)  # policies that hold spare GPUs in the simulated reading
TOLERANCE = 1.0  # percent of G: policies whose paired difference lies within +-1% are equal for an operator's choice


def _se(v: dict, base: float) -> float:
    """A simulated throughput's standard error relative to its mean, in log points, from its 95% t-interval over
    v["seeds"] seeds (1.96 where the count is not given). A missing interval (one seed) is unbounded: inf."""
    lo, hi = v["ci95"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.inf
    if v["mean"] <= 0:
        return 0.0
    n = v.get("seeds")
    quantile = 1.96 if not n else float(sps.t.ppf(0.975, n - 1))
    return 100 * (hi - lo) / (2 * quantile * v["mean"])


def kept_readings(throughput: dict, sim: dict, model: str, level: str, paper_drops: dict) -> dict:
    """reading -> policy -> {"kept", "se"} for one job and level (the paper's reading only where it has numbers)."""
    row = throughput["table2"][model]
    ref = row["none"][REFERENCE]["mean"]
    names = [p for p in policies.simulator_policies() if p in row[level] and p in row["none"]]
    own = {p: row["none"][p]["mean"] / ref for p in names}  # each policy's failure-free overhead
    simulated = {p: {"kept": row[level][p]["mean"] / ref, "se": _se(row[level][p], ref)} for p in names}
    variants = {"bamboo": FITTED} | {policy: label for label, (policy, _) in VARIANTS.items()}
    fitted = simulated | {p: {"kept": row[level][v]["mean"] / ref, "se": _se(row[level][v], ref)}
                          for p, v in variants.items() if p in names and v in row[level]}
    f = SCENARIOS[level].expected_failed_fraction()
    cost = CostModel(PAPER_JOBS[model])
    barrier = simulated | {p: {"kept": own[p] * (1 - 2 * f * (1 - 1 / cost.alpha(1, exact=exact))), "se": 0.0}
                           for p, exact in NEIGHBOUR.items() if p in names}
    spare_row = sim["spares"][model][level]
    spares = {p: {"kept": spare_row[p]["mean"] / ref, "se": _se(spare_row[p], ref)} for p in names if p in spare_row}
    provisioned = simulated | {p: {"kept": simulated[p]["kept"] / (1 + f), "se": simulated[p]["se"]}
                               for p in SPARES if p in names}
    out = {"simulated": simulated, "fitted": fitted, "no-barrier": barrier, "spares": spares, "provisioned": provisioned}
    given = {p: d for p, d in paper_drops.get(model, {}).get(level, {}).items() if p in names}
    if given:
        out["paper"] = simulated | {p: {"kept": own[p] * (1 - d), "se": 0.0} for p, d in given.items()}
    return out


def paired(a: dict, b: dict, noise) -> dict:
    """The paired difference d = 100 ln(G_a / G_b) (module docstring) of two cells {"kept", "se", "log_q"}, where
    log_q is seed -> 100 ln q (None: exact, q = 1) and an optional "q_var" scales q's variance (1: measured; an
    interpolated q carries its weights' squares). Returns the difference, its 95% half-width and the seeds paired."""
    if b["kept"] <= 0:  # no progress at all (e.g. checkpoint-restart failing faster than it restarts)
        return {"d": math.inf if a["kept"] > 0 else math.nan, "half": 0.0 if a["kept"] > 0 else math.inf, "seeds": []}
    d = 100 * math.log(a["kept"] / b["kept"])
    var, trained = a["se"] ** 2 + b["se"] ** 2, [c for c in (a, b) if c["log_q"] is not None]
    if not trained:
        return {"d": d, "half": 1.96 * math.sqrt(var), "seeds": []}
    seeds = sorted(set.intersection(*(set(c["log_q"]) for c in trained)))
    if not seeds or noise is None:
        return {"d": math.nan, "half": math.inf, "seeds": seeds}
    d += float(np.mean([sum((1 if c is a else -1) * c["log_q"][s] for c in trained) for s in seeds]))
    # 100 ln q is itself a paired difference (a run against its seed's failure-free run): sd^2 per seed. Two trained
    # policies share that failure-free run, which cancels: their difference is again one pair's, sd^2 per seed.
    factor = (sum(c.get("q_var", 1.0) for c in trained) / 2) if len(trained) == 2 else trained[0].get("q_var", 1.0)
    var += factor * noise.sd ** 2 / len(seeds)
    return {"d": d, "half": float(sps.t.ppf(0.975, noise.df) * math.sqrt(var)), "seeds": seeds}


def goodput_of(cell: dict) -> float:
    """G = kept x q, q the geometric mean over seeds (1 for an exact policy)."""
    return cell["kept"] * (1.0 if cell["log_q"] is None else math.exp(np.mean(list(cell["log_q"].values())) / 100))


def compare(cells: dict, noise, tolerance: float = TOLERANCE) -> dict:
    """The policy of highest G and how it stands against each other policy Q, from the paired difference d and its
    95% interval [lo, hi] (log points): ahead when lo > 0 and d above the tolerance; `equal` (within the tolerance)
    when the whole interval lies within +-tolerance; else `tied` (not decided; a NaN or unbounded difference
    always is). It leads when it is ahead of every other policy (and there is another policy)."""
    tol = float(log_points(tolerance))
    ranked = sorted(cells, key=lambda p: -goodput_of(cells[p]))
    best = ranked[0]
    diffs = {p: paired(cells[best], cells[p], noise) for p in ranked[1:]}
    equal = [p for p, x in diffs.items() if -tol <= x["d"] - x["half"] and x["d"] + x["half"] <= tol]
    tied = [p for p, x in diffs.items() if p not in equal and not (x["d"] - x["half"] > 0 and x["d"] > tol)]
    return {"best": best, "goodput": {p: goodput_of(cells[p]) for p in ranked}, "leads": bool(diffs) and not tied and not equal,
            "tied": tied, "equal": equal, "tolerance_pct": tolerance, "second": ranked[1] if len(ranked) > 1 else None,
            "margin": {p: {"d": x["d"], "lo": x["d"] - x["half"], "hi": x["d"] + x["half"], "seeds": x["seeds"]}
                       for p, x in diffs.items()}}


def verdict(by_reading: dict) -> dict:
    """Over the readings' compare(): `leader` when one policy leads under every reading, else None; `outcomes`:
    each outcome (a policy that leads, or 'tied: a, b') with the readings that give it."""
    outcomes: dict[str, list[str]] = {}
    for reading, c in by_reading.items():
        key = c["best"] if c["leads"] else "tied: " + ", ".join([c["best"], *c["tied"], *c.get("equal", [])])
        outcomes.setdefault(key, []).append(reading)
    leader = next(iter(outcomes)) if len(outcomes) == 1 and not next(iter(outcomes)).startswith("tied") else None
    return {"leader": leader, "outcomes": outcomes}


def interp_log_q(points: list[tuple[float, dict]], x: float) -> tuple[dict, bool, float]:
    """seed -> 100 ln q at failed fraction x, linear between (0, q = 1) and the measured points (x_i, seed -> 100
    ln q_i) over the seeds both bracketing points have; beyond the last point it is held there (clamped: True).
    Also the factor on q's per-seed variance: w^2 from failure-free (exact); between two measured points
    (1 - w)^2 + w^2 + w (1 - w), their errors correlated 1/2 through the seed's shared failure-free run."""
    pts = [(0.0, None)] + sorted(points, key=lambda p: p[0])
    if x >= pts[-1][0]:
        return dict(pts[-1][1]), x > pts[-1][0], 1.0
    for (x0, v0), (x1, v1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            w = (x - x0) / (x1 - x0) if x1 > x0 else 1.0
            seeds = v1.keys() if v0 is None else v1.keys() & v0.keys()
            factor = w ** 2 if v0 is None else (1 - w) ** 2 + w ** 2 + w * (1 - w)
            return {s: (1 - w) * (0.0 if v0 is None else v0[s]) + w * v1[s] for s in seeds}, False, factor
    raise ValueError(f"failed fraction {x} below 0")
