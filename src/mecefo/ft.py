"""The torchft backend: each data-parallel rank a replica group under torchft's Manager, surviving real
process deaths: one process holding the whole model (FtCluster), or with --shard fsdp a group of processes
sharding it with FSDP2 (FtShardedCluster). Started by `python -m mecefo.launch`, which also runs the
lighthouse and kills and restarts replicas, or by hand (multi-node; torchrun for a group).

Each step, on every live replica:
  1. quorum (torchft): the lighthouse says which replicas take part; a replica behind the others (a
     restarted process) heals first, from a live peer: parameters, optimizer state, low-rank subspaces,
     the run's counters and the step (= the data position);
  2. the failed set = the ranks 0..n-1 not in the quorum (one all-reduce of a one-hot vector);
  3. the policy (mecefo.policies) plans the step from that failed set: under MeCeFO a failed rank's
     micro-batches are computed by its neighbour with the techniques, as in the other backends;
  4. every replica computes its pieces; the weighted gradient sums are all-reduced with SUM and divided
     by the per-group weights (the aggregation of the other backends, not torchft's 1/participants mean);
  5. torchft's should_commit: the optimizer steps only if every participant finished the step; if one
     died during it, nothing is applied and the step is redone with the next quorum (no step is lost or
     applied twice).
The loop is mecefo.train.Run's, as on every backend; this module is the backend (FtCluster: the hooks of
mecefo.cluster.Backend answered by torchft) and the replica's entry point. Rows of committed steps go to
OUT/replicas/rank<r>.jsonl (the trainer's rows; the replica and the wall time under "backend"), heals to
rank<r>.heals.jsonl, the replica's summary to rank<r>.summary.json (the launcher merges them), a status
file says what the replica is doing, and the lowest live rank evaluates and writes OUT/checkpoint.pt on
the trainer's cadence.

    python -m mecefo.ft --out OUT --replica R --lighthouse ADDR     (the launcher's command; OUT/config.json)
    torchrun --nproc_per_node K ... -m mecefo.ft --out OUT ...     (replica R as a group of K, --shard fsdp)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from . import config as config_mod
from .cluster import Backend, StepResult
from .errors import TrainingStopped, UsageError, guarded
from . import liveness
from .plan import Piece, StepPlan
from .processes import die_with_parent, group_store, serve
from .records import atomic_write_text, repair_tail

HEAL_DELAY_ENV = "MECEFO_FT_HEAL_DELAY_S"  # tests: hold a process's first healing so that it can be killed then
# Faults the tests inject, by environment variable, into a replica's first life (not into a restarted one):
FAULT_VOID = "MECEFO_FT_FAULT_VOID_FROM"  # STEP: every step from STEP on fails (a persistent fault)
FAULT_DIE_IN_QUORUM = "MECEFO_FT_FAULT_DIE_IN_QUORUM"  # R[,R..]:STEP[;...]: these ranks SIGKILL themselves the moment
#   the first new quorum (a changed membership) at or after step STEP forms, before its process group is built: the
#   survivors then meet a dead member at the quorum's store
FAULT_CRASH = "MECEFO_FT_FAULT_CRASH"  # R:STEP: rank R raises an exception at step STEP (a crash: exit status 1)
FAULT_HEAL = "MECEFO_FT_FAULT_HEAL"  # R/J: process J of rank R's replica group fails its first heal (its source "died")
FAULT_ABANDON = "MECEFO_FT_FAULT_ABANDON"  # R:STEP: rank R leaves step STEP's exchange without a collective (an error
#   of its own, alive): its peers are left blocked in the collective on it
FAULT_LONE_COMMIT = "MECEFO_FT_FAULT_LONE_COMMIT"  # R:STEP: only rank R commits step STEP (every other replica's commit
#   fails after the exchange, as when a dying peer's last message reached R alone) and R dies right after writing its
#   row: the others redo the step without it, and R, restarted, heals past it
HOST_ENV = "MECEFO_FT_HOST"  # the address peers reach this replica at; unset: 127.0.0.1, every server on loopback
TIMEOUT_S = float(os.environ.get("MECEFO_FT_TIMEOUT_S", "30"))  # torchft's connect, collective and quorum timeouts
JOIN_TIMEOUT_S = float(os.environ.get("MECEFO_FT_JOIN_TIMEOUT_S", "300"))  # the wait for the peers before training
# A replica gives up waiting for a quorum only when the lighthouse has formed none, or not answered, for this long
# (the cluster is gone; while it recovers, quorums keep forming): above every single wait (TIMEOUT_S, the join wait).
STALL_S = float(os.environ.get("MECEFO_FT_STALL_S", "90"))
VOID_S = float(os.environ.get("MECEFO_FT_VOID_S", "120"))  # a step voided again and again for this long stops the run
LIFE = uuid.uuid4().hex[:12]  # this process, in its rows and heals: the merge tells a restart from a live replica's heal
CHECKPOINT_S = float(os.environ.get("MECEFO_FT_CHECKPOINT_S", "3600"))  # a group's wait for its checkpoint write
# torchft's manager server retries a failed lighthouse request this many times, TIMEOUT_S / (retries + 1) apart
# (100 ms here). With 0 retries a request to a lighthouse that died is answered to nobody: the replica's quorum
# hangs for its whole timeout (torchft 0.2.0: "We don't broadcast in cases when this method returns an error").
QUORUM_RETRIES = max(0, int(TIMEOUT_S * 10) - 1)


@dataclass
class FtCluster(Backend):
    """This replica of a torchft run: computes its pieces, all-reduces through torchft's Manager (which
    tracks the peers' errors), takes its failed set from the quorum and commits with should_commit."""

    run_dir: Path | None = None  # the run folder (mecefo.launch's)
    lighthouse: str = ""  # the lighthouse's address
    min_step_s: float = 0.0  # pace steps to at least this long (so that the launcher's kills land)
    wait_for: int = 1  # replicas to wait for before the first step
    rejoin: bool = False  # a restarted replica: heal from a live peer first
    group: "Group | None" = None  # this process's replica group (join_group)

    def __post_init__(self):
        self.group = self.group or join_group("none", self.device)
        self.replicas = self.run_dir / "replicas"
        self.replicas.mkdir(parents=True, exist_ok=True)
        self.manager, self.store, self.healed = None, None, {}
        self.healed_at, self.healed_before, self.first, self.last_begin = None, False, True, None
        self.heals, self.void_since, self.voids = 0, None, 0
        if self.group.rank == 0:  # a process killed mid-write left a partial last line: cut it before appending
            for name in (f"rank{self.rank}.jsonl", f"rank{self.rank}.heals.jsonl"):
                repair_tail(self.replicas / name)
        self.status("starting")

    def status(self, what: str) -> None:
        if self.group.rank == 0:  # the group's files are its rank 0's
            atomic_write_text(self.replicas / f"rank{self.rank}.status", f"{what} {time.time():.3f}\n")

    # ------------------------------------------------------------------ peers
    def connect(self, components: dict, step: int) -> int | None:
        """torchft's Manager on this replica's own store (a bare process must host one; torchrun would), at
        `step`, then wait for the peers."""
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        self.healed = components  # what a heal sends and takes
        if self.rejoin and not self.live_peer_ahead(step):
            return None
        host, bind = network()
        timeout = timedelta(seconds=TIMEOUT_S)
        pg = liveness.process_group(self.device.type, timeout)  # a new quorum's rendezvous ends when a member dies
        with _manager_server_bound_to(bind), self.deadline(f"the lighthouse at {self.lighthouse}"):
            self.manager = Manager(
                pg=pg, load_state_dict=self.load_state, state_dict=self.state, min_replica_size=1,
                use_async_quorum=False, replica_id=f"mecefo_{self.rank}", store_addr=self.group.address,
                store_port=self.group.port, rank=self.group.rank, world_size=self.group.size, lighthouse_addr=self.lighthouse, hostname=host, timeout=timeout,
                quorum_timeout=timeout, connect_timeout=timeout, init_sync=False, quorum_retries=QUORUM_RETRIES,
                checkpoint_transport=PGTransport(pg, timeout=timeout, device=self.device))  # heals over the process
                # group: no HTTP server (torchft's default transport listens on every interface)
        pg.recorder = self.manager._client = liveness.QuorumRecorder(self.manager._client, self._die_in_quorum)
        pg.recorder.gone, pg.recorder.manager = self.members_gone, self.manager
        if os.environ.get(FAULT_HEAL) == f"{self.rank}/{self.group.rank}" and not self.rejoin:
            self.manager._checkpoint_transport.recv_checkpoint = _fails_once(self.manager._checkpoint_transport.recv_checkpoint)
        pg.lighthouse = self.lighthouse
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        if self.wait():
            return self.manager.current_step()  # a restarted replica: its peers' step, once it has healed
        print(f"rank {self.rank}: the run finished before this replica could rejoin", flush=True)
        return None

    def _die_in_quorum(self, result) -> None:
        changed, self.quorum_id = result.quorum_id != getattr(self, "quorum_id", None), result.quorum_id
        for spec in os.environ.get(FAULT_DIE_IN_QUORUM, "").split(";") if not self.rejoin else ():
            ranks, _, step = spec.partition(":")
            if spec and changed and self.rank in {int(r) for r in ranks.split(",")} and result.max_step >= int(step):
                os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def deadline(self, what: str):
        """torchft's waits end at TIMEOUT_S with an exception: the replica stops with one line naming what it
        waited for (exit 3), not a traceback."""
        try:
            yield
        except (RuntimeError, TimeoutError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TrainingStopped(f"rank {self.rank}: waited {TIMEOUT_S:g} s for {what} in vain ({first})") from None

    def quorum(self) -> None:
        """torchft's quorum (a replica behind its peers heals in it), waited for as long as the cluster makes
        progress (mecefo.liveness.wait_for_quorum); then healed() on what happened in it."""
        heals = self.heals
        try:
            liveness.wait_for_quorum(self.manager, self.lighthouse, STALL_S, TIMEOUT_S, self.manager._client,
                                     agree=self.quorum_agreed, known_gone=self.members_gone)
        except TimeoutError as e:
            raise TrainingStopped(f"rank {self.rank}: waited for a quorum at the lighthouse {self.lighthouse} in vain: "
                                  f"{e}") from None
        self.after_quorum(self.heals > heals)

    quorum_agreed = None  # a replica of one process has nothing to agree on (FtShardedCluster: its group's answer)

    GONE = ("down", "starting", "waiting")  # the status words of a rank whose process holds none of the run's state

    def members_gone(self, members: list[str]) -> set[str]:
        """The members (torchft replica ids, mecefo_R:uuid) whose rank's status file says it holds no state: the
        launcher found it dead ("down"), or a later process of the rank is starting or waiting to heal (the old one
        is dead). Read from the files alone, so every process of a group answers alike for the same files; replicas
        started by hand (no launcher to write "down") are waited for as the lighthouse's view allows."""
        found = set()
        for m in members:
            name = liveness.replica_name(m)
            if not name.startswith("mecefo_") or not name[7:].isdigit() or int(name[7:]) == self.rank:
                continue
            try:
                word = (self.replicas / f"rank{int(name[7:])}.status").read_text().split()[0]
            except (OSError, IndexError):
                continue
            if word in self.GONE:
                found.add(m)
        return found

    def after_quorum(self, healed: bool) -> None:
        """After a quorum: whether this process healed in it (a group's processes must agree: FtShardedCluster)."""

    HEAL_SKIPS = ("rng",)  # components a heal does not send
    several_writers = True  # the lowest live rank writes; a stalled writer may wake after its successor wrote

    def state(self) -> dict:
        """What a live peer sends a replica that heals (everything but the RNG states)."""
        return {k: c.state_dict() for k, c in self.healed.items() if k not in self.HEAL_SKIPS}

    def load_state(self, state: dict) -> None:
        self.status("healing")
        delay = float(os.environ.get(HEAL_DELAY_ENV, "0") or 0)
        if delay and (not self.healed_before or os.environ.get("MECEFO_FT_HEAL_DELAY_EVERY")):
            time.sleep(delay)
        self.healed_before = True
        for k, v in state.items():
            self.healed[k].load_state_dict(v)
        self.healed_at, self.heals = time.time(), self.heals + 1

    def run_finished(self) -> bool:
        """Whether some replica has finished the run (a waiting replica then has nobody to join)."""
        return any(self.replicas.glob("rank*.summary.json"))

    def live_peer_ahead(self, step: int) -> bool:
        """A restarted replica, before its manager exists (and heartbeats, which would make quorums wait for it):
        wait until the lighthouse's last quorum is ahead of `step`, i.e. a live peer holds newer state to heal from.
        False if the run finished first. (Without this, two restarted replicas could form a quorum of their own,
        e.g. with a restarted lighthouse that does not see the others yet, and train a second history.)"""
        self.status("waiting")
        start = time.monotonic()
        while True:
            status = liveness.read_status(self.lighthouse)
            ahead, finished, late = self.agreed(  # (a group's processes must take the same branch)
                ahead=status is not None and status.max_step is not None and status.max_step > step,
                finished=any(self.replicas.glob("rank*.summary.json")), late=time.monotonic() - start > JOIN_TIMEOUT_S)
            if finished:
                print(f"rank {self.rank}: the run finished before this replica could rejoin", flush=True)
                return False
            if ahead:
                return True
            if late:
                raise TrainingStopped(f"rank {self.rank}: waited {JOIN_TIMEOUT_S:g} s (MECEFO_FT_JOIN_TIMEOUT_S) for a "
                                      f"live peer to heal from at the lighthouse {self.lighthouse}")
            time.sleep(0.05)

    def agreed(self, ahead: bool, finished: bool, late: bool) -> tuple[bool, bool, bool]:
        """(every process sees a live peer ahead, any sees the run finished, any has waited too long): this process's
        own answers (a group of several agrees on them: FtShardedCluster)."""
        return ahead, finished, late

    def wait(self) -> bool:
        """Take part in quorums without training (nothing is committed) until `wait_for` replicas are there
        (the run's start) or, for a restarted replica, until it has healed from a live peer. False if the
        run finished meanwhile. The last of these quorums is the first step's."""
        self.status("waiting")
        start = time.monotonic()
        while True:
            if time.monotonic() - start > JOIN_TIMEOUT_S:
                what = "a live peer to heal from" if self.rejoin else f"{self.wait_for} replicas"
                raise TrainingStopped(f"rank {self.rank}: waited {JOIN_TIMEOUT_S:g} s (MECEFO_FT_JOIN_TIMEOUT_S) for "
                                      f"{what} at the lighthouse {self.lighthouse}; "
                                      f"{self.manager.num_participants()} there")
            self.quorum()
            if self.rejoin:
                if self.rejoined():
                    return True
            elif self.manager.num_participants() >= self.wait_for:
                return True
            self.manager.report_error(RuntimeError("waiting for peers"))  # makes should_commit False everywhere
            self.manager.should_commit()
            if self.run_finished():
                return False
            time.sleep(0.05)

    def rejoined(self) -> bool:
        """A restarted replica is back once it has healed from a live peer: its own state (a fresh model) is never
        trained on, whoever else is in the quorum (another restarted replica holds no newer state)."""
        return self.healed_at is not None

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------ a step
    def begin(self, step: int) -> int:
        """The quorum (after pacing the previous step to min_step_s); its step, which is this replica's after
        a heal."""
        if self.last_begin is not None:
            spare = self.min_step_s - (time.perf_counter() - self.last_begin)
            if spare > 0:
                time.sleep(spare)
        self.last_begin = time.perf_counter()
        if not self.first:  # the waiting loop's last quorum is the first step's
            self.quorum()
        self.first = False
        step = self.manager.current_step()
        crash = os.environ.get(FAULT_CRASH, "").split(":")
        if len(crash) == 2 and int(crash[0]) == self.rank and step >= int(crash[1]) and not self.rejoin:
            raise RuntimeError(f"an injected crash at step {step} ({FAULT_CRASH})")
        if self.healed_at is not None:
            print(f"rank {self.rank}: healed from a live peer at step {step}", flush=True)
            if self.group.rank == 0:
                with open(self.replicas / f"rank{self.rank}.heals.jsonl", "a") as f:
                    f.write(json.dumps({"healed_at_step": step, "time": self.healed_at, "life": LIFE}) + "\n")
            self.healed_at = None
        return step

    def failed(self, step: int, schedule) -> frozenset[int] | None:
        """The ranks not in this step's quorum (one all-reduce of a one-hot vector; None if a peer failed
        during the exchange)."""
        from torch.distributed import ReduceOp

        onehot = torch.zeros(self.n_ranks, dtype=torch.float32, device=self.device)
        onehot[self.rank] = 1.0
        self.manager.allreduce(onehot, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None or round(float(onehot[self.rank])) != 1:
            return None
        return frozenset(r for r in range(self.n_ranks) if round(float(onehot[r])) == 0)

    def step(self, plan: StepPlan) -> StepResult:
        from torch.distributed import ReduceOp

        abandon = os.environ.get(FAULT_ABANDON, "").split(":")
        if len(abandon) == 2 and int(abandon[0]) == self.rank and self.manager.current_step() + 1 == int(abandon[1]) \
                and not self.rejoin and not getattr(self, "abandoned", False):
            self.abandoned = True  # once
            self.manager.report_error(RuntimeError(f"an injected abandoned exchange ({FAULT_ABANDON})"))
            return self.exchange_step(plan, self.rank, lambda t: None)
        return self.exchange_step(plan, self.rank, lambda t: self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait())

    def peer_failed(self) -> bool:
        """Whether a peer failed during this step's exchange (torchft's error)."""
        return self.manager.errored() is not None

    def abort(self) -> bool:
        """A non-finite loss: void if a peer died during the exchange (its partial sums are not the step's;
        redone), else reported so that no peer commits it, and training stops."""
        void = self.peer_failed()
        if not void:
            self.manager.report_error(RuntimeError("non-finite loss"))
        self._should_commit()
        return void

    def commits(self, plan: StepPlan | None) -> bool:
        """torchft's should_commit: every participant finished the step (else nothing is applied, and the
        step is redone with the next quorum: no step is lost or applied twice)."""
        if plan is None:
            self.manager.report_error(RuntimeError("the quorum's failed set could not be read"))
        fault = os.environ.get(FAULT_VOID)
        if fault and self.manager.current_step() >= int(fault):
            self.manager.report_error(RuntimeError(f"a persistent fault ({FAULT_VOID}={fault})"))
        lone = os.environ.get(FAULT_LONE_COMMIT, "").split(":")
        if len(lone) == 2 and int(lone[0]) != self.rank and self.manager.current_step() + 1 == int(lone[1]) \
                and not self.rejoin and not getattr(self, "left_alone", False):
            self.left_alone = True  # once
            self.manager.report_error(RuntimeError(f"an injected failed commit ({FAULT_LONE_COMMIT})"))
        return self._should_commit() and plan is not None

    def _should_commit(self) -> bool:
        """torchft's should_commit. A step that does not commit closes this replica's process group at once: gloo
        reports a dead peer only to a collective waiting on that peer's connection, so a survivor still blocked on
        this replica in the step's collective would otherwise wait out the collective timeout (30 s), heartbeating,
        while the lighthouse waits for it to join the next quorum (measured by the chaos harness: 15 s without a
        step). The next quorum builds a new group: the lighthouse gives a new quorum id after a failed commit (a
        restarted lighthouse that repeats this group's id leaves this replica with no group: its next collective fails
        at once, its commit fails, and the quorum after has a new id)."""
        if self.manager.should_commit():
            return True
        self.manager._pg.abort()
        return False

    def end_step(self, row: dict | None) -> None:
        """The status file says the step committed; a step voided again and again for VOID_S stops the run."""
        if row is not None:
            self.void_since, self.voids = None, 0
            self.status(f"step {row['step']}")
            if os.environ.get(FAULT_LONE_COMMIT) == f"{self.rank}:{row['step']}" and not self.rejoin:
                os.kill(os.getpid(), signal.SIGKILL)
            return
        now = time.monotonic()
        self.void_since, self.voids = self.void_since or now, self.voids + 1
        if now - self.void_since > VOID_S:
            error = self.manager.errored()
            raise TrainingStopped(
                f"rank {self.rank}: step {self.manager.current_step() + 1} was voided {self.voids} times over "
                f"{now - self.void_since:.0f} s (MECEFO_FT_VOID_S {VOID_S:g}); the last error: "
                f"{str(getattr(error, 'original_exception', error)).strip().splitlines()[0] if error else 'none'}")

    # ------------------------------------------------------------------ files
    def owns_out(self) -> bool:
        return False  # the launcher writes config.json and merges the replicas' files

    def writes(self, plan: StepPlan | None) -> bool:
        """The lowest live rank evaluates and checkpoints at a step; outside a step every replica evaluates."""
        return self.group.rank == 0 and self.io(plan)

    def io(self, plan: StepPlan | None) -> bool:
        """The replica (its whole group) that writes: the lowest live rank at a step; every replica outside one."""
        return plan is None or self.rank == min(set(range(self.n_ranks)) - plan.failed)

    def metrics_path(self, out):
        return self.replicas / f"rank{self.rank}.jsonl" if self.group.rank == 0 else None

    def summary_path(self, out):
        return self.replicas / f"rank{self.rank}.summary.json" if self.group.rank == 0 else None

    def extras(self) -> dict:
        return {"rank": self.rank, "time": time.time(), "life": LIFE}

    def agreement(self) -> dict:
        """This replica alone (the launcher compares the replicas' digests, in summary_extras)."""
        return {"ranks_checked": [self.rank], "identical": True}

    def summary_extras(self) -> dict:
        return {"rank": self.rank, "digest": self.digest(with_parameters=True)}


class FtShardedCluster(FtCluster):
    """A replica group of k processes sharding the model with FSDP2 (`--shard fsdp`; k = the group's
    WORLD_SIZE, 1 included): the group is one data-parallel rank of the paper, its micro-batches split by rows
    over its processes. Each backward reduce-scatters w_p grad(loss_p) within the group (summed, as on the
    torch backend's FSDP); the gradient shards, the loss and weight sums then cross the groups through
    torchft's all-reduce, process j of every group with process j of the others, SUM, and the per-group
    weights are divided out: the paper's aggregation rule, as on every backend. Low-rank factors G_y^T (x V1)
    are summed within the group and each process adds its shard's rows of (sum) V1^T before the exchange
    (linear, so the sum over groups is the sum of all factors).

    The failure unit is the group: its processes join one quorum (torchft's ManagerServer on the group's
    rank 0 waits for all k) and commit together; when one dies the launcher takes the group down and
    restarts it, and process j heals its own shards (parameters, optimizer state) from process j of a live
    group, the rest of the state as on the unsharded backend. Files are the group's rank 0's."""

    @classmethod
    def build_model(cls, model_cfg, device: torch.device, seed: int) -> torch.nn.Module:
        from .cluster import sharded_model

        return sharded_model(model_cfg, device, seed)  # over the group's process group (the default one)

    def components(self, optimizer) -> dict:
        from .cluster import sharded_components

        self.optimizer = optimizer  # (a heal sends its shards)
        return sharded_components(self.model, optimizer)

    def restore_checkpoint(self, path, config_hash: str, components: dict, optimizer) -> int:
        from .cluster import restore_sharded

        return restore_sharded(path, config_hash, components, self.group.rank)

    def evaluates(self, plan: StepPlan | None) -> bool:
        return self.io(plan)  # the whole group: the forward pass gathers the shards

    def parameters_finite(self) -> bool:
        return _all_in_group(super().parameters_finite(), self.device)

    def run_finished(self) -> bool:
        return not _all_in_group(not super().run_finished(), self.device)  # one answer for the group

    # the model's components gather the whole model: a collective, and the group's processes may send to
    # different groups' processes, or only some of them send; each sends its own shards instead (state)
    HEAL_SKIPS = ("rng", "model", "optimizer")

    def rejoined(self) -> bool:
        """Every process of the group has healed (torchft spreads the heal sources over the group's ranks: one
        transfer can fail while the others succeed; after_quorum kills a group healed by halves)."""
        return _all_in_group(super().rejoined() and self.manager.errored() is None, self.device)

    def agreed(self, ahead: bool, finished: bool, late: bool) -> tuple[bool, bool, bool]:
        votes = _min_in_group([int(ahead), int(not finished), int(not late)], self.device)
        return bool(votes[0]), not votes[1], not votes[2]

    def quorum_agreed(self, ok: bool) -> bool:
        """Whether every process of the group had its quorum try succeed (liveness.wait_for_quorum's agree)."""
        return _all_in_group(ok, self.device)

    def after_quorum(self, healed: bool) -> None:
        """A mid-run heal too must be the whole group's: if only some of its processes healed in this quorum (a
        source died during one transfer), the group holds no one state and kills itself to be restarted."""
        healed_here = _count_in_group(healed, self.device)
        if 0 < healed_here < self.group.size:
            print(f"rank {self.rank}: {healed_here} of the group's {self.group.size} processes healed; the group "
                  "restarts", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def write_checkpoint(self, path, step: int, config_hash: str, states: dict, plan, keep: int = 1) -> None:
        """The group's rank 0 writes; the others wait for the write (MECEFO_FT_CHECKPOINT_S), so that none of them
        goes on to the next quorum, which waits for all of the group's processes, while it writes."""
        super().write_checkpoint(path, step, config_hash, states, plan, keep)
        if self.group.size > 1:
            key = f"mecefo/checkpoint/{step}"
            if self.group.rank == 0:
                self.group.store.set(key, "written")
            else:
                try:
                    self.group.store.wait([key], timedelta(seconds=CHECKPOINT_S))
                except (RuntimeError, TimeoutError):
                    raise TrainingStopped(f"rank {self.rank}: the group's checkpoint of step {step} was not written "
                                          f"within {CHECKPOINT_S:g} s (MECEFO_FT_CHECKPOINT_S)") from None

    def peer_failed(self) -> bool:
        """The group's answer: any of its processes saw a peer fail (its shard of the exchange, and so the
        group's gradient norm, are not the step's)."""
        return not _all_in_group(not super().peer_failed(), self.device)

    @classmethod
    def shards(cls, cfg) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))  # the group's processes

    def failed(self, step: int, schedule) -> frozenset[int] | None:
        """The quorum's failed set, or None for the whole group if any of its processes saw a peer fail during
        the exchange (its processes then all redo the step; one computing while another does not would hang)."""
        down = super().failed(step, schedule)
        return down if _all_in_group(down is not None, self.device) else None

    # ------------------------------------------------------------------ a heal: this process's shards
    def state(self) -> dict:
        from .cluster import _local

        _reshard(self.model)
        return super().state() | {
            "group_size": self.group.size,
            "model": {k: _local(p).detach() for k, p in self.model.named_parameters()},
            "optimizer": _map_tensors(self.optimizer.state_dict(), _local)}

    def load_state(self, state: dict) -> None:
        if state.get("group_size") != self.group.size:
            raise TrainingStopped(f"rank {self.rank}: a live group of {state.get('group_size')} processes cannot heal a "
                                  f"group of {self.group.size} (every replica group must have the same size)")
        model, optimizer = state.pop("model"), state.pop("optimizer")
        state.pop("group_size")
        super().load_state(state)
        from .cluster import _local

        _reshard(self.model)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k, v in model.items():
                _local(params[k]).copy_(v)
        by_index = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, entry in optimizer["state"].items():  # the peer's local shards back into DTensors of our own layout
            p = by_index[int(i)]
            for k, v in entry.items():
                if torch.is_tensor(v) and hasattr(p, "device_mesh") and v.dim() > 0 and v.shape == _local(p).shape:
                    from torch.distributed.tensor import DTensor

                    entry[k] = DTensor.from_local(v.to(self.device), p.device_mesh, p.placements, run_check=False,
                                                  shape=p.shape, stride=p.stride())
        self.optimizer.load_state_dict(optimizer)

    # ------------------------------------------------------------------ a step
    def step(self, plan: StepPlan) -> StepResult:
        import torch.distributed as dist
        from torch.distributed import ReduceOp

        from .cluster import _local, add_low_rank_rows

        self.current_step = plan.step
        self.model.zero_grad(set_to_none=True)
        loss_sum, weight_sum = 0.0, 0.0
        for piece in plan.pieces.get(self.rank, ()):  # every process of the group: one pass per piece (FSDP's
            mine = rows_of(piece, self.group.rank, self.group.size)  # collectives need all of them in each)
            if mine is None:  # more processes than rows: one row at weight 0 (its gradient is exactly 0)
                self.run_piece(Piece(piece.owner, piece.micro, piece.start, piece.start + 1, piece.batch,
                                     piece.techniques), 0.0)
                continue
            loss_sum += self.run_piece(mine, mine.weight) * mine.weight
            weight_sum += mine.weight
        add_low_rank_rows(self.model, self.lowrank, plan, self.group.rank, self.group.size, dist.all_reduce)
        totals = torch.tensor([loss_sum, weight_sum], device=self.device, dtype=torch.float32)
        dist.all_reduce(totals)  # the group's sums (its gradient shards are summed by FSDP's reduce-scatter)
        params = list(self.model.parameters())
        flat = torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))).reshape(-1)
                          for p in params] + [totals])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()  # across the groups
        offset = 0
        for p in params:
            local = flat[offset: offset + _local(p).numel()].view_as(_local(p))
            offset += local.numel()
            if p.grad is None:
                from torch.distributed.tensor import DTensor

                p.grad = DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
            else:
                _local(p.grad).copy_(local)
        self.normalise(plan.counts(len(self.model.layers)))
        loss = flat[-2].item() / max(flat[-1].item(), 1e-12)
        if not _all_in_group(self.manager.errored() is None, self.device):  # each process has its own exchange: if one
            loss = float("nan")  # failed, every process of the group must take the same branch (abort: the step is void)
        return StepResult(loss, plan.samples())

    # ------------------------------------------------------------------ agreement
    def agreement(self) -> dict:
        """The group's processes hold the same V1; the group's digest (every shard's) goes in the summary, where
        the launcher compares the groups'."""
        import torch.distributed as dist

        digests = [None] * self.group.size
        dist.all_gather_object(digests, self.digest(with_parameters=True))
        bases = [d[:d[0] + 1] for d in digests]
        self.group_digest = [x for d in digests for x in d]
        return {"ranks_checked": [self.rank], "identical": all(b == bases[0] for b in bases)}

    def summary_extras(self) -> dict:
        return {"rank": self.rank, "group_size": self.group.size, "digest": self.group_digest}


