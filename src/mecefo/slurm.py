"""MeCeFO with real failures on a Slurm allocation: one replica group per node, each restarted on its node when it
dies, the progress line and a failure injector. scripts/slurm/mecefo.sbatch runs them; `submit` does the same
through submitit.

    python -m mecefo.slurm lighthouse --port 29510 &                          # on the batch host (the first node)
    python -m mecefo.slurm node --out DIR --lighthouse http://HEAD:29510        # srun: once per node
    python -m mecefo.slurm watch --out DIR [--kill 1:200:30s] [--chaos 7:0.5]  # on the batch host, in the background
    python -m mecefo.slurm submit --out DIR --nodes 4 --gpus_per_node 8 [--partition P] -- TRAINER FLAGS

`lighthouse` runs torchft's lighthouse with our settings (mecefo.lighthouse), listening on every interface: the other
nodes reach it at the first node's hostname. It is the job's single point of failure: if it dies, the replicas wait
for it (MECEFO_FT_STALL_S, 90 s) and then stop (exit 3); the same job submitted again continues.

`node` is the supervisor of one node: it starts the node's replica, rank SLURM_NODEID (`python -m mecefo.ft`, or with
--shard fsdp a replica group of --group_size processes under torchrun, one per GPU of the node), and when the
replica dies it starts it again with --rejoin (it heals from a live peer): at once after anyone's signal (an OOM
killer's, say), and after a crash (any other exit but 0, 2 and 3) up to --max_restarts times; after the injector's
kill, when the kill says (mecefo.supervise's grammar: never, at a step, after seconds). It ends with the replica's
own status: 0 finished, 2 bad input, 3 cannot go on (every replica dead: submit the same job again and it continues
from the last checkpoint). Other nodes reach this node's servers at its hostname (MECEFO_FT_HOST, unless set).

`watch` prints the run's progress line (mecefo.progress: step, ranks training, last heal, ETA) every
MECEFO_PROGRESS_S seconds, and is the failure injector: --kill and --stall in mecefo.supervise's grammar (a node's
whole replica group: RANK/PROCESS and the lighthouse are mecefo.launch's alone; each --kill fires once per run, a job
submitted again included), and --chaos SEED[:RATE], drawn by mecefo.chaos's generator from the kinds a node's
supervisor can fire (INJECTABLE: every kind but killing one process of a group and the lighthouse, and `all`). An
injection is an order, a file OUT/slurm/order-node<R> that node R's supervisor acts on (the injector needs no access
to the other nodes, only to the run folder they share). Every program logs its events in OUT/events/
(mecefo.supervise: node<R>.jsonl, watch.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import chaos
from . import config as config_mod
from . import lighthouse as lighthouse_mod
from .errors import CANNOT_GO_ON, UsageError, guarded
from .ft import exit_path
from .processes import die_with_parent
from .progress import ProgressLine
from .records import atomic_write_text, read_rows
from .runfiles import DOWN, FINISHED, HEALING, LEFT, STARTING, STEP, TRAINING, read_config, write_replica_status
from .supervise import (CrashBudget, EventLog, ReplicaGroup, committed_step, exit_kind, parse_kill, parse_stall,
                        read_statuses, replica_env)

POLL_S = 0.05
LIGHTHOUSE_WAIT_S = 120.0  # a node waits this long for the lighthouse to answer before its replica starts
RUN_OVER_S = 30.0  # a replica still rejoining this long after every other replica finished is given up
# the chaos kinds a node's supervisor can fire on an order (mecefo.chaos.KINDS): not one process of a group (torchrun
# owns them), not the lighthouse (the batch script owns it), not `all` (the job would end: resubmitting is by hand)
INJECTABLE = frozenset({"kill", "multi_kill", "kill_healing", "kill_writer", "kill_store", "kill_checkpoint", "external",
                        "stall", "long_stall", "stall_past_end"})
GONE = (DOWN, FINISHED, LEFT)  # statuses of a rank whose process does not run


def slurm_dir(out: Path) -> Path:
    return out / "slurm"


def order_path(out: Path, node: int) -> Path:
    """OUT/slurm/order-node<R>: what the injector asks node R's supervisor to do (JSON: what, why, restart, seconds)."""
    return slurm_dir(out) / f"order-node{node}"


