"""The run's records from its replicas' files (mecefo.ft.ReplicaFiles writes them; mecefo.launch reads them):
where a resume starts (resume_point: the checkpoint's step, the rows after it dropped), which rows count (lineage:
one row per step, from the replicas that committed it), the merged metrics.jsonl, failed_steps.json, events.json
and summary.json (merge), and the recovery timings of the launcher's events (recovery_times, not_rejoined)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import failures
from .errors import TrainingStopped
from .records import atomic_write_json, atomic_write_text, git_commit, read_rows
from .timing import rows_total


def resume_point(out: Path, cfg) -> int:
    """The checkpoint's step (its config must be this run's), or 0 for a run stopped before its first checkpoint
    (it starts over, as mecefo.train's); the replicas' rows and heals after it, and their summaries, are dropped, so
    that the steps redone are not counted twice."""
    from . import checkpoint
    from .runfiles import holds_run_of

    ckpt = out / checkpoint.NAME
    step = checkpoint.load(ckpt, cfg.hash())["step"] if ckpt.exists() or not holds_run_of(out, cfg) else 0
    for path in [*(out / "replicas").glob("rank*.jsonl")]:  # rows and heals; a torn line (a kill mid-write) dropped
        keep = [row for row in read_rows(path)[0] if row.get("step", row.get("healed_at_step", 0)) <= step]
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in keep))
    for path in [*(out / "replicas").glob("rank*.summary.json"), *(out / "replicas").glob("rank*.left.json")]:
        path.unlink()
    return step


def merge(out: Path, cfg, events: list, t0: float | None = None) -> dict:
    """metrics.jsonl, failed_steps.json, events.json and summary.json from the replicas' files: the metrics
    rows and the summary in the trainer's schema (the summary's "backend" key holds the kills and the
    recovery timings). events: the supervisor's (none for replicas started by hand); t0: when the launch
    started (None: the wall time runs from the first committed step to the last)."""
    n, steps = cfg.cluster.ranks, cfg.train.steps
    own, healed, finals, torn = read_replicas(out, n)
    rows, superseded = lineage(own, healed, {f["backend"]["rank"] for f in finals})
    left = left_behind(out)
    missing = [s for s in range(1, steps + 1) if s not in rows]
    if missing:
        raise TrainingStopped(f"steps {missing[:5]} were never committed")
    if not finals:
        raise TrainingStopped("no replica wrote its summary")
    identical = all(f["backend"]["digest"] == finals[0]["backend"]["digest"] for f in finals)
    ordered = [rows[s] for s in range(0 if 0 in rows else 1, steps + 1)]
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(row) + "\n" for row in ordered))
    failed = [rows[s]["down"] for s in range(1, steps + 1)]  # as it happened (the policy's "failed" may differ)
    atomic_write_json(out / "failed_steps.json", {"n_ranks": n, "failed": failed})
    timings = recovery_times(events, rows, healed)
    atomic_write_json(out / "events.json", {"events": events, "healed": healed, "timings": timings})
    times = [rows[s]["backend"]["time"] for s in range(1, steps + 1)]
    missing = not_rejoined(events, rows, max(times))
    happened = failures.logged(n, [frozenset(f) for f in failed], cfg.cluster.seconds_per_step)
    summary = finals[0] | {
        "final_train_loss": rows[steps]["loss"], "tokens_trained": rows[steps]["tokens_trained"],
        "rank_agreement": {"ranks_checked": [f["backend"]["rank"] for f in finals], "identical": identical},
        "failure_schedule": {"fraction_failed": happened.fraction_failed(), "events": happened.failure_events()},
        "wall_time_s": time.time() - t0 if t0 is not None else max(times) - min(times), "git_commit": git_commit(),
        "backend": {"name": "torchft", "kills": sum(e["kind"] == "kill" for e in events), "timings": timings,
                    "not_rejoined": missing, "left_behind": left, "torn_lines_dropped": torn,
                    "superseded_rows": superseded,
                    "chaos": [e for e in events if e["kind"] == "chaos"],
                    "replica_timing": {str(f["backend"]["rank"]): f.get("timing") for f in finals}},
        "timing": rows_total([rows[s]["timing"] for s in range(1, steps + 1) if "timing" in rows[s]])}
    atomic_write_json(out / "summary.json", summary)
    if not identical:
        raise TrainingStopped(f"the live replicas ended with different parameters (ranks {summary['rank_agreement']})")
    return summary


def left_behind(out: Path) -> list[dict]:
    """The replicas that woke after the run had finished without them and stopped without training
    (mecefo.ft.ReplicaFiles.left_behind): rank, the step each woke at, the run's step then."""
    return sorted((json.loads(p.read_text()) for p in (out / "replicas").glob("rank*.left.json")), key=lambda x: x["rank"])


