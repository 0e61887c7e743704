"""Randomized failures for the torchft backend: `mecefo.launch --chaos SEED[:RATE]` (after torchft's punisher,
but with events beyond a plain kill), and the event distribution the chaos harness (experiments.chaos) draws.

Events arrive as a Poisson process in wall-clock time, RATE per minute (default 6), from the first committed
step until the last 30% of the steps (a quiet tail, so that the restarts an event causes can rejoin and the
end state is checked). Each event's kind is drawn with the weights of KINDS, its targets among the ranks that hold the
run's state at that moment (training: not stalled, not still joining; never the last of them, but for `all`), every
draw from one numpy generator seeded
with SEED. An event that waits for a moment (an evaluation, a checkpoint write, the rank it killed healing or
joining again) waits at most ARMED_S and is then dropped (recorded as expired). A killed rank is restarted after U(0, RESTART_S)
seconds, unless the kind says otherwise. Every event is recorded in its supervisor's event log (kind "chaos";
mecefo.supervise: the launcher's, merged into events.json). The Slurm watcher (mecefo.slurm watch --chaos) draws from
the same generator the kinds a node's supervisor can fire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import UsageError
from .runfiles import CHECKPOINTING, EVALUATING, HEALING, WAITING

RESTART_S = 2.0  # a killed rank is restarted after U(0, RESTART_S) s
STALL_S = (2.0, 6.0)  # a stalled rank is stopped for U(*STALL_S) s
# a long stall: longer than torchft's timeouts (30 s: its collectives, connections and quorum tries), the lighthouse's
# join wait (20 s) and the grace for a restarted lighthouse (11 s)
LONG_STALL_S = (35.0, 50.0)
LIGHTHOUSE_DOWN_S = (1.0, 3.0)  # the lighthouse is restarted after U(*LIGHTHOUSE_DOWN_S) s
ARMED_S = 15.0  # an event waiting for its moment is dropped after this long
QUIET_TAIL = 0.3  # no event starts in the last 30% of the steps
DEFAULT_RATE = 6.0  # events per minute


@dataclass(frozen=True)
class Kind:
    name: str
    weight: float
    what: str
    groups_only: bool = False


KINDS = (
    Kind("kill", 0.22, "SIGKILL one rank's replica (its whole group: a node lost), restarted after U(0, 2) s"),
    Kind("kill_process", 0.10, "SIGKILL one process of a replica group (the launcher takes the group down), restarted "
         "after U(0, 2) s", groups_only=True),
    Kind("multi_kill", 0.12, "SIGKILL k ranks at once, k uniform in 2 .. (running ranks - 1), each restarted after U(0, 2) s"),
    Kind("kill_healing", 0.10, "SIGKILL a rank (restarted after U(0, 2) s), then again while it heals, as it applies the "
         "state it received; restarted at once"),
    Kind("kill_writer", 0.08, "SIGKILL the rank that evaluates and writes (the lowest running rank) during its next "
         "evaluation or checkpoint write; restarted after U(0, 2) s"),
    Kind("kill_store", 0.08, "SIGKILL a rank (restarted after U(0, 2) s), then, as it joins again, the rank whose TCPStore "
         "the new quorum uses (the training rank whose replica id sorts first): the quorum changes on a dead store; "
         "restarted after U(0, 2) s"),
    Kind("kill_checkpoint", 0.05, "SIGKILL the rank writing a checkpoint, during the write; restarted after U(0, 2) s"),
    Kind("external", 0.10, "SIGKILL a rank's process from outside the launcher's plan (as an OOM killer would): the launcher "
         "sees an unplanned death and restarts the rank at once"),
    Kind("stall", 0.10, "SIGSTOP one rank's processes for U(2, 6) s, then SIGCONT (a straggler, not a death)"),
    Kind("long_stall", 0.04, "SIGSTOP one rank's processes for U(35, 50) s, longer than torchft's timeouts (30 s) and the "
         "lighthouse's join wait (20 s): a GC pause, swap, a VM migration, an NFS hang; it heals from the others when it "
         "wakes"),
    Kind("stall_past_end", 0.03, "SIGSTOP one rank's processes until every other replica has ended (a stall that outlasts "
         "the run): it wakes behind a finished run, stops without training and is named (backend.left_behind)"),
    Kind("lighthouse", 0.03, "kill the lighthouse and start a new one on the same address after U(1, 3) s (its state is lost)"),
    Kind("all", 0.02, "SIGKILL every rank at once once a checkpoint exists: the launch stops (exit 3) and --resume continues"),
)


def kinds(group_size: int, can: frozenset[str] | None = None) -> tuple[Kind, ...]:
    """The kinds drawn for replica groups of group_size processes by a supervisor that can fire `can` (None: all)."""
    return tuple(k for k in KINDS if (group_size > 1 or not k.groups_only) and (can is None or k.name in can))


def parse(spec: str) -> tuple[int, float]:
    """--chaos SEED[:RATE] -> (seed, events per minute)."""
    seed, _, rate = spec.partition(":")
    try:
        seed_v, rate_v = int(seed), float(rate) if rate else DEFAULT_RATE
    except ValueError:
        raise UsageError(f"--chaos {spec!r}: expected SEED[:RATE] (an integer seed, events per minute)") from None
    if seed_v < 0 or not (math.isfinite(rate_v) and rate_v > 0):
        raise UsageError(f"--chaos {spec!r}: the seed must be >= 0 and the rate a positive number of events per minute")
    return seed_v, rate_v


def describe() -> str:
    """The distribution, for --help and the README."""
    total = sum(k.weight for k in KINDS)
    return "\n".join(f"  {k.name} ({100 * k.weight / total:.0f}%{', groups only' if k.groups_only else ''}): {k.what}"
                     for k in KINDS)


class Punisher:
    """Draws and fires the events of one run. Its supervisor (mecefo.launch's, or mecefo.slurm's watcher) calls
    poll() every tick; poll acts through the supervisor's verbs (kill, restart_after, kill_unplanned, stall,
    restart_lighthouse: those of the kinds in `can`, None: every kind) and reads its view (committed(), training(),
    alive(), statuses(), has_checkpoint()), and records each event with its log(message, **event)."""

    def __init__(self, seed: int, rate_per_min: float, group_size: int, steps: int, can: frozenset[str] | None = None):
        self.rng, self.rate, self.group_size = np.random.default_rng(seed), rate_per_min, group_size
        self.kinds = kinds(group_size, can)
        weights = np.array([k.weight for k in self.kinds])
        self.p = weights / weights.sum()
        self.quiet_from = int(math.ceil(steps * (1 - QUIET_TAIL)))
        self.next_at, self.armed, self.victim, self.fired = None, None, None, []

    def _gap(self) -> float:
        return float(self.rng.exponential(60.0 / self.rate))

    def poll(self, sup, now: float) -> None:
        step = sup.committed()
        if step < 1 or step >= self.quiet_from:
            return
        if self.next_at is None:
            self.next_at = now + self._gap()
        if self.armed is not None:
            kind, since = self.armed
            if self._fire(kind, sup):
                self.armed, self.victim, self.next_at = None, None, now + self._gap()
            elif now - since > ARMED_S:
                self._record(sup, kind, "expired", f"its moment did not come within {ARMED_S:g} s")
                self.armed, self.victim, self.next_at = None, None, now + self._gap()
            return
        if now < self.next_at:
            return
        kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.p))]
        if self._fire(kind, sup):
            self.next_at = now + self._gap()
        else:
            self.armed = (kind, now)

    def _record(self, sup, kind: Kind, outcome: str, detail: str, **extra) -> None:
        self.fired.append({"kind": kind.name, "outcome": outcome})
        sup.log(f"chaos: {kind.name} {outcome}: {detail}", kind="chaos", chaos=kind.name, outcome=outcome,
                detail=detail, step=sup.committed(), **extra)

    def _restart_delay(self) -> float:
        return float(self.rng.uniform(0, RESTART_S))

    def _fire(self, kind: Kind, sup) -> bool:
        """Fire the event if its moment has come (True), else leave it armed (False). Its targets are drawn among the
        ranks that hold the run's state (training: not stalled, not still joining), never the last of them but by
        `all`; a two-phase event (kill_healing, kill_store) first kills a victim, then waits for its return."""
        training, status = sup.training(), sup.statuses()
        name = kind.name
        if name == "all":
            if not sup.has_checkpoint():
                return False
            everyone = sup.alive()  # the stalled and the joining ones too
            self._record(sup, kind, "fired", f"ranks {everyone} killed at once", ranks=everyone)
            for r in everyone:
                sup.kill(r, "chaos: all")
            return True
        if name == "lighthouse":
            down = float(self.rng.uniform(*LIGHTHOUSE_DOWN_S))
            self._record(sup, kind, "fired", f"lighthouse down for {down:.1f} s", down_s=down)
            sup.restart_lighthouse(down)
            return True
        if name in ("kill_healing", "kill_store") and self.victim is None:
            if len(training) < 2:
                return False
            self.victim = int(self.rng.choice(training))  # first the rank whose return is the moment
            self._kill(sup, kind, [self.victim], phase="first")
            return False
        if name == "kill_healing":
            if status.get(self.victim) == HEALING and self.victim in sup.alive():
                self._kill(sup, kind, [self.victim], restart=0.0, phase="while healing")
                return True
            return False
        if name == "kill_store":
            first = sorted(training, key=lambda r: f"mecefo_{r}:")  # as torchft sorts its ids "mecefo_R:<uuid>"
            if status.get(self.victim) == WAITING and self.victim in sup.alive() and len(first) >= 2:
                self._kill(sup, kind, first[:1], joining=self.victim, phase="the store's host")
                return True
            return False
        if len(training) < 2:  # never the last rank that holds the state
            return False
        if name in ("kill", "kill_process", "external", "stall", "long_stall", "stall_past_end"):
            r = int(self.rng.choice(training))
            if name == "kill":
                self._kill(sup, kind, [r])
            elif name == "kill_process":
                self._kill(sup, kind, [r], process=int(self.rng.integers(self.group_size)))
            elif name == "external":
                self._record(sup, kind, "fired", f"rank {r} killed outside the plan", ranks=[r])
                sup.kill_unplanned(r)
            elif name == "stall_past_end":
                self._record(sup, kind, "fired", f"rank {r} stopped until the others end", ranks=[r])
                sup.stall(r, math.inf)
            else:
                seconds = float(self.rng.uniform(*(STALL_S if name == "stall" else LONG_STALL_S)))
                self._record(sup, kind, "fired", f"rank {r} stopped for {seconds:.1f} s", ranks=[r], stall_s=seconds)
                sup.stall(r, seconds)
            return True
        if name == "multi_kill":
            if len(training) < 3:
                return False
            k = int(self.rng.integers(2, len(training)))
            self._kill(sup, kind, sorted(int(r) for r in self.rng.choice(training, size=k, replace=False)))
            return True
        if name in ("kill_writer", "kill_checkpoint"):
            busy = (CHECKPOINTING,) if name == "kill_checkpoint" else (EVALUATING, CHECKPOINTING)
            writing = [r for r in training if status.get(r) in busy]
            if writing:
                self._kill(sup, kind, writing[:1])
            return bool(writing)
        raise ValueError(f"unknown chaos kind {name}")

    def _kill(self, sup, kind: Kind, ranks: list[int], process: int | None = None, restart: float | None = None,
              **extra) -> None:
        delays = [self._restart_delay() if restart is None else restart for _ in ranks]
        who = f"process {process} of rank {ranks[0]}" if process is not None else f"rank(s) {ranks}"
        self._record(sup, kind, "fired", f"{who} killed, restarted after {', '.join(f'{d:.1f}' for d in delays)} s",
                     ranks=ranks, process=process, restart_after_s=delays, **extra)
        for r, d in zip(ranks, delays):
            sup.kill(r, f"chaos: {kind.name}", process)
            sup.restart_after(r, d)