def run_config(out: Path):
    return config_mod.build(read_config(out, "mecefo.launch --prepare"))


def committed(out: Path, ranks: int, steps: int) -> tuple[int, list[str]]:
    """The furthest committed step over the replicas' status files, and each replica's status word ("none": none)."""
    statuses = read_statuses(out, ranks)
    return committed_step(statuses, steps), [statuses.get(r, ["none"])[0] for r in range(ranks)]


def replica_command(out: Path, rank: int, lighthouse: str, group_size: int, shard: str, wait_for: int, rejoin: bool,
                    host: str, min_step_s: float, tensorboard: str | None = None) -> list[str]:
    """The node's replica: `python -m mecefo.ft`, or a group of group_size processes under torchrun (--shard fsdp)."""
    if shard == "fsdp":
        with socket.socket() as s:  # the group's store, on this node
            s.bind(("", 0))
            port = s.getsockname()[1]
        starter = ["-m", "torch.distributed.run", "--nproc_per_node", str(group_size), "--master_addr", host,
                   "--master_port", str(port), "-m", "mecefo.ft"]
    elif group_size > 1:
        raise UsageError(f"--group_size {group_size}: a group of several processes shards the model (--shard fsdp)")
    else:
        starter = ["-m", "mecefo.ft"]
    return [sys.executable, *starter, "--out", str(out), "--replica", str(rank), "--lighthouse", lighthouse,
            "--min_step_s", str(min_step_s), *(["--rejoin"] if rejoin else ["--wait_for", str(wait_for)]),
            *(["--tensorboard", str(Path(tensorboard) / f"rank{rank}")] if tensorboard else [])]


