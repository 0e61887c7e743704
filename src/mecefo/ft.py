"""The torchft backend: each data-parallel rank a replica group under torchft's Manager, surviving real
process deaths: one process holding the whole model, or with --shard fsdp a group of processes
sharding it with FSDP2 (mecefo.engine.Sharded over the group). Started by `python -m mecefo.launch`, which also runs the
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
The loop is mecefo.train.Run's and the computation mecefo.engine's, as on every backend; this module is
torchft's membership (FtMembership: steps 1, 2 and 5, the heals, and the exchange's all-reduce), the
replica's files (ReplicaFiles) and the replica's entry point. Rows of committed steps go to
OUT/replicas/rank<r>.jsonl (the trainer's rows; the replica and the wall time under "backend"), heals to
rank<r>.heals.jsonl, the replica's summary to rank<r>.summary.json (the launcher merges them), a status
file says what the replica is doing, and the lowest live rank evaluates and writes OUT/checkpoint on
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
from . import liveness
from . import torchft_private as private
from .errors import BAD_INPUT, CANNOT_GO_ON, TrainingStopped, UsageError, guarded
from .faults import Faults
from .heal import HealTransport, read_token
from .membership import COMMIT, REDO, STOP, LeftBehind, Membership, Quorum, token_data
from .plan import StepPlan
from .placement import local_device
from .processes import die_with_parent, group_store, serve
from .records import atomic_write_json, atomic_write_text, last_row, repair_tail
from .runfiles import (BEHIND, FINISHED, HEALING, HOLDS_NONE, LEFT, STARTING, STEP, TRAINING, WAITING, RunFiles,
                       read_config, read_replica_status, write_replica_status)

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


class ReplicaFiles(RunFiles):
    """One replica's files (its group's rank 0 writes them): OUT/replicas/rank<r>.jsonl (the trainer's rows of
    committed steps), rank<r>.heals.jsonl, rank<r>.summary.json (the launcher merges them) and rank<r>.status
    (what the replica is doing, with the time: the launcher's and the peers' view of it). The lowest live rank
    writes OUT/checkpoint; a group's other processes wait for its write."""

    several_writers = True  # the lowest live rank writes; a stalled writer may wake after its successor wrote

    def __init__(self, out: Path, rank: int, group: "Group"):
        super().__init__(out, main=False)  # the launcher writes config.json and merges the replicas' files
        self.rank, self.group = rank, group
        self.replicas = self.out / "replicas"
        self.replicas.mkdir(parents=True, exist_ok=True)
        if group.rank == 0:  # a process killed mid-write left a partial last line: cut it before appending
            for name in (f"rank{rank}.jsonl", f"rank{rank}.heals.jsonl"):
                repair_tail(self.replicas / name)

    def metrics_path(self) -> Path | None:
        return self.replicas / f"rank{self.rank}.jsonl" if self.group.rank == 0 else None

    def summary_path(self) -> Path | None:
        return self.replicas / f"rank{self.rank}.summary.json" if self.group.rank == 0 else None

    def status(self, what: str) -> None:
        if self.group.rank == 0:  # the group's files are its rank 0's
            write_replica_status(self.out, self.rank, what)

    def status_of(self, rank: int) -> str | None:
        """The first word of a rank's status file (None: none readable)."""
        words = read_replica_status(self.out, rank)
        return words[0] if words else None

    def healed(self, step: int, at: float) -> None:
        if self.group.rank == 0:
            with open(self.replicas / f"rank{self.rank}.heals.jsonl", "a") as f:
                f.write(json.dumps({"healed_at_step": step, "time": at, "life": LIFE}) + "\n")

    def run_finished(self) -> bool:
        """Whether some replica has finished the run."""
        return any(self.replicas.glob("rank*.summary.json"))

    def front(self, n_ranks: int) -> tuple[int, bool, dict[int, int]]:
        """What the run's files say of the other replicas: (the furthest step any of them committed, dead or alive: its
        status's step, or the last of its rows; whether one has finished the run; rank -> step of those whose status
        says they train)."""
        furthest, finished, training = 0, self.run_finished(), {}
        for q in range(n_ranks):
            if q == self.rank:
                continue
            words = read_replica_status(self.out, q) or [""]
            finished = finished or words[0] == FINISHED
            if words[0] in TRAINING and len(words) > 1 and words[1].isdigit():
                training[q] = int(words[1])
                furthest = max(furthest, training[q])
            row = last_row(self.replicas / f"rank{q}.jsonl")
            if row is not None and isinstance(row.get("step"), int):
                furthest = max(furthest, row["step"])
        return furthest, finished, training

    def left_behind(self, woke_at: int, front: int) -> None:
        """OUT/replicas/rank<r>.left.json: this replica woke at step woke_at after the run had finished (at front)
        without it, and stopped without training (the launcher's merge names it)."""
        if self.group.rank == 0:
            atomic_write_json(self.replicas / f"rank{self.rank}.left.json",
                              {"rank": self.rank, "woke_at_step": woke_at, "run_step": front, "time": time.time(), "life": LIFE})
            write_replica_status(self.out, self.rank, f"{LEFT} {woke_at}")

    def write_checkpoint(self, step: int, config_hash: str, states: dict, tensors: dict | None, writer: bool,
                         collective: bool, keep: int = 1) -> None:
        """The group's processes write their shards, its rank 0 the rest; the others wait for the write to be
        made current (MECEFO_FT_CHECKPOINT_S), so that none of them goes on to the next quorum, which waits for all
        of the group's processes, while it writes."""
        super().write_checkpoint(step, config_hash, states, tensors, writer, collective, keep)
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


