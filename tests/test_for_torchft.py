"""mecefo.for_torchft: the step-indexed batches, and a torchft loop's steps equal to our local engine's.

The in-process check runs N replica groups as threads, each with its own model, optimizer and KeepBatch, on a
stand-in for torchft's Manager that offers what the library calls (wait_quorum, current_step, allreduce with SUM,
errored, report_error); a group that comes back heals from a live one (model, optimizer and KeepBatch state, as
torchft's heal sends the manager's state_dict). The real Manager, lighthouse and processes: test_torchft_example.py.
"""

from __future__ import annotations

import copy
import threading
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mecefo.config import DataConfig
from mecefo.data import TokenData
from mecefo.engine import Batched
from mecefo.for_torchft import KeepBatch, StepBatches
from mecefo.model import GPT, preset
from mecefo.neighbour import LowRankWgrad
from mecefo.policies import plan_step


# ------------------------------------------------------------------ StepBatches
@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 40), n=st.integers(1, 4), batch=st.integers(1, 5), accum=st.integers(1, 3),
       seed=st.integers(0, 3))
def test_step_batches_read_every_sample_once_per_epoch(size, n, batch, accum, seed):
    data = StepBatches(list(range(size)), n, batch, seed, accum)
    per_step = n * accum * batch
    steps = size * per_step // np.gcd(size, per_step) // per_step  # whole epochs: lcm(size, per_step) positions
    seen = [i for s in range(steps) for o in range(n) for m in range(accum) for i in data.indices(s, o, m)]
    epochs = len(seen) // size
    for e in range(epochs):
        assert sorted(seen[e * size:(e + 1) * size]) == list(range(size))  # each epoch a permutation of the dataset
    again = StepBatches(list(range(size)), n, batch, seed, accum)  # a pure function of the address: any group's batch
    s, o, m = steps - 1, n - 1, accum - 1
    assert again.indices(s, o, m) == data.indices(s, o, m)


def test_step_batches_refuse_addresses_outside_the_run():
    data = StepBatches(list(range(10)), 2, 3)
    for bad in [(0, 2, 0), (0, 0, 1), (-1, 0, 0)]:
        with pytest.raises(ValueError, match="no batch"):
            data.indices(*bad)
    with pytest.raises(ValueError, match="must be >= 1"):
        StepBatches(list(range(10)), 0, 3)
    with pytest.raises(ValueError, match="empty"):
        StepBatches([], 2, 3)


# ------------------------------------------------------------------ a stand-in for torchft's Manager
class Quorum:
    """The live groups of one step: their SUM all-reduces meet at a barrier."""

    def __init__(self, step: int, members: list[int]):
        self.step, self.members = step, members
        # (a timeout: a group whose thread raised fails the others' wait instead of hanging the test)
        self.barrier, self.tensors, self.lock = threading.Barrier(len(members), timeout=60), {}, threading.Lock()

    def allreduce(self, who: int, t: torch.Tensor) -> None:
        with self.lock:
            self.tensors[who] = t
        self.barrier.wait()
        total = sum(self.tensors[r].clone() for r in sorted(self.tensors))
        self.barrier.wait()
        t.copy_(total)
        with self.lock:
            self.tensors.pop(who)
        self.barrier.wait()


class Manager:
    def __init__(self, replica: int):
        self.replica, self.quorum, self.error = replica, None, None

    def wait_quorum(self):
        pass

    def current_step(self) -> int:
        return self.quorum.step

    def allreduce(self, t, reduce_op=None):
        assert reduce_op == torch.distributed.ReduceOp.SUM
        self.quorum.allreduce(self.replica, t)
        return self

    def wait(self):
        return True

    def errored(self):
        return self.error

    def report_error(self, e):
        self.error = e


@pytest.fixture(scope="module")
def nano_data():
    return TokenData(DataConfig(vocab_size=512, seq_len=32, micro_batch_size=4))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(preset("nano", vocab_size=512)).double()


def _loss(model, xy):
    return model(*xy)


def _replay_local(data, policy, schedule, n, lr):
    """Our local engine (mecefo.engine.Batched: every rank in one process) on the same failed sets."""
    model = _model()
    engine = Batched(model, data, 0, torch.device("cpu"), LowRankWgrad(r=4, tau=2), nullcontext, n_ranks=n)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, failed in enumerate(schedule):
        plan = plan_step(policy, step, failed, n, 1, 4)
        engine.lowrank.steps = step
        engine.prepare(plan)
        losses.append(engine.step(plan).loss)
        optimizer.step()
    return model, losses


def _train_threads(data, policy, schedule, n, lr):
    """The library's loop, one thread per live group, heals from a live group when a group comes back."""
    groups = []
    for r in range(n):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        keep = KeepBatch(Manager(r), model, r, n, batch_size=4, policy=policy, layout="mecefo",
                         lowrank=LowRankWgrad(r=4, tau=2))
        groups.append((model, optimizer, keep))
    losses, was_live = [], set(range(n))

    def batch_of(step):
        def rows(p):
            x, y = data.micro_batch(0, step, rank=p.owner, micro=p.micro, n_ranks=n)
            return torch.as_tensor(x[p.start:p.stop]), torch.as_tensor(y[p.start:p.stop])
        return rows

    for step, failed in enumerate(schedule):
        live = [r for r in range(n) if r not in failed]
        for r in set(live) - was_live:  # a heal: the manager's state_dict of a live group
            model, optimizer, keep = groups[next(iter(was_live & set(live)))]
            groups[r][0].load_state_dict(copy.deepcopy(model.state_dict()))
            groups[r][1].load_state_dict(copy.deepcopy(optimizer.state_dict()))
            groups[r][2].load_state_dict(copy.deepcopy(keep.state_dict()))
        quorum, out = Quorum(step, live), {}

        def one(r):
            model, optimizer, keep = groups[r]
            keep.manager.quorum = quorum
            optimizer.zero_grad()
            plan = keep.plan()
            keep.backward(plan, batch_of(plan.step), _loss)
            out[r] = (plan, keep.all_reduce(plan))
            assert keep.samples == plan.samples()  # the rows every group's exchange summed over
            optimizer.step()

        threads = [threading.Thread(target=one, args=(r,)) for r in live]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(out) == set(live), "a group's step raised (see the thread's traceback above)"
        assert all(plan.failed == failed for plan, _ in out.values())
        assert len({loss for _, loss in out.values()}) == 1  # every group reads the same global loss
        losses.append(out[live[0]][1])
        was_live = set(live)
    return [g[0] for g in groups], losses, was_live


