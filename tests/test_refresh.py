"""The V1 refresh on the torch backend (engine.TorchReplicated.prepare), shared among the ranks: three ranks run as
threads over an in-memory broadcast, against one LowRankWgrad that computes every subspace itself."""

import threading

import pytest
import torch

from mecefo.engine import TorchReplicated
from mecefo.model import GPT, ModelConfig
from mecefo.neighbour import MECEFO, LowRankWgrad
from mecefo.plan import Piece, StepPlan

CFG = ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, ffn_dim=80)
TAU = 5


class Bus:
    """torch.distributed.broadcast among threads: every rank calls it in the same order."""

    def __init__(self, n: int):
        self.barrier, self.slot, self.calls, self.reduced = threading.Barrier(n, timeout=30), None, [], []

    def rank(self, r: int):
        bus = self

        class Dist:
            @staticmethod
            def broadcast(tensor, src):
                if r == src:
                    bus.slot = tensor.clone()
                    bus.calls.append((src, tuple(tensor.shape)))
                bus.barrier.wait()
                if r != src:
                    tensor.copy_(bus.slot)
                bus.barrier.wait()

            class ReduceOp:
                MAX = "max"

            @staticmethod
            def all_reduce(tensor, op):
                bus.barrier.wait()
                bus.reduced.append(tensor.clone())
                bus.barrier.wait()
                tensor.copy_(torch.stack(bus.reduced[-len(bus.reduced):]).amax(0))
                bus.barrier.wait()
                if r == 0:
                    bus.reduced.clear()
                bus.barrier.wait()
        return Dist


def _engines(n: int, mode: str):
    bus, engines = Bus(n), []
    for r in range(n):
        torch.manual_seed(0)
        model = GPT(CFG)
        lowrank = LowRankWgrad(r=0.25, tau=TAU, svd="randomized", seed=3).bind(model)
        engine = TorchReplicated(model, None, 0, torch.device("cpu"), lowrank, n_ranks=n, rank=r, low_rank_refresh=mode)
        engine.dist = bus.rank(r)
        engines.append(engine)
    return bus, engines


def _prepare(engines, step: int, failed: frozenset, expect_errors: bool = False):
    plan = StepPlan(step, failed, {f: min(set(range(len(engines))) - failed) for f in failed},
                    {r: (Piece(r, 0, 0, 2, 2, MECEFO),) for r in range(len(engines)) if r not in failed})
    errors = []

    def run(e):
        try:
            e.lowrank.steps = step
            e.prepare(plan)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert bool(errors) == expect_errors, errors
    return errors


def _reference(step: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    lowrank = LowRankWgrad(r=0.25, tau=TAU, svd="randomized", seed=3).bind(model)
    lowrank.steps = step
    return {name: lowrank.basis(m) for m, name in ((m, lowrank._names[m]) for m in lowrank.matrices(model))}


def _held(engine) -> dict:
    return {engine.lowrank._names[m]: v for m, (v, _) in engine.lowrank._basis.items()}


@pytest.mark.parametrize("mode", ["shared", "local"])
def test_each_alive_rank_computes_its_share_and_every_rank_holds_the_same_subspaces(mode):
    bus, engines = _engines(3, mode)
    failed = frozenset({1})
    _prepare(engines, 7, failed)  # epoch 1: every matrix stale
    reference, matrices = _reference(7), 3 * CFG.n_layers
    for r, e in enumerate(engines):
        held = _held(e)
        if mode == "local" and r in failed:
            assert held == {}  # a failed rank computes nothing of its own
            continue
        assert held.keys() == reference.keys()
        assert all(torch.equal(held[k], reference[k]) for k in reference)
    counts = [e.lowrank.svd_count for e in engines]
    if mode == "shared":  # the 6 matrices once each, over the 2 alive ranks; the failed one computes none
        assert counts == [matrices // 2, 0, matrices // 2] and sum(counts) == matrices
        assert [src for src, _ in bus.calls] == [0] + [0, 2] * (matrices // 2)  # the stale flags, then each V1
    else:
        assert counts == [matrices, 0, matrices] and bus.calls == []
    # later in the same epoch (rank 1 still down and wiped, as a failed rank is): nothing is stale on the alive ranks
    engines[1].lowrank.refresh()
    _prepare(engines, 9, failed)
    assert [e.lowrank.svd_count for e in engines] == counts
    # the next epoch with every rank alive: three shares
    _prepare(engines, 10, frozenset())
    reference = _reference(10)
    for e in engines:
        assert all(torch.equal(_held(e)[k], reference[k]) for k in reference)
    if mode == "shared":
        assert [e.lowrank.svd_count - c for e, c in zip(engines, counts)] == [2, 2, 2]


def test_the_option_is_checked_and_leaves_the_config_hash_alone():
    from dataclasses import replace

    from mecefo.config import Config
    from mecefo.errors import UsageError

    cfg = Config()
    with pytest.raises(UsageError, match="cluster.low_rank_refresh='each'"):
        replace(cfg, cluster=replace(cfg.cluster, low_rank_refresh="each")).validate()
    assert replace(cfg, cluster=replace(cfg.cluster, low_rank_refresh="local")).hash() == cfg.hash()


def test_an_svd_that_fails_on_one_rank_raises_on_every_rank_at_once():
    """A refresh that raises on its owner (say, on non-finite weights) is raised by every rank, not left to the others'
    broadcast timeout."""
    _, engines = _engines(2, "shared")

    def broken(linear, whole=None):
        raise torch.linalg.LinAlgError("the SVD did not converge")

    engines[1].lowrank.basis = broken
    errors = _prepare(engines, 7, frozenset(), expect_errors=True)
    assert len(errors) == 2 and any(isinstance(e, torch.linalg.LinAlgError) for e in errors)
    assert any("another process" in str(e) for e in errors)
