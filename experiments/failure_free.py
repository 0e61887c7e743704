"""Train the CPU reference configuration without failures: the anchor every later comparison is made against.

    python -m experiments.failure_free [--quick]

quick: experiments/configs/nano.toml (seconds); default: experiments/configs/tiny.toml (minutes on 2 cores).
Results land in results/failure_free/<preset>-<config hash>/ and are reused when the config is unchanged.
"""

from __future__ import annotations

import argparse
import sys

from mecefo.train import run

from mecefo.results import FAILURE_FREE_CONFIG

from .common import guarded, load_config, run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized profile")
    args = parser.parse_args(argv)
    cfg = load_config(FAILURE_FREE_CONFIG["quick" if args.quick else "default"])
    summary = run(cfg, run_dir("failure_free", cfg))
    print(f"failure-free {cfg.model.preset}: val ppl {summary['final_val_ppl']:.2f} "
          f"in {summary['wall_time_s']:.0f} s -> {run_dir('failure_free', cfg)}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
