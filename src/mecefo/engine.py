"""The step engine: how a planned step is computed and exchanged, whoever decided who is alive.

One process computes pieces (mecefo.plan.Piece: rows of a rank's micro-batch, with the techniques the
policy chose) into .grad; the engine then sums the processes' weighted gradients and divides each
parameter group by its weight, the paper's aggregation rule (mecefo.cluster's docstring). How the model
is held and how the sums cross the processes is the engine's:

  Batched     every rank in this process (the local backend): the pieces of all ranks that share a
              micro-batch index and a technique set run as one batch
  Replicated  one process per rank, the whole model in each; the weighted sums cross the replicas through
              the injected all_reduce (torch.distributed's, or torchft's Manager's)
  TorchReplicated  Replicated under a schedule of simulated failures (the torch backend): a failed rank's
              state is lost and given back by a live rank's broadcast when it recovers
  Sharded     FSDP2 over the processes sharing the shards: either every rank (the torch backend: one
              process per rank) or one rank's replica group (torchft: its processes split the rank's rows),
              the group's sums then crossing the groups through the injected all_reduce

Contract. Run sizes the memory check with rows_per_pass(cfg) (classmethod: the rows of one pass), builds the model
with build_model (classmethod, before the optimizer) and the engine from it, its clock the Run's (mecefo.timing:
the engine times the exchange and V1's refresh into it); the membership's engine_options(shard) give all_reduce and
shard_group; every process of the run then calls, at each step and in this order (collectives match):
    compute(plan, optimizer) -> StepResult   state lost/given back (transition), V1 refreshed where the plan
                                             uses it, this process's pieces, the exchange; .grad then holds the
                                             aggregated gradient of the parameters this process holds
    update(plan, optimizer, lr)              the optimizer step where this process updates (after the
                                             membership said the step commits)
and around the steps: components(optimizer) (the checkpoint's model and optimizer), restore(ckpt, components)
(every process, from a checkpoint's contents or None where it did not read one), sync_for_io(optimizer) (before
the writer evaluates or checkpoints), parameters_finite(), collective_checkpoint (every process writes its own shards)
and checkpoint_tensors(optimizer) (the tensors it writes), agreement() (whether the processes hold one state), model,
evaluates_with_writer (an evaluation is collective: every process sharing the writer's shards runs it); and for a
torchft heal (mecefo.ft.FtMembership, handed the engine by connect): heal_skips (components a heal does not send),
heal_state() / load_heal_state(state) (what it sends of the model and optimizer instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import checkpoint
from .checkpoint import Component
from .errors import UsageError
from .model import group_of
from .neighbour import LowRankWgrad, Neighbour, Techniques
from .plan import NORMAL, Piece, StepPlan, fuse
from .timing import Clock


def normalise(model: torch.nn.Module, counts: dict[str, float], group_of: Callable[[str], str]) -> None:
    """.grad holds each parameter's weighted sum over the pieces; divide it by its group's weight c_g (the sum of the
    weights of the pieces that trained the group: mecefo.plan.StepPlan.counts); no gradient where c_g is 0."""
    for name, p in model.named_parameters():
        c = counts[group_of(name)]
        if c == 0:
            p.grad = None
        elif p.grad is not None and c != 1:
            p.grad.div_(c)


@dataclass
class StepResult:
    loss: float  # weighted mean training loss over the pieces computed this step
    samples: int


@dataclass
class StepEngine:
    """The computation every engine shares (pieces into .grad, the per-group division); an engine of one
    process and one rank (n_ranks 1) as it stands."""

    model: torch.nn.Module
    data: object  # mecefo.data.TokenData, or any source with .micro_batch (the benches' fixed batch)
    seed: int
    device: torch.device
    lowrank: LowRankWgrad
    autocast: Callable = None  # a callable returning the autocast context
    n_ranks: int = 1
    rank: int = 0  # the data-parallel rank this process computes for (Batched: all of them)
    all_reduce: Callable | None = None  # SUM in place over the replicas (ranks or replica groups); None: none
    shard_group: tuple[int, int] = (0, 1)  # (this process, processes) sharing the model's shards (Sharded)
    low_rank_refresh: str = "shared"  # V1's SVDs: shared among the ranks (TorchReplicated) or computed by each (local)
    neighbour_pass: str = "sequential"  # a process's pieces each in its own pass, or fused (mecefo.plan.fuse)
    _neighbours: dict = field(default_factory=dict)
    current_step: int = 0
    clock: Clock = None  # where the step's time goes (mecefo.timing; the Run's)

    evaluates_with_writer = False  # an evaluation is a collective of the processes sharing the shards
    heal_skips = ()  # checkpoint components a torchft heal does not send (heal_state sends them instead)

    def __post_init__(self):
        import contextlib

        self.autocast = self.autocast or contextlib.nullcontext
        self.clock = self.clock if self.clock is not None else Clock()

    # ------------------------------------------------------------------ the model
    @classmethod
    def build_model(cls, model_cfg, device: torch.device, seed: int, compile: bool = False) -> torch.nn.Module:
        """The seeded model (the same initial weights in every process), its blocks compiled if asked (compile_blocks)."""
        from .model import GPT, compile_blocks

        torch.manual_seed(seed)
        model = GPT(model_cfg).to(device)
        return compile_blocks(model) if compile else model

    @classmethod
    def rows_per_pass(cls, cfg) -> int:
        """The most sequences one forward pass of this process holds (for the memory check)."""
        return cfg.data.micro_batch_size

    # ------------------------------------------------------------------ a step
    def compute(self, plan: StepPlan, optimizer) -> StepResult:
        """The step's state transition, V1 refresh, this process's pieces and the exchange."""
        self.transition(plan, optimizer)
        self.lowrank.steps = plan.step
        self.prepare(plan)
        return self.step(plan)

    def transition(self, plan: StepPlan, optimizer) -> None:
        """State lost by ranks that fail, given back to ranks that recover (nothing, but in TorchReplicated)."""

    def prepare(self, plan: StepPlan, computing: bool = True) -> None:
        """Refresh V1 (once per tau-step epoch) at a step where some rank uses low_rank_wgrad: every rank
        does it at the same step from the same weights, so all ranks hold the same subspaces."""
        ffn, head = plan.uses("low_rank_wgrad"), plan.uses("low_rank_head")
        if computing and (ffn or head):
            with self.clock("refresh"):
                self.lowrank.prepare(self.model, ffn, head)

    def step(self, plan: StepPlan) -> StepResult:
        """This process's pieces (its rank's) and the exchange of their weighted sums."""
        return self.exchange_step(plan)

    def updates(self, plan: StepPlan) -> bool:
        return not plan.skipped

    def update(self, plan: StepPlan, optimizer, lr: float) -> None:
        """The optimizer step at lr where this process updates; parameters without a gradient are left unchanged."""
        if self.updates(plan):
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        self.model.zero_grad(set_to_none=True)

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

    def forward_backward(self, x: np.ndarray, y: np.ndarray, techniques: Techniques, weight: float) -> torch.Tensor:
        """Forward and backward of the rows, weight * gradient of their mean loss accumulated into .grad;
        returns the mean loss, a tensor on the device (read once per step: no host sync per piece)."""
        x, y = torch.as_tensor(x, device=self.device), torch.as_tensor(y, device=self.device)
        with self.autocast():
            loss = self.model(x, y, neighbour=self.neighbour(techniques))
        (loss * weight).backward() if weight != 1 else loss.backward()
        return loss.detach()

    def zero_sum(self) -> torch.Tensor:
        """A loss sum on the device in fp64: the same arithmetic as Python floats of each piece's loss."""
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def run_batch(self, pieces: list[Piece], weight: float | None = None) -> tuple[torch.Tensor, float]:
        """Pieces with the same techniques in one forward and backward, their rows concatenated: with R rows
        of micro-batches of b rows, sum_p w_p grad(mean loss of p) = (R / b) grad(mean loss of the R rows),
        and sum_p w_p = R / b (weight, where given, instead: 0 for a filler pass). Returns (sum w * loss, sum w)."""
        if len({(p.techniques, p.batch) for p in pieces}) != 1:
            raise ValueError("a batch needs pieces of one technique set and one micro-batch size")
        rows = [self.rows(p) for p in pieces]
        weight = sum(p.weight for p in pieces) if weight is None else weight
        x, y = (rows[0] if len(rows) == 1 else (np.concatenate([x for x, _ in rows]), np.concatenate([y for _, y in rows])))
        loss = self.forward_backward(x, y, pieces[0].techniques, weight)
        return loss.double() * weight, weight

    def passes(self, pieces) -> list[list[Piece]]:
        """This process's forward and backward passes over its pieces: each piece alone (neighbour_pass 'sequential'),
        or those of one micro-batch index and technique set together ('fused': a neighbour's own and failed
        micro-batches m in one pass, k + 1 times the rows when it covers k ranks; mecefo.plan.fuse)."""
        return fuse(pieces) if self.neighbour_pass == "fused" else [[p] for p in pieces]

    def run_pieces(self, pieces) -> tuple[torch.Tensor, float]:
        """Forward and backward of the pieces (in this process's passes), gradients accumulated into .grad; returns
        (sum w*loss on the device, sum w)."""
        loss_sum, weight_sum = self.zero_sum(), 0.0
        for group in self.passes(pieces):
            ls, ws = self.run_batch(group)
            loss_sum, weight_sum = loss_sum + ls, weight_sum + ws
        self.lowrank.finish()
        return loss_sum, weight_sum

    def exchange_step(self, plan: StepPlan) -> StepResult:
        """One process per rank: compute this rank's pieces, SUM-all-reduce the weighted gradient sums (with
        the loss and weight sums) in one flat tensor, divide each group by its weight."""
        self.current_step = plan.step
        self.model.zero_grad(set_to_none=True)
        loss_sum, weight_sum = self.run_pieces(plan.pieces.get(self.rank, ()))
        params = list(self.model.parameters())
        sums = torch.stack([loss_sum, torch.tensor(weight_sum, dtype=torch.float64, device=self.device)])
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [sums.to(params[0].dtype)])
        if self.all_reduce is not None:
            with self.clock("exchange"):
                self.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.normalise(plan.counts(len(self.model.layers)))
        return StepResult(flat[-2].item() / max(flat[-1].item(), 1e-12), plan.samples())

    def normalise(self, counts: dict[str, float]) -> None:
        """.grad holds the weighted sums; divide each group by its weight (no gradient where it is 0)."""
        # (a Hugging Face model's groups by module name: mecefo.hf)
        normalise(self.model, counts, getattr(self.model, "group_of", group_of))

    # ------------------------------------------------------------------ state
    collective_checkpoint = False  # whether every process sharing the model's shards writes a checkpoint (FSDP)

    def components(self, optimizer) -> dict[str, Component]:
        """The model and the optimizer as components (whole tensors), which a torchft heal sends."""
        return {"model": Component(self.model.state_dict, self.model.load_state_dict),
                "optimizer": Component(optimizer.state_dict, optimizer.load_state_dict)}

    def checkpoint_tensors(self, optimizer) -> dict:
        """The model's and optimizer's state for a checkpoint, in this engine's layout (mecefo.checkpoint.tensors)."""
        return checkpoint.tensors(self.model, optimizer)

    def restore(self, path, config_hash: str, components: dict, optimizer) -> int:
        """Load the checkpoint at path into the model, the optimizer and the components; returns its step."""
        ckpt = checkpoint.load(path, config_hash)
        checkpoint.load_tensors(path, self.model, optimizer)
        return checkpoint.restore(ckpt, components)

    def sync_for_io(self, optimizer) -> None:
        """Before the writer evaluates or writes a checkpoint: give it the current state if it has none."""

    def parameters_finite(self) -> bool:
        """Whether every parameter this process holds for the run is finite."""
        return all(bool(torch.isfinite(_local(p)).all()) for p in self.model.parameters())

    def agreement(self) -> dict:
        """Whether the processes hold the same state (one process: trivially); "digest": this process's (or its
        group's) state's checksums, which a launcher compares across replicas."""
        return {"ranks_checked": [self.rank], "identical": True, "digest": self.digest(with_parameters=True)}

    def heal_state(self) -> dict:
        """What a torchft heal sends of the model and optimizer (none here: they go as checkpoint components)."""
        return {}

    def load_heal_state(self, state: dict) -> None:
        pass

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


