"""`python -m mecefo.slurm submit`: scripts/slurm/mecefo.sbatch through submitit, from Python.

    python -m mecefo.slurm submit --out DIR --nodes 4 --gpus_per_node 8 --partition P -- --preset llama-7b ...
    python -m mecefo.slurm submit --out DIR --nodes 2 --cluster local --wait -- --config experiments/configs/nano.toml

On the submitting machine it checks the trainer flags and writes DIR/config.json (mecefo.launch --prepare, DIR on a
file system the nodes share), then submits one task per node. Each task is a node's supervisor (mecefo.slurm node);
the first task also runs the lighthouse and `mecefo.slurm watch` (the progress line, and with --kill or --chaos the
failure injector), and keeps the lighthouse
until every replica has finished. With --wait it waits for the job and merges the replicas' records
(mecefo.launch --merge); without, it prints the job id and the merge command. `--cluster local` runs the job's
tasks as processes of this machine (submitit's LocalExecutor, each task standing for a node): how the tests run it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import config as config_mod
from .errors import UsageError, guarded


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="the run folder, on a file system every node sees")
    p.add_argument("--nodes", type=int, required=True, help="nodes = data-parallel ranks (one replica group each)")
    config_mod.add_flag(p, "gpus-per-node", type=int, default=0, help="GPUs per node (with --shard fsdp, the group size)")
    config_mod.add_flag(p, "cpus-per-task", type=int, default=None)
    p.add_argument("--partition", help="Slurm partition")
    config_mod.add_flag(p, "time-min", type=int, default=48 * 60, help="the job's time limit, minutes")
    p.add_argument("--cluster", choices=("slurm", "local"), default=None,
                   help="submitit's executor (default: slurm where sbatch is found, else local)")
    p.add_argument("--port", type=int, default=None, help="the lighthouse's port (default 29510)")
    p.add_argument("--kill", action="append", default=[], help="the injector's NODE:STEP[:SECONDS]")
    p.add_argument("--chaos", metavar="SEED[:RATE]", help="the injector's random node kills")
    config_mod.add_flag(p, "max-restarts", type=int, default=3)
    config_mod.add_flag(p, "min-step-s", type=float, default=0.0)
    p.add_argument("--tensorboard", metavar="DIR", help="each replica's TensorBoard scalars in DIR/rank<R> (mecefo.board)")
    p.add_argument("--wait", action="store_true", help="wait for the job, then merge its records")


@dataclass
class NodeTask:
    """What submitit runs on every node (pickled by submitit, so its fields are plain values)."""

    out: str
    port: int
    group_size: int | None
    kills: list
    chaos: str | None
    max_restarts: int
    min_step_s: float
    tensorboard: str | None = None

    def __call__(self) -> int:
        import submitit

        from . import slurm

        env = submitit.JobEnvironment()
        rank, head, out = env.global_rank, env.hostnames[0], Path(self.out)
        lighthouse = f"http://{head}:{self.port}"
        helpers = []
        if rank == 0:  # the first node: the lighthouse and the watcher
            slurm.slurm_dir(out).mkdir(parents=True, exist_ok=True)
            with open(slurm.slurm_dir(out) / "lighthouse.log", "a") as log:
                helpers.append(subprocess.Popen(slurm.lighthouse_command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}))
            helpers.append(subprocess.Popen([sys.executable, "-m", "mecefo.slurm", "watch", "--out", self.out,  # the
                                             *(a for k in self.kills for a in ("--kill", k)),  # progress line, and
                                             *(["--chaos", self.chaos] if self.chaos else [])]))  # the injector
        try:
            code = guarded(lambda: slurm.node(out, rank, lighthouse, self.group_size, self.max_restarts, self.min_step_s,
                                              self.tensorboard), "interrupted")
            if rank == 0:  # keep the lighthouse for the others' last steps
                cfg = config_mod.build(slurm.read_config(out, "mecefo.launch --prepare"))
                deadline = time.monotonic() + slurm.RUN_OVER_S * 2
                while time.monotonic() < deadline and any(w not in ("finished", "none")
                                                          for w in slurm.committed(out, cfg.cluster.ranks)[1]):
                    time.sleep(0.2)
            return code
        finally:
            for p in helpers:
                p.kill()
                p.wait()


def submit(args, trainer_flags: list[str]) -> int:
    import shutil

    import submitit

    from . import slurm
    from .launch import main as launch_main
    from .launch import merge_by_hand

    if args.nodes < 1:
        raise UsageError(f"--nodes {args.nodes} must be at least 1")
    if trainer_flags[:1] == ["--"]:
        trainer_flags = trainer_flags[1:]
    if "--ranks" in trainer_flags:
        raise UsageError("--ranks: one rank per node, set by --nodes")
    for k in args.kill:
        slurm.parse_kill(k)
    if args.chaos:
        slurm.chaos.parse(args.chaos)
    code = launch_main(["--out", args.out, "--prepare", "--ranks", str(args.nodes), *trainer_flags])
    if code != 0:
        return code
    fsdp = config_mod.build(slurm.read_config(Path(args.out), "mecefo.launch --prepare")).cluster.shard == "fsdp"
    cluster = args.cluster or ("slurm" if shutil.which("sbatch") else "local")
    executor = submitit.AutoExecutor(folder=Path(args.out) / "slurm" / "submitit", cluster=cluster)
    if cluster == "local":  # one machine: each task stands for a node
        executor.update_parameters(tasks_per_node=args.nodes, timeout_min=args.time_min)
    else:
        executor.update_parameters(nodes=args.nodes, tasks_per_node=1, timeout_min=args.time_min, name="mecefo",
                                   **({"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}),
                                   **({"cpus_per_task": args.cpus_per_task} if args.cpus_per_task else {}),
                                   **({"slurm_partition": args.partition} if args.partition else {}))
    task = NodeTask(args.out, args.port or slurm.LIGHTHOUSE_PORT, args.gpus_per_node if fsdp and args.gpus_per_node else None,
                    list(args.kill), args.chaos, args.max_restarts, args.min_step_s, args.tensorboard)
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
