"""n data-parallel ranks under failures: the run's cluster configuration, the paper's aggregation rule, and
the backends that run a step plan with one semantics (in-process simulated ranks, one torch.distributed
process per rank, optionally FSDP2-sharded). Who computes what at a step is the policy's (mecefo.policies,
mecefo.plan).

Aggregation (the paper's rule, generalised by weights). Parameters fall in groups (mecefo.model.group_of):
attention of layer l (projections and their RMSNorm), FFN of layer l (projections and their RMSNorm),
embedding, head, final norm. For each group G,
        g_G = sum_{pieces p giving G a gradient} w_p grad_G(loss_p)  /  sum_{those pieces} w_p.
With MeCeFO (neighbours skip attention on both their micro-batches) this is the paper's
G_l = (1/|N_l|) sum_{i in N_l} G_{i,l} for attention, N_l the ranks neither failed nor neighbours, and the
average over all n micro-batches for every other parameter. When no piece gives a group a gradient
(N_l empty), that group gets no gradient and the optimizer leaves it unchanged for the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import checkpoint, policies
from .checkpoint import Component
from .errors import UsageError
from .model import group_of
from .neighbour import LowRankWgrad, Neighbour, Techniques
from .plan import NORMAL, Piece, StepPlan


@dataclass(frozen=True)
class ClusterConfig:
    ranks: int = 1  # data-parallel size n
    backend: str = "local"  # a registered backend (mecefo.cluster.BACKENDS; `--help` lists them)
    shard: str = "none"  # none (every rank holds the whole model) | fsdp (FSDP2: torch, over the ranks; torchft, in each group)
    failures: str = "none"  # none | low | mid | high | custom:<interval_h>:<recovery_h> | path/to/trace.csv
    policy: str = "mecefo"  # a registered policy (mecefo.policies.trainer_policies())
    techniques: str = "mecefo"  # what mecefo's neighbours / spread-mecefo's extra shares apply
    seconds_per_step: float = 44.0  # maps the scenarios' hours to steps (see README)
    recovery: str = "fixed"  # fixed | exponential
    failure_start: str = "stationary"  # stationary (ranks already down at step 0 as in steady state) | cold (all alive)
    failable: str = ""  # asymmetric mode: comma-separated ranks that can fail ("" = all)
    failure_free_steps: int = 0  # the first k steps see no failure (a warm start shared by every policy of a seed)
    all_down: str = "skip"  # skip (log and skip the step) | error
    restart_every: int = 50  # checkpoint-restart: steps between checkpoints
    r: float = 0.125  # low-rank width of low_rank_wgrad (>= 1 absolute, < 1 a fraction of min(m, n))
    low_rank_tau: int = 50  # optimizer steps between SVD refreshes of V1
    low_rank_svd: str = "auto"  # exact | randomized | auto (randomized when min(m, n) > 1024)
    failure_seed: int = -1  # seed of the failure process (-1: the training seed)
    track_grad_error: bool = False  # also compute the failure-free gradient and log Assumption 3's relative error

    def validate(self) -> None:
        if self.ranks < 1:
            raise UsageError(f"cluster.ranks={self.ranks} must be at least 1")
        spec = backend_spec(self.backend)
        if self.shard not in spec.classes:
            raise UsageError(f"cluster.shard={self.shard!r} is not available on cluster.backend={self.backend!r}; "
                             f"allowed there: {', '.join(map(repr, spec.classes))}"
                             + ("" if any(self.shard in s.classes for s in BACKENDS.values()) else
                                " (the shard modes: 'none', 'fsdp')"))
        if not spec.rollbacks and policies.get(self.policy, trainer=True).rolls_back:
            raise UsageError(f"cluster.backend={self.backend!r} cannot send a run back to an earlier step: not with "
                             f"cluster.policy={self.policy!r}")
        if self.low_rank_svd not in ("exact", "randomized", "auto"):
            raise UsageError(f"cluster.low_rank_svd={self.low_rank_svd!r}; allowed: 'exact', 'randomized', 'auto'")
        policies.get(self.policy, trainer=True).validate(self)
        try:
            Techniques.parse(self.techniques)
        except ValueError as e:
            raise UsageError(f"cluster.techniques: {e}") from None
        if self.seconds_per_step <= 0:
            raise UsageError(f"cluster.seconds_per_step={self.seconds_per_step} must be positive")
        if self.failure_start not in ("stationary", "cold"):
            raise UsageError(f"cluster.failure_start={self.failure_start!r}; allowed: 'stationary', 'cold'")
        if self.all_down not in ("skip", "error"):
            raise UsageError(f"cluster.all_down={self.all_down!r}; allowed: 'skip', 'error'")
        if self.failure_free_steps < 0:
            raise UsageError(f"cluster.failure_free_steps={self.failure_free_steps} must be non-negative")
        if self.restart_every < 1 or self.low_rank_tau < 1 or self.r <= 0:
            raise UsageError("cluster.restart_every, cluster.low_rank_tau and cluster.r must be positive")
        self.failable_ranks()

    def failable_ranks(self) -> tuple[int, ...] | None:
        if not self.failable:
            return None
        try:
            ranks = tuple(int(r) for r in self.failable.split(","))
        except ValueError:
            raise UsageError(f"cluster.failable={self.failable!r} must be comma-separated rank numbers") from None
        if any(not 0 <= r < self.ranks for r in ranks):
            raise UsageError(f"cluster.failable={self.failable!r} must name ranks in 0..{self.ranks - 1}")
        return ranks


# ---------------------------------------------------------------------------------------------- backends
@dataclass(frozen=True)
class BackendSpec:
    """A registered backend: its name (cluster.backend), one line for --help, the command that starts its
    processes and the entry point they run, its classes by shard mode ("module:Class", imported when used),
    and whether a policy may send its runs back to an earlier step (checkpoint-restart's rollback)."""

    name: str
    summary: str
    started_by: str
    entry: str  # the module whose main() starts a run: mecefo.train, or mecefo.launch for torchft
    classes: dict
    rollbacks: bool = True


BACKENDS = {s.name: s for s in (  # the only place backends are named
    BackendSpec("local", "n ranks simulated in one process (pieces batched across ranks)", "python -m mecefo.train",
                "mecefo.train", {"none": "mecefo.cluster:LocalCluster"}),
    BackendSpec("torch", "one process per rank under torchrun (gloo on CPU, nccl on CUDA); --shard fsdp: FSDP2",
                "torchrun --nproc_per_node N -m mecefo.train", "mecefo.train",
                {"none": "mecefo.cluster:TorchCluster", "fsdp": "mecefo.cluster:ShardedCluster"}),
    BackendSpec("torchft", "one process per rank under torchft's Manager: real process deaths, healing from a peer; "
                "--shard fsdp: a replica group of --group_size processes per rank, FSDP2 inside",
                "python -m mecefo.launch", "mecefo.launch",
                {"none": "mecefo.ft:FtCluster", "fsdp": "mecefo.ft:FtShardedCluster"}, rollbacks=False),
)}


def backends_table() -> str:
    """The README's table of backends (a test keeps the README's copy equal to it)."""
    rows = [f"| `{b.name}` | {b.summary} | `{b.started_by}` | {', '.join(f'`{k}`' for k in b.classes)} |"
            for b in BACKENDS.values()]
    return "\n".join(["| `--backend` | what it runs | started by | `--shard` |", "|---|---|---|---|", *rows])


def backend_spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise UsageError(f"cluster.backend={name!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    return BACKENDS[name]


def backend_class(cc: ClusterConfig) -> type["Backend"]:
    """The class that runs cc's backend and shard mode (cc is validated)."""
    import importlib

    module, name = backend_spec(cc.backend).classes[cc.shard].split(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class StepResult:
    loss: float  # weighted mean training loss over the pieces computed this step
    samples: int


@dataclass
class Backend:
    """The data-parallel ranks a run trains on. mecefo.train.Run drives every backend with one loop; this
    class is the contract (with the simulated backends' answers as defaults) and the computation they share.

    Each step, in the loop's order (every process of the run calls these, so that collectives match):
      begin(step) -> step          the step to run: `step`; torchft: its quorum's step (a healed replica
                                   jumps to its peers' step)
      failed(step, schedule)       the ranks down at the step: the schedule's; torchft: those missing from the
                                   quorum (None: a peer died during the exchange; the loop then calls only
                                   commits(None), which is False, and redoes the step)
      transition(plan, optimizer)  state lost by ranks that fail, given back to ranks that recover
      prepare(plan)                low-rank subspaces refreshed where the plan uses them
      step(plan) -> StepResult     this process's pieces; .grad then holds the aggregated gradient
      abort() -> bool              on a non-finite loss or gradient norm only: no peer commits the step; True
                                   if it was void anyway (torchft: a peer died, the numbers are not the step's;
                                   it is redone), False if training stops (exit 3)
      commits(plan | None) -> bool whether the step counts: always; torchft: its should_commit
      updates(plan) -> bool        whether this process applies the optimizer update
      end_step(row)                after the row is recorded (None: not committed); torchft: its status file
    Around the steps:
      setup(cfg, device, ...)      (class) join the processes; returns (rank, device) (torchft: the launcher
                                   has set up, the replica is given its rank)
      build_model, open_data, agree, rows_per_pass  (class) the model, the token data, one decision for
                                   every process, the most sequences in one pass (memory check)
      connect(components, step)    join the peers before the first step; returns the step joined at (torchft:
                                   a restarted replica's peers' step, once healed), None if the run ended first
      io(plan), writes(plan), evaluates(plan)  whether this process takes part in an evaluation / checkpoint
                                   (a collective on the torch backends), whether it writes the files, and
                                   whether it runs the evaluation (FSDP: every rank) (plan None: outside a
                                   step); sync_for_io(optimizer) gives the writer current state
      components, parameters_finite, restore_checkpoint, agreement, extras, summary_extras
      metrics_path(out), summary_path(out)  where this process writes its rows and summary (None: nowhere)
      owns_out()                   this process writes OUT/config.json and truncates metrics on a resume
      close()                      leave the peers
    """

    model: torch.nn.Module
    data: object  # mecefo.data.TokenData
    seed: int
    device: torch.device
    lowrank: LowRankWgrad
    autocast: object  # a callable returning the autocast context
    n_ranks: int = 1
    _neighbours: dict = field(default_factory=dict)
    current_step: int = 0
    rank: int = 0

    # ------------------------------------------------------------------ processes
    @classmethod
    def setup(cls, cfg, device: torch.device, **options) -> tuple[int, torch.device]:
        return 0, device

    @classmethod
    def build_model(cls, model_cfg, device: torch.device, seed: int) -> torch.nn.Module:
        """The seeded model (the same initial weights in every process)."""
        from .model import GPT

        torch.manual_seed(seed)
        return GPT(model_cfg).to(device)

    @classmethod
    def rows_per_pass(cls, cfg) -> int:
        """The most sequences one forward pass of this process holds (for the memory check)."""
        return cfg.data.micro_batch_size

    @classmethod
    def shards(cls, cfg) -> int:
        """Processes sharing the model's shards under shard='fsdp' (the torch backend: every rank)."""
        return cfg.cluster.ranks

    @classmethod
    def open_data(cls, cfg, main: bool):
        from .data import TokenData

        return TokenData(cfg.data)

    @classmethod
    def agree(cls, decide):
        """decide() (rank 0 reads the output folder); its outcome for every process."""
        return decide()

    def connect(self, components: dict, step: int) -> int | None:
        return step

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ a step
    def begin(self, step: int) -> int:
        return step

    def failed(self, step: int, schedule) -> frozenset[int] | None:
        return schedule.failed[step]

    def abort(self) -> bool:
        return False

    def commits(self, plan: StepPlan | None) -> bool:
        return True

    def end_step(self, row: dict | None) -> None:
        pass

    def status(self, what: str) -> None:
        """What this process is doing now ("evaluating 40", "checkpointing 40"), for whoever watches (torchft: the
        replica's status file, which the launcher reads)."""

    # ------------------------------------------------------------------ files
    def owns_out(self) -> bool:
        return self.rank == 0

    def io(self, plan: StepPlan | None) -> bool:
        return True

    def writes(self, plan: StepPlan | None) -> bool:
        return self.rank == 0

    several_writers = False  # whether two processes may write the run's checkpoint at once (torchft: yes)

    def write_checkpoint(self, path, step: int, config_hash: str, states: dict, plan: StepPlan | None,
                         keep: int = 1) -> None:
        """Write the gathered states (every process that takes part in the checkpoint calls this); keep: how many
        checkpoints stay (train.keep_checkpoints)."""
        if self.writes(plan):
            checkpoint.save(path, step, config_hash, states, keep_later=self.several_writers, keep=keep)

    def metrics_path(self, out):
        return out / "metrics.jsonl" if self.rank == 0 else None

    def summary_path(self, out):
        return out / "summary.json" if self.rank == 0 else None

    def extras(self) -> dict:
        """Backend-specific entries of a metrics row (under its "backend" key)."""
        return {}

    def summary_extras(self) -> dict:
        """Backend-specific entries of summary.json (under its "backend" key)."""
        return {}

    def prepare(self, plan: StepPlan, computing: bool = True) -> None:
        """Refresh V1 (once per tau-step epoch) at a step where some rank uses low_rank_wgrad: every rank
        does it at the same step from the same weights, so all ranks hold the same subspaces."""
        ffn, head = plan.uses("low_rank_wgrad"), plan.uses("low_rank_head")
        if computing and (ffn or head):
            self.lowrank.prepare(self.model, ffn, head)

    def neighbour(self, t: Techniques) -> Neighbour | None:
        if t == NORMAL:
            return None
        if t not in self._neighbours:
            self._neighbours[t] = Neighbour(t, self.lowrank)
        return self._neighbours[t]

    def rows(self, p: Piece) -> tuple[np.ndarray, np.ndarray]:
        """The piece's rows of its owner's micro-batch (inputs, targets)."""
        x, y = self.data.micro_batch(self.seed, self.current_step, rank=p.owner, micro=p.micro, n_ranks=self.n_ranks)
        return x[p.start:p.stop], y[p.start:p.stop]

    def forward_backward(self, x: np.ndarray, y: np.ndarray, techniques: Techniques, weight: float) -> float:
        """Forward and backward of the rows, weight * gradient of their mean loss accumulated into .grad;
        returns the mean loss."""
        x, y = torch.as_tensor(x, device=self.device), torch.as_tensor(y, device=self.device)
        with self.autocast():
            loss = self.model(x, y, neighbour=self.neighbour(techniques))
        (loss * weight).backward() if weight != 1 else loss.backward()
        return loss.item()

    def run_piece(self, p: Piece, weight: float) -> float:
        """Forward and backward of one piece, weight * gradient accumulated into .grad; returns its loss."""
        return self.forward_backward(*self.rows(p), p.techniques, weight)

    def run_batch(self, pieces: list[Piece]) -> tuple[float, float]:
        """Pieces with the same techniques in one forward and backward, their rows concatenated: with R rows
        of micro-batches of b rows, sum_p w_p grad(mean loss of p) = (R / b) grad(mean loss of the R rows),
        and sum_p w_p = R / b. Returns (sum w * loss, sum w)."""
        if len({(p.techniques, p.batch) for p in pieces}) != 1:
            raise ValueError("a batch needs pieces of one technique set and one micro-batch size")
        rows = [self.rows(p) for p in pieces]
        weight = sum(p.weight for p in pieces)
        loss = self.forward_backward(np.concatenate([x for x, _ in rows]), np.concatenate([y for _, y in rows]),
                                     pieces[0].techniques, weight)
        return loss * weight, weight

    def run_pieces(self, pieces) -> tuple[float, float]:
        """Forward and backward of the pieces, gradients accumulated into .grad; returns (sum w*loss, sum w)."""
        loss_sum, weight_sum = 0.0, 0.0
        for p in pieces:
            loss_sum += self.run_piece(p, p.weight) * p.weight
            weight_sum += p.weight
        self.lowrank.finish()
        return loss_sum, weight_sum

    def exchange_step(self, plan: StepPlan, rank: int, all_reduce_sum) -> StepResult:
        """One process per rank: compute this rank's pieces, SUM-all-reduce the weighted gradient sums (with
        the loss and weight sums) in one flat tensor, divide each group by its weight."""
        self.current_step = plan.step
        self.model.zero_grad(set_to_none=True)
        loss_sum, weight_sum = self.run_pieces(plan.pieces.get(rank, ()))
        params = list(self.model.parameters())
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [torch.tensor([loss_sum, weight_sum], device=self.device, dtype=params[0].dtype)])
        all_reduce_sum(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.normalise(plan.counts(len(self.model.layers)))
        return StepResult(flat[-2].item() / max(flat[-1].item(), 1e-12), plan.samples())

    def updates(self, plan: StepPlan) -> bool:
        return not plan.skipped

    def transition(self, plan: StepPlan, optimizer) -> None:
        """Nothing is lost in one process: the single model is everyone's state."""

    def sync_for_io(self, optimizer) -> None:
        pass

    def evaluates(self, plan: StepPlan | None) -> bool:
        """Whether this process runs the evaluation (FSDP: every rank, the forward pass is collective)."""
        return self.writes(plan)

    def components(self, optimizer) -> dict[str, Component]:
        """The model and the optimizer as checkpoint components (whole tensors; mecefo.checkpoint)."""
        return {"model": Component(self.model.state_dict, self.model.load_state_dict),
                "optimizer": Component(optimizer.state_dict, optimizer.load_state_dict)}

    def parameters_finite(self) -> bool:
        """Whether every parameter this process holds for the run is finite."""
        return all(bool(torch.isfinite(_local(p)).all()) for p in self.model.parameters())

    def restore_checkpoint(self, path, config_hash: str, components: dict, optimizer) -> int:
        """Load the checkpoint at path into the components; returns its step."""
        return checkpoint.restore(checkpoint.load(path, config_hash), components)

    def agreement(self) -> dict:
        """Whether the ranks hold the same state (one process: trivially)."""
        return {"ranks_checked": [0], "identical": True}

    def digest(self, with_parameters: bool = True) -> list[float]:
        """Checksums of this process's low-rank subspaces (by module name) and, if asked, of its parameters,
        each weighted by position (equal digests: the same state, to float64 summation)."""
        def checksum(t: torch.Tensor) -> float:
            t = _local(t).detach().double().flatten()
            return float(t.abs().sum()) + float((t * torch.arange(t.numel(), device=t.device, dtype=torch.float64)).sum())

        names = {m: n for n, m in self.model.named_modules()}
        bases = sorted((names[m], v) for m, (v, _) in self.lowrank._basis.items())
        sums = [checksum(v) for _, v in bases]
        if with_parameters:
            sums += [checksum(p) for p in self.model.parameters()]
        return [len(bases)] + sums

    def normalise(self, counts: dict[str, float]) -> None:
        """.grad holds the weighted sums; divide each group by its weight (no gradient where it is 0)."""
        group = getattr(self.model, "group_of", group_of)  # a Hugging Face model's groups by module name (mecefo.hf)
        for name, p in self.model.named_parameters():
            c = counts[group(name)]
            if c == 0:
                p.grad = None
            elif p.grad is not None and c != 1:
                p.grad.div_(c)


class LocalCluster(Backend):
    """n ranks simulated in one process, into the same .grad. The pieces of all ranks that share a
    micro-batch index and a technique set run as one batch (the model's weights are the same on every
    rank), so a step costs about what it costs one rank with the whole global batch, whatever n."""

    @classmethod
    def rows_per_pass(cls, cfg) -> int:
        return cfg.data.micro_batch_size * cfg.cluster.ranks

    def step(self, plan: StepPlan) -> StepResult:
        self.current_step = plan.step
        self.model.zero_grad(set_to_none=True)
        batches: dict[tuple[int, Techniques, int], list[Piece]] = {}
        for rank in sorted(plan.pieces):
            for p in plan.pieces[rank]:
                batches.setdefault((p.micro, p.techniques, p.batch), []).append(p)
        loss_sum, weight_sum = 0.0, 0.0
        for pieces in batches.values():
            ls, ws = self.run_batch(pieces)
            loss_sum, weight_sum = loss_sum + ls, weight_sum + ws
        self.lowrank.finish()
        self.normalise(plan.counts(len(self.model.layers)))
        return StepResult(loss_sum / max(weight_sum, 1e-12), plan.samples())


class TorchCluster(Backend):
    """One process per rank (torchrun). A failed rank computes nothing and contributes zeros; everyone
    all-reduces the weighted gradient sums; a failed rank loses its state and, on recovery, receives the
    parameters, optimizer state and low-rank subspaces from a live rank before it rejoins."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.n_ranks = dist.get_rank(), dist.get_world_size()
        self.valid = set(range(self.n_ranks))  # ranks whose state is current
        self.prev_failed: frozenset[int] = frozenset()

    @classmethod
    def setup(cls, cfg, device: torch.device, **options) -> tuple[int, torch.device]:
        """Join the process group torchrun describes; returns (rank, this rank's device)."""
        import os

        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "0"))
        if world != cfg.cluster.ranks:
            raise UsageError(f"cluster.backend='torch' needs torchrun with --nproc_per_node {cfg.cluster.ranks} "
                             f"(WORLD_SIZE={world or 'unset'})")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return dist.get_rank(), device

    @classmethod
    def open_data(cls, cfg, main: bool):
        """Rank 0 builds the token cache while the others wait, then everyone opens it."""
        import torch.distributed as dist

        data = Backend.open_data(cfg, main) if main else None
        dist.barrier()
        return data or Backend.open_data(cfg, main)

    @classmethod
    def agree(cls, decide):
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

    def transition(self, plan: StepPlan, optimizer) -> None:
        failed = plan.failed
        alive = set(range(self.n_ranks)) - failed
        for r in sorted(failed - self.prev_failed):
            if alive:  # with everyone down the last state survives, as in a checkpoint
                self.valid.discard(r)
                if r == self.rank:
                    self._wipe(optimizer)
        recovered = sorted(r for r in alive if r not in self.valid)
        if recovered:
            self._broadcast_state(min(self.valid), optimizer)
            self.valid |= set(recovered)
        self.prev_failed = failed

    def _wipe(self, optimizer) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))
        optimizer.state.clear()
        self.lowrank.refresh()

    def _broadcast_state(self, src: int, optimizer) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                self.dist.broadcast(p.data, src)
        payload = [(optimizer.state_dict(), self.lowrank.state_dict()) if self.rank == src else None]
        self.dist.broadcast_object_list(payload, src=src, device=self.device if self.device.type == "cuda" else None)
        if self.rank != src:
            optimizer.load_state_dict(payload[0][0])
            self.lowrank.load_state_dict(payload[0][1])

    WHOLE = ("model", "optimizer", "lowrank")  # what _broadcast_state sends, tensor by tensor

    def parameters_finite(self) -> bool:
        """Every rank whose state is current holds finite parameters (a failed rank's are NaN by design)."""
        ok = torch.tensor([int(self.rank not in self.valid or super().parameters_finite())], device=self.device)
        self.dist.all_reduce(ok, op=self.dist.ReduceOp.MIN)
        return bool(ok.item())

    def restore_checkpoint(self, path, config_hash: str, components: dict, optimizer) -> int:
        """Rank 0 reads the file; the others receive the state from it, tensors by broadcast (as at a
        recovery), the rest as one object: no rank but 0 needs the file."""
        box = [None]
        if self.rank == 0:
            ckpt = checkpoint.load(path, config_hash)
            checkpoint.restore(ckpt, components)
            box[0] = {k: v for k, v in ckpt.items() if k not in self.WHOLE}
        self.dist.broadcast_object_list(box, src=0)
        if self.rank != 0:
            checkpoint.restore(box[0], {k: c for k, c in components.items() if k not in self.WHOLE})
        self._broadcast_state(0, optimizer)
        return box[0]["step"]

    def sync_for_io(self, optimizer) -> None:
        """Before rank 0 evaluates or writes a checkpoint: give it the current state if it has none."""
        if 0 not in self.valid:
            self._broadcast_state(min(self.valid), optimizer)

    def updates(self, plan: StepPlan) -> bool:
        return not plan.skipped and self.rank not in plan.failed

    def prepare(self, plan: StepPlan, computing: bool = True) -> None:
        super().prepare(plan, computing=self.rank not in plan.failed)

    def step(self, plan: StepPlan) -> StepResult:
        return self.exchange_step(plan, self.rank, self.dist.all_reduce)

    def agreement(self) -> dict:
        """Every rank whose state is current holds the same parameters and the same V1 (all ranks call)."""
        digests = [None] * self.n_ranks
        self.dist.all_gather_object(digests, self.digest(with_parameters=True))
        checked = sorted(self.valid)
        return {"ranks_checked": checked, "identical": all(digests[r] == digests[checked[0]] for r in checked)}


