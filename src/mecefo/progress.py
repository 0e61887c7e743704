"""The launchers' progress line (mecefo.launch, and mecefo.slurm's injector on the batch host): every PROGRESS_S
seconds, the committed step, the ranks training, the last heal and an estimate of the time left from the step rate
over the last minute.

    [launch   62.10s] step 180/300 (60%), 3/4 ranks training, last heal: rank 2 at step 171, 6 s ago; 24.1 steps/min, ETA 5m00s
"""

from __future__ import annotations

import os
import time
from collections import deque

PROGRESS_S = float(os.environ.get("MECEFO_PROGRESS_S", "10"))
WINDOW_S = 60.0  # the step rate is measured over this long


class ProgressLine:
    def __init__(self, steps: int, every_s: float = PROGRESS_S):
        self.steps, self.every_s = steps, every_s
        self.samples = deque()  # (time.monotonic(), committed step)
        self.last_printed = None  # (the first line comes every_s after the first call)
        self.last_heal = None  # (rank, step, time.monotonic())

    def healed(self, rank: int, step: int, now: float | None = None) -> None:
        self.last_heal = (rank, step, time.monotonic() if now is None else now)

    def rate_per_min(self) -> float | None:
        """Committed steps a minute over the last minute's samples (None: none committed)."""
        if len(self.samples) < 2:
            return None
        (t0, s0), (t1, s1) = self.samples[0], self.samples[-1]
        return 60 * (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def line(self, step: int, training: int, ranks: int, now: float | None = None) -> str | None:
        """The line, when it is due (else None); every call records the step for the rate."""
        now = time.monotonic() if now is None else now
        self.samples.append((now, step))
        while len(self.samples) > 2 and now - self.samples[1][0] > WINDOW_S:
            self.samples.popleft()
        if self.last_printed is None:
            self.last_printed = now
        if now - self.last_printed < self.every_s or self.every_s <= 0:
            return None
        self.last_printed = now
        per_min = self.rate_per_min()
        heal = "none" if self.last_heal is None else \
            f"rank {self.last_heal[0]} at step {self.last_heal[1]}, {now - self.last_heal[2]:.0f} s ago"
        eta = "ETA unknown (no step in the last minute)" if per_min is None else \
            f"{per_min:.1f} steps/min, ETA {_duration(60 * (self.steps - step) / per_min)}"
        return (f"step {step}/{self.steps} ({100 * step / self.steps:.0f}%), {training}/{ranks} ranks training, "
                f"last heal: {heal}; {eta}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
