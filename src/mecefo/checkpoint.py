"""Checkpoints: one protocol for every stateful part of a run, written with torch.distributed.checkpoint (DCP).

A checkpoint is a folder. Its model and optimizer are written by DCP (`.metadata` and `__<rank>_<i>.distcp`
files), from the engine's own layout: under FSDP2 every process writes its own shards (no process gathers
the model), otherwise the one writing process writes the whole; the tensors are keyed by parameter name
(torch.distributed.checkpoint.state_dict), so a checkpoint loads into another layout: FSDP2 over another
number of processes, or one process holding the whole model (a twin, a resume, an analysis). Only tensors go
through DCP (read back with weights_only, after its `.metadata` has been checked to hold nothing but DCP's
own records: no pickled code runs). Everything else goes to `state.pt`, written by the writer and read as
data only (weights_only): the optimizer's hyperparameters and non-tensor state,
{"step", "config_hash"} and one entry per small component, each from its `state_dict()` and given back
through its `load_state_dict()`: the RNG states, the low-rank subspaces with their epoch, the policy's own
state (checkpoint-restart's snapshot), the run's counters. The data position is the step (a micro-batch is
a pure function of it).

On disk: OUT/checkpoint.step-<S>-<id>/ folders, each written whole in a temporary folder first (flushed to
the disk), then renamed; OUT/checkpoint is a symbolic link to the current one, replaced atomically, so a
writer killed at any moment leaves the previous checkpoint whole. With train.keep_checkpoints K > 1 the
K - 1 highest-step checkpoints that were current before the latest stay beside it (to go back to one:
`ln -sfn checkpoint.step-<S>-<id> OUT/checkpoint`, then --resume).

A checkpoint proves itself: its writer records, last, the size and SHA-256 of every file in the folder
(`digest.json`, after every process's shards are written), and a load verifies them before anything is
applied (verify). A torn copy, a truncated shard, a file missing or added, a folder written by a version
without digests: each is refused with one line naming the file. Where a run resumes (mecefo.runfiles.
prepare_out, the same for mecefo.train, torchrun, FSDP, mecefo.launch and the Slurm path), a current
checkpoint that does not verify is skipped for the newest intact one among those kept (use_newest_intact:
the link moved to it, the bad folders set aside as <name>.corrupt, one line saying which and why); with none
intact the run is refused (exit 2), nothing touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .errors import UsageError, unwritable

NAME = "checkpoint"  # OUT/checkpoint: the link to the current checkpoint folder
STATE = "state.pt"  # in a checkpoint folder: the step, the config hash and the small components
DIGEST = "digest.json"  # in a checkpoint folder: the size and SHA-256 of every other file, written last
CORRUPT = ".corrupt"  # the suffix of a checkpoint folder set aside because it did not verify
TENSORS = ("model", "optimizer")  # the components written by DCP


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
    """Every small component's state (the model and optimizer go through DCP: tensors())."""
    return {name: c.state_dict() for name, c in components.items() if name not in TENSORS}