class ShardedCluster(TorchCluster):
    """The torch backend with the model sharded by FSDP2 (`fully_shard` per block and at the root) over the
    data-parallel group; parameters, gradients and optimizer state live in 1/n shards.

    The aggregation rule is unchanged: every backward pass reduce-scatters w_p grad(loss_p) summed over the
    ranks (divide factor 1, zeros for parameters a rank gave no gradient, e.g. attention skipped by a
    neighbour) and accumulates it into the gradient shards, so no rank ever holds a whole-model gradient;
    the per-group weights are then divided out of the shards. FSDP's collectives need every rank in every
    forward and backward, so a rank with fewer pieces than the busiest one runs zero-weight passes on one
    row of its own micro-batch (its gradient is exactly 0). The low-rank factors G_y^T (x V1) are all-reduced (m x r each, small) and every rank adds
    its rows of (sum of factors) V1^T to its gradient shard.

    A failed rank computes no piece and contributes weight 0, as in the unsharded backend, but keeps its
    shard and its optimizer state (the only copy of those rows): a simulated failure loses the rank's
    compute, not its memory, so nothing is resynchronised at recovery.
    """

    @classmethod
    def build_model(cls, model_cfg, device: torch.device, seed: int) -> torch.nn.Module:
        return sharded_model(model_cfg, device, seed)  # before the optimizer, which must see the shards

    def evaluates(self, plan: StepPlan | None) -> bool:
        return True  # every rank: the forward pass gathers the shards

    def transition(self, plan: StepPlan, optimizer) -> None:
        """Nothing is lost: every rank keeps its shard."""

    def sync_for_io(self, optimizer) -> None:
        pass

    def updates(self, plan: StepPlan) -> bool:
        return not plan.skipped  # every shard is updated, or its rows would go stale

    def prepare(self, plan: StepPlan, computing: bool = True) -> None:
        Backend.prepare(self, plan)  # gathering a weight is a collective: every rank takes part

    def step(self, plan: StepPlan) -> StepResult:
        self.current_step = plan.step
        self.model.zero_grad(set_to_none=True)
        mine = plan.pieces.get(self.rank, ())
        passes = max((len(ps) for ps in plan.pieces.values()), default=0)
        filler = Piece(self.rank, 0, 0, 1, 1)  # one row of this rank's own first micro-batch, weight 0
        loss_sum, weight_sum = 0.0, 0.0
        for i in range(passes):  # each backward reduce-scatters and accumulates into the gradient shards
            if i < len(mine):
                loss_sum += self.run_piece(mine[i], mine[i].weight) * mine[i].weight
                weight_sum += mine[i].weight
            else:
                self.run_piece(filler, 0.0)
        add_low_rank_rows(self.model, self.lowrank, plan, self.rank, self.n_ranks, self.dist.all_reduce)
        totals = torch.tensor([loss_sum, weight_sum], device=self.device, dtype=torch.float64)
        self.dist.all_reduce(totals)
        self.normalise(plan.counts(len(self.model.layers)))
        return StepResult(totals[0].item() / max(totals[1].item(), 1e-12), plan.samples())

    def components(self, optimizer) -> dict[str, Component]:
        return sharded_components(self.model, optimizer)

    def restore_checkpoint(self, path, config_hash: str, components: dict, optimizer) -> int:
        return restore_sharded(path, config_hash, components, self.rank)

    def agreement(self) -> dict:
        """Every rank holds the same V1 (the parameters are shards: each rank's are its own)."""
        digests = [None] * self.n_ranks
        self.dist.all_gather_object(digests, self.digest(with_parameters=False))
        return {"ranks_checked": list(range(self.n_ranks)), "identical": all(d == digests[0] for d in digests)}


