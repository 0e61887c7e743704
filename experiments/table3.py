"""Table 3 decided: every paired comparison of the sweep, its verdict word under the pooled seed-to-seed noise,
the seeds that word needs, and where it lies against the paper's range (with the paper's rounding); written to
results/sweep/table3-<profile>.json, which paper_figures.sweep only renders.

    python -m experiments.table3 [--quick]

The default profile reads every sweep index that results/ holds beside it (index-default.json and, after
`--long`, index-long.json): a row uses every seed any of them ran, and says which profile those seeds come from.
Every change is decided on the log scale (100 ln(a / b), the scale the pooled noise is fitted on) and printed as
percent. A word is printed only where a rerun on another machine (new draws of every seed) would give it with
probability >= 95% from its own 95% interval (mecefo.stats.decide); each row states that probability, its margin
from the threshold, and the probability that a rerun deciding by this same rule prints the word again (about 50% at
the threshold: any threshold rule has that). Elsewhere the row says "not decided with k seeds" and how many would
decide it at the sd's upper bound. The pooled noise's homogeneity is tested (Bartlett over disjoint groups of
configurations) and the words under per-group pooling are written beside.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import numpy as np

from mecefo import failures
from mecefo.errors import UsageError
from mecefo.records import atomic_write_json, git_commit
from mecefo.results import RESULTS, load_config, paper_numbers, quick_flag
from mecefo.stats import (Noise, bartlett, bonferroni_level, block_noise, decide, direction_threshold, log_change, log_points,
                          interval_half_width, percent, rerun_probability, sample_noise, seeds_to_decide, word_of)

from .common import guarded

LEVELS = ("none", "low", "mid", "high")
TOLERANCE = 1.0  # percent: "equal within ±1%" (a ratio within [0.99, 1.01])
AGREE = 0.95  # the probability with which a rerun's interval must give the same word
PAPER_DIGITS = 2  # the paper prints perplexities to two decimals
NONE = ("main", "none", "none", "mecefo")  # failure-free runs: (tag, level, policy, techniques)
COLD = ("cold", "high", "mecefo", "mecefo")  # MeCeFO at high without the warm start: decided on its own noise
COMPARISONS = (("mecefo", "none"), ("drop", "none"), ("mecefo", "drop"), ("spread-mecefo", "none"))
PROFILES = {"quick": ("quick",), "default": ("default", "long")}  # the indices a profile's table reads


def name(policy: str) -> str:
    return "failure-free" if policy == "none" else policy


def load_cells(profile: str) -> tuple[list[dict], dict]:
    """The finished cells of every index the profile reads (deduplicated by config hash, each with the profiles
    that list it), and the indices' metadata."""
    cells, meta = {}, {}
    for p in PROFILES[profile]:
        path = RESULTS / "sweep" / f"index-{p}.json"
        if not path.exists():
            continue
        index = json.loads(path.read_text())
        meta[p] = {k: index.get(k) for k in ("base_config", "design", "last_evaluations", "git_commit", "wall_time_s")}
        meta[p]["runs"] = sum("val_ppl" in c for c in index["cells"])
        for c in index["cells"]:
            if "val_ppl" in c:
                c = {"failable": "", "tag": "main", "techniques": "mecefo", **c}
                cells.setdefault(c["config_hash"], {**c, "profiles": []})["profiles"].append(p)
    if not meta:
        raise UsageError(f"no {RESULTS / 'sweep' / f'index-{PROFILES[profile][0]}.json'}; run python -m experiments.sweep"
                         f"{' --quick' if profile == 'quick' else ''} first")
    if not cells:
        raise UsageError("the sweep indices hold no finished run with 'val_ppl'; rerun python -m experiments.sweep")
    return list(cells.values()), meta


def key(c: dict) -> tuple:
    return (c["tag"], c["level"], c["policy"], c["techniques"])


