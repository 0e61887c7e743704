"""The README's first screen: a table of the paper's claims against ours (`claims`: the claim, the paper's number
with its source, ours with its 95% interval, the verdict, the page that explains it), and the longer readings behind
it (`answers`, in docs/results.md), what has run on a GPU (`gpu`, docs/status.md) and the float checks
(docs/reproducibility.md); every number read from the results files that decide it, none decided here.

    python -m paper_figures.headline [--quick]
"""

from __future__ import annotations

import json
import sys

from mecefo.errors import UsageError, guarded
from mecefo.results import RESULTS, in_paper_order as in_order, measurement, neighbour_bench, paper_numbers, quick_flag

from .common import ROOT, write_block, write_table
from .sweep import COLD_ID, main_id


def _read(path, *keys: str):
    """The result at path (None: not there yet); a UsageError where it lacks one of `keys` (an older version wrote it)."""
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if missing := [k for k in keys if k not in result]:
        raise UsageError(f"{path} lacks {', '.join(missing)} (an older version wrote it); rerun its experiment")
    return result


def pct(r: dict) -> str:
    """A row's change and 95% interval, read back from the log scale as percent."""
    return f"{r['change_pct']:+.2f}% [{r['change_ci_pct'][0]:+.2f}, {r['change_ci_pct'][1]:+.2f}]"


def word(r: dict) -> str:
    """A row's word with the qualifiers it needs: the family-wise word where it differs, and for a direction the
    probability that a rerun deciding by the same rule prints it again."""
    out = r["word"]
    if r["repeat"] is not None and not out.startswith("not decided"):
        out += f", its direction printed again by a rerun deciding by this rule with P {r['repeat']:.2f}"
    if r["word_family"] != r["word"]:
        out += f"; family-wise: {r['word_family']}"
    return out


def quality(t3: dict | None) -> str:
    if t3 is None:
        return "- **Quality (Table 3):** no results/sweep/table3-*.json yet (`python -m experiments.table3`)."
    by = {r["id"]: r for r in t3["rows"]}
    parts = []
    for lvl in ("low", "mid", "high"):
        r = by.get(main_id(lvl, "mecefo", "none"))
        if r:
            parts.append(f"{lvl} {pct(r)} *{word(r)}* ({r['pairs']} seeds)")
    vs = by.get(main_id("high", "mecefo", "drop"))
    paper = t3["paper"].get("high")
    line = (f"- **Quality (Table 3 analog, {t3['n']} ranks, validation perplexity, MeCeFO − failure-free, paired "
            "95% intervals):** " + "; ".join(parts) + ".")
    if paper:
        line += (f" The paper's high change is +{paper['printed'][0]:.2f} .. +{paper['printed'][1]:.2f}% over 350M-7B: "
                 f"ours is {paper['where']}.")
    cold = by.get(COLD_ID)
    if cold:
        line += f" Without the failure-free warm start, high: {pct(cold)} *{word(cold)}* ({cold['pairs']} seeds, its own noise)."
    if vs:
        line += f" MeCeFO − drop (torchft's policy) at high: {pct(vs)} *{word(vs)}*."
    return line


def throughput(t2: dict | None, hyp: dict | None) -> list[str]:
    if t2 is None:
        return ["- **Throughput (Table 2):** no results/throughput/table2-*.json yet (`python -m experiments.table2`)."]
    cells = [f"{name} {w['drop'][0]:.1f}% [{w['drop'][1]:.1f}, {w['drop'][2]:.1f}] against the paper's {w['paper']:.2f}%, "
             f"{w['word']}" for name, w in in_order(t2["mecefo"]).items()]
    lines = ["- **Throughput (Table 2, simulated 32 A100s, high failures), MeCeFO's drop:** " + "; ".join(cells)
             + " (Results: throughput gives the readings that would reconcile them)."]
    if hyp is not None:
        b = hyp["bound"]
        c = {m: v["technique_sets"]["+ low_rank_wgrad (MeCeFO)"] for m, v in b["models"].items()}
        lines.append(f"- **The bound:** any policy that trains every sample while {100 * b['f']:.1f}% of the GPUs are down, "
                     "covering their work at MeCeFO's relative cost c and spreading it perfectly, loses at least "
                     + ", ".join(f"{100 * v['bound']:.1f}% ({m}, c = {v['c']:.2f})" for m, v in in_order(c).items())
                     + "; the paper's drops would need c = "
                     + " / ".join(f"{v['c_needed']:.2f}" for v in in_order(b["models"]).values()) + ".")
    return lines


