"""Fault-tolerance policies: one module per policy, found by a registry.

A policy is a subclass of `Policy` registered with `@register`. It says
- for the trainer: who computes which rows of whose micro-batches at a step (`cover`, turned into a
  StepPlan by `plan`), and what it does around a step (`before_step` may send the run back to an earlier
  step, `after_step` may keep a snapshot); it owns the state it needs (`state_dict` / `load_state_dict`,
  written into every checkpoint);
- for the throughput simulator (mecefo.simulator): the time breakdown and trained tokens of a step with a
  given set of failed GPUs (`sim_step`), the pause a failure or a recovery event costs (`sim_on_failure`,
  `sim_on_recovery`), and, for policies that roll back, a checkpoint interval (`sim_checkpoint_interval`).
The trainer, the torch backends, the simulator, the sweep, the figures and the CLI all enumerate the
registry; nothing else lists policies.

Discovery: every module of this package is imported, and so is every module named in the environment
variable MECEFO_POLICY_MODULES (comma-separated import paths). A policy outside this package (yours, or a
test's) joins the trainer, the simulator, the sweep and the CLI by being named there, without a change to
any file of the repository.
"""

from __future__ import annotations

import importlib
import math
import os
import pkgutil
from typing import ClassVar

import numpy as np

from ..errors import TrainingStopped, UsageError
from ..neighbour import MECEFO, Techniques
from ..plan import NORMAL, Piece, StepPlan, assign_neighbours, whole

_REGISTRY: dict[str, type["Policy"]] = {}
_LOADED: set[str] = set()


class Policy:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line: the README's policy table and `python -m mecefo.train --help`
    order: ClassVar[int] = 100  # position in tables
    trains: ClassVar[bool] = True  # the trainer can run it (False: a throughput model only)
    exact: ClassVar[bool] = False  # computes every sample exactly: its quality is failure-free training's
    rolls_back: ClassVar[bool] = False  # before_step may send the run back to an earlier step

    def __init__(self, config=None, techniques=None):
        """config: the run's mecefo.cluster.ClusterConfig (None in the simulator and in tools); techniques:
        what neighbours apply (default: config.techniques, else MeCeFO's three)."""
        self.config = config
        self.techniques = techniques if techniques is not None else techniques_of(config)

    @classmethod
    def validate(cls, config) -> None:
        """Refuse a ClusterConfig this policy cannot run (raise UsageError)."""

    # ------------------------------------------------------------------ trainer
    def effective_failed(self, failed: frozenset[int]) -> frozenset[int]:
        """The ranks that compute nothing this step (a policy with spare nodes: none)."""
        return failed

    def cover(self, failed: frozenset[int], alive: list[int], pieces: dict[int, tuple[Piece, ...]],
              accum: int, batch: int) -> dict[int, int]:
        """Add the pieces that cover the failed ranks' micro-batches to `pieces` (alive rank -> its pieces,
        its own micro-batches already there); return failed rank -> neighbour, where there is one."""
        return {}

    def plan(self, step: int, failed: frozenset[int], n: int, accum: int, batch: int,
             all_down: str = "skip") -> StepPlan:
        """Who computes what at this step; with every rank down the step is skipped (or, under
        all_down='error', training stops naming the step)."""
        failed = self.effective_failed(failed)
        alive = [r for r in range(n) if r not in failed]
        if not alive:
            if all_down == "error":
                raise TrainingStopped(f"step {step + 1}: all {n} ranks are down (cluster.all_down='error')")
            return StepPlan(step, failed, {}, {}, skipped=True)
        pieces = {r: whole(r, accum, batch) for r in alive}
        neighbours = self.cover(failed, alive, pieces, accum, batch) if failed else {}
        return StepPlan(step, failed, neighbours, pieces)

    def before_step(self, step: int, schedule, model, optimizer) -> int | None:
        """Called before step `step` runs; return an earlier step to continue from instead (rollback)."""
        return None

    def after_step(self, step: int, model, optimizer) -> None:
        """Called once `step` steps are done."""

    @property
    def replayed_steps(self) -> int:
        return 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ---------------------------------------------------------------- simulator
    def sim_step(self, job, cost, failed: frozenset[int], t: float, sim: dict) -> tuple[dict, float, float | None]:
        """(time breakdown of one step, trained tokens, the time until which this holds or None) with the
        failed GPUs held fixed. `cost.parts()` is the failure-free breakdown; `sim` is this run's scratch
        state (shared with the event hooks)."""
        return cost.parts(), float(job.tokens_per_step), None

    @classmethod
    def sim_validate(cls, job) -> None:
        """Refuse a simulator Job this policy cannot run (raise ValueError)."""

    def sim_job(self, job):
        """The job this policy runs on the same GPUs (a policy that needs another layout changes it)."""
        return job

    def sim_on_failure(self, job, unit: int, down: frozenset[int], t: float, sim: dict) -> float:
        """Seconds of pause when GPU `unit` fails (`down`: the GPUs down before it). The rule shared by
        every policy whose communicator changes: one re-formation, job.const('reform_s')."""
        return job.const("reform_s")

    def sim_on_recovery(self, job, unit: int, down: frozenset[int], t: float, sim: dict) -> float:
        """Seconds of pause when GPU `unit` comes back (`down`: the GPUs still down); it rejoins the
        communicator: the same rule."""
        return job.const("reform_s")

    def sim_checkpoint_interval(self, job, cost, mtbf_s: float) -> int | None:
        """Steps between checkpoints; a policy that returns one rolls back to the last checkpoint at every
        failure (the simulator then discards the steps since it)."""
        return None


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy known by its name."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    held = _REGISTRY.get(cls.name)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
        raise UsageError(f"policy {cls.name!r} of {cls.__module__}.{cls.__qualname__} would replace "
                         f"{held.__module__}.{held.__qualname__}; give it another name")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> None:
    modules = [f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)]
    modules += [m.strip() for m in os.environ.get("MECEFO_POLICY_MODULES", "").split(",") if m.strip()]
    for module in modules:
        if module not in _LOADED:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise UsageError(f"MECEFO_POLICY_MODULES: cannot import {module!r} ({e})") from None
            _LOADED.add(module)