def tensors(model: torch.nn.Module, optimizer) -> dict:
    """The model's and optimizer's state keyed by parameter name, in the model's own layout (FSDP2: this
    process's shards, as DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


WRITE_DELAY_ENV = "MECEFO_CHECKPOINT_DELAY_S"  # tests, the chaos harness: hold each write before its rename (a big model's)


def save(path: Path, step: int, config_hash: str, states: dict, tensor_states: dict | None = None, *,
         collective: bool = False, writer: bool = True, keep_later: bool = False, keep: int = 1) -> None:
    """Write a checkpoint and make it the current one at path (OUT/checkpoint).

    tensor_states (tensors()) go through DCP: with collective, every process of the default process group calls
    this (FSDP2: each writes its shards; `writer` is the one that also writes state.pt and renames); otherwise
    only the writer calls it. The folder is written under a temporary name of the writer's own (two writers, e.g.
    a stalled one and its successor, never share one), then renamed and linked. With keep_later (several writers:
    torchft), a writer that finds a later step already current (it was stalled while its successor wrote) keeps
    that one; without it a lower step replaces a higher one, as after checkpoint-restart's rollback. keep > 1:
    the K - 1 highest steps current before stay beside it. Temporary folders of writers no longer alive are
    removed."""
    import torch.distributed as dist

    path = Path(path)
    if not (writer or collective):
        return
    if tensor_states is not None:  # only tensors through DCP: the rest to state.pt
        tensor_states, rest = _split(tensor_states)
        states = {**states, **rest}
    name = [f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp" if writer else None]
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=_writer_rank(writer))  # one folder for every process's shards
    tmp = path.parent / name[0]
    try:
        if writer:
            _remove_stale(path)
            tmp.mkdir(parents=True)
        if collective and dist.is_initialized():
            dist.barrier()  # (the folder exists before anyone writes into it)
        if tensor_states is not None:
            import torch.distributed.checkpoint as dcp

            with _quiet():
                dcp.save(tensor_states, checkpoint_id=tmp, no_dist=not collective)
        if not writer:
            return
        _write_state(tmp / STATE, {"step": step, "config_hash": config_hash, **states})
        _seal(tmp)  # (collective: dcp.save returned once every process's shards and the metadata were written)
        delay = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        if delay:
            time.sleep(delay)
        if keep_later and path.exists() and _step_of(path) > step:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        final = path.parent / f"{path.name}.step-{step:08d}-{name[0].rsplit('.', 2)[1]}"
        os.rename(tmp, final)
        _fsync_dir(path.parent)
        link = path.parent / f".{path.name}.{os.getpid()}.link"
        link.unlink(missing_ok=True)
        os.symlink(final.name, link)
        if path.exists() and not path.is_symlink():
            raise UsageError(f"{path} is not a checkpoint link (written by an older version?); move it away")
        os.replace(link, path)
        _fsync_dir(path.parent)
        _prune(path, keep - 1)
    except BaseException as e:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        full = unwritable(e)
        if full is not None and not full.filename:  # (DCP's writes name no file): the line names the checkpoint
            raise OSError(full.errno, full.strerror, f"{path} (step {step})") from e
        raise


def _split(tensor_states: dict) -> tuple[dict, dict]:
    """(the model's and optimizer's tensors, the rest: the optimizer's param_groups and any non-tensor state)."""
    optimizer = tensor_states["optimizer"]
    state, extra = {}, {}
    for name, entry in optimizer["state"].items():
        state[name] = {k: v for k, v in entry.items() if torch.is_tensor(v)}
        if len(state[name]) < len(entry):
            extra[name] = {k: v for k, v in entry.items() if not torch.is_tensor(v)}
    return ({"model": tensor_states["model"], "optimizer": {"state": state}},
            {"optimizer_param_groups": optimizer["param_groups"], "optimizer_extra": extra})


@contextlib.contextmanager
def _quiet():
    """DCP in one process warns that it assumes one process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _writer_rank(writer: bool) -> int:
    """The rank (in the default process group) of the process that writes state.pt (a collective)."""
    import torch.distributed as dist

    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dist.get_rank() if writer else None)
    found = [r for r in ranks if r is not None]
    if len(found) != 1:
        raise RuntimeError(f"a checkpoint needs exactly one writer among the processes sharing it, found {found}")
    return found[0]


def _write_state(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Corrupt(UsageError):
    """A checkpoint folder that does not hold what its writer recorded (one line naming the file and why)."""


def _files(folder: Path) -> list[Path]:
    """Every regular file under folder but the digest, by name."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DIGEST)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _seal(folder: Path) -> None:
    """Record the size and SHA-256 of every file in folder (its digest.json, flushed to the disk)."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(folder)}
    with open(folder / DIGEST, "w") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


_verified: dict = {}  # folder -> the files' (name, size, mtime) when they last verified: not hashed twice per process


def verify(path: Path) -> Path:
    """The checkpoint folder at path (the link resolved), once every file its writer recorded is there with the
    recorded size and SHA-256 and no other file is; else a one-line Corrupt naming the file."""
    link = Path(path)
    folder = link.resolve()
    if not folder.is_dir():
        raise Corrupt(f"checkpoint {link}: its folder {folder.name} is missing")
    try:
        written = json.loads((folder / DIGEST).read_text())["files"]
        if not isinstance(written, dict):
            raise ValueError
    except FileNotFoundError:
        raise Corrupt(f"checkpoint {folder.name} has no {DIGEST} (incomplete, or written by a version before digests)") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise Corrupt(f"checkpoint {folder.name}: its {DIGEST} cannot be read") from None
    present = {p.relative_to(folder).as_posix(): p for p in _files(folder)}
    seen = tuple((name, p.stat().st_size, p.stat().st_mtime_ns) for name, p in present.items())
    if _verified.get(folder) == seen:
        return folder
    for name, record in sorted(written.items()):
        if name not in present:
            raise Corrupt(f"checkpoint {folder.name}: {name} is missing")
        size = present[name].stat().st_size
        if size != record.get("bytes"):
            raise Corrupt(f"checkpoint {folder.name}: {name} is {size} bytes, {record.get('bytes')} when written (truncated "
                          "or torn)")
        if _sha256(present[name]) != record.get("sha256"):
            raise Corrupt(f"checkpoint {folder.name}: {name} is not what was written (its SHA-256 differs)")
    extra = sorted(set(present) - set(written))
    if extra:
        raise Corrupt(f"checkpoint {folder.name}: {extra[0]} was not written with it")
    _verified[folder] = seen
    return folder


def _candidates(path: Path) -> list[Path]:
    """The current checkpoint (the link's folder, even if missing), then the earlier ones kept, newest first."""
    path = Path(path)
    current = [path] if path.is_symlink() or path.exists() else []
    return current + [p for p in reversed(earlier(path))]


def _intact(folder: Path, config_hash: str) -> None:
    """Corrupt unless folder verifies and reads as data; UsageError if it is another config's."""
    folder = verify(folder)
    try:
        if (folder / ".metadata").exists():  # (a checkpoint of small states only has none: its digest says so)
            _checked(folder)
        read(folder)
    except UsageError as e:  # (its digest verifies, yet it would not load: rewritten, digest included)
        raise Corrupt(str(e)) from None
    load(folder, config_hash)


def newest_intact(path: Path, config_hash: str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint that verifies and reads as data: the current one or an earlier one kept, None if none
    does; the newer ones skipped, each with why). A checkpoint of another config is refused (UsageError), not skipped."""
    skipped = []
    for candidate in _candidates(path):
        try:
            _intact(candidate, config_hash)
        except Corrupt as e:
            skipped.append((candidate.resolve() if candidate.is_symlink() else candidate, str(e)))
            continue
        return candidate.resolve(), skipped
    return None, skipped


def describe_newest_intact(path: Path, config_hash: str) -> str:
    """What --resume will use, verified: 'the checkpoint of step S (folder, verified)', with the newer ones skipped and
    why, or that none is intact."""
    chosen, skipped = newest_intact(path, config_hash)
    why = "; ".join(f"skipping {reason}" for _, reason in skipped)
    if chosen is None:
        return f"no checkpoint in {Path(path).parent} is intact ({why})" if skipped else ""
    return f"the checkpoint of step {read(chosen)['step']} ({chosen.name}, verified)" + (f"; {why}" if why else "")


def use_newest_intact(path: Path, config_hash: str) -> Path | None:
    """Make the newest intact checkpoint the current one (OUT/checkpoint), before a resume: newer ones that do not
    verify are set aside as <name>.corrupt (kept to be read, no longer a checkpoint) with one line saying which and why;
    none intact: a one-line UsageError, nothing touched. None where OUT holds no checkpoint."""
    path = Path(path)
    chosen, skipped = newest_intact(path, config_hash)
    if chosen is None:
        if not skipped:
            return None
        raise UsageError(f"no checkpoint in {path.parent} is intact, nothing was changed: "
                         + "; ".join(reason for _, reason in skipped))
    if skipped:
        link = path.parent / f".{path.name}.{os.getpid()}.link"
        link.unlink(missing_ok=True)
        os.symlink(chosen.name, link)
        os.replace(link, path)
        for folder, _ in skipped:
            if folder.is_dir():
                os.rename(folder, folder.with_name(folder.name + CORRUPT))
        _fsync_dir(path.parent)
        import sys

        print(f"note: resuming from the checkpoint of step {read(chosen)['step']} ({chosen.name}, verified): "
              + "; ".join(f"skipped {reason}" for _, reason in skipped)
              + f" (set aside as <name>{CORRUPT})", file=sys.stderr, flush=True)
    return chosen


def seal_trusted(folder: Path) -> Path:
    """Record the digest of a checkpoint folder written before digests, which you trust as it is (it then loads);
    one that has a digest already is left alone (a UsageError)."""
    folder = Path(folder).resolve()
    if not (folder / STATE).exists():
        raise UsageError(f"{folder} is not a checkpoint folder (no {STATE})")
    if (folder / DIGEST).exists():
        raise UsageError(f"{folder} has a digest already; a checkpoint that does not verify is torn, not unsealed")
    _seal(folder)
    return folder


def _remove_stale(path: Path) -> None:
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        pid = stale.name[len(path.name) + 2:].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _written(path: Path) -> list[tuple[int, int, Path]]:
    """Every checkpoint folder beside path: (step, when written, folder)."""
    found = []
    for p in path.parent.glob(f"{path.name}.step-*-*"):
        step, _, written = p.name[len(path.name) + len(".step-"):].partition("-")
        if p.is_dir() and step.isdigit() and written.isdigit():
            found.append((int(step), int(written), p))
    return sorted(found)


def earlier(path: Path) -> list[Path]:
    """The earlier checkpoints kept beside the current one at path, by step."""
    path = Path(path)
    current = path.resolve() if path.exists() else None
    return [p for _, _, p in _written(path) if p.resolve() != current]


def _prune(path: Path, n: int) -> None:
    """Keep the current checkpoint and, of the others, the latest written of each step, the n highest steps."""
    current = path.resolve()
    latest: dict[int, Path] = {}
    drop = []
    for step, _, p in _written(path):  # (by step, then by when written)
        if p.resolve() == current:
            continue
        if step in latest:
            drop.append(latest[step])
        latest[step] = p
    steps = sorted(latest)
    drop += [latest[s] for s in (steps[:-n] if n > 0 else steps)]
    for p in drop:
        shutil.rmtree(p, ignore_errors=True)


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
    """A checkpoint's small state (step, config hash, the components but the model and optimizer), read as data
    (weights_only), memory-mapped; a one-line UsageError if unreadable."""
    try:
        with torch.serialization.safe_globals(_data_types()):
            return torch.load(Path(path) / STATE, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise UsageError(f"checkpoint {path} cannot be read as data ({type(e).__name__}); delete it to start over") from None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle: unpickled here with nothing but DCP's own records allowed, so that a
    tampered one is refused before DCP unpickles it."""

    ALLOWED = {("pathlib", "PosixPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED or module == "torch.distributed.checkpoint.metadata" or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint record")


def _checked(path: Path) -> Path:
    """path, once its DCP metadata holds DCP's records and tensors only (else a one-line UsageError)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        with open(Path(path) / ".metadata", "rb") as f:
            meta = _MetadataUnpickler(f).load()
        if not all(isinstance(m, TensorStorageMetadata) for m in meta.state_dict_metadata.values()):
            raise ValueError("non-tensor items")
    except Exception as e:
        raise UsageError(f"checkpoint {path} cannot be read as data ({type(e).__name__}); delete it to start over") from None
    return Path(path)


def read_model(path: Path) -> dict:
    """The whole model's state dict from a checkpoint, whatever the layout that wrote it (one process, this one)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    verify(path)
    try:
        with _quiet():
            _load_state_dict(state, storage_reader=FileSystemReader(_checked(path)),
                             planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"checkpoint {path}: its model cannot be read ({type(e).__name__}: {e})") from None
    return state["model"]


def load(path: Path, config_hash: str) -> dict:
    """The checkpoint's small state at path, verified (verify), refusing a corrupt or unreadable one or another
    config's with a one-line UsageError."""
    verify(path)
    ckpt = read(path)
    if ckpt.get("config_hash") != config_hash:
        raise UsageError(f"checkpoint {path} belongs to another config (hash {ckpt.get('config_hash')} != "
                         f"{config_hash}); choose another --out")
    return ckpt


def load_tensors(path: Path, model: torch.nn.Module, optimizer, collective: bool = False) -> None:
    """The checkpoint's model and optimizer into this process's (its layout: whole, or FSDP2 shards; with
    collective every process of the default process group calls this and reads its own shards). An optimizer
    without state for a parameter in the checkpoint (it had no gradient yet) gets none here either."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    reader = dcp.FileSystemReader(_checked(path))
    written = reader.read_metadata().state_dict_metadata
    rest = read(path)
    state, _ = _split(tensors(model, optimizer))  # (materialises every parameter's optimizer state, as a destination)
    state["optimizer"]["state"] = {name: entry for name, entry in state["optimizer"]["state"].items()
                                   if any(k.startswith(f"optimizer.state.{name}.") for k in written)}
    with _quiet():
        dcp.load(state, storage_reader=reader, no_dist=not collective)
    for name, entry in rest.get("optimizer_extra", {}).items():
        state["optimizer"]["state"].setdefault(name, {}).update(entry)
    state["optimizer"]["param_groups"] = rest["optimizer_param_groups"]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def restore(ckpt: dict, components: dict) -> int:
    """Give every small component its state back; returns the step to continue from."""
    missing = sorted(set(components) - set(ckpt) - set(TENSORS))
    ckpt = {k: v for k, v in ckpt.items() if not k.startswith("optimizer_")}
    if missing:
        raise UsageError(f"checkpoint lacks {', '.join(missing)} (written by an older version?); delete it to start over")
    for name, c in components.items():
        if name not in TENSORS:
            c.load_state_dict(ckpt[name])
    return ckpt["step"]


def main(argv: list[str] | None = None) -> int:
    """python -m mecefo.checkpoint seal FOLDER: see seal_trusted."""
    import argparse

    from .errors import guarded

    parser = argparse.ArgumentParser(prog="python -m mecefo.checkpoint", description="checkpoints written before "
                                     "digests: record the digest of one you trust, so that it loads")
    parser.add_argument("command", choices=["seal"])
    parser.add_argument("folder", help="OUT/checkpoint or OUT/checkpoint.step-S-ID")

    def run() -> int:
        args = parser.parse_args(argv)
        print(f"sealed {seal_trusted(Path(args.folder))}")
        return 0

    return guarded(run)


if __name__ == "__main__":
    import sys

    sys.exit(main())
