import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo import failures
from mecefo.errors import UsageError
from mecefo.failures import SCENARIOS, Event, arrivals, export_trace, from_events, generate, read_trace


@pytest.mark.parametrize("name", ["low", "mid", "high"])
def test_expected_failed_fraction_matches_table_1(name):
    expected = {"low": 2 / 32, "mid": 3 / 32, "high": 4 / 32}[name]
    assert SCENARIOS[name].expected_failed_fraction() == pytest.approx(expected)


@pytest.mark.parametrize("name, n", [("high", 32), ("mid", 8), ("low", 4)])
def test_mean_failed_fraction_over_seeds_is_within_a_confidence_interval(name, n):
    """Little's law: the time-average fraction of failed ranks is recovery / (32 interval), whatever n."""
    fractions = [generate(SCENARIOS[name], n, 2000, 60.0, seed).fraction_failed() for seed in range(300)]
    mean, se = np.mean(fractions), np.std(fractions, ddof=1) / np.sqrt(len(fractions))
    expected = SCENARIOS[name].expected_failed_fraction()
    # the process starts with everyone alive, so the first recovery_h hours are below steady state
    horizon_h, recovery_h = 2000 * 60.0 / 3600, SCENARIOS[name].recovery_h
    expected *= 1 - recovery_h / (2 * horizon_h)
    assert abs(mean - expected) < 4 * se, (mean, expected, se)


def test_per_rank_failure_rate_is_preserved_when_n_changes():
    sc = SCENARIOS["high"]
    assert sc.expected_events(8, 10) == pytest.approx(sc.expected_events(32, 10) / 4)
    events = [generate(sc, 8, 1000, 36.0, s).failure_events() for s in range(200)]
    assert abs(np.mean(events) - sc.expected_events(8, 10)) < 4 * np.std(events) / np.sqrt(200)


def test_same_seed_same_schedule_and_fixed_recovery():
    a = generate(SCENARIOS["high"], 8, 500, 60.0, seed=3)
    b = generate(SCENARIOS["high"], 8, 500, 60.0, seed=3)
    assert a == b
    start = {}
    for e in sorted(a.events, key=lambda e: e.time_s):
        if e.kind == "remove":
            start[e.rank] = e.time_s
        else:
            assert e.time_s - start.pop(e.rank) == pytest.approx(2 * 3600)


def test_asymmetric_mode_only_fails_the_given_ranks():
    s = generate(SCENARIOS["high"], 8, 3000, 60.0, seed=0, failable=(2, 5))
    assert s.failure_events() > 0
    assert set().union(*s.failed) <= {2, 5}


def test_exponential_recovery_has_the_right_mean():
    s = [generate(SCENARIOS["mid"], 32, 5000, 60.0, seed, recovery="exponential") for seed in range(20)]
    durations = []
    for sched in s:
        start = {}
        for e in sorted(sched.events, key=lambda e: e.time_s):
            if e.kind == "remove":
                start[e.rank] = e.time_s
            else:
                durations.append((e.time_s - start.pop(e.rank)) / 3600)
    assert abs(np.mean(durations) - 3.0) < 4 * 3.0 / np.sqrt(len(durations))


def test_trace_export_and_replay_round_trip(tmp_path):
    sched = generate(SCENARIOS["high"], 6, 400, 120.0, seed=1)
    path = tmp_path / "trace.csv"
    export_trace(sched, path)
    first = path.read_text().splitlines()[0]
    assert first == "0,add,node1"
    replayed = read_trace(path, 6, 400, 120.0)
    assert replayed.failed == sched.failed


def test_replay_of_a_bamboo_style_trace(tmp_path):
    path = tmp_path / "p3.csv"
    path.write_text("0,add,node1\n0,add,node2\n0,add,node3\n60000,remove,node2\n120000,add,node2\n")
    s = read_trace(path, 3, 5, 30.0)  # (a removal of a node the trace never adds is refused: test below)
    assert [sorted(f) for f in s.failed] == [[], [], [1], [1], []]