def read_replicas(out: Path, n: int) -> tuple[dict[int, list[dict]], list[dict], list[dict], int]:
    """The replicas' files under OUT/replicas: each rank's committed rows, every heal ({rank, healed_at_step, time}),
    the summaries of those that finished, and how many torn lines were dropped (a line torn by a kill mid-write: its
    step is in the other replicas' rows, and a step missing from all of them is refused by the merge)."""
    own, healed, torn = {}, [], 0
    for r in range(n):
        found, dropped = read_rows(out / "replicas" / f"rank{r}.heals.jsonl")
        healed, torn = healed + [{"rank": r, **h} for h in found], torn + dropped
        own[r], dropped = read_rows(out / "replicas" / f"rank{r}.jsonl")
        torn += dropped
    finals = [json.loads(p.read_text()) for p in sorted((out / "replicas").glob("rank*.summary.json"))]
    return own, healed, finals, torn


def lineage(own: dict[int, list[dict]], healed: list[dict], finished: set[int]) -> tuple[dict[int, dict], list[dict]]:
    """The run's rows (step -> row) from each replica's committed rows (in the order it wrote them), its heals and the
    replicas that finished (wrote their summary); and the rows superseded ({rank, step}).

    torchft agrees on a commit within a replica group, not across groups, and a restarted lighthouse can give a replica
    a quorum of its own before it hears from the others: a replica can commit steps the others never saw (a dying
    peer's last message reached it alone; a lone quorum) and die before any peer heals from it. The others redo those
    steps without it, and it, restarted, heals: its rows of them belong to a history that died with it. The run's
    history is the one the finished replicas hold, traced back from the state each ended with: a row follows the
    same replica's previous row, or, after a heal to step s, the rows of step s of the peers it could have healed from:
    those in its quorum (the peer still held that row's state at the heal, and its next row is the same as this
    replica's next one); failing that, a peer's row of step s written before the heal whose next row is the same as
    this replica's, or whose state went on in that peer; failing that, any. Where the replicas' rows of a step disagree
    (loss, or who was down or failed), the versions outside that history are superseded; but a live process (a row's
    "life" names it) that lost more than one step to the other history before one heal of its own trained a second
    history beside it (a commit that reached one replica alone loses one step): refused. Exactly one version must be
    in the history, else two histories went on and the records are refused as not one run, as they are if a
    replica's rows in it do not go up step by step."""
    mine = {r: [row for row in found if row["step"] > 0] for r, found in own.items()}
    heals = {}
    for h in healed:
        heals.setdefault(h["rank"], []).append(h)
    t = lambda row: row["backend"]["time"]  # noqa: E731
    versions = {}  # step -> the rows (rank, index, row) of it
    for q, rows in mine.items():
        for j, x in enumerate(rows):
            versions.setdefault(x["step"], []).append((q, j, x))

    def after(q: int, j: int) -> float:  # when replica q wrote its row after row j (inf: none)
        return t(mine[q][j + 1]) if j + 1 < len(mine[q]) else float("inf")

    def held(q: int, j: int) -> bool:
        """Row j's state stayed replica q's until its next row (the same process, no heal between), or it finished
        holding it."""
        if j + 1 == len(mine[q]) and q not in finished:
            return False  # it died holding it
        same = j + 1 == len(mine[q]) or mine[q][j]["backend"].get("life") == mine[q][j + 1]["backend"].get("life")
        return same and all(not t(mine[q][j]) < h["time"] < after(q, j) for h in heals.get(q, []))

    def next_is(q: int, j: int, row: dict) -> bool:  # replica q's row after row j is `row`'s step, the same version
        return j + 1 < len(mine[q]) and mine[q][j + 1]["step"] == row["step"] and _same(mine[q][j + 1], row)

    def sources(r: int, i: int) -> list[tuple[int, int]]:
        """The rows the state behind row i of replica r came from (i = len(mine[r]): the state it finished with)."""
        row = mine[r][i] if i < len(mine[r]) else None
        before, until = t(mine[r][i - 1]) if i else float("-inf"), t(row) if row is not None else float("inf")
        heal = max((h for h in heals.get(r, []) if before < h["time"] < until), key=lambda h: h["time"], default=None)
        if heal is None:
            return [(r, i - 1)] if i else []
        when = heal["time"]
        peers = [(q, j) for q, j, x in versions.get(heal["healed_at_step"], []) if q != r and t(x) < when]
        went_on = [(q, j) for q, j in peers if j + 1 < len(mine[q]) and held(q, j)]
        # in its quorum: the peer held that row's state at the heal, and its next row is this replica's next one
        in_quorum = [(q, j) for q, j in peers
                     if held(q, j) and after(q, j) > when and (row is None or next_is(q, j, row))]
        same_next = [(q, j) for q, j in went_on if row is not None and next_is(q, j, row)]
        return in_quorum or same_next or went_on or peers

    history, todo = set(), [(r, len(mine[r])) for r in finished if r in mine]
    while todo:
        if (key := todo.pop()) not in history:
            history.add(key)
            todo += sources(*key)
    for r, rows in mine.items():
        kept = [x["step"] for i, x in enumerate(rows) if (r, i) in history]
        if any(b <= a for a, b in zip(kept, kept[1:])):
            raise TrainingStopped(f"rank {r} committed a step twice: {kept}")
    first = next((row for found in own.values() for row in found if row["step"] == 0), None)
    rows = {0: first} if first is not None else {}  # the evaluation before training
    lost = []  # the rows outside the run's history
    for step, written in sorted(versions.items()):
        sides = []  # the distinct versions of the step, each with the rows that wrote it
        for r, i, row in written:
            side = next((x for x in sides if _same(x[0][2], row)), None)
            if side is None:
                sides.append(side := [])
            side.append((r, i, row))
        if len(sides) > 1:
            live = [side for side in sides if any((r, i) in history for r, i, _ in side)]
            if len(live) != 1:
                ranks = [side[0][0] for side in sides]
                raise TrainingStopped(f"step {step}: replicas disagree (rank {ranks[0]} vs rank {ranks[1]}), and "
                                      f"{'both' if live else 'neither'} went on")
            lost += [(r, row) for side in sides if side is not live[0] for r, _, row in side]
            written = live[0]
        rows[step] = dict(written[0][2])
        val = next((row["val_loss"] for _, _, row in written if row.get("val_loss") is not None), None)
        if val is not None:  # the replica that evaluates wrote it
            rows[step]["val_loss"] = val
    alive = {}  # (rank, the heal) -> the steps a live process lost to the other history before that heal of its own
    for r, row in lost:
        life = row["backend"].get("life")
        heal = min((h["time"] for h in heals.get(r, []) if h.get("life") == life and h["time"] > t(row)), default=None)
        if life is not None and heal is not None:
            alive.setdefault((r, heal), []).append(row["step"])
    for (r, _), lost_steps in alive.items():
        if len(lost_steps) > 1:  # a commit that went alone is one step; this replica went on: a second history
            raise TrainingStopped(f"step {lost_steps[0]}: rank {r} trained steps {lost_steps[0]}-{lost_steps[-1]} on a "
                                  f"history of its own while the others went on, and then healed from theirs")
    return rows, [{"rank": r, "step": row["step"]} for r, row in lost]