class FtMembership(Membership):
    """This replica's membership in a torchft run: torchft's Manager says who is alive (the lighthouse's
    quorum), heals this replica from a live peer when it is behind, carries the engine's exchange (its
    all-reduce tracks the peers' errors) and commits a step only if every participant finished it
    (should_commit). With --shard fsdp the replica is a group of processes (one FSDP2 shard group, the
    engine's): they join one quorum, and every answer below is the group's (a process computing while another
    does not would hang), through one collective of the group."""

    def __init__(self, cfg, rank: int, device: torch.device, run_dir: Path, lighthouse: str, min_step_s: float = 0.0,
                 wait_for: int = 1, rejoin: bool = False, group: "Group | None" = None, faults: Faults | None = None,
                 clock=None):
        self.cfg, self.rank, self.device, self.n_ranks, self.clock = cfg, rank, device, cfg.cluster.ranks, clock
        self.lighthouse = lighthouse  # the lighthouse's address
        self.min_step_s = min_step_s  # pace steps to at least this long (so that the launcher's kills land)
        self.wait_for = wait_for  # replicas to wait for before the first step
        self.rejoin = rejoin  # a restarted replica: heal from a live peer first
        self.faults = faults or Faults()  # the tests' (mecefo.faults); none in a run
        self.sharded = cfg.cluster.shard == "fsdp"
        self.group = group or join_group(cfg.cluster.shard, device)  # this process's replica group
        self.replica_files = ReplicaFiles(run_dir, rank, self.group)
        self.token = read_token(run_dir)  # the run's (mecefo.heal): a heal's peer must prove it
        self.replicas = self.replica_files.replicas
        self.manager, self.engine, self.healed = None, None, {}
        self.healed_at, self.healed_before, self.first, self.last_begin = None, False, True, None
        self.quorum_at, self.voided = None, False  # when the last quorum returned; a step voided since the last commit
        self.heals, self.void_since, self.voids = 0, None, 0  # void_since: a liveness.Awake while steps are voided
        self.status(STARTING)

    @classmethod
    def setup(cls, cfg, device: torch.device, replica: int | None = None, **options) -> tuple[int, torch.device, bool, dict]:
        """Replica `replica`'s process: its device (torchrun's processes of a group on one node: a GPU each,
        mecefo.placement), its replica group (join_group) and the tests' faults (mecefo.faults, read once here); the
        group's rank 0 prints."""
        if replica is None:
            raise UsageError("cluster.backend='torchft' starts its replicas under python -m mecefo.launch (see docs/training.md)")
        if device.type == "cuda":
            device = torch.device("cuda", local_device(torch.cuda.device_count()))
            torch.cuda.set_device(device)
        group = join_group(cfg.cluster.shard, device)
        faults = Faults.from_environ(replica, group.rank, options.get("rejoin", False))
        return replica, device, group.rank == 0, {**options, "group": group, "faults": faults}

    @classmethod
    def open_data(cls, cfg, main: bool):
        return token_data(cfg)  # (the launcher has built the token cache)

    @classmethod
    def agree(cls, decide, device: torch.device, options: dict) -> dict:
        """The launcher decided for the run (mecefo.runfiles.prepare_out) and holds OUT's lock: decide is not called.
        A replica resumes from OUT/checkpoint if there is one, unless restarted (it heals from a live peer instead);
        a group's processes answer together (another group may be writing the first checkpoint)."""
        resume = (Path(options["run_dir"]) / "checkpoint").exists() and not options.get("rejoin", False)
        if options["group"].size > 1:
            resume = _all_in_group(resume, device)
        return {"finished": None, "resume": resume}

    def files(self, out) -> ReplicaFiles:
        return self.replica_files

    def status(self, what: str) -> None:
        self.replica_files.status(what)

    @classmethod
    def shards(cls, cfg) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))  # the group's processes

    def engine_options(self, shard: str) -> dict:
        """The engine's exchange crosses the replicas (groups) through torchft's all-reduce; with FSDP the group
        shares the shards."""
        return {"all_reduce": self.all_reduce} | ({"shard_group": (self.group.rank, self.group.size)} if self.sharded else {})

    def _all(self, ok: bool) -> bool:
        """Whether ok holds in every process of this replica (one collective of a group)."""
        return _all_in_group(ok, self.device) if self.sharded else ok

    # ------------------------------------------------------------------ peers
    def connect(self, components: dict, step: int, engine) -> int | None:
        """torchft's Manager on this replica's own store (a bare process must host one; torchrun would), at
        `step`, then wait for the peers."""
        from torchft import Manager

        self.healed, self.engine = components, engine  # what a heal sends and takes
        if self.rejoin and not self.live_peer_ahead(step):
            return None
        host, bind = network()
        timeout = timedelta(seconds=TIMEOUT_S)
        pg = liveness.process_group(self.device.type, timeout)  # a new quorum's rendezvous ends when a member dies
        with private.manager_server_bound_to(bind), self.deadline(f"the lighthouse at {self.lighthouse}"):
            self.manager = Manager(
                pg=pg, load_state_dict=self.load_state, state_dict=self.state, min_replica_size=1,
                use_async_quorum=False, replica_id=f"mecefo_{self.rank}", store_addr=self.group.address,
                store_port=self.group.port, rank=self.group.rank, world_size=self.group.size, lighthouse_addr=self.lighthouse, hostname=host, timeout=timeout,
                quorum_timeout=timeout, connect_timeout=timeout, init_sync=False, quorum_retries=QUORUM_RETRIES,
                checkpoint_transport=HealTransport(pg, timeout, self.device, self.token,
                                                   identity=lambda: (pg.session, pg.member_rank)))  # heals over the process
                # group, tensors and JSON after proof of the run's token (mecefo.heal): no HTTP server (torchft's default
                # transport listens on every interface), no pickle (torchft's PGTransport unpickles what a peer sends)
        pg.recorder = liveness.QuorumRecorder(private.client(self.manager), self._die_in_quorum)
        private.set_client(self.manager, pg.recorder)
        pg.recorder.gone, pg.recorder.manager = self.members_gone, self.manager
        if self.faults.heal_fails():
            private.wrap_heal_receiver(self.manager, _fails_after)
        pg.lighthouse = self.lighthouse
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        if self.wait():
            return self.manager.current_step()  # a restarted replica: its peers' step, once it has healed
        print(f"rank {self.rank}: the run finished before this replica could rejoin", flush=True)
        return None

    def _die_in_quorum(self, result) -> None:
        changed, self.quorum_id = result.quorum_id != getattr(self, "quorum_id", None), result.quorum_id
        if self.faults.dies_in_quorum(changed, result.max_step):
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

    def _quorum(self) -> None:
        """torchft's quorum (a replica behind its peers heals in it), waited for as long as the cluster makes
        progress (mecefo.liveness.wait_for_quorum); then after_quorum on what happened in it."""
        heals, t0 = self.heals, time.perf_counter()
        try:
            liveness.wait_for_quorum(self.manager, self.lighthouse, STALL_S, TIMEOUT_S, private.client(self.manager),
                                     agree=self._all if self.sharded else None, known_gone=self.members_gone)
        except TimeoutError as e:
            raise TrainingStopped(f"rank {self.rank}: waited for a quorum at the lighthouse {self.lighthouse} in vain: "
                                  f"{e}") from None
        self.clock.add("heal" if self.heals > heals else "quorum", time.perf_counter() - t0)  # (a heal: the transfer too)
        self.after_quorum(self.heals > heals)

    def members_gone(self, members: list[str]) -> set[str]:
        """The members (torchft replica ids, mecefo_R:uuid) whose rank's status file says it holds none of the run's
        state (mecefo.runfiles.HOLDS_NONE): the launcher found it dead ("down"), a later process of the rank is
        starting or waiting to heal (the old one is dead), it is behind the run, or done with it. Read from the files alone, so every process of a group answers alike for the same files; replicas
        started by hand (no launcher to write "down") are waited for as the lighthouse's view allows."""
        found = set()
        for m in members:
            name = liveness.replica_name(m)
            if not name.startswith("mecefo_") or not name[7:].isdigit() or int(name[7:]) == self.rank:
                continue
            if self.replica_files.status_of(int(name[7:])) in HOLDS_NONE:
                found.add(m)
        return found

    def after_quorum(self, healed: bool) -> None:
        """A mid-run heal must be the whole group's: if only some of its processes healed in this quorum (a source
        died during one transfer), the group holds no one state and kills itself to be restarted."""
        if not self.sharded:
            return
        healed_here = _count_in_group(healed, self.device)
        if 0 < healed_here < self.group.size:
            print(f"rank {self.rank}: {healed_here} of the group's {self.group.size} processes healed; the group "
                  "restarts", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def state(self) -> dict:
        """What a live peer sends a replica that heals: every component but the RNG states, and with FSDP this
        process's own shards instead of the gathered model and optimizer (gathering is a collective, and the
        group's processes may send to different groups' processes, or only some of them send)."""
        skips = ("rng", *self.engine.heal_skips)
        return {k: c.state_dict() for k, c in self.healed.items() if k not in skips} | (
            {"shards": self.engine.heal_state()} if self.sharded else {})

    def load_state(self, state: dict) -> None:
        shards = state.pop("shards", None)
        if self.sharded and (shards or {}).get("group_size") != self.group.size:
            raise TrainingStopped(f"rank {self.rank}: a live group of {(shards or {}).get('group_size')} processes "
                                  f"cannot heal a group of {self.group.size} (every replica group must have the same size)")
        self.status(HEALING)
        time.sleep(self.faults.heal_delay(self.healed_before))
        self.healed_before = True
        for k, v in state.items():
            self.healed[k].load_state_dict(v)
        if shards is not None:
            self.engine.load_heal_state(shards)
        self.healed_at, self.heals = time.time(), self.heals + 1

    def run_finished(self) -> bool:
        """Whether some replica has finished the run (a waiting replica then has nobody to join; the group's answer)."""
        return not self._all(not self.replica_files.run_finished())

    def live_peer_ahead(self, step: int) -> bool:
        """A restarted replica, before its manager exists (and heartbeats, which would make quorums wait for it):
        wait until the lighthouse's last quorum is ahead of `step`, i.e. a live peer holds newer state to heal from.
        False if the run finished first. (Without this, two restarted replicas could form a quorum of their own,
        e.g. with a restarted lighthouse that does not see the others yet, and train a second history.)"""
        self.status(WAITING)
        start = time.monotonic()
        while True:
            status = liveness.read_status(self.lighthouse)
            ahead, finished, late = self.agreed(  # (a group's processes must take the same branch)
                ahead=status is not None and status.max_step is not None and status.max_step > step,
                finished=self.replica_files.run_finished(), late=time.monotonic() - start > JOIN_TIMEOUT_S)
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
        """(every process sees a live peer ahead, any sees the run finished, any has waited too long): the group's
        answers."""
        if not self.sharded:
            return ahead, finished, late
        votes = _min_in_group([int(ahead), int(not finished), int(not late)], self.device)
        return bool(votes[0]), not votes[1], not votes[2]

    def wait(self) -> bool:
        """Take part in quorums without training (nothing is committed) until `wait_for` replicas are there
        (the run's start) or, for a restarted replica, until it has healed from a live peer. False if the
        run finished meanwhile. The last of these quorums is the first step's."""
        self.status(WAITING)
        start = time.monotonic()
        while True:
            if time.monotonic() - start > JOIN_TIMEOUT_S:
                what = "a live peer to heal from" if self.rejoin else f"{self.wait_for} replicas"
                raise TrainingStopped(f"rank {self.rank}: waited {JOIN_TIMEOUT_S:g} s (MECEFO_FT_JOIN_TIMEOUT_S) for "
                                      f"{what} at the lighthouse {self.lighthouse}; "
                                      f"{self.manager.num_participants()} there")
            self._quorum()
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
        trained on, whoever else is in the quorum (another restarted replica holds no newer state). A group: once
        every process has healed (torchft spreads the heal sources over the group's ranks: one transfer can fail
        while the others succeed; after_quorum kills a group healed by halves)."""
        if not self.sharded:
            return self.healed_at is not None
        return _all_in_group(self.healed_at is not None and self.manager.errored() is None, self.device)

    def keep_to_the_front(self, end: int, check: bool = True) -> None:
        """After a quorum: train only at the run's front. A replica stalled (SIGSTOP, swap, a VM paused, an NFS hang)
        while its peers went on wakes behind them, and a lighthouse that has forgotten them can give it a quorum of its
        own: it must not train a second history from its old state. So the run's files are read (the furthest step
        any other replica committed, dead or alive, and whether one has finished: ReplicaFiles.front) and, behind them:
          - a replica finished the run: this one stops without training (LeftBehind: exit 0, named in the summary);
          - a replica ahead is alive (it trains, and the lighthouse hears it): the step is void and the quorum asked
            again, until one with that peer heals this replica (STALL_S of this process's waking time at most);
          - none ahead is alive: one step behind, the step a replica committed alone before it died (torchft agrees on
            a commit within a replica group only) is redone (the merge's rule: a version that died with its replica);
            further behind, this replica holds no state the run can go on from: it stops (exit 3), after
            liveness.REJOIN_GRACE_S in which a stalled peer ahead may wake.
        A group's processes decide together (one collective of the group, with each process's deadlines in the vote).
        check False: nothing to read (the caller knows this replica missed no quorum); a group always checks."""
        if not check:
            return
        waited, since = liveness.Awake(cap_s=2 * TIMEOUT_S), None
        while True:
            step = self.manager.current_step()
            if step >= end:
                return
            furthest, finished, training = self.replica_files.front(self.n_ranks)
            ahead = {q for q, s in training.items() if s > step}
            live = bool(ahead) and self._alive(ahead)
            spent = waited() if since is not None else 0.0
            grace_over, stall_over = spent > liveness.REJOIN_GRACE_S, spent > STALL_S
            if self.sharded:
                votes = _min_in_group([-furthest, int(not finished), int(not live), int(not grace_over),
                                       int(not stall_over)], self.device)
                furthest, finished, live, grace_over, stall_over = -votes[0], *(not v for v in votes[1:])
            what = front_verdict(step, furthest, finished, live)
            if what == "left":
                raise LeftBehind(step, max(furthest, step))
            if what == "train":
                if since is not None:
                    print(f"rank {self.rank}: at the run's front again at step {step}", flush=True)
                    self.status(f"{STEP} {step}")
                return
            if since is None:
                since = step
                print(f"rank {self.rank}: at step {step} behind the run (step {furthest} committed): "
                      + ("waiting to heal from a live peer ahead" if live else "no live peer ahead yet"), flush=True)
            if (not live and grace_over) or stall_over:
                raise TrainingStopped(
                    f"rank {self.rank}: at step {step} behind the run (step {furthest} was committed), and "
                    + ("no replica ahead of it is alive to heal from" if not live else
                       f"no quorum with a live replica ahead formed within {STALL_S:g} s (MECEFO_FT_STALL_S)")
                    + ": it stops rather than train a second history")
            self.status(f"{BEHIND} {step}")
            self.manager.report_error(RuntimeError("behind the run's front"))  # nothing of this quorum commits
            self.manager.should_commit()
            time.sleep(0.1 if live else liveness.STATUS_EVERY_S)
            self._quorum()

    def _alive(self, ranks: set[int]) -> bool:
        """Whether the lighthouse hears one of these ranks' replicas (a heartbeat younger than its timeout); an
        unreachable lighthouse tells nothing: True (the caller waits, within its bound)."""
        status = liveness.read_status(self.lighthouse)
        if status is None:
            return True
        names = {f"mecefo_{q}" for q in ranks}
        return any(liveness.replica_name(h) in names and h not in status.dead for h in status.heartbeats)

    def left_behind(self, e: LeftBehind) -> None:
        print(f"rank {self.rank}: woke at step {e.step} after the run had finished (step {e.front}) without it; it "
              "stops without training (the summary names it under backend.left_behind)", flush=True)
        self.replica_files.left_behind(e.step, e.front)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------ a step
    def quorum(self, step: int, schedule, end: int) -> Quorum:
        """torchft's quorum (after pacing the previous step to min_step_s), its step (this replica's after a heal)
        and the ranks missing from it (one all-reduce of a one-hot vector; None, and the step void, if a peer failed
        during that exchange). At a step >= end the run is over: no exchange."""
        if self.last_begin is not None:
            spare = self.min_step_s - (time.perf_counter() - self.last_begin)
            if spare > 0:
                with self.clock("pace"):
                    time.sleep(spare)
        self.last_begin = time.perf_counter()
        first, heals = self.first or self.quorum_at is None, self.heals
        if not self.first:  # the waiting loop's last quorum is the first step's
            self._quorum()
        self.first = False
        # Behind the run only if this replica missed a quorum the others formed: it was away (this quorum returned long
        # after the last), a step of its was void, it healed, or this is its first; a group's processes always vote.
        away = self.quorum_at is None or time.monotonic() - self.quorum_at > liveness.CHECK_AFTER_S
        self.keep_to_the_front(end, check=self.sharded or first or away or self.voided or self.heals > heals)
        self.quorum_at = time.monotonic()
        step = self.manager.current_step()
        if crash := self.faults.crashes(step):
            raise RuntimeError(crash)
        if self.healed_at is not None:
            print(f"rank {self.rank}: healed from a live peer at step {step}", flush=True)
            self.replica_files.healed(step, self.healed_at)
            self.healed_at = None
        if step >= end:
            return Quorum(step, frozenset())
        with self.clock("quorum"):
            down = self._failed()
        if down is None:
            self._commits(None)
        return Quorum(step, down)

    def _failed(self) -> frozenset[int] | None:
        from torch.distributed import ReduceOp

        onehot = torch.zeros(self.n_ranks, dtype=torch.float32, device=self.device)
        onehot[self.rank] = 1.0
        self.manager.allreduce(onehot, reduce_op=ReduceOp.SUM).wait()
        ok = self.manager.errored() is None and round(float(onehot[self.rank])) == 1
        if not self._all(ok):  # any process of the group saw a peer fail: the whole group redoes the step
            return None
        return frozenset(r for r in range(self.n_ranks) if round(float(onehot[r])) == 0)

    def all_reduce(self, t: torch.Tensor) -> None:
        """The engine's exchange: SUM over the replicas through torchft's Manager (which records a peer's failure
        instead of raising). A group whose process saw a failure fills t with NaN in every process: the step's
        numbers are not its, and every process must take the same branch (void, redone)."""
        from torch.distributed import ReduceOp

        if not self.sharded and (abandon := self.faults.abandons(self.manager.current_step())):
            self.manager.report_error(RuntimeError(abandon))
            return
        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        if self.sharded and not _all_in_group(self.manager.errored() is None, self.device):
            t.fill_(float("nan"))

    def peer_failed(self) -> bool:
        """Whether a peer failed during this step's exchange (torchft's error; a group: any of its processes saw
        one, so its shard of the exchange, and the group's gradient norm, are not the step's)."""
        return not self._all(self.manager.errored() is None)

    def finish(self, plan: StepPlan, finite: bool) -> str:
        """A non-finite loss: void (REDO) if a peer died during the exchange (its partial sums are not the step's),
        else reported so that no peer commits it, and training stops (STOP). A finite one: torchft's should_commit
        (COMMIT: every participant finished the step; else REDO with the next quorum: no step is lost or applied
        twice)."""
        if not finite:
            void = self.peer_failed()
            if not void:
                self.manager.report_error(RuntimeError("non-finite loss"))
            self._should_commit()
            return REDO if void else STOP
        return COMMIT if self._commits(plan) else REDO

    def _commits(self, plan: StepPlan | None) -> bool:
        if plan is None:
            self.manager.report_error(RuntimeError("the quorum's failed set could not be read"))
        for fault in (self.faults.voids(self.manager.current_step()), self.faults.refuses_commit(self.manager.current_step())):
            if fault:
                self.manager.report_error(RuntimeError(fault))
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
        private.abort_process_group(self.manager)
        return False

    def end_step(self, row: dict | None) -> None:
        """The status file says the step committed; a step voided again and again for VOID_S stops the run."""
        self.voided = row is None
        if row is not None:
            self.void_since, self.voids = None, 0
            self.status(f"{STEP} {row['step']}")
            if self.faults.dies_after_commit(row["step"]):
                os.kill(os.getpid(), signal.SIGKILL)
            return
        self.void_since, self.voids = self.void_since or liveness.Awake(cap_s=2 * TIMEOUT_S), self.voids + 1
        voided_s = self.void_since()  # (this process's waking time: a replica stopped for long is not timed out by it)
        if voided_s > VOID_S:
            error = self.manager.errored()
            raise TrainingStopped(
                f"rank {self.rank}: step {self.manager.current_step() + 1} was voided {self.voids} times over "
                f"{voided_s:.0f} s (MECEFO_FT_VOID_S {VOID_S:g}); the last error: "
                f"{str(getattr(error, 'original_exception', error)).strip().splitlines()[0] if error else 'none'}")

    # ------------------------------------------------------------------ who writes
    def writes(self, plan: StepPlan | None) -> bool:
        """The lowest live rank evaluates and checkpoints at a step; outside a step every replica evaluates."""
        return self.group.rank == 0 and self.io(plan)

    def io(self, plan: StepPlan | None) -> bool:
        """The replica (its whole group) that writes: the lowest live rank at a step; every replica outside one."""
        return plan is None or self.rank == min(set(range(self.n_ranks)) - plan.failed)

    def extras(self) -> dict:
        return {"rank": self.rank, "time": time.time(), "life": LIFE}

    def summary_extras(self, digest: list | None) -> dict:
        """The replica's (its group's) digest, which the launcher compares across replicas."""
        return {"rank": self.rank, **({"group_size": self.group.size} if self.sharded else {}), "digest": digest}


def front_verdict(step: int, furthest: int, finished: bool, live: bool) -> str:
    """What a replica at `step` does after a quorum, from the run's files (FtMembership.keep_to_the_front): 'left' (a
    replica finished the run without it: stop without training), 'train' (at the front; or exactly one step behind
    replicas none of which is alive: a step committed alone by a replica that died with it, redone), 'heal' (a live
    replica ahead: void the step and ask again) or 'wait' (behind replicas none of which is alive, by more than one
    step: a stalled one may wake within the grace; then stop)."""
    if finished:
        return "left"
    if furthest <= step or (not live and furthest == step + 1):
        return "train"
    return "heal" if live else "wait"


def _all_in_group(ok: bool, device: torch.device) -> bool:
    """Whether ok holds in every process of this replica group (a collective of the group)."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _fails_after(recv):
    """A checkpoint transport's recv_checkpoint that receives the state and then fails, every time (mecefo.faults.HEAL): the
    transfer fails at its end, in a quorum where it worked, so that the group's other processes heal in it whatever
    this machine's timing (a first transfer that failed for real in them too would leave no group healed by halves);
    the group then kills itself (after_quorum) and its restarted processes heal whole."""

    def wrapped(*args, **kwargs):
        recv(*args, **kwargs)
        raise RuntimeError("an injected failure of this process's heal (MECEFO_FT_FAULT_HEAL)")

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


