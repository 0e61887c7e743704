"""Benchmark of the torchft backend: the per-step cost of torchft's quorum against the torch backend, and the
time a real failure costs.

    python -m experiments.bench_ft [--quick]

1. Without failures, 2 ranks, the same config (nano with --quick, tiny otherwise), one thread per process:
   the torch backend (torchrun, gloo) and the torchft backend (mecefo.launch, gloo), one after the other.
   Step time: the median over steps (the first 5 left out) of the wall-clock gap between consecutive rows
   (for torchft: between commits, so quorum, failed-set exchange and should_commit are included).
   Written: both medians and their ratio.
2. With real kills, 3 ranks, steps paced to 0.1 s: rank 1 killed with SIGKILL and restarted 10 steps later,
   twice. Written: seconds from each kill to the next committed step, and from each restart to the first step the
   restarted rank takes part in (a spare process taking over, quorum, healing).
Writes results/bench/ft-<profile>.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mecefo.records import atomic_write_json, git_commit, package_versions
from mecefo.results import quick_flag

from .common import CONFIGS, RESULTS, ROOT, guarded


def _run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} failed ({r.returncode}): {r.stderr[-2000:]}")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    preset, steps = ("nano", 40) if quick else ("tiny", 60)
    config = ["--config", str(CONFIGS / f"{preset}.toml"), "--steps", str(steps), "--eval_every", str(steps)]
    scratch = Path(tempfile.mkdtemp(prefix="bench_ft-"))
    try:
        _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "mecefo.train", *config,
              "--ranks", "2", "--backend", "torch", "--quiet", "--out", str(scratch / "torch")])
        torch_rows = [r for r in _rows(scratch / "torch" / "metrics.jsonl") if r["step"] > 5]
        torch_step = statistics.median(b["wall_time_s"] - a["wall_time_s"] for a, b in zip(torch_rows, torch_rows[1:]))
        _run(["-m", "mecefo.launch", *config, "--ranks", "2", "--quiet", "--out", str(scratch / "ft")])
        ft_rows = [r for r in _rows(scratch / "ft" / "metrics.jsonl") if r["step"] > 5]  # merged from the replicas:
        ft_step = statistics.median(b["backend"]["time"] - a["backend"]["time"]  # their clock, not one's wall time
                                    for a, b in zip(ft_rows, ft_rows[1:]))
        _run(["-m", "mecefo.launch", "--config", str(CONFIGS / "nano.toml"), "--steps", "120", "--eval_every", "120",
              "--ranks", "3", "--min-step-s", "0.1", "--kill", "1:15:25", "--kill", "1:70:80", "--quiet",
              "--out", str(scratch / "kills")])
        timings = json.loads((scratch / "kills" / "summary.json").read_text())["backend"]["timings"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"preset": preset, "steps": steps, "ranks": 2, "torch_step_s": torch_step, "torchft_step_s": ft_step,
              "ratio_torchft_over_torch": ft_step / torch_step, "recovery": timings,
              "git_commit": git_commit(), "packages": package_versions()}
    path = RESULTS / "bench" / f"ft-{'quick' if quick else 'default'}.json"
    atomic_write_json(path, result)
    print(f"{preset}, 2 ranks: torch backend {1e3 * torch_step:.1f} ms/step, torchft {1e3 * ft_step:.1f} ms/step "
          f"(x{ft_step / torch_step:.2f}); kill -> next step {timings['kill_to_step_s']} s, "
          f"restart -> rejoin {timings['restart_to_rejoin_s']} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
