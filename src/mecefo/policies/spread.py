"""Spread (ReCycle-like): a failed rank's micro-batches split evenly by rows over all surviving ranks,
computed exactly."""

from __future__ import annotations

from . import NORMAL, Policy, register, spread_cover


@register
class Spread(Policy):
    name = "spread"
    summary = "the failed micro-batches split evenly over all survivors, exact (ReCycle-like)"
    order = 3
    exact = True
    extra_share_techniques = False

    def cover(self, failed, alive, pieces, accum, batch):
        t = self.techniques if self.extra_share_techniques else NORMAL
        return spread_cover(failed, alive, pieces, accum, batch, t)

    def sim_step(self, job, cost, failed, t, sim):
        """The d alive peers of the worst stage share its f failed GPUs' m micro-batches, filling their
        pipeline bubbles first: extra time max(0, m f / d t_mb - (pp - 1) t_mb) (x c_nb / c with the
        techniques on the extra shares)."""
        parts, tokens = cost.parts(), float(job.tokens_per_step)
        if not failed:
            return parts, tokens, None
        m, pp, t_mb = job.micro_batches, job.pp, cost.t_mb
        per_stage = max(sum(1 for u in failed if u % pp == s) for s in range(pp))
        if per_stage >= job.dp:
            return parts | {"degraded": float("inf")}, 0.0, None
        scale = cost.t_mb_neighbour / t_mb if self.extra_share_techniques else 1.0
        parts["degraded"] = max(0.0, m * per_stage / (job.dp - per_stage) * scale * t_mb - (pp - 1) * t_mb)
        return parts, tokens, None
