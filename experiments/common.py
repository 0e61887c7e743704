"""Shared by the experiment modules: profiles, result folders keyed by config hash, CLI error handling."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mecefo import config as config_mod
from mecefo.config import Config
from mecefo.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
RESULTS = Path(os.environ.get("MECEFO_RESULTS", ROOT / "results"))  # tests point it at a temporary folder
PROFILES = ("quick", "default", "full")


def load_config(name: str, **overrides) -> Config:
    """experiments/configs/<name>.toml with CLI-style overrides."""
    return config_mod.load(CONFIGS / f"{name}.toml", {k: str(v) for k, v in overrides.items()})


def run_dir(experiment: str, cfg: Config) -> Path:
    """results/<experiment>/<preset>-<config hash>: the same config always lands in the same folder."""
    return RESULTS / experiment / f"{cfg.model.preset}-{cfg.hash()}"


def guarded(main):
    """Run main(); a UsageError becomes a one-line message and exit status 2."""
    try:
        return main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
