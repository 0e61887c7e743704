"""The torchft backend: one process per data-parallel rank (a replica group of one GPU or CPU process),
under torchft's Manager, surviving real process deaths. Started by `python -m mecefo.launch`, which also
runs the lighthouse and kills and restarts replicas.

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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from . import config as config_mod
from .cluster import Backend, StepResult
from .errors import TrainingStopped, UsageError, guarded
from .plan import StepPlan
from .records import atomic_write_text

HEAL_DELAY_ENV = "MECEFO_FT_HEAL_DELAY_S"  # tests: hold a process's first healing so that it can be killed then
HOST_ENV = "MECEFO_FT_HOST"  # the address peers reach this replica at; unset: 127.0.0.1, every server on loopback
TIMEOUT_S = float(os.environ.get("MECEFO_FT_TIMEOUT_S", "30"))  # torchft's connect, collective and quorum timeouts
JOIN_TIMEOUT_S = float(os.environ.get("MECEFO_FT_JOIN_TIMEOUT_S", "300"))  # the wait for the peers before training


@dataclass
class FtCluster(Backend):
    """This replica of a torchft run: computes its pieces, all-reduces through torchft's Manager (which
    tracks the peers' errors), takes its failed set from the quorum and commits with should_commit."""

    run_dir: Path | None = None  # the run folder (mecefo.launch's)
    lighthouse: str = ""  # the lighthouse's address
    min_step_s: float = 0.0  # pace steps to at least this long (so that the launcher's kills land)
    wait_for: int = 1  # replicas to wait for before the first step
    rejoin: bool = False  # a restarted replica: heal from a live peer first

    def __post_init__(self):
        self.replicas = self.run_dir / "replicas"
        self.replicas.mkdir(parents=True, exist_ok=True)
        self.manager, self.store, self.healed = None, None, {}
        self.healed_at, self.healed_before, self.first, self.last_begin = None, False, True, None
        self.status("starting")

    def status(self, what: str) -> None:
        atomic_write_text(self.replicas / f"rank{self.rank}.status", f"{what} {time.time():.3f}\n")

    # ------------------------------------------------------------------ peers
    def connect(self, components: dict, step: int) -> int | None:
        """torchft's Manager on this replica's own store (a bare process must host one; torchrun would), at
        `step`, then wait for the peers."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        self.healed = components  # what a heal sends and takes
        host, bind = network()
        self.store = _store(host, bind)
        timeout = timedelta(seconds=TIMEOUT_S)
        pg = (ProcessGroupNCCL if self.device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
        with _manager_server_bound_to(bind), self.deadline(f"the lighthouse at {self.lighthouse}"):
            self.manager = Manager(
                pg=pg, load_state_dict=self.load_state, state_dict=self.state, min_replica_size=1,
                use_async_quorum=False, replica_id=f"mecefo_{self.rank}", store_addr=host, store_port=self.store.port,
                rank=0, world_size=1, lighthouse_addr=self.lighthouse, hostname=host, timeout=timeout,
                quorum_timeout=timeout, connect_timeout=timeout, init_sync=False,
                checkpoint_transport=PGTransport(pg, timeout=timeout, device=self.device))  # heals over the process
                # group: no HTTP server (torchft's default transport listens on every interface)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        if self.wait():
            return self.manager.current_step()  # a restarted replica: its peers' step, once it has healed
        print(f"rank {self.rank}: the run finished before this replica could rejoin", flush=True)
        return None

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
        with self.deadline(f"a quorum at the lighthouse {self.lighthouse}"):
            self.manager.start_quorum()

    def state(self) -> dict:
        """What a live peer sends a replica that heals (everything but the RNG states)."""
        return {k: c.state_dict() for k, c in self.healed.items() if k != "rng"}

    def load_state(self, state: dict) -> None:
        self.status("healing")
        delay = float(os.environ.get(HEAL_DELAY_ENV, "0") or 0)
        if delay and (not self.healed_before or os.environ.get("MECEFO_FT_HEAL_DELAY_EVERY")):
            time.sleep(delay)
        self.healed_before = True
        for k, v in state.items():
            self.healed[k].load_state_dict(v)
        self.healed_at = time.time()

    def run_finished(self) -> bool:
        """Whether some replica has finished the run (a waiting replica then has nobody to join)."""
        return any(self.replicas.glob("rank*.summary.json"))

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
            if self.rejoin:  # healed, or in a quorum with peers at its own step (torchft heals only those behind)
                if self.healed_at is not None or (self.manager.num_participants() > 1 and self.manager.is_participating()):
                    return True
            elif self.manager.num_participants() >= self.wait_for:
                return True
            self.manager.report_error(RuntimeError("waiting for peers"))  # makes should_commit False everywhere
            self.manager.should_commit()
            if self.run_finished():
                return False
            time.sleep(0.05)

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
        if self.healed_at is not None:
            print(f"rank {self.rank}: healed from a live peer at step {step}", flush=True)
            with open(self.replicas / f"rank{self.rank}.heals.jsonl", "a") as f:
                f.write(json.dumps({"healed_at_step": step, "time": self.healed_at}) + "\n")
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

        return self.exchange_step(plan, self.rank, lambda t: self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait())

    def abort(self) -> bool:
        """A non-finite loss: void if a peer died during the exchange (its partial sums are not the step's;
        redone), else reported so that no peer commits it, and training stops."""
        void = self.manager.errored() is not None
        if not void:
            self.manager.report_error(RuntimeError("non-finite loss"))
        self.manager.should_commit()
        return void

    def commits(self, plan: StepPlan | None) -> bool:
        """torchft's should_commit: every participant finished the step (else nothing is applied, and the
        step is redone with the next quorum: no step is lost or applied twice)."""
        if plan is None:
            self.manager.report_error(RuntimeError("the quorum's failed set could not be read"))
        return self.manager.should_commit() and plan is not None

    def end_step(self, row: dict | None) -> None:
        if row is not None:
            self.status(f"step {row['step']}")

    # ------------------------------------------------------------------ files
    def owns_out(self) -> bool:
        return False  # the launcher writes config.json and merges the replicas' files

    def writes(self, plan: StepPlan | None) -> bool:
        """The lowest live rank evaluates and checkpoints at a step; outside a step every replica evaluates."""
        return plan is None or self.rank == min(set(range(self.n_ranks)) - plan.failed)

    def io(self, plan: StepPlan | None) -> bool:
        return self.writes(plan)  # nothing collective: only the writer takes part

    def metrics_path(self, out):
        return self.replicas / f"rank{self.rank}.jsonl"

    def summary_path(self, out):
        return self.replicas / f"rank{self.rank}.summary.json"

    def extras(self) -> dict:
        return {"rank": self.rank, "time": time.time()}

    def agreement(self) -> dict:
        """This replica alone (the launcher compares the replicas' digests, in summary_extras)."""
        return {"ranks_checked": [self.rank], "identical": True}

    def summary_extras(self) -> dict:
        return {"rank": self.rank, "digest": self.digest(with_parameters=True)}


def network() -> tuple[str, str]:
    """(the address this replica advertises, the address its servers listen on). On one node, unless
    MECEFO_FT_HOST says otherwise: 127.0.0.1 for both, so that nothing listens beyond the loopback. With
    MECEFO_FT_HOST set (multi-node): that address, listening on every interface. None of these servers
    (torchft's manager, our store, gloo) authenticates its peers: a private network only."""
    host = os.environ.get(HOST_ENV, "")
    return (host, "0.0.0.0") if host else ("127.0.0.1", "127.0.0.1")


def _store(host: str, bind: str):
    """This replica group's TCPStore (a bare process must host one; torchrun would), listening on `bind` only
    (a TCPStore given a host name still listens on every interface; a socket handed to it does not)."""
    import socket

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((bind, 0))
    port = sock.getsockname()[1]
    return TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())


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

    training = Run(cfg, out, resolve_device(cfg.train.device), rank, quiet=False, run_dir=out, lighthouse=lighthouse,
                   min_step_s=min_step_s, wait_for=wait_for, rejoin=rejoin)
    try:
        start = training.start(resume=(out / "checkpoint.pt").exists())
        if start is not None:
            training.train(start, cfg.train.steps)
            training.summary()
            training.cluster.status("finished")
    finally:
        training.cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mecefo.ft", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    config_mod.add_flag(parser, "min-step-s", type=float, default=0.0)
    config_mod.add_flag(parser, "wait-for", type=int, default=1, help="replicas to wait for before the first step")
    parser.add_argument("--rejoin", action="store_true", help="a restarted replica: heal from a live peer first")
    args = parser.parse_args(argv)
    out = Path(args.out)

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