def _same(a: dict, b: dict) -> bool:
    """Two replicas' rows of one step are the same step: the same loss (the exchange's, identical in every member;
    1e-9 for the float's JSON round trip) and the same ranks down and failed."""
    if a["failed"] != b["failed"] or a["down"] != b["down"] or (a["loss"] is None) != (b["loss"] is None):
        return False
    return a["loss"] is None or abs(a["loss"] - b["loss"]) <= 1e-9 * max(1.0, abs(a["loss"]))


def windows(events: list, kinds: tuple) -> list[tuple[dict, float]]:
    """Each event of these kinds with the time its window ends: the rank's next kill, death or start, or the run's
    next resume (a launch that stopped with every rank down), whichever comes first (inf: none)."""
    found = []
    for i, e in enumerate(events):
        if e["kind"] in kinds:
            found.append((e, next((x["time"] for x in events[i + 1:] if x["kind"] == "resume" or (
                x.get("rank") == e["rank"] and x["kind"] in ("kill", "down", "start"))), float("inf"))))
    return found


def disruptions(events: list) -> list[tuple[float, float]]:
    """The intervals in which no recovery can be quick whatever the code does: a rank stalled (SIGSTOP: a straggler
    holds every synchronous step) and the lighthouse down (no quorum forms), as (start, end) times."""
    found, down_since = [], None
    for i, e in enumerate(events):
        if e["kind"] == "stall":  # until its SIGCONT (stall_end; a stall that outlasts the run has no seconds)
            end = next((x["time"] for x in events[i + 1:] if x["kind"] == "stall_end" and x.get("rank") == e["rank"]),
                       e["time"] + e["seconds"] if e.get("seconds") is not None else float("inf"))
            found.append((e["time"], end))
        elif e["kind"] == "lighthouse" and e.get("what") == "killed":
            down_since = e["time"]
        elif e["kind"] == "lighthouse" and down_since is not None:  # restarted (or found dead and restarted)
            found.append((down_since, e["time"]))
            down_since = None
    return found + ([(down_since, float("inf"))] if down_since is not None else [])