def node_gpus(environ=os.environ) -> int:
    """The GPUs Slurm gave this node's task: SLURM_GPUS_ON_NODE, else those CUDA_VISIBLE_DEVICES lists, else 1 (the
    CPU: one process)."""
    if environ.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return max(int(environ["SLURM_GPUS_ON_NODE"]), 1)
    listed = [g for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return max(len(listed), 1)


def wait_for_lighthouse(lighthouse: str, seconds: float = LIGHTHOUSE_WAIT_S) -> None:
    lighthouse_mod.wait_until_up(lighthouse, seconds,
                                 where=" (is it running on the first node, and its port open between the nodes?)")


def take_order(path: Path) -> dict | None:
    """The injector's order for this node, once (the file is removed); None if there is none."""
    try:
        order = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return order


class Node:
    """One node's supervisor (see the module's docstring): its replica group's process, the orders it acts on, and
    its events (OUT/events/node<R>.jsonl)."""

    def __init__(self, out: Path, rank: int, cfg, say_prefix: str):
        self.out, self.rank, self.cfg, self.ranks = out, rank, cfg, cfg.cluster.ranks
        self.log, self.t0, self.prefix = EventLog(out, f"node{rank}"), time.time(), say_prefix
        self.group = None  # the replica group's torchrun or process, in a session of its own (ReplicaGroup)
        self.step, self.words = 0, []  # the run as the last look saw it

    def say(self, msg: str, **event) -> None:
        print(f"[{self.prefix} {time.time() - self.t0:8.2f}s] {msg}", flush=True)
        if event:
            self.log.record(node=self.rank, **event)

    def look(self) -> tuple[int, list[str]]:
        """The replicas' status files, read once: the committed step and every replica's status word."""
        self.step, self.words = committed(self.out, self.ranks, self.cfg.train.steps)
        return self.step, self.words

    def others(self) -> list[str]:
        return [w for r, w in enumerate(self.words) if r != self.rank]

    def run_over(self) -> bool:
        """Every other replica has finished the run."""
        others = self.others()
        return bool(others) and all(w == FINISHED for w in others)

    def act(self, order: dict) -> dict | None:
        """Carry out the injector's order; the order if it killed the replica (its restart says when it comes back)."""
        step, why = self.look()[0], order.get("why", "injector")  # (now: the step the injector acted at, or later)
        if order.get("what") == "stall":
            seconds = order.get("seconds")
            self.group.stall(seconds if seconds is not None else math.inf)
            self.say(f"replica {self.rank} stopped " + (f"for {seconds:g} s" if seconds is not None else
                                                       "until every other replica has ended") + f" ({why})",
                     kind="stall", rank=self.rank, seconds=seconds, why=why, step=step)
            return None
        if order.get("what") == "external":  # behind the plan (as an OOM killer would): seen as a death
            self.group.signal(signal.SIGKILL)
            return None
        self.group.kill()  # every process of the group: a node lost
        write_replica_status(self.out, self.rank, DOWN)  # its peers do not wait for it (FtMembership.members_gone)
        self.log.record(node=self.rank, kind="kill", rank=self.rank, why=why, step=step)  # (the launcher's event
        return order  # names: the merge's recovery timings)

    def wake(self) -> None:
        """SIGCONT a stalled group when its stall is over (a stall past the end: once every other replica ended)."""
        if self.group.wake_due(others_ended=all(w in GONE for w in self.others())):
            self.group.wake()
            self.say(f"replica {self.rank} goes on", kind="stall_end", rank=self.rank, step=self.step)

    def wait_for_restart(self, restart: dict | None) -> int | None:
        """After a kill: wait for its restart (after seconds, once a step is committed, or never); an exit status
        (0: the run finished without it, a replica finished it; 3: every replica is down, nobody left to heal it)
        if it is not restarted."""
        if restart is not None and "after_s" in restart:
            self.say(f"replica {self.rank} killed by the injector; restarting in {restart['after_s']:g} s")
            time.sleep(restart["after_s"])
            return None
        self.say(f"replica {self.rank} killed by the injector; " + (f"restarted once step {restart['at_step']} is "
                 "committed" if restart is not None else "not restarted"))
        nobody_since = None
        while True:
            step, _ = self.look()
            if restart is not None and step >= restart["at_step"]:
                return None
            others = self.others()
            if FINISHED in others:
                self.say(f"the run finished without replica {self.rank}", kind="not_rejoined")
                return 0
            if all(w in GONE + ("none",) for w in others):
                nobody_since = nobody_since or time.monotonic()
                if time.monotonic() - nobody_since > RUN_OVER_S:
                    self.say(f"every replica is down: node {self.rank} stops", kind="stopped", code=CANNOT_GO_ON)
                    return CANNOT_GO_ON
            else:
                nobody_since = None
            time.sleep(POLL_S)


def node(out: Path, rank: int, lighthouse: str, group_size: int | None, max_restarts: int, min_step_s: float = 0.0,
         tensorboard: str | None = None) -> int:
    """One node's supervisor (see the module's docstring); returns its exit status. group_size None: the node's GPUs
    (SLURM_GPUS_ON_NODE) with --shard fsdp, else 1."""
    cfg = run_config(out)
    ranks = cfg.cluster.ranks
    if not 0 <= rank < ranks:
        raise UsageError(f"node {rank}: the run in {out} has {ranks} ranks (cluster.ranks), one per node; "
                         f"this allocation has more nodes")
    if group_size is None:
        group_size = node_gpus() if cfg.cluster.shard == "fsdp" else 1
    wait_for_lighthouse(lighthouse)
    host = os.environ.get("MECEFO_FT_HOST") or socket.gethostname()
    env = replica_env(one_thread=False) | {"MECEFO_FT_HOST": host}  # (less Slurm's or a caller's torchrun)
    sup, crashes, rejoin, why = Node(out, rank, cfg, f"node {rank}"), CrashBudget(max_restarts), False, "initial"
    orders = order_path(out, rank)
    orders.unlink(missing_ok=True)

    def stop(signum, _frame):  # scancel, the time limit, Ctrl-C: the replica group goes down with its supervisor
        if sup.group is not None:
            sup.group.kill()
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)

    stopped_with = exit_path(out, rank)
    while True:
        stopped_with.unlink(missing_ok=True)
        write_replica_status(out, rank, STARTING)  # (not the dead one's)
        with open(out / "replicas" / f"node{rank}.log", "a") as log:
            proc = subprocess.Popen(replica_command(out, rank, lighthouse, group_size, cfg.cluster.shard, ranks, rejoin,
                                                    host, min_step_s, tensorboard),
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=die_with_parent)  # (a supervisor SIGKILLed takes its replica along)
        sup.group = ReplicaGroup(rank, [proc], sessions=True)
        sup.say(f"started replica {rank} (pid {sup.group.pids()}, {group_size} process{'es' if group_size > 1 else ''}"
                f"{', rejoining' if rejoin else ''})", kind="start", rank=rank, why=why, step=sup.look()[0])
        killed, gone_since = None, None
        while (ended := sup.group.ended()) is None:
            order = take_order(orders) if orders.exists() else None
            if order is not None and (killed := sup.act(order)) is not None:
                ended = sup.group.ended()
                break
            words = sup.look()[1]
            sup.wake()
            if sup.run_over() and words[rank] not in (FINISHED, STEP):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > RUN_OVER_S:  # the run ended while this replica was rejoining
                    sup.group.kill()
                    sup.say(f"the run finished before replica {rank} rejoined ({words[rank]}): stopped", kind="not_rejoined")
                    return 0
            time.sleep(POLL_S)
        step, code = sup.look()[0], ended[1]
        if exit_kind(code) != "stopped" and code != 0 and stopped_with.exists():  # under torchrun: the replica's own
            code = int(stopped_with.read_text().strip() or code)  # status (torchrun exits 1 for any worker's failure)
        kind = exit_kind(code)
        if killed is not None:
            if (ended := sup.wait_for_restart(killed.get("restart"))) is not None:
                return ended
            why = "restart after a kill"
        elif kind == "finished":
            sup.say(f"replica {rank} finished", kind="finished")
            return 0
        elif kind == "stopped":
            sup.say(f"replica {rank} stopped with exit {code} (see {out / 'replicas'}): the node stops too", kind="stopped",
                    code=code)
            return code
        elif kind == "killed":
            sup.say(f"replica {rank} died of signal {-code} at step {step}: restarting", kind="down", rank=rank, code=code,
                    unplanned=True, step=step)
            why = "restart after a death"
        else:
            sup.log.record(node=rank, kind="down", rank=rank, code=code, unplanned=True, step=step)
            if not crashes.crashed(rank):
                sup.say(f"replica {rank} crashed (exit {code}) {crashes.of(rank)} times: the node stops", kind="crash",
                        rank=rank, code=code, step=step)
                return code
            sup.say(f"replica {rank} crashed (exit {code}, crash {crashes.of(rank)} of {max_restarts} allowed): restarting",
                    kind="crash", rank=rank, code=code, step=step)
            why = "restart after a crash"
        sup.look()
        if sup.run_over():
            sup.say(f"the run has finished: replica {rank} is not restarted", kind="not_rejoined")
            return 0
        rejoin = True