def rows(cells: list[dict], n: int) -> list[dict]:
    """Every paired row at the main n: id, group, comparison, the two selectors (tag, level, policy, techniques)."""
    at = [c for c in cells if c["n"] == n]
    levels = {c["level"] for c in at if c["tag"] == "main"}
    out = [{"group": lvl, "comparison": f"{name(a)} − {name(b)}", "a": ("main", lvl, a, "mecefo"),
            "b": NONE if b == "none" else ("main", lvl, b, "mecefo")} for lvl in LEVELS[1:] if lvl in levels
           for a, b in COMPARISONS]
    asym = [c for c in at if c["tag"] == "asymmetric"]
    if asym:
        ranks = asym[0]["failable"].split(",")
        group = f"high, asymmetric (only ranks {ranks[0]}-{ranks[-1]} fail)"
        out += [{"group": group, "comparison": f"{p} − failure-free", "a": ("asymmetric", "high", p, "mecefo"), "b": NONE}
                for p in ("mecefo", "drop")]
        out.append({"group": group, "comparison": "mecefo − drop", "a": ("asymmetric", "high", "mecefo", "mecefo"),
                    "b": ("asymmetric", "high", "drop", "mecefo")})
    high = failures.SCENARIOS["high"]
    for spec in sorted({c["level"] for c in at if c["tag"] == "frequency"}, key=lambda s: -failures.scenario(s).interval_h):
        sc = failures.scenario(spec)
        group = f"high x{high.interval_h / sc.interval_h:g} frequency (Table 1 interval {sc.interval_h:g} h, recovery {sc.recovery_h:g} h)"
        out += [{"group": group, "comparison": f"{p} − failure-free", "a": ("frequency", spec, p, "mecefo"), "b": NONE}
                for p in ("mecefo", "drop")]
        out.append({"group": group, "comparison": "mecefo − drop", "a": ("frequency", spec, "mecefo", "mecefo"),
                    "b": ("frequency", spec, "drop", "mecefo")})
    if any(c["tag"] == "cold" for c in at):
        out.append({"group": "high, no warm start (failures from step 0)", "comparison": "mecefo − failure-free",
                    "a": COLD, "b": NONE, "own_noise": True})
    att, ffn = ("fig3", "high", "mecefo", "skip_attention"), ("fig3", "high", "mecefo", "skip_ffn")
    out += [{"group": "high", "comparison": "skip attention − failure-free", "a": att, "b": NONE, "figure3": True},
            {"group": "high", "comparison": "skip FFN − failure-free", "a": ffn, "b": NONE, "figure3": True},
            {"group": "high", "comparison": "skip attention − skip FFN", "a": att, "b": ffn, "figure3": True}]
    for r in out:
        r["id"] = "/".join(":".join(s) for s in (r["a"], r["b"]))
    return out


def paper_range(level: str) -> dict:
    """The paper's MeCeFO change against failure-free at a level, over its models, as printed and with the
    rounding of its two-decimal perplexities (each value anywhere within ±0.005)."""
    t3 = paper_numbers()["table3_val_ppl"]
    i, eps = t3["levels"].index(level), 0.5 * 10 ** -PAPER_DIGITS
    vals = list(t3["rows"].values())
    printed = [100 * (v[i] / v[0] - 1) for v in vals]
    lo = [100 * ((v[i] - eps) / (v[0] + eps) - 1) for v in vals]
    hi = [100 * ((v[i] + eps) / (v[0] - eps) - 1) for v in vals]
    return {"printed": [min(printed), max(printed)], "with_rounding": [min(lo), max(hi)], "source": t3["source"]}


def where(mean: float, noise: Noise, pairs: int, rng: list[float], level: float = 0.95) -> dict:
    """Where a row lies against the paper's range (percent, with its rounding), decided like the words: 'above',
    'below' or 'within' the range only where a rerun's 95% interval says so with probability >= AGREE."""
    lo, hi = (float(log_points(v)) for v in rng)
    p = {"above": rerun_probability(mean, noise.sd, pairs, noise.df, lower=hi, level=level),
         "below": rerun_probability(mean, noise.sd, pairs, noise.df, upper=lo, level=level),
         "within": rerun_probability(mean, noise.sd, pairs, noise.df, lo, hi, level)}
    best = max(p, key=p.get)
    word = f"{best} the paper's range" if p[best] >= AGREE else "not distinguished from the paper's range"
    return {"where": word, "probability": p[best], "probabilities": p}


