"""MeCeFO with real failures on a Slurm allocation: one replica group per node, each restarted on its node when it
dies, the progress line and a failure injector. scripts/slurm/mecefo.sbatch runs them; `submit` does the same
through submitit.

    python -m mecefo.slurm lighthouse --port 29510 &                          # on the batch host (the first node)
    python -m mecefo.slurm node --out DIR --lighthouse http://HEAD:29510        # srun: once per node
    python -m mecefo.slurm watch --out DIR [--kill 1:200:30] [--chaos 7:0.5]   # on the batch host, in the background
    python -m mecefo.slurm submit --out DIR --nodes 4 --gpus_per_node 8 [--partition P] -- TRAINER FLAGS

`lighthouse` runs torchft's lighthouse with the launcher's settings (mecefo.launch), listening on every interface:
the other nodes reach it at the first node's hostname. It is the job's single point of failure: if it dies, the
replicas wait for it (MECEFO_FT_STALL_S, 90 s) and then stop (exit 3); the same job submitted again continues.

`node` is the supervisor of one node: it starts the node's replica, rank SLURM_NODEID (`python -m mecefo.ft`, or with
--shard fsdp a replica group of --group_size processes under torchrun, one per GPU of the node), and when the
replica dies it starts it again with --rejoin (it heals from a live peer): at once after a kill (the injector's,
an OOM killer's, anyone's signal), and after a crash (any other exit but 0, 2 and 3) up to --max_restarts times.
It ends with the replica's own status: 0 finished, 2 bad input, 3 cannot go on (every replica dead: submit the
same job again and it continues from the last checkpoint). Other nodes reach this node's servers at its hostname
(MECEFO_FT_HOST, unless set).

`watch` prints the run's progress line (mecefo.progress: step, ranks training, last heal, ETA) every
MECEFO_PROGRESS_S seconds, and is the failure injector: it kills nodes' replica groups as a node failure would
(SIGKILL to every process of the group): at committed steps (--kill NODE:STEP[:SECONDS], restarted after SECONDS,
default 0; each fires once per run, a job submitted again included) and at random (--chaos SEED[:RATE], RATE per
minute, a uniformly drawn node among those training, never the last, restarted after U(0, 2) s, until the last 30%
of the steps). A kill is a file OUT/slurm/kill-node<R> that node R's supervisor acts on (the injector needs no
access to the other nodes, only to the run folder they share). Its injections and resumes are lines of
OUT/slurm/events-watch.jsonl; each node supervisor's starts, kills and deaths, of events-node<R>.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import chaos
from . import config as config_mod
from .errors import BAD_INPUT, CANNOT_GO_ON, UsageError, guarded
from .processes import die_with_parent
from .progress import ProgressLine
from .records import atomic_write_text, read_rows
from .ft import exit_path
from .runfiles import TRAINING, read_config, read_replica_status

POLL_S = 0.05
LIGHTHOUSE_PORT = 29510
LIGHTHOUSE_WAIT_S = 120.0  # a node waits this long for the lighthouse to answer before its replica starts
RUN_OVER_S = 30.0  # a replica still rejoining this long after every other replica finished is given up


def slurm_dir(out: Path) -> Path:
    return out / "slurm"


def record(out: Path, who: str, **event) -> None:
    """One line of OUT/slurm/events-<who>.jsonl: a file per writer (node<R>, watch), as appends from several nodes to
    one file on a network file system can interleave."""
    slurm_dir(out).mkdir(parents=True, exist_ok=True)
    with open(slurm_dir(out) / f"events-{who}.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")


def kill_request(out: Path, node: int) -> Path:
    return slurm_dir(out) / f"kill-node{node}"


def committed(out: Path, ranks: int) -> tuple[int, list[str]]:
    """The furthest committed step over the replicas' status files, and each replica's status word."""
    furthest, words = 0, []
    for r in range(ranks):
        status = read_replica_status(out, r) or ["none"]
        words.append(status[0])
        if status[0] in TRAINING and status[1].isdigit():
            furthest = max(furthest, int(status[1]))
    return furthest, words


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


def lighthouse_command(port: int) -> list[str]:
    from .launch import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, _lighthouse_binary

    return [_lighthouse_binary(), "--bind", f"[::]:{port}", "--min_replicas", "1", "--join_timeout_ms",
            str(JOIN_TIMEOUT_MS), "--quorum_tick_ms", "20", "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]


def wait_for_lighthouse(lighthouse: str, seconds: float = LIGHTHOUSE_WAIT_S) -> None:
    from .errors import TrainingStopped
    from .liveness import read_status

    deadline = time.monotonic() + seconds
    while read_status(lighthouse, timeout_s=1.0) is None:
        if time.monotonic() > deadline:
            raise TrainingStopped(f"the lighthouse at {lighthouse} did not answer for {seconds:g} s (is it running on "
                                  "the first node, and its port open between the nodes?)")
        time.sleep(0.2)


def node(out: Path, rank: int, lighthouse: str, group_size: int | None, max_restarts: int, min_step_s: float = 0.0,
         tensorboard: str | None = None) -> int:
    """One node's supervisor (see the module's docstring); returns its exit status. group_size None: the node's GPUs
    (SLURM_GPUS_ON_NODE) with --shard fsdp, else 1."""
    cfg = config_mod.build(read_config(out, "mecefo.launch --prepare"))
    ranks = cfg.cluster.ranks
    if not 0 <= rank < ranks:
        raise UsageError(f"node {rank}: the run in {out} has {ranks} ranks (cluster.ranks), one per node; "
                         f"this allocation has more nodes")
    if group_size is None:
        group_size = node_gpus() if cfg.cluster.shard == "fsdp" else 1
    wait_for_lighthouse(lighthouse)
    host = os.environ.get("MECEFO_FT_HOST") or socket.gethostname()
    env = {**os.environ, "MECEFO_FT_HOST": host}
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):  # Slurm's or a caller's torchrun
        env.pop(k, None)
    t0, crashes, rejoin, why = time.time(), 0, False, "initial"
    request = kill_request(out, rank)
    request.unlink(missing_ok=True)

    current = [None]  # the replica group's leader process, while it runs

    def stop(signum, _frame):  # scancel, the time limit, Ctrl-C: the replica group goes down with its supervisor
        if current[0] is not None and current[0].poll() is None:
            os.killpg(current[0].pid, signal.SIGKILL)
            current[0].wait()
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)

    def say(msg: str, **event) -> None:
        print(f"[node {rank} {time.time() - t0:8.2f}s] {msg}", flush=True)
        if event:
            record(out, f"node{rank}", node=rank, **event)

    stopped_with = exit_path(out, rank)
    while True:
        stopped_with.unlink(missing_ok=True)
        log = open(out / "replicas" / f"node{rank}.log", "a")
        proc = subprocess.Popen(replica_command(out, rank, lighthouse, group_size, cfg.cluster.shard, ranks, rejoin,
                                                host, min_step_s, tensorboard),
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)  # (a supervisor SIGKILLed takes its replica along)
        log.close()
        current[0] = proc
        say(f"started replica {rank} (pid {proc.pid}, {group_size} process{'es' if group_size > 1 else ''}"
            f"{', rejoining' if rejoin else ''})", kind="start", rank=rank,
            why=why, step=committed(out, ranks)[0])
        killed_for, gone_since = None, None
        while (code := proc.poll()) is None:
            if request.exists():
                order = json.loads(request.read_text() or "{}")
                killed_for = float(order.get("restart_after_s", 0.0))
                os.killpg(proc.pid, signal.SIGKILL)  # every process of the group: a node lost
                record(out, f"node{rank}", node=rank, kind="kill", rank=rank, why=order.get("why", "injector"),
                       step=committed(out, ranks)[0])  # (the launcher's event names: the merge's recovery timings)
                proc.wait()
                request.unlink(missing_ok=True)
                code = proc.returncode
                break
            words = committed(out, ranks)[1]
            others = [w for r, w in enumerate(words) if r != rank]
            if others and all(w == "finished" for w in others) and words[rank] not in ("finished", "step"):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > RUN_OVER_S:  # the run ended while this replica was rejoining
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    say(f"the run finished before replica {rank} rejoined ({words[rank]}): stopped", kind="not_rejoined")
                    return 0
            time.sleep(POLL_S)
        step = committed(out, ranks)[0]
        if code not in (0, BAD_INPUT, CANNOT_GO_ON) and stopped_with.exists():  # under torchrun: the replica's own
            code = int(stopped_with.read_text().strip() or code)  # status (torchrun exits 1 for any worker's failure)
        if killed_for is not None:
            say(f"replica {rank} killed by the injector at step {step}; restarting in {killed_for:g} s")
            time.sleep(killed_for)
            why = "restart after a kill"
        elif code == 0:
            say(f"replica {rank} finished", kind="finished")
            return 0
        elif code in (BAD_INPUT, CANNOT_GO_ON):
            say(f"replica {rank} stopped with exit {code} (see {out / 'replicas'}): the node stops too", kind="stopped",
                code=code)
            return code
        elif code < 0:
            say(f"replica {rank} died of signal {-code} at step {step}: restarting", kind="down", rank=rank, code=code,
                unplanned=True, step=step)
            why = "restart after a death"
        else:
            crashes += 1
            record(out, f"node{rank}", node=rank, kind="down", rank=rank, code=code, unplanned=True, step=step)
            if crashes > max_restarts:
                say(f"replica {rank} crashed (exit {code}) {crashes} times: the node stops", kind="crash", rank=rank,
                    code=code, step=step)
                return code
            say(f"replica {rank} crashed (exit {code}, crash {crashes} of {max_restarts} allowed): restarting",
                kind="crash", rank=rank, code=code, step=step)
            why = "restart after a crash"
        others = [w for r, w in enumerate(committed(out, ranks)[1]) if r != rank]
        if others and all(w == "finished" for w in others):
            say(f"the run has finished: replica {rank} is not restarted", kind="not_rejoined")
            return 0
        rejoin = True


def watch(out: Path, kills: list[tuple[int, int, float]], chaos_spec: str | None, stop_after_s: float | None = None) -> int:
    """The progress line and the failure injector (see the module's docstring); returns 0 when the run has finished."""
    cfg = config_mod.build(read_config(out, "mecefo.launch --prepare"))
    ranks, steps = cfg.cluster.ranks, cfg.train.steps
    for n, _, _ in kills:
        if not 0 <= n < ranks:
            raise UsageError(f"--kill {n}:...: the node must be in 0..{ranks - 1}")
    seed, rate = chaos.parse(chaos_spec) if chaos_spec else (0, 0.0)
    start = resumed_from(out, ranks)  # a job submitted again: each --kill fires once per run, not once per job
    fired = {(e["node"], e["at"]) for e in events(out, "watch") if e["kind"] == "inject" and "at" in e}
    rng, t0 = random.Random(seed), time.monotonic()
    pending = sorted((k for k in kills if (k[0], k[1]) not in fired), key=lambda k: k[1])
    next_at = t0 + rng.expovariate(rate / 60) if rate else None
    slurm_dir(out).mkdir(parents=True, exist_ok=True)
    if start:  # (the merge's recovery timings end at a resume: no interval spans two jobs)
        record(out, "watch", kind="resume", step=start)
    progress, heals = ProgressLine(steps), {r: _size(out / "replicas" / f"rank{r}.heals.jsonl") for r in range(ranks)}

    def fire(n: int, seconds: float, why: str, step: int, at: int | None = None) -> None:
        atomic_write_text(kill_request(out, n), json.dumps({"restart_after_s": seconds, "why": why}))
        record(out, "watch", kind="inject", node=n, why=why, step=step, restart_after_s=seconds,
               **({"at": at} if at is not None else {}))
        print(f"[watch] node {n} killed at step {step} ({why}; restarted after {seconds:.1f} s)", flush=True)

    while True:
        step, words = committed(out, ranks)
        if words and all(w == "finished" for w in words):
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
        while pending and step >= pending[0][1]:
            n, at, seconds = pending.pop(0)
            fire(n, seconds, "--kill", step, at)
        if next_at is not None and time.monotonic() >= next_at:
            next_at = time.monotonic() + rng.expovariate(rate / 60)
            training = [r for r, w in enumerate(words) if w in TRAINING and not kill_request(out, r).exists()]
            if 0 < step < (1 - chaos.QUIET_TAIL) * steps and len(training) > 1:
                fire(rng.choice(training), rng.uniform(0, chaos.RESTART_S), f"--chaos {chaos_spec}", step)
        time.sleep(POLL_S)


def events(out: Path, who: str = "*") -> list[dict]:
    """The events of OUT/slurm/events-<who>.jsonl (who "*": every writer's), in time order; a line torn by a writer
    killed mid-write is dropped. None for replicas started by hand."""
    found = []
    for path in sorted(slurm_dir(out).glob(f"events-{who}.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return sorted(found, key=lambda e: e["time"])


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def resumed_from(out: Path, ranks: int) -> int:
    """The step a job continues from: the last row the replicas kept (mecefo.launch --prepare cuts them back to the
    checkpoint); 0 for a new run."""
    steps = [row.get("step", 0) for r in range(ranks) if (out / "replicas" / f"rank{r}.jsonl").exists()
             for row in read_rows(out / "replicas" / f"rank{r}.jsonl")[0]]
    return max(steps, default=0)


def parse_kill(spec: str) -> tuple[int, int, float]:
    parts = spec.split(":")
    try:
        node_, step = int(parts[0]), int(parts[1])
        seconds = float(parts[2]) if len(parts) == 3 else 0.0
        if len(parts) > 3 or step < 1 or seconds < 0:
            raise ValueError
    except (ValueError, IndexError):
        raise UsageError(f"--kill {spec!r}: expected NODE:STEP[:SECONDS] (STEP >= 1, SECONDS >= 0)") from None
    return node_, step, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mecefo.slurm", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = parser.add_subparsers(dest="verb", required=True)
    h = sub.add_parser("lighthouse", help="torchft's lighthouse with the launcher's settings, on every interface")
    h.add_argument("--port", type=int, default=LIGHTHOUSE_PORT)
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
    i.add_argument("--kill", action="append", default=[], help="NODE:STEP[:SECONDS]")
    i.add_argument("--chaos", metavar="SEED[:RATE]")
    from .submit import add_arguments

    add_arguments(sub.add_parser("submit", help="submit the job through submitit (see mecefo.submit)"))
    args, rest = parser.parse_known_args(argv)

    def run() -> int:
        if args.verb != "submit" and rest:
            raise UsageError(f"unrecognized arguments: {' '.join(rest)}")
        if args.verb == "lighthouse":
            os.environ.setdefault("RUST_LOG", "warn")
            os.execv(lighthouse_command(args.port)[0], lighthouse_command(args.port))
        out = Path(args.out)
        if args.verb == "node":
            rank = args.node if args.node is not None else int(os.environ.get("SLURM_NODEID", "-1"))
            if rank < 0:
                raise UsageError("python -m mecefo.slurm node: no --node and no SLURM_NODEID (run it under srun)")
            return node(out, rank, args.lighthouse, args.group_size, args.max_restarts, args.min_step_s, args.tensorboard)
        if args.verb == "watch":
            return watch(out, [parse_kill(k) for k in args.kill], args.chaos)
        from .submit import submit

        return submit(args, rest)

    return guarded(run, "interrupted: this node's replica was killed (the same job submitted again continues)")


if __name__ == "__main__":
    sys.exit(main())
