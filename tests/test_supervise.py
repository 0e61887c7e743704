"""The supervisors' shared core (mecefo.supervise): a replica group's processes killed, stopped and woken, how they
ended, and the crash budget; the kill grammar's Kill and the event log."""

import math
import os
import signal
import subprocess
import time

from mecefo.supervise import CrashBudget, EventLog, ReplicaGroup, exit_kind, parse_kill, read_events


def _sleeper(*extra) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", "sleep 60 & wait", *extra], start_new_session=True)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_group_is_stopped_woken_and_killed_whole_its_sessions_included():
    """sessions=True (a Slurm node's torchrun): the signal reaches the session, the worker (sleep) too."""
    group = ReplicaGroup(0, [_sleeper(), _sleeper()], sessions=True)
    time.sleep(0.2)
    workers = [c for p in group.procs for c in _children(p.pid)]
    assert group.ended() is None and len(workers) == 2
    group.stall(math.inf)
    time.sleep(0.1)
    assert {_state(p.pid) for p in group.procs} | {_state(w) for w in workers} == {"T"}
    assert group.wake_due(others_ended=False) is False and group.wake_due(others_ended=True) is True
    group.wake()
    time.sleep(0.1)
    assert group.stalled_until is None and "T" not in {_state(p.pid) for p in group.procs}
    group.kill()
    assert group.ended() == (0, -signal.SIGKILL)
    time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{w}") and _state(w) != "Z" for w in workers)


def test_one_process_of_a_group_killed_leaves_the_others_and_the_group_reads_its_death():
    group = ReplicaGroup(1, [_sleeper(), _sleeper()])
    group.kill(process=1)
    assert group.procs[0].poll() is None and group.ended() == (1, -signal.SIGKILL)
    group.kill()
    done = ReplicaGroup(2, [subprocess.Popen(["true"]), subprocess.Popen(["true"])])
    for p in done.procs:
        p.wait()
    assert done.ended() == (None, 0) and exit_kind(0) == "finished"
    stall = ReplicaGroup(3, [_sleeper()])
    stall.stall(0.05)
    time.sleep(0.1)
    assert stall.wake_due(others_ended=False)
    stall.kill()  # a stopped group dies of SIGKILL too
    assert stall.ended() == (0, -signal.SIGKILL)


def test_the_crash_budget_counts_each_rank_apart():
    budget = CrashBudget(max_restarts=1)
    assert budget.crashed(0) and not budget.crashed(0) and budget.crashed(1) and budget.of(0) == 2
    assert [exit_kind(c) for c in (0, 2, 3, -9, 1)] == ["finished", "stopped", "stopped", "killed", "crashed"]


def test_a_kill_restarted_after_seconds_is_due_from_the_moment_it_fired():
    kill = parse_kill("1:5:2s", 3)
    assert not kill.restart_due(step=99, now=100.0)  # not fired yet
    kill.fired(now=100.0)
    assert kill.done and not kill.restart_due(99, 101.9) and kill.restart_due(6, 102.0)


def test_the_event_log_keeps_every_writers_lines_in_time_order_and_a_fresh_run_starts_empty(tmp_path):
    a, b = EventLog(tmp_path, "launch"), EventLog(tmp_path, "node1")
    a.record(kind="start", rank=0)
    b.record(kind="kill", rank=1)
    with open(b.path, "a") as f:
        f.write('{"time": 1e20, "kind": "to')  # a writer killed mid-line
    assert [e["kind"] for e in read_events(tmp_path)] == ["start", "kill"]
    assert [e["kind"] for e in EventLog(tmp_path, "launch").events] == ["start"]  # a resumed writer reads its own
    EventLog(tmp_path, "launch", fresh=True)
    assert read_events(tmp_path) == []
