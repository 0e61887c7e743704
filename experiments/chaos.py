"""The chaos harness: randomized real failures on the torchft backend, and the invariants every run must keep.

    python -m experiments.chaos [--quick]

Each schedule is one `mecefo.launch --chaos SEED:RATE` run of nano (mecefo.chaos draws its events: kills of one
rank, of several at once, of a healing rank, of the rank that evaluates and writes, of the rank whose store the
next quorum uses, during a checkpoint write, kills the launcher did not plan, stalled ranks, stalls longer than
torchft's timeouts, a stall that outlasts the run, the lighthouse killed and restarted, every rank at once), on
one-process replicas (3 or 4 ranks), on replica groups of 2 processes with FSDP2 inside (3 groups), and on a disk
that fills (one-process replicas writing to a small tmpfs; skipped, with the reason, where this machine cannot mount
one). Every heal and every checkpoint write is held 0.3 s, as a larger model's would take, so that the events aimed
at them can land; two checkpoints are kept. Each run is checked for:
  completed     the launch exits 0; or, when every rank was down at once, exits 3 naming it with the
                checkpoint readable (if one was written yet), and `--resume` (without chaos) then completes the
                run, from the checkpoint or from the start; before that resume the newest checkpoint's largest
                file is torn (cut to a third) where an earlier one is kept, and the resume must say that it
                skipped it and go on from the earlier one (`skipped_torn`); on the full disk, the launch stops at
                the first write that cannot succeed (exit 3, its line naming ENOSPC, no replica restarted for it:
                `disk`), and `--resume` after the disk is given room completes the run;
  once          every step 1..S committed, by every replica that committed it at most once and in order,
                the replicas agreeing on its loss and failed set (read from each replica's own rows);
  identical     the replicas that finished hold identical parameters and subspaces (their own summaries' digests);
  rejoined      every restarted replica wrote a committed row of its own before the end, or the summary
                (backend.not_rejoined) and the launcher's last line say which did not and what it was doing;
  all_down      where the launcher stopped because every replica was dead, its events show that no rank held
                the run's state then (each had been killed, or had not trained since its restart);
  left          every replica the summary names as left behind (woke after the run had finished without it) was
                stopped by a stall, and the launcher's last line names it;
  twin          the loss curve equals a simulated backend's replaying the run's failed_steps.json (relative
                TWIN_RTOL; the largest deviation is recorded): the local one's (one process, the same plans summed
                in another order), and, on every EXACT_EVERY-th schedule and wherever the local twin is beyond
                TWIN_RTOL, the torch backend's (torchrun, a process per data-parallel rank), which sums the same
                per-rank gradients in an all-reduce as torchft does and then decides. Measured on the default
                profile: the torch twin within 1.9e-7 (0.0 on half of 10 runs), the local one within 5e-5 but
                on one schedule (seed 23: 2.1e-4 at one step of 150, where the torch twin was within 2.2e-6,
                the local summation order amplified by training).
The merge's own refusals (replicas disagreeing, a step committed twice or never, different final parameters) count as
violations. A run that does not end within its time limit, or ends otherwise, is lost. Measured: restart-to-rejoin and
kill-to-next-step times (the launcher's, from its events and the committed rows), with the restart's phases
(process start until the replica waits for a quorum, then until it trains).
Each schedule's result is cached under results/chaos/runs/ by its parameters and the library's source (a
change to src/mecefo reruns it). Writes results/chaos/chaos-<profile>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mecefo.errors import TrainingStopped, UsageError
from mecefo.records import atomic_write_json, git_commit, package_versions, read_jsonl

from .common import CONFIGS, RESULTS, ROOT, guarded

PROFILES = {"quick": {"single": 2, "groups": 1, "disk": 0}, "default": {"single": 50, "groups": 20, "disk": 3}}
# the full disk: a tmpfs of DISK_BYTES of which all but DISK_ROOM_BYTES is taken by a filler (the launch fills the rest
# near its third checkpoint: a nano checkpoint is 0.89 MB), removed once the launch has stopped on it
DISK_BYTES, DISK_ROOM_BYTES = 16 << 20, 2_600_000
# The torchft run against its simulated twins. The local backend batches pieces across ranks, so its sums differ in
# order from an all-reduce's and training amplifies the difference: the torch backend itself deviates from the local
# one by up to 1.3e-5 on a 100-step run with two ranks down at once (tests/test_ft.py's twin test, measured), while
# torchft equals the torch backend bit for bit there. A defect of the kinds looked for (a step applied twice or not at
# all, a heal that drops a piece of state) moves the loss by far more than that, and does not come back.
TWIN_RTOL = 1e-4
EXACT_EVERY = 5  # one-process schedules whose seed is a multiple of this also get a torch-backend twin
HOLD_S = "0.3"  # every heal and checkpoint write held this long (MECEFO_FT_HEAL_DELAY_S, MECEFO_CHECKPOINT_DELAY_S)
# mecefo.replica_records.recovery_times: every kill and restart, and those whose interval met no stall or lighthouse outage
TIMINGS = ("restart_to_rejoin_s", "kill_to_step_s", "restart_to_rejoin_clear_s", "kill_to_step_clear_s")
TARGETS = {"rejoin_p95_s": {"one-process": 5.0, "groups of 2": 10.0}, "kill_to_step_p95_s": 1.5}


@dataclass(frozen=True)
class Schedule:
    seed: int
    ranks: int
    group_size: int
    steps: int
    min_step_s: float
    rate: float  # chaos events per minute
    limit_s: float  # a run not finished by then is lost
    disk: bool = False  # the run's folder on a disk that fills (a small tmpfs)

    @property
    def family(self) -> str:
        return "full disk" if self.disk else "one-process" if self.group_size == 1 else f"groups of {self.group_size}"

    def args(self) -> list[str]:
        shard = ["--shard", "fsdp", "--group_size", str(self.group_size)] if self.group_size > 1 else []
        return ["--config", str(CONFIGS / "nano.toml"), "--ranks", str(self.ranks), "--steps", str(self.steps),
                "--eval_every", str(self.steps // 4), "--checkpoint_every", "10", "--keep_checkpoints", "2", *shard]


def schedules(profile: str) -> list[Schedule]:
    counts = PROFILES[profile]
    single = [Schedule(i, 3 + i % 2, 1, 150, 0.2, 12.0, 300.0) for i in range(counts["single"])]
    groups = [Schedule(1000 + i, 3, 2, 100, 0.3, 8.0, 480.0) for i in range(counts["groups"])]
    disk = [Schedule(2000 + i, 3, 1, 150, 0.2, 12.0, 300.0, disk=True) for i in range(counts["disk"])]
    return single + groups + disk


def source_hash() -> str:
    """The library's source: a cached result is reused only for the code that produced it."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "src" / "mecefo").rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1",
            "MECEFO_FT_HEAL_DELAY_S": HOLD_S, "MECEFO_FT_HEAL_DELAY_EVERY": "1", "MECEFO_CHECKPOINT_DELAY_S": HOLD_S}


