"""Bamboo (NSDI'23), a throughput model of its published mechanism, on pipeline layouts only (a pure
data-parallel job is given job.const('bamboo_stages') stages): every stage also runs its successor's
forward (redundant computation), in the pipeline bubbles where it fits; when a GPU is lost its predecessor
adopts its stage at bamboo_fallback x step time until a reconfiguration, which Bamboo starts when
2 x overloaded / active GPUs exceeds bamboo_reconfig_threshold or another pipeline can be formed, and which
pauses training for bamboo_reconfig_s and leaves GPUs // stages pipelines of the full depth (the other
GPUs wait); a GPU lost next to a stage already being covered is fatal: a full restart (bamboo_restart_s).
Exact, so the trainer does not run it."""

from __future__ import annotations

from dataclasses import replace

from . import Policy, register
from .oobleck import compute_time


def predecessor(u: int, job) -> int:
    """The GPU that covers u: the previous stage of its pipeline (stage 0 wraps to the last)."""
    r, s = divmod(u, job.pp)
    return r * job.pp + (s - 1) % job.pp


@register
class Bamboo(Policy):
    name = "bamboo"
    summary = "redundant successor forward in bubbles; predecessor covers at 1.5x until reconfiguration; restart on adjacent failures (simulator only)"
    order = 7
    trains = False
    exact = True

    def sim_job(self, job):
        if job.pp > 1:
            return job
        stages = int(job.const("bamboo_stages"))
        if job.gpus % stages:
            raise ValueError(f"bamboo_stages={stages} must divide the job's {job.gpus} GPUs")
        return replace(job, dp=job.gpus // stages, pp=stages)

    def sim_step(self, job, cost, failed, t, sim):
        parts, tokens = cost.parts(), float(job.tokens_per_step)
        m, pp = job.micro_batches, job.pp
        parts["redundant"] = max(0.0, m * cost.t_mb / 3 - (pp - 1) * cost.t_mb)  # successor forward = 1/3 of fwd+bwd
        pipes = sim.setdefault("pipelines", (job.gpus - len(failed)) // pp)
        if pipes == 0:
            return parts | {"degraded": float("inf")}, 0.0, None
        busy = compute_time((pp,) * pipes, m * job.dp, pp, cost.t_mb)
        parts["degraded"] = busy - parts["compute"] - parts["bubble"]
        if sim.get("covering"):  # predecessors cover lost stages until the reconfiguration
            parts["degraded"] += sum(parts.values()) * (job.const("bamboo_fallback") - 1)
        return parts, tokens, None

    def _reconfigure(self, job, alive: int, sim: dict) -> None:
        sim["pipelines"], sim["covering"], sim["lost"] = alive // job.pp, set(), set()

    def sim_on_failure(self, job, unit, down, t, sim):
        covering, lost = sim.setdefault("covering", set()), sim.setdefault("lost", set())
        sim.setdefault("pipelines", (job.gpus - len(down)) // job.pp)
        alive, pred = job.gpus - len(down) - 1, predecessor(unit, job)
        if unit in covering or pred in covering or pred in lost:  # two adjacent stages lost: fatal
            self._reconfigure(job, alive, sim)
            return job.const("bamboo_restart_s")
        covering.add(pred)
        lost.add(unit)
        if 2 * len(covering) / max(alive, 1) > job.const("bamboo_reconfig_threshold"):
            self._reconfigure(job, alive, sim)
            return job.const("bamboo_reconfig_s")
        return 0.0

    def sim_on_recovery(self, job, unit, down, t, sim):
        alive = job.gpus - len(down)
        if alive // job.pp > sim.get("pipelines", 0):  # another pipeline can be formed
            self._reconfigure(job, alive, sim)
            return job.const("bamboo_reconfig_s")
        return 0.0
