"""Checkpoints: one protocol for every stateful part of a run.

A checkpoint is {"step", "config_hash"} plus one entry per component, each taken from the component's
`state_dict()` and given back through its `load_state_dict()`: the model, the optimizer, the RNG states,
the low-rank subspaces with their epoch, the policy's own state (checkpoint-restart's snapshot), the
run's counters. The data position is the step (a micro-batch is a pure function of it). Written to a
temporary file and renamed, so a checkpoint on disk is always whole. With train.keep_checkpoints K > 1 the K - 1
highest-step checkpoints that were current before the latest stay beside it as checkpoint.step-S.pt (to go back to one: copy it
over checkpoint.pt and --resume).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from .errors import UsageError


class RNG:
    """The torch, numpy and Python generators as a component."""

    def state_dict(self) -> dict:
        return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])


class Component:
    """A component from a pair of functions (for states that take a collective to gather, e.g. FSDP's)."""

    def __init__(self, get, put):
        self.state_dict, self.load_state_dict = get, put


def gather(components: dict) -> dict:
    """Every component's state (under FSDP some are collectives: every rank calls this)."""
    return {name: c.state_dict() for name, c in components.items()}


WRITE_DELAY_ENV = "MECEFO_CHECKPOINT_DELAY_S"  # tests, the chaos harness: hold each write before its rename (a big model's)


def save(path: Path, step: int, config_hash: str, states: dict, keep_later: bool = False, keep: int = 1) -> None:
    """Write to a temporary file of this process's own (two writers, e.g. a stalled one and its successor, never
    share one), flushed to the disk, then renamed over the checkpoint: a writer killed at any moment leaves the
    previous checkpoint whole. With keep_later (several writers: torchft), a writer that finds a later step already
    there (it was stalled while its successor wrote) keeps that one; without it a lower step replaces a higher one,
    as after checkpoint-restart's rollback. Temporary files of writers no longer alive are removed. keep > 1: the
    checkpoint being replaced stays as an earlier one (keep_earlier)."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        pid = stale.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"step": step, "config_hash": config_hash, **states}, f)
            f.flush()
            os.fsync(f.fileno())
        delay = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        if delay:
            time.sleep(delay)
        if keep_later and path.exists() and _step_of(path) > step:
            tmp.unlink()
            return
        if keep > 1:
            keep_earlier(path, keep - 1)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def earlier(path: Path) -> list[Path]:
    """The earlier checkpoints kept beside path, by step."""
    path = Path(path)
    return sorted(path.parent.glob(f"{path.stem}.step-*{path.suffix}"))  # (8-digit steps: by name is by step)


def keep_earlier(path: Path, n: int) -> None:
    """Before path is replaced: its file also named path.step-S (a hard link: no copy, and the rename over it is
    atomic; a step written again, after a rollback, replaces its earlier version), then only the n highest steps of
    those kept."""
    path = Path(path)
    old = _step_of(path) if path.exists() else -1
    if old >= 0:
        link = path.with_name(f".{path.stem}.{os.getpid()}.link")
        link.unlink(missing_ok=True)
        os.link(path, link)
        os.replace(link, path.with_name(f"{path.stem}.step-{old:08d}{path.suffix}"))
    for stale in earlier(path)[:-n]:
        stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _step_of(path: Path) -> int:
    """The step of the checkpoint at path (-1 if it cannot be read: replace it)."""
    try:
        return int(read(path)["step"])
    except UsageError:
        return -1


def _data_types() -> list:
    """What a checkpoint may hold beyond tensors and Python's containers: numpy's RNG state (an array)."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read(path: Path) -> dict:
    """A checkpoint file's contents, read as data (weights_only: no pickled code runs), memory-mapped so that
    reading its hash, or one component, does not read every tensor; a one-line UsageError if unreadable."""
    try:
        with torch.serialization.safe_globals(_data_types()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise UsageError(f"checkpoint {path} cannot be read as data ({type(e).__name__}); delete it to start over") from None


def load(path: Path, config_hash: str) -> dict:
    """The checkpoint at path, refusing an unreadable one or another config's with a one-line UsageError."""
    ckpt = read(path)
    if ckpt.get("config_hash") != config_hash:
        raise UsageError(f"checkpoint {path} belongs to another config (hash {ckpt.get('config_hash')} != "
                         f"{config_hash}); choose another --out")
    return ckpt


def restore(ckpt: dict, components: dict) -> int:
    """Give every component its state back; returns the step to continue from."""
    missing = sorted(set(components) - set(ckpt))
    if missing:
        raise UsageError(f"checkpoint lacks {', '.join(missing)} (written by an older version?); delete it to start over")
    for name, c in components.items():
        c.load_state_dict(ckpt[name])
    return ckpt["step"]
