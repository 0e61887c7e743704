"""Run files: what a run writes into its folder OUT, and the rules for an OUT that already holds something.

OUT/run.lock     held (mecefo.runfolder: an flock the kernel releases however the holder dies) by the process
                 training or launching into OUT, taken before OUT is read or written
OUT/config.json  the resolved config and its hash, written first
OUT/metrics.jsonl, OUT/summary.json   one row per committed step; the summary (mecefo.train)
OUT/checkpoint   mecefo.checkpoint: written atomically; the last train.keep_checkpoints kept
torchft (mecefo.ft.ReplicaFiles): each replica writes OUT/replicas/rank<r>.{jsonl,heals.jsonl,summary.json,status},
which the launcher reads and merges.

The rule for an existing OUT (prepare_out), the same for mecefo.train and mecefo.launch: a finished run of this
config is reused; an interrupted one resumes from its checkpoint (or starts over, stopped before its first);
a run of another config, or a folder holding anything else, is refused with one line (exit 2), nothing
touched. --resume only insists that there is something to resume.

Contract (RunFiles; mecefo.train.Run calls): metrics_path() / summary_path() (None: this process writes none),
owns_out() (this process writes config.json, write_config(cfg), and cuts the metrics back on a resume), status(what)
(what this process is doing, for whoever watches: the status words below), write_checkpoint(...) (every
process taking part in the checkpoint) and checkpoint_path() (where a resume reads it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from . import checkpoint
from .errors import UsageError
from .records import atomic_write_json, atomic_write_text
from .runfolder import LOCK, lock_holder, release_lock


class RunFiles:
    """The run's files written by its main process (rank 0) alone."""

    several_writers = False  # whether two processes may write the run's checkpoint at once (torchft: yes)

    def __init__(self, out: Path, main: bool):
        self.out, self.main = Path(out), main

    def owns_out(self) -> bool:
        return self.main

    def metrics_path(self) -> Path | None:
        return self.out / "metrics.jsonl" if self.main else None

    def summary_path(self) -> Path | None:
        return self.out / "summary.json" if self.main else None

    def status(self, what: str) -> None:
        """What this process is doing now ("evaluating 40", "checkpointing 40"), for whoever watches (torchft: the
        replica's status file, which the launcher reads)."""

    def write_config(self, cfg) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.out / "config.json", {"config_hash": cfg.hash(), "config": cfg.to_dict()})

    def write_checkpoint(self, step: int, config_hash: str, states: dict, tensors: dict | None, writer: bool,
                         collective: bool, keep: int = 1) -> None:
        """Write a checkpoint (mecefo.checkpoint.save): the small states and the model's and optimizer's tensors;
        every process that takes part in it calls this (collective: every process sharing the shards writes its
        own; writer: this one writes the rest and makes it current); keep: how many stay (train.keep_checkpoints)."""
        if writer or collective:
            checkpoint.save(self.checkpoint_path(), step, config_hash, states, tensors, collective=collective,
                            writer=writer, keep_later=self.several_writers, keep=keep)

    def checkpoint_path(self) -> Path:
        return self.out / checkpoint.NAME


def read_config(out: Path, who: str) -> dict:
    """OUT/config.json's config values (for mecefo.config.build), or a one-line UsageError naming `who` writes it."""
    try:
        return json.loads((out / "config.json").read_text())["config"]
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"{out / 'config.json'} cannot be read ({type(e).__name__}); {who} writes it") from None


# ---- the replica status files: OUT/replicas/rank<r>.status, "<what> [<step>] <unix time>", one line, written whole
# by the replica (its group's process 0: mecefo.ft.ReplicaFiles) and by the launcher (starting, down), read by both
# The replica status words, the one list of them (OUT/replicas/rank<r>.status: the word, the step where it has one,
# the time). A replica writes all but DOWN; its supervisor writes STARTING before it starts one and DOWN once it is dead.
STARTING = "starting"  # its process is starting (imports, the group's rendezvous)
WAITING = "waiting"  # in quorums without training: the run's first replicas, or a restarted one before its heal
HEALING = "healing"  # applying the state a live peer sent
STEP = "step"  # "step S": committed step S
EVALUATING = "evaluating"  # "evaluating S"
CHECKPOINTING = "checkpointing"  # "checkpointing S"
BEHIND = "behind"  # "behind S": woke behind the run, waits to heal from a live peer ahead
LEFT = "left"  # "left S": woke after the run had finished without it; stopped without training
FINISHED = "finished"  # done with the run
DOWN = "down"  # its process is dead (written by its supervisor)
TRAINING = (STEP, EVALUATING, CHECKPOINTING)  # the statuses of a replica that trains (status word, then its step)
# the statuses of a rank whose process holds none of the run's current state: dead (down), not yet healed (starting,
# waiting), behind the run (behind: it waits to heal from a live peer ahead; left: it woke after the run had finished),
# or done (finished)
HOLDS_NONE = (DOWN, STARTING, WAITING, BEHIND, LEFT, FINISHED)