def goodput(result: dict | None) -> str:
    """Which policy a cluster should run: one sentence per job (paper_figures.goodput.job_sentence)."""
    if result is None:
        return "- **Which policy a cluster should run (goodput):** no results/goodput/goodput-*.json yet (`python -m experiments.goodput_runs`, then `python -m experiments.goodput`)."
    from .goodput import job_sentence  # matplotlib only when there is a result to render

    return ("- **Which policy reaches failure-free quality first (goodput = throughput kept x quality per token, not in the "
            "paper; a policy \"leads\" only if it is ahead at 95%, and not only by less than 1%, under every reading of the "
            "throughput: simulated, fitted baselines, no barrier, spares for every policy, per provisioned GPU, the paper's "
            "drops; else what each reading gives; Results: goodput):** "
            + " ".join(job_sentence(m, levels, result["levels"]) for m, levels in in_order(result["envelope"]).items()))


def theory(grad: dict | None, rate: dict | None) -> list[str]:
    lines = []
    if grad is not None and grad.get("max_relative_error") is not None:
        lines.append(f"- **Assumption 3 (relative gradient error of MeCeFO against failure-free on the same batch):** "
                     f"at most {grad['max_relative_error']:.2f} over {len(grad['points'])} steps with an active failure "
                     f"(the paper: below {grad['paper_bound']}; the theory needs < 1).")
    if rate is not None:
        fits = rate["synthetic"]["fits"]
        lines.append("- **The O(1/sqrt(nT)) rate on a synthetic non-convex problem** (fitted slope against nT, "
                     "theory −1/2): " + "; ".join(f"{p} {f['slope']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}]"
                                                for p, f in fits.items()) + ".")
        gpt = rate.get("gpt_rate")
        if gpt and "policies" not in gpt:
            raise UsageError("results/analysis/rate lacks gpt_rate.policies (an older analysis.rate wrote it); rerun it")
        if gpt:
            lines.append("- **The rate on the GPT** (from a trained checkpoint, two-halves estimate of the held-out gradient; fitted slope "
                         "against nT): " + "; ".join(f"{p} {f['unbiased']['slope']:+.3f} [{f['unbiased']['ci95'][0]:+.3f}, "
                                                    f"{f['unbiased']['ci95'][1]:+.3f}]" for p, f in ((p, gpt["fits"][p]) for p in gpt["policies"])
                                                    if f["unbiased"]) + ". " + gpt["verdict"])
    return lines


def float_check(result: dict | None, which: dict | None) -> str:
    """Which float settings change the bits here, and the whole table rerun under them (experiments.float_check)."""
    lines = []
    if which is not None:
        own = which["own"]
        changed = [f"`{' '.join(f'{k}={v}' for k, v in w['env'].items())}`" for w in which["settings"].values() if w["changes_bits"]]
        same = [f"`{' '.join(f'{k}={v}' for k, v in w['env'].items())}`" for w in which["settings"].values() if not w["changes_bits"]]
        lines.append(f"Which float settings change the bits here ({which['steps']} steps of the sweep's base config, "
                     f"failures from step 0, against this machine's own: {own['capability']}, {own['threads']} threads): "
                     f"{', '.join(changed) or 'none'} change them; {', '.join(same) or 'none'} leave them as they are.")
    if result is None:
        lines.append("The table has not been rerun under them here yet (`python -m experiments.float_check`).")
        return "\n\n".join(lines) + "\n"
    for name, s in result["settings"].items():
        flips = [f"{r['group']}, {r['comparison']}: {r['original']['change_pct']:+.2f}% *{r['original']['word']}* -> "
                 f"{r['rerun']['change_pct']:+.2f}% *{r['rerun']['word']}*"
                 for r in s["rows"].values() if r["original"]["word"] != r["rerun"]["word"]]
        nz = s["noise"]
        lines.append(
            f"Under `{' '.join(f'{k}={v}' for k, v in s['env'].items())}` ({s['capability']}, {s['threads']} threads), "
            + (f"all {s['runs']} runs of the table rerun" if s["runs"] == s.get("of_runs", s["runs"]) else
               f"the {s['runs']} runs behind the printed words rerun (the table's other {s['of_runs'] - s['runs']} keep "
               "their values)")
            + f": every rerun's perplexity moved by {s['mean_abs_change_of_ppl_pct']:.2f}% "
            f"on average (at most {s['max_abs_change_of_ppl_pct']:.2f}%); the pooled noise re-estimated with the reruns "
            f"is {nz['rerun']['sd']:.2f} ({nz['rerun']['df']} df) against {nz['original']['sd']:.2f}; "
            f"{s['words_changed']} of the {len(s['rows'])} rows that use a rerun changed their word, and {s['directions_lost']} of the "
            f"{s['directions_printed']} printed directions were lost (a rerun with new seeds, deciding by the same rule, "
            f"would be expected to lose {s['directions_lost_new_seeds']:.2f} of them; a float rerun of the same seeds is "
            "closer to the original than that)"
            + (": " + "; ".join(flips) if flips else "") + f". Commit `{result['git_commit'][:12]}`.")
    return "\n\n".join(lines) + "\n"


