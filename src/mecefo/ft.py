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
Rows of committed steps go to OUT/replicas/rank<r>.jsonl (with the wall time), a status file says what
the replica is doing, and the lowest live rank writes OUT/checkpoint.pt every train.checkpoint_every steps.

    python -m mecefo.ft --out OUT --replica R --lighthouse ADDR     (the launcher's command; OUT/config.json)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from . import checkpoint, config as config_mod, policies
from .cluster import StepResult, _Common
from .data import TokenData
from .errors import TrainingStopped, UsageError, guarded
from .model import GPT, preset
from .neighbour import LowRankWgrad
from .plan import StepPlan
from .records import atomic_write_json, atomic_write_text
from .train import Progress, apply_update, autocast, build_optimizer, clip_gradients, evaluate, lr_at, resolve_device

HEAL_DELAY_ENV = "MECEFO_FT_HEAL_DELAY_S"  # tests: hold a process's first healing so that it can be killed then
HOST_ENV = "MECEFO_FT_HOST"  # this replica's store address (default localhost; set it on multi-node runs)
TIMEOUT_S = 30.0  # torchft's collective / quorum timeouts on localhost


class FtCluster(_Common):
    """Computes this replica's pieces; all-reduces through torchft's Manager (errors are tracked by it)."""

    manager = None
    rank = 0

    def step(self, plan: StepPlan) -> StepResult:
        from torch.distributed import ReduceOp

        return self.exchange_step(plan, self.rank, lambda t: self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait())


def parameter_digest(model: torch.nn.Module) -> list[float]:
    """A checksum per parameter tensor (equal digests: identical parameters, to float64 summation)."""
    return [float(p.detach().double().sum()) + float((p.detach().double().flatten() *
                                                       torch.arange(p.numel(), dtype=torch.float64)).sum())
            for p in model.parameters()]


class Replica:
    def __init__(self, cfg, out: Path, rank: int, lighthouse: str, min_step_s: float):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torch.distributed import TCPStore

        self.cfg, self.out, self.rank, self.min_step_s = cfg, out, rank, min_step_s
        cc, tc = cfg.cluster, cfg.train
        self.device = resolve_device(tc.device)
        self.data = TokenData(cfg.data)
        torch.manual_seed(tc.seed)  # the same initial weights on every replica (init_sync off)
        self.model = GPT(preset(cfg.model.preset, vocab_size=self.data.vocab_size)).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.policy = policies.get(cc.policy, trainer=True)(cc)
        self.lowrank = LowRankWgrad(r=cc.r, tau=cc.low_rank_tau, svd=cc.low_rank_svd, seed=tc.seed).bind(self.model)
        self.progress = Progress()
        self.cluster = FtCluster(self.model, self.data, tc.seed, self.device, self.lowrank,
                                 lambda: autocast(self.device, tc.precision), n_ranks=cc.ranks)
        self.components = self.cluster.components(self.optimizer) | {
            "rng": checkpoint.RNG(), "lowrank": self.lowrank, "policy": self.policy, "progress": self.progress}
        self.log_path = out / "replicas" / f"rank{rank}.jsonl"
        self.status_path = out / "replicas" / f"rank{rank}.status"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.status("starting")
        start = 0
        if (out / "checkpoint.pt").exists():  # every replica starts from the last checkpoint; those behind heal
            start = checkpoint.restore(checkpoint.load(out / "checkpoint.pt", cfg.hash()), self.components)
        # each replica group hosts its own store (torchrun would; a bare process must)
        host = os.environ.get(HOST_ENV, "localhost")  # across nodes: an address the other replicas can reach
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        pg = (ProcessGroupNCCL if self.device.type == "cuda" else ProcessGroupGloo)(timeout=timedelta(seconds=TIMEOUT_S))
        self.manager = Manager(pg=pg, load_state_dict=self.load_state, state_dict=self.state, min_replica_size=1,
                               use_async_quorum=False, replica_id=f"mecefo_{rank}", store_addr=host,
                               store_port=self.store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                               timeout=timedelta(seconds=TIMEOUT_S), quorum_timeout=timedelta(seconds=TIMEOUT_S),
                               init_sync=False)
        self.manager.load_state_dict({"step": start, "batches_committed": 0})
        self.cluster.manager, self.cluster.rank = self.manager, rank
        self.healed_at, self.healed_before = None, False

    # torchft's healing: what a live peer sends, and how the restarted replica takes it
    def state(self) -> dict:
        return {k: c.state_dict() for k, c in self.components.items() if k != "rng"}

    def load_state(self, state: dict) -> None:
        self.status("healing")
        delay = float(os.environ.get(HEAL_DELAY_ENV, "0") or 0)
        if delay and not self.healed_before:
            time.sleep(delay)
        self.healed_before = True
        for k, v in state.items():
            self.components[k].load_state_dict(v)
        self.healed_at = time.time()

    def status(self, what: str) -> None:
        atomic_write_text(self.status_path, f"{what} {time.time():.3f}\n")

    def failed_set(self) -> frozenset[int] | None:
        """The ranks not in this step's quorum (None if a peer failed during the exchange)."""
        from torch.distributed import ReduceOp

        onehot = torch.zeros(self.cfg.cluster.ranks, dtype=torch.float32, device=self.device)
        onehot[self.rank] = 1.0
        self.manager.allreduce(onehot, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None or round(float(onehot[self.rank])) != 1:
            return None
        return frozenset(r for r in range(self.cfg.cluster.ranks) if round(float(onehot[r])) == 0)

    def run_finished(self) -> bool:
        """Whether some replica has finished the run (a waiting replica then has nobody to join)."""
        for path in self.out.glob("replicas/rank*.final.json"):
            try:
                if json.loads(path.read_text())["step"] >= self.cfg.train.steps:
                    return True
            except (OSError, ValueError, KeyError):
                continue
        return False

    def wait(self, wait_for: int, rejoin: bool) -> bool:
        """Take part in quorums without training (nothing is committed) until `wait_for` replicas are
        there (the run's start) or, for a restarted replica, until it has healed from a live peer.
        Returns False if the run finished meanwhile."""
        self.status("waiting")
        while True:
            self.manager.start_quorum()
            if rejoin:  # healed, or in a quorum with peers at its own step (torchft heals only those behind)
                if self.healed_at is not None or (self.manager.num_participants() > 1 and self.manager.is_participating()):
                    return True
            elif self.manager.num_participants() >= wait_for:
                return True
            self.manager.report_error(RuntimeError("waiting for peers"))  # makes should_commit False everywhere
            self.manager.should_commit()
            if self.run_finished():
                return False
            time.sleep(0.05)

    def train(self, wait_for: int = 1, rejoin: bool = False) -> None:
        cfg, cc, dc, tc = self.cfg, self.cfg.cluster, self.cfg.data, self.cfg.train
        if not self.wait(wait_for, rejoin):
            print(f"rank {self.rank}: the run finished before this replica could rejoin", flush=True)
            self.manager.shutdown(wait=False)
            return
        log = open(self.log_path, "a")
        first = True
        while True:
            t0 = time.perf_counter()
            if not first:  # the waiting loop's last quorum is this step's
                self.manager.start_quorum()
            first = False
            step = self.manager.current_step()
            if self.healed_at is not None:
                print(f"rank {self.rank}: healed from a live peer at step {step}", flush=True)
                log.write(json.dumps({"healed_at_step": step, "time": self.healed_at}) + "\n")
                self.healed_at = None
            if step >= tc.steps:
                break
            failed = self.failed_set()
            loss = grad_norm = None
            plan = None
            if failed is not None:
                plan = self.policy.plan(step, failed, cc.ranks, dc.grad_accum, dc.micro_batch_size)
                self.lowrank.steps = step
                self.cluster.prepare(plan)
                result = self.cluster.step(plan)
                loss, grad_norm = result.loss, clip_gradients(self.model, cfg.optim.grad_clip)
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # as mecefo.train: stop, commit nothing
                    self.manager.report_error(RuntimeError("non-finite loss"))
                    self.manager.should_commit()
                    raise TrainingStopped(f"step {step + 1}: non-finite training loss {loss} or gradient norm {grad_norm}")
            if self.manager.should_commit() and plan is not None:
                lr = cfg.optim.lr * lr_at(step, cfg.optim, tc.steps)
                apply_update(self.optimizer, lr)
                self.progress.tokens_trained += result.samples * dc.seq_len
                self.progress.last_loss = loss
                row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "failed": sorted(plan.failed),
                       "neighbours": {str(j): nb for j, nb in plan.neighbours.items()}, "samples": result.samples,
                       "tokens_trained": self.progress.tokens_trained, "rank": self.rank, "time": time.time()}
                lowest = self.rank == min(set(range(cc.ranks)) - plan.failed)
                if lowest and ((step + 1) % tc.eval_every == 0 or step + 1 == tc.steps):
                    row["val_loss"] = evaluate(self.model, self.data, "val", self.device, tc.precision)
                log.write(json.dumps(row) + "\n")
                log.flush()
                self.status(f"step {step + 1}")
                if lowest and ((tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0) or step + 1 == tc.steps):
                    checkpoint.save(self.out / "checkpoint.pt", step + 1, cfg.hash(), checkpoint.gather(self.components))
            else:
                print(f"rank {self.rank}: step {step + 1} not committed (a peer failed); redoing it", flush=True)
            self.model.zero_grad(set_to_none=True)
            spare = self.min_step_s - (time.perf_counter() - t0)
            if spare > 0:
                time.sleep(spare)
        log.close()
        final = {"rank": self.rank, "step": self.manager.current_step(), "digest": parameter_digest(self.model),
                 "val_loss": evaluate(self.model, self.data, "val", self.device, tc.precision),
                 "test_loss": evaluate(self.model, self.data, "test", self.device, tc.precision)
                 if "test" in self.data.splits else None, "splits": self.data.splits}
        atomic_write_json(self.out / "replicas" / f"rank{self.rank}.final.json", final)
        self.status("finished")
        self.manager.shutdown(wait=False)


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

    def replica() -> int:
        try:
            values = json.loads((out / "config.json").read_text())["config"]
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"{out / 'config.json'} cannot be read ({type(e).__name__}); mecefo.launch writes it") from None
        cfg = config_mod.build(values)
        if not 0 <= args.replica < cfg.cluster.ranks:
            raise UsageError(f"--replica {args.replica} must be in 0..{cfg.cluster.ranks - 1}")
        Replica(cfg, out, args.replica, args.lighthouse, args.min_step_s).train(args.wait_for, args.rejoin)
        return 0

    return guarded(replica, f"rank {args.replica}: interrupted")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (torchft's and gloo's threads)
