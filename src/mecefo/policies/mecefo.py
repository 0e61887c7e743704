"""MeCeFO (the paper): a failed rank's neighbour computes its own and the failed rank's micro-batches, both
with the techniques (default: skip_attention + recompute_ffn + low_rank_wgrad)."""

from __future__ import annotations

from . import NORMAL, Policy, neighbour_cover, neighbour_load, register


@register
class MeCeFO(Policy):
    name = "mecefo"
    summary = "a neighbour computes its own and the failed rank's micro-batches with the techniques (the paper)"
    order = 0
    exact_neighbour = False

    def cover(self, failed, alive, pieces, accum, batch):
        t = NORMAL if self.exact_neighbour else self.techniques
        return neighbour_cover(failed, alive, pieces, accum, batch, t)

    def sim_step(self, job, cost, failed, t, sim):
        """The slowest GPU sets the step: a neighbour covering k failed GPUs takes alpha_k times a normal
        GPU's compute (mecefo.simulator.CostModel.alpha), less the share job.neighbour_slack of the extra
        time that idle time hides (H2); nobody left in a stage: no progress."""
        parts, tokens = cost.parts(), float(job.tokens_per_step)
        if not failed:
            return parts, tokens, None
        k = neighbour_load(failed, job)
        if k >= job.dp:
            return parts | {"degraded": float("inf")}, 0.0, None
        extra = (parts["compute"] + parts["bubble"]) * (cost.alpha(k, exact=self.exact_neighbour) - 1)
        parts["degraded"] = (1 - job.neighbour_slack) * extra
        return parts, tokens, None
