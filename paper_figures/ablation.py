"""The Table 6 analog (neighbour cost per technique, relative to a normal rank) and the figure of MeCeFO's
FLOPs ratio against tokens per step, from results/ablation/ only.

    python -m paper_figures.ablation [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from mecefo.errors import UsageError, guarded
from mecefo.results import measurement

from .common import save_figure, style, write_table

PAPER_NOTE = ("The paper's Table 6 reports only that naive NDB runs out of memory and that adding the "
              "techniques one by one brings memory and throughput back near failure-free; its numbers are unknown.")


def load_result(quick: bool) -> dict:
    path = measurement("ablation", "ablation", quick)
    if not path.exists():
        raise UsageError(f"no {path}; run python -m experiments.ablation{' --quick' if quick else ''} first")
    return json.loads(path.read_text())


def room(df: pd.DataFrame) -> str:
    """Naive NDB's largest micro-batch under ZeRO-2 as a share of a normal rank's, per preset (from the records)."""
    parts = []
    for name, group in df.groupby("preset", sort=False):
        if {"normal rank", "naive NDB"} <= set(group["row"]):
            normal, naive = (group[group["row"] == r].iloc[0]["memory_fit"]["zero2_max_batch"] for r in ("normal rank", "naive NDB"))
            if normal:
                parts.append(f"{name} {naive} of {normal} ({100 * naive / normal:.0f}%)")
    return ("; naive NDB's largest micro-batch against a normal rank's: " + ", ".join(parts)) if parts else ""


def table(result: dict) -> str:
    df = pd.DataFrame(result["records"])
    r_main = 64 if 64 in result["settings"]["r_values"] else result["settings"]["r_values"][0]
    df = df[(df["r"] == r_main) | ~df["row"].str.contains("low_rank")]
    lines = [f"# Neighbour cost per technique (the paper's Table 6, measured)\n",
             f"Sequence length {result['settings']['seq_len']}; low-rank r = {r_main} (per FFN matrix, capped at its "
             "input width); a neighbour computes its own and the failed rank's micro-batches. Ratios are to a normal "
             "rank doing one micro-batch per slot, over k micro-batches per optimizer step.\n",
             "- **FLOPs**: matrix-multiply FLOPs counted by FlopCounterMode on the meta device (equal to the closed "
             "forms in `mecefo/costs.py`), per optimizer step; the V1^T product is applied once per step.",
             "- **act. together / sequential**: bytes saved for backward (once per storage, fp32, parameters excluded, "
             "checkpointed inputs included) when both micro-batches are held at once / run one after the other.",
             "- **wall**: this CPU, median over rounds of alternated timings (fp32, forward+backward).",
             "- **peak (MemTracker)**: torch's MemTracker under FakeTensorMode, one AdamW step, fp32, both micro-batches together.",
             f"- **A100 fit**: one 80 GB A100 per rank; bf16 activations (half the fp32 count); replicated = fp32 weights, "
             f"gradients and AdamW moments (16 B/parameter); ZeRO-2 = gradients and moments sharded over "
             f"{result['dp_ranks']} data-parallel ranks. Temporaries and fragmentation are not included. The last "
             "column is the largest micro-batch (sequences) each row could run under ZeRO-2 (activations grow "
             f"linearly with it){room(df)}.\n",
             PAPER_NOTE + "\n"]
    for name, group in df.groupby("preset", sort=False):
        base = group[group["row"] == "normal rank"].iloc[0]
        b, k = int(base["batch"]), int(base["k"])
        lines.append(f"\n## {name} (micro-batch {b} x {result['settings']['seq_len']} tokens, k = {k})\n")
        has_wall = "wall_ratio" in group and group["wall_ratio"].notna().any()
        header = "| row | FLOPs / normal | act. together / normal | act. sequential / normal | act. together |"
        header += " wall / normal | peak (MemTracker) |" if has_wall else ""
        header += " fits A100 (replicated / ZeRO-2) | largest micro-batch fitting (ZeRO-2) |"
        lines += [header, "|" + "---|" * (header.count("|") - 1)]
        for _, rec in group.iterrows():
            fit = rec["memory_fit"]
            cells = [rec["row"], f"{rec['flops'] / base['flops']:.3f}",
                     f"{rec['activation_bytes_together'] / base['activation_bytes_together']:.3f}",
                     f"{rec['activation_bytes_sequential'] / base['activation_bytes_sequential']:.3f}",
                     f"{rec['activation_bytes_together'] / 2**30:.2f} GiB"]
            if has_wall:
                cells += [f"{rec['wall_ratio']:.2f}" if pd.notna(rec.get("wall_ratio")) else "",
                          f"{rec['peak_memory']['total'] / 2**30:.2f} GiB" if isinstance(rec.get("peak_memory"), dict) else ""]
            cells.append(f"{'yes' if fit['replicated_fits'] else 'no'} ({fit['replicated_bytes'] / 1e9:.1f} GB) / "
                         f"{'yes' if fit['zero2_fits'] else 'no'} ({fit['zero2_bytes'] / 1e9:.1f} GB)")
            cells.append(f"{fit['zero2_max_batch']} x {result['settings']['seq_len']}")
            lines.append("| " + " | ".join(cells) + " |")
    r_values = result["settings"]["r_values"]
    if len(r_values) > 1:
        lines += ["\n## MeCeFO neighbour FLOPs / normal rank, by r\n", "| preset | " + " | ".join(f"r = {r}" for r in r_values) + " |",
                  "|---|" + "---|" * len(r_values)]
        full = pd.DataFrame(result["records"])
        for name, group in full.groupby("preset", sort=False):
            base = group[group["row"] == "normal rank"].iloc[0]["flops"]
            mecefo = group[group["row"].str.contains("MeCeFO")].set_index("r")["flops"]
            lines.append(f"| {name} | " + " | ".join(f"{mecefo[r] / base:.3f}" for r in r_values) + " |")
    lines.append(f"\nSource: `{result['git_commit'][:12]}`, results/ablation (settings and their hash in the file).\n")
    return "\n".join(lines)


def flops_vs_tokens(result: dict):
    """MeCeFO neighbour / normal FLOPs against tokens per step, from the counted per-micro-batch FLOPs:
    ratio(k) = (2 k (c_nb - a) + a) / (k c_normal), a = the once-per-step V1^T product."""
    rows = []
    recs = pd.DataFrame(result["records"])
    for name, group in recs.groupby("preset", sort=False):
        normal = group[group["row"] == "normal rank"].iloc[0]["per_micro_batch_flops"]["total"]
        tokens_per_micro = int(group.iloc[0]["batch"]) * result["settings"]["seq_len"]
        for _, rec in group[group["row"].str.contains("MeCeFO")].iterrows():
            c = rec["per_micro_batch_flops"]
            for k in [2 ** i for i in range(0, 11)]:
                once = (2 * k * (c["total"] - c["wgrad_apply"]) + c["wgrad_apply"]) / (k * normal)
                rows.append({"preset": name, "r": rec["r"], "tokens per step": k * tokens_per_micro, "ratio": once,
                             "V1^T applied": "once per step"})
                rows.append({"preset": name, "r": rec["r"], "tokens per step": k * tokens_per_micro,
                             "ratio": 2 * c["total"] / normal, "V1^T applied": "per micro-batch"})
    df = pd.DataFrame(rows)
    style()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    df["r"] = df["r"].astype(str)
    many_r = df["r"].nunique() > 1
    sns.lineplot(df, x="tokens per step", y="ratio", hue="preset", style="r" if many_r else "V1^T applied",
                 size="V1^T applied" if many_r else None, sizes=(0.8, 2.0) if many_r else None, marker="o",
                 markersize=3, ax=ax)
    ax.axhline(2.0, color="grey", ls="--", lw=1)
    ax.text(df["tokens per step"].min(), 2.02, "naive NDB (2x)", color="grey", fontsize=8)
    ax.set(xscale="log", ylabel="MeCeFO neighbour FLOPs / normal rank",
           title="Low-rank Wgrad's 2rmn term amortises with tokens per step")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    result = load_result(parser.parse_args(argv).quick)
    paths = [write_table("ablation_table6", table(result))]
    paths += save_figure(flops_vs_tokens(result), "ablation_flops_vs_tokens")
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
