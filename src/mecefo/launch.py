"""Real failures: train with the torchft backend while a supervisor kills replica processes with SIGKILL
and restarts them.

    python -m mecefo.launch --config experiments/configs/nano.toml --ranks 3 --failures high --out DIR
    python -m mecefo.launch ... --kill 1:10:20 --kill 2:heal        # explicit kills (see --help)

Starts torchft's lighthouse (mecefo.lighthouse, a child process), the n replica processes (`python -m mecefo.ft`), and a
supervisor that follows the committed step. The kill plan comes from the failure schedule (--failures, as
for mecefo.train: a scenario at cluster.seconds_per_step, or a trace; a rank failed at step s is killed
once step s is reached, and restarted at its recovery step) and from --kill in mecefo.supervise's grammar:
R:S[:S2] (kill rank R at step S and, with S2, restart it once step S2 is committed; R:S:Ts, T seconds after the
kill) or R:heal (kill rank R while it is healing,
the next time it heals; it is restarted at once; the kill lands while it applies the state received from a
peer: torchft calls our loader after the transfer), and --chaos SEED[:RATE] draws random events (mecefo.chaos:
kills, simultaneous kills, kills while healing or writing, stalls, the lighthouse killed and restarted). A
restarted process heals from a live peer and rejoins. With --shard fsdp --group_size K each rank is a replica
group of K processes sharding the model (mecefo.engine.Sharded under mecefo.ft.FtMembership): a kill takes the whole group (a node
lost), --kill R/J:S[:S2] kills its process J only, and a group missing any process is taken down and
restarted. A replica killed by anyone's signal is restarted at once; one that crashes (an exit status other
than 2, bad input, and 3, cannot go on) is restarted up to --max_restarts times. Every process started here is
killed on exit, Ctrl-C included. If every replica is dead at once, the run stops (exit 3) with the last
checkpoint intact; `--resume` continues from it. Every MECEFO_PROGRESS_S seconds (10) it prints a progress line
(mecefo.progress: the committed step, the ranks training, the last heal, the step rate and the time left);
--tensorboard DIR writes TensorBoard scalars (mecefo.board): the launcher's in DIR/launcher, replica r's rows in
DIR/rank<r>. Each process gets a GPU of its own on CUDA (mecefo.placement).

Outputs in DIR, merged from the replicas' files in the trainer's record schema (mecefo.records):
metrics.jsonl (the step-0 evaluation, then one row per committed step: loss, lr, gradient norm, the ranks
down, who covered whom, samples; the replica and its wall clock under "backend"), summary.json (the kills
and recovery timings under "backend", and the restarted ranks that did not rejoin before the end, with what
they were doing), events.json (kills, restarts, exits, chaos events and every change of a replica's status,
when each rank healed, and the recovery timings; merged from events/launch.jsonl, the launcher's event log as it
happens, mecefo.supervise), failed_steps.json (the ranks down at every step, for the simulated twin:
`python -m mecefo.train ... --failures steps:DIR/failed_steps.json`), and replicas/ (each replica's rows,
heals, summary, status and log). OUT/run.lock is held by the launcher while it runs (mecefo.runfolder).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import chaos, failures
from . import config as config_mod
from .errors import BAD_INPUT, CANNOT_GO_ON, TrainingStopped, UsageError, guarded
from .heal import ensure_token
from .lighthouse import Lighthouse
from .placement import launcher_gpus, one_gpu, visible_gpus
from .progress import ProgressLine
from .processes import ForkServer, become_subreaper, die_with_parent, group_store
from .records import atomic_write_json
from .replica_records import merge, resume_point
from .runfiles import DOWN, FINISHED, HEALING, STARTING, TRAINING, RunFiles, read_config, write_replica_status
from .supervise import (KILL_GRAMMAR, CrashBudget, EventLog, Kill, ReplicaGroup, committed_step, exit_kind, how,
                        parse_kill, parse_stall, read_events, read_statuses, replica_env)

POLL_S = 0.02
FORK_SERVER_BACKOFF_S = 10.0  # after the fork server died: start the next one no sooner
FORK_SERVER_READY_S = 60.0  # the run's first replicas wait this long for the fork server, then start as fresh processes
MAX_RESTARTS = 3  # default --max_restarts: restarts of a rank after a crash (a non-signal exit other than 2 and 3)


@dataclass
class Supervisor:
    """Starts the replicas, follows them through their status files (OUT/replicas/rank<r>.status: what each is
    doing, and the step it committed), kills and restarts them on the kill plan and the chaos events, restarts
    a rank that dies of anyone's signal at once and one that crashes within --max_restarts, and stops the launch
    when a replica stops on bad input (2) or cannot go on (3), or when every replica is dead."""

    cfg: object
    out: Path
    lighthouse: Lighthouse
    kills: list[Kill]
    min_step_s: float
    quiet: bool = False
    group_size: int = 1  # processes per replica group (--group_size)
    max_restarts: int = MAX_RESTARTS
    chaos: object = None  # a mecefo.chaos.Punisher
    procs: dict = field(default_factory=dict)  # rank -> its running replica group (mecefo.supervise.ReplicaGroup)
    event_log: EventLog | None = None  # OUT/events/launch.jsonl (mecefo.supervise)
    t0: float = field(default_factory=time.time)
    furthest: int = 0
    rejoining: set = field(default_factory=set)  # restarted ranks that have not trained yet
    gpus: list = field(default_factory=list)  # process j of rank r: gpus[r][j] (mecefo.placement; [] on the CPU)
    stores: dict = field(default_factory=dict)  # rank -> its group's store (hosted here, on loopback)
    crashes: CrashBudget = None  # --max_restarts (mecefo.supervise)
    lighthouse_back_at: float | None = None
    lighthouse_down: bool = False  # killed for good (--kill lighthouse:STEP): not restarted when found dead
    seen: dict = field(default_factory=dict)  # rank -> the last status word observed
    observed: dict = field(default_factory=dict)  # rank -> its status file's words, as last read (or written here)
    fork_server: bool = False  # replica processes forked from a process with the imports done (--fork_server)
    forks: ForkServer | None = None  # that process, while it lives
    fork_server_back_at: float = 0.0  # after it died: start the next one no sooner
    first_step: int = 0  # the step this launch starts from (a restart before any commit is a start)
    wait_for: int = 1  # the replicas the run's first step waits for
    polling: bool = False  # in run()'s loop: a signal is only recorded, and the loop raises it (see interrupt)
    interrupted: bool = False
    progress: ProgressLine | None = None  # the progress line (mecefo.progress), every MECEFO_PROGRESS_S seconds
    tensorboard: Path | None = None  # --tensorboard DIR: the launcher's scalars in DIR/launcher, replica r's in DIR/rank<r>
    board: object = None
    board_at: float = 0.0

    def __post_init__(self):
        self.crashes = self.crashes or CrashBudget(self.max_restarts)

    def interrupt(self) -> None:
        """Ctrl-C, SIGTERM or SIGHUP while the loop runs: recorded here, raised by the loop at its next poll. Raised
        from the handler itself, the KeyboardInterrupt could land in an at-fork callback of a replica's Popen, where
        Python prints it as 'Exception ignored' and drops it (CI saw this with two Ctrl-C 50 ms apart)."""
        self.interrupted = True

    @property
    def events(self) -> list[dict]:
        return self.event_log.events if self.event_log is not None else []

    def log(self, msg: str, **event) -> None:
        if event and self.event_log is not None:
            self.event_log.record(**event)
        if not self.quiet:
            print(f"[launch {time.time() - self.t0:7.2f}s] {msg}", flush=True)

    # ------------------------------------------------------------------ what the replicas say
    def observe(self) -> dict[int, list[str]]:
        """Read the statuses, follow the committed step, and record every change of what a replica does."""
        statuses = read_statuses(self.out, self.cfg.cluster.ranks)
        self.furthest = max(self.furthest, committed_step(statuses, self.cfg.train.steps))
        for r, words in statuses.items():
            if self.seen.get(r) != words[0]:
                self.seen[r] = words[0]
                self.event_log.record(kind="status", rank=r, status=words[0], step=self.furthest)
        self.observed = statuses
        return statuses

    def committed(self) -> int:
        """The highest step any replica has committed (from the statuses last observed)."""
        return self.furthest

    def statuses(self) -> dict[int, str]:
        return {r: words[0] for r, words in self.observed.items()}

    def alive(self) -> list[int]:
        """Ranks whose processes run (stalled and still joining ones included)."""
        return sorted(self.procs)

    def training(self) -> list[int]:
        """Ranks that hold the run's state: their processes run, not stalled, past their heal (or never restarted)."""
        return sorted(r for r, g in self.procs.items() if g.stalled_until is None and r not in self.rejoining
                      and self.statuses().get(r) in TRAINING)

    def has_checkpoint(self) -> bool:
        return (self.out / "checkpoint").exists()

    # ------------------------------------------------------------------ verbs (the kill plan's and chaos')
    def start(self, rank: int, why: str, wait_for: int = 1) -> None:
        """Start rank's replica: one process, or with --group_size K a group of K meeting at a store hosted here."""
        write_replica_status(self.out, rank, STARTING)  # (not the dead one's)
        self.observed[rank] = [STARTING]  # (what this tick read was the dead process's)
        env = self.replica_env()
        if self.group_size > 1 or self.cfg.cluster.shard == "fsdp":
            self.stores[rank] = group_store("127.0.0.1", "127.0.0.1")  # a fresh one per start: no key of a dead group
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.stores[rank].port), "WORLD_SIZE": str(self.group_size)}
        argv = ["--out", str(self.out), "--replica", str(rank), "--lighthouse", self.lighthouse.address,
                "--min-step-s", str(self.min_step_s)] + (["--rejoin"] if why != "initial" else ["--wait-for", str(wait_for)]) \
            + (["--tensorboard", str(self.tensorboard / f"rank{rank}")] if self.tensorboard is not None else [])
        group, forked = [], 0
        for j in range(self.group_size):
            mine, path = env | {"RANK": str(j), "LOCAL_RANK": str(j)}, self.out / "replicas" / _log_name(rank, j)
            if self.gpus:  # a GPU of its own (mecefo.placement)
                mine |= one_gpu(self.gpus[rank][j])
            proc = self.forks.spawn(argv, mine, str(path)) if self.forks is not None else None
            if proc is not None:  # its imports done
                forked += 1
            else:  # a fresh interpreter
                with open(path, "a") as log:  # (the child holds its own descriptor)
                    proc = subprocess.Popen([sys.executable, "-m", "mecefo.ft", *argv], stdout=log, stderr=subprocess.STDOUT,
                                            env=mine, start_new_session=True, preexec_fn=die_with_parent)
            group.append(proc)
        self.procs[rank] = ReplicaGroup(rank, group)
        self.seen.pop(rank, None)
        for k in self.kills:  # every earlier kill of the rank is answered by this start
            if k.rank == rank and k.done:
                k.restarted = True
        if why != "initial":
            self.rejoining.add(rank)
        self.log(f"started rank {rank} (pid {self.procs[rank].pids()}, {why}"
                 + (f", {forked} forked" if forked else "") + ")", kind="start", rank=rank, why=why, forked=forked,
                 step=self.committed())

    def replica_env(self) -> dict:
        """The environment every replica process starts from (mecefo.supervise.replica_env), less any opening of the
        servers (MECEFO_FT_HOST: one node, everything on the loopback)."""
        env = replica_env(drop=("MECEFO_FT_HOST",))
        if sys.platform == "linux":  # gloo's and NCCL's sockets on the loopback too (they otherwise take the
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # hostname's interface: NCCL's bootstrap listens there)
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        return env

    def keep_fork_server(self) -> None:
        """The fork server (--fork_server): started with the launch, and again FORK_SERVER_BACKOFF_S after it died
        (meanwhile replicas start as fresh interpreters)."""
        if not self.fork_server:
            return
        if self.forks is not None and not self.forks.alive():
            self.log(f"the fork server died (see {self.out / 'replicas' / 'fork-server.log'}); replicas start as fresh "
                     "processes until the next one is ready", kind="fork_server_died")
            self.forks, self.fork_server_back_at = None, time.monotonic() + FORK_SERVER_BACKOFF_S
        if self.forks is None and time.monotonic() >= self.fork_server_back_at:
            self.forks = ForkServer(self.out, self.replica_env(), self.out / "replicas" / "fork-server.log")

    def kill(self, rank: int, why: str, process: int | None = None) -> None:
        """SIGKILL rank's replica group (process None), or one process of it, which then takes the group down."""
        if rank not in self.procs:
            return
        if process is not None and len(self.procs[rank].procs) > 1:
            self.procs[rank].kill(process)
            self.log(f"killed process {process} of rank {rank} with SIGKILL at step {self.committed()} ({why})",
                     kind="kill", rank=rank, process=process, why=why, step=self.committed())
            return
        self.procs.pop(rank).kill()
        self.mark_down(rank)
        self.log(f"killed rank {rank} with SIGKILL at step {self.committed()} ({why})", kind="kill", rank=rank,
                 why=why, step=self.committed())

    def mark_down(self, rank: int) -> None:
        """Say in rank's status file that its process is dead: its peers do not wait for it to reappear at a restarted
        lighthouse (FtMembership.members_gone)."""
        write_replica_status(self.out, rank, DOWN)
        self.observed[rank] = [DOWN]

    def restart_after(self, rank: int, seconds: float) -> None:
        """Restart rank (killed) after `seconds`, as a node replaced."""
        self.kills.append(Kill(rank, None, None, done=True, restart_at=time.monotonic() + seconds))

    def kill_unplanned(self, rank: int) -> None:
        """SIGKILL rank's first process behind the plan's back (as an OOM killer would): the next poll sees an
        unplanned death."""
        if rank in self.procs:
            self.procs[rank].signal(signal.SIGKILL, process=0)

    def stall(self, rank: int, seconds: float) -> None:
        """SIGSTOP rank's processes, SIGCONT after `seconds` (a straggler; math.inf: once every other replica has
        ended, a stall that outlasts the run)."""
        how = f"for {seconds:g} s" if math.isfinite(seconds) else "until every other replica has ended"
        self.log(f"stopped rank {rank} {how} at step {self.committed()}", kind="stall", rank=rank,
                 seconds=seconds if math.isfinite(seconds) else None, step=self.committed())
        if rank in self.procs:
            self.procs[rank].stall(seconds)

    def restart_lighthouse(self, seconds: float | None) -> None:
        """SIGKILL the lighthouse; start a new one on its address after `seconds` (None: never)."""
        self.lighthouse.kill()
        self.lighthouse_back_at = time.monotonic() + seconds if seconds is not None else None
        self.lighthouse_down = seconds is None
        self.log("lighthouse killed", kind="lighthouse", what="killed", step=self.committed())

    def take_down(self, rank: int, dead: int, code: int, unplanned: bool) -> None:
        """A process of rank's group died: the group cannot go on without its shards, so its other processes are
        killed too (a node lost); the kill plan, or else an immediate restart, brings it back."""
        self.procs.pop(rank).kill()
        self.mark_down(rank)
        what = f"process {dead} died ({how(code)}); its group killed" if self.group_size > 1 else how(code)
        self.log(f"rank {rank} down: {what}", kind="down", rank=rank, process=dead, code=code, unplanned=unplanned,
                 step=self.committed())

    # ------------------------------------------------------------------ the loop
    def run(self, initially_down: frozenset[int]) -> None:
        n, steps = self.cfg.cluster.ranks, self.cfg.train.steps
        self.first_step, self.wait_for = self.furthest, n - len(initially_down)
        self.progress = ProgressLine(steps)
        if self.tensorboard is not None:
            from .board import Board

            self.board = Board(self.tensorboard / "launcher")
        self.polling = True  # stays True if the loop raises: a second signal during the clean-up is only recorded
        self.keep_fork_server()
        ready_by = time.monotonic() + FORK_SERVER_READY_S  # (its one import is quicker than every replica's at once)
        while self.forks is not None and not self.forks.is_ready(0.1) and self.forks.alive() and not self.interrupted \
                and time.monotonic() < ready_by:
            pass
        for r in range(n):
            if r not in initially_down:
                self.start(r, "initial", wait_for=self.wait_for)
        while True:
            if self.interrupted:
                raise KeyboardInterrupt
            self.tick()
            statuses = self.statuses()
            back = {r for r in self.rejoining if statuses.get(r) in TRAINING}
            for r in back:
                self.progress.healed(r, self.committed())
            self.rejoining = {r for r in self.rejoining if r in self.procs and statuses.get(r) not in (*TRAINING, FINISHED)}
            line = self.progress.line(self.committed(), len(self.training()), n)
            if line:
                self.log(line)
            if self.board is not None and time.monotonic() - self.board_at >= 1.0:
                self.board_at = time.monotonic()
                self.board.scalars({"launch/committed_step": self.committed(), "launch/ranks_training": len(self.training()),
                                    "launch/steps_per_min": self.progress.rate_per_min(),
                                    "launch/kills": sum(e["kind"] == "kill" for e in self.events)}, time.time() - self.t0)
            if not set(self.procs) - self.rejoining:  # nobody left who trains (a restarted one cannot heal)
                if self.committed() >= steps:
                    self.stop()  # a replica still waiting to rejoin a finished run
                    self.polling = False
                    return
                self.stop()  # (the restarted ones that never healed: before the checkpoints are read)
                raise TrainingStopped(
                    f"all {n} replicas are dead at step {self.committed()}; nobody is left to heal the others"
                    f"{self.last_crash()}. " + self.after_stop())
            time.sleep(POLL_S)

    def tick(self) -> None:
        """One look at the replicas: the plan's and chaos' kills and restarts, stalls ending, the lighthouse back,
        and every exit handled."""
        now, steps = time.monotonic(), self.cfg.train.steps
        statuses = self.observe()
        step = self.committed()
        for k in self.kills:
            if k.what != "kill":
                if not k.done and step >= k.at_step and (k.rank is None or k.rank in self.procs):
                    k.done = k.restarted = True
                    if k.what == "stall":
                        self.stall(k.rank, k.seconds)
                    else:
                        self.restart_lighthouse(k.seconds)
                continue
            healing = statuses.get(k.rank, [""])[0] == HEALING
            if not k.done and k.rank in self.procs and (
                    (k.at_step is not None and step >= k.at_step) or (k.at_step is None and healing)):
                self.kill(k.rank, "while healing" if k.at_step is None else f"scheduled at step {k.at_step}", k.process)
                k.fired(now)
            if k.done and not k.restarted and k.restart_due(step, now) and k.rank not in self.procs:
                if step < steps and self.procs:
                    if step > self.first_step:
                        self.start(k.rank, "restart after a kill")
                    else:  # nothing committed yet: the others wait for it as one of the run's first replicas
                        self.start(k.rank, "initial", wait_for=self.wait_for)
                k.restarted = True
        outlasting = {r for r, g in self.procs.items() if g.stalled_until == math.inf}
        for r, group in list(self.procs.items()):
            if group.wake_due(others_ended=not set(self.procs) - outlasting):
                group.wake()
                self.log(f"rank {r} goes on at step {self.committed()}", kind="stall_end", rank=r, step=self.committed())
        if self.lighthouse_back_at is not None and now >= self.lighthouse_back_at:
            self.lighthouse.restart()
            self.lighthouse_back_at = None
            self.log("lighthouse restarted on the same address", kind="lighthouse", what="restarted", step=step)
        elif self.lighthouse_back_at is None and not self.lighthouse_down and self.lighthouse.died() is not None:
            self.log(f"the lighthouse died (exit status {self.lighthouse.died()}, see {self.lighthouse.log}); "
                     "restarted on the same address", kind="lighthouse", what="died", step=step)
            self.lighthouse.restart()
        if self.chaos is not None:
            self.chaos.poll(self, now)
        self.keep_fork_server()
        for r, group in list(self.procs.items()):
            ended = group.ended()
            if ended is None:
                continue
            j, code = ended
            if exit_kind(code) == "finished":  # (or the run finished before it could rejoin)
                del self.procs[r]
                self.furthest = max(self.furthest, steps)
                continue
            if exit_kind(code) == "stopped":
                self.log(f"rank {r} exited with status {code}", kind="exit", rank=r, process=j, code=code)
                self.stop_with(r, code, j)  # bad input, or it cannot go on: the others would follow
            planned = any(k.rank == r and k.done and not k.restarted for k in self.kills)
            self.take_down(r, j, code, unplanned=not planned)
            if exit_kind(code) == "crashed":  # a CUDA or NCCL error, an exception: restarted within the budget
                within = self.crashes.crashed(r)
                self.log(f"rank {r} crashed ({self.line_of(r, j)}); restart {self.crashes.of(r)} of {self.max_restarts}",
                         kind="crash", rank=r, process=j, code=code, line=self.line_of(r, j))
                if not within:
                    self.stop_with(r, code, j)
            if not planned:  # nobody plans its return: restarted at once, as a node replaced
                self.kills.append(Kill(r, None, 0, done=True))

    def after_stop(self) -> str:
        """What --resume does with the run folder a stopped launch leaves (read once every replica is stopped)."""
        from . import checkpoint

        path = self.out / "checkpoint"
        if not (path.exists() or path.is_symlink() or checkpoint.earlier(path)):
            return f"No checkpoint was written yet (train.checkpoint_every); --resume starts the run in {self.out} over"
        try:
            what = checkpoint.describe_newest_intact(path, self.cfg.hash())
        except UsageError as e:
            return f"--resume refuses: {e}"
        if what.startswith("no checkpoint"):
            return f"{what[0].upper()}{what[1:]}; --resume refuses to start (nothing is deleted)"
        return f"--resume continues from {what}"

    def line_of(self, rank: int, process: int = 0) -> str:
        log = self.out / "replicas" / _log_name(rank, process)
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        return lines[-1].strip() if lines else "(no output)"

    def last_crash(self) -> str:
        crash = next((e for e in reversed(self.events) if e["kind"] == "crash"), None)
        return "" if crash is None else f" (the last to die, rank {crash['rank']}, crashed: {crash['line']})"

    def stop_with(self, rank: int, code: int, process: int = 0) -> None:
        """Stop the run with the one line the replica stopped with: its log's 'error: ' line (bad input, exit 2),
        its 'stopped: ' line (exit 3), or for a crash past its restarts its last line and where its log is."""
        self.stop()  # every replica first: no writer changes the checkpoints while after_stop reads them
        log = self.out / "replicas" / _log_name(rank, process)
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        if code in (BAD_INPUT, CANNOT_GO_ON):
            prefix, error = ("error: ", UsageError) if code == BAD_INPUT else ("stopped: ", TrainingStopped)
            line = next((ln[len(prefix):] for ln in reversed(lines) if ln.startswith(prefix)), None)
            if line is None:
                line = f"rank {rank} exited with status {code}"
            elif not line.startswith(f"rank {rank}: "):  # (a replica's own lines name it already)
                line = f"rank {rank}: {line}"
            raise error(line + (f". {self.after_stop()}" if code == CANNOT_GO_ON else ""))
        raise TrainingStopped(f"rank {rank} died (exit status {code}) {self.crashes.of(rank)} times, more than "
                              f"--max_restarts {self.max_restarts}: {self.line_of(rank, process)} (see {log}). "
                              + self.after_stop())

    def stop(self) -> None:
        for group in self.procs.values():
            group.kill()
        self.procs.clear()
        if self.forks is not None:
            self.forks.stop()
            self.forks = None


