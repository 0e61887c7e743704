"""TensorBoard scalars, optional (`--tensorboard DIR` of mecefo.train and mecefo.launch; pip install -e .[tb]):
what a run's rows say, as they are written, for the tool users watch (torchtitan writes the same kind).

Tags: train/loss, train/val_loss, train/lr, train/grad_norm, train/tokens_per_s, cluster/failed and cluster/down
(ranks), timing/<phase> (seconds of the row's interval, mecefo.timing); the launcher's own: launch/committed_step,
launch/ranks_training, launch/steps_per_min, launch/kills. The x axis is the training step (the launcher's: seconds
since its start). metrics.jsonl stays the record; these are a view of it."""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError

ROW_TAGS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s")


class Board:
    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("--tensorboard needs the tensorboard package: pip install -e .[tb]") from None
        self.writer = SummaryWriter(str(folder))

    def row(self, row: dict) -> None:
        step = row["step"]
        for key in ROW_TAGS:
            if row.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", row[key], step)
        for key in ("failed", "down"):
            if key in row:
                self.writer.add_scalar(f"cluster/{key}", len(row[key]), step)
        for key, seconds in row.get("timing", {}).items():
            if key.endswith("_s"):
                self.writer.add_scalar(f"timing/{key[:-2]}", seconds, step)
        self.writer.flush()

    def scalars(self, values: dict, x: float) -> None:
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(key, value, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
