"""Failure scenarios (the paper's Table 1), a seeded process turning one into failed ranks per step, and
traces in the CSV format of Bamboo's and Oobleck's public traces (`t_ms,add|remove,nodeN`, no header).

Table 1 is stated for a 32-rank cluster: a new failure every `interval_h` hours, each failed rank recovering
after `recovery_h` hours. We keep the per-rank failure rate, 1 / (32 interval_h) per hour, so n ranks see
failures arrive as a Poisson process of rate n / (32 interval_h) per hour; each arrival takes down a rank
drawn uniformly among the alive ranks that can fail (all, or a fixed subset in asymmetric mode), for a
fixed (or, optionally, exponential) recovery time. By Little's law the expected fraction of failed ranks
is about recovery_h / (32 interval_h): 6.25 % (low), 9.4 % (mid), 12.5 % (high).
Hours become steps through `seconds_per_step`: rank r is failed at step s if it is down at time s * seconds_per_step.

Start: 'stationary' (the trainer's default) runs the same process from 10 recovery times before step 0
and keeps what overlaps the run, so that at step 0 each rank is already down with the stationary
probability, with the residual recovery time the process itself gives it (uniform on (0, R) for a fixed
recovery R, exponential for exponential recovery); 'cold' starts with every rank alive, so that over a
run of H hours the failed fraction is only about 1 - R / (2H) of the stationary one.
"""

from __future__ import annotations

import bisect
import csv
import heapq
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UsageError

REFERENCE_RANKS = 32


@dataclass(frozen=True)
class FailureScenario:
    name: str
    interval_h: float  # a new failure every ... hours on a REFERENCE_RANKS-rank cluster (inf: never)
    recovery_h: float  # a failed rank recovers after ... hours

    def expected_failed_fraction(self) -> float:
        """Little's law: arrivals per rank-hour x hours down."""
        return 0.0 if self.interval_h == float("inf") else min(1.0, self.recovery_h / (REFERENCE_RANKS * self.interval_h))

    def expected_events(self, n_ranks: int, hours: float) -> float:
        return 0.0 if self.interval_h == float("inf") else n_ranks * hours / (REFERENCE_RANKS * self.interval_h)


SCENARIOS = {
    "none": FailureScenario("none", float("inf"), 0.0),
    "low": FailureScenario("low", 2.0, 4.0),
    "mid": FailureScenario("mid", 1.0, 3.0),
    "high": FailureScenario("high", 0.5, 2.0),
}


MAX_EXPECTED_ARRIVALS = 1e6  # a schedule that would draw more is refused (a mistyped interval or seconds_per_step)


@dataclass(frozen=True)
class Event:
    time_s: float
    kind: str  # "remove" (the rank fails) | "add" (the rank is back)
    rank: int


@dataclass(frozen=True)
class Schedule:
    """Failed ranks at each step, and the events they came from."""

    n_ranks: int
    failed: tuple[frozenset[int], ...]  # one entry per step
    events: tuple[Event, ...]
    seconds_per_step: float
    initially_down: frozenset[int] = frozenset()  # down at time 0 (their "remove" came before the run)

    def fraction_failed(self) -> float:
        return float(np.mean([len(f) for f in self.failed])) / self.n_ranks if self.failed else 0.0

    def failure_events(self) -> int:
        return sum(e.kind == "remove" for e in self.events)

    def after_warm_start(self, k: int) -> "Schedule":
        """This schedule shifted k steps later (its last k steps cut): the first k steps see no failure, a
        failure-free warm start that every policy of a seed shares; ranks down at its time 0 fail at step k."""
        if k <= 0:
            return self
        steps, shift = len(self.failed), k * self.seconds_per_step
        events = [Event(shift, "remove", r) for r in sorted(self.initially_down)]
        events += [Event(e.time_s + shift, e.kind, e.rank) for e in self.events]
        events = [e for e in events if e.time_s < steps * self.seconds_per_step]
        return Schedule(self.n_ranks, (frozenset(),) * min(k, steps) + self.failed[: max(steps - k, 0)], tuple(events),
                        self.seconds_per_step, frozenset())

    def new_failures(self, step: int) -> frozenset[int]:
        """Ranks that are failed at `step` and were not at step - 1."""
        before = self.failed[step - 1] if step > 0 else frozenset()
        return self.failed[step] - before


