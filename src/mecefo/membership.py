"""Membership: who is alive at a step, and whether the step counts.

Two answers exist. A schedule's (Static, the local and torch backends): the failure schedule says which
ranks are down at each step (mecefo.failures), every step commits, and a non-finite loss stops the run.
torchft's (mecefo.ft.FtMembership): the lighthouse's quorum says who is alive, a replica behind heals from
a live peer, and a step commits only if every participant finished it.

Contract. mecefo.train.Run, in every process of the run (so that collectives match):
  construction     Membership(cfg, rank, device, clock=Clock, **options): the Run's clock (mecefo.timing), into which
                   it times what it waits for (torchft: pace, quorum, heal); options: the backend's own
  before the run   setup(cfg, device, **options) (class: join the processes; returns (rank, device, main, options):
                   main, whether this process prints; options, the constructor's), open_data(cfg, main),
                   agree(decide, device, options) and shards(cfg) (class: the token data, one decision for every
                   process, decide() where OUT is read and locked (the torchft launcher decided before its replicas
                   started: none), the processes sharing the model's shards under FSDP), then
                   connect(components, step, engine) -> the step joined at (torchft: a restarted replica's
                   peers' step, once healed), None if the run ended first
  each step        quorum(step, schedule, end) -> Quorum   the step to run and the ranks down at it (failed
                                                      None: a peer died while the failed set was exchanged; the
                                                      step did not count and is redone); at a step >= end the
                                                      run is over and the failed set is not asked for
                   finish(plan, finite) -> COMMIT | REDO | STOP   after the engine computed the step (finite:
                                                      its loss and gradient norm are); REDO: nothing is applied
                                                      and the same step runs again
                   end_step(row)                      after the row is recorded (None: not committed)
  who writes       io(plan) (this process takes part in an evaluation or a checkpoint), writes(plan) (it writes
                   the files); plan None: outside a step
  after the run    summary_extras(digest) (summary.json's "backend" entries; digest: the engine's checksums of this
                   process's or its group's state), close(); torchft's replica also left_behind(LeftBehind) when it
                   woke after the run had finished without it
  per committed step, Run makes six calls on its parts, in this order: membership.quorum, engine.compute,
                   membership.finish, engine.update, membership.extras (a row's "backend" entries), membership.end_step
  for the engine   engine_options(shard) -> the engine's all_reduce (SUM in place over the replicas: the ranks,
                   or torchft's replica groups; absent where one process, or one FSDP group, holds every rank)
                   and shard_group (this process, and the processes sharing the model's shards with it)
  for the files    files(out): the run's files (mecefo.runfiles.RunFiles; torchft: one set per replica)
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass

import torch

from .errors import UsageError

COMMIT, REDO, STOP = "commit", "redo", "stop"


@dataclass(frozen=True)
class Quorum:
    step: int  # the step to run (torchft: its quorum's; a healed replica jumps to its peers' step)
    failed: frozenset[int] | None  # the ranks down at it (None: the step is void and redone)


class LeftBehind(Exception):
    """A replica woke behind a run that had finished without it (mecefo.ft.FtMembership.keep_to_the_front): it stops
    without training, and the launch completes with the others' history. (Here, not in mecefo.ft: a replica runs that
    module as __main__, where a class of its own would not be the one its membership raises.)"""

    def __init__(self, step: int, front: int):
        super().__init__(f"woke at step {step}, the run at {front}")
        self.step, self.front = step, front


class Membership(abc.ABC):
    """The contract (the module's docstring says who calls what, and when): every membership answers all of it,
    none inherits another's answers by accident."""

    clock = None  # the Run's mecefo.timing.Clock, shared with the step engine (given to the constructor)

    @classmethod
    @abc.abstractmethod
    def setup(cls, cfg, device: torch.device, **options) -> tuple[int, torch.device, bool, dict]: ...

    @classmethod
    @abc.abstractmethod
    def shards(cls, cfg) -> int: ...

    @classmethod
    @abc.abstractmethod
    def open_data(cls, cfg, main: bool): ...

    @classmethod
    @abc.abstractmethod
    def agree(cls, decide, device: torch.device, options: dict) -> dict: ...

    @abc.abstractmethod
    def connect(self, components: dict, step: int, engine) -> int | None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def engine_options(self, shard: str) -> dict: ...

    @abc.abstractmethod
    def files(self, out): ...

    @abc.abstractmethod
    def quorum(self, step: int, schedule, end: int) -> Quorum: ...

    @abc.abstractmethod
    def finish(self, plan, finite: bool) -> str: ...

    @abc.abstractmethod
    def end_step(self, row: dict | None) -> None: ...

    @abc.abstractmethod
    def io(self, plan) -> bool: ...

    @abc.abstractmethod
    def writes(self, plan) -> bool: ...

    @abc.abstractmethod
    def extras(self) -> dict: ...

    @abc.abstractmethod
    def summary_extras(self, digest: list | None) -> dict: ...

    def left_behind(self, e: LeftBehind) -> None:
        """This process woke after the run had finished without it (only torchft's replicas can)."""
        raise e


def token_data(cfg):
    """The config's token data (mecefo.data.TokenData), opened by this process."""
    from .data import TokenData

    return TokenData(cfg.data)


class Static(Membership):
    """The failure schedule's membership in one process (the local backend): every rank is simulated here."""

    def __init__(self, cfg, rank: int, device: torch.device, clock=None, **options):
        if options:
            raise TypeError(f"unexpected options {sorted(options)}")
        self.cfg, self.rank, self.device, self.clock = cfg, rank, device, clock

    # ------------------------------------------------------------------ processes
    @classmethod
    def setup(cls, cfg, device: torch.device, **options) -> tuple[int, torch.device, bool, dict]:
        return 0, device, True, options

    @classmethod
    def shards(cls, cfg) -> int:
        """Processes sharing the model's shards under shard='fsdp' (the torch backend: every rank)."""
        return cfg.cluster.ranks

    @classmethod
    def open_data(cls, cfg, main: bool):
        return token_data(cfg)

    @classmethod
    def agree(cls, decide, device: torch.device, options: dict) -> dict:
        """decide() (this process reads the output folder); its outcome."""
        return decide()

    def connect(self, components: dict, step: int, engine) -> int | None:
        return step

    def close(self) -> None:
        pass

    def engine_options(self, shard: str) -> dict:
        return {}

    def files(self, out):
        from .runfiles import RunFiles

        return RunFiles(out, self.rank == 0)

    # ------------------------------------------------------------------ a step
    def quorum(self, step: int, schedule, end: int) -> Quorum:
        return Quorum(step, schedule.failed[step] if step < end else frozenset())

    def finish(self, plan, finite: bool) -> str:
        return COMMIT if finite else STOP

    def end_step(self, row: dict | None) -> None:
        pass

    # ------------------------------------------------------------------ who writes
    def io(self, plan) -> bool:
        return True

    def writes(self, plan) -> bool:
        return self.rank == 0

    def extras(self) -> dict:
        return {}

    def summary_extras(self, digest: list | None) -> dict:
        return {}


class TorchStatic(Static):
    """The failure schedule's membership with one process per rank under torchrun: the processes join the
    default process group, rank 0 decides for everyone, and every rank takes part in the collectives."""

    @classmethod
    def setup(cls, cfg, device: torch.device, **options) -> tuple[int, torch.device, bool, dict]:
        """Join the process group torchrun describes; returns (rank, this rank's device, rank 0 prints, options)."""
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "0"))
        if world != cfg.cluster.ranks:
            raise UsageError(f"cluster.backend='torch' needs torchrun with --nproc_per_node {cfg.cluster.ranks} "
                             f"(WORLD_SIZE={world or 'unset'})")
        if device.type == "cuda":
            from .placement import local_device

            device = torch.device("cuda", local_device(torch.cuda.device_count()))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return dist.get_rank(), device, dist.get_rank() == 0, options

    @classmethod
    def open_data(cls, cfg, main: bool):
        """Rank 0 builds the token cache while the others wait, then everyone opens it."""
        import torch.distributed as dist

        data = token_data(cfg) if main else None
        dist.barrier()
        return data or token_data(cfg)

    @classmethod
    def agree(cls, decide, device: torch.device, options: dict) -> dict:
        """decide() on rank 0, its outcome (or its UsageError) on every rank, so that all ranks reuse a finished
        run, or all stop, together."""
        import torch.distributed as dist

        outcome, failure = [None], None
        if dist.get_rank() == 0:
            try:
                outcome[0] = ("ok", decide())
            except UsageError as e:
                outcome[0] = ("usage", str(e))
            except Exception as e:  # anything else: every rank stops, rank 0 with the original error
                outcome[0], failure = ("crash", f"rank 0 failed: {type(e).__name__}: {e}"), e
        dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind == "usage":
            raise UsageError(value)
        if kind == "crash":
            raise failure if failure is not None else RuntimeError(value)
        return value

    def engine_options(self, shard: str) -> dict:
        """Unsharded: every rank's sums all-reduced; FSDP: the shard group is every rank (one process each)."""
        import torch.distributed as dist

        if shard == "fsdp":
            return {"shard_group": (self.rank, self.cfg.cluster.ranks)}
        return {"all_reduce": dist.all_reduce}
