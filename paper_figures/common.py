"""Shared by the figure/table scripts: they read results/ only and write paper_figures/out/ atomically."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from mecefo.records import atomic_write_text, read_jsonl  # noqa: E402,F401  (read_jsonl: for the figure scripts)
from mecefo.results import FIGURES as OUT  # noqa: E402
from mecefo.results import ROOT  # noqa: E402


def style() -> None:
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.1)


def plain_log_ticks(axis, ticks=None) -> None:
    """A log axis labelled in plain numbers (no "3x10^1" minor labels colliding with the major ones)."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter, NullLocator

    if ticks is not None:
        axis.set_ticks(ticks, [f"{t:g}" for t in ticks])
    else:
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FormatStrFormatter("%g"))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


COMMITTED = ROOT / "docs" / "figures"  # the README's figures: PNGs of the default profile, kept in git


def save_figure(fig, name: str, committed: bool = False) -> list[Path]:
    """paper_figures/out/<name>.png and .pdf, each written to a temporary file and renamed; with committed,
    also docs/figures/<name>.png (callers pass it for the default profile only)."""
    OUT.mkdir(parents=True, exist_ok=True)
    targets = [(OUT, "png"), (OUT, "pdf")] + ([(COMMITTED, "png")] if committed else [])
    paths = []
    for folder, ext in targets:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=f".{ext}")
        os.close(fd)
        fig.savefig(tmp, dpi=110 if folder == COMMITTED else 150, bbox_inches="tight")
        os.replace(tmp, folder / f"{name}.{ext}")
        paths.append(folder / f"{name}.{ext}")
    plt.close(fig)
    return paths


def write_table(name: str, markdown: str) -> Path:
    path = OUT / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, markdown)
    return path


def write_block(block: str, text: str, quick: bool | None) -> Path:
    """A generated block of the README or a docs/ page: paper_figures/out/blocks-<quick|default|any>/<block>.md,
    spliced between the page's `<!-- block:begin -->` and `<!-- block:end -->` markers by `python -m
    paper_figures.readme` (the one writer of the pages). quick=None: a block true under any profile (the
    profiles' times), spliced into the committed pages by every profile."""
    return write_table(f"blocks-{'any' if quick is None else 'quick' if quick else 'default'}/{block}", text)