@pytest.mark.parametrize("policy", ["mecefo", "drop", "spread-mecefo", "ndb-exact"])
def test_library_steps_equal_the_local_engine(nano_data, policy):
    n, lr = 3, 1e-2
    rng = np.random.default_rng(["mecefo", "drop", "spread-mecefo", "ndb-exact"].index(policy))
    schedule = [frozenset(int(r) for r in np.flatnonzero(rng.random(n) < 0.35)) for _ in range(6)]
    schedule = [f if len(f) < n else frozenset({0}) for f in schedule]  # somebody lives at every step
    # group 1 down at step 2 (V1 of tau-epoch 1 computed there), back at step 3 as group 0's neighbour: it must use the
    # V1 its heal carried, not one of step 3's weights
    schedule[2], schedule[3] = frozenset({1}), frozenset({0})
    for s in range(1, len(schedule)):  # a group that lived through the last step lives on: someone holds the run
        last_live = set(range(n)) - schedule[s - 1]
        if last_live <= schedule[s]:
            schedule[s] = schedule[s] - {min(last_live)}
    reference, ref_losses = _replay_local(nano_data, policy, schedule, n, lr)
    models, losses, live = _train_threads(nano_data, policy, schedule, n, lr)
    # The GPT's loss is a float32 number (its logits are cast up; the engine runs every row in one pass, the library a
    # pass per piece): measured <= 1.4e-7 relative in the losses; in the float64 parameters after six steps <= 5e-12.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    with torch.no_grad():
        worst = max(float(((q - p).abs() / (p.abs() + 1e-3)).max()) for r in live
                    for p, q in zip(reference.parameters(), models[r].parameters()))
    assert worst < 1e-9, f"{policy}: parameters differ by {worst:.1e} relative"


def _steps_in_threads(keeps, step, batches):
    quorum, out = Quorum(step, list(range(len(keeps)))), {}

    def one(r):
        keeps[r].manager.quorum = quorum
        plan = keeps[r].plan()
        own = keeps[r].backward(plan, lambda p: batches.rows(step, p), _loss)
        out[r] = (own, keeps[r].all_reduce(plan), keeps[r].samples)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(keeps))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def test_bf16_parameters_exchange_the_loss_in_float64(nano_data):
    """The loss and weight sums do not go through a bf16 buffer (its step at 16 is 0.125); the gradients are exchanged
    in the parameters' dtype."""
    class Windows:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            x, y = nano_data.micro_batch(0, i, rank=0, n_ranks=1)
            return torch.as_tensor(x[0]), torch.as_tensor(y[0])

    batches = StepBatches(Windows(), 2, 4)
    keeps = [KeepBatch(Manager(r), _model().bfloat16(), r, 2, batch_size=4, policy="mecefo", layout="mecefo")
             for r in range(2)]
    out = _steps_in_threads(keeps, 0, batches)
    own = [out[r][0] for r in range(2)]
    assert out[0][1] == out[1][1] == pytest.approx(sum(own) / 2, rel=1e-12) and out[0][2] == 8
    assert all(p.grad.dtype == torch.bfloat16 for p in keeps[0].model.parameters())


def test_a_voided_exchange_plans_nothing(nano_data):
    model = _model()
    manager = Manager(0)
    keep = KeepBatch(manager, model, 0, 1, batch_size=4, policy="mecefo", layout="mecefo")
    manager.quorum, manager.error = Quorum(5, [0]), RuntimeError("a peer died")
    plan = keep.plan()
    assert plan.skipped and not plan.pieces and plan.step == 5
    assert np.isnan(keep.backward(plan, lambda p: None, _loss)) and np.isnan(keep.all_reduce(plan))
    assert all(p.grad is None for p in model.parameters())


def test_two_groups_claiming_one_index_are_refused(nano_data):
    quorum = Quorum(0, [0, 1])
    keeps = []
    for who in (0, 1):
        m = Manager(who)
        m.quorum = quorum
        keeps.append(KeepBatch(m, _model(), 1, 3, batch_size=4, layout="mecefo"))  # both say replica 1
    errors = []

    def one(k):
        try:
            k.plan()
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=one, args=(k,)) for k in keeps]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(errors) == 2 and "replica indices [1]" in errors[0]
    assert all(isinstance(k.manager.error, RuntimeError) for k in keeps)  # the step is voided everywhere


def test_policies_that_need_the_trainer_are_refused():
    with pytest.raises(ValueError, match="needs the trainer's checkpoints or spare groups"):
        KeepBatch(Manager(0), _model(), 0, 2, batch_size=4, policy="checkpoint-restart", layout="mecefo")
    with pytest.raises(ValueError, match="replica=2 is not in 0..1"):
        KeepBatch(Manager(0), _model(), 2, 2, batch_size=4, layout="mecefo")