def recovery_times(events: list, rows: dict, healed: list) -> dict:
    """Seconds from each kill of a training rank (ours, or a death nobody planned, as the launcher saw it) to the next
    committed step (the run's, before any resume), and from each restart to the first committed step the restarted rank took part in
    (each within its window: before the rank's next kill or start, and before the run's next resume). The `_clear`
    lists keep those whose interval meets no disruption (a stall, the lighthouse down): what recovery itself costs.
    `causes` names, for each entry of the two full lists, the death behind it (the kill's reason, e.g. "chaos:
    multi_kill", or "unplanned") and whether it was clear: what a tail is made of."""
    committed = [rows[s] for s in sorted(rows) if s > 0]
    to_first_step, to_rejoin, clear = [], [], {"kill_to_step_clear_s": [], "restart_to_rejoin_clear_s": []}
    causes = {"kill_to_step_s": [], "restart_to_rejoin_s": []}
    spans = disruptions(events)

    def add(to: list, key: str, start: float, end: float, why: str) -> None:
        to.append(end - start)
        calm = not any(a < end and start < b for a, b in spans)
        if calm:
            clear[key].append(end - start)
        causes[key.replace("_clear", "")].append({"why": why, "clear": calm})

    def reason(e: dict) -> str:
        return e.get("why") or ("unplanned" if e.get("unplanned") else "down")

    resumes = [x["time"] for x in events if x["kind"] == "resume"]
    deaths = [(e["time"], e["rank"], reason(e)) for e in events
              if e["kind"] == "kill" or (e["kind"] == "down" and e.get("rank") is not None)]
    for e in events:
        if not (e["kind"] == "kill" or (e["kind"] == "down" and e.get("unplanned"))):
            continue
        before = [r for r in committed if r["backend"]["time"] < e["time"]]
        if not before or e["rank"] in before[-1]["down"]:
            continue  # it did not train: its death costs no step
        end = min((t for t in resumes if t > e["time"]), default=float("inf"))
        after = [r["backend"]["time"] for r in committed if e["time"] < r["backend"]["time"] < end]
        if after:
            add(to_first_step, "kill_to_step_clear_s", e["time"], after[0], reason(e))
    for e, end in windows(events, ("start",)):
        if e["why"] != "initial":
            after = [r["backend"]["time"] for r in committed if e["time"] < r["backend"]["time"] < end and e["rank"] not in r["down"]]
            if after:
                why = next((w for t, r, w in reversed(deaths) if r == e["rank"] and t <= e["time"]), e["why"])
                add(to_rejoin, "restart_to_rejoin_clear_s", e["time"], after[0], why)
    return {"kill_to_step_s": to_first_step, "restart_to_rejoin_s": to_rejoin, **clear, "causes": causes}


def not_rejoined(events: list, rows: dict, end: float) -> list[dict]:
    """The restarts after which the rank took part in no committed step, and was neither killed nor restarted again
    nor the run resumed: the rank, the step it was restarted at, how long before the run's last step, and its last
    status (starting: its process was still starting; waiting: for a live peer or a quorum; healing)."""
    committed = [rows[s] for s in sorted(rows) if s > 0]
    missing = []
    for e, until in windows(events, ("start",)):
        if e["why"] == "initial" or until < float("inf"):
            continue
        if any(r["backend"]["time"] > e["time"] and e["rank"] not in r["down"] for r in committed):
            continue  # rejoined
        seen = [x["status"] for x in events if x["kind"] == "status" and x.get("rank") == e["rank"] and x["time"] > e["time"]]
        missing.append({"rank": e["rank"], "restarted_at_step": e["step"], "seconds_before_end": end - e["time"],
                        "last_status": seen[-1] if seen else "starting"})
    return missing