def golden(tol: dict) -> str:
    """The golden tolerance and what it was measured over (tests/golden/tolerance.json, tests.test_golden --measure)."""
    name = lambda s: " ".join(f"{k}={v}" for k, v in s["setting"].items()) or "nothing set"  # noqa: E731
    changed = [f"`{name(c)}` at {c['threads']} thread{'s' if c['threads'] > 1 else ''}" for c in tol["settings_that_changed_the_bits"]]
    earlier = "; ".join(f"{e['max_rel_dev']:.1e} ({e['pairs']} comparison: {e['what']})" for e in tol["earlier_machines"])
    return (f"  Measured here ({tol['capability']}, torch {tol['torch']}): {tol['settings']} runs of the golden table (float "
            f"settings x 1 and 2 threads), {tol['pairs']} pairs; {len(changed)} of them differ in the bits from this "
            f"machine's own (nothing set, 1 thread){': ' + ', '.join(changed) if changed else ''}. The largest relative "
            f"deviation between any two is {tol['max_pairwise_rel_dev']:.1e}; "
            + (f"an earlier machine's golden file deviated by {earlier}; " if earlier else "")
            + f"the golden losses are compared within rtol {tol['rtol']:.1e} ({tol['safety_factor']} x the largest, "
            f"{tol['measured_max_rel_dev']:.2e}, to two digits). `tests/test_golden.py` shows the check fails when r, tau, the MHA divisor "
            "or the weight of the neighbour's pieces in the aggregate (by 5%) changes, and passes a 1-ulp perturbation of the initial weights.")


GPU_RUNS = ROOT / "experiments" / "gpu_runs"  # experiments.gpu_check's records from GPU machines, kept in the repository


def gpu(records: list[dict]) -> str:
    """What has run on a GPU: the latest record of experiments.gpu_check on one (experiments/gpu_runs/), or that none
    has."""
    if not records:
        return ("- **Never run on a GPU:** the CUDA paths (nccl, bf16 autocast, FSDP2 sharding, torchft over NCCL) are "
                "written and tested on the CPU only; `python -m experiments.gpu_check` is the first thing to run on one.")
    r = max(records, key=lambda x: x["date"])
    ran, failed = [], []
    policies = r["policies"]
    good = [p for p, v in policies.items() if v["exit"] == 0 and v["finite"] and v["steps_with_failures"] > 0]
    (ran if len(good) == len(policies) else failed).append(
        f"bf16 training under failures with {len(good)} of {len(policies)} policies")
    ran.append(f"the randomized V1 (energy gap {100 * r['low_rank']['energy_gap']:.2f}% against the exact SVD)")
    for shard, what in (("none", "torchrun over NCCL"), ("fsdp", "FSDP2 under torchrun")):
        t = r["torchrun"][shard]
        (ran if t["exit"] == 0 else failed).append(what + ("" if t["exit"] == 0 else f" ({t['error'].splitlines()[-1]})"))
    ft = r.get("torchft", {})
    if "run" in ft:
        run = ft["run"]
        what = (f"torchft on CUDA ({run['ranks']} replica{'s' if run['ranks'] > 1 else ''}"
                + (f", {run['kills']} killed and healed" if run.get("kills") else "") + ")")
        (ran if run["exit"] == 0 else failed).append(what)
        if "refused" in ft:
            (ran if ft["refused"]["exit"] == 2 else failed).append("one replica more than GPUs refused in one line")
    speed = "; ".join(f"{t['preset']}{' compiled' if t.get('compiled') else ''} {t['tokens_per_s']:,.0f} tokens/s (MFU {100 * t['mfu']:.1f}%, peak memory "
                      f"{t['measured_over_predicted']:.2f}x mecefo.costs' prediction)" for t in r["throughput"])
    return (f"- **On a GPU** (`experiments.gpu_check` on one {r['device']}, torch {r['packages']['torch']}, "
            f"{r['date']}, the tree of commit `{r['tree_commit'][:12]}`; `{r['file']}`): ran: {'; '.join(ran)}"
            + (f". Failed: {'; '.join(failed)}" if failed else "") + f". {speed}. Not yet run on several GPUs: "
            "replicas healing over NCCL, FSDP2 groups across GPUs.")