@torch.no_grad()
def add_low_rank_rows(model, lowrank: LowRankWgrad, plan: StepPlan, shard: int, n_shards: int, all_reduce) -> None:
    """FSDP2 with low_rank_wgrad: sum the factors G_y^T (x V1) (m x r each) of the processes sharing the shards
    (all_reduce, a SUM over them) and add this shard's rows of (sum) V1^T to its gradient shard (FSDP2 shards
    dim 0 in torch.chunk's split)."""
    linears = lowrank.matrices(model, plan.uses("low_rank_wgrad"), plan.uses("low_rank_head"))
    if not linears:
        return
    device = next(model.parameters()).device
    factors = [lowrank.pending.pop(m, None) for m in linears]
    shapes = [(m.weight.shape[0], lowrank.basis(m).shape[1]) for m in linears]
    flat = torch.cat([(f if f is not None else torch.zeros(s, device=device)).reshape(-1).float()
                      for f, s in zip(factors, shapes)])
    all_reduce(flat)
    offset = 0
    for m, shape in zip(linears, shapes):
        factor = flat[offset: offset + shape[0] * shape[1]].view(shape)
        offset += factor.numel()
        if m.weight.grad is None:  # no piece at all for these processes: their factors are 0
            continue
        local = m.weight.grad.to_local()
        chunks = factor.chunk(n_shards, dim=0)
        rows = chunks[shard] if shard < len(chunks) else factor[:0]
        if rows.shape[0] != local.shape[0]:
            raise RuntimeError(f"FSDP shard of {m} has {local.shape[0]} rows, expected {rows.shape[0]}")
        local.add_(lowrank.gradient(m, rows).to(local.dtype))