@pytest.mark.parametrize("line, message", [
    ("0,add", "p.csv:2: expected"),
    ("abc,add,node1", "p.csv:2: time 'abc'"),
    ("100,crash,node1", "p.csv:2: expected"),
    ("-5,remove,node1", "p.csv:2: time '-5' must be a finite, non-negative"),
    ("nan,remove,node1", "p.csv:2: time 'nan' must be a finite"),
    ("100,remove,node7", "p.csv:2: removes node 'node7', which the trace never adds"),
])
def test_malformed_trace_names_the_line(tmp_path, line, message):
    path = tmp_path / "p.csv"
    path.write_text("0,add,node1\n" + line + "\n")
    with pytest.raises(UsageError, match=message):
        read_trace(path, 2, 10, 1.0)


def test_custom_scenarios_and_bad_specs():
    s = failures.resolve("custom:0.25:1", 4, 100, 600.0, 0)
    assert s.failure_events() > 0
    for bad in ("sometimes", "custom:0:1", "custom:a:b", "custom:1", "custom:nan:1", "custom:1:nan", "custom:inf:1"):
        with pytest.raises(UsageError, match="cluster.failures"):
            failures.resolve(bad, 4, 10, 1.0, 0)


def test_a_binary_trace_is_refused(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UsageError, match="is not a text CSV file"):
        read_trace(path, 2, 10, 1.0)


@pytest.mark.parametrize("spec, seconds", [("custom:1e-12:1", 1.0), ("high", 1e12)])
def test_a_schedule_too_dense_to_draw_is_refused_before_sampling(spec, seconds):
    with pytest.raises(UsageError, match="expects .* failure arrivals"):
        failures.resolve(spec, 4, 100, seconds, 0)


def test_events_at_step_boundaries():
    s = from_events(2, 4, 10.0, [Event(10.0, "remove", 1), Event(30.0, "add", 1)])
    assert [sorted(f) for f in s.failed] == [[], [1], [1], []]
    assert s.new_failures(1) == {1} and s.new_failures(2) == frozenset()


@pytest.mark.parametrize("recovery", ["fixed", "exponential"])
@pytest.mark.parametrize("name", ["low", "high"])
def test_a_stationary_start_has_table_1s_failed_fraction_from_the_first_step(name, recovery):
    """Little's law from step 0: the mean failed fraction over the first 10 steps (the first 10 minutes) is
    within 4 standard errors (over seeds) of recovery / (32 interval); a cold start has nobody down at 0."""
    sc = SCENARIOS[name]
    first = np.array([np.mean([len(f) for f in generate(sc, 32, 10, 60.0, seed, recovery, start="stationary").failed]) / 32
                      for seed in range(400)])
    se = first.std(ddof=1) / np.sqrt(len(first))
    assert abs(first.mean() - sc.expected_failed_fraction()) < 4 * se + 1e-3, (first.mean(), sc.expected_failed_fraction(), se)
    assert all(not generate(sc, 32, 10, 60.0, seed, recovery).failed[0] for seed in range(50))


def test_a_stationary_start_draws_the_residual_recovery_correctly():
    """Fixed recovery R: a rank down at step 0 comes back after a residual uniform on (0, R)."""
    sc = SCENARIOS["high"]
    residual = []
    for seed in range(300):
        s = generate(sc, 32, 10, 60.0, seed, start="stationary")
        back = {e.rank: e.time_s for e in s.events if e.kind == "add"}
        residual += [back[r] / 3600 for r in s.initially_down]
    residual = np.array(residual)
    assert len(residual) > 500 and residual.max() <= sc.recovery_h
    assert residual.mean() == pytest.approx(sc.recovery_h / 2, abs=4 * residual.std() / np.sqrt(len(residual)))


def test_a_stationary_schedule_exports_and_replays_the_same(tmp_path):
    s = generate(SCENARIOS["high"], 8, 200, 120.0, seed=1, start="stationary")
    assert s.initially_down
    export_trace(s, tmp_path / "t.csv")
    assert read_trace(tmp_path / "t.csv", 8, 200, 120.0).failed == s.failed


