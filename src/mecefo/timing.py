"""Where a step's time goes: the phases of mecefo.train.Run's loop, timed on one clock that the membership and the
step engine share (Run.clock). A phase timed inside another is not counted in the outer one, so the phases of an
interval add up to it, and `other` is what no phase covers (the planning, the rows, the status files).

Phases: quorum (waiting for torchft's quorum and agreeing who is in it; 0 on the simulated backends), heal (applying
a live peer's state inside the quorum), refresh (the SVDs of V1 under low_rank_wgrad, once per tau-epoch, and on the
torch backend their broadcast from the rank that computed each), compute (forward and backward of this process's
pieces, FSDP2's reduce-scatter within a group included), exchange (the all-reduce of the gradient sums across ranks or replica groups), commit
(torchft's should_commit), update (the optimizer step), evaluate, checkpoint, pace (the sleep that paces a step
to mecefo.launch's --min_step_s). A quorum in which this process healed is counted as heal, the transfer included.

Each metrics row's "timing" covers the interval since the previous row: a voided step's attempt and the previous
step's checkpoint write land in the next row (a row is written before its step's checkpoint, so that a resume never
lacks the row of the step it resumes from). The summary's "timing" holds the totals and their shares of the run's time.
On CUDA a phase ends where the host next waits for the GPU (a loss read, a collective's wait): kernels still running
at a phase's end are counted in the phase that waits for them."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

PHASES = ("quorum", "heal", "refresh", "compute", "exchange", "commit", "update", "evaluate", "checkpoint", "pace")


class Clock:
    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.since_row = dict.fromkeys(PHASES, 0.0)
        self.started = self.row_started = time.perf_counter()
        self._inner = []  # seconds spent in phases nested in each open phase
        self._thread = threading.get_ident()  # the loop's thread; time spent in other threads is not the step's

    @contextmanager
    def __call__(self, phase: str):
        """Time the block as `phase`, less the phases timed inside it."""
        if threading.get_ident() != self._thread:
            yield
            return
        t0 = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - t0
            self.add(phase, elapsed - self._inner.pop(), elapsed)

    def add(self, phase: str, seconds: float, outer: float | None = None) -> None:
        """Count `seconds` as `phase` (and `outer`, default the same, as nested time of the enclosing phase)."""
        self.totals[phase] += seconds
        self.since_row[phase] += seconds
        if self._inner:
            self._inner[-1] += seconds if outer is None else outer

    def row(self) -> dict:
        """The interval since the previous row, by phase (seconds, rounded to the microsecond); starts the next."""
        now = time.perf_counter()
        out = _shares_of(self.since_row, now - self.row_started, shares=False)
        self.since_row, self.row_started = dict.fromkeys(PHASES, 0.0), now
        return out

    def summary(self) -> dict:
        """The run's totals (this process's, since its start) and each phase's share of the total."""
        return _shares_of(self.totals, time.perf_counter() - self.started, shares=True)


def rows_total(timings: list[dict]) -> dict:
    """The totals and shares of a run's rows' timing entries (the merge of torchft's replicas: the committed history)."""
    phases = {k: sum(t.get(f"{k}_s", 0.0) for t in timings) for k in PHASES}
    return _shares_of(phases, sum(t["total_s"] for t in timings), shares=True)


def _shares_of(phases: dict, total: float, shares: bool) -> dict:
    out = {f"{k}_s": round(v, 6) for k, v in phases.items()}
    out["other_s"] = round(max(total - sum(phases.values()), 0.0), 6)
    out["total_s"] = round(total, 6)
    if shares:
        out["share"] = {k: round(v / total, 4) if total > 0 else 0.0 for k, v in phases.items()} | {
            "other": round(out["other_s"] / total, 4) if total > 0 else 0.0}
    return out
