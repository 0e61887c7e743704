import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo.costs import Shape, counted_flops, svd_flops
from mecefo.failures import Event, Schedule, export_trace, read_trace
from mecefo.model import preset
from mecefo.neighbour import MECEFO, LowRankWgrad, Techniques, resolve_r
from mecefo.policies import neighbour_load, simulator_policies
from mecefo.simulator import GPUS, CostModel, Job, simulate

POLICIES = simulator_policies()

JOB = Job(model="llama-350m", dp=8, pp=2, micro_batch=4, global_batch=256)
H = 6 * 3600.0


def refresh_per_step(cfg, r: float, tau: int) -> float:
    """One V1 refresh's SVD FLOPs over tau steps, the matrices enumerated from the model's own FFN linears."""
    import torch

    from mecefo.model import GPT, ffn_linears

    with torch.device("meta"):
        model = GPT(cfg)
    lr = LowRankWgrad(r=r)
    total = 0
    for m in ffn_linears(model):
        rows, cols = m.weight.shape
        w = resolve_r(r, rows, cols)
        total += svd_flops(rows, cols, w, lr.method(rows, cols, w), lr.oversample_columns(w), lr.niter)
    return total / tau


def test_step_flops_equal_torchs_flop_counter_on_the_model():
    """The simulator's FLOPs of a normal and a neighbour micro-batch against FlopCounterMode's count of the
    model itself (on the meta device), not against the closed forms the simulator uses; the neighbour's per-step share
    of a V1 refresh (SVD FLOPs / tau, an estimate: torch counts no SVD) from the model's own FFN matrices."""
    cost = CostModel(JOB)
    cfg, shape = preset(JOB.model), Shape(JOB.micro_batch, JOB.seq_len)
    assert cost.flops_normal == counted_flops(cfg, shape, Techniques())["total"]
    refresh = refresh_per_step(cfg, JOB.r, JOB.low_rank_tau)
    assert cost.flops_neighbour + cost.flops_apply - refresh == counted_flops(cfg, shape, MECEFO, JOB.r)["total"]
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
    assert out.tokens > 0 and out.events == len({e.time_s for e in scaled if e.kind == "remove"})  # a burst is one event


# ---------------------------------------------------------------- baselines' mechanisms and hypotheses
from dataclasses import replace  # noqa: E402

from mecefo.failures import SCENARIOS  # noqa: E402
from mecefo.policies.bamboo import predecessor  # noqa: E402
from mecefo.policies.oobleck import compute_time, pipelines  # noqa: E402
from mecefo.simulator import constants, cost_needed, scenario_failures, spread_bound  # noqa: E402

PURE_DP = Job(model="llama-350m", dp=8, pp=1, micro_batch=4, global_batch=256)


def test_every_constant_has_a_source_and_per_model_values_resolve():
    for name, entry in constants().items():
        assert entry["source"].strip() and "value" in entry, name
        assert hasattr(Job(), name), name  # each is a Job field (None = from the file)
    j = Job(model="llama-7b")
    assert j.const("restart_s") == constants()["restart_s"]["value"]["llama-7b"]
    assert replace(j, restart_s=1.0).const("restart_s") == 1.0  # a field overrides the file
    assert Job(model="llama-130m").const("restart_s") == constants()["restart_s"]["value"]["llama-350m"]  # nearest


def test_the_bound_and_its_inverse():
    """spread_bound at Table 1's high f: c = 1 loses exactly f; cost_needed inverts it; 4.18% needs c ~ 0.3."""
    f = 0.125
    assert spread_bound(f, 1.0) == pytest.approx(f)
    for c in (0.1, 0.5, 0.83):
        assert cost_needed(spread_bound(f, c), f) == pytest.approx(c)
    assert cost_needed(0.0418, f) == pytest.approx(0.305, abs=0.001)


@settings(max_examples=25, deadline=None)
@given(items=events_strategy)
def test_exact_spreading_at_pp1_loses_the_time_averaged_failed_fraction(items):
    """An independent computation: spread (c = 1) on a pure data-parallel job without pauses retains
    1 - (time-averaged failed fraction) of its throughput (spread_bound at c = 1), up to the partial steps lost."""
    job = replace(Job(model="llama-350m", dp=16, pp=1, micro_batch=4, global_batch=4096), reform_s=0.0)
    events = [e for e in to_events(items) if e.rank < job.gpus]
    down, t_last, area = set(), 0.0, 0.0
    for e in sorted(events, key=lambda e: e.time_s) + [Event(H, "end", -1)]:
        t = min(e.time_s, H)
        area += len(down) * (t - t_last)
        t_last = t
        if e.kind != "end" and e.time_s < H:
            (down.add if e.kind == "remove" else down.discard)(e.rank)
    f_bar = area / H / job.gpus
    base = simulate(job, "spread", [], H)
    o = simulate(job, "spread", events, H)
    step = sum(CostModel(job).base.values())
    slack = (sum(e.kind == "remove" for e in events) + 2) * 2 * step / H  # steps cut by events and the tail
    assert 1 - o.throughput / base.throughput == pytest.approx(f_bar, abs=slack + 1e-9)