def arrivals(pool: tuple[int, ...], rng: np.random.Generator, begin: float, horizon: float, rate_per_s: float,
             draw_hours) -> list[Event]:
    """Poisson arrivals at rate_per_s from `begin` until `horizon` (seconds); each takes a rank drawn uniformly
    from the alive ones of `pool` (in pool order), down for draw_hours() hours; an arrival finding none alive is
    lost. Returns each failure's remove and add events, in arrival order. The alive ranks are kept as their
    positions in pool, sorted, and the down ones in a heap by when they come back: an arrival costs log(pool)."""
    where: dict[int, list[int]] = {}  # a rank's positions in pool (one, unless pool names it twice)
    for i, r in enumerate(pool):
        where.setdefault(r, []).append(i)
    alive, down, events = list(range(len(pool))), [], []
    t = begin + rng.exponential(1 / rate_per_s)
    while t < horizon:
        while down and down[0][0] <= t:  # back by now
            for i in where[heapq.heappop(down)[1]]:
                bisect.insort(alive, i)
        if alive:
            rank = pool[alive[rng.integers(len(alive))]]
            until = t + draw_hours() * 3600.0
            heapq.heappush(down, (until, rank))
            for i in where[rank]:
                del alive[bisect.bisect_left(alive, i)]
            events += [Event(t, "remove", rank), Event(until, "add", rank)]
        t += rng.exponential(1 / rate_per_s)
    return events


def generate(scenario: FailureScenario, n_ranks: int, steps: int, seconds_per_step: float, seed: int,
             recovery: str = "fixed", failable: tuple[int, ...] | None = None, start: str = "cold") -> Schedule:
    """Sample a schedule: Poisson arrivals at rate n / (32 interval_h) per hour (all arrivals land on the
    `failable` subset in asymmetric mode), the failed rank uniform among alive failable ranks (an arrival
    finding none alive is lost), recovery after recovery_h (fixed) or Exp(mean recovery_h); from a cold or
    a stationary start (module docstring)."""
    if recovery not in ("fixed", "exponential"):
        raise UsageError(f"cluster.recovery={recovery!r}; allowed: 'fixed', 'exponential'")
    if start not in ("stationary", "cold"):
        raise UsageError(f"cluster.failure_start={start!r}; allowed: 'stationary', 'cold'")
    pool = tuple(range(n_ranks)) if failable is None else tuple(failable)
    if any(not 0 <= r < n_ranks for r in pool):
        raise UsageError(f"cluster.failable={list(pool)} must name ranks in 0..{n_ranks - 1}")
    horizon = steps * seconds_per_step
    rng = np.random.default_rng([seed, n_ranks, 7919] + ([1] if start == "stationary" else []))
    events: list[Event] = []
    begin = -10 * scenario.recovery_h * 3600.0 if start == "stationary" else 0.0
    if scenario.interval_h != float("inf") and pool:
        rate_per_s = n_ranks / (REFERENCE_RANKS * scenario.interval_h * 3600.0)
        expected = rate_per_s * (horizon - begin)
        if not expected <= MAX_EXPECTED_ARRIVALS:  # refused before sampling (it would not end in reasonable time)
            raise UsageError(f"cluster.failures={scenario.name!r} over {steps} steps of {seconds_per_step:g} s on {n_ranks} "
                             f"ranks expects {expected:.3g} failure arrivals (more than {MAX_EXPECTED_ARRIVALS:.0e}); "
                             "lengthen the interval or shorten seconds_per_step")
        draw_hours = (lambda: scenario.recovery_h) if recovery == "fixed" else (lambda: rng.exponential(scenario.recovery_h))
        events = arrivals(pool, rng, begin, horizon, rate_per_s, draw_hours)
    pairs = zip(events[0::2], events[1::2])  # each failure: its remove, then its add
    down_at_0 = frozenset(rem.rank for rem, add in pairs if rem.time_s < 0 < add.time_s)
    events = [e for e in events if e.time_s >= 0]
    return from_events(n_ranks, steps, seconds_per_step, events, down_at_0)