class Injector:
    """The watcher's hands, for its --kill and --stall plan and for mecefo.chaos's Punisher (whose supervisor it is):
    orders written into the run folder (order_path) for the nodes' supervisors, and the view of the run that the
    replicas' status files give. Orders of one look are written together by flush() (a kill and its restart are one
    order)."""

    can = INJECTABLE

    def __init__(self, out: Path, ranks: int, steps: int, log: EventLog):
        self.out, self.ranks, self.steps, self.events = out, ranks, steps, log
        self.observed, self.pending = {}, {}
        self.stalled = {}  # rank -> until when it was ordered stopped (time.monotonic(); inf: until the others end)

    def look(self) -> tuple[int, list[str]]:
        self.observed = read_statuses(self.out, self.ranks)
        return self.committed(), [self.observed.get(r, ["none"])[0] for r in range(self.ranks)]

    # the view (mecefo.chaos.Punisher's)
    def committed(self) -> int:
        return committed_step(self.observed, self.steps)

    def statuses(self) -> dict[int, str]:
        return {r: words[0] for r, words in self.observed.items()}

    def ordered(self, rank: int) -> bool:
        """An order for rank is waiting (this look's, or one its supervisor has not taken yet)."""
        return rank in self.pending or order_path(self.out, rank).exists()

    def running(self, rank: int) -> bool:
        """Whether rank's replica runs, with no order waiting for it (an order goes to a running replica only)."""
        return self.statuses().get(rank, DOWN) not in GONE and not self.ordered(rank)

    def training(self) -> list[int]:
        """Ranks holding the run's state: training, not stopped by a stall, no order waiting."""
        now = time.monotonic()
        self.stalled = {r: until for r, until in self.stalled.items() if until > now}
        return sorted(r for r, w in self.statuses().items() if w in TRAINING and self.running(r) and r not in self.stalled)

    def alive(self) -> list[int]:
        return sorted(r for r, w in self.statuses().items() if w not in GONE)

    def has_checkpoint(self) -> bool:
        return (self.out / "checkpoint").exists()

    def log(self, msg: str, **event) -> None:
        print(f"[watch] {msg}", flush=True)
        if event:
            self.events.record(**event)

    # the verbs
    def kill(self, rank: int, why: str, process: int | None = None) -> None:
        self.pending[rank] = {"what": "kill", "why": why, "restart": None}

    def restart_after(self, rank: int, seconds: float) -> None:
        self.pending[rank]["restart"] = {"after_s": float(seconds)}

    def kill_unplanned(self, rank: int) -> None:
        self.pending[rank] = {"what": "external", "why": "outside the plan"}

    def stall(self, rank: int, seconds: float, why: str = "chaos: stall") -> None:
        self.pending[rank] = {"what": "stall", "seconds": None if math.isinf(seconds) else float(seconds), "why": why}
        self.stalled[rank] = time.monotonic() + seconds

    def flush(self, step: int, at: dict | None = None) -> None:
        """Write the orders of this look (at: rank -> the --kill/--stall it answers, recorded once per run)."""
        for rank, order in self.pending.items():
            atomic_write_text(order_path(self.out, rank), json.dumps(order))
            mark = (at or {}).get(rank)
            self.events.record(kind="inject", node=rank, what=order["what"], why=order.get("why"), step=step,
                               restart=order.get("restart"), **({"at": mark} if mark is not None else {}))
            print(f"[watch] node {rank} {_said(order, step)}", flush=True)
        self.pending = {}