def _spot_trace(path):
    """Bamboo's shape: 8 nodes at 0 ms; preemptions (a burst of 3 at once), replacements under new names,
    one node back under its old name; nodes never come back under a preempted name otherwise."""
    path.write_text("\n".join([*(f"0,add,node{i}" for i in range(1, 9)),
                               "1000,remove,node2", "3000,remove,node5", "3000,remove,node6", "3000,remove,node7",
                               "5000,add,node9", "6000,add,node10", "7000,remove,node1", "8000,add,node11",
                               "9000,add,node12", "10000,add,node1", "12000,remove,node9"]) + "\n")


def _trace_fraction(path, steps, sps):
    """The trace's own down fraction per step: 1 - present / peak."""
    rows = [line.split(",") for line in path.read_text().split()]
    present, peak, out = set(), 0, []
    for t, kind, node in rows:
        (present.add if kind == "add" else present.discard)(node)
        peak = max(peak, len(present))
    for step in range(steps):
        now = set()
        for t, kind, node in rows:
            if float(t) <= step * sps * 1000:
                (now.add if kind == "add" else now.discard)(node)
        out.append(1 - len(now) / peak)
    return np.array(out)


def test_a_spot_trace_replays_as_a_pool_replacements_bring_ranks_back(tmp_path):
    path = tmp_path / "spot.csv"
    _spot_trace(path)
    s = read_trace(path, 8, 14, 1.0)
    downs = [len(f) for f in s.failed]
    assert downs == [0, 1, 1, 4, 4, 3, 2, 3, 2, 1, 0, 0, 1, 1]  # ranks come back with the replacements
    assert np.allclose(np.array(downs) / 8, _trace_fraction(path, 14, 1.0))
    assert s.failed[-1] != frozenset(range(8))


@pytest.mark.parametrize("n", [2, 4, 16, 32])
def test_a_trace_pool_of_another_size_is_scaled_to_n(tmp_path, n):
    """The down fraction is the trace's scaled to n ranks (within rounding: 1 / (2 n) per step)."""
    path = tmp_path / "spot.csv"
    _spot_trace(path)
    s = read_trace(path, n, 14, 1.0)
    ours = np.array([len(f) for f in s.failed]) / n
    assert np.all(np.abs(ours - _trace_fraction(path, 14, 1.0)) <= 1 / (2 * n) + 1e-12)
    assert any(len(a) > len(b) for a, b in zip(s.failed, s.failed[1:]))  # and some ranks do come back


def test_trace_edge_cases(tmp_path):
    path = tmp_path / "t.csv"
    # a node preempted and a replacement added in the same millisecond: the slot is held again at once
    path.write_text("0,add,a\n0,add,b\n1000,remove,a\n1000,add,c\n")
    assert [len(f) for f in read_trace(path, 2, 3, 1.0).failed] == [0, 0, 0]
    # removed at 0 ms: down from the start (initially down, not a failure event); back when re-added
    path.write_text("0,add,a\n0,add,b\n0,remove,b\n2000,add,b\n")
    s = read_trace(path, 2, 3, 1.0)
    assert s.initially_down == {1} and s.failure_events() == 0 and [len(f) for f in s.failed] == [1, 1, 0]
    # a pool smaller than n with a slot down at 0: the scaled share of ranks is down from step 0
    path.write_text("".join(f"0,add,n{i}\n" for i in range(8)) + "0,remove,n3\n5000,add,n9\n")
    s = read_trace(path, 32, 6, 1.0)
    assert len(s.failed[0]) == 4 and len(s.failed[-1]) == 0
    # a trace that adds nobody
    path.write_text("10,remove,a\n")
    with pytest.raises(UsageError, match="adds no node"):
        read_trace(path, 2, 3, 1.0)


