"""Do Table 3's words survive another float environment? Rerun the deciding rows (failure-free, MeCeFO and drop
at high failures, the default profile's seeds) with torch's vectorised CPU kernels changed (ATEN_CPU_CAPABILITY,
as another CPU would run them), decide their words with the same pooled noise, and compare them word by word
with the words the original runs of the same seeds give.

    python -m experiments.float_check [--capability avx2] [--quick]

The reruns live in results/float_check/<capability>/ (their own results root: same configs, other rounding)
and are reused on rerun; the comparison goes to results/float_check/float_check-<profile>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from mecefo.records import atomic_write_json, git_commit
from mecefo.results import RESULTS
from mecefo.stats import Noise, decide

from . import sweep, table3
from .common import guarded

DECIDING = (("none", "none"), ("high", "mecefo"), ("high", "drop"))
ROWS = (("mecefo", "none"), ("drop", "none"), ("mecefo", "drop"))  # at high, paired by seed


def deciding_cells(profile: str) -> list[sweep.Cell]:
    d = sweep.DESIGNS[profile]
    return [c for c in sweep.cells(profile) if c.n == d.n and c.tag == "main" and (c.level, c.policy) in DECIDING]


def worker(profile: str) -> dict[str, float]:
    """Run the deciding cells in this process's float environment (the caller sets it); their perplexities."""
    from mecefo.train import run

    out = {}
    for i, c in enumerate(deciding_cells(profile)):
        cfg = sweep.cell_config(sweep.DESIGNS[profile].base, c)
        folder = RESULTS / "sweep" / f"{cfg.model.preset}-{cfg.hash()}"
        run(cfg, folder, quiet=True)
        out[f"{c.level}:{c.policy}:{c.seed}"] = sweep.run_ppl(folder)
        print(f"[{i + 1}] {c.level} {c.policy} seed {c.seed}: ppl {out[f'{c.level}:{c.policy}:{c.seed}']:.4f}", flush=True)
    return out


def words(ppl: dict[str, float], seeds: list[int], noise: Noise) -> dict[str, dict]:
    name = table3.name
    out = {}
    for a, b in ROWS:
        sel = lambda p: [ppl[f"{'none' if p == 'none' else 'high'}:{p}:{s}"] for s in seeds]  # noqa: E731
        d = 100 * (np.array(sel(a)) / np.array(sel(b)) - 1)
        v = decide(float(d.mean()), len(seeds), noise, table3.TOLERANCE, agree=table3.AGREE)
        out[f"{name(a)} − {name(b)}"] = {"mean": v.mean, "ci": v.ci, "word": v.word}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", default="avx2", choices=("default", "avx2", "avx512"),
                        help="ATEN_CPU_CAPABILITY of the rerun (this machine's own is the original's)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    profile = "quick" if args.quick else "default"
    if args.worker:
        import torch

        print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                          "ppl": worker(profile)}))
        return 0
    t3_path = RESULTS / "sweep" / f"table3-{profile}.json"
    if not t3_path.exists():
        from mecefo.errors import UsageError

        raise UsageError(f"no {t3_path}; run python -m experiments.table3{' --quick' if args.quick else ''} first")
    t3 = json.loads(t3_path.read_text())
    noise = Noise(**t3["noise"])
    original = {f"{c['level']}:{c['policy']}:{c['seed']}": c["val_ppl"] for c in t3["cells"]
                if c["n"] == t3["n"] and c["tag"] == "main" and (c["level"], c["policy"]) in DECIDING}
    root = RESULTS / "float_check" / args.capability
    env = {**os.environ, "ATEN_CPU_CAPABILITY": args.capability, "MECEFO_RESULTS": str(root)}
    proc = subprocess.run([sys.executable, "-m", "experiments.float_check", "--worker"] + (["--quick"] if args.quick else []),
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        return proc.returncode
    import torch

    got = json.loads(proc.stdout.splitlines()[-1])
    rerun = got["ppl"]
    seeds = sorted({int(k.split(":")[2]) for k in rerun})
    missing = [k for k in rerun if k not in original]
    if missing:
        from mecefo.errors import UsageError

        raise UsageError(f"the original sweep lacks {missing}; run python -m experiments.sweep first")
    rel = [abs(100 * (rerun[k] / original[k] - 1)) for k in rerun]
    before, after = words(original, seeds, noise), words(rerun, seeds, noise)
    # the original sweep ran in this machine's own float environment (no ATEN_CPU_CAPABILITY set by run_all.sh)
    result = {"capability": args.capability, "rerun_capability": got["capability"], "rerun_threads": got["threads"],
              "original_capability": torch.backends.cpu.get_cpu_capability(), "profile": profile, "seeds": seeds, "noise": t3["noise"],
              "runs": {k: {"original": original[k], "rerun": rerun[k]} for k in rerun},
              "max_abs_change_of_ppl_pct": max(rel), "mean_abs_change_of_ppl_pct": float(np.mean(rel)),
              "rows": {r: {"original": before[r], "rerun": after[r]} for r in before},
              "words_changed": sum(before[r]["word"] != after[r]["word"] for r in before), "git_commit": git_commit()}
    path = RESULTS / "float_check" / f"float_check-{profile}.json"
    atomic_write_json(path, result)
    print(f"per-run ppl moved by {result['mean_abs_change_of_ppl_pct']:.2f}% on average (max "
          f"{result['max_abs_change_of_ppl_pct']:.2f}%) under ATEN_CPU_CAPABILITY={args.capability}")
    for r, v in result["rows"].items():
        print(f"  {r}: {v['original']['mean']:+.2f}% {v['original']['word']!r} -> {v['rerun']['mean']:+.2f}% {v['rerun']['word']!r}")
    print(f"{result['words_changed']} of {len(before)} words changed -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