def watch(out: Path, kills: list[str], stalls: list[str], chaos_spec: str | None, stop_after_s: float | None = None) -> int:
    """The progress line and the failure injector (see the module's docstring); returns 0 when the run has finished."""
    cfg = run_config(out)
    ranks, steps = cfg.cluster.ranks, cfg.train.steps
    plan = [slurm_kill(k, ranks) for k in kills] + [parse_stall(s, ranks) for s in stalls]
    punisher = chaos.Punisher(*chaos.parse(chaos_spec), 1, steps, can=Injector.can) if chaos_spec else None
    log = EventLog(out, "watch")
    fired = {(e["node"], e["at"]) for e in log.events if e["kind"] == "inject" and "at" in e}
    marks = [f"kill {s}" for s in kills] + [f"stall {s}" for s in stalls]
    for k, mark in zip(plan, marks):  # a job submitted again: each fires once per run, not once per job
        k.done = (k.rank, mark) in fired
    start = resumed_from(out, ranks)
    if start:  # (the merge's recovery timings end at a resume: no interval spans two jobs)
        log.record(kind="resume", step=start)
    hands = Injector(out, ranks, steps, log)
    progress, heals = ProgressLine(steps), {r: _size(out / "replicas" / f"rank{r}.heals.jsonl") for r in range(ranks)}
    t0 = time.monotonic()
    while True:
        step, words = hands.look()
        if FINISHED in words and all(w in GONE + ("none",) for w in words):  # (a node killed for good included)
            return 0
        for r in range(ranks):  # a heal is a line of the replica's heals file (mecefo.ft)
            path = out / "replicas" / f"rank{r}.heals.jsonl"
            size = _size(path)
            if size > heals.get(r, 0):
                last = path.read_text().strip().splitlines()[-1]
                with contextlib.suppress(ValueError, KeyError):
                    progress.healed(r, json.loads(last)["healed_at_step"])
            heals[r] = size
        line = progress.line(step, sum(w in TRAINING for w in words), ranks)
        if line:
            print(f"[watch] {line}", flush=True)
        if stop_after_s is not None and time.monotonic() - t0 > stop_after_s:
            return 0
        at = {}
        for k, mark in zip(plan, marks):
            due = (k.at_step is not None and step >= k.at_step) or (k.at_step is None and words[k.rank] == HEALING)
            if k.done or not due or not hands.running(k.rank):
                continue
            k.done, at[k.rank] = True, mark
            if k.what == "stall":
                hands.stall(k.rank, k.seconds, "--stall")
                continue
            hands.kill(k.rank, "--kill")
            hands.pending[k.rank]["restart"] = ({"after_s": k.restart_after_s} if k.restart_after_s is not None else
                                                {"at_step": k.restart_step} if k.restart_step else
                                                {"after_s": 0.0} if k.at_step is None else None)
        if punisher is not None:  # (after the plan: it draws among the ranks with no order this look)
            punisher.poll(hands, time.monotonic())
        hands.flush(step, at)
        time.sleep(POLL_S)