def test_a_stationary_schedule_keeps_its_initially_down_ranks_through_export(tmp_path):
    s = generate(SCENARIOS["high"], 8, 200, 120.0, seed=1, start="stationary")
    export_trace(s, tmp_path / "t.csv")
    back = read_trace(tmp_path / "t.csv", 8, 200, 120.0)
    assert back.initially_down == s.initially_down and back.failure_events() == s.failure_events()


def test_a_warm_start_shifts_the_stationary_schedule_and_keeps_it_exportable(tmp_path):
    """failure_free_steps = k: no failure in the first k steps, then the stationary schedule's first steps,
    its initially-down ranks failing at step k; export and replay give the same failed sets."""
    base = generate(SCENARIOS["high"], 32, 120, 219.6, seed=3, start="stationary")
    assert base.initially_down  # this seed has ranks down at step 0
    warm = base.after_warm_start(40)
    assert len(warm.failed) == 120 and all(not f for f in warm.failed[:40])
    assert warm.failed[40:] == base.failed[:80]
    assert warm.new_failures(40) == base.failed[0] and not warm.initially_down
    assert base.after_warm_start(0) is base and all(not f for f in base.after_warm_start(500).failed)
    export_trace(warm, tmp_path / "warm.csv")
    assert read_trace(tmp_path / "warm.csv", 32, 120, 219.6).failed == warm.failed


def test_a_logged_replay_is_not_shifted_again_and_a_warm_start_past_the_end_leaves_no_event(tmp_path):
    import json

    path = tmp_path / "failed_steps.json"
    path.write_text(json.dumps({"n_ranks": 4, "failed": [[], [], [1], [1, 2], []]}))
    replay = failures.resolve(f"steps:{path}", 4, 5, 60.0, seed=0, failure_free_steps=2)
    assert replay.failed == (frozenset(), frozenset(), frozenset({1}), frozenset({1, 2}), frozenset())
    shifted = failures.resolve("high", 32, 50, 219.6, seed=3, start="stationary", failure_free_steps=10)
    assert shifted.failed[10:] == failures.resolve("high", 32, 50, 219.6, seed=3, start="stationary").failed[:40]
    past = generate(SCENARIOS["high"], 32, 50, 219.6, seed=3, start="stationary").after_warm_start(50)
    assert past.failure_events() == 0 and not past.events and all(not f for f in past.failed)


def naive_arrivals(pool, rng, begin, horizon, rate_per_s, draw_hours):
    """arrivals() by a scan of the pool at every arrival (an independent computation of the same draws)."""
    down_until = {r: begin - 1.0 for r in pool}
    events, t = [], begin + rng.exponential(1 / rate_per_s)
    while t < horizon:
        alive = [r for r in pool if down_until[r] <= t]
        if alive:
            rank = alive[rng.integers(len(alive))]
            down_until[rank] = t + draw_hours() * 3600.0
            events += [Event(t, "remove", rank), Event(down_until[rank], "add", rank)]
        t += rng.exponential(1 / rate_per_s)
    return events


@settings(max_examples=200, deadline=None)
@given(pool=st.lists(st.integers(0, 40), min_size=1, max_size=30), seed=st.integers(0, 2**31),
       rate_per_s=st.floats(1e-4, 1e-1), recovery_h=st.floats(1e-3, 2.0), exponential=st.booleans(),
       begin=st.sampled_from([0.0, -3600.0]))
def test_arrivals_draw_what_a_scan_of_the_pool_draws(pool, seed, rate_per_s, recovery_h, exponential, begin):
    """The same ranks at the same times as the scan, ties, duplicates in the pool and ranks back at once included."""
    def draws(rng):
        return (lambda: rng.exponential(recovery_h)) if exponential else (lambda: recovery_h)

    a, b = np.random.default_rng(seed), np.random.default_rng(seed)
    assert arrivals(tuple(pool), a, begin, 20_000.0, rate_per_s, draws(a)) == \
        naive_arrivals(tuple(pool), b, begin, 20_000.0, rate_per_s, draws(b))