def warm_start_share(base: str) -> dict:
    """The share of the learning-rate-weighted updates (sum of lr over steps) made in the failure-free warm start."""
    from mecefo.train import lr_at

    cfg = load_config(base)
    k, steps = cfg.cluster.failure_free_steps, cfg.train.steps
    lrs = np.array([lr_at(s, cfg.optim, steps) for s in range(steps)])
    return {"steps": k, "of": steps, "lr_weighted_share": float(lrs[:k].sum() / lrs.sum())}


def n_sweep(cells: list[dict], level: float = 0.95) -> list[dict]:
    """Per n: mecefo's and drop's change at high failures against failure-free training at n = 1 (the same
    samples at every n), paired by seed over the seeds that ran both, on the log scale and printed as percent; with
    two or more seeds the mean's Student-t interval from those differences alone (the n-sweep's own noise)."""
    main = {(c["n"], c["level"], c["policy"], c["seed"]): c["val_ppl"] for c in cells if c["tag"] == "main"}
    refs = {s: v for (n, lvl, p, s), v in main.items() if (n, lvl, p) == (1, "none", "none")}
    out = []
    for n in sorted({n for (n, lvl, _, _) in main if n == 1 or lvl == "high"}):
        row = {"n": n, "failure_free_ppl": refs.get(0)}
        for p in ("mecefo", "drop"):
            pairs = [(main[(n, "high", p, s)], refs[s]) for s in sorted(refs) if (n, "high", p, s) in main]
            if not pairs:
                row[p] = row[f"{p}_ci"] = None
                continue
            d = log_change([a for a, _ in pairs], [b for _, b in pairs])
            row[p], row[f"{p}_seeds"] = float(percent(d.mean())), len(d)
            row[f"{p}_ci"] = None
            if len(d) > 1:
                half = interval_half_width(float(d.std(ddof=1)), len(d), level)
                row[f"{p}_ci"] = [float(percent(d.mean() - half)), float(percent(d.mean() + half))]
        out.append(row)
    return out


def n_alone(cells: list[dict], n: int) -> dict | None:
    """Failure-free at the main n against n = 1 (seed 0, the same samples): whether n by itself changes the
    result (only the order of floating-point sums can differ)."""
    ff = {c["n"]: c["val_ppl"] for c in cells if c["tag"] == "main" and c["level"] == "none" and c["seed"] == 0}
    if n == 1 or 1 not in ff or n not in ff:
        return None
    change = float(percent(log_change(ff[n], ff[1])))
    return {"n": n, "change_pct": change, "identical": ff[n] == ff[1]}


def resolution(paper: dict, noise: Noise, cells: list[dict], n: int, level: float = 0.95) -> dict:
    """What deciding the paper's low and mid effects would take if they held here: seeds per row for a size within
    the tolerance and for a direction (mecefo.stats.seeds_to_decide at the sd's upper bound), and the hours of runs
    (a failure-free and a MeCeFO run per seed, at the mean measured time of a run at n)."""
    times = [c["wall_time_s"] for c in cells if c.get("wall_time_s") and c["n"] == n]
    run_s = float(np.mean(times)) if times else None
    seeds = lambda pct, claim: seeds_to_decide(float(log_points(pct)), noise.upper, noise.df, claim, TOLERANCE,  # noqa: E731
                                               level, AGREE)
    hours = lambda k: None if k is None or run_s is None else 2 * k * run_s / 3600  # noqa: E731
    out = {"run_s": run_s}
    for lvl in ("low", "mid"):
        if lvl in paper:
            lo, hi = paper[lvl]["printed"]
            within, direction = seeds(hi, "within"), seeds(lo, "direction")
            out[lvl] = {"effect": [lo, hi], "within_seeds": within, "within_hours": hours(within),
                        "direction_seeds": direction, "direction_hours": hours(direction)}
    return out