def _launch(args: list[str], out: Path, limit_s: float, logs: Path) -> tuple[int | None, str, str, float]:
    """mecefo.launch in its own session (so that a lost run's replicas go with it), its output in logs/; (status or
    None if it ran past limit_s, stdout, stderr, seconds)."""
    t0 = time.time()
    with open(logs / f"{out.name}.stdout", "w") as so, open(logs / f"{out.name}.stderr", "w") as se:
        proc = subprocess.Popen([sys.executable, "-m", "mecefo.launch", *args, "--out", str(out)], stdout=so, stderr=se,
                                env=_env(), cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, (logs / f"{out.name}.stdout").read_text(), (logs / f"{out.name}.stderr").read_text(), time.time() - t0


def _twin(s: Schedule, out: Path, scratch: Path, backend: str = "local") -> float:
    """The largest relative loss deviation of the run from a simulated backend replaying its failed steps: the local
    one (in this process), or the torch one (torchrun, a process per rank)."""
    from mecefo.train import main as train_main

    twin = scratch / f"twin-{backend}"
    args = s.args()
    if s.group_size > 1:  # (the flags of the groups dropped, with their values: not another flag's value)
        args = args[:args.index("--shard")] + args[args.index("--shard") + 4:]
    args = [*args, "--quiet", "--out", str(twin), "--failures", f"steps:{out / 'failed_steps.json'}"]
    if backend == "local":
        code = train_main(args)
        if code == 130:  # Ctrl-C reached the twin (mecefo.train turns it into its exit status): stop the harness
            raise KeyboardInterrupt
        ok = code == 0
    else:
        ok = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(s.ranks),
                             "-m", "mecefo.train", *args, "--backend", "torch"], cwd=ROOT,
                            env={k: v for k, v in _env().items() if k != "MECEFO_CHECKPOINT_DELAY_S"},
                            capture_output=True, timeout=s.limit_s).returncode == 0
    if not ok:
        raise RuntimeError(f"the {backend} twin did not train")
    ours, theirs = read_jsonl(out / "metrics.jsonl")[1:], read_jsonl(twin / "metrics.jsonl")[1:]
    if [r["down"] for r in ours] != [r["down"] for r in theirs]:
        return float("inf")
    return max((abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ours, theirs, strict=True)
                if a["loss"] is not None), default=0.0)


