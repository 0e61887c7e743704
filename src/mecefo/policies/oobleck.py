"""Oobleck (SOSP'23), a throughput model of its published mechanism: after a failure, pipelines are
re-instantiated from pipeline templates (one per number of GPUs, from the fewest that hold the model's
training state, n0, up to the job's depth) on the GPUs that remain, and the global batch is redistributed
over the pipelines so that the slowest finishes first. Exact (no sample is lost or approximated), so the
trainer does not run it: its quality is failure-free training's."""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache

from . import Policy, register


def pipelines(failed: frozenset[int], job) -> tuple[int, ...]:
    """GPUs per re-instantiated pipeline. Each replica keeps its alive GPUs as one pipeline of fewer stages;
    a pipeline below n0 = job.const('oobleck_min_stages') is dissolved and its GPUs join the smallest
    pipelines (up to the job's depth) or, n0 of them together, form a new one; any left idle."""
    n0, pp = int(job.const("oobleck_min_stages")), job.pp
    lost = Counter(u // pp for u in failed)  # failed GPUs per replica (unit u sits in replica u // pp)
    sizes = [pp - lost[r] for r in range(job.dp)]
    kept, spare = sorted(s for s in sizes if s >= n0), sum(s for s in sizes if s < n0)
    while spare:
        if kept and kept[0] < pp:
            kept[0] += 1
            spare -= 1
        elif spare >= n0:
            kept.append(min(spare, pp))
            spare -= kept[-1]
        else:
            break
        kept.sort()
    return tuple(kept)


@lru_cache(maxsize=4096)
def compute_time(sizes: tuple[int, ...], micro_batches: int, pp: int, t_mb: float) -> float:
    """Least time for the pipelines to run `micro_batches` micro-batches under 1F1B: a pipeline of p GPUs
    holds all layers, so its stage time is t_mb pp / p and m micro-batches take (m + p - 1) t_mb pp / p.
    Micro-batches go one at a time to the pipeline that would finish earliest with it (optimal for this
    min-max, since each pipeline's time grows by a constant per micro-batch), so the time is the
    `micro_batches`-th smallest of all pipelines' finishing times {(m + p - 1) t_mb pp / p : m >= 1}: found
    here by bisection over m for each distinct p (a pipeline template's p is at most pp)."""
    if micro_batches <= 0 or not sizes:
        return 0.0
    counts = Counter(sizes)

    def finish(m: int, p: int) -> float:  # the time at which a pipeline of p GPUs finishes its m-th micro-batch
        return t_mb * pp if m == 1 else (m + p - 1) * t_mb * pp / p

    def done_by(t: float) -> int:  # micro-batches all pipelines finish by time t
        total = 0
        for p, k in counts.items():
            m = max(0, int(t * p / (t_mb * pp)) - p + 1)  # then exact against finish(), which rounds
            while finish(m + 1, p) <= t:
                m += 1
            while m > 0 and finish(m, p) > t:
                m -= 1
            total += k * m
        return total

    best = math.inf
    for p in counts:  # the first of p's finishing times by which micro_batches are done
        lo, hi = 1, micro_batches
        while lo < hi:
            mid = (lo + hi) // 2
            if done_by(finish(mid, p)) >= micro_batches:
                hi = mid
            else:
                lo = mid + 1
        best = min(best, finish(lo, p))
    return best


@register
class Oobleck(Policy):
    name = "oobleck"
    summary = "pipelines re-instantiated from templates on the remaining GPUs, batch redistributed; a pause per event (simulator only)"
    order = 6
    trains = False
    exact = True

    def failure_free_parts(self, job, cost) -> dict:
        return cost.parts()

    @classmethod
    def sim_validate(cls, job) -> None:
        if job.const("oobleck_rejoin") not in ("recovery", "next_failure"):
            raise ValueError(f"oobleck_rejoin={job.const('oobleck_rejoin')!r}; allowed: 'recovery', 'next_failure'")

    def sim_step(self, job, cost, failed, t, sim):
        parts, tokens = self.failure_free_parts(job, cost), float(job.tokens_per_step)
        failed = failed | sim.get("waiting", frozenset())  # recovered GPUs not yet rejoined
        if not failed:
            return parts, tokens, None
        if sim.get("oobleck_failed") != failed:  # the failed set changes at events only: reuse between them
            sim["oobleck_failed"], sim["oobleck_sizes"] = failed, pipelines(failed, job)
        sizes = sim["oobleck_sizes"]
        if not sizes:
            return parts | {"degraded": float("inf")}, 0.0, None
        busy = compute_time(sizes, job.micro_batches * job.dp, job.pp, cost.t_mb)
        parts["degraded"] = max(0.0, busy - parts["compute"] - parts["bubble"])
        return parts, tokens, None

    def sim_on_failure(self, job, unit, down, t, sim):
        sim["waiting"] = frozenset()  # GPUs waiting to rejoin join in this rendezvous
        return job.const("reform_s") + job.const("oobleck_reinstantiate_s")

    def sim_on_recovery(self, job, unit, down, t, sim):
        if job.const("oobleck_rejoin") == "next_failure":
            sim["waiting"] = sim.get("waiting", frozenset()) | {unit}
            return 0.0
        return job.const("reform_s") + job.const("oobleck_reinstantiate_s")
