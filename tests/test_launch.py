"""mecefo.launch's bookkeeping on replica files written by hand: the merge into one run's records, what it
refuses, and what a resume drops."""

import json
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.common import CONFIGS
from mecefo import checkpoint
from mecefo import config as config_mod
from mecefo.errors import TrainingStopped, UsageError
from mecefo.replica_records import lineage, merge, resume_point
from mecefo.records import SUMMARY

CFG = config_mod.load(CONFIGS / "nano.toml", {"steps": "3", "ranks": "2", "backend": "torchft"})


def _row(step, rank, t, failed=(), loss=None):
    return {"step": step, "loss": loss if loss is not None else 5.0 - step, "failed": list(failed), "down": list(failed),
            "tokens_trained": 100 * step, "backend": {"rank": rank, "time": t}}


def _replicas(tmp_path, rows: dict, digests=((1.0,), (1.0,)), heals=None):
    folder = tmp_path / "replicas"
    folder.mkdir(parents=True, exist_ok=True)
    for r, rs in rows.items():
        (folder / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rs))
    for r, digest in enumerate(digests):
        summary = dict.fromkeys(SUMMARY) | {"final_val_loss": 4.0, "backend": {"name": "torchft", "rank": r, "digest": list(digest)}}
        (folder / f"rank{r}.summary.json").write_text(json.dumps(summary))
    for r, hs in (heals or {}).items():
        (folder / f"rank{r}.heals.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hs))
    return types.SimpleNamespace(events=[{"time": 10.5, "kind": "kill", "rank": 1, "why": "scheduled", "step": 1},
                                         {"time": 11.5, "kind": "start", "rank": 1, "why": "restart after a kill", "step": 2}],
                                 t0=0.0)


def test_merge_joins_the_replicas_rows_into_the_trainers_records(tmp_path):
    """Rank 1 dies after step 1 and heals at step 2; rank 0 commits steps 2 alone; both commit step 3."""
    rows = {0: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 0, 10.0), _row(2, 0, 11.0, [1]), _row(3, 0, 12.0)],
            1: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 1, 10.0), _row(3, 1, 12.0)]}
    supervisor = _replicas(tmp_path, rows, heals={1: [{"healed_at_step": 2, "time": 11.8}]})
    summary = merge(tmp_path, CFG, supervisor.events, supervisor.t0)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3] and metrics[2]["failed"] == [1]
    assert json.loads((tmp_path / "failed_steps.json").read_text())["failed"] == [[], [1], []]
    assert summary["rank_agreement"] == {"ranks_checked": [0, 1], "identical": True}
    assert summary["final_train_loss"] == 2.0 and summary["tokens_trained"] == 300
    assert summary["failure_schedule"] == {"fraction_failed": pytest.approx(1 / 6), "events": 1}  # as it happened
    assert summary["backend"]["kills"] == 1
    # the kill at 10.5 s: the first step without rank 1 committed at 11.0; the restart at 11.5: it trained at 12.0
    assert summary["backend"]["timings"] == {"kill_to_step_s": [pytest.approx(0.5)], "restart_to_rejoin_s": [pytest.approx(0.5)],
                                             "kill_to_step_clear_s": [pytest.approx(0.5)],
                                             "restart_to_rejoin_clear_s": [pytest.approx(0.5)],
                                             "causes": {"kill_to_step_s": [{"why": "scheduled", "clear": True}],
                                                        "restart_to_rejoin_s": [{"why": "scheduled", "clear": True}]}}
    assert json.loads((tmp_path / "events.json").read_text())["healed"] == [{"rank": 1, "healed_at_step": 2, "time": 11.8}]