def _phases(events: list[dict]) -> list[dict]:
    """For each restart (within its window: mecefo.replica_records.windows): seconds until the replica waited for a live peer
    (its process started, imported, built its model) and until it trained (quorum, heal, first step)."""
    from mecefo.replica_records import windows

    found = []
    for e, end in windows(events, ("start",)):
        if e["why"] == "initial":
            continue
        seen = {}
        for x in events:
            if x["kind"] == "status" and x.get("rank") == e["rank"] and e["time"] < x["time"] < end:
                seen.setdefault(x["status"], x["time"])
        trained = min((seen[k] for k in ("step", "evaluating", "checkpointing") if k in seen), default=None)
        found.append({"rank": e["rank"], "forked": e.get("forked", 0),
                      "to_waiting_s": seen["waiting"] - e["time"] if "waiting" in seen else None,
                      "to_training_s": trained - e["time"] if trained is not None else None})
    return found


# the merge's refusals (mecefo.replica_records.merge): the records are not one run, an invariant broken, not a lost run
MERGE_REFUSALS = {"replicas disagree": "once", "committed a step twice": "once", "were never committed": "once",
                  "ended with different parameters": "identical"}


def _tear_newest(out: Path) -> dict | None:
    """Tear the newest checkpoint's largest file (cut to a third: a bad disk, a copy cut short) where an earlier one is
    kept to resume from instead; what was torn."""
    from mecefo import checkpoint

    if not (out / "checkpoint").exists() or not checkpoint.earlier(out / "checkpoint"):
        return None
    newest = (out / "checkpoint").resolve()
    target = max((p for p in newest.iterdir() if p.is_file() and p.name != checkpoint.DIGEST), key=lambda p: p.stat().st_size)
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
    return {"folder": newest.name, "file": target.name}


def _disk(scratch: Path) -> tuple[Path | None, str | None]:
    """A tmpfs of DISK_BYTES at scratch/disk with all but DISK_ROOM_BYTES taken by scratch/disk/filler; (the folder, None)
    or (None, why it cannot be had here)."""
    disk = scratch / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES // 1024}k", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"cannot mount a tmpfs here ({(r.stderr.strip() or 'mount failed').splitlines()[0]})"
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - DISK_ROOM_BYTES))
    return disk, None


