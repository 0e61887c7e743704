"""Faults injected into a torchft replica by the tests, as one object handed to its membership (`mecefo.ft.FtMembership`),
as torchft's own tests hand failure injectors to their managers.

A replica is a process of its own, so the tests name the faults in its environment; they are read once, when the
replica starts (`Faults.from_environ`), never on the step path. Every fault but VOID_FROM and the heal delay is
injected into a replica's first life only (a restarted replica, --rejoin, runs clean):

  MECEFO_FT_FAULT_VOID_FROM=STEP        every step from STEP on fails (a persistent fault)
  MECEFO_FT_FAULT_DIE_IN_QUORUM=R[,R..]:STEP[;...]   these ranks SIGKILL themselves the moment the first new quorum (a
                                        changed membership) at or after step STEP forms, before its process group is
                                        built: the survivors then meet a dead member at the quorum's store
  MECEFO_FT_FAULT_CRASH=R:STEP          rank R raises an exception at step STEP (a crash: exit status 1)
  MECEFO_FT_FAULT_HEAL=R/J              process J of rank R's replica group fails its heals (its source "died")
  MECEFO_FT_FAULT_ABANDON=R:STEP        rank R leaves step STEP's exchange without a collective (an error of its own,
                                        alive): its peers are left blocked in the collective on it
  MECEFO_FT_FAULT_LONE_COMMIT=R:STEP    only rank R commits step STEP (every other replica's commit fails after the
                                        exchange, as when a dying peer's last message reached R alone) and R dies right
                                        after writing its row: the others redo the step without it, and R, restarted,
                                        heals past it
  MECEFO_FT_HEAL_DELAY_S=SECONDS        hold a process's first healing so that it can be killed then (with
                                        MECEFO_FT_HEAL_DELAY_EVERY set: every healing)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

VOID_FROM = "MECEFO_FT_FAULT_VOID_FROM"
DIE_IN_QUORUM = "MECEFO_FT_FAULT_DIE_IN_QUORUM"
CRASH = "MECEFO_FT_FAULT_CRASH"
HEAL = "MECEFO_FT_FAULT_HEAL"
ABANDON = "MECEFO_FT_FAULT_ABANDON"
LONE_COMMIT = "MECEFO_FT_FAULT_LONE_COMMIT"
HEAL_DELAY = "MECEFO_FT_HEAL_DELAY_S"
HEAL_DELAY_EVERY = "MECEFO_FT_HEAL_DELAY_EVERY"


def _rank_step(value: str) -> tuple[int, int] | None:
    rank, _, step = value.partition(":")
    return (int(rank), int(step)) if rank and step else None


@dataclass
class Faults:
    """The faults of one replica (rank `rank`, process `process` of its group); Faults() injects none."""

    rank: int = -1
    process: int = 0
    void_from: int | None = None
    die_in_quorum: list = field(default_factory=list)  # (ranks, step) pairs
    crash: tuple | None = None
    heal: tuple | None = None  # (rank, process)
    abandon: tuple | None = None
    lone_commit: tuple | None = None
    heal_delay_s: float = 0.0
    heal_delay_every: bool = False
    fired: set = field(default_factory=set)  # the once-only faults that fired

    @classmethod
    def from_environ(cls, rank: int, process: int, rejoin: bool, environ=os.environ) -> Faults:
        """The faults the environment names for this replica (see the module's docstring)."""
        first = not rejoin
        get = environ.get
        return cls(
            rank, process,
            void_from=int(get(VOID_FROM)) if get(VOID_FROM) else None,
            die_in_quorum=[({int(r) for r in ranks.split(",")}, int(step))
                           for ranks, _, step in (s.partition(":") for s in get(DIE_IN_QUORUM, "").split(";") if s)]
            if first else [],
            crash=_rank_step(get(CRASH, "")) if first else None,
            heal=tuple(int(x) for x in get(HEAL).split("/")) if first and get(HEAL) else None,
            abandon=_rank_step(get(ABANDON, "")) if first else None,
            lone_commit=_rank_step(get(LONE_COMMIT, "")) if first else None,
            heal_delay_s=float(get(HEAL_DELAY, "0") or 0), heal_delay_every=bool(get(HEAL_DELAY_EVERY)))

    def _once(self, name: str) -> bool:
        if name in self.fired:
            return False
        self.fired.add(name)
        return True

    def voids(self, step: int) -> str | None:
        """Why the step after `step` (the manager's current step) fails, if it does."""
        return f"a persistent fault ({VOID_FROM}={self.void_from})" if self.void_from is not None and step >= self.void_from else None

    def dies_in_quorum(self, changed: bool, max_step: int) -> bool:
        return changed and any(self.rank in ranks and max_step >= step for ranks, step in self.die_in_quorum)

    def crashes(self, step: int) -> str | None:
        if self.crash is not None and self.crash[0] == self.rank and step >= self.crash[1]:
            return f"an injected crash at step {step} ({CRASH})"
        return None

    def heal_fails(self) -> bool:
        return self.heal == (self.rank, self.process)

    def abandons(self, step: int) -> str | None:
        """Why this replica leaves the exchange of the step after `step` without a collective (once)."""
        if self.abandon == (self.rank, step + 1) and self._once("abandon"):
            return f"an injected abandoned exchange ({ABANDON})"
        return None

    def refuses_commit(self, step: int) -> str | None:
        """Why this replica's commit of the step after `step` fails (once): another rank commits it alone."""
        if self.lone_commit is not None and self.lone_commit[0] != self.rank and step + 1 == self.lone_commit[1] \
                and self._once("lone_commit"):
            return f"an injected failed commit ({LONE_COMMIT})"
        return None

    def dies_after_commit(self, step: int) -> bool:
        """Whether this replica dies right after writing the row of `step` (it committed it alone)."""
        return self.lone_commit == (self.rank, step)

    def heal_delay(self, healed_before: bool) -> float:
        return self.heal_delay_s if not healed_before or self.heal_delay_every else 0.0
