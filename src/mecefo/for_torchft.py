"""MeCeFO for torchft users: keep the global batch when a replica group dies, in your own training loop.

torchft (its Manager, process groups and lighthouse) keeps a job training when a replica group dies, but the dead
group's data is dropped for as long as it is down: the global batch shrinks. Here the live groups compute the dead
groups' batches too, under a policy of mecefo.policies:
- 'drop' (default): torchft's own behaviour, the mean gradient of the live groups' batches;
- 'mecefo' (the paper's Neighbour-Do-Both): each dead group's batch is computed by one live neighbour, both of the
  neighbour's batches with MeCeFO's techniques (attention's backward skipped, the FFN recomputed, low-rank FFN weight
  gradients: their cost against their FLOPs is the paper's Table 6, measured in docs/results.md); 'ndb-exact': the
  neighbour computes it exactly (two groups' work);
- 'spread', 'spread-mecefo': the dead groups' rows split across every live group, exactly or with the techniques.

A torchft loop (torchft's train_ddp.py) changes in five lines; examples/torchft_llama.py is a whole one:

    batches = StepBatches(dataset, n_replicas=N, batch_size=B, seed=0)     # any group's batch at any step
    manager = Manager(..., use_async_quorum=False)  # a synchronous quorum: the library is tested with one only
    keep = KeepBatch(manager, model, replica=R, n_replicas=N, batch_size=B, policy="mecefo", layout="llama")
    # the manager's state_dict() adds {"keep": keep.state_dict()}, its load_state_dict calls keep.load_state_dict
    while manager.current_step() < steps:
        optimizer.zero_grad()                      # torchft.Optimizer: starts the quorum
        plan = keep.plan()                         # who is down, and which batches this group computes
        keep.backward(plan, lambda piece: batches.rows(plan.step, piece), loss_of)
        loss = keep.all_reduce(plan)               # SUM, each parameter group divided by its weight
        optimizer.step()                           # torchft.Optimizer: applied unless this group saw an error

The model is not wrapped (no torchft DistributedDataParallel): the gradients are exchanged once, after every piece,
in one flat buffer per parameter dtype (not bucketed, not overlapped with the backward pass), and a step costs one
more small all-reduce (the failed set) before its forward pass. The techniques act on the model only inside
`backward`, by module name (mecefo.adapter). Only torchft's public API is used: Manager.wait_quorum, current_step,
allreduce (SUM), errored and report_error.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .adapter import Adapter, Layout
from .engine import normalise
from .neighbour import MECEFO, LowRankWgrad, Neighbour, Techniques
from .plan import NORMAL, Piece, StepPlan
from . import policies


class StepBatches:
    """Any group's batch at any step, from a map-style dataset: the samples of (step, owner, micro) are a pure
    function of (seed, step, owner, micro), so a live group can compute a dead group's batch.

    The steps read the dataset in order of position: micro-batch m of group o at step s holds positions
    g0 .. g0 + B - 1 with g0 = ((s * N + o) * A + m) * B (N groups, A micro-batches of B samples per group and step);
    position g is sample perm_e[g mod L] of a dataset of L samples, e = g div L its epoch and perm_e a permutation
    seeded by (seed, e). (mecefo.data.TokenData addresses its token windows alike, with a random offset per epoch.)"""

    def __init__(self, dataset, n_replicas: int, batch_size: int, seed: int = 0, accum: int = 1,
                 collate: Callable | None = None):
        if n_replicas < 1 or batch_size < 1 or accum < 1:
            raise ValueError(f"n_replicas={n_replicas}, batch_size={batch_size}, accum={accum}: each must be >= 1")
        if len(dataset) < 1:
            raise ValueError("the dataset is empty")
        self.dataset, self.n, self.batch, self.seed, self.accum = dataset, n_replicas, batch_size, seed, accum
        self.collate = collate or torch.utils.data.default_collate
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a micro-batch spans at most two epochs (unless the dataset is smaller)
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
        return self._orders[epoch]

    def indices(self, step: int, owner: int, micro: int = 0) -> list[int]:
        """The dataset indices of group `owner`'s micro-batch `micro` at `step`."""
        if not (0 <= owner < self.n and 0 <= micro < self.accum and step >= 0):
            raise ValueError(f"no batch at step={step} owner={owner}/{self.n} micro={micro}/{self.accum}")
        size = len(self.dataset)
        g0 = ((step * self.n + owner) * self.accum + micro) * self.batch
        return [int(self._order(g // size)[g % size]) for g in range(g0, g0 + self.batch)]

    def rows(self, step: int, piece: Piece):
        """The piece's rows of its owner's micro-batch at `step`, collated."""
        if piece.batch != self.batch:
            raise ValueError(f"a piece of {piece.batch} rows per micro-batch, these batches have {self.batch}")
        idx = self.indices(step, piece.owner, piece.micro)[piece.start:piece.stop]
        return self.collate([self.dataset[i] for i in idx])


class KeepBatch:
    """One replica group's side of a step under `policy`, on a torchft Manager: the failed set read from the quorum,
    this group's pieces computed (with the techniques where the plan says), the weighted sums exchanged.

    replica: this group's index in 0..n_replicas-1 (its data address; each live group a different one). layout: where
    the techniques act (a mecefo.adapter.LAYOUTS name, 'llama' for transformers' LlamaForCausalLM & co., or a Layout).
    techniques: what neighbours apply (MeCeFO's three by default). lowrank: the low-rank weight gradients' settings
    (rank ratio r, refresh period tau, the SVD); its state (the subspaces V1) goes in state_dict, so a group healing from
    a peer takes the subspaces its peers hold."""

    def __init__(self, manager, model: torch.nn.Module, replica: int, n_replicas: int, batch_size: int,
                 policy: str = "drop", layout: Layout | str = "llama", techniques: Techniques = MECEFO,
                 accum: int = 1, lowrank: LowRankWgrad | None = None):
        if not 0 <= replica < n_replicas:
            raise ValueError(f"replica={replica} is not in 0..{n_replicas - 1}")
        cls = policies.get(policy, trainer=True)
        if cls.rolls_back or cls.effective_failed is not policies.Policy.effective_failed:
            raise ValueError(f"policy {policy!r} needs the trainer's checkpoints or spare groups; here: "
                             + ", ".join(n for n, c in policies.registry().items() if c.trains and not c.rolls_back
                                         and c.effective_failed is policies.Policy.effective_failed))
        self.manager, self.model, self.replica, self.n = manager, model, replica, n_replicas
        self.batch, self.accum, self.policy = batch_size, accum, cls(techniques=techniques)
        self.adapter = Adapter(model, layout)
        self.lowrank = (lowrank or LowRankWgrad()).bind(model)
        self._neighbours: dict[Techniques, Neighbour] = {}
        self._sums, self.samples = [0.0, 0.0], 0

    # ------------------------------------------------------------------ the step
    def plan(self) -> StepPlan:
        """The step's plan, after the quorum: the failed set is the groups 0..N-1 not taking part in it (one SUM
        all-reduce of a one-hot vector; every group, this one included, reads the same set). A peer that failed during
        that exchange makes torchft's manager record an error: the plan is skipped (nothing computed, nothing exchanged)
        and this group's optimizer.step() does not apply the step; it is redone with the next quorum."""
        self._sums, self.samples = [0.0, 0.0], 0
        self.manager.wait_quorum()
        step = self.manager.current_step()
        onehot = torch.zeros(self.n, dtype=torch.float32, device=self._device())
        onehot[self.replica] = 1.0
        self.manager.allreduce(onehot, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return StepPlan(step, frozenset(), {}, {}, skipped=True)
        # (A group healing under an asynchronous quorum does not take part: torchft zeroes its tensor, so the plan
        # counts it as failed and it computes nothing. The library is tested with a synchronous quorum only.)
        counts = [round(float(c)) for c in onehot]
        if max(counts) > 1:
            twice = [r for r, c in enumerate(counts) if c > 1]
            error = RuntimeError(f"replica indices {twice} are held by more than one replica group in this quorum")
            self.manager.report_error(error)
            raise error
        return self.policy.plan(step, frozenset(r for r in range(self.n) if counts[r] == 0), self.n, self.accum,
                                self.batch)

    def backward(self, plan: StepPlan, rows: Callable[[Piece], Any], loss_of: Callable[[torch.nn.Module, Any], torch.Tensor]
                 ) -> float:
        """Forward and backward of this group's pieces: for each, loss_of(model, rows(piece)) (the mean loss of the
        piece's rows) under the piece's techniques, weight * its gradient accumulated into .grad (weight = the piece's
        share of a micro-batch), one piece after the other. Returns the weighted mean loss of the pieces (nan when this
        group computes nothing). At a step whose plan uses the low-rank weight gradients, every computing group first
        computes the subspaces V1 that are stale (missing, or from an earlier period of tau steps) from its current
        weights, as our engine does (mecefo.engine.StepEngine.prepare): the same V1 in every group."""
        mine = plan.pieces.get(self.replica, ())
        self.lowrank.steps = plan.step
        if mine and (plan.uses("low_rank_wgrad") or plan.uses("low_rank_head")):
            for linear in (self.adapter.ffn_linears() if plan.uses("low_rank_wgrad") else []) \
                    + ([self.adapter.head] if plan.uses("low_rank_head") else []):
                self.lowrank.basis(linear)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._device())
        for piece in mine:
            if piece.batch != self.batch:
                raise ValueError(f"a piece of {piece.batch} rows per micro-batch, KeepBatch's batch_size is {self.batch}")
            with self.adapter.neighbour(self._neighbour(piece.techniques)):
                loss = loss_of(self.model, rows(piece))
            (loss * piece.weight).backward()
            loss_sum += loss.detach().double() * piece.weight
        self.lowrank.finish()
        self._sums = [float(loss_sum), sum(p.weight for p in mine)]
        return self._sums[0] / self._sums[1] if self._sums[1] else float("nan")

    def all_reduce(self, plan: StepPlan) -> float:
        """SUM all-reduce of every group's weighted gradient sums (one flat tensor per parameter dtype, the loss and
        weight sums carried in a float32 or float64 one), then each parameter group's sum divided by its weight c_g, the
        pieces that gave it a gradient:

            grad_g = (sum over pieces p computing group g of w_p grad_g loss_p) / c_g,   c_g = sum of those w_p

        (a group no piece trains keeps no gradient and is not updated; the .grad tensors become views of the exchanged
        buffer). Returns the global batch's weighted mean loss; self.samples: the rows the exchange summed over, every
        group's (N x accum x batch_size when the global batch is whole)."""
        if plan.skipped:
            return float("nan")
        groups: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                groups.setdefault(p.dtype, []).append(p)
        sums = torch.tensor(self._sums, dtype=torch.float64, device=self._device())
        carrier = next((d for d in groups if d in (torch.float32, torch.float64)), None)  # exact enough for the sums
        for dtype, params in groups.items():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                             + ([sums.to(dtype)] if dtype == carrier else []))
            self.manager.allreduce(flat, reduce_op=torch.distributed.ReduceOp.SUM).wait()
            offset = 0
            for p in params:
                p.grad = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
            if dtype == carrier:
                sums = flat[offset:].double()
        if carrier is None:
            self.manager.allreduce(sums, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        normalise(self.model, plan.counts(len(self.adapter.blocks)), self.adapter.group_of)
        loss_sum, weight_sum = (float(v) for v in sums)
        self.samples = round(weight_sum * self.batch)
        return loss_sum / max(weight_sum, 1e-12)

    # ------------------------------------------------------------------ state a heal carries
    def state_dict(self) -> dict:
        """The techniques' state (the step count and the subspaces V1 by module name) for the manager's state_dict."""
        return self.lowrank.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.lowrank.load_state_dict(state)

    def _neighbour(self, t: Techniques) -> Neighbour | None:
        if t == NORMAL:
            return None
        return self._neighbours.setdefault(t, Neighbour(t, self.lowrank))

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device


__all__ = ["StepBatches", "KeepBatch"]