def _said(order: dict, step: int) -> str:
    """An order in words (the watcher's line)."""
    why = order.get("why")
    if order["what"] == "stall":
        return f"stopped at step {step} ({why}; " + (f"for {order['seconds']:g} s)" if order["seconds"] is not None
                                                    else "until the others end)")
    if order["what"] == "external":
        return f"killed outside the plan at step {step}"
    restart = order.get("restart")
    return f"killed at step {step} ({why}; " + ("never restarted)" if restart is None else
                                              f"restarted after {restart['after_s']:.1f} s)" if "after_s" in restart
                                              else f"restarted at step {restart['at_step']})")


def slurm_kill(spec: str, ranks: int):
    """A --kill of the injector: mecefo.supervise's grammar, whole nodes only."""
    return parse_kill(spec, ranks, processes=False, lighthouse=False)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def resumed_from(out: Path, ranks: int) -> int:
    """The step a job continues from: the last row the replicas kept (mecefo.launch --prepare cuts them back to the
    checkpoint); 0 for a new run."""
    steps = [row.get("step", 0) for r in range(ranks) if (out / "replicas" / f"rank{r}.jsonl").exists()
             for row in read_rows(out / "replicas" / f"rank{r}.jsonl")[0]]
    return max(steps, default=0)


# ---------------------------------------------------------------------------------------------- submit (submitit)
def add_submit_arguments(p) -> None:
    p.add_argument("--out", required=True, help="the run folder, on a file system every node sees")
    p.add_argument("--nodes", type=int, required=True, help="nodes = data-parallel ranks (one replica group each)")
    config_mod.add_flag(p, "gpus-per-node", type=int, default=0, help="GPUs per node (with --shard fsdp, the group size)")
    config_mod.add_flag(p, "cpus-per-task", type=int, default=None)
    p.add_argument("--partition", help="Slurm partition")
    config_mod.add_flag(p, "time-min", type=int, default=48 * 60, help="the job's time limit, minutes")
    p.add_argument("--cluster", choices=("slurm", "local"), default=None,
                   help="submitit's executor (default: slurm where sbatch is found, else local)")
    p.add_argument("--port", type=int, default=None, help=f"the lighthouse's port (default {lighthouse_mod.PORT})")
    p.add_argument("--kill", action="append", default=[], help="the injector's kills (mecefo.supervise's grammar)")
    p.add_argument("--stall", action="append", default=[], help="the injector's RANK:STEP:SECONDS|end")
    p.add_argument("--chaos", metavar="SEED[:RATE]", help="the injector's random events")
    config_mod.add_flag(p, "max-restarts", type=int, default=3)
    config_mod.add_flag(p, "min-step-s", type=float, default=0.0)
    p.add_argument("--tensorboard", metavar="DIR", help="each replica's TensorBoard scalars in DIR/rank<R> (mecefo.board)")
    p.add_argument("--wait", action="store_true", help="wait for the job, then merge its records")


