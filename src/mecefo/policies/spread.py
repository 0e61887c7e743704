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
        """The failed GPUs of the worst stage (f of them, d alive peers) have their m micro-batches each
        split over w = job.spread_width peers (0: all d), filling pipeline bubbles first: a peer's extra
        time is max(0, m f / min(d, w f) t_mb - (pp - 1) t_mb), x c_nb / c with the techniques on the extra
        shares."""
        parts, tokens = cost.parts(), float(job.tokens_per_step)
        if not failed:
            return parts, tokens, None
        m, pp, t_mb = job.micro_batches, job.pp, cost.t_mb
        per_stage = max(sum(1 for u in failed if u % pp == s) for s in range(pp))
        alive = job.dp - per_stage
        if alive <= 0:
            return parts | {"degraded": float("inf")}, 0.0, None
        helpers = alive if job.spread_width <= 0 else min(alive, job.spread_width * per_stage)
        scale = cost.t_mb_neighbour / t_mb if self.extra_share_techniques else 1.0
        parts["degraded"] = max(0.0, m * per_stage / helpers * scale * t_mb - (pp - 1) * t_mb)
        return parts, tokens, None