def replica_status_path(out: Path, rank: int) -> Path:
    return Path(out) / "replicas" / f"rank{rank}.status"


def write_replica_status(out: Path, rank: int, what: str) -> None:
    atomic_write_text(replica_status_path(out, rank), f"{what} {time.time():.3f}\n")


def read_replica_status(out: Path, rank: int) -> list[str] | None:
    """The status file's words ([what, (step,) time]), or None where there is none yet or it is empty."""
    try:
        return (replica_status_path(out, rank).read_text().split()) or None
    except OSError:
        return None


def missing_folders(out: Path) -> list[Path]:
    """The folders of OUT that do not exist yet (OUT first, then its parents), or a UsageError if OUT cannot be made
    a run folder; what the run's lock creates, and what is removed again if the run refuses to start."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UsageError(f"--out {out} cannot be a run folder: {existing} is "
                         + ("not a directory" if not existing.is_dir() else "not writable"))
    return [p for p in (out, *out.parents) if not p.exists()]


def holds_run_of(out: Path, cfg) -> bool:
    """Whether OUT/config.json is this config's (a run of it started there)."""
    try:
        return json.loads((out / "config.json").read_text()).get("config_hash") == cfg.hash()
    except (OSError, ValueError):
        return False


def prepare_out(out: Path, cfg, resume: bool) -> dict:
    """The rule for an existing OUT, the same for mecefo.train and mecefo.launch (taken under OUT's lock): reuse a
    finished run of this config ({"finished": summary}); continue an interrupted one ({"resume": True} from its
    checkpoint, {"resume": False, "started": True} from the start where it stopped before its first checkpoint);
    start afresh in an empty or new OUT; refuse (UsageError) a folder holding another config's run or anything
    else, a --resume with nothing to resume, and a folder another live run holds. A resume is from the newest intact
    checkpoint kept (mecefo.checkpoint.use_newest_intact); with none intact the run is refused, nothing touched."""
    summary, ckpt = out / "summary.json", out / checkpoint.NAME
    holder = lock_holder(out)  # (None where this process holds it)
    if holder is not None:
        raise UsageError(f"--out {out} is in use by a live run (pid {holder}, {out / LOCK}); wait for it to end or "
                         "choose another --out")
    if summary.exists():
        done = json.loads(summary.read_text())
        if done.get("config_hash") == cfg.hash():
            return {"finished": done, "resume": False, "started": True}
        raise UsageError(f"--out {out} holds a finished run of another config (hash {done.get('config_hash')}); "
                         "choose another --out")
    started = holds_run_of(out, cfg)
    if started:  # the newest intact checkpoint kept becomes the current one (a corrupt newer one skipped, one line)
        has_checkpoint = checkpoint.use_newest_intact(ckpt, cfg.hash()) is not None
    else:  # refuses another config's checkpoint, or a corrupt one, before anything is touched
        has_checkpoint = (ckpt.exists() or ckpt.is_symlink()) and bool(checkpoint.load(ckpt, cfg.hash()))
    if resume and not has_checkpoint and not started:
        raise UsageError(f"--resume given but {out} holds no checkpoint and no run of this config")
    if not has_checkpoint and out.exists() and any(p.name != LOCK for p in out.iterdir()) and not started:
        raise UsageError(f"--out {out} is not empty and holds no run of this config; choose another --out")
    # (our own run, interrupted before its first checkpoint, starts over)
    return {"finished": None, "resume": has_checkpoint, "started": started}


def give_up(out: Path, made: list[Path]) -> None:
    """A run that refused to start: its lock released, and the folders its lock created removed (nothing else was
    written in them)."""
    release_lock(out)
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines written after the checkpoint we resume from (they will be recomputed), and a torn last
    line (a process killed mid-write leaves one) with a note."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append((json.loads(line), line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise UsageError(f"{path}:{i + 1} is not JSON (only a torn last line is dropped); move the file away") from None
            print(f"note: dropping the torn last line of {path} (the run was killed while writing it)", file=sys.stderr)
    atomic_write_text(path, "".join(line + "\n" for row, line in rows if row["step"] <= step))