def from_events(n_ranks: int, steps: int, seconds_per_step: float, events: list[Event],
                initially_down: frozenset[int] = frozenset()) -> Schedule:
    events = sorted(events, key=lambda e: e.time_s)  # stable: at equal times, in the order given
    down, failed, i = set(initially_down), [], 0
    for step in range(steps):
        t = step * seconds_per_step
        while i < len(events) and events[i].time_s <= t:
            (down.add if events[i].kind == "remove" else down.discard)(events[i].rank)
            i += 1
        failed.append(frozenset(down))
    return Schedule(n_ranks, tuple(failed), tuple(events), seconds_per_step, frozenset(initially_down))


def export_trace(schedule: Schedule, path: str | Path) -> None:
    """Write `t_ms,add|remove,nodeN` rows: every rank added at 0 ms (node{r+1} is rank r), then the events."""
    rows = [(0, "add", f"node{r + 1}") for r in range(schedule.n_ranks)]
    rows += [(0, "remove", f"node{r + 1}") for r in sorted(schedule.initially_down)]
    rows += [(round(e.time_s * 1000), e.kind, f"node{e.rank + 1}") for e in schedule.events]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def _csv_rows(f, path: Path):
    """csv rows of a text file, a UsageError for one that is not text (a binary file given as a trace)."""
    try:
        yield from csv.reader(f)
    except (UnicodeDecodeError, csv.Error) as e:
        raise UsageError(f"failure trace {path} is not a text CSV file ({type(e).__name__})") from None


def _parse_trace(path: Path) -> list[tuple[float, str, str]]:
    """The (seconds, add|remove, node) rows of a trace, in file order; a malformed row is a UsageError naming
    file:line."""
    if not path.is_file():
        raise UsageError(f"failure trace {path} does not exist")
    rows, lines = [], []
    with open(path, newline="", errors="strict") as f:
        for lineno, row in enumerate(_csv_rows(f, path), start=1):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 3 or row[1].strip() not in ("add", "remove") or not row[2].strip():
                raise UsageError(f"{path}:{lineno}: expected 't_ms,add|remove,node', got {','.join(row)!r}")
            try:
                t_ms = float(row[0])
            except ValueError:
                raise UsageError(f"{path}:{lineno}: time {row[0]!r} is not a number of milliseconds") from None
            if not math.isfinite(t_ms) or t_ms < 0:
                raise UsageError(f"{path}:{lineno}: time {row[0]!r} must be a finite, non-negative number of milliseconds")
            rows.append((t_ms / 1000.0, row[1].strip(), row[2].strip()))
            lines.append(lineno)
    added = {node for _, kind, node in rows if kind == "add"}
    for (_, kind, node), lineno in zip(rows, lines):
        if added and kind == "remove" and node not in added:  # (a trace that adds nobody: trace_slots says so)
            raise UsageError(f"{path}:{lineno}: removes node {node!r}, which the trace never adds")
    return rows


