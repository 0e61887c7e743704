"""Spread + MeCeFO (ours): a failed rank's micro-batches split over all survivors, each applying the
MeCeFO techniques to its extra share only."""

from __future__ import annotations

from . import register
from .spread import Spread


@register
class SpreadMeCeFO(Spread):
    name = "spread-mecefo"
    summary = "split over survivors, each applying the techniques to its extra share only (ours)"
    order = 4
    exact = False
    extra_share_techniques = True