def gpu_records() -> list[dict]:
    return [json.loads(p.read_text()) | {"file": str(p.relative_to(ROOT))} for p in sorted(GPU_RUNS.glob("*.json"))]


def answers(quick: bool) -> str:
    """The readings behind the table, one paragraph per answer (docs/results.md)."""
    profile = "quick" if quick else "default"
    t3 = _read(RESULTS / "sweep" / f"table3-{profile}.json")
    lines = [quality(t3), *throughput(_read(measurement("throughput", "table2", quick), "paper_policies"),
                                      _read(measurement("throughput", "hypotheses", quick))),
             goodput(_read(measurement("goodput", "goodput", quick), "levels")),
             *theory(_read(measurement("analysis", "grad_error", quick)), _read(measurement("analysis", "rate", quick)))]
    return "\n".join(lines) + "\n"


RESULTS_PAGE = "docs/results.md"
WHERE = {"table3": f"[quality]({RESULTS_PAGE}#results-quality-table-3)",
         "table2": f"[throughput]({RESULTS_PAGE}#results-throughput-table-2)",
         "neighbour": f"[the neighbour]({RESULTS_PAGE}#the-neighbours-cost-flops-by-exact-count-and-time)",
         "goodput": f"[goodput]({RESULTS_PAGE}#results-goodput-which-policy-a-cluster-should-run)",
         "analysis": "[analysis](docs/analysis.md)", "chaos": "[real failures](docs/real_failures.md)"}


def _ci(x: float, lo: float, hi: float, fmt: str = "+.2f", unit: str = "%") -> str:
    return f"{x:{fmt}}{unit} [{lo:{fmt}}, {hi:{fmt}}]"


def agreement(r: dict, sign: int) -> str:
    """A decided direction against the paper's: `sign` -1 where the paper's claim is a decrease."""
    w = r["word"]
    if w in ("better", "worse"):
        return f"{w}: " + ("agrees" if (w == "better") == (sign < 0) else "disagrees")
    return w


def slope_verdict(lo: float, hi: float, theory: float) -> str:
    if lo <= theory <= hi:
        return "consistent with the theory's slope"
    if hi >= 0:
        return "not shown to fall"
    return "falls " + ("faster" if hi < theory else "slower") + " than 1/sqrt(nT)"