def _reshard(model: torch.nn.Module) -> None:
    """Put the FSDP2 model's sharded parameters back in place: after a forward pass without backward (an
    evaluation), the root module keeps its parameters gathered, whole, until its next backward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _all_in_group(ok: bool, device: torch.device) -> bool:
    """Whether ok holds in every process of this replica group (a collective of the group)."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _fails_once(recv):
    """A checkpoint transport's recv_checkpoint that fails the first time (FAULT_HEAL)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"an injected failure of this process's heal ({FAULT_HEAL})")
        return recv(*args, **kwargs)

    return wrapped


def _min_in_group(values: list[int], device: torch.device) -> list[int]:
    """Each value's minimum over this replica group's processes (one collective of the group)."""
    import torch.distributed as dist

    t = torch.tensor(values, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]


def _count_in_group(ok: bool, device: torch.device) -> int:
    """In how many processes of this replica group ok holds (a collective of the group)."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag)
    return int(flag.item())


def rows_of(piece: Piece, j: int, k: int) -> Piece | None:
    """Process j's share of a piece's rows when a group of k processes computes it: contiguous, the first
    (rows mod k) processes one row more (None: no row). A share of weight rows/b gives weight * grad of its
    mean loss, so the shares' sum is the piece's."""
    n = piece.stop - piece.start
    start = piece.start + j * (n // k) + min(j, n % k)
    stop = start + n // k + (1 if j < n % k else 0)
    return Piece(piece.owner, piece.micro, start, stop, piece.batch, piece.techniques) if stop > start else None


def _map_tensors(tree, fn):
    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


@dataclass
class Group:
    """This process's replica group: its rank in the group, the group's size, the store the group's
    processes and torchft's Manager meet at (its address as the other replicas reach it), and the store itself
    where this process hosts it."""

    rank: int
    size: int
    address: str
    port: int
    store: object = None


def join_group(shard: str, device: torch.device) -> Group:
    """The replica group this process belongs to. Started by mecefo.launch with --group_size K, or by torchrun:
    RANK, WORLD_SIZE and the group's store at MASTER_ADDR:MASTER_PORT come from the environment (the address
    other replicas reach the store at: MECEFO_FT_HOST if set). Alone (python -m mecefo.ft): a group of one
    that hosts its own store on loopback. With --shard fsdp, the group's processes form the default process
    group, over which FSDP2 shards the model."""
    import torch.distributed as dist

    size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if "MASTER_PORT" in os.environ:
        from torch.distributed import TCPStore

        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ["MASTER_PORT"])
        group = Group(rank, size, os.environ.get(HOST_ENV, "") or address, port,
                      TCPStore(address, port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=JOIN_TIMEOUT_S)))
    elif size == 1:
        store = group_store(*network())
        group = Group(0, 1, network()[0], store.port, store)
    else:
        raise UsageError(f"WORLD_SIZE={size} without MASTER_PORT: a replica group of several processes is started by "
                         "mecefo.launch --group_size or by torchrun")
    if size > 1 and shard != "fsdp":
        raise UsageError(f"a replica group of {size} processes shards the model: --shard fsdp (with --shard none a "
                         "replica is one process)")
    if shard == "fsdp" and not dist.is_initialized():
        from torch.distributed import PrefixStore

        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=PrefixStore("mecefo/group", group.store),
                                    rank=rank, world_size=size, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        except (RuntimeError, TimeoutError) as e:
            raise TrainingStopped(f"group rank {rank}: the {size} processes of its replica group did not all arrive "
                                  f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from None
    return group


def network() -> tuple[str, str]:
    """(the address this replica advertises, the address its servers listen on). On one node, unless
    MECEFO_FT_HOST says otherwise: 127.0.0.1 for both, so that nothing listens beyond the loopback. With
    MECEFO_FT_HOST set (multi-node): that address, listening on every interface. None of these servers
    (torchft's manager, our store, gloo) authenticates its peers: a private network only."""
    host = os.environ.get(HOST_ENV, "")
    return (host, "0.0.0.0") if host else ("127.0.0.1", "127.0.0.1")


class _manager_server_bound_to:
    """torchft 0.2.0's Manager binds its ManagerServer to [::] with no argument to change it: while the Manager
    is built, the class it instantiates is wrapped so that the server listens on `bind` (process-local)."""

    def __init__(self, bind: str):
        self.bind = bind

    def __enter__(self):
        import torchft.manager as manager

        self.module, self.original = manager, manager.ManagerServer
        original, host = self.original, (self.bind if self.bind != "0.0.0.0" else "[::]")
        manager.ManagerServer = lambda **kw: original(**{**kw, "bind": f"{host}:{kw['bind'].rsplit(':', 1)[1]}"})

    def __exit__(self, *exc):
        self.module.ManagerServer = self.original


def replica(cfg, out: Path, rank: int, lighthouse: str, min_step_s: float, wait_for: int, rejoin: bool) -> None:
    """One replica process: mecefo.train's Run on this backend, from OUT/checkpoint.pt if there is one (the
    replicas behind then heal from a live peer)."""
    from .train import Run, resolve_device

    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and torch.cuda.device_count() > 1:  # torchrun's processes of a group on one node
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    group = join_group(cfg.cluster.shard, device)
    training = Run(cfg, out, device, rank, quiet=group.rank != 0, run_dir=out, lighthouse=lighthouse,
                   min_step_s=min_step_s, wait_for=wait_for, rejoin=rejoin, group=group)
    resume = (out / "checkpoint.pt").exists() and not rejoin  # a restarted replica heals from a live peer instead
    if cfg.cluster.shard == "fsdp":  # one answer for the group (another group may be writing the first checkpoint)
        resume = _all_in_group(resume, device)
    try:
        start = training.start(resume=resume)
        if start is not None:
            training.train(start, cfg.train.steps)
            training.summary()
            training.cluster.status("finished")
    finally:
        training.cluster.close()


def _forked(argv: list[str]) -> int:
    """main, in a replica process forked by the fork server (mecefo.processes.serve): a life of its own (the
    merge tells lives apart; the fork inherited the server's)."""
    global LIFE
    LIFE = uuid.uuid4().hex[:12]
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--fork-server" in argv:  # mecefo.launch's: every replica process a fork of this one (mecefo.processes)
        return serve(_forked)
    parser = argparse.ArgumentParser(prog="python -m mecefo.ft", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    config_mod.add_flag(parser, "min-step-s", type=float, default=0.0)
    config_mod.add_flag(parser, "wait-for", type=int, default=1, help="replicas to wait for before the first step")
    parser.add_argument("--rejoin", action="store_true", help="a restarted replica: heal from a live peer first")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a group's process under torchrun: it dies with its torchrun
        die_with_parent()

    def start() -> int:
        try:
            values = json.loads((out / "config.json").read_text())["config"]
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"{out / 'config.json'} cannot be read ({type(e).__name__}); mecefo.launch writes it") from None
        cfg = config_mod.build(values)
        if not 0 <= args.replica < cfg.cluster.ranks:
            raise UsageError(f"--replica {args.replica} must be in 0..{cfg.cluster.ranks - 1}")
        replica(cfg, out, args.replica, args.lighthouse, args.min_step_s, args.wait_for, args.rejoin)
        return 0

    return guarded(start, f"rank {args.replica}: interrupted")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (torchft's and gloo's threads)
