import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo.costs import Shape, analytic_flops
from mecefo.failures import Event, Schedule, export_trace, read_trace
from mecefo.model import preset
from mecefo.neighbour import MECEFO, Techniques
from mecefo.policies import neighbour_load, simulator_policies
from mecefo.simulator import GPUS, CostModel, Job, simulate

POLICIES = simulator_policies()

JOB = Job(model="llama-350m", dp=8, pp=2, micro_batch=4, global_batch=256)
H = 6 * 3600.0


def test_step_flops_equal_costs_counts():
    cost = CostModel(JOB)
    cfg, shape = preset(JOB.model), Shape(JOB.micro_batch, JOB.seq_len)
    assert cost.flops_normal == analytic_flops(cfg, shape, Techniques())["total"]
    nb = analytic_flops(cfg, shape, MECEFO, JOB.r)
    assert cost.flops_neighbour + cost.flops_apply == nb["total"]
    assert cost.t_mb * GPUS[JOB.gpu]["peak_flops"] * JOB.mfu * JOB.pp == pytest.approx(cost.flops_normal)


def test_without_failures_every_policy_runs_at_its_failure_free_speed_minus_its_steady_overhead():
    cost = CostModel(JOB)
    step = sum(cost.base.values())
    expected = math.floor(H / step) * JOB.tokens_per_step / H
    out = {p: simulate(JOB, p, [], H, mtbf_s=3600.0) for p in POLICIES}
    for p in ("mecefo", "ndb-exact", "spread", "spread-mecefo", "drop", "oobleck"):
        assert out[p].throughput == pytest.approx(expected, rel=1e-12), p
    assert out["bamboo"].throughput < expected and out["bamboo"].breakdown["redundant"] > 0
    assert out["checkpoint-restart"].throughput < expected and out["checkpoint-restart"].breakdown["checkpoint"] > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_breakdown_sums_to_wall_time(policy):
    events = [Event(1000.0, "remove", 3), Event(4000.0, "remove", 9), Event(9000.0, "add", 3)]
    o = simulate(JOB, policy, events, H, mtbf_s=3600.0)
    assert sum(o.breakdown.values()) == pytest.approx(o.wall_s, rel=1e-9)
    assert all(v >= -1e-6 for v in o.breakdown.values())


events_strategy = st.lists(st.tuples(st.floats(0, H * 0.9), st.floats(60, 4 * 3600), st.integers(0, JOB.gpus - 1)),
                           max_size=6)


def to_events(items):
    out = []
    for t, dur, unit in items:
        out += [Event(t, "remove", unit), Event(t + dur, "add", unit)]
    return out


@settings(max_examples=40, deadline=None)
@given(items=events_strategy, extra=st.tuples(st.floats(0, H * 0.9), st.floats(60, 4 * 3600), st.integers(0, JOB.gpus - 1)),
       policy=st.sampled_from(POLICIES))
def test_more_failures_never_raise_throughput(items, extra, policy):
    base = to_events(items)
    # a unit is down at most once at a time: drop an extra failure that overlaps the same unit's
    if any(u == extra[2] and not (extra[0] + extra[1] < t or t + d < extra[0]) for t, d, u in items):
        return
    fewer = simulate(JOB, policy, base, H, mtbf_s=3600.0).throughput
    more = simulate(JOB, policy, base + to_events([extra]), H, mtbf_s=3600.0).throughput
    assert more <= fewer * (1 + 1e-9)


def test_trace_replay_is_deterministic(tmp_path):
    events = [Event(1234.5, "remove", 2), Event(5000.0, "remove", 7), Event(8000.25, "add", 2)]
    path = tmp_path / "trace.csv"
    export_trace(Schedule(JOB.gpus, (), tuple(events), 1.0), path)
    replayed = list(read_trace(path, JOB.gpus, 1, 1.0).events)
    a = simulate(JOB, "mecefo", replayed, H)
    b = simulate(JOB, "mecefo", replayed, H)
    assert a.throughput == b.throughput
    assert a.throughput == pytest.approx(simulate(JOB, "mecefo", events, H).throughput, rel=1e-6)


def test_simultaneous_failures_and_a_neighbour_failing_while_covering():
    pp1 = Job(model="llama-350m", dp=8, pp=1, micro_batch=4, global_batch=256)
    cost = CostModel(pp1)
    assert neighbour_load(frozenset({1}), pp1) == 1
    assert neighbour_load(frozenset({1, 2}), pp1) == 1  # 2 covered 1, then fails: someone else takes both
    assert neighbour_load(frozenset(range(6)), pp1) == 3  # 6 failed over 2 alive peers
    assert neighbour_load(frozenset(range(8)), pp1) == 8  # nobody left
    events = [Event(100.0, "remove", 1), Event(100.0, "remove", 5), Event(500.0, "remove", 2)]
    o = simulate(pp1, "mecefo", events, 3600.0)
    assert 0 < o.throughput < simulate(pp1, "mecefo", [], 3600.0).throughput
    assert cost.alpha(2) > cost.alpha(1) > 1
    everyone = [Event(10.0, "remove", u) for u in range(8)]
    assert simulate(pp1, "mecefo", everyone, 3600.0).tokens < simulate(pp1, "mecefo", [], 3600.0).tokens / 100


def test_drop_loses_the_failed_replicas_samples():
    events = [Event(0.0, "remove", 3)]
    o = simulate(JOB, "drop", events, H)
    base = simulate(JOB, "drop", [], H)
    # pp = 2: GPU 3 is replica 1's second stage, so replica 1 of 8 drops its samples
    assert o.tokens / base.tokens == pytest.approx(7 / 8, rel=0.01)


def test_bad_policy():
    with pytest.raises(ValueError, match="policy"):
        simulate(JOB, "hope", [], H)


def test_a_spot_trace_replays_in_the_simulator_with_gpus_coming_back(tmp_path):
    """The reader the trainer uses: preempted nodes never return, replacements do, so GPUs come back."""
    from tests.test_failures import _spot_trace

    path = tmp_path / "spot.csv"
    _spot_trace(path)
    s = read_trace(path, JOB.gpus, 1, 1.0)
    down = set(s.initially_down)
    peak = 0
    for e in sorted(s.events, key=lambda e: e.time_s):
        (down.add if e.kind == "remove" else down.discard)(e.rank)
        peak = max(peak, len(down))
    assert peak == 8 and len(down) == 2  # 4 of 8 trace nodes down at worst; 1 of 8 at the end, scaled to 16
    scaled = [Event(e.time_s * 600, e.kind, e.rank) for e in s.events]  # seconds -> 10-minute ticks
    out = simulate(JOB, "mecefo", scaled, 14 * 600.0, initially_down=s.initially_down)
    assert out.tokens > 0 and out.events == sum(e.kind == "remove" for e in scaled)