def _log_name(rank: int, process: int) -> str:
    """A replica's log: rank<r>.log, and rank<r>.<j>.log for process j > 0 of its group."""
    return f"rank{rank}.log" if process == 0 else f"rank{rank}.{process}.log"


def kill_plan(schedule: failures.Schedule, explicit: list[str], n: int,
              group_size: int = 1) -> tuple[list[Kill], frozenset[int]]:
    """Kills from the schedule's failed sets (a rank failed at step s is killed once s steps are committed,
    restarted at its recovery step: its whole replica group, a node lost), then the explicit --kill specs
    (RANK/PROCESS: one process of the group, which takes the group down). Returns them and the ranks down
    at 0."""
    kills = []
    failed = schedule.failed
    for s in range(1, len(failed)):
        for r in sorted(failed[s] - failed[s - 1]):
            back = next((t for t in range(s + 1, len(failed)) if r not in failed[t]), None)
            kills.append(Kill(r, s, back))
    down0 = failed[0] if failed else frozenset()
    for r in sorted(down0):  # down from the start: started at its recovery step
        back = next((t for t in range(1, len(failed)) if r not in failed[t]), None)
        kills.append(Kill(r, 0, back, done=True))
    kills += [parse_kill(spec, n, group_size) for spec in explicit]
    return kills, down0


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags (the trainer's are parsed by mecefo.train's parser from what is left)."""
    parser = argparse.ArgumentParser(prog="python -m mecefo.launch", description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="--chaos events (mecefo.chaos):\n" + chaos.describe() + "\n\n" + config_mod.fields_help())
    parser.add_argument("--config")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="append", default=[],
                        help=f"{KILL_GRAMMAR}; "
                             "RANK/PROCESS:...: one process of the rank's replica group (the group goes down with it); "
                             "lighthouse:STEP[:SECONDS]: the lighthouse killed, a new one started after SECONDS (never without)")
    parser.add_argument("--stall", action="append", default=[],
                        help="RANK:STEP:SECONDS: SIGSTOP the rank's processes once STEP is committed, SIGCONT after SECONDS "
                             "(a straggler); RANK:STEP:end: SIGCONT once every other replica has ended (a stall that "
                             "outlasts the run: the replica wakes behind a finished run and stops without training)")
    config_mod.add_flag(parser, "group-size", type=int, default=1,
                        help="processes per replica group, FSDP2 sharding the model among them (needs --shard fsdp)")
    config_mod.add_flag(parser, "min-step-s", type=float, default=0.0, help="pace steps to at least this long (so kills land)")
    parser.add_argument("--chaos", metavar="SEED[:RATE]",
                        help=f"random failure events, RATE per minute (default {chaos.DEFAULT_RATE:g}), drawn from SEED "
                             "(the kinds and their weights: below)")
    parser.add_argument("--no-fork-server", "--no_fork_server", dest="fork_server", action="store_false", default=None,
                        help="every replica process a fresh interpreter (see --fork_server)")
    config_mod.add_flag(parser, "fork_server", action="store_true", default=None,
                        help="start every replica process as a fork of one that has done the imports (a restart then "
                             "skips the interpreter's start and the imports, 3-9 s on 2 busy CPU cores); default: on "
                             "the CPU on Linux, off on CUDA (a process must see its GPU before torch first looks at "
                             "CUDA, and CUDA does not survive a fork)")
    config_mod.add_flag(parser, "max-restarts", type=int, default=MAX_RESTARTS,
                        help="restarts of a rank that crashes (exits with a status other than 2 and 3) before the launch stops")
    parser.add_argument("--resume", action="store_true", help="continue DIR's run, from DIR/checkpoint if there is "
                        "one (a rerun of the same command does so anyway; --resume insists that there is a run to continue)")
    parser.add_argument("--prepare", action="store_true",
                        help="replicas started by hand (multi-node): check the config, write DIR/config.json and exit")
    parser.add_argument("--merge", action="store_true",
                        help="after replicas started by hand: merge their files into DIR's metrics and summary")
    parser.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str] | None = None, restore_signals: bool = True) -> int:
    """The launcher (restore_signals=False: as a process, Ctrl-C stays ignored after the clean-up, until exit)."""
    parser = build_parser()

    def launch() -> int:
        supervisor = lighthouse = locked = None
        merged = False
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        original = {sig: signal.getsignal(sig) for sig in signals}
        try:
            from .runfiles import give_up, missing_folders, prepare_out
            from .runfolder import release_lock, take_lock
            from .train import parse_args as train_args

            args, rest = parser.parse_known_args(argv)
            if args.merge:
                return merge_by_hand(Path(args.out), rest or args.config or args.kill or args.resume or args.prepare)
            if args.prepare and (args.kill or args.chaos or args.stall):
                raise UsageError("--prepare: replicas started by hand are killed by hand (or by your cluster), not by "
                                 "--kill or --chaos")
            punisher_args = chaos.parse(args.chaos) if args.chaos else None
            if args.max_restarts < 0:
                raise UsageError(f"--max_restarts {args.max_restarts} must be at least 0")
            trainer_flags, overrides = train_args(rest)
            if trainer_flags.stop_after is not None:
                raise UsageError("mecefo.launch has no --stop_after: interrupt it (Ctrl-C) and continue with --resume")
            if overrides.get("backend", "torchft") != "torchft":
                raise UsageError(f"mecefo.launch runs the torchft backend; --backend {overrides['backend']} starts "
                                 "with python -m mecefo.train (see docs/training.md)")
            cfg = config_mod.load(args.config, {**overrides, "backend": "torchft"})
            out = Path(args.out)
            if not (math.isfinite(args.min_step_s) and args.min_step_s >= 0):
                raise UsageError(f"--min_step_s {args.min_step_s} must be a finite, non-negative number of seconds")
            cc = cfg.cluster
            if args.group_size < 1 or (args.group_size > 1 and cc.shard != "fsdp"):
                raise UsageError(f"--group_size {args.group_size}: a group of several processes shards the model, with "
                                 "--shard fsdp" if args.group_size > 1 else f"--group_size {args.group_size} must be at least 1")
            from .data import TokenData  # the token cache, built once here rather than by every replica
            from .train import check_memory, model_config, resolve_device

            vocab_size = TokenData(cfg.data).vocab_size
            import torch

            if args.prepare:  # the replicas run on other nodes: this one's memory and GPUs say nothing of theirs
                device, gpus = torch.device("cpu"), []
            else:
                device = resolve_device(cfg.train.device)
                check_memory(cfg, model_config(cfg, vocab_size)[0], device, cfg.data.micro_batch_size,
                             processes=cc.ranks * args.group_size if device.type == "cpu" else 1, shards=args.group_size)
                gpus = (launcher_gpus(cc.ranks, args.group_size, visible_gpus(torch.cuda.device_count()))
                        if device.type == "cuda" else [])
            if gpus and args.fork_server:
                raise UsageError("--fork_server: not on CUDA (the server imports torch before a replica knows its GPU, "
                                 "and CUDA does not survive a fork); drop it")
            schedule = failures.for_run(cfg)
            kills, down0 = kill_plan(schedule, args.kill, cc.ranks, args.group_size)
            kills += [parse_stall(spec, cc.ranks) for spec in args.stall]
            # everything else is checked: only now is the run folder read and written, under its lock (a resume cuts
            # the replicas' rows back to the checkpoint: never while another launch writes them)
            made = missing_folders(out)
            locked = take_lock(out)
            try:
                decision = prepare_out(out, cfg, args.resume)  # mecefo.train's rule for an existing OUT
                if len(down0) == cc.ranks and not decision["started"]:  # (a resumed run starts everyone at once)
                    raise UsageError("every rank is down at step 0 under this schedule; nothing can start")
            except BaseException:
                locked = None
                give_up(out, made)
                raise
            if decision["finished"] is not None:
                print(f"{out} holds this config's finished run (summary.json): reused, nothing launched", flush=True)
                return 0
            start_step = 0
            if decision["started"]:  # an interrupted run of this config: from its checkpoint, or from the start
                start_step = resume_point(out, cfg)
                kills = [k for k in kills if k.at_step is None or k.at_step > start_step]
                down0 = frozenset()  # everyone starts from the checkpoint
            (out / "replicas").mkdir(parents=True, exist_ok=True)
            for p in (out / "replicas").glob("rank*.status"):
                p.unlink()
            RunFiles(out, main=True).write_config(cfg)
            ensure_token(out)  # the run's token (mecefo.heal), mode 0600: a heal's peer must prove it
            if args.prepare:
                starter = ("python -m mecefo.ft" if cc.shard != "fsdp" else
                           f"torchrun --nproc_per_node {args.group_size} --master_addr $(hostname) --master_port PORT_R -m mecefo.ft")
                print(f"prepared {out}: on each node, for each of its ranks R, with N = {cc.ranks - len(down0)} ranks up "
                      f"at step 0:\n  MECEFO_FT_HOST=$(hostname) {starter} --out {out} --replica R "
                      f"--lighthouse http://LIGHTHOUSE_HOST:29510 --wait_for N\n(a restarted rank adds --rejoin); then "
                      f"python -m mecefo.launch --out {out} --merge", flush=True)
                return 0
            os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
            lighthouse = Lighthouse(out / "lighthouse.log")
            punisher = chaos.Punisher(*punisher_args, args.group_size, cfg.train.steps) if punisher_args else None
            supervisor = Supervisor(cfg, out, lighthouse, kills, args.min_step_s, args.quiet, furthest=start_step,
                                    group_size=args.group_size, max_restarts=args.max_restarts, chaos=punisher,
                                    fork_server=(device.type == "cpu" if args.fork_server is None else args.fork_server)
                                    and become_subreaper(),  # the run's events so far (a resumed run), then this launch's
                                    event_log=EventLog(out, "launch", fresh=not decision["started"]))
            supervisor.gpus = gpus
            supervisor.tensorboard = Path(trainer_flags.tensorboard) if trainer_flags.tensorboard else None
            if decision["started"]:
                supervisor.log(f"resumed from the checkpoint of step {start_step}", kind="resume", step=start_step)
            def on_signal(*_):  # Ctrl-C, a closed terminal, a scheduler's stop: all end the launch the same way
                if supervisor.polling:
                    supervisor.interrupt()
                else:
                    raise KeyboardInterrupt

            for sig in signals:  # (SIGINT too where it was inherited ignored, as in a background job)
                signal.signal(sig, on_signal)
            supervisor.run(down0)
            summary = merge(out, cfg, read_events(out), supervisor.t0)
            merged = True
            t, missing = summary["backend"]["timings"], summary["backend"]["not_rejoined"]
            left = summary["backend"]["left_behind"]
            print(f"done: {summary['backend']['kills']} kills; val loss {summary['final_val_loss']:.4f}; kill -> next step "
                  f"{_fmt(t['kill_to_step_s'])} s, restart -> rejoin {_fmt(t['restart_to_rejoin_s'])} s"
                  + (f"; not rejoined: {_not_rejoined(missing)}" if missing else "")
                  + (f"; left behind: {_left_behind(left)}" if left else "") + f" -> {out}", flush=True)
        finally:
            for sig in signals:  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            try:
                if supervisor is not None:
                    supervisor.stop()
                    if supervisor.board is not None:
                        supervisor.board.close()
                    if not merged:  # a launch that stops keeps its events for the records of a --resume
                        try:
                            atomic_write_json(out / "events.json", {"events": supervisor.events, "complete": False})
                        except OSError as e:  # (a full disk: the line that stops the launch says so)
                            print(f"note: {out / 'events.json'} could not be written ({e.strerror})", file=sys.stderr)
                if lighthouse is not None:
                    lighthouse.kill()
                if locked is not None:
                    release_lock(out)
            finally:
                for sig, handler in original.items():  # in-process callers (tests) get their handlers back
                    if restore_signals:
                        signal.signal(sig, handler)
        return 0

    return guarded(launch, "interrupted: every replica process was killed")


def merge_by_hand(out: Path, other_flags) -> int:
    """--merge: the records of a run whose replicas were started by hand (no supervisor: no kill events)."""
    if other_flags:
        raise UsageError("--merge takes only --out (the run's config is the one in DIR/config.json)")
    cfg = config_mod.build(read_config(out, "mecefo.launch --prepare"))
    summary = merge(out, cfg, read_events(out))  # (the node supervisors' starts, kills and deaths, where mecefo.slurm
    # ran the replicas; none where they were started by hand)
    t = summary["backend"]["timings"]
    print(f"merged {cfg.cluster.ranks} replicas' records: val loss {summary['final_val_loss']:.4f}; "
          f"{summary['backend']['kills']} kills; kill -> next step {_fmt(t['kill_to_step_s'])} s, restart -> rejoin "
          f"{_fmt(t['restart_to_rejoin_s'])} s" + (f"; left behind: {_left_behind(summary['backend']['left_behind'])}"
                                                     if summary["backend"]["left_behind"] else "") + f" -> {out}", flush=True)
    return 0


def _left_behind(left: list[dict]) -> str:
    return "; ".join(f"rank {x['rank']} (stalled, woke at step {x['woke_at_step']} after the run had finished at step "
                     f"{x['run_step']}, never rejoined)" for x in left)


def _not_rejoined(missing: list[dict]) -> str:
    return "; ".join(f"rank {m['rank']} (restarted {m['seconds_before_end']:.1f} s before the end, last seen "
                     f"{m['last_status']})" for m in missing)


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "-"


if __name__ == "__main__":
    code = main(restore_signals=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # every replica is dead and every file written: skip the interpreter's teardown, where a late
    # KeyboardInterrupt (a second Ctrl-C) or torchft's threads could hang it