class Batched(StepEngine):
    """n ranks simulated in one process, into the same .grad. The pieces of all ranks that share a
    micro-batch index and a technique set run as one batch (the model's weights are the same on every
    rank), so a step costs about what it costs one rank with the whole global batch, whatever n."""

    @classmethod
    def rows_per_pass(cls, cfg) -> int:
        return cfg.data.micro_batch_size * cfg.cluster.ranks

    def step(self, plan: StepPlan) -> StepResult:
        self.current_step = plan.step
        self.model.zero_grad(set_to_none=True)
        loss_sum, weight_sum = self.zero_sum(), 0.0
        for pieces in fuse([p for rank in sorted(plan.pieces) for p in plan.pieces[rank]]):
            ls, ws = self.run_batch(pieces)
            loss_sum, weight_sum = loss_sum + ls, weight_sum + ws
        self.lowrank.finish()
        self.normalise(plan.counts(len(self.model.layers)))
        return StepResult((loss_sum / max(weight_sum, 1e-12)).item(), plan.samples())


class Replicated(StepEngine):
    """One process per rank holding the whole model: its rank's pieces, the weighted sums all-reduced (the
    injected all_reduce: torchft's Manager, whose replicas are real processes that die and heal)."""


class TorchReplicated(Replicated):
    """One process per rank (torchrun) under a schedule of simulated failures. A failed rank computes
    nothing and contributes zeros; everyone all-reduces the weighted gradient sums; a failed rank loses its
    state and, on recovery, receives the parameters, optimizer state and low-rank subspaces from a live rank
    before it rejoins."""

    WHOLE = ("model", "optimizer", "lowrank")  # what _broadcast_state sends, tensor by tensor

    def __post_init__(self):
        super().__post_init__()
        import torch.distributed as dist

        self.dist = dist
        self.valid = set(range(self.n_ranks))  # ranks whose state is current
        self.prev_failed: frozenset[int] = frozenset()

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

    def prepare(self, plan: StepPlan, computing: bool = True) -> None:
        """V1 refreshed at the step StepEngine.prepare names, its SVDs shared (low_rank_refresh 'shared'): the stale
        matrices, as the lowest alive rank sees them (every rank whose state is current holds the same subspaces; a
        failed rank's were wiped), go to the alive ranks in turn (the i-th to the (i mod a)-th of the a alive ranks),
        each computes its own and broadcasts it, so that a refresh costs each rank 1/a of the SVDs and every rank ends
        with the same V1 whatever its CPU or GPU. 'local': every alive rank computes every V1 (as StepEngine)."""
        if self.low_rank_refresh != "shared":
            return super().prepare(plan, computing=self.rank not in plan.failed)
        ffn, head = plan.uses("low_rank_wgrad"), plan.uses("low_rank_head")
        alive = sorted(set(range(self.n_ranks)) - plan.failed)
        if (ffn or head) and alive:
            with self.clock("refresh"):
                shared_refresh(self.lowrank, self.lowrank.matrices(self.model, ffn, head), self.rank, alive, self.dist,
                               self.device)

    def updates(self, plan: StepPlan) -> bool:
        return not plan.skipped and self.rank not in plan.failed

    def parameters_finite(self) -> bool:
        """Every rank whose state is current holds finite parameters (a failed rank's are NaN by design)."""
        ok = torch.tensor([int(self.rank not in self.valid or super().parameters_finite())], device=self.device)
        self.dist.all_reduce(ok, op=self.dist.ReduceOp.MIN)
        return bool(ok.item())

    def restore(self, path, config_hash: str, components: dict, optimizer) -> int:
        """Rank 0 reads the checkpoint; the others receive the state from it, tensors by broadcast (as at a
        recovery), the rest as one object: no rank but 0 needs the files."""
        box = [None]
        if self.rank == 0:
            try:
                ckpt = checkpoint.load(path, config_hash)
                checkpoint.load_tensors(path, self.model, optimizer)
                checkpoint.restore(ckpt, components)
                box[0] = {k: v for k, v in ckpt.items() if k not in self.WHOLE}
            except UsageError as e:  # (every rank stops with the line, none is left in the broadcast)
                box[0] = {"refused": str(e)}
        self.dist.broadcast_object_list(box, src=0)
        if "refused" in box[0]:
            raise UsageError(box[0]["refused"])
        if self.rank != 0:
            checkpoint.restore(box[0], {k: c for k, c in components.items() if k not in self.WHOLE})
        self._broadcast_state(0, optimizer)
        return box[0]["step"]

    def sync_for_io(self, optimizer) -> None:
        """Before rank 0 evaluates or writes a checkpoint: give it the current state if it has none."""
        if 0 not in self.valid:
            self._broadcast_state(min(self.valid), optimizer)

    def agreement(self) -> dict:
        """Every rank whose state is current holds the same parameters and the same V1 (all ranks call)."""
        digests = [None] * self.n_ranks
        self.dist.all_gather_object(digests, self.digest(with_parameters=True))
        checked = sorted(self.valid)
        return {"ranks_checked": checked, "identical": all(digests[r] == digests[checked[0]] for r in checked)}


