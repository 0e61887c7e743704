"""python -m paper_figures.profile: how long each profile of run_all.sh took, step by step, from the wall times it
appends to results/run_all/times-<profile>.jsonl (one row per command: its invocation, commit, whether results/
was empty at the start, and seconds).

Writes the block `profiles` (one line per profile, for the README) and `profile_<name>` (the latest run's table,
for docs/profiles.md). A run that reused cached results says so: only a run from an empty results/ measures the
profile's cost."""

from __future__ import annotations

import sys

from mecefo.errors import UsageError, guarded
from mecefo.records import read_jsonl
from mecefo.results import RESULTS

from .common import write_block
from .readme import block_text

PROFILES = ("quick", "default", "full")


def latest(rows: list[dict]) -> list[dict]:
    """The rows of the latest invocation (run_all.sh stamps each of its commands with its start time)."""
    last = max(r["invocation"] for r in rows)
    return [r for r in rows if r["invocation"] == last]


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def provenance(run: list[dict]) -> str:
    r = run[0]
    how = "from an empty results/" if r.get("fresh") else "reusing results/ cached by an earlier run"
    return f"started {r['invocation']}, commit `{r['commit']}`, {r.get('cores', '?')} cores, {how}"


def table(name: str, run: list[dict]) -> str:
    total = sum(r["seconds"] for r in run)
    lines = [f"{command(name)}: {minutes(total)} ({provenance(run)}).", "",
             "| step | wall time | share |", "|---|---:|---:|"]
    for r in run:
        lines.append(f"| `{r['command']}` | {minutes(r['seconds'])} | {100 * r['seconds'] / total:.0f}% |")
    lines.append(f"| **total** | **{minutes(total)}** | |")
    return "\n".join(lines)


def command(name: str) -> str:
    return f"`bash run_all.sh{'' if name == 'default' else ' --' + name}`"


def summary(runs: dict[str, list[dict]], committed: str = "") -> str:
    """One line per profile: its latest run here, else the line the committed block already holds for it (a
    profile not run in this checkout keeps the time measured where it was)."""
    kept = {name: line for line in committed.splitlines() for name in PROFILES if line.startswith(f"- {command(name)}:")}
    lines = [f"- {command(name)}: {minutes(sum(r['seconds'] for r in runs[name]))} ({provenance(runs[name])})"
             if name in runs else kept.get(name) for name in PROFILES]
    lines = [line for line in lines if line]
    return "\n".join(lines) if lines else "No profile has been timed yet (`bash run_all.sh` appends to results/run_all/)."


def main(argv: list[str]) -> int:
    if argv:
        raise UsageError("usage: python -m paper_figures.profile (reads every results/run_all/times-<profile>.jsonl)")
    runs = {}
    for name in PROFILES:
        path = RESULTS / "run_all" / f"times-{name}.jsonl"
        if path.exists():
            runs[name] = latest(read_jsonl(path))
    paths = [write_block("profiles", summary(runs, block_text("profiles")), quick=None)]
    paths += [write_block(f"profile_{name}", table(name, run), quick=None) for name, run in runs.items()]
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(lambda: main(sys.argv[1:])))
