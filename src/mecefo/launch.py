"""Real failures: train with the torchft backend while a supervisor kills replica processes with SIGKILL
and restarts them.

    python -m mecefo.launch --config experiments/configs/nano.toml --ranks 3 --failures high --out DIR
    python -m mecefo.launch ... --kill 1:10:20 --kill 2:heal        # explicit kills (see --help)

Starts torchft's lighthouse (in this process), the n replica processes (`python -m mecefo.ft`), and a
supervisor that follows the committed step. The kill plan comes from the failure schedule (--failures, as
for mecefo.train: a scenario at cluster.seconds_per_step, or a trace; a rank failed at step s is killed
once step s is reached, and restarted at its recovery step) and from --kill R:S[:S2] (kill rank R at step
S and, with S2, restart it once step S2 is committed) or --kill R:heal (kill rank R while it is healing,
the next time it heals; it is restarted at once; the kill lands while it applies the state received from a peer: torchft calls our loader
after the transfer). A restarted process heals from a live peer and rejoins. With --shard fsdp --group_size K
each rank is a replica group of K processes sharding the model (mecefo.ft.FtShardedCluster): a kill takes the
whole group (a node lost), --kill R/J:S[:S2] kills its process J only, and a group missing any process is
taken down and restarted. Every process started here is
killed on exit, Ctrl-C included. If every replica is dead at once, the run stops (exit 3) with the last
checkpoint intact; `--resume` continues from it.

Outputs in DIR, merged from the replicas' files in the trainer's record schema (mecefo.records):
metrics.jsonl (the step-0 evaluation, then one row per committed step: loss, lr, gradient norm, the ranks
down, who covered whom, samples; the replica and its wall clock under "backend"), summary.json (the kills
and recovery timings under "backend"), events.json (kills, restarts and exits, when each rank healed, and
the recovery timings), failed_steps.json (the ranks down at every step, for the simulated twin:
`python -m mecefo.train ... --failures steps:DIR/failed_steps.json`), and replicas/ (each replica's rows,
heals, summary, status and log). OUT/run.lock holds the launcher's pid while it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from . import config as config_mod
from . import failures
from .errors import BAD_INPUT, CANNOT_GO_ON, TrainingStopped, UsageError, guarded
from .records import atomic_write_json, atomic_write_text, git_commit

POLL_S = 0.02
# How long the lighthouse waits for a live (heartbeating) replica that has not asked for the quorum yet before
# forming one without it; a dead one drops out at the heartbeat timeout (1 s) whatever this is. It must exceed
# the longest step plus heal: with 500 ms, a replica kept waiting through a peer's 5 s heal made the next quorum
# form the moment one other peer arrived, leaving the third out by milliseconds, which then had to heal: the
# replicas took turns healing every 2-3 steps for ever (measured). Below the quorum timeout (MECEFO_FT_TIMEOUT_S).
JOIN_TIMEOUT_MS = int(os.environ.get("MECEFO_FT_LIGHTHOUSE_JOIN_MS", "20000"))


# what a replica must not inherit from the launcher's environment: a caller's torchrun (its store and ranks) or
# MECEFO_FT_HOST (the launcher runs one node: everything on the loopback)
INHERITED_NOT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "MECEFO_FT_HOST")


@dataclass
class Kill:
    rank: int
    at_step: int | None  # kill once this step is committed (None: while healing)
    restart_step: int | None  # restart once this step is committed (None: never)
    done: bool = False
    restarted: bool = False
    process: int | None = None  # one process of the rank's replica group (None: the whole group)


@dataclass
class Supervisor:
    cfg: object
    out: Path
    lighthouse: str
    kills: list[Kill]
    min_step_s: float
    quiet: bool = False
    group_size: int = 1  # processes per replica group (--group_size)
    procs: dict = field(default_factory=dict)  # rank -> its group's Popens
    events: list = field(default_factory=list)
    t0: float = field(default_factory=time.time)
    furthest: int = 0
    rejoining: set = field(default_factory=set)  # restarted ranks that have not trained yet
    gpus: int = 0  # CUDA devices on this node (processes are placed round-robin)
    stores: dict = field(default_factory=dict)  # rank -> its group's store (hosted here, on loopback)

    def log(self, msg: str, **event) -> None:
        if event:
            self.events.append({"time": time.time(), **event})
        if not self.quiet:
            print(f"[launch {time.time() - self.t0:7.2f}s] {msg}", flush=True)

    def start(self, rank: int, why: str, wait_for: int = 1) -> None:
        """Start rank's replica: one process, or with --group_size K a group of K meeting at a store hosted here."""
        atomic_write_text(self.out / "replicas" / f"rank{rank}.status", f"starting {time.time():.3f}\n")  # not the dead one's
        env = {k: v for k, v in os.environ.items() if k not in INHERITED_NOT}  # not a caller's torchrun's, nor
        env |= {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),   # an opening of the servers: one node
                "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        if sys.platform == "linux":  # one node: gloo's sockets on the loopback too (it otherwise takes the hostname's)
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if self.group_size > 1 or self.cfg.cluster.shard == "fsdp":
            from .ft import _store

            self.stores[rank] = _store("127.0.0.1", "127.0.0.1")  # a fresh one per start: no key of a dead group
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.stores[rank].port), "WORLD_SIZE": str(self.group_size)}
        extra = ["--rejoin"] if why != "initial" else ["--wait-for", str(wait_for)]
        group = []
        for j in range(self.group_size):
            if self.gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:  # one GPU per process on this node
                env["CUDA_VISIBLE_DEVICES"] = str((rank * self.group_size + j) % self.gpus)
            log = open(self.out / "replicas" / _log_name(rank, j), "a")
            group.append(subprocess.Popen(
                [sys.executable, "-m", "mecefo.ft", "--out", str(self.out), "--replica", str(rank),
                 "--lighthouse", self.lighthouse, "--min-step-s", str(self.min_step_s)] + extra,
                stdout=log, stderr=subprocess.STDOUT, env=env | {"RANK": str(j), "LOCAL_RANK": str(j)},
                start_new_session=True, preexec_fn=_die_with_parent))
            log.close()  # the child holds its own descriptor
        self.procs[rank] = group
        for k in self.kills:  # every earlier kill of the rank is answered by this start
            if k.rank == rank and k.done:
                k.restarted = True
        self.log(f"started rank {rank} (pid {' '.join(str(p.pid) for p in group)}, {why})", kind="start", rank=rank,
                 why=why, step=self.committed())

    def kill(self, rank: int, why: str, process: int | None = None) -> None:
        """SIGKILL rank's replica group (process None), or one process of it, which then takes the group down."""
        if process is not None and len(self.procs[rank]) > 1:
            self.procs[rank][process].send_signal(signal.SIGKILL)
            self.procs[rank][process].wait()
            self.log(f"killed process {process} of rank {rank} with SIGKILL at step {self.committed()} ({why})",
                     kind="kill", rank=rank, process=process, why=why, step=self.committed())
            return
        for proc in self.procs.pop(rank):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self.log(f"killed rank {rank} with SIGKILL at step {self.committed()} ({why})", kind="kill", rank=rank,
                 why=why, step=self.committed())

    def take_down(self, rank: int, dead: int, code: int) -> None:
        """A process of rank's group died of a signal: the group cannot go on without its shards, so its
        other processes are killed too (a node lost); the kill plan, or else an immediate restart, brings it back."""
        for proc in self.procs.pop(rank):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        what = f"process {dead} died (signal {-code}); its group killed" if self.group_size > 1 else f"killed by signal {-code}"
        self.log(f"rank {rank} down: {what}", kind="down", rank=rank, process=dead, step=self.committed())

    def committed(self) -> int:
        """The highest step any replica has committed (from the replicas' status files)."""
        for path in (self.out / "replicas").glob("rank*.status"):
            try:
                what = path.read_text().split()
            except OSError:
                continue
            if what and what[0] == "step":
                self.furthest = max(self.furthest, int(what[1]))
            elif what and what[0] == "finished":
                self.furthest = max(self.furthest, self.cfg.train.steps)
        return self.furthest

    def training(self, rank: int) -> bool:
        try:
            return (self.out / "replicas" / f"rank{rank}.status").read_text().startswith(("step", "finished"))
        except OSError:
            return False

    def healing(self, rank: int) -> bool:
        try:
            return (self.out / "replicas" / f"rank{rank}.status").read_text().startswith("healing")
        except OSError:
            return False

    def run(self, initially_down: frozenset[int]) -> None:
        n, steps = self.cfg.cluster.ranks, self.cfg.train.steps
        for r in range(n):
            if r not in initially_down:
                self.start(r, "initial", wait_for=n - len(initially_down))
        while True:
            step = self.committed()
            for k in self.kills:
                if not k.done and k.rank in self.procs and (
                        (k.at_step is not None and step >= k.at_step) or (k.at_step is None and self.healing(k.rank))):
                    self.kill(k.rank, "while healing" if k.at_step is None else f"scheduled at step {k.at_step}", k.process)
                    k.done = True
                if (k.done and not k.restarted and k.restart_step is not None and step >= k.restart_step
                        and k.rank not in self.procs):
                    if step < steps and self.procs:
                        self.start(k.rank, "restart after a kill")
                        self.rejoining.add(k.rank)
                    k.restarted = True
            for r, group in list(self.procs.items()):
                codes = [proc.poll() for proc in group]
                killed = [j for j, code in enumerate(codes) if code is not None and code < 0]
                if killed:  # a process of the group died of a signal (ours, or anyone's): the group is down
                    self.take_down(r, killed[0], codes[killed[0]])
                    if not any(k.rank == r and k.done and not k.restarted for k in self.kills):  # nobody plans its
                        self.kills.append(Kill(r, None, 0, done=True))  # return: restarted at once, as a node replaced
                    continue
                for j, code in enumerate(codes):
                    if code is not None and code != 0:  # not one of ours (ours are removed from procs before the SIGKILL)
                        self.log(f"rank {r} exited with status {code}", kind="exit", rank=r, process=j, code=code)
                        self.stop_with(r, code, j)  # bad input, a non-finite loss, a crash: the others would follow
                if all(code == 0 for code in codes):
                    del self.procs[r]
            self.rejoining = {r for r in self.rejoining if r in self.procs and not self.training(r)}
            if not set(self.procs) - self.rejoining:  # nobody left who trains (a restarted one cannot heal)
                if self.committed() >= steps:
                    self.stop()  # a replica still waiting to rejoin a finished run
                    return
                raise TrainingStopped(
                    f"all {n} replicas are dead at step {step}; nobody is left to heal the others. The last "
                    f"checkpoint in {self.out} is intact (if train.checkpoint_every wrote one); continue with --resume")
            time.sleep(POLL_S)

    def stop_with(self, rank: int, code: int, process: int = 0) -> None:
        """Stop the run with the one line the replica stopped with: its log's 'error: ' line (bad input, exit 2),
        its 'stopped: ' line (exit 3), or for anything else (a crash) its last line and where its log is."""
        log = self.out / "replicas" / _log_name(rank, process)
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        if code in (BAD_INPUT, CANNOT_GO_ON):
            prefix, error = ("error: ", UsageError) if code == BAD_INPUT else ("stopped: ", TrainingStopped)
            raise error(next((f"rank {rank}: " + ln[len(prefix):] for ln in reversed(lines) if ln.startswith(prefix)),
                             f"rank {rank} exited with status {code}"))
        last = lines[-1].strip() if lines else "(no output)"
        raise TrainingStopped(f"rank {rank} died (exit status {code}): {last} (see {log}); the last checkpoint in "
                              f"{self.out} is intact, --resume continues")

    def stop(self) -> None:
        for group in self.procs.values():
            for proc in group:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def _log_name(rank: int, process: int) -> str:
    """A replica's log: rank<r>.log, and rank<r>.<j>.log for process j > 0 of its group."""
    return f"rank{rank}.log" if process == 0 else f"rank{rank}.{process}.log"


