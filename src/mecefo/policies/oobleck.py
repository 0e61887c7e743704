"""Oobleck (SOSP'23), a throughput model of its published mechanism: after a failure, pipelines are
re-instantiated from pipeline templates (one per number of GPUs, from the fewest that hold the model's
training state, n0, up to the job's depth) on the GPUs that remain, and the global batch is redistributed
over the pipelines so that the slowest finishes first. Exact (no sample is lost or approximated), so the
trainer does not run it: its quality is failure-free training's."""

from __future__ import annotations

import heapq
from functools import lru_cache

from . import Policy, register


def pipelines(failed: frozenset[int], job) -> tuple[int, ...]:
    """GPUs per re-instantiated pipeline. Each replica keeps its alive GPUs as one pipeline of fewer stages;
    a pipeline below n0 = job.const('oobleck_min_stages') is dissolved and its GPUs join the smallest
    pipelines (up to the job's depth) or, n0 of them together, form a new one; any left idle."""
    n0, pp = int(job.const("oobleck_min_stages")), job.pp
    sizes = [pp - sum(1 for u in failed if u // pp == r) for r in range(job.dp)]
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
    holds all layers, so its stage time is t_mb pp / p and m_i micro-batches take (m_i + p - 1) t_mb pp / p;
    micro-batches go one at a time to the pipeline that would finish earliest with it (optimal for this
    min-max, since each pipeline's time grows by a constant per micro-batch)."""
    heap = [(t_mb * pp, 1, p) for p in sizes]  # (time once it runs its next micro-batch, that count, p)
    heapq.heapify(heap)
    worst = 0.0
    for _ in range(micro_batches):
        t, m, p = heapq.heappop(heap)
        worst = max(worst, t)
        heapq.heappush(heap, ((m + p) * t_mb * pp / p, m + 1, p))
    return worst


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
        sizes = pipelines(failed, job)
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
