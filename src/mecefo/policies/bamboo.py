"""Bamboo (NSDI'23), a throughput model: redundant computation every step (each stage also runs its
successor's forward, in the pipeline bubbles where it fits); on a failure the predecessor takes over at
`bamboo_fallback`x speed until a reconfiguration completes, then pipelines run on the remaining GPUs; two
failed GPUs adjacent in one pipeline (or adjacent replicas when pp = 1) force a full restart. Exact, so the
trainer does not run it."""

from __future__ import annotations

from . import register
from .oobleck import Oobleck

# Reconfiguration pauses of Oobleck's copy of Bamboo's simulator (docs/simulators.md): GPT-3 medium (350M)
# 100 s, 2.7B 230 s, 6.7B 450 s; 1B interpolated in log-parameters.
BAMBOO_RECONFIG_S = {"llama-350m": 100.0, "llama-1b": 150.0, "llama-7b": 450.0}


def adjacent(u: int, failed: frozenset[int], job) -> bool:
    """Whether GPU u has a failed neighbour stage in its pipeline (or a failed neighbour replica at pp = 1)."""
    r, s = divmod(u, job.pp)
    if job.pp > 1:
        return any(v in failed for v in (r * job.pp + s - 1, r * job.pp + s + 1) if 0 <= s + (v - u) < job.pp)
    return ((r - 1) % job.dp) in failed or ((r + 1) % job.dp) in failed


@register
class Bamboo(Oobleck):
    name = "bamboo"
    summary = "redundant successor forward in bubbles; fallback 1.5x until reconfiguration; restart on adjacent failures (simulator only)"
    order = 7

    def failure_free_parts(self, job, cost) -> dict:
        parts = cost.parts()
        parts["redundant"] = max(0.0, job.micro_batches * cost.t_mb / 3 - (job.pp - 1) * cost.t_mb)
        return parts

    def sim_step(self, job, cost, failed, t, sim):
        parts, tokens, _ = super().sim_step(job, cost, failed, t, sim)
        until = sim.get("fallback_until", -1.0)
        if t < until and parts["degraded"] != float("inf"):  # the predecessor covers at fallback speed
            parts["degraded"] += sum(parts.values()) * (job.bamboo_fallback - 1)
            return parts, tokens, until
        return parts, tokens, None

    def sim_on_failure(self, job, unit, down, t, sim):
        pause = job.bamboo_restart_s if adjacent(unit, down, job) else job.event_pause_s
        sim["fallback_until"] = t + pause + BAMBOO_RECONFIG_S.get(job.model, 150.0)
        return pause

    def sim_on_recovery(self, job, unit, t, sim):
        return BAMBOO_RECONFIG_S.get(job.model, 150.0)