def unregister(module: str) -> None:
    """Forget the policies a module (of MECEFO_POLICY_MODULES) registered, and the module, so that it is
    imported again by the next look-up (a reloaded notebook's policy; the tests' example)."""
    for name in [n for n, cls in _REGISTRY.items() if cls.__module__ == module]:
        del _REGISTRY[name]
    _LOADED.discard(module)
    import sys

    sys.modules.pop(module, None)


def registry() -> dict[str, type[Policy]]:
    """name -> policy class, in table order."""
    _load()
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (kv[1].order, kv[0])))


def trainer_policies() -> tuple[str, ...]:
    return tuple(n for n, cls in registry().items() if cls.trains)


def simulator_policies() -> tuple[str, ...]:
    return tuple(registry())


def plan_step(name: str, step: int, failed: frozenset[int], n: int, accum: int, batch: int, techniques=None,
              all_down: str = "skip") -> StepPlan:
    """One step's plan under the registered policy `name` (for tools and tests; the trainer keeps one
    policy object for the whole run)."""
    return get(name, trainer=True)(techniques=techniques).plan(step, failed, n, accum, batch, all_down)


def get(name: str, trainer: bool = False) -> type[Policy]:
    """The policy class called `name`, or a UsageError listing the allowed names."""
    allowed = trainer_policies() if trainer else simulator_policies()
    if name not in allowed:
        raise UsageError(f"cluster.policy={name!r}; allowed: {', '.join(allowed)}")
    return registry()[name]


def table() -> str:
    """The README's policy table, from the registry."""
    lines = ["| policy | what it does | trainer | simulator | exact |", "|---|---|---|---|---|"]
    for name, cls in registry().items():
        lines.append(f"| `{name}` | {cls.summary} | {'yes' if cls.trains else 'no'} | yes | {'yes' if cls.exact else 'no'} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ shared by several policies
def neighbour_cover(failed, alive, pieces, accum, batch, techniques) -> dict[int, int]:
    """Neighbour-do-both: each failed rank's neighbour (mecefo.plan.assign_neighbours) computes its own and
    the failed rank's micro-batches, both with `techniques`."""
    neighbours = assign_neighbours(failed, len(alive) + len(failed))
    for j, nb in neighbours.items():
        pieces[nb] = tuple(Piece(p.owner, p.micro, p.start, p.stop, p.batch, techniques) for p in pieces[nb]) \
            + whole(j, accum, batch, techniques)
    return neighbours


def spread_cover(failed, alive, pieces, accum, batch, techniques) -> dict[int, int]:
    """Each failed rank's micro-batches split evenly by rows over all alive ranks, with `techniques` on
    the extra shares only."""
    bounds = np.linspace(0, batch, len(alive) + 1).round().astype(int)
    for j in sorted(failed):
        for i, r in enumerate(alive):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            if hi > lo:
                pieces[r] = pieces[r] + tuple(Piece(j, m, lo, hi, batch, techniques) for m in range(accum))
    return {}


def neighbour_load(failed: frozenset[int], job) -> int:
    """The most failed GPUs one GPU covers under the neighbour rule (nobody covers two while an alive peer
    of the stage covers none): ceil(f_s / (dp - f_s)) for the worst stage s; dp if a stage has nobody left."""
    worst = 0
    for stage in {u % job.pp for u in failed}:
        f = sum(1 for u in failed if u % job.pp == stage)
        worst = max(worst, job.dp if f >= job.dp else math.ceil(f / (job.dp - f)))
    return worst


def techniques_of(config):
    """The techniques a run's neighbours apply (cluster.techniques), MeCeFO's three by default."""
    return MECEFO if config is None else Techniques.parse(config.techniques)


__all__ = ["NORMAL", "Policy", "register", "registry", "get", "plan_step", "table", "trainer_policies",
           "simulator_policies"]