def power(noise: Noise, level: float = 0.95, seeds: range = range(2, 65)) -> dict:
    """The |mean| (log points) a direction word needs against the number of seeds, at the pooled sd and at its upper
    bound (mecefo.stats.direction_threshold), for the power figure."""
    return {"seeds": list(seeds),
            "at_sd": [direction_threshold(noise.sd, k, noise.df, level, AGREE) for k in seeds],
            "at_upper": [direction_threshold(noise.upper, k, noise.df, level, AGREE) for k in seeds]}


def group_noise(at: list[dict], table_rows: list[dict], level: float = 0.95) -> dict:
    """The pooled noise's homogeneity: one block fit per group of rows (its configurations with the failure-free runs
    they are compared with; the cold row's own noise), the per-group sds, and Bartlett's test of equal variance
    across the groups that have residual df (approximate: the groups share the failure-free runs)."""
    by_key = {}
    for c in at:
        by_key.setdefault(key(c), []).append(c)
    groups = {}
    for r in table_rows:
        groups.setdefault(r["group"], set()).update({r["a"], r["b"]})
    out = {}
    for g, keys in groups.items():
        runs = [(k, c["seed"], c["val_ppl"]) for k in keys for c in by_key.get(k, [])]
        try:
            nz = block_noise(runs, level)
        except ValueError:
            continue
        out[g] = asdict(nz)
    tested = {g: v for g, v in out.items() if v["df"] >= 1}
    test = bartlett([v["sd"] ** 2 for v in tested.values()], [v["df"] for v in tested.values()]) if len(tested) > 1 else None
    return {"groups": out, "bartlett": test}