def check(s: Schedule, scratch: Path) -> dict:
    """One schedule: launch it, resume it if every rank went down at once (tearing the newest checkpoint first) or the
    disk filled (giving it room first), and check the invariants, each read from the replicas' own files (their rows
    and summaries) rather than from the launcher's merge of them."""
    out = scratch / "run"
    result = {"schedule": asdict(s), "family": s.family, "seconds": 0.0, "resumed": False}
    if s.disk:
        disk, why = _disk(scratch)
        if disk is None:
            return result | {"lost": None, "skipped": why}
        out = disk / "run"
        result["disk"] = {"filled": False}
    try:
        return _check(s, scratch, out, result)
    finally:
        if s.disk:  # (its records kept beside the scratch's, to be read if the run is lost: the tmpfs goes)
            shutil.copytree(out, scratch / "run", ignore=shutil.ignore_patterns("*.pt", "*.distcp", "filler"),
                            dirs_exist_ok=True)
            subprocess.run(["umount", "-l", str(scratch / "disk")], capture_output=True)


def _check(s: Schedule, scratch: Path, out: Path, result: dict) -> dict:
    from mecefo import checkpoint

    chaos = ["--chaos", f"{s.seed}:{s.rate:g}", "--min_step_s", f"{s.min_step_s:g}"] + ([] if s.disk else ["--quiet"])
    code, stdout, stderr, seconds = _launch([*s.args(), *chaos], out, s.limit_s, scratch)  # (the full disk: its log read)
    result["seconds"] = seconds
    last = (stderr.strip().splitlines() or stdout.strip().splitlines() or ["(no output)"])[-1]
    claims = []  # the launcher's "every replica is dead" stops, checked against its events
    torn_ok = []  # each resume after a torn checkpoint said it skipped it
    for _ in range(3):  # a launch stops on every rank down, or on the full disk; then --resume (without chaos)
        full = code == 3 and "No space left on device" in last and result.get("disk", {}).get("filled") is False
        if code == 3 and "replicas are dead" in last:
            claims.append(json.loads((out / "events.json").read_text())["events"])
            result["all_down_checkpoint_step"] = None  # none yet: --resume starts over
            if (out / "checkpoint").exists():
                try:
                    result["all_down_checkpoint_step"] = checkpoint.read(out / "checkpoint")["step"]
                except UsageError as e:
                    return result | {"lost": f"every rank down, and the checkpoint is not readable: {e}"}
            result["torn"] = _tear_newest(out)
        elif full:  # the disk filled: stopped at once (no replica restarted for it), then given room
            result["disk"] = {"filled": True, "last_line": last, "restarted": " crashed (" in stdout,
                              "verified": "verified" in last or "No checkpoint was written yet" in last}
            (out.parent / "filler").unlink()
        else:
            break
        code, stdout, stderr, more = _launch([*s.args(), "--min_step_s", f"{s.min_step_s:g}", "--quiet", "--resume"],
                                             out, s.limit_s, scratch)
        result |= {"resumed": True, "seconds": result["seconds"] + more}
        if result.get("torn"):
            torn_ok.append(any(line.startswith("note: resuming from the checkpoint of step") and result["torn"]["folder"]
                               in line and result["torn"]["file"] in line for line in stderr.splitlines()))
            result["torn"] = None
        last = (stderr.strip().splitlines() or stdout.strip().splitlines() or ["(no output)"])[-1]
    refused = next((name for text, name in MERGE_REFUSALS.items() if text in last), None)
    if code == 3 and refused:
        events = json.loads((out / "events.json").read_text())["events"] if (out / "events.json").exists() else []
        return result | {"lost": None, "violations": [refused], "invariants": {refused: False}, "last_line": last,
                         "twin_max_rel": None, "torch_twin_max_rel": None, **{k: [] for k in TIMINGS},
                         "not_rejoined": [], "phases": [], "chaos": _chaos_events(events), "crashes": 0}
    if code != 0:
        return result | {"lost": f"not finished within {s.limit_s:g} s" if code is None else f"exit {code}: {last}"}
    summary = json.loads((out / "summary.json").read_text())
    events = json.loads((out / "events.json").read_text())["events"]
    backend = summary["backend"]
    missing, last_line = backend["not_rejoined"], stdout.strip().splitlines()[-1]
    twin = _twin(s, out, scratch)
    exact = _twin(s, out, scratch, "torch") if s.seed % EXACT_EVERY == 0 or twin > TWIN_RTOL else None
    left = backend["left_behind"]
    stalled = {e["rank"] for e in events if e["kind"] == "stall"}
    invariants = {
        "once": _each_step_once(out, s, events),
        "identical": _replicas_identical(out),
        "rejoined": sorted((m["rank"], m["restarted_at_step"]) for m in missing) == _not_back(events, out)
        and all(f"rank {m['rank']} (restarted" in last_line for m in missing),
        "twin": exact <= TWIN_RTOL if exact is not None else twin <= TWIN_RTOL,
        "all_down": all(_nobody_held_state(claim) for claim in claims),
        "left": all(x["rank"] in stalled and f"rank {x['rank']} (stalled, woke at step" in last_line for x in left),
        "skipped_torn": all(torn_ok),
        "disk": not s.disk or (result["disk"]["filled"] and not result["disk"]["restarted"] and result["disk"]["verified"]),
    }
    return result | {
        "lost": None, "invariants": invariants, "violations": [k for k, ok in invariants.items() if not ok],
        "twin_max_rel": twin, "torch_twin_max_rel": exact, **{k: backend["timings"][k] for k in TIMINGS},
        "not_rejoined": missing, "left_behind": left, "torn_resumes": len(torn_ok),
        "causes": backend["timings"]["causes"],
        "phases": _phases(events), "chaos": _chaos_events(events),
        "crashes": sum(e["kind"] == "crash" for e in events), "superseded_rows": backend.get("superseded_rows", []),
        "fork_server_deaths": sum(e["kind"] == "fork_server_died" for e in events),
        "last_line": last_line}