@dataclass
class NodeTask:
    """What submitit runs on every node (pickled by submitit, so its fields are plain values): the node's supervisor,
    and on the first node also the lighthouse and the watcher, kept until every replica has finished."""

    out: str
    port: int
    group_size: int | None
    kills: list
    stalls: list
    chaos: str | None
    max_restarts: int
    min_step_s: float
    tensorboard: str | None = None

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        rank, head, out = env.global_rank, env.hostnames[0], Path(self.out)
        lighthouse = f"http://{head}:{self.port}"
        helpers = []
        if rank == 0:  # the first node: the lighthouse and the watcher
            slurm_dir(out).mkdir(parents=True, exist_ok=True)
            with open(slurm_dir(out) / "lighthouse.log", "a") as log:
                helpers.append(subprocess.Popen(lighthouse_mod.command(f"[::]:{self.port}"), stdout=log,
                                                stderr=subprocess.STDOUT, env=lighthouse_mod.environment()))
            helpers.append(subprocess.Popen([sys.executable, "-m", "mecefo.slurm", "watch", "--out", self.out,  # the
                                             *(a for k in self.kills for a in ("--kill", k)),  # progress line, and
                                             *(a for k in self.stalls for a in ("--stall", k)),  # the injector
                                             *(["--chaos", self.chaos] if self.chaos else [])]))
        try:
            code = guarded(lambda: node(out, rank, lighthouse, self.group_size, self.max_restarts, self.min_step_s,
                                        self.tensorboard), "interrupted")
            if rank == 0:  # keep the lighthouse for the others' last steps
                cfg = run_config(out)
                deadline = time.monotonic() + RUN_OVER_S * 2
                while time.monotonic() < deadline and any(
                        w not in GONE + ("none",) for w in committed(out, cfg.cluster.ranks, cfg.train.steps)[1]):
                    time.sleep(0.2)
            return code
        finally:
            for p in helpers:
                p.kill()
                p.wait()