def decide_table(cells: list[dict], meta: dict, level: float = 0.95) -> dict:
    """The decided Table 3: pooled noise over every run at the main n, then each row's verdict."""
    first = next(iter(meta.values()))
    n = int(first["design"]["n"])
    at = [c for c in cells if c["n"] == n]
    # the cold runs' early, chaotic plateau escape is not the pooled rows' noise: they are left out of it
    noise = block_noise([(key(c) + (c["failable"],), c["seed"], c["val_ppl"]) for c in at if c["tag"] != "cold"], level)
    by = {}
    for c in at:
        twin = by.setdefault(key(c), {}).get(c["seed"])
        if twin is not None and twin["config_hash"] != c["config_hash"]:  # e.g. an index from an older sweep.toml
            raise UsageError(f"two runs for {'/'.join(key(c))} seed {c['seed']} with different configs "
                             f"({twin['config_hash']} in {twin['profiles']}, {c['config_hash']} in {c['profiles']}); "
                             "rerun python -m experiments.sweep for the stale profile or move its index away")
        by[key(c)][c["seed"]] = c
    table, layout = [], rows(cells, n)
    for r in layout:
        xa, xb = by.get(r["a"], {}), by.get(r["b"], {})
        seeds = sorted(set(xa) & set(xb))
        if not seeds:
            continue
        d = log_change([xa[s]["val_ppl"] for s in seeds], [xb[s]["val_ppl"] for s in seeds])
        if r.get("own_noise") and len(d) < 2:
            continue
        row_noise = sample_noise(d, level) if r.get("own_noise") else noise
        v = decide(float(d.mean()), len(seeds), row_noise, TOLERANCE, level, AGREE, own=bool(r.get("own_noise")))
        # a run listed by the default index is the default's; the long profile's own runs are its extra seeds
        profiles = {c["profiles"][0] for s in seeds for c in (xa[s], xb[s])}
        table.append({**{k: r[k] for k in ("id", "group", "comparison")}, "figure3": r.get("figure3", False),
                      "seeds": seeds, "differences": d.tolist(), "sample_sd": float(d.std(ddof=1)) if len(d) > 1 else None,
                      "profile": "long" if "long" in profiles else profiles.pop(), **asdict(v),
                      "change_pct": float(percent(v.mean)), "change_ci_pct": [float(percent(x)) for x in v.ci],
                      "noise": "pooled" if row_noise is noise else asdict(row_noise)})
    family = len(table)
    fam_level = bonferroni_level(level, family)
    homogeneity = group_noise([c for c in at if c["tag"] != "cold"], [r for r in layout if not r.get("own_noise")], level)
    for row in table:
        own = row["noise"] != "pooled"
        row_noise = Noise(**row["noise"]) if own else noise
        row["word_family"] = word_of(row["mean"], row_noise.sd, row["pairs"], row_noise.df, TOLERANCE, fam_level, AGREE)[0]
        grp = homogeneity["groups"].get(row["group"])
        row["word_group_noise"] = (row["word"] if own else None if grp is None or grp["df"] < 1 else
                                   word_of(row["mean"], grp["sd"], row["pairs"], grp["df"], TOLERANCE, level, AGREE)[0])
    paper = {}
    for lvl in LEVELS[1:]:
        main = next((row for row in table if row["id"] == f"main:{lvl}:mecefo:mecefo/{':'.join(NONE)}"), None)
        if main is not None:
            rng = paper_range(lvl)
            # decided like the words: where a rerun's interval would place it with probability >= AGREE
            paper[lvl] = {**rng, "ours_ci": main["change_ci_pct"], "ours_change": main["change_pct"],
                          **where(main["mean"], noise, main["pairs"], rng["with_rounding"], level)}
    base = first["base_config"]
    cfg = load_config(base)
    keep = ("tag", "n", "level", "policy", "techniques", "failable", "seed", "run", "val_ppl", "profiles", "wall_time_s")
    hours = (cfg.train.steps - cfg.cluster.failure_free_steps) * cfg.cluster.seconds_per_step / 3600
    cold_hours = cfg.train.steps * cfg.cluster.seconds_per_step / 3600
    return {"n": n, "noise": asdict(noise), "tolerance": TOLERANCE, "level": level, "agree": AGREE,
            "family": family, "family_level": fam_level, "rows": table, "paper": paper, "n_sweep": n_sweep(cells),
            "cells": [{k: c.get(k) for k in keep} for c in cells], "n_alone": n_alone(cells, n),
            # at one sequence per rank spread-mecefo cannot split a failed rank's rows over survivors
            "spread_splits_rows": cfg.data.micro_batch_size // n > 1,
            "homogeneity": homogeneity, "power": power(noise, level),
            "resolution": resolution(paper, noise, at, n, level), "warm_start": warm_start_share(base), "failure_hours": hours,
            "cold_failure_hours": cold_hours, "indices": meta, "base_config": base,
            "resolved_base_config": cfg.to_dict(), "git_commit": git_commit()}


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    profile = "quick" if quick else "default"
    cells, meta = load_cells(profile)
    result = decide_table(cells, meta)
    path = RESULTS / "sweep" / f"table3-{profile}.json"
    atomic_write_json(path, result)
    noise = result["noise"]
    print(f"pooled noise: sd {noise['sd']:.3f} points per paired difference ({noise['df']} df, 95% upper bound "
          f"{noise['upper']:.3f}) from {noise['runs']} runs at n = {result['n']}")
    for r in result["rows"]:
        print(f"  {r['group'][:40]:40s} {r['comparison']:32s} {r['change_pct']:+6.2f}% [{r['change_ci_pct'][0]:+.2f}, "
              f"{r['change_ci_pct'][1]:+.2f}] {r['pairs']} seeds: {r['word']} (P {r['probability']:.3f})")
    test = result["homogeneity"]["bartlett"]
    if test:
        print(f"homogeneity of the pooled noise: Bartlett chi2 {test['statistic']:.2f} on {test['df']} df, p = {test['p']:.3g}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
