"""Shared by the experiment modules: result paths and configs (mecefo.results), CLI error handling."""

from mecefo.errors import guarded
from mecefo.results import CONFIGS, RESULTS, ROOT, load_config, run_dir

__all__ = ["CONFIGS", "RESULTS", "ROOT", "guarded", "load_config", "run_dir"]
