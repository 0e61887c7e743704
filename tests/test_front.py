"""mecefo.ft's rule for a replica behind the run (keep_to_the_front): it trains only at the run's front, heals from a
live peer ahead, stops without training behind a finished run, and never trains on behind replicas that died ahead
of it but for the one step a lone commit can leave. The torchft Manager and the run's files are stand-ins here; the
slow tests in test_ft_faults.py run the real thing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo import ft, liveness
from mecefo.errors import TrainingStopped
from mecefo.membership import LeftBehind


@settings(max_examples=300, deadline=None)
@given(step=st.integers(0, 200), ahead=st.integers(-5, 100), finished=st.booleans(), live=st.booleans())
def test_the_verdict_never_trains_behind_the_run_but_for_one_step_left_by_the_dead(step, ahead, finished, live):
    furthest = max(0, step + ahead)
    what = ft.front_verdict(step, furthest, finished, live)
    if finished:
        assert what == "left"
    elif furthest <= step:
        assert what == "train"
    elif live:
        assert what == "heal"  # a live peer ahead: never train, heal from it
    else:
        assert what == ("train" if furthest == step + 1 else "wait")


class Manager:
    def __init__(self, step):
        self.step, self.voids = step, 0

    def current_step(self):
        return self.step

    def report_error(self, e):
        self.voids += 1

    def should_commit(self):
        return False


class Files:
    def __init__(self, views):
        self.views, self.statuses, self.reads = list(views), [], 0

    def front(self, n):
        self.reads += 1
        return self.views[min(self.reads, len(self.views)) - 1]

    def status(self, what):
        self.statuses.append(what)


def _replica(step, views, live=True, heal_to=None):
    replica = ft.FtMembership.__new__(ft.FtMembership)
    replica.rank, replica.n_ranks, replica.sharded, replica.lighthouse = 1, 4, False, "http://lighthouse"
    replica.manager, replica.replica_files = Manager(step), Files(views)
    replica._alive = lambda ranks: live
    replica.quorums = 0

    def quorum():
        replica.quorums += 1
        if heal_to is not None:
            replica.manager.step = heal_to

    replica._quorum = quorum
    return replica


def test_at_the_front_nothing_is_voided_and_without_cause_nothing_is_read():
    r = _replica(25, [(25, False, {0: 25})])
    r.keep_to_the_front(100)
    assert (r.manager.voids, r.quorums) == (0, 0)
    r = _replica(25, [(60, False, {0: 60})])
    r.keep_to_the_front(100, check=False)
    assert r.replica_files.reads == 0


def test_behind_a_live_peer_the_step_is_voided_until_a_quorum_heals_it(monkeypatch):
    monkeypatch.setattr(ft.time, "sleep", lambda s: None)
    r = _replica(25, [(60, False, {0: 60}), (60, False, {0: 60})], live=True, heal_to=60)
    r.keep_to_the_front(100)
    assert (r.manager.voids, r.quorums, r.manager.step) == (1, 1, 60)
    assert r.replica_files.statuses == ["behind 25", "step 60"]  # (not left 'behind': peers would not wait for it)


def test_behind_a_finished_run_it_stops_without_training():
    r = _replica(25, [(100, True, {})])
    with pytest.raises(LeftBehind) as e:
        r.keep_to_the_front(100)
    assert (e.value.step, e.value.front, r.manager.voids) == (25, 100, 0)


def test_one_step_behind_a_replica_that_died_it_redoes_the_step():
    r = _replica(25, [(26, False, {})], live=False)
    r.keep_to_the_front(100)
    assert r.manager.voids == 0


def test_behind_replicas_that_died_further_ahead_it_waits_the_grace_then_stops(monkeypatch):
    monkeypatch.setattr(ft.time, "sleep", lambda s: None)
    clock = iter(range(0, 1000, 3))  # each look: 3 s more of waking time
    monkeypatch.setattr(liveness.time, "monotonic", lambda: float(next(clock)))
    r = _replica(25, [(60, False, {})], live=False)
    with pytest.raises(TrainingStopped, match="no replica ahead of it is alive to heal from"):
        r.keep_to_the_front(100)
    assert r.quorums >= 1 and r.manager.voids == r.quorums


def test_a_process_stopped_for_longer_than_a_deadline_is_not_timed_out_by_the_stop(monkeypatch):
    """liveness.Awake: a look that comes long after the last (the process was stopped) adds cap_s at most."""
    times = iter([0.0, 1.0, 500.0, 501.0])
    monkeypatch.setattr(liveness.time, "monotonic", lambda: next(times))
    awake = liveness.Awake(cap_s=5.0)
    assert [awake(), awake(), awake()] == [1.0, 6.0, 7.0]