def sharded_components(model, optimizer) -> dict[str, Component]:
    """An FSDP2 model and its optimizer as checkpoint components: whole tensors gathered onto the group's rank
    0's CPU (a collective of the processes sharing the shards; the others get empty dicts), and on load
    broadcast from rank 0 into every process's shards."""
    from torch.distributed.checkpoint import state_dict as dcp

    gather = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    scatter = dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    return {"model": Component(lambda: dcp.get_model_state_dict(model, options=gather),
                               lambda s: dcp.set_model_state_dict(model, s, options=scatter)),
            "optimizer": Component(lambda: dcp.get_optimizer_state_dict(model, optimizer, options=gather),
                                   lambda s: dcp.set_optimizer_state_dict(model, optimizer, s, options=scatter))}


def restore_sharded(path, config_hash: str, components: dict, rank: int) -> int:
    """The shards' rank 0 (`rank`: this process's rank in the default process group) reads the checkpoint and
    broadcasts it: the model and optimizer into the shards, the rest as one object. Returns its step."""
    import torch.distributed as dist

    sharded, box, ckpt = ("model", "optimizer"), [None], {}
    if rank == 0:
        ckpt = checkpoint.load(path, config_hash)
        box[0] = {k: v for k, v in ckpt.items() if k not in sharded}
    dist.broadcast_object_list(box, src=0)
    return checkpoint.restore(box[0] | {k: ckpt.get(k, {}) for k in sharded}, components)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def sharded_model(cfg, device: torch.device, seed: int) -> torch.nn.Module:
    """A GPT sharded by FSDP2 whose whole is never built on any rank but 0: rank 0 initialises it (seeded,
    on the CPU, as the unsharded backends do) and broadcasts it into the others' shards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from .model import GPT

    torch.manual_seed(seed)
    whole = GPT(cfg).state_dict() if dist.get_rank() == 0 else {}
    with torch.device("meta"):
        model = GPT(cfg)
    shard_model(model, device)
    model.to_empty(device=device)
    model.reset_buffers()
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 over all ranks: each block is one unit (its attention and FFN together), the root holds the
    embedding, final norm and LM head. Gradients are summed (divide factor 1) so that the aggregation rule
    divides by its own per-group weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    for module in [*model.layers, model]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