def _chaos_events(events: list[dict]) -> list[dict]:
    return [{k: e.get(k) for k in ("chaos", "outcome", "detail", "step")} for e in events if e["kind"] == "chaos"]


def _replica_rows(out: Path) -> dict[int, list[dict]]:
    """Each replica's own committed rows (a torn line dropped, as the merge does)."""
    from mecefo.records import read_rows

    found = {}
    for path in (out / "replicas").glob("rank*.jsonl"):
        rank = path.name[len("rank"):-len(".jsonl")]
        if rank.isdigit():
            found[int(rank)] = [r for r in read_rows(path)[0] if r.get("step")]
    return found


def _each_step_once(out: Path, s: Schedule, events: list[dict]) -> bool:
    """Every step 1..S committed; each replica commits each step at most once, in order (a heal jumps ahead, never
    back); replicas that committed a step agree on its loss and on who was down, but for a version of a step that died
    with the replicas that committed it alone (mecefo.replica_records.lineage, the merge's rule), and each such row is
    confirmed by the launcher's own events: its replica was killed or died after writing it and before its next heal
    (the history it was on died with its process). Stricter than the merge, which also takes a live replica's one
    lone commit (healed from the others' redo, alive): here that is a violation, kept to be read."""
    from mecefo.replica_records import lineage, read_replicas

    own, healed, finals, _ = read_replicas(out, s.ranks)
    own = {r: [row for row in rows if row.get("step")] for r, rows in own.items()}
    try:
        rows, superseded = lineage(own, healed, {f["backend"]["rank"] for f in finals})
    except TrainingStopped:
        return False
    deaths = {}
    for e in events:
        if e["kind"] in ("kill", "down") and e.get("rank") is not None:
            deaths.setdefault(e["rank"], []).append(e["time"])
    for x in superseded:
        mine = own[x["rank"]]
        t = next(row["backend"]["time"] for row in mine if row["step"] == x["step"])
        t_heal = min((h["time"] for h in healed if h["rank"] == x["rank"] and h["time"] > t), default=float("inf"))
        if not any(t < d < t_heal for d in deaths.get(x["rank"], [])):
            return False
    return sorted(k for k in rows if k > 0) == list(range(1, s.steps + 1))


