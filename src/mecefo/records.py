"""Writing results so they can be trusted: atomic files, config hashes, code commit and package versions."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "numpy", "tokenizers", "scipy", "pandas", "matplotlib", "seaborn")


# The record schema of a training run, the same on every backend (local, torch, FSDP, torchft; tests check
# it): OUT/metrics.jsonl has one EVAL_ROW at step 0 and one STEP_ROW per step (plus "val_loss" on the
# evaluation cadence), OUT/summary.json is one SUMMARY. Backend-specific entries live under "backend".
EVAL_ROW = {"step": "0", "val_loss": "validation loss before training", "tokens_seen": "0"}
STEP_ROW = {
    "step": "the step just trained (1-based)", "loss": "weighted mean training loss (null: skipped, every rank down)",
    "lr": "learning rate of the update", "grad_norm": "norm of the aggregated gradient before clipping",
    "tokens_seen": "tokens of the global batches so far", "tokens_trained": "tokens that gave a gradient so far",
    "samples": "sequences that gave a gradient this step", "tokens_per_s": "this step's trained tokens per second",
    "down": "ranks down (the schedule's; torchft: missing from the quorum)",
    "failed": "ranks computing nothing under the policy", "neighbours": "failed rank -> the rank covering it",
    "attention_ranks": "|N_l|: ranks whose attention gradients enter the step",
    "skipped": "every rank was down", "busiest_rank_flops": "the busiest rank's FLOPs / a normal rank's",
    "replayed_steps": "steps replayed so far (checkpoint-restart)", "replay": "this step is a replay",
    "grad_rel_error": "||g - g_exact|| / ||g_exact|| with --track_grad_error, else null",
    "wall_time_s": "seconds trained so far", "timing": "seconds since the previous row by phase (mecefo.timing: quorum, "
    "heal, refresh, compute, exchange, commit, update, evaluate, checkpoint, pace, other; total)",
    "backend": "backend-specific entries (torchft: rank, time)"}
SUMMARY = {
    "config": "the resolved config", "config_hash": "its hash", "seed": "train.seed", "steps": "train.steps",
    "final_train_loss": "the last step's training loss", "final_val_loss": "validation loss at the end",
    "final_val_ppl": "exp(final_val_loss)", "final_test_loss": "test loss (null: the data has no test split)",
    "final_test_ppl": "exp(final_test_loss) or null", "splits": "the data's splits",
    "n_parameters": "model parameters", "model": "the model's shape",
    "cost_accounting": "how exactly mecefo.costs counts the model: 'exact', or what it leaves out (--hf_config)", "tokens_seen": "tokens of all global batches",
    "tokens_trained": "tokens that gave a gradient", "replayed_steps": "steps replayed (checkpoint-restart)",
    "skipped_steps": "steps with every rank down", "skipped_fraction": "skipped_steps / steps",
    "rank_agreement": "ranks compared at the end and whether they hold the same state",
    "failure_schedule": "fraction of rank-steps failed and failure events (torchft: as they happened)",
    "wall_time_s": "seconds of training (torchft: of the launch, the replicas' start-up included; a warm-started run: "
    "its warm start's steps included, not the warm start's evaluation at its last step, which a run from step 0 counts)",
    "warm_start": "the run's warm start (mecefo.train.run(warm_start=)): its folder and step; null: trained from step 0",
    "timing": "seconds by phase over the run and each phase's share (torchft: over the committed rows; each replica "
    "process's own under backend.replica_timing; a warm-started run: the steps after its warm start)", "device": "torch device", "git_commit": "the code's commit",
    "packages": "package versions", "backend": "name, and backend-specific entries (torchft: kills, timings)"}


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, then rename: readers never see a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def stable_hash(obj) -> str:
    """First 12 hex digits of the SHA-256 of the canonical JSON of obj."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def git_commit() -> str:
    """HEAD of the repository holding this package, with '-dirty' if tracked files changed; 'unknown' outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (metrics.jsonl)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def read_rows(path: Path) -> tuple[list[dict], int]:
    """The rows of a JSON-lines file written by a process that may have been killed mid-write, and how many lines
    were dropped as torn (not JSON: a partial line, or one a restarted writer appended to a partial line).
    A missing file has no rows."""
    path = Path(path)
    if not path.exists():
        return [], 0
    rows, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            torn += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            torn += 1
    return rows, torn


def repair_tail(path: Path) -> bool:
    """Cut a JSON-lines file back to its last whole line (a writer killed mid-line leaves a partial one, to which the
    next writer would append); True if something was cut."""
    path = Path(path)
    if not path.exists():
        return False
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return False
        f.truncate(data.rfind(b"\n") + 1)
    return True


def last_row(path: Path, tail_bytes: int = 1 << 16) -> dict | None:
    """The last whole JSON row of a JSON-lines file (its last tail_bytes read; a torn last line skipped), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            data = f.read()
    except OSError:
        return None
    for line in reversed(data.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            return row
    return None
