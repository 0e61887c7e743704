"""A policy that lives outside the package, to show that a new policy is one file: registered by naming
this module in MECEFO_POLICY_MODULES (tests/test_policy_registry.py does), nothing else changes.

neighbour-half: a failed rank's neighbour computes the first half of each of its micro-batches, exactly;
the other half is dropped. In the simulator the neighbour then works 1.5x a normal GPU while a failure lasts.
"""

from mecefo.plan import Piece, assign_neighbours
from mecefo.policies import Policy, register


@register
class NeighbourHalf(Policy):
    name = "neighbour-half"
    summary = "a neighbour computes the first half of each failed micro-batch exactly (test-only example)"
    order = 50

    def cover(self, failed, alive, pieces, accum, batch):
        neighbours = assign_neighbours(failed, len(alive) + len(failed))
        for j, nb in neighbours.items():
            pieces[nb] = pieces[nb] + tuple(Piece(j, m, 0, batch // 2, batch) for m in range(accum))
        return neighbours

    def sim_step(self, job, cost, failed, t, sim):
        parts, tokens = cost.parts(), float(job.tokens_per_step)
        if failed:
            parts["degraded"] = 0.5 * (parts["compute"] + parts["bubble"])
            tokens *= 1 - len(failed) / (2 * job.gpus)
        return parts, tokens, None
