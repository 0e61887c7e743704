"""A replica stalled past the end of the run, as a user meets it: the same launch again and again, rank 1's processes
SIGSTOPped from outside the launcher (a GC pause, swap, a VM migration, an NFS hang) once it has committed step 25,
and SIGCONTed 45 s later, after the others have finished.

    python -m experiments.stall_past_end [--runs 10]

    mecefo.launch --config nano.toml --ranks 4 --steps 100 --min_step_s 0.2 --eval_every 50   (one-process replicas)
    ... --ranks 3 --shard fsdp --group_size 2                                                    (groups of 2)

Each launch must exit 0 with the three others' history, rank 1 named as left behind in its summary and last line, and
no step of rank 1's after it woke. Before mecefo.ft's keep_to_the_front, 2 launches of 2 ended with exit 3 ("step
26: replicas disagree (rank 0 vs rank 1), and both went on") and no summary. Writes results/chaos/stall-past-end.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from mecefo.records import atomic_write_json, git_commit, package_versions

from .common import CONFIGS, RESULTS, ROOT, guarded

STALL_AT, STALL_S = 25, 45.0
FAMILIES = {"one-process": ["--ranks", "4"], "groups of 2": ["--ranks", "3", "--shard", "fsdp", "--group_size", "2"]}


def _replica_pids(rank: int) -> list[int]:
    """The processes of rank's replica (the launcher names its forks mecefo-r<R> and mecefo-r<R>.<J>)."""
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            continue
        if name == f"mecefo-r{rank}" or name.startswith(f"mecefo-r{rank}."):
            found.append(int(comm.parent.name))
    return found


def one(family: str, scratch: Path) -> dict:
    out = scratch / "run"
    args = ["--config", str(CONFIGS / "nano.toml"), "--steps", "100", "--min_step_s", "0.2", "--eval_every", "50",
            *FAMILIES[family], "--out", str(out)]
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}
    with open(scratch / "stdout", "w") as so, open(scratch / "stderr", "w") as se:
        launcher = subprocess.Popen([sys.executable, "-m", "mecefo.launch", *args], stdout=so, stderr=se, env=env,
                                    cwd=ROOT, start_new_session=True)
        status, stopped = out / "replicas" / "rank1.status", []
        while launcher.poll() is None and time.monotonic() - t0 < 240:
            words = status.read_text().split() if status.exists() else []
            if words[:1] == ["step"] and int(words[1]) >= STALL_AT:
                stopped = _replica_pids(1)
                for pid in stopped:
                    os.kill(pid, signal.SIGSTOP)
                break
            time.sleep(0.02)
        at = int(words[1]) if stopped else None
        time.sleep(STALL_S)
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        try:
            code = launcher.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            code = None
    stdout, stderr = (scratch / "stdout").read_text(), (scratch / "stderr").read_text()
    last = (stdout.strip().splitlines() or ["(none)"])[-1] if code == 0 else (stderr.strip().splitlines() or ["(none)"])[-1]
    result = {"family": family, "exit": code, "stopped_at_step": at, "processes_stopped": len(stopped), "last_line": last,
              "seconds": time.monotonic() - t0}
    if code == 0:
        summary = json.loads((out / "summary.json").read_text())
        left = summary["backend"]["left_behind"]
        rows = [json.loads(line)["step"] for line in (out / "replicas" / "rank1.jsonl").read_text().splitlines()]
        result |= {"left_behind": left, "rank1_last_step": max(rows), "identical": summary["rank_agreement"]["identical"],
                   "ok": [x["rank"] for x in left] == [1] and max(rows) == left[0]["woke_at_step"]
                   and "left behind: rank 1" in last and summary["rank_agreement"]["identical"]}
    else:
        result["ok"] = False
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="launches per family")
    args = parser.parse_args(argv)
    runs = []
    for family in FAMILIES:
        for _ in tqdm(range(args.runs), desc=family, disable=not sys.stderr.isatty()):
            with tempfile.TemporaryDirectory(prefix="stall-") as scratch:
                runs.append(one(family, Path(scratch)))
            r = runs[-1]
            print(f"{family}: exit {r['exit']}, stopped at step {r['stopped_at_step']}, ok {r['ok']}: {r['last_line']}",
                  flush=True)
    summary = {f: {"launches": sum(r["family"] == f for r in runs), "exit_0": sum(r["family"] == f and r["exit"] == 0 for r in runs),
                   "ok": sum(r["family"] == f and r["ok"] for r in runs)} for f in FAMILIES}
    path = RESULTS / "chaos" / "stall-past-end.json"
    atomic_write_json(path, {"stall_at_step": STALL_AT, "stall_s": STALL_S, "runs": runs, "summary": summary,
                             "git_commit": git_commit(), "packages": package_versions()})
    for f, v in summary.items():
        print(f"{f}: {v['exit_0']} of {v['launches']} launches exit 0, {v['ok']} with rank 1 left behind and named")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