def test_failure_units_fail_together_and_keep_the_failed_fraction():
    job8 = replace(PAPER_7B, failure_unit=8)
    events, down = scenario_failures(SCENARIOS["high"], job8, 48 * 3600.0, seed=3)
    removes = sorted((e.time_s, e.rank) for e in events if e.kind == "remove")
    groups = {}
    for t, u in removes:
        groups.setdefault(t, []).append(u)
    assert all(sorted(g) == list(range(g[0] // 8 * 8, g[0] // 8 * 8 + 8)) for g in groups.values())
    assert len(down) % 8 == 0
    with pytest.raises(ValueError, match="failure_unit"):
        scenario_failures(SCENARIOS["high"], replace(PAPER_7B, failure_unit=5), 3600.0, seed=0)


PAPER_7B = Job(model="llama-7b", dp=8, pp=4, micro_batch=2, global_batch=1024)


def test_oobleck_templates():
    """Pipelines keep their alive GPUs while >= n0; smaller ones are dissolved into others; the batch goes
    to whichever pipeline finishes first (failure-free: the job's own 1F1B time; pp = 1: ceil(M / d))."""
    assert pipelines(frozenset(), PAPER_7B) == (4,) * 8
    assert pipelines(frozenset({0}), PAPER_7B) == (3,) + (4,) * 7
    assert pipelines(frozenset({0, 1, 2}), PAPER_7B) == (4,) * 7  # 1 GPU left < n0 = 2: it joins... nobody below 4
    assert sorted(pipelines(frozenset({0, 1, 2, 4}), PAPER_7B)) == [4] + [4] * 6  # the lone GPU fills the 3-stage one
    m, t = PAPER_7B.micro_batches, 0.01
    assert compute_time((4,) * 8, m * 8, 4, t) == pytest.approx((m + 3) * t)
    assert compute_time((1,) * 7, 64, 1, t) == pytest.approx(math.ceil(64 / 7) * t)
    full, slower = simulate(PAPER_7B, "oobleck", [], H), simulate(PAPER_7B, "oobleck", [Event(0.0, "remove", 5)], H)
    assert slower.throughput < full.throughput * 31 / 32  # a 3-stage template is slower than a perfect rescale


def greedy_compute_time(sizes, micro_batches, pp, t_mb):
    """An independent computation of compute_time: hand out micro-batches one at a time, each to the pipeline
    that would finish it earliest, and take the last finish."""
    heap = [(t_mb * pp, 1, p) for p in sizes]
    heapq.heapify(heap)
    worst = 0.0
    for _ in range(micro_batches):
        t, m, p = heapq.heappop(heap)
        worst = max(worst, t)
        heapq.heappush(heap, ((m + p) * t_mb * pp / p, m + 1, p))
    return worst


@settings(max_examples=300, deadline=None)
@given(pp=st.integers(1, 8), data=st.data(), micro_batches=st.integers(0, 400),
       t_mb=st.floats(1e-4, 10.0, allow_nan=False))
def test_oobleck_compute_time_equals_the_greedy_assignment(pp, data, micro_batches, t_mb):
    sizes = tuple(data.draw(st.lists(st.integers(1, pp), min_size=1, max_size=40)))
    assert compute_time(sizes, micro_batches, pp, t_mb) == greedy_compute_time(sizes, micro_batches, pp, t_mb)


def test_oobleck_rejoin_at_next_failure_keeps_recovered_gpus_idle():
    events = [Event(100.0, "remove", 1), Event(1000.0, "add", 1)]
    now = simulate(PURE_DP, "oobleck", events, H)
    late = simulate(replace(PURE_DP, oobleck_rejoin="next_failure"), "oobleck", events, H)
    assert late.throughput < now.throughput
    with pytest.raises(ValueError, match="oobleck_rejoin"):
        simulate(replace(PURE_DP, oobleck_rejoin="never"), "oobleck", events, H)


def test_bamboo_runs_a_pipeline_layout_reconfigures_and_restarts_on_adjacent_failures():
    from mecefo.policies import get

    bamboo = get("bamboo")()
    assert bamboo.sim_job(PURE_DP).pp == 4 and bamboo.sim_job(PURE_DP).gpus == PURE_DP.gpus
    assert predecessor(4, PAPER_7B) == 7 and predecessor(5, PAPER_7B) == 4  # stage 0 wraps
    big = replace(Job(model="llama-350m", dp=16, pp=4, micro_batch=4, global_batch=1024), bamboo_reconfig_threshold=0.5)
    sim = {}
    assert bamboo.sim_on_failure(big, 5, frozenset(), 0.0, sim) == 0.0  # below the threshold: the predecessor covers
    assert sim["covering"] == {4}
    assert bamboo.sim_on_failure(big, 6, frozenset({5}), 1.0, sim) == big.const("bamboo_restart_s")  # next to a covered stage
    sim = {}
    assert bamboo.sim_on_failure(PAPER_7B, 5, frozenset(), 0.0, sim) == PAPER_7B.const("bamboo_reconfig_s")  # 2/31 > 0.05
    assert sim["pipelines"] == 7
    assert bamboo.sim_on_recovery(PAPER_7B, 5, frozenset(), 9.0, sim) == PAPER_7B.const("bamboo_reconfig_s")  # 8 fit again


def test_hypothesis_parameters_are_neutral_by_default_and_move_the_drop_the_right_way():
    events = [Event(100.0, "remove", 1), Event(5000.0, "add", 1)]
    drop = {}
    for label, job in {"default": PURE_DP, "slack": replace(PURE_DP, neighbour_slack=1.0),
                       "alpha": replace(PURE_DP, neighbour_alpha=1.0), "width": replace(PURE_DP, spread_width=1)}.items():
        policy = "spread-mecefo" if label == "width" else "mecefo"
        drop[label] = 1 - simulate(job, policy, events, H).throughput / simulate(job, policy, [], H).throughput
    pauses = 2 * PURE_DP.const("reform_s") / H  # what is left with the neighbour free: the two re-formations
    assert drop["slack"] == pytest.approx(drop["alpha"]) and drop["slack"] < pauses + 2e-3 < drop["default"]
    assert CostModel(replace(PURE_DP, neighbour_alpha=1.3)).alpha(1) == pytest.approx(1.3)
    assert CostModel(replace(PURE_DP, neighbour_alpha=1.3)).alpha(2) == pytest.approx(1.6)
    everyone = simulate(replace(PURE_DP, spread_width=0), "spread-mecefo", events, H).throughput
    assert simulate(replace(PURE_DP, spread_width=1), "spread-mecefo", events, H).throughput < everyone


def test_checkpoint_restart_without_failures_takes_no_checkpoints_and_pays_spare_and_restart_per_failure():
    assert simulate(PURE_DP, "checkpoint-restart", [], H).breakdown["checkpoint"] == 0
    o = simulate(PURE_DP, "checkpoint-restart", [Event(100.0, "remove", 1)], H, mtbf_s=3600.0)
    assert o.breakdown["pause"] == pytest.approx(PURE_DP.const("replacement_delay_s") + PURE_DP.const("restart_s"))


def test_hypotheses_crossing():
    from experiments.hypotheses import crossing

    assert crossing([0, 1, 2], [0.0, 0.1, 0.3], 0.2) == pytest.approx(1.5)
    assert crossing([10, 1000], [0.0, 0.2], 0.1, log=True) == pytest.approx(100)
    assert crossing([0, 1], [0.5, 0.6], 0.1) is None


def test_a_simulator_measurement_is_reused_only_when_made_by_the_same_code(tmp_path):
    from mecefo.records import atomic_write_json
    from mecefo.results import reusable, sources_digest

    path = tmp_path / "m.json"
    assert not reusable(path, sources_digest())
    atomic_write_json(path, {"sources_digest": sources_digest()})
    assert reusable(path, sources_digest())
    assert not reusable(path, "0" * 12)
    path.write_text("{broken")
    assert not reusable(path, sources_digest())


def test_simultaneous_failures_are_one_event_with_one_pause():
    """A node of 8 GPUs failing at once re-forms the communicator once (the longest pause of the group)."""
    job = replace(PURE_DP, failure_unit=8)
    node = [Event(100.0, "remove", u) for u in range(8)]
    one = [Event(100.0, "remove", 0)]
    assert simulate(job, "drop", node, H).breakdown["pause"] == pytest.approx(job.const("reform_s"))
    assert simulate(job, "drop", node, H).events == simulate(job, "drop", one, H).events == 1