def replica(cfg, out: Path, rank: int, lighthouse: str, min_step_s: float, wait_for: int, rejoin: bool,
            tensorboard: Path | None = None) -> None:
    """One replica process: mecefo.train's run() on this backend, from OUT/checkpoint if there is one (the replicas
    behind then heal from a live peer)."""
    from .train import run

    run(cfg, out, tensorboard=tensorboard, replica=rank, run_dir=out, lighthouse=lighthouse, min_step_s=min_step_s,
        wait_for=wait_for, rejoin=rejoin)


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
    parser.add_argument("--tensorboard", metavar="DIR", help="TensorBoard scalars of this replica's rows (mecefo.board)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a group's process under torchrun: it dies with its torchrun
        die_with_parent()

    def start() -> int:
        cfg = config_mod.build(read_config(out, "mecefo.launch"))
        if not 0 <= args.replica < cfg.cluster.ranks:
            raise UsageError(f"--replica {args.replica} must be in 0..{cfg.cluster.ranks - 1}")
        replica(cfg, out, args.replica, args.lighthouse, args.min_step_s, args.wait_for, args.rejoin,
                Path(args.tensorboard) if args.tensorboard else None)
        return 0

    code = guarded(start, f"rank {args.replica}: interrupted")
    if code in (BAD_INPUT, CANNOT_GO_ON) and os.environ.get("RANK", "0") == "0":  # for a supervisor that sees only
        with contextlib.suppress(OSError):  # torchrun's status (1 for any worker's failure): mecefo.slurm's node
            atomic_write_text(exit_path(out, args.replica), f"{code}\n")
    return code


def exit_path(out: Path, rank: int) -> Path:
    """OUT/replicas/rank<r>.exit: the status a replica stopped with when it was 2 (bad input) or 3 (cannot go on)."""
    return out / "replicas" / f"rank{rank}.exit"


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (torchft's and gloo's threads)
