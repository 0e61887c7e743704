"""Where results live: the one module that knows the repository's result paths, profiles and configs, and
the one loader of the paper's own numbers.

results/<experiment>/<preset>-<config hash>/   a training run (the same config always lands in one folder)
results/<experiment>/...-<profile>.json        an experiment's or analysis's measurements
paper_figures/out/                             figures and tables drawn from results/ (paper_figures only)
paper_figures/paper_numbers.json               the paper's numbers, each with its table or figure

MECEFO_RESULTS points results/ elsewhere (e.g. a scratch folder for a trial run).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

ROOT = Path(os.environ.get("MECEFO_ROOT", Path(__file__).resolve().parents[2]))
CONFIGS = ROOT / "experiments" / "configs"
RESULTS = Path(os.environ.get("MECEFO_RESULTS", ROOT / "results"))
FIGURES = ROOT / "paper_figures" / "out"
PAPER_NUMBERS = ROOT / "paper_figures" / "paper_numbers.json"
FAILURE_FREE_CONFIG = {"quick": "nano", "default": "tiny"}  # the failure-free reference run of each profile


def profile(quick: bool) -> str:
    return "quick" if quick else "default"


def neighbour_bench(quick: bool) -> Path:
    """experiments.bench_neighbour's result: the quick profile's; else the full profile's (the layer shapes of all three
    of Table 2's models) where it has run, or the default's (llama-350m's and llama-1b's)."""
    bench = RESULTS / "bench"
    if quick:
        return bench / "neighbour-quick.json"
    full = bench / "neighbour-full.json"
    return full if full.exists() else bench / "neighbour-default.json"


def quick_flag(argv: list[str] | None, description: str) -> bool:
    """The --quick flag of an experiment, analysis or figure CLI (the only option most of them take)."""
    import argparse

    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized profile")
    return parser.parse_args(argv).quick


def read_measurement(experiment: str, name: str, quick: bool, producer: str, keys: tuple[str, ...] = ()) -> dict:
    """results/<experiment>/<name>-<profile>.json, or a UsageError naming the module that writes it (also where the
    file lacks one of `keys`: an older version of that module wrote it)."""
    from .errors import UsageError

    path = measurement(experiment, name, quick)
    if not path.exists():
        raise UsageError(f"no {path}; run python -m {producer}{' --quick' if quick else ''} first")
    result = json.loads(path.read_text())
    if missing := [k for k in keys if k not in result]:
        raise UsageError(f"{path} lacks {', '.join(missing)} (an older python -m {producer} wrote it); run "
                         f"python -m {producer}{' --quick' if quick else ''} again")
    return result


def load_config(name: str, **overrides):
    """experiments/configs/<name>.toml with CLI-style overrides."""
    from . import config as config_mod

    return config_mod.load(CONFIGS / f"{name}.toml", {k: str(v) for k, v in overrides.items()})


def run_dir(experiment: str, cfg) -> Path:
    """results/<experiment>/<preset>-<config hash>: the same config always lands in the same folder."""
    return RESULTS / experiment / f"{cfg.model.preset}-{cfg.hash()}"


def failure_free_run(quick: bool) -> Path:
    """The failure-free reference run of a profile (experiments.failure_free)."""
    return run_dir("failure_free", load_config(FAILURE_FREE_CONFIG[profile(quick)]))


def measurement(experiment: str, name: str, quick: bool) -> Path:
    """results/<experiment>/<name>-<profile>.json."""
    return RESULTS / experiment / f"{name}-{profile(quick)}.json"


SIMULATOR_SOURCES = ("src/mecefo/simulator.py", "src/mecefo/simulator_constants.json", "src/mecefo/costs.py",
                     "src/mecefo/failures.py", "src/mecefo/policies", "src/mecefo/model.py", "src/mecefo/neighbour.py",
                     "src/mecefo/plan.py", "paper_figures/paper_numbers.json", "experiments/throughput.py",
                     "experiments/hypotheses.py")


def sources_digest(paths=SIMULATOR_SOURCES) -> str:
    """SHA-256 (12 hex digits) of the contents of these files (folders: their *.py and *.json files), so a
    measurement made by other code is recomputed rather than reused."""
    import hashlib

    h = hashlib.sha256()
    for rel in paths:
        path = ROOT / rel
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.suffix in (".py", ".json") and f.is_file():
                h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def reusable(path: Path, digest: str) -> bool:
    """Whether the measurement at `path` exists and was made by code with this sources_digest."""
    try:
        return json.loads(path.read_text()).get("sources_digest") == digest
    except (OSError, ValueError):
        return False


def sweep_index(quick: bool) -> Path:
    return RESULTS / "sweep" / f"index-{profile(quick)}.json"


@lru_cache(maxsize=1)
def paper_numbers() -> dict:
    """The paper's numbers (paper_figures/paper_numbers.json): every entry names its source table or figure."""
    return json.loads(PAPER_NUMBERS.read_text())


def in_paper_order(d: dict) -> dict:
    """d's entries keyed by the paper's jobs in Table 2's row order, then its other keys (results JSON is written with
    sorted keys, so a dict read back has lost the order it was built in)."""
    jobs = list(paper_numbers()["table2_throughput_tokens_per_s"]["rows"])
    return {m: d[m] for m in jobs if m in d} | {k: v for k, v in d.items() if k not in jobs}