def submit(args, trainer_flags: list[str]) -> int:
    """`submit`: scripts/slurm/mecefo.sbatch through submitit, from Python. On the submitting machine it checks the
    trainer flags and writes DIR/config.json (mecefo.launch --prepare, DIR on a file system the nodes share), then
    submits one task per node (NodeTask). With --wait it waits for the job and merges the replicas' records
    (mecefo.launch --merge); without, it prints the job id and the merge command. `--cluster local` runs the job's
    tasks as processes of this machine (submitit's LocalExecutor, each task standing for a node): how the tests run
    it."""
    import shutil

    import submitit

    from .launch import main as launch_main
    from .launch import merge_by_hand

    if args.nodes < 1:
        raise UsageError(f"--nodes {args.nodes} must be at least 1")
    if trainer_flags[:1] == ["--"]:
        trainer_flags = trainer_flags[1:]
    if "--ranks" in trainer_flags:
        raise UsageError("--ranks: one rank per node, set by --nodes")
    for k in args.kill:
        slurm_kill(k, args.nodes)
    for k in args.stall:
        parse_stall(k, args.nodes)
    if args.chaos:
        chaos.parse(args.chaos)
    code = launch_main(["--out", args.out, "--prepare", "--ranks", str(args.nodes), *trainer_flags])
    if code != 0:
        return code
    fsdp = run_config(Path(args.out)).cluster.shard == "fsdp"
    cluster = args.cluster or ("slurm" if shutil.which("sbatch") else "local")
    executor = submitit.AutoExecutor(folder=Path(args.out) / "slurm" / "submitit", cluster=cluster)
    if cluster == "local":  # one machine: each task stands for a node
        executor.update_parameters(tasks_per_node=args.nodes, timeout_min=args.time_min)
    else:
        executor.update_parameters(nodes=args.nodes, tasks_per_node=1, timeout_min=args.time_min, name="mecefo",
                                   **({"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}),
                                   **({"cpus_per_task": args.cpus_per_task} if args.cpus_per_task else {}),
                                   **({"slurm_partition": args.partition} if args.partition else {}))
    task = NodeTask(args.out, args.port or lighthouse_mod.PORT, args.gpus_per_node if fsdp and args.gpus_per_node else None,
                    list(args.kill), list(args.stall), args.chaos, args.max_restarts, args.min_step_s, args.tensorboard)
    job = executor.submit(task)
    print(f"submitted job {job.job_id} ({cluster}, {args.nodes} nodes): its logs in {Path(args.out) / 'slurm' / 'submitit'}",
          flush=True)
    if not args.wait:
        print(f"when it has finished: python -m mecefo.launch --out {args.out} --merge", flush=True)
        return 0
    codes = job.results()
    worst = max(codes, key=lambda c: (c != 0, c))
    if worst != 0:
        print(f"the job's nodes ended with {codes}: see {Path(args.out) / 'replicas'}", file=sys.stderr, flush=True)
        return worst
    return merge_by_hand(Path(args.out), False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mecefo.slurm", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = parser.add_subparsers(dest="verb", required=True)
    h = sub.add_parser("lighthouse", help="torchft's lighthouse with our settings (mecefo.lighthouse), on every interface")
    h.add_argument("--port", type=int, default=lighthouse_mod.PORT)
    n = sub.add_parser("node", help="one node's supervisor (run by srun, once per node)")
    n.add_argument("--out", required=True)
    n.add_argument("--lighthouse", required=True)
    n.add_argument("--node", type=int, help="this node's replica (default: SLURM_NODEID)")
    config_mod.add_flag(n, "group-size", type=int, default=None,
                        help="processes of the node's replica group with --shard fsdp (default: SLURM_GPUS_ON_NODE, else 1)")
    config_mod.add_flag(n, "max-restarts", type=int, default=3)
    config_mod.add_flag(n, "min-step-s", type=float, default=0.0)
    n.add_argument("--tensorboard", metavar="DIR", help="the replica's TensorBoard scalars in DIR/rank<R> (mecefo.board)")
    i = sub.add_parser("watch", help="the progress line and the failure injector (on the batch host, in the background)")
    i.add_argument("--out", required=True)
    i.add_argument("--kill", action="append", default=[], help="mecefo.supervise's grammar, whole nodes: NODE:STEP"
                   "[:RESTART_STEP | :SECONDSs] or NODE:heal")
    i.add_argument("--stall", action="append", default=[], help="NODE:STEP:SECONDS or NODE:STEP:end")
    i.add_argument("--chaos", metavar="SEED[:RATE]", help="random events (mecefo.chaos), the kinds in INJECTABLE")
    add_submit_arguments(sub.add_parser("submit", help="submit the job through submitit"))
    args, rest = parser.parse_known_args(argv)

    def run() -> int:
        if args.verb != "submit" and rest:
            raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
        if args.verb == "lighthouse":
            command = lighthouse_mod.command(f"[::]:{args.port}")
            os.execve(command[0], command, lighthouse_mod.environment())
        out = Path(args.out)
        if args.verb == "node":
            rank = args.node if args.node is not None else int(os.environ.get("SLURM_NODEID", "-1"))
            if rank < 0:
                raise UsageError("python -m mecefo.slurm node: no --node and no SLURM_NODEID (run it under srun)")
            return node(out, rank, args.lighthouse, args.group_size, args.max_restarts, args.min_step_s, args.tensorboard)
        if args.verb == "watch":
            return watch(out, args.kill, args.stall, args.chaos)
        return submit(args, rest)

    return guarded(run, "interrupted: this node's replica was killed (the same job submitted again continues)")


if __name__ == "__main__":
    sys.exit(main())
