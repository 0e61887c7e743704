"""What every supervisor of torchft replicas shares: the kill grammar, the replica groups' processes (ReplicaGroup:
killed, stopped, woken, how they ended) and the crash budget, how a replica's exit is read, the event log, and how
the run's progress is read from the replicas' status files.

Two programs supervise replicas: `mecefo.launch` (every replica group of a run on one machine) and `mecefo.slurm node`
(the one replica group of a node of a Slurm job, with `mecefo.slurm watch` injecting failures by files in the run
folder). Both read their kills in this grammar, draw random failures from `mecefo.chaos`, hold each replica group
as a ReplicaGroup, log events here, and decide the same way what an exit means; what differs is how a group starts
(a process or K of them on this machine, possibly forked; torchrun on a node) and the loop's ending rules.

The kill grammar (`--kill`, both programs):
    RANK:STEP               kill rank RANK's replica group once step STEP is committed; never restarted
    RANK:STEP:RESTART_STEP  ... restarted once step RESTART_STEP is committed
    RANK:STEP:SECONDSs      ... restarted SECONDS seconds after the kill (e.g. 1:200:30s)
    RANK:heal               killed while it heals (the next time it does), restarted at once
    RANK/PROCESS:...        one process of the group, which takes the group down (mecefo.launch only)
    lighthouse:STEP[:SECONDS]  the lighthouse killed, a new one started after SECONDS, never without (mecefo.launch only)
and `--stall RANK:STEP:SECONDS` (SIGSTOP the group once STEP is committed, SIGCONT after SECONDS; `end`: once every
other replica has ended).

The event log: OUT/events/<writer>.jsonl, one file per writer (the launcher; each node's supervisor and the
watcher of a Slurm job: appends from several nodes to one file on a network file system can interleave), one JSON
object per line with its "time" and "kind". `read_events` merges them in time order; the merge of a run's records
(mecefo.replica_records) reads them for its recovery timings and writes OUT/events.json.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import BAD_INPUT, CANNOT_GO_ON, UsageError
from .runfiles import FINISHED, TRAINING, read_replica_status

KILL_GRAMMAR = ("RANK:STEP (killed for good), RANK:STEP:RESTART_STEP, RANK:STEP:SECONDSs (restarted SECONDS s after "
                "the kill), or RANK:heal (killed while healing, restarted at once)")
# what a replica must not inherit from its supervisor's environment: a caller's torchrun (its store and ranks)
INHERITED_NOT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


@dataclass
class Kill:
    """One entry of a kill plan: a kill (of a rank's group, or of one process of it), a stall, or the lighthouse."""

    rank: int | None  # None: the lighthouse
    at_step: int | None  # act once this step is committed (None: while the rank heals)
    restart_step: int | None  # restart once this step is committed (None: never, unless restart_after_s or restart_at)
    done: bool = False
    restarted: bool = False
    process: int | None = None  # one process of the rank's replica group (None: the whole group)
    restart_at: float | None = None  # restart at this time (time.monotonic()), whatever the step
    what: str = "kill"  # kill | stall (SIGSTOP for `seconds`, then SIGCONT) | lighthouse (rank None; back after
    seconds: float | None = None  # `seconds`, None: never)
    restart_after_s: float | None = None  # restart this long after the kill

    def fired(self, now: float) -> None:
        """The kill happened at `now` (time.monotonic()): a restart after seconds is due from then."""
        self.done = True
        if self.restart_after_s is not None:
            self.restart_at = now + self.restart_after_s

    def restart_due(self, step: int, now: float) -> bool:
        return ((self.restart_step is not None and step >= self.restart_step) or
                (self.restart_at is not None and now >= self.restart_at))


def parse_kill(spec: str, ranks: int, group_size: int = 1, processes: bool = True, lighthouse: bool = True) -> Kill:
    """One --kill spec (the grammar above) as a Kill; a one-line UsageError otherwise. processes / lighthouse: whether
    this supervisor can kill one process of a group / the lighthouse."""
    parts = spec.split(":")
    if parts[0] == "lighthouse":
        if not lighthouse:
            raise UsageError(f"--kill {spec!r}: this supervisor does not run the lighthouse; expected {KILL_GRAMMAR}")
        try:
            at, down = int(parts[1]), float(parts[2]) if len(parts) == 3 else None
            if len(parts) not in (2, 3) or at < 1 or (down is not None and not (math.isfinite(down) and down >= 0)):
                raise ValueError
        except (ValueError, IndexError):
            raise UsageError(f"--kill {spec!r}: expected lighthouse:STEP[:SECONDS] (STEP >= 1; restarted after "
                             "SECONDS, never without)") from None
        return Kill(None, at, None, what="lighthouse", seconds=down)
    try:
        who, _, process = parts[0].partition("/")
        rank = int(who)
        if len(parts) == 2 and parts[1] == "heal":
            kill = Kill(rank, None, 0)
        elif len(parts) in (2, 3):
            restart = parts[2] if len(parts) == 3 else None
            seconds = float(restart[:-1]) if restart is not None and restart.endswith("s") else None
            if seconds is not None and not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError
            kill = Kill(rank, int(parts[1]), int(restart) if restart is not None and seconds is None else None,
                        restart_after_s=seconds)
        else:
            raise ValueError
        kill.process = int(process) if process else None
    except ValueError:
        raise UsageError(f"--kill {spec!r}: expected {'RANK[/PROCESS]' if processes else 'RANK'}:STEP[:RESTART_STEP "
                         f"| :SECONDSs] or RANK:heal") from None
    if not 0 <= rank < ranks:
        raise UsageError(f"--kill {spec!r}: rank must be in 0..{ranks - 1}")
    if kill.process is not None and not processes:
        raise UsageError(f"--kill {spec!r}: this supervisor kills a whole replica group (a node), not one process of it")
    if kill.process is not None and not 0 <= kill.process < group_size:
        raise UsageError(f"--kill {spec!r}: the process must be in 0..{group_size - 1} (--group_size {group_size})")
    if kill.at_step is not None and (kill.at_step < 1 or (kill.restart_step is not None and kill.restart_step <= kill.at_step)):
        raise UsageError(f"--kill {spec!r}: STEP must be at least 1 and RESTART_STEP after it")
    return kill


def parse_stall(spec: str, ranks: int) -> Kill:
    """--stall RANK:STEP:SECONDS: SIGSTOP the rank's processes once STEP is committed, SIGCONT SECONDS later (SECONDS
    `end`: once every other replica has ended, a stall that outlasts the run)."""
    try:
        rank, at, seconds = spec.split(":")
        stall = Kill(int(rank), int(at), None, what="stall", seconds=math.inf if seconds == "end" else float(seconds))
    except ValueError:
        raise UsageError(f"--stall {spec!r}: expected RANK:STEP:SECONDS or RANK:STEP:end") from None
    if not (0 <= stall.rank < ranks and stall.at_step >= 1 and not math.isnan(stall.seconds) and stall.seconds > 0) or (
            math.isinf(stall.seconds) and seconds != "end"):
        raise UsageError(f"--stall {spec!r}: the rank must be in 0..{ranks - 1}, STEP at least 1, SECONDS positive "
                         "(or end)")
    return stall


# ---------------------------------------------------------------------------------------------- a replica group
class ReplicaGroup:
    """The processes of one rank's replica group as its supervisor runs them: one process (python -m mecefo.ft), the
    K processes of --group_size K, or a Slurm node's torchrun (sessions: a signal goes to each process's session,
    torchrun's workers included). The one place that kills, stops and wakes replicas, and reads how they ended."""

    def __init__(self, rank: int, procs: list, sessions: bool = False):
        self.rank, self.procs, self.sessions = rank, list(procs), sessions
        self.stalled_until: float | None = None  # stopped (SIGSTOP) until then (time.monotonic(); inf: the others end)

    def pids(self) -> str:
        return " ".join(str(p.pid) for p in self.procs)

    def signal(self, sig: int, process: int | None = None) -> None:
        """sig to every process of the group (process None) or to one, where it still runs."""
        for p in self.procs if process is None else self.procs[process:process + 1]:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig) if self.sessions else p.send_signal(sig)

    def kill(self, process: int | None = None) -> None:
        """SIGKILL every process (a node lost) or one, and reap them."""
        self.signal(signal.SIGKILL, process)
        for p in self.procs if process is None else self.procs[process:process + 1]:
            p.wait()

    def stall(self, seconds: float) -> None:
        """SIGSTOP for `seconds` (math.inf: until wake_due says every other replica has ended)."""
        self.signal(signal.SIGSTOP)
        self.stalled_until = time.monotonic() + seconds

    def wake_due(self, others_ended: bool) -> bool:
        """Whether its stall is over: its time has come, or (a stall past the end) every other replica has ended."""
        until = self.stalled_until
        return until is not None and (time.monotonic() >= until or (math.isinf(until) and others_ended))

    def wake(self) -> None:
        self.signal(signal.SIGCONT)
        self.stalled_until = None

    def ended(self) -> tuple[int | None, int] | None:
        """None while it runs; (None, 0) once every process exited 0; else (process, code) of the first that died."""
        codes = [p.poll() for p in self.procs]
        dead = [j for j, code in enumerate(codes) if code is not None and code != 0]
        if dead:
            return dead[0], codes[dead[0]]
        return (None, 0) if all(code == 0 for code in codes) else None