def _die_with_parent() -> None:
    """In a replica before it starts (Linux): SIGKILL it when the launcher dies, however the launcher dies
    (a SIGKILL of the launcher cannot run its clean-up, and the replicas are in their own session)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def kill_plan(schedule: failures.Schedule, explicit: list[str], n: int,
              group_size: int = 1) -> tuple[list[Kill], frozenset[int]]:
    """Kills from the schedule's failed sets (a rank failed at step s is killed once s steps are committed,
    restarted at its recovery step: its whole replica group, a node lost), then the explicit --kill specs
    (RANK/PROCESS: one process of the group, which takes the group down). Returns them and the ranks down
    at 0."""
    kills = []
    failed = schedule.failed
    for s in range(1, len(failed)):
        for r in sorted(failed[s] - failed[s - 1]):
            back = next((t for t in range(s + 1, len(failed)) if r not in failed[t]), None)
            kills.append(Kill(r, s, back))
    down0 = failed[0] if failed else frozenset()
    for r in sorted(down0):  # down from the start: started at its recovery step
        back = next((t for t in range(1, len(failed)) if r not in failed[t]), None)
        kills.append(Kill(r, 0, back, done=True))
    for spec in explicit:
        parts = spec.split(":")
        try:
            who, _, process = parts[0].partition("/")
            rank = int(who)
            if len(parts) == 2 and parts[1] == "heal":
                kills.append(Kill(rank, None, 0))
            elif len(parts) in (2, 3):
                kills.append(Kill(rank, int(parts[1]), int(parts[2]) if len(parts) == 3 else None))
            else:
                raise ValueError
            kills[-1].process = int(process) if process else None
        except ValueError:
            raise UsageError(f"--kill {spec!r}: expected RANK[/PROCESS]:STEP[:RESTART_STEP] or RANK[/PROCESS]:heal") from None
        if not 0 <= rank < n:
            raise UsageError(f"--kill {spec!r}: rank must be in 0..{n - 1}")
        if kills[-1].process is not None and not 0 <= kills[-1].process < group_size:
            raise UsageError(f"--kill {spec!r}: the process must be in 0..{group_size - 1} (--group_size {group_size})")
        k = kills[-1]
        if k.at_step is not None and (k.at_step < 1 or (k.restart_step is not None and k.restart_step <= k.at_step)):
            raise UsageError(f"--kill {spec!r}: STEP must be at least 1 and RESTART_STEP after it")
    return kills, down0


def resume_point(out: Path, cfg) -> int:
    """The checkpoint's step (its config must be this run's); the replicas' rows and heals after it, and
    their summaries, are dropped, so that the steps redone from the checkpoint are not counted twice."""
    from . import checkpoint

    step = checkpoint.load(out / "checkpoint.pt", cfg.hash())["step"]
    for path in [*(out / "replicas").glob("rank*.jsonl")]:
        keep = [line for line in path.read_text().splitlines()
                if json.loads(line).get("step", json.loads(line).get("healed_at_step", 0)) <= step]
        atomic_write_text(path, "".join(line + "\n" for line in keep))
    for path in (out / "replicas").glob("rank*.summary.json"):
        path.unlink()
    return step


def merge(out: Path, cfg, events: list, t0: float | None = None) -> dict:
    """metrics.jsonl, failed_steps.json, events.json and summary.json from the replicas' files: the metrics
    rows and the summary in the trainer's schema (the summary's "backend" key holds the kills and the
    recovery timings). events: the supervisor's (none for replicas started by hand); t0: when the launch
    started (None: the wall time runs from the first committed step to the last)."""
    n, steps = cfg.cluster.ranks, cfg.train.steps
    rows, healed, per_rank = {}, [], {}
    for r in range(n):
        path = out / "replicas" / f"rank{r}.heals.jsonl"
        healed += [{"rank": r, **json.loads(line)} for line in path.read_text().splitlines()] if path.exists() else []
        path = out / "replicas" / f"rank{r}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            first = rows.setdefault(row["step"], row)
            if row["step"] == 0:  # the evaluation before training: every replica that started at 0 made it
                continue
            per_rank.setdefault(r, []).append(row["step"])
            if abs(first["loss"] - row["loss"]) > 1e-9 * max(1.0, abs(first["loss"])) or first["failed"] != row["failed"]:
                raise TrainingStopped(f"step {row['step']}: replicas disagree (rank {first['backend']['rank']} vs rank {r})")
            if row.get("val_loss") is not None:
                first["val_loss"] = row["val_loss"]
    missing = [s for s in range(1, steps + 1) if s not in rows]
    if missing:
        raise TrainingStopped(f"steps {missing[:5]} were never committed")
    for r, seq in per_rank.items():  # no step applied twice by a replica
        if any(b <= a for a, b in zip(seq, seq[1:])):
            raise TrainingStopped(f"rank {r} committed a step twice: {seq}")
    finals = [json.loads(p.read_text()) for p in sorted((out / "replicas").glob("rank*.summary.json"))]
    if not finals:
        raise TrainingStopped("no replica wrote its summary")
    identical = all(f["backend"]["digest"] == finals[0]["backend"]["digest"] for f in finals)
    ordered = [rows[s] for s in range(0 if 0 in rows else 1, steps + 1)]
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(row) + "\n" for row in ordered))
    failed = [rows[s]["down"] for s in range(1, steps + 1)]  # as it happened (the policy's "failed" may differ)
    atomic_write_json(out / "failed_steps.json", {"n_ranks": n, "failed": failed})
    timings = recovery_times(events, rows, healed)
    atomic_write_json(out / "events.json", {"events": events, "healed": healed, "timings": timings})
    times = [rows[s]["backend"]["time"] for s in range(1, steps + 1)]
    happened = failures.logged(n, [frozenset(f) for f in failed], cfg.cluster.seconds_per_step)
    summary = finals[0] | {
        "final_train_loss": rows[steps]["loss"], "tokens_trained": rows[steps]["tokens_trained"],
        "rank_agreement": {"ranks_checked": [f["backend"]["rank"] for f in finals], "identical": identical},
        "failure_schedule": {"fraction_failed": happened.fraction_failed(), "events": happened.failure_events()},
        "wall_time_s": time.time() - t0 if t0 is not None else max(times) - min(times), "git_commit": git_commit(),
        "backend": {"name": "torchft", "kills": sum(e["kind"] == "kill" for e in events), "timings": timings}}
    atomic_write_json(out / "summary.json", summary)
    if not identical:
        raise TrainingStopped(f"the live replicas ended with different parameters (ranks {summary['rank_agreement']})")
    return summary


def recovery_times(events: list, rows: dict, healed: list) -> dict:
    """Seconds from each kill to the first committed step without the killed rank, and from each restart
    to the first committed step the restarted rank took part in."""
    committed = [rows[s] for s in sorted(rows) if s > 0]
    to_first_step, to_rejoin = [], []
    for e in events:
        if e["kind"] == "kill":
            after = [r["backend"]["time"] for r in committed if r["backend"]["time"] > e["time"] and e["rank"] in r["failed"]]
            if after:
                to_first_step.append(after[0] - e["time"])
        if e["kind"] == "start" and e["why"] != "initial":
            after = [r["backend"]["time"] for r in committed if r["backend"]["time"] > e["time"] and e["rank"] not in r["failed"]]
            if after:
                to_rejoin.append(after[0] - e["time"])
    return {"kill_to_step_s": to_first_step, "restart_to_rejoin_s": to_rejoin}


def main(argv: list[str] | None = None, restore_signals: bool = True) -> int:
    """The launcher (restore_signals=False: as a process, Ctrl-C stays ignored after the clean-up, until exit)."""
    parser = argparse.ArgumentParser(prog="python -m mecefo.launch", description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_mod.fields_help())
    parser.add_argument("--config")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill", action="append", default=[],
                        help="RANK:STEP (killed for good), RANK:STEP:RESTART_STEP, or RANK:heal (killed while healing, restarted); "
                             "RANK/PROCESS:...: one process of the rank's replica group (the group goes down with it)")
    config_mod.add_flag(parser, "group-size", type=int, default=1,
                        help="processes per replica group, FSDP2 sharding the model among them (needs --shard fsdp)")
    config_mod.add_flag(parser, "min-step-s", type=float, default=0.0, help="pace steps to at least this long (so kills land)")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    parser.add_argument("--prepare", action="store_true",
                        help="replicas started by hand (multi-node): check the config, write DIR/config.json and exit")
    parser.add_argument("--merge", action="store_true",
                        help="after replicas started by hand: merge their files into DIR's metrics and summary")
    parser.add_argument("--quiet", action="store_true")

    def launch() -> int:
        supervisor = lighthouse = locked = None
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        original = {sig: signal.getsignal(sig) for sig in signals}
        try:
            from .train import parse_args as train_args, release_lock, take_lock

            args, rest = parser.parse_known_args(argv)
            if args.merge:
                return merge_by_hand(Path(args.out), rest or args.config or args.kill or args.resume or args.prepare)
            if args.prepare and args.kill:
                raise UsageError("--prepare: replicas started by hand are killed by hand (or by your cluster), not --kill")
            trainer_flags, overrides = train_args(rest)
            if trainer_flags.stop_after is not None:
                raise UsageError("mecefo.launch has no --stop_after: interrupt it (Ctrl-C) and continue with --resume")
            if overrides.get("backend", "torchft") != "torchft":
                raise UsageError(f"mecefo.launch runs the torchft backend; --backend {overrides['backend']} starts "
                                 "with python -m mecefo.train (see README)")
            cfg = config_mod.load(args.config, {**overrides, "backend": "torchft"})
            out = Path(args.out)
            if (out / "replicas").exists() and not args.resume:
                raise UsageError(f"{out} holds a run; pass --resume to continue it or choose another --out")
            if args.resume and not (out / "checkpoint.pt").exists():
                raise UsageError(f"--resume: no checkpoint in {out}")
            if not (math.isfinite(args.min_step_s) and args.min_step_s >= 0):
                raise UsageError(f"--min_step_s {args.min_step_s} must be a finite, non-negative number of seconds")
            cc = cfg.cluster
            if args.group_size < 1 or (args.group_size > 1 and cc.shard != "fsdp"):
                raise UsageError(f"--group_size {args.group_size}: a group of several processes shards the model, with "
                                 "--shard fsdp" if args.group_size > 1 else f"--group_size {args.group_size} must be at least 1")
            from .data import TokenData  # the token cache, built once here rather than by every replica
            from .train import check_memory, model_config, resolve_device

            device = resolve_device(cfg.train.device)
            check_memory(cfg, model_config(cfg, TokenData(cfg.data).vocab_size)[0], device,
                         cfg.data.micro_batch_size, processes=cc.ranks * args.group_size if device.type == "cpu" else 1,
                         shards=args.group_size)
            import torch

            gpus = torch.cuda.device_count() if device.type == "cuda" else 0
            if gpus and args.group_size > 1 and cc.ranks * args.group_size > gpus:
                raise UsageError(f"{cc.ranks} ranks x --group_size {args.group_size} processes need as many GPUs on this "
                                 f"node (NCCL cannot share one between processes of a group); it has {gpus}")
            schedule = failures.for_run(cfg)
            kills, down0 = kill_plan(schedule, args.kill, cc.ranks, args.group_size)
            start_step = 0
            if args.resume:
                start_step = resume_point(out, cfg)
                kills = [k for k in kills if k.at_step is None or k.at_step > start_step]
                down0 = frozenset()  # everyone starts from the checkpoint
            if len(down0) == cc.ranks:
                raise UsageError("every rank is down at step 0 under this schedule; nothing can start")
            # everything is checked: only now is the run folder written
            locked = take_lock(out)
            (out / "replicas").mkdir(parents=True, exist_ok=True)
            for p in (out / "replicas").glob("rank*.status"):
                p.unlink()
            atomic_write_json(out / "config.json", {"config_hash": cfg.hash(), "config": cfg.to_dict()})
            if args.prepare:
                starter = ("python -m mecefo.ft" if cc.shard != "fsdp" else
                           f"torchrun --nproc_per_node {args.group_size} --master_addr $(hostname) --master_port PORT_R -m mecefo.ft")
                print(f"prepared {out}: on each node, for each of its ranks R, with N = {cc.ranks - len(down0)} ranks up "
                      f"at step 0:\n  MECEFO_FT_HOST=$(hostname) {starter} --out {out} --replica R "
                      f"--lighthouse http://LIGHTHOUSE_HOST:29510 --wait_for N\n(a restarted rank adds --rejoin); then "
                      f"python -m mecefo.launch --out {out} --merge", flush=True)
                return 0
            os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
            from torchft.coordination import LighthouseServer

            lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS, quorum_tick_ms=20,
                                          heartbeat_timeout_ms=1000)
            address = f"http://127.0.0.1:{urllib.parse.urlparse(lighthouse.address()).port}"  # (it names the host)
            supervisor = Supervisor(cfg, out, address, kills, args.min_step_s, args.quiet, furthest=start_step,
                                    group_size=args.group_size)
            supervisor.gpus = gpus
            for sig in signals:  # Ctrl-C, a closed terminal, a scheduler's stop: all end the launch the same way (and
                signal.signal(sig, _interrupt)  # SIGINT too where it was inherited ignored, as in a background job)
            supervisor.run(down0)
            summary = merge(out, cfg, supervisor.events, supervisor.t0)
            t = summary["backend"]["timings"]
            print(f"done: {summary['backend']['kills']} kills; val loss {summary['final_val_loss']:.4f}; kill -> first step without "
                  f"the rank {_fmt(t['kill_to_step_s'])} s, restart -> rejoin {_fmt(t['restart_to_rejoin_s'])} s -> {out}", flush=True)
        finally:
            for sig in signals:  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            try:
                if supervisor is not None:
                    supervisor.stop()
                if lighthouse is not None:
                    lighthouse.shutdown()
                if locked is not None:
                    release_lock(out)
            finally:
                for sig, handler in original.items():  # in-process callers (tests) get their handlers back
                    if restore_signals:
                        signal.signal(sig, handler)
        return 0

    return guarded(launch, "interrupted: every replica process was killed")


def merge_by_hand(out: Path, other_flags) -> int:
    """--merge: the records of a run whose replicas were started by hand (no supervisor: no kill events)."""
    if other_flags:
        raise UsageError("--merge takes only --out (the run's config is the one in DIR/config.json)")
    try:
        cfg = config_mod.build(json.loads((out / "config.json").read_text())["config"])
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--merge: {out / 'config.json'} cannot be read ({type(e).__name__}); --prepare writes it") from None
    summary = merge(out, cfg, [])
    print(f"merged {cfg.cluster.ranks} replicas' records: val loss {summary['final_val_loss']:.4f} -> {out}", flush=True)
    return 0


def _interrupt(*_):
    raise KeyboardInterrupt


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "-"


if __name__ == "__main__":
    code = main(restore_signals=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # every replica is dead and every file written: skip the interpreter's teardown, where a late
    # KeyboardInterrupt (a second Ctrl-C) or torchft's threads could hang it