@pytest.mark.parametrize("rows, digests, message", [
    ({0: [_row(1, 0, 1.0), _row(3, 0, 3.0)]}, ((1.0,),), "steps [2] were never committed"),
    ({0: [_row(1, 0, 1.0), _row(2, 0, 2.0), _row(3, 0, 3.0)], 1: [_row(1, 1, 1.0, loss=9.0)]}, ((1.0,), (1.0,)),
     "step 1: replicas disagree"),
    ({0: [_row(1, 0, 1.0), _row(2, 0, 2.0), _row(2, 0, 2.5), _row(3, 0, 3.0)]}, ((1.0,),), "rank 0 committed a step twice"),
    ({0: [_row(1, 0, 1.0), _row(2, 0, 2.0), _row(3, 0, 3.0)]}, ((1.0,), (2.0,)), "ended with different parameters"),
])
def test_merge_refuses_records_that_are_not_one_run(tmp_path, rows, digests, message):
    supervisor = _replicas(tmp_path, rows, digests)
    with pytest.raises(TrainingStopped, match=message.replace("[", r"\[").replace("]", r"\]")):
        merge(tmp_path, CFG, supervisor.events, supervisor.t0)
    if "different parameters" in message:  # written anyway, saying so
        assert json.loads((tmp_path / "summary.json").read_text())["rank_agreement"]["identical"] is False


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.integers(4, 12), st.data())
def test_a_commit_that_died_with_its_replica_is_superseded_and_two_histories_that_went_on_are_refused(n, steps, data):
    """Random histories. The run's step s is committed at time s by every replica alive then; the last replica commits
    every step. Others may be killed and heal later (their rows stay the run's), and may commit an orphan (a step s
    alone, with another loss) and then: heal before their next row, resuming at s + 1 or redoing s ("heal"); die for
    good ("dead", no summary); or go on without a heal ("split": a history of its own, until a kill and a heal end it).
    A kill's heal is a restart (a new process, a new "life") or a live replica healed (a stall). lineage returns the
    run's rows and supersedes exactly the rows of the orphans and of the histories of their own that a restart ended;
    a "split" that no heal ended, or that a live replica's heal ended, is refused (a second history went on)."""
    run = {s: _row(s, 0, float(s), loss=5.0 - s / 100) for s in range(1, steps + 1)}
    own, healed, finished, expected, split, replaced = {}, [], set(range(n)), [], False, False
    for r in range(n):
        mine, s, diverged, life = [], 1, False, 0  # diverged: on a history of its own (after a "split"), until a heal
        orphan = None if r == n - 1 else data.draw(st.none() | st.tuples(st.integers(1, steps),
                                                                       st.sampled_from(["heal", "redo", "dead", "split"])))
        kill = None if r == n - 1 else data.draw(st.none() | st.tuples(st.integers(1, steps), st.booleans()))
        ours = lambda row, t: row | {"backend": {"rank": r, "time": t, "life": f"{r}.{life}"}}  # noqa: E731
        while s <= steps:
            if orphan and s == orphan[0]:
                mine.append(ours(_row(s, r, 0, loss=9.0), s + 0.1))
                how = orphan[1]
                expected += [(r, s)]
                diverged = how == "split"
                if how == "dead":
                    finished.discard(r)
                    break
                if how in ("heal", "redo"):  # restarted
                    life += 1
                    healed.append({"rank": r, "healed_at_step": s - (how == "redo"), "time": s + 0.5, "life": f"{r}.{life}"})
                if how == "redo":
                    mine.append(ours(run[s], s + 0.6))
                s += 1
                continue
            if diverged:  # its own history's row of step s
                mine.append(ours(_row(s, r, 0, loss=9.0 + s / 100), float(s)))
                expected += [(r, s)]
            else:
                mine.append(ours(run[s], float(s)))
            if kill and kill[0] == s and s + 2 <= steps and (not orphan or orphan[0] != s + 1):  # healed two steps on
                life += kill[1]  # restarted, or a live replica that fell behind
                replaced |= diverged and not kill[1]
                healed.append({"rank": r, "healed_at_step": s + 2, "time": s + 2.5, "life": f"{r}.{life}"})
                s, diverged = s + 2, False
            s += 1
        own[r] = mine
        split |= diverged
    if split or replaced:
        with pytest.raises(TrainingStopped, match="replicas disagree .* both went on|on a history of its own"):
            lineage(own, healed, finished)
        return
    rows, superseded = lineage(own, healed, finished)
    assert [rows[s]["loss"] for s in sorted(rows)] == [run[s]["loss"] for s in run]
    assert sorted((x["rank"], x["step"]) for x in superseded) == sorted(expected)


def test_a_step_redone_by_a_replica_whose_first_version_was_not_discarded_is_a_step_committed_twice_and_step_0_kept():
    rows = [_row(1, 0, 1.0), _row(2, 0, 2.0), _row(2, 0, 2.5), _row(3, 0, 3.0)]
    with pytest.raises(TrainingStopped, match="rank 0 committed a step twice"):
        lineage({0: rows}, [], {0})
    assert sorted(lineage({0: rows}, [{"rank": 0, "healed_at_step": 1, "time": 2.2}], {0})[0]) == [1, 2, 3]
    evaluated = {"step": 0, "val_loss": 6.0}  # only a replica that started at step 0 has the evaluation before it
    assert lineage({0: rows[:2], 1: [evaluated, *rows[:2]]}, [], {0, 1})[0][0] == evaluated