def trace_slots(rows: list[tuple[float, str, str]]) -> tuple[int, list[Event], frozenset[int]]:
    """A trace as a pool of P slots, P its largest number of nodes present at once: (P, slot events,
    slots down at 0). The rows at 0 ms set the start: nodes added take slots 0, 1, ... in order of first
    appearance, a node also removed at 0 ms leaves its slot down. Later, a removal frees the node's slot and
    a node added (a replacement, under a new name or its old one) takes its old slot if that is free, else
    the lowest free slot; rows at equal times apply in file order. A slot is down while no node holds it."""
    if not any(kind == "add" for _, kind, _ in rows):
        raise UsageError("the failure trace adds no node: nothing to train on")
    rows = sorted(rows, key=lambda r: r[0])  # stable: at equal times, file order (a node's own rows stay in order)
    present, peak = set(), 0
    for _, kind, node in rows:
        (present.add if kind == "add" else present.discard)(node)
        peak = max(peak, len(present))
    slot_of: dict[str, int] = {}
    holder: dict[int, str] = {}
    for t, kind, node in rows:  # the start: every row at 0 ms, removals of nodes not yet added ignored
        if t > 0:
            break
        if kind == "add" and node not in slot_of:
            slot_of[node] = len(slot_of)
        if kind == "add":
            holder[slot_of[node]] = node
        elif node in slot_of:
            holder.pop(slot_of[node], None)
    peak = max(peak, len(slot_of))
    down_at_0 = frozenset(range(peak)) - set(holder)
    events: list[Event] = []
    for t, kind, node in rows:
        if t == 0:
            continue
        if kind == "remove":
            s = slot_of.get(node)
            if s is not None and holder.get(s) == node:
                del holder[s]
                events.append(Event(t, "remove", s))
            continue
        if node in slot_of and holder.get(slot_of[node]) == node:
            continue  # added twice
        free = [s for s in range(peak) if s not in holder]
        s = slot_of[node] if slot_of.get(node) in free else free[0]
        slot_of[node], holder[s] = s, node
        events.append(Event(t, "add", s))
    return peak, events, down_at_0


