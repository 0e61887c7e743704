"""What a slow heal costs on the torchft backend: throughput against heal time.

    python -m experiments.bench_heal [--quick]

nano on 3 replicas under mecefo.launch, 200 steps paced to 0.1 s, the kill pattern of the twin test (rank 1
killed at step 8 and restarted at 12, killed again while it heals, rank 2 killed at 16 and restarted at 30),
with every heal held for D seconds (MECEFO_FT_HEAL_DELAY_S with MECEFO_FT_HEAL_DELAY_EVERY: a large model's
state transfer, imitated), D in 0, 2, 5, 10 s (--quick: 0, 2). Measured per D, from the committed rows'
wall clocks: the seconds from the first committed step to the last, the heals, and the excess over D = 0
divided by D: about the number of heals if a heal costs its own duration, far more if the replicas fall into
taking turns healing (they did with the lighthouse's 500 ms join timeout, before it was raised; see
mecefo.lighthouse.JOIN_TIMEOUT_MS). A run that does not finish within 300 s is written as such.
Writes results/bench/heal-<profile>.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mecefo.records import atomic_write_json, git_commit, package_versions
from mecefo.results import quick_flag

from .common import CONFIGS, RESULTS, ROOT, guarded

KILLS = ["--kill", "1:8:12", "--kill", "1:heal", "--kill", "2:16:30"]
STEPS, PACE, LIMIT_S = 200, 0.1, 300


def one(delay: float, scratch: Path) -> dict:
    out = scratch / f"d{delay:g}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1",
           "MECEFO_FT_HEAL_DELAY_S": str(delay), "MECEFO_FT_HEAL_DELAY_EVERY": "1"}
    cmd = [sys.executable, "-m", "mecefo.launch", "--config", str(CONFIGS / "nano.toml"), "--ranks", "3", "--steps",
           str(STEPS), "--min_step_s", str(PACE), *KILLS, "--out", str(out), "--quiet"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"heal_s": delay, "finished": False, "note": f"not finished within {LIMIT_S} s"}
    if r.returncode != 0:
        raise RuntimeError(f"mecefo.launch failed at D = {delay} ({r.returncode}): {r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    times = [row["backend"]["time"] for row in rows]
    healed = json.loads((out / "events.json").read_text())["healed"]
    return {"heal_s": delay, "finished": True, "seconds": times[-1] - times[0], "steps": len(rows),
            "steps_per_s": (len(rows) - 1) / (times[-1] - times[0]), "heals": len(healed),
            "slowest_steps_s": sorted((b - a for a, b in zip(times, times[1:])), reverse=True)[:4]}


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    delays = (0.0, 2.0) if quick else (0.0, 2.0, 5.0, 10.0)
    scratch = Path(tempfile.mkdtemp(prefix="bench_heal-"))
    try:
        runs = [one(d, scratch) for d in delays]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = runs[0]["seconds"]
    for run in runs[1:]:
        if run["finished"]:
            run["heals_paid"] = (run["seconds"] - base) / run["heal_s"]  # ~ heals if each costs its own duration
    path = RESULTS / "bench" / f"heal-{'quick' if quick else 'default'}.json"
    atomic_write_json(path, {"steps": STEPS, "pace_s": PACE, "kills": KILLS, "runs": runs, "git_commit": git_commit(),
                             "packages": package_versions()})
    for run in runs:
        print(f"heal {run['heal_s']:g} s: " + (f"{run['seconds']:.1f} s for {run['steps']} steps, {run['heals']} heals"
                                              + (f", excess = {run['heals_paid']:.2f} heals' time" if "heals_paid" in run else "")
                                              if run["finished"] else run["note"]))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