def _replicas_identical(out: Path) -> bool:
    """The replicas that finished hold the same state: their own summaries' digests (parameters and subspaces),
    compared here rather than taken from the merge's verdict."""
    digests = [json.loads(p.read_text())["backend"]["digest"] for p in (out / "replicas").glob("rank*.summary.json")]
    return bool(digests) and all(d == digests[0] for d in digests)


def _nobody_held_state(events: list[dict]) -> bool:
    """The launcher stopped saying every replica was dead: by its events, each rank's last life had ended (killed, or
    died) or had not trained (a restart that never reached a training status)."""
    for rank in {e["rank"] for e in events if e.get("rank") is not None}:
        mine = [e for e in events if e.get("rank") == rank and e["kind"] in ("start", "kill", "down", "status")]
        lives = [i for i, e in enumerate(mine) if e["kind"] == "start"]
        last_life = mine[lives[-1]:] if lives else mine
        if any(e["kind"] in ("kill", "down") for e in last_life):
            continue
        if any(e["kind"] == "status" and e["status"] in ("step", "evaluating", "checkpointing") for e in last_life):
            return False
    return True


def _not_back(events: list[dict], out: Path) -> list[tuple[int, int]]:
    """(rank, step) of the restarts after which the replica wrote no committed row of its own (read from its rows file,
    not from the merged records) and was not killed or restarted again, nor the run resumed: what the launcher must
    report as not rejoined."""
    rows = _replica_rows(out)
    found = []
    for i, e in enumerate(events):
        if e["kind"] != "start" or e["why"] == "initial":
            continue
        again = any(x["kind"] == "resume" or (x.get("rank") == e["rank"] and x["kind"] in ("kill", "down", "start"))
                    for x in events[i + 1:])
        back = any(r["backend"]["time"] > e["time"] for r in rows.get(e["rank"], []))
        if not again and not back:
            found.append((e["rank"], e["step"]))
    return sorted(found)


def run_cached(s: Schedule, code: str) -> dict:
    key = hashlib.sha256(json.dumps([asdict(s), code, HOLD_S]).encode()).hexdigest()[:12]
    path = RESULTS / "chaos" / "runs" / f"{s.family.replace(' ', '-')}-{s.seed}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    scratch = Path(tempfile.mkdtemp(prefix="chaos-"))
    try:
        result = check(s, scratch) | {"source": code}
    except KeyboardInterrupt:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    except Exception as e:  # the harness's own failure is a lost run too, not a crash of the whole harness
        result = {"schedule": asdict(s), "family": s.family, "lost": f"harness: {type(e).__name__}: {e}"}
    if result.get("lost") or result.get("violations"):  # kept to be read: the run's folder, replicas' logs, twins
        kept = RESULTS / "chaos" / "kept" / path.stem
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(scratch, kept, ignore=shutil.ignore_patterns("*.pt"), dirs_exist_ok=True)
        result["kept"] = str(kept.relative_to(ROOT) if kept.is_relative_to(ROOT) else kept)
    shutil.rmtree(scratch, ignore_errors=True)
    atomic_write_json(path, result)
    return result


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    v = np.asarray(values)
    return {"n": len(v), "p50": float(np.percentile(v, 50)), "p95": float(np.percentile(v, 95)), "max": float(v.max())}


def _by_cause(runs: list[dict]) -> dict:
    """Each timing's quantiles by the death behind it (the chaos kind, or an unplanned death), and how many of them
    met a stall or a lighthouse outage: what each tail is made of."""
    found: dict = {}
    for key in ("kill_to_step_s", "restart_to_rejoin_s"):
        groups: dict = {}
        for r in runs:
            for t, c in zip(r.get(key, []), r.get("causes", {}).get(key, [])):
                groups.setdefault(c["why"].removeprefix("chaos: "), []).append((t, c["clear"]))
        found[key] = {why: _quantiles([t for t, _ in v]) | {"not_clear": sum(not c for _, c in v)}
                      for why, v in sorted(groups.items())}
    return found