def scale_to_ranks(slots: int, events: list[Event], down_at_0: frozenset[int], n_ranks: int) -> tuple[list[Event], frozenset[int]]:
    """Slot events of a P-slot pool as events of n ranks. P = n: rank r is slot r. Otherwise the down
    fraction is scaled: after each slot event round(n d / P) ranks are down (d the slots down), a change
    landing on the rank nearest the slot's scaled position floor(slot n / P) (the next alive one in ring
    order going down, the one mirroring the slot or else the longest down coming back)."""
    if slots == n_ranks:
        return events, down_at_0
    down_slots, down = set(), []
    target = lambda: round(n_ranks * len(down_slots) / slots)  # noqa: E731

    def take_down(home: int) -> int:
        r = next((home + k) % n_ranks for k in range(n_ranks) if (home + k) % n_ranks not in down)
        down.append(r)
        return r

    for s in sorted(down_at_0):
        down_slots.add(s)
        while len(down) < target():
            take_down(s * n_ranks // slots)
    initially = frozenset(down)
    out = []
    for e in events:
        (down_slots.add if e.kind == "remove" else down_slots.discard)(e.rank)
        home = e.rank * n_ranks // slots
        while len(down) < target():
            out.append(Event(e.time_s, "remove", take_down(home)))
        while len(down) > target():
            r = home if home in down else down[0]
            down.remove(r)
            out.append(Event(e.time_s, "add", r))
    return out, initially


def read_trace(path: str | Path, n_ranks: int, steps: int, seconds_per_step: float) -> Schedule:
    """Replay a trace (Bamboo's and Oobleck's `t_ms,add|remove,nodeN`) on n ranks: the trace is a pool of
    slots (trace_slots: replacements take free slots, so ranks come back) scaled to n ranks (scale_to_ranks)."""
    slots, events, down_at_0 = trace_slots(_parse_trace(Path(path)))
    events, initially_down = scale_to_ranks(slots, events, down_at_0, n_ranks)
    return from_events(n_ranks, steps, seconds_per_step, events, initially_down)


def scenario(spec: str) -> FailureScenario:
    """A preset name, or 'custom:<interval_h>:<recovery_h>' (e.g. custom:0.25:1 keeps high's 1:4 ratio)."""
    if spec in SCENARIOS:
        return SCENARIOS[spec]
    parts = spec.split(":")
    try:
        if parts[0] != "custom" or len(parts) != 3:
            raise ValueError
        interval, recovery = float(parts[1]), float(parts[2])
        if not (math.isfinite(interval) and interval > 0 and math.isfinite(recovery) and recovery >= 0):
            raise ValueError
    except ValueError:
        raise UsageError(f"cluster.failures={spec!r}; allowed: {', '.join(SCENARIOS)}, "
                         "custom:<interval_h>:<recovery_h> or a trace .csv file") from None
    return FailureScenario(spec, interval, recovery)


def resolve(spec: str, n_ranks: int, steps: int, seconds_per_step: float, seed: int, recovery: str = "fixed",
            failable: tuple[int, ...] | None = None, start: str = "cold", failure_free_steps: int = 0) -> Schedule:
    """A scenario (name or custom:...), the path of a trace CSV (a trace starts as it says), or
    steps:<file.json>, the failed set of every step as a run logged it (mecefo.launch's failed_steps.json);
    scenarios and traces start after `failure_free_steps` (Schedule.after_warm_start), a steps: replay is
    replayed as logged (its warm start, if any, is in the file)."""
    if spec.startswith("steps:"):
        return read_failed_steps(Path(spec[len("steps:"):]), n_ranks, steps, seconds_per_step)
    if spec in SCENARIOS or spec.startswith("custom:"):
        return generate(scenario(spec), n_ranks, steps, seconds_per_step, seed, recovery, failable,
                        start).after_warm_start(failure_free_steps)
    if spec.endswith(".csv") or Path(spec).exists():
        return read_trace(spec, n_ranks, steps, seconds_per_step).after_warm_start(failure_free_steps)
    return generate(scenario(spec), n_ranks, steps, seconds_per_step, seed, recovery, failable)  # raises


def for_run(cfg) -> Schedule:
    """The failure schedule of a run's config (mecefo.config.Config): its cluster section at its steps."""
    cc = cfg.cluster
    return resolve(cc.failures, cc.ranks, cfg.train.steps, cc.seconds_per_step,
                   seed=cfg.train.seed if cc.failure_seed < 0 else cc.failure_seed, recovery=cc.recovery,
                   failable=cc.failable_ranks(), start=cc.failure_start, failure_free_steps=cc.failure_free_steps)


def read_failed_steps(path: Path, n_ranks: int, steps: int, seconds_per_step: float) -> Schedule:
    """A Schedule that replays logged failed sets step by step ({"n_ranks": n, "failed": [[ranks], ...]})."""
    import json

    try:
        data = json.loads(path.read_text())
        failed = [frozenset(int(r) for r in f) for f in data["failed"]]
        logged_n = int(data["n_ranks"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"failed steps {path}: {e}") from None
    if logged_n != n_ranks:
        raise UsageError(f"failed steps {path} were logged on {logged_n} ranks, not {n_ranks}")
    if len(failed) < steps:
        raise UsageError(f"failed steps {path} cover {len(failed)} steps, fewer than {steps}")
    if any(not 0 <= r < n_ranks for f in failed for r in f):
        raise UsageError(f"failed steps {path} name a rank outside 0..{n_ranks - 1}")
    return logged(n_ranks, failed[:steps], seconds_per_step)


def logged(n_ranks: int, failed: list[frozenset[int]], seconds_per_step: float) -> Schedule:
    """The Schedule whose failed set at step s is failed[s] (its events where the sets change)."""
    steps = len(failed)
    events = [Event(s * seconds_per_step, "remove", r) for s in range(1, steps) for r in sorted(failed[s] - failed[s - 1])]
    events += [Event(s * seconds_per_step, "add", r) for s in range(1, steps) for r in sorted(failed[s - 1] - failed[s])]
    return Schedule(n_ranks, tuple(failed), tuple(events), seconds_per_step, failed[0] if failed else frozenset())
