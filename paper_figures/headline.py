"""The README's first screen: one line per answer (quality, throughput, the bound, the theory checks, what has
never run on a GPU), each with its interval, rendered from the results files that decide it.

    python -m paper_figures.headline [--quick]
"""

from __future__ import annotations

import json
import sys

from mecefo.errors import guarded
from mecefo.results import RESULTS, measurement, quick_flag
from analysis.rate import POLICIES

from .common import update_readme, write_table
from .sweep import COLD_ID, main_id
from .throughput import in_order


def _read(path):
    return json.loads(path.read_text()) if path.exists() else None


def quality(t3: dict | None) -> str:
    if t3 is None:
        return "- **Quality (Table 3):** no results/sweep/table3-*.json yet (`python -m experiments.table3`)."
    by = {r["id"]: r for r in t3["rows"]}
    parts = []
    for lvl in ("low", "mid", "high"):
        r = by.get(main_id(lvl, "mecefo", "none"))
        if r:
            parts.append(f"{lvl} {r['mean']:+.2f}% [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}] *{r['word']}* ({r['pairs']} seeds)")
    vs = by.get(main_id("high", "mecefo", "drop"))
    paper = t3["paper"].get("high")
    line = (f"- **Quality (Table 3 analog, {t3['n']} ranks, validation perplexity, MeCeFO − failure-free, paired "
            "95% intervals):** " + "; ".join(parts) + ".")
    if paper:
        line += (f" The paper's high change is +{paper['printed'][0]:.2f} .. +{paper['printed'][1]:.2f}% over 350M-7B: "
                 f"ours is {paper['where']}.")
    cold = by.get(COLD_ID)
    if cold:
        line += (f" Without the failure-free warm start, high: {cold['mean']:+.2f}% [{cold['ci'][0]:+.2f}, {cold['ci'][1]:+.2f}] "
                 f"*{cold['word']}* ({cold['pairs']} seeds, its own noise).")
    if vs:
        line += (f" MeCeFO − drop (torchft's policy) at high: {vs['mean']:+.2f}% [{vs['ci'][0]:+.2f}, {vs['ci'][1]:+.2f}] "
                 f"*{vs['word']}*.")
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


def theory(grad: dict | None, rate: dict | None) -> list[str]:
    lines = []
    if grad is not None and grad["points"]:
        worst = max(p["relative error"] for p in grad["points"])
        lines.append(f"- **Assumption 3 (relative gradient error of MeCeFO against failure-free on the same batch):** "
                     f"at most {worst:.2f} over {len(grad['points'])} steps with an active failure "
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


def float_check(result: dict | None) -> str:
    """The rerun of the deciding rows in another float environment (experiments.float_check), word by word."""
    if result is None:
        return "not run here yet (`python -m experiments.float_check`).\n"
    rows = "; ".join(f"{r} {v['original']['mean']:+.2f}% *{v['original']['word']}* -> {v['rerun']['mean']:+.2f}% "
                     f"*{v['rerun']['word']}*" for r, v in result["rows"].items())
    moved = (f"every run's perplexity moved (by {result['mean_abs_change_of_ppl_pct']:.2f}% on average, at most "
             f"{result['max_abs_change_of_ppl_pct']:.2f}%)" if result["max_abs_change_of_ppl_pct"] > 0 else
             "no run's perplexity moved (the check tested nothing)")
    threads = f" and {result['rerun_threads']} intra-op thread(s)" if "rerun_threads" in result else ""
    return (f"with torch's CPU kernels at {result.get('rerun_capability', result['capability'])}{threads} instead of "
            f"{result.get('original_capability', 'this machine')}'s, {moved}, "
            f"and {result['words_changed']} of {len(result['rows'])} words changed (high failures, seeds "
            f"{', '.join(map(str, result['seeds']))}, decided with the same pooled noise): {rows}. Commit "
            f"`{result['git_commit'][:12]}`.\n")


def headline(quick: bool) -> str:
    profile = "quick" if quick else "default"
    t3 = _read(RESULTS / "sweep" / f"table3-{profile}.json")
    lines = [quality(t3), *throughput(_read(measurement("throughput", "table2", quick)),
                                      _read(measurement("throughput", "hypotheses", quick))),
             *theory(_read(measurement("analysis", "grad_error", quick)), _read(measurement("analysis", "rate", quick))),
             "- **Never run on a GPU:** the CUDA paths (nccl, bf16 autocast, FSDP2 sharding, torchft over NCCL) are "
             "written and tested on the CPU only; `python -m experiments.gpu_check` is the first thing to run on one."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    text = headline(quick)
    check = float_check(_read(RESULTS / "float_check" / f"float_check-{'quick' if quick else 'default'}.json"))
    paths = [write_table("headline", text + "\n" + check)]
    if not quick:
        paths += [update_readme("headline", text), update_readme("float_check", check.rstrip("\n"))]
    for p in paths:
        if p is not None:
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