class Sharded(StepEngine):
    """The model sharded by FSDP2 (`fully_shard` per block and at the root) over the processes of the default
    process group, which share its shards: parameters, gradients and optimizer state live in 1/k shards.

    Who computes what. Without an injected all_reduce the shard group is every rank, one process each (the
    torch backend): process j computes rank j's pieces. With one (torchft) the shard group is one rank's
    replica group: its k processes split each of the rank's pieces by rows (row_share), and the group's
    gradient shards, loss and weight sums then cross the groups, process j of every group with process j of
    the others (SUM).

    The aggregation rule is unchanged: every backward pass reduce-scatters w_p grad(loss_p) summed over the
    group (divide factor 1, zeros for parameters a process gave no gradient, e.g. attention skipped by a
    neighbour) and accumulates it into the gradient shards, so no process ever holds a whole-model gradient;
    the per-group weights are then divided out of the shards. FSDP's collectives need every process in every
    forward and backward, so a process with fewer passes than the busiest one runs zero-weight passes on one
    row (its gradient is exactly 0). The low-rank factors G_y^T (x V1) are all-reduced within the group
    (m x r each, small) and every process adds its rows of (sum of factors) V1^T to its gradient shard
    (linear: the sum over groups is the sum of all factors).

    A failed rank (the torch backend's simulated failure) computes no piece and contributes weight 0, but
    keeps its shard and its optimizer state (the only copy of those rows): a simulated failure loses the
    rank's compute, not its memory, so nothing is resynchronised at recovery.
    """

    evaluates_with_writer = True
    heal_skips = ("model", "optimizer")  # gathering them is a collective: a heal sends this process's shards

    @classmethod
    def build_model(cls, model_cfg, device: torch.device, seed: int, compile: bool = False) -> torch.nn.Module:
        return sharded_model(model_cfg, device, seed, compile)  # before the optimizer, which must see the shards

    def prepare(self, plan: StepPlan, computing: bool = True) -> None:
        """V1 refreshed at the step StepEngine.prepare names, its SVDs shared (low_rank_refresh 'shared') among the
        processes sharing the shards (every rank on the torch backend, a failed one included: it keeps its shard; one
        replica group's processes on torchft): each gathers the whole of every stale matrix of a round (FSDP2's
        all-gather, a collective), keeps its own, computes its SVD and broadcasts it (shared_refresh). 'local': every
        process computes every V1 (as StepEngine)."""
        ffn, head = plan.uses("low_rank_wgrad"), plan.uses("low_rank_head")
        if self.low_rank_refresh != "shared" or not (ffn or head):
            return super().prepare(plan)
        import torch.distributed as dist

        j, k = self.shard_group
        with self.clock("refresh"):
            shared_refresh(self.lowrank, self.lowrank.matrices(self.model, ffn, head), j, list(range(k)), dist,
                           self.device, gathered=True)

    def shares(self, plan: StepPlan) -> list[tuple[list[Piece], float]]:
        """This process's passes (self.passes): (pieces, weight), weight 0 for a filler pass."""
        j, k = self.shard_group
        if self.all_reduce is None:  # one process per rank
            mine = self.passes(plan.pieces.get(j, ()))
            passes = max((len(self.passes(ps)) for ps in plan.pieces.values()), default=0)
            filler = [Piece(j, 0, 0, 1, 1)]  # one row of this rank's own first micro-batch, weight 0
            return [(ps, sum(p.weight for p in ps)) for ps in mine] + [(filler, 0.0)] * (passes - len(mine))
        shares = []
        for group in self.passes(plan.pieces.get(self.rank, ())):
            mine = [s for s in (row_share(p, j, k) for p in group) if s is not None]
            first = group[0]  # more processes than rows: one row at weight 0
            shares.append((mine, sum(p.weight for p in mine)) if mine else
                          ([Piece(first.owner, first.micro, first.start, first.start + 1, first.batch, first.techniques)], 0.0))
        return shares

    def step(self, plan: StepPlan) -> StepResult:
        import torch.distributed as dist

        self.current_step = plan.step
        self.model.zero_grad(set_to_none=True)
        loss_sum, weight_sum = self.zero_sum(), 0.0
        for pieces, weight in self.shares(plan):  # each backward reduce-scatters and accumulates into the shards
            ls, ws = self.run_batch(pieces, weight)
            loss_sum, weight_sum = loss_sum + ls, weight_sum + ws
        j, k = self.shard_group
        with self.clock("exchange"):
            add_low_rank_rows(self.model, self.lowrank, plan, j, k, dist.all_reduce)
            totals = torch.stack([loss_sum, torch.tensor(weight_sum, dtype=torch.float64, device=self.device)])
            dist.all_reduce(totals)  # the group's sums (its gradient shards are summed by FSDP's reduce-scatter)
            if self.all_reduce is not None:
                totals = self._cross_groups(totals)
        self.normalise(plan.counts(len(self.model.layers)))
        return StepResult(totals[0].item() / max(totals[1].item(), 1e-12), plan.samples())

    def _cross_groups(self, totals: torch.Tensor) -> torch.Tensor:
        """The gradient shards and the sums, SUM over the replica groups (the injected all_reduce); returns the
        summed totals."""
        params = list(self.model.parameters())
        flat = torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))).reshape(-1)
                          for p in params] + [totals.to(_local(params[0]).dtype)])
        self.all_reduce(flat)
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
        return flat[-2:].double()

    def updates(self, plan: StepPlan) -> bool:
        return not plan.skipped  # every shard is updated, or its rows would go stale

    collective_checkpoint = True  # every process writes its own shards

    def components(self, optimizer) -> dict[str, Component]:
        """None: the shards go to checkpoints through DCP, to heals through heal_state."""
        self.optimizer = optimizer
        return {}

    def restore(self, path, config_hash: str, components: dict, optimizer) -> int:
        """Every process reads its own shards (DCP, whatever the layout that wrote them); the shard group's
        first process reads the rest and broadcasts it. Returns the checkpoint's step."""
        import torch.distributed as dist

        box = [None]
        if self.shard_group[0] == 0:
            try:
                box[0] = checkpoint.load(path, config_hash)  # (verified: mecefo.checkpoint.verify)
            except UsageError as e:  # every process of the group stops with the line, none is left in the broadcast
                box[0] = {"refused": str(e)}
        dist.broadcast_object_list(box, src=0)
        if "refused" in box[0]:
            raise UsageError(box[0]["refused"])
        checkpoint.load_tensors(path, self.model, optimizer, collective=True)
        return checkpoint.restore(box[0], components)

    def parameters_finite(self) -> bool:
        """Every process of the shard group holds finite shards (a collective of the group)."""
        import torch.distributed as dist

        ok = torch.tensor([int(super().parameters_finite())], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def agreement(self) -> dict:
        """Every process of the shard group holds the same V1 (the parameters are shards: each its own); the
        group's digest (every shard's) for a launcher comparing replica groups."""
        import torch.distributed as dist

        digests = [None] * self.shard_group[1]
        dist.all_gather_object(digests, self.digest(with_parameters=True))
        bases = [d[:d[0] + 1] for d in digests]
        checked = list(range(self.n_ranks)) if self.all_reduce is None else [self.rank]
        return {"ranks_checked": checked, "identical": all(b == bases[0] for b in bases),
                "digest": [x for d in digests for x in d]}

    # ------------------------------------------------------------------ a heal: this process's shards
    def heal_state(self) -> dict:
        """This process's own shards (its model's and optimizer's), which process j of a healing group takes."""
        _reshard(self.model)
        return {"group_size": self.shard_group[1],
                "model": {k: _local(p).detach() for k, p in self.model.named_parameters()},
                "optimizer": _map_tensors(self.optimizer.state_dict(), _local)}

    def load_heal_state(self, state: dict) -> None:
        """A peer's shards into this process's (the groups have the same size: the same layout)."""
        _reshard(self.model)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k, v in state["model"].items():
                _local(params[k]).copy_(v)
        by_index = [p for g in self.optimizer.param_groups for p in g["params"]]
        optimizer = state["optimizer"]
        for i, entry in optimizer["state"].items():  # the peer's local shards back into DTensors of our own layout
            p = by_index[int(i)]
            for k, v in entry.items():
                if torch.is_tensor(v) and hasattr(p, "device_mesh") and v.dim() > 0 and v.shape == _local(p).shape:
                    from torch.distributed.tensor import DTensor

                    entry[k] = DTensor.from_local(v.to(self.device), p.device_mesh, p.placements, run_check=False,
                                                  shape=p.shape, stride=p.stride())
        self.optimizer.load_state_dict(optimizer)


def shared_refresh(lowrank: LowRankWgrad, linears, rank: int, members: list[int], dist, device,
                   gathered: bool = False) -> None:
    """V1 of the stale matrices among `linears` (stale as members[0] sees them: every member whose state is current
    holds the same subspaces), computed once and shared: the i-th stale matrix goes to member i mod m of the m members,
    each computes its own and broadcasts it, so that a refresh costs each member 1/m of the SVDs and every member ends
    with the same V1 whatever its CPU or GPU. Every share is computed before any broadcast (one in between would
    serialise them). gathered (FSDP2 shards): the whole matrices are gathered first, a collective of every member for
    every matrix, in rounds of m matrices (one whole matrix kept per member and round). Every process of `dist` calls
    this, members or not (the broadcasts are collectives); an SVD that fails on one member raises on all."""
    stale = set(lowrank.stale(linears))
    flags = torch.tensor([m in stale for m in linears], dtype=torch.uint8, device=device)
    dist.broadcast(flags, members[0])
    todo = [m for m, f in zip(linears, flags.tolist()) if f]
    owner = {m: members[i % len(members)] for i, m in enumerate(todo)}
    size = len(members) if gathered else max(len(todo), 1)
    for start in range(0, len(todo), size):
        batch = todo[start:start + size]
        wholes = {}
        for m in batch:  # (the gathers before any SVD: an error below leaves no member inside a gather)
            w = m.weight.detach().full_tensor() if gathered else None
            if owner[m] == rank:
                wholes[m] = w
        error = None
        try:
            for m, w in wholes.items():
                lowrank.basis(m, w)
        except Exception as exc:  # noqa: BLE001 (raised below on every member, not left to a collective's timeout)
            error = exc
        wholes.clear()
        failed = torch.tensor([error is not None], dtype=torch.uint8, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            raise error or RuntimeError("the V1 refresh failed on another process (its log names the error)")
        for m in batch:
            v1 = lowrank.basis(m) if owner[m] == rank else lowrank.empty_basis(m)
            dist.broadcast(v1, owner[m])
            if owner[m] != rank:
                lowrank.install(m, v1)


def row_share(piece: Piece, j: int, k: int) -> Piece | None:
    """Process j's share of a piece's rows when a group of k processes computes it: contiguous, the first
    (rows mod k) processes one row more (None: no row). A share of weight rows/b gives weight * grad of its
    mean loss, so the shares' sum is the piece's."""
    n = piece.stop - piece.start
    start = piece.start + j * (n // k) + min(j, n % k)
    stop = start + n // k + (1 if j < n % k else 0)
    return Piece(piece.owner, piece.micro, start, stop, piece.batch, piece.techniques) if stop > start else None


@torch.no_grad()
def add_low_rank_rows(model, lowrank: LowRankWgrad, plan: StepPlan, shard: int, n_shards: int, all_reduce) -> None:
    """FSDP2 with low_rank_wgrad: sum the factors G_y^T (x V1) (m x r each) of the processes sharing the shards
    (all_reduce, a SUM over them) and add this shard's rows of (sum) V1^T to its gradient shard (FSDP2 shards
    dim 0 in torch.chunk's split)."""
    linears = lowrank.matrices(model, plan.uses("low_rank_wgrad"), plan.uses("low_rank_head"))
    if not linears:
        return
    device = next(model.parameters()).device
    pending = lowrank.pending
    factors = [pending.get(m) for m in linears]
    shapes = [(m.weight.shape[0], lowrank.basis(m).shape[1]) for m in linears]
    flat = torch.cat([(f if f is not None else torch.zeros(s, device=device)).reshape(-1).float()
                      for f, s in zip(factors, shapes)])  # (a copy: the buffers are zeroed for the next step)
    lowrank.clear(linears)
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _reshard(model: torch.nn.Module) -> None:
    """Put the FSDP2 model's sharded parameters back in place: after a forward pass without backward (an
    evaluation), the root module keeps its parameters gathered, whole, until its next backward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _map_tensors(tree, fn):
    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def sharded_model(cfg, device: torch.device, seed: int, compile: bool = False) -> torch.nn.Module:
    """A GPT sharded by FSDP2 whose whole is never built on any rank but 0: rank 0 initialises it (seeded,
    on the CPU, as the unsharded backends do) and broadcasts it into the others' shards; its blocks compiled before
    they are sharded, if asked (compile_blocks)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from .model import GPT, compile_blocks

    torch.manual_seed(seed)
    whole = GPT(cfg).state_dict() if dist.get_rank() == 0 else {}
    with torch.device("meta"):
        model = GPT(cfg)
    if compile:
        compile_blocks(model)
    shard_model(model, device)
    model.to_empty(device=device)
    model.reset_buffers()
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 over all processes of the default group: each block is one unit (its attention and FFN together),
    the root holds the embedding, final norm and LM head. Gradients are summed (divide factor 1) so that the
    aggregation rule divides by its own per-group weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch.distributed.fsdp import FSDPModule

    from .errors import UsageError

    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):  # (the GPU check met torch 2.11 without it)
        raise UsageError(f"--shard fsdp needs FSDP2's set_reduce_scatter_unused_params, which torch {torch.__version__} "
                         "lacks (a neighbour's pieces leave attention unused and the processes' reduce-scatters would "
                         "not match): install the pinned torch (requirements.txt; 2.13 has it)")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    for module in [*model.layers, model]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