def test_resume_point_drops_what_came_after_the_checkpoint(tmp_path):
    rows = {0: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 0, 1.0), _row(2, 0, 2.0), _row(3, 0, 3.0)]}
    _replicas(tmp_path, rows, heals={0: [{"healed_at_step": 1, "time": 1.0}, {"healed_at_step": 3, "time": 3.0}]})
    checkpoint.save(tmp_path / "checkpoint", 2, CFG.hash(), {})
    assert resume_point(tmp_path, CFG) == 2
    kept = [json.loads(line)["step"] for line in (tmp_path / "replicas" / "rank0.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]
    heals = (tmp_path / "replicas" / "rank0.heals.jsonl").read_text().splitlines()
    assert [json.loads(h)["healed_at_step"] for h in heals] == [1]
    assert not list((tmp_path / "replicas").glob("*.summary.json"))  # the run is not finished any more


def test_a_checkpoint_of_another_config_or_a_torn_one_is_refused(tmp_path):
    checkpoint.save(tmp_path / "checkpoint", 2, "another", {})
    with pytest.raises(UsageError, match="belongs to another config"):
        resume_point(tmp_path, CFG)
    state = tmp_path / "checkpoint" / "state.pt"
    state.write_bytes(state.read_bytes()[:40])
    with pytest.raises(UsageError, match="state.pt is 40 bytes, .* when written"):  # its digest refuses it first
        checkpoint.load(tmp_path / "checkpoint", CFG.hash())


def test_torn_rows_are_dropped_on_merge_and_on_resume_and_repaired_before_appending(tmp_path):
    """A replica killed mid-write leaves a partial last line; restarted, it would append to it: repair_tail cuts it
    back first; merge and resume_point drop any line that is not JSON (its step is in the other replicas' rows)."""
    from mecefo.records import read_rows, repair_tail

    rows = {0: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 0, 10.0), _row(2, 0, 11.0), _row(3, 0, 12.0)],
            1: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 1, 10.0), _row(2, 1, 11.0), _row(3, 1, 12.0)]}
    supervisor = _replicas(tmp_path, rows)
    path = tmp_path / "replicas" / "rank1.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:17] + lines[3] + "\n")  # step 2 torn, step 3 glued to it
    with open(tmp_path / "replicas" / "rank0.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # killed while writing
    assert read_rows(path) == ([json.loads(lines[0]), json.loads(lines[1])], 1)
    summary = merge(tmp_path, CFG, supervisor.events, supervisor.t0)
    assert summary["backend"]["torn_lines_dropped"] == 2
    assert [m["step"] for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [0, 1, 2, 3]
    assert repair_tail(tmp_path / "replicas" / "rank0.jsonl") and not repair_tail(tmp_path / "replicas" / "rank0.jsonl")
    assert (tmp_path / "replicas" / "rank0.jsonl").read_text().endswith('"time": 12.0}}\n')
    checkpoint.save(tmp_path / "checkpoint", 3, CFG.hash(), {})
    assert resume_point(tmp_path, CFG) == 3
    assert read_rows(path)[1] == 0  # rewritten whole


def test_restarts_are_judged_within_their_window_and_those_never_back_are_named():
    """Rank 1 restarted at 2 s rejoins at 3 s, is killed at 3.3 s, restarted at 3.5 s, and the launch stops with every
    rank down: its resume at 3.8 s ends that restart's window (not judged, nor a 1 s rejoin at 4.5 s). Rank 2 restarted
    at 5 s is killed again at 5.5 s before it trained (not judged; that kill is not a training rank's), restarted at
    6 s and never trains: named, with what it was last doing. A lighthouse outage (2.2-2.8 s) and a stall (4.1-4.3 s)
    keep the rejoin and the second kill out of the clear lists."""
    from mecefo.replica_records import not_rejoined, recovery_times

    def event(t, kind, r, **more):
        return {"time": t, "kind": kind, "rank": r, "step": 0, "why": "restart after a kill", **more}

    events = [event(0.0, "start", 1, why="initial"), event(1.0, "kill", 1), event(2.0, "start", 1),
              {"time": 2.2, "kind": "lighthouse", "what": "killed"}, {"time": 2.8, "kind": "lighthouse", "what": "restarted"},
              event(3.3, "kill", 1), event(3.5, "start", 1), {"time": 3.8, "kind": "resume", "step": 3},
              event(4.0, "kill", 2), event(4.1, "stall", 0, seconds=0.2), event(5.0, "start", 2), event(5.5, "kill", 2),
              event(6.0, "start", 2, step=6), event(6.5, "status", 2, status="waiting")]
    rows = {s: _row(s, 0, t, down) for s, t, down in
            [(1, 0.5, []), (2, 1.5, [1]), (3, 3.0, []), (4, 4.5, [2]), (5, 5.8, [2]), (6, 6.2, [2]), (7, 10.0, [2])]}
    timings = recovery_times(events, rows, [])
    assert timings == {"kill_to_step_s": [pytest.approx(0.5), pytest.approx(0.5)], "restart_to_rejoin_s": [pytest.approx(1.0)],
                       # the second kill's step waited on a stalled rank, the rejoin on a lighthouse that was down
                       "kill_to_step_clear_s": [pytest.approx(0.5)], "restart_to_rejoin_clear_s": [],
                       # each entry's death named: the kill behind a restart is the rank's last one before it
                       "causes": {"kill_to_step_s": [{"why": "restart after a kill", "clear": True},
                                                     {"why": "restart after a kill", "clear": False}],
                                  "restart_to_rejoin_s": [{"why": "restart after a kill", "clear": False}]}}
    assert not_rejoined(events, rows, end=10.0) == [
        {"rank": 2, "restarted_at_step": 6, "seconds_before_end": 4.0, "last_status": "waiting"}]


@pytest.mark.parametrize("spec, message", [
    ("lighthouse", "expected lighthouse:STEP[:SECONDS]"), ("lighthouse:0", "expected lighthouse:STEP"),
    ("lighthouse:3:-1", "expected lighthouse:STEP"), ("lighthouse:3:x", "expected lighthouse:STEP")])
def test_a_lighthouse_kill_is_parsed_or_refused_in_one_line(spec, message):
    from mecefo.failures import resolve
    from mecefo.launch import kill_plan

    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        kill_plan(resolve("none", 2, 10, 44.0, seed=0, start="stationary"), [spec], 2)


def test_stall_and_lighthouse_specs():
    from mecefo.failures import resolve
    from mecefo.launch import kill_plan
    from mecefo.supervise import parse_stall

    kills, _ = kill_plan(resolve("none", 3, 10, 44.0, seed=0, start="stationary"), ["lighthouse:4:2.5", "lighthouse:6"], 3)
    assert [(k.what, k.rank, k.at_step, k.seconds) for k in kills] == [("lighthouse", None, 4, 2.5), ("lighthouse", None, 6, None)]
    assert [(k.what, k.rank, k.at_step, k.seconds) for k in [parse_stall("2:5:3", 3)]] == [("stall", 2, 5, 3.0)]
    for bad in ("2:5", "3:5:1", "1:0:1", "1:5:0", "1:5:inf"):
        with pytest.raises(UsageError, match="--stall"):
            parse_stall(bad, 3)


def test_a_checkpoint_write_never_replaces_a_later_step_nor_leaves_dead_writers_files(tmp_path):
    """A writer stalled before its rename wakes after its successor wrote a later step: the later one stays. A dead
    writer's temporary folder is removed by the next write; a live writer's is left alone."""
    import os
    import subprocess

    path = tmp_path / "checkpoint"
    checkpoint.save(path, 20, CFG.hash(), {}, keep_later=True)
    checkpoint.save(path, 10, CFG.hash(), {}, keep_later=True)  # the stalled one
    assert checkpoint.read(path)["step"] == 20
    checkpoint.save(path, 10, CFG.hash(), {})  # one writer (mecefo.train): after checkpoint-restart's rollback
    assert checkpoint.read(path)["step"] == 10
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        for pid in (dead.pid, live.pid):
            (tmp_path / f".checkpoint.{pid}.1.tmp").mkdir()
            (tmp_path / f".checkpoint.{pid}.1.tmp" / "state.pt").write_bytes(b"partial")
        checkpoint.save(path, 30, CFG.hash(), {}, keep_later=True)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [f".checkpoint.{live.pid}.1.tmp"]
        assert checkpoint.read(path)["step"] == 30 and os.path.getsize(path / "state.pt") > 0
    finally:
        live.kill()
        live.wait()


def test_a_live_replica_that_lost_one_lone_commit_is_superseded_and_one_that_lost_a_history_is_refused():
    """torchft agrees on a commit within a group: a commit can reach one replica alone, which later heals from the
    others' redo, alive (the same "life"): its one row is superseded. A live replica that trained two steps of its own
    while the others went on, and then healed from them, was a second history: refused."""
    life = lambda row, t, who: row | {"backend": {"rank": row["backend"]["rank"], "time": t, "life": who}}  # noqa: E731
    others = [life(_row(s, 1, 0), float(s), "b") for s in range(1, 5)]
    lone = [life(_row(1, 0, 0), 1.0, "a"), life(_row(2, 0, 0, loss=9.0), 2.1, "a"), life(_row(3, 0, 0), 3.0, "a"),
            life(_row(4, 0, 0), 4.0, "a")]
    heal = [{"rank": 0, "healed_at_step": 2, "time": 2.5, "life": "a"}]
    assert lineage({0: lone, 1: others}, heal, {0, 1})[1] == [{"rank": 0, "step": 2}]
    second = [*lone[:2], life(_row(3, 0, 0, loss=9.5), 3.0, "a"), life(_row(4, 0, 0), 4.0, "a")]
    with pytest.raises(TrainingStopped, match="rank 0 trained steps 2-3 on a history of its own"):
        lineage({0: second, 1: others}, [{"rank": 0, "healed_at_step": 3, "time": 3.5, "life": "a"}], {0, 1})
    restarted = [{"rank": 0, "healed_at_step": 3, "time": 3.5, "life": "c"}]  # a new process: that history died with it
    assert lineage({0: second, 1: others}, restarted, {0, 1})[1] == [{"rank": 0, "step": 2}, {"rank": 0, "step": 3}]


def test_two_replicas_healed_in_one_quorum_and_two_lone_commits_of_one_process_far_apart_are_one_run():
    """Rank 2 committed step 2 alone and died; restarted, it heals in the same quorum as rank 0 (which fell behind), a
    moment after it: rank 2's dead row of step 2 is not a source of rank 0's heal (its state did not last until its
    next row). And a live process that lost one lone commit, healed, and much later lost another: two one-step
    losses, one run."""
    life = lambda row, t, who: row | {"backend": {"rank": row["backend"]["rank"], "time": t, "life": who}}  # noqa: E731
    ones = [life(_row(s, 1, 0), float(s), "b") for s in range(1, 6)]
    behind = [life(_row(1, 0, 0), 1.0, "a"), life(_row(3, 0, 0), 3.0, "a"), life(_row(4, 0, 0), 4.0, "a"),
              life(_row(5, 0, 0), 5.0, "a")]
    lone = [life(_row(1, 2, 0), 1.0, "c"), life(_row(2, 2, 0, loss=9.0), 1.9, "c"), life(_row(3, 2, 0), 3.0, "d"),
            life(_row(4, 2, 0), 4.0, "d"), life(_row(5, 2, 0), 5.0, "d")]
    heals = [{"rank": 0, "healed_at_step": 2, "time": 2.5, "life": "a"}, {"rank": 2, "healed_at_step": 2, "time": 2.6, "life": "d"}]
    assert lineage({0: behind, 1: ones, 2: lone}, heals, {0, 1, 2})[1] == [{"rank": 2, "step": 2}]
    twice = [life(_row(1, 0, 0), 1.0, "a"), life(_row(2, 0, 0, loss=9.0), 2.1, "a"), life(_row(3, 0, 0), 3.0, "a"),
             life(_row(4, 0, 0, loss=9.0), 4.1, "a"), life(_row(5, 0, 0), 5.0, "a")]
    heals = [{"rank": 0, "healed_at_step": 2, "time": 2.5, "life": "a"}, {"rank": 0, "healed_at_step": 4, "time": 4.5, "life": "a"}]
    assert lineage({0: twice, 1: ones}, heals, {0, 1})[1] == [{"rank": 0, "step": 2}, {"rank": 0, "step": 4}]


def test_the_fork_server_is_the_devices_choice_unless_a_flag_says_otherwise():
    """No flag leaves the choice to the device (on on the CPU, off on CUDA). The GPU check found --no-fork-server's
    store_false defaulting to True: every CUDA launch was refused as if --fork_server had been given."""
    from mecefo.launch import build_parser

    def parsed(*flags):
        return build_parser().parse_known_args(["--out", "x", *flags])[0].fork_server

    assert parsed() is None
    assert parsed("--no-fork-server") is False and parsed("--no_fork_server") is False
    assert parsed("--fork_server") is True
