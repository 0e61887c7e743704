"""Oobleck (SOSP'23), a throughput model: pipelines are re-instantiated from templates on the remaining
GPUs. Exact (no sample is lost or approximated), so the trainer does not run it: its quality is
failure-free training's."""

from __future__ import annotations

from . import Policy, register


@register
class Oobleck(Policy):
    name = "oobleck"
    summary = "pipelines re-instantiated on the remaining GPUs, step time x N / (N - f), a pause per event (simulator only)"
    order = 6
    trains = False
    exact = True

    def failure_free_parts(self, job, cost) -> dict:
        return cost.parts()

    def sim_step(self, job, cost, failed, t, sim):
        parts, tokens = self.failure_free_parts(job, cost), float(job.tokens_per_step)
        f = len(failed)
        if not f:
            return parts, tokens, None
        if f >= job.gpus:
            return parts | {"degraded": float("inf")}, 0.0, None
        parts["degraded"] = (parts["compute"] + parts["bubble"] + parts["redundant"]) * (job.gpus / (job.gpus - f) - 1)
        return parts, tokens, None

    def sim_on_failure(self, job, unit, down, t, sim):
        return job.oobleck_reconfig_s

    def sim_on_recovery(self, job, unit, t, sim):
        return job.oobleck_reconfig_s  # a recovered GPU rejoins through a reconfiguration
