"""The README's first screen: one line per answer (quality, throughput, the bound, the theory checks, what has
what has run on a GPU), each with its interval, rendered from the results files that decide it.

    python -m paper_figures.headline [--quick]
"""

from __future__ import annotations

import json
import sys

from mecefo.errors import guarded
from mecefo.results import RESULTS, measurement, quick_flag
from analysis.rate import POLICIES

from .common import ROOT, update_readme, write_table
from .sweep import COLD_ID, main_id
from .throughput import in_order


def _read(path):
    return json.loads(path.read_text()) if path.exists() else None


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
        return "- **Which policy a cluster should run (goodput):** no results/goodput/goodput-*.json yet (`python -m experiments.goodput`)."
    from .goodput import job_sentence  # matplotlib only when there is a result to render

    return ("- **Which policy reaches failure-free quality first (goodput = throughput kept x quality per token, not in the "
            "paper; a policy \"leads\" only if it is ahead at 95%, and not only by less than 1%, under every reading of the "
            "throughput: simulated, fitted baselines, no barrier, spares for every policy, per provisioned GPU, the paper's "
            "drops; else what each reading gives; Results: goodput):** "
            + " ".join(job_sentence(m, levels) for m, levels in in_order(result["envelope"]).items()))


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
        if gpt:
            lines.append("- **The rate on the GPT** (from a trained checkpoint, two-halves estimate of the held-out gradient; fitted slope "
                         "against nT): " + "; ".join(f"{p} {f['unbiased']['slope']:+.3f} [{f['unbiased']['ci95'][0]:+.3f}, "
                                                    f"{f['unbiased']['ci95'][1]:+.3f}]" for p, f in sorted(gpt["fits"].items(), key=lambda
                                                    kv: POLICIES.index(kv[0])) if f["unbiased"]) + ". " + gpt["verdict"])
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


def headline(quick: bool) -> str:
    profile = "quick" if quick else "default"
    t3 = _read(RESULTS / "sweep" / f"table3-{profile}.json")
    lines = [quality(t3), *throughput(_read(measurement("throughput", "table2", quick)),
                                      _read(measurement("throughput", "hypotheses", quick))),
             goodput(_read(measurement("goodput", "goodput", quick))),
             *theory(_read(measurement("analysis", "grad_error", quick)), _read(measurement("analysis", "rate", quick))),
             gpu(gpu_records())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    text, profile = headline(quick), "quick" if quick else "default"
    check = float_check(_read(RESULTS / "float_check" / f"float_check-{profile}.json"),
                        _read(RESULTS / "float_check" / f"which-{profile}.json"))
    paths = [write_table("headline", text + "\n" + check)]
    if not quick:
        paths += [update_readme("headline", text), update_readme("float_check", check.rstrip("\n")),
                  update_readme("golden", golden(json.loads((ROOT / "tests" / "golden" / "tolerance.json").read_text())))]
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
