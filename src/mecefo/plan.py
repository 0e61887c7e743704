"""Who computes what at a step: pieces of micro-batches, step plans, and the neighbour rule.

Pieces. Each computing rank runs pieces: (whose micro-batch, which rows, which techniques). A piece of
`rows` out of b rows has weight rows / b and contributes weight * grad(mean loss over its rows). Any rank
can compute any rank's micro-batch: the sampler makes a micro-batch a pure function of (seed, step,
owner, micro-batch index).

Neighbours. Each failed rank j gets a neighbour: the next alive rank after j in ring order that covers
nobody yet; once every alive rank covers one, the least-loaded alive rank, nearest in ring order after j.
Roles are recomputed from the failed set every step, so a neighbour that fails hands over at the next step.

A policy (mecefo.policies) turns a failed set into a StepPlan; the backends (mecefo.cluster) run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import group_kind, groups
from .neighbour import Techniques

NORMAL = Techniques()


@dataclass(frozen=True)
class Piece:
    owner: int  # whose micro-batch (its data address)
    micro: int  # which gradient-accumulation micro-batch of the owner
    start: int  # rows [start, stop) of that micro-batch
    stop: int
    batch: int  # rows of a whole micro-batch
    techniques: Techniques = NORMAL

    @property
    def weight(self) -> float:
        return (self.stop - self.start) / self.batch


def whole(owner: int, accum: int, batch: int, techniques: Techniques = NORMAL) -> tuple[Piece, ...]:
    """All of a rank's micro-batches, whole."""
    return tuple(Piece(owner, m, 0, batch, batch, techniques) for m in range(accum))


@dataclass(frozen=True)
class StepPlan:
    step: int
    failed: frozenset[int]
    neighbours: dict[int, int]
    pieces: dict[int, tuple[Piece, ...]]  # computing rank -> its pieces (failed ranks compute nothing)
    skipped: bool = False

    def counts(self, n_layers: int) -> dict[str, float]:
        """Sum of the weights of the pieces giving each parameter group (mecefo.model.groups) a gradient."""
        out = dict.fromkeys(groups(n_layers), 0.0)
        for pieces in self.pieces.values():
            for p in pieces:
                for g in out:
                    out[g] += p.weight if p.techniques.trains(group_kind(g)) else 0.0
        return out

    def samples(self) -> int:
        return sum(p.stop - p.start for pieces in self.pieces.values() for p in pieces)

    def uses(self, technique: str) -> bool:
        """Whether any piece of the step applies this technique (a Techniques field name)."""
        return any(getattr(p.techniques, technique) for ps in self.pieces.values() for p in ps)


def assign_neighbours(failed: frozenset[int], n: int) -> dict[int, int]:
    """failed rank -> the alive rank that computes its micro-batch (see the module docstring)."""
    alive = [r for r in range(n) if r not in failed]
    if not alive:
        return {}
    load = {r: 0 for r in alive}
    out = {}
    for j in sorted(failed):
        ring = [(j + k) % n for k in range(1, n) if (j + k) % n in load]
        choice = min(ring, key=lambda r: (load[r], ring.index(r)))
        out[j] = choice
        load[choice] += 1
    return out


def fuse(pieces) -> list[list[Piece]]:
    """The pieces that can run as one forward and backward pass: those sharing a micro-batch index, a technique set
    and a micro-batch size (a neighbour's own and failed micro-batch m, under its techniques), in order of first
    appearance. One pass of R rows of b-row micro-batches gives sum_p w_p grad(mean loss of p) as (R / b) grad(mean
    loss of the R rows) (mecefo.engine.StepEngine.run_batch)."""
    passes: dict[tuple, list[Piece]] = {}
    for p in pieces:
        passes.setdefault((p.micro, p.techniques, p.batch), []).append(p)
    return list(passes.values())


def rank_flops(plan: StepPlan, piece_flops, apply_flops: int) -> dict[int, int]:
    """FLOPs each computing rank does this step; piece_flops(rows, techniques) gives one piece's
    forward+backward, apply_flops the once-per-step V1^T product of a rank using low_rank_wgrad."""
    out = {}
    for rank, pieces in plan.pieces.items():
        out[rank] = sum(piece_flops(p.stop - p.start, p.techniques) for p in pieces)
        out[rank] += apply_flops if any(p.techniques.low_rank_wgrad for p in pieces) else 0
    return out