def summarise(runs: list[dict]) -> dict:
    families = sorted({r["family"] for r in runs}, key=lambda f: (f != "one-process", f))
    done = [r for r in runs if not r["lost"] and not r.get("skipped")]
    kinds: dict = {}
    for r in done:
        for e in r["chaos"]:
            kinds.setdefault(e["chaos"], {}).setdefault(e["outcome"], 0)
            kinds[e["chaos"]][e["outcome"]] += 1
    per_family = {}
    for f in families:
        mine = [r for r in done if r["family"] == f]
        per_family[f] = {
            "schedules": sum(r["family"] == f for r in runs), "lost": sum(r["family"] == f and bool(r["lost"]) for r in runs),
            "skipped": sorted({r["skipped"] for r in runs if r["family"] == f and r.get("skipped")}),
            "left_behind": sum(len(r.get("left_behind", [])) for r in mine),
            "torn_resumes": sum(r.get("torn_resumes", 0) for r in mine),
            "violations": sum(len(r["violations"]) for r in mine), "resumed_after_all_down": sum("all_down_checkpoint_step" in r for r in mine),  # (not a full disk's resume)
            **{k: _quantiles([t for r in mine for t in r.get(k, [])]) for k in TIMINGS},
            "restart_to_waiting_s": _quantiles([p["to_waiting_s"] for r in mine for p in r["phases"]
                                                if p["to_waiting_s"] is not None]),
            "not_rejoined": sum(len(r["not_rejoined"]) for r in mine), "crashes": sum(r["crashes"] for r in mine),
            "fork_server_deaths": sum(r.get("fork_server_deaths", 0) for r in mine),
            "restarts_not_forked": sum(p.get("forked", 1) == 0 for r in mine for p in r["phases"]),
            "superseded_rows": sum(len(r.get("superseded_rows", [])) for r in mine),
            "twin_max_rel": max((r["twin_max_rel"] for r in mine if r["twin_max_rel"] is not None), default=None),
            "torch_twin_max_rel": max((r["torch_twin_max_rel"] for r in mine if r.get("torch_twin_max_rel") is not None),
                                      default=None),
            "torch_twins": sum(r.get("torch_twin_max_rel") is not None for r in mine),
            "by_cause": _by_cause(mine),
            "seconds": sum(r.get("seconds", 0) for r in runs if r["family"] == f)}
    return {"families": per_family, "events": kinds,
            "lost": [{"seed": r["schedule"]["seed"], "why": r["lost"]} for r in runs if r["lost"]],
            "violated": [{"seed": r["schedule"]["seed"], "violations": r["violations"]} for r in done if r["violations"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI-sized profile")
    args = parser.parse_args(argv)
    profile = "quick" if args.quick else "default"
    code = source_hash()
    plan = schedules(profile)
    runs = []
    for s in tqdm(plan, desc=f"chaos ({profile})", disable=not sys.stderr.isatty()):
        runs.append(run_cached(s, code))
        r = runs[-1]
        if not sys.stderr.isatty():
            print(f"chaos {s.family} seed {s.seed}: " + (f"LOST ({r['lost']})" if r["lost"] else
                  f"skipped ({r['skipped']})" if r.get("skipped") else
                  f"{len(r['chaos'])} events, violations {r['violations'] or 'none'}, rejoin {r['restart_to_rejoin_s']}"),
                  flush=True)
    result = {"profile": profile, "source": code, "targets": TARGETS, "twin_rtol": TWIN_RTOL, "exact_every": EXACT_EVERY,
              "hold_s": float(HOLD_S),
              "runs": runs, "summary": summarise(runs), "git_commit": git_commit(), "packages": package_versions()}
    path = RESULTS / "chaos" / f"chaos-{profile}.json"
    atomic_write_json(path, result)
    for f, v in result["summary"]["families"].items():
        print(f"{f}: {v['schedules']} schedules, {v['lost']} lost, {v['violations']} violations; restart -> rejoin "
              f"p95 {v['restart_to_rejoin_s'].get('p95', float('nan')):.2f} s; kill -> step p95 "
              f"{v['kill_to_step_s'].get('p95', float('nan')):.2f} s")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