class CrashBudget:
    """--max_restarts: how many times each rank may crash (exit_kind 'crashed') and be restarted."""

    def __init__(self, max_restarts: int):
        self.max_restarts, self.crashes = max_restarts, {}

    def crashed(self, rank: int) -> bool:
        """Count a crash of rank's replica; whether it may be restarted."""
        self.crashes[rank] = self.crashes.get(rank, 0) + 1
        return self.crashes[rank] <= self.max_restarts

    def of(self, rank: int) -> int:
        return self.crashes.get(rank, 0)


# ---------------------------------------------------------------------------------------------- a replica's exit
def how(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def exit_kind(code: int) -> str:
    """What a replica's exit status says: 'finished' (0), 'stopped' (2, bad input; 3, cannot go on: the others would
    stop alike, so the supervisor stops), 'killed' (by anyone's signal: restarted at once) or 'crashed' (any other
    status: restarted within --max_restarts)."""
    if code == 0:
        return "finished"
    if code in (BAD_INPUT, CANNOT_GO_ON):
        return "stopped"
    return "killed" if code < 0 else "crashed"


# ---------------------------------------------------------------------------------------------- the run's progress
def read_statuses(out: Path, ranks: int) -> dict[int, list[str]]:
    """Each replica's status file, split ([what, (step,) time]); ranks without one are left out."""
    found = {}
    for r in range(ranks):
        words = read_replica_status(out, r)
        if words:
            found[r] = words
    return found


def committed_step(statuses: dict[int, list[str]], steps: int) -> int:
    """The furthest step the replicas' statuses say was committed (a finished replica: the run's last)."""
    furthest = 0
    for words in statuses.values():
        if words[0] in TRAINING and len(words) > 1 and words[1].isdigit():
            furthest = max(furthest, int(words[1]))
        elif words[0] == FINISHED:
            furthest = max(furthest, steps)
    return furthest


def replica_env(environ=os.environ, drop: tuple = (), one_thread: bool = True) -> dict:
    """The environment a replica process starts from: its supervisor's, less a caller's torchrun (and `drop`),
    torchft's Rust logs at warn, and with one_thread (several replicas sharing one machine's cores) one thread per
    process unless OMP_NUM_THREADS says otherwise."""
    env = {k: v for k, v in environ.items() if k not in INHERITED_NOT + drop}
    env["RUST_LOG"] = environ.get("RUST_LOG", "warn")
    if one_thread:
        env["OMP_NUM_THREADS"] = environ.get("OMP_NUM_THREADS", "1")
    return env


# ---------------------------------------------------------------------------------------------- the event log
def events_dir(out: Path) -> Path:
    return Path(out) / "events"


class EventLog:
    """One writer's events, OUT/events/<who>.jsonl: appended as they happen (a supervisor killed keeps what it
    logged), kept in memory as `events` (with the writer's earlier ones). fresh: a run that starts over: every
    writer's earlier events are removed."""

    def __init__(self, out: Path, who: str, fresh: bool = False):
        self.path = events_dir(out) / f"{who}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            for earlier in self.path.parent.glob("*.jsonl"):
                earlier.unlink()
        self.events = _read(self.path)

    def record(self, **event) -> dict:
        event = {"time": time.time(), **event}
        self.events.append(event)
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        return event


def _read(path: Path) -> list[dict]:
    found = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line torn by a writer killed mid-write
                found.append(json.loads(line))
    return found


def read_events(out: Path, who: str = "*") -> list[dict]:
    """The events of OUT/events/<who>.jsonl (who "*": every writer's), in time order (none for replicas started by
    hand)."""
    found = [e for path in sorted(events_dir(out).glob(f"{who}.jsonl")) for e in _read(path)]
    return sorted(found, key=lambda e: e["time"])