def claims(quick: bool) -> list[tuple[str, str, str, str, str]]:
    """(claim, paper, ours, verdict, where) for every paper item with a result here; a missing result says which
    command makes it."""
    profile, paper = ("quick" if quick else "default"), paper_numbers()
    rows = []
    t3 = _read(RESULTS / "sweep" / f"table3-{profile}.json")
    if t3 is None:
        rows.append(("Table 3: perplexity under failures", "", "no result yet", "", "`python -m experiments.table3`"))
    else:
        by = {r["id"]: r for r in t3["rows"]}
        for lvl in ("low", "mid", "high"):
            r, p = by.get(main_id(lvl, "mecefo", "none")), t3["paper"].get(lvl)
            if r and p:
                rows.append((f"Table 3, {lvl} failures: validation perplexity, MeCeFO against failure-free",
                             f"+{p['printed'][0]:.2f} .. +{p['printed'][1]:.2f}% (350M-7B)",
                             f"{pct(r)} ({r['pairs']} seeds, n = {t3['n']})", f"{r['word']}; {p['where']}", WHERE["table3"]))
        fig3 = next((r for r in t3["rows"] if r.get("figure3") and r["comparison"] == "skip attention − skip FFN"), None)
        if fig3:
            rows.append(("Figure 3: skipping attention in the backward pass against skipping the FFN (perplexity, high)",
                         paper["figure3_skip"]["claim"], f"{pct(fig3)} ({fig3['pairs']} seeds)", agreement(fig3, -1),
                         WHERE["table3"]))
    t2 = _read(measurement("throughput", "table2", quick), "paper_policies")
    if t2 is not None:
        for name, w in in_order(t2["mecefo"]).items():
            rows.append((f"Table 2: MeCeFO's throughput drop under high failures, {name} (32 A100s, simulated here)",
                         f"{w['paper']:.2f}%", _ci(w["drop"][0], w["drop"][1], w["drop"][2], ".1f"), w["word"], WHERE["table2"]))
    grad = _read(measurement("analysis", "grad_error", quick))
    if grad is not None and grad.get("max_relative_error") is not None:
        bound, top = grad["paper_bound"], grad["max_relative_error"]
        rows.append(("Assumption 3: relative gradient error of MeCeFO against failure-free, same batch",
                     f"below {bound:g} (Figures 4-7)", f"at most {top:.2f} over {len(grad['points'])} steps with a failure",
                     ("within the paper's" if top < bound else "above the paper's") + " " + f"{bound:g}; "
                     + ("below" if top < 1 else "not below") + " the theory's 1", WHERE["analysis"]))
    rate, theory_slope = _read(measurement("analysis", "rate", quick)), paper["theorem1_rate"]["slope_against_nT"]
    if rate is not None:
        f = rate["synthetic"]["fits"].get("mecefo")
        if f:
            rows.append(("Theorem 1: O(1/sqrt(nT)), synthetic non-convex problem (slope of E||grad f||^2 against nT)",
                         f"{theory_slope:+.1f}", _ci(f["slope"], *f["ci95"], "+.3f", ""), slope_verdict(*f["ci95"], theory_slope),
                         WHERE["analysis"]))
        g = (rate.get("gpt_rate") or {}).get("fits", {}).get("mecefo", {}).get("unbiased")
        if g:
            rows.append(("Theorem 1 on the GPT (momentum SGD from a trained checkpoint, held-out gradient)",
                         f"{theory_slope:+.1f}", _ci(g["slope"], *g["ci95"], "+.3f", ""), slope_verdict(*g["ci95"], theory_slope),
                         WHERE["analysis"]))
    nb = _read(neighbour_bench(profile == "quick"))
    if nb is not None:
        shape = nb["shapes"][-1]
        v = shape["sets"]["mecefo"]
        rows.append((f"Table 6: the neighbour's cost with the three techniques, against naive neighbour-do-both "
                     f"({shape['preset']}'s layer, CPU)", "near failure-free (numbers not given)",
                     f"time {v['time_ratio']:.2f}x, FLOPs {v['flop_ratio']:.2f}x naive",
                     f"time {v['time_over_flop']:.2f}x its FLOP count", WHERE["neighbour"]))
    chaos = _read(RESULTS / "chaos" / "chaos-default.json") or _read(RESULTS / "chaos" / "chaos-quick.json")
    if chaos is not None:
        s = chaos["summary"]
        n = sum(f["schedules"] for f in s["families"].values())
        lost, bad = len(s["lost"]), len(s["violated"])
        rows.append(("Not in the paper (simulated failures only): real process deaths on torchft, random schedules",
                     "-", f"{n} schedules ({chaos['profile']} profile): {lost} lost, {bad} with an invariant violated",
                     "survived" if not lost and not bad else "not all survived", WHERE["chaos"]))
    gp = _read(measurement("goodput", "goodput", quick), "levels")
    if gp is not None:
        parts = []
        for model, levels in in_order(gp["envelope"]).items():
            v = levels["high"]["verdict"]
            sim = next((o for o, readings in v["outcomes"].items() if "simulated" in readings), None)
            parts.append(f"{model}: " + (f"`{v['leader']}`" if v["leader"] else "none under every reading"
                                         + (f" (simulated: `{sim}`)" if sim else "")))
        rows.append(("Not in the paper: which policy reaches failure-free quality first at high failures "
                     "(throughput kept x quality per token)", "MeCeFO (implied)", "; ".join(parts),
                     "see the page: it depends on the throughput reading", WHERE["goodput"]))
    return rows


def claims_table(rows: list[tuple[str, ...]]) -> str:
    lines = ["| paper claim | paper | ours (95% interval) | verdict | where |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    profile = "quick" if quick else "default"
    table, text = claims_table(claims(quick)), answers(quick)
    check = float_check(_read(RESULTS / "float_check" / f"float_check-{profile}.json"),
                        _read(RESULTS / "float_check" / f"which-{profile}.json"))
    paths = [write_table("headline", table + "\n" + text + "\n" + check),
             write_block("headline", table, quick), write_block("answers", text, quick),
             write_block("float_check", check.rstrip("\n"), quick), write_block("gpu", gpu(gpu_records()), None),
             write_block("golden", golden(json.loads((ROOT / "tests" / "golden" / "tolerance.json").read_text())), None)]
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
