"""Neighbour-do-both, exactly: MeCeFO's roles without its approximations (the quality upper bound, at
twice a neighbour's cost)."""

from __future__ import annotations

from . import register
from .mecefo import MeCeFO


@register
class NeighbourDoBothExact(MeCeFO):
    name = "ndb-exact"
    summary = "the same neighbour computes both micro-batches exactly (2x its work)"
    order = 1
    exact = True
    exact_neighbour = True
