"""Drop (torchft's behaviour): the failed ranks' samples are skipped for the step and the survivors'
gradients averaged, so the global batch shrinks while a rank is down."""

from __future__ import annotations

from . import Policy, register


@register
class Drop(Policy):
    name = "drop"
    summary = "the failed ranks' samples are skipped; the survivors' gradients averaged (torchft)"
    order = 2

    def sim_step(self, job, cost, failed, t, sim):
        """Step time unchanged; a replica with a failed GPU trains none of its samples."""
        replicas = len({u // job.pp for u in failed})
        return cost.parts(), float(job.tokens_per_step) * (job.dp - replicas) / job.dp, None
