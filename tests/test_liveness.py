"""mecefo.liveness: the lighthouse's view read from its status page, a quorum's rendezvous that ends when a member is
dead instead of at the store's timeout, and a quorum wait that goes on while the cluster makes progress."""

import threading
import time
from datetime import timedelta

import pytest

from mecefo import lighthouse, liveness


def _lighthouse(heartbeat_ms: int = 300):
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=10,
                              heartbeat_timeout_ms=heartbeat_ms)
    return server, "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]


def test_the_status_page_says_who_is_dead_and_how_old_the_last_quorum_is():
    """A real lighthouse (torchft 0.2.0): a replica forms a quorum at step 7, a second one heartbeats once and then is
    silent, and is counted dead after the heartbeat timeout; the quorum's age and step are read."""
    from torchft.coordination import LighthouseClient

    server, address = _lighthouse()
    try:
        assert liveness.read_status(address).max_step is None  # no quorum yet
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        client.quorum("mecefo_0:id0", timeout=timedelta(seconds=5), address="a0", store_address="s:0", step=7,
                      world_size=1, shrink_only=False)
        client.heartbeat("mecefo_1:id1")
        status = liveness.read_status(address)
        assert set(status.heartbeats) == {"mecefo_0:id0", "mecefo_1:id1"} and not status.dead
        assert status.max_step == 7 and status.quorum_id >= 1 and 0 <= status.quorum_age_s < 5
        for _ in range(6):  # replica 0 heartbeats, replica 1 is silent for longer than the 300 ms timeout
            client.heartbeat("mecefo_0:id0")
            time.sleep(0.1)
        status = liveness.read_status(address)
        assert status.dead == {"mecefo_1:id1"} and status.heartbeats["mecefo_1:id1"] > 0.3
    finally:
        server.shutdown()
    time.sleep(0.2)
    assert liveness.read_status(address) is None  # down: unreachable, not an error


def test_parse_status_on_a_page_without_a_quorum_or_heartbeats():
    status = lighthouse.parse_status("Current quorum_id: 0 <br>\nNext quorum status: waiting\n<h2>Heartbeats</h2><ul></ul>")
    assert status == liveness.Status({}, frozenset(), 0, None, None)


class _Watch:
    """Reports `member` dead from `after` seconds on (a stand-in for the lighthouse's view)."""

    def __init__(self, member: str | None, after: float):
        self.member, self.until = member, time.monotonic() + after

    def check(self):
        if self.member is not None and time.monotonic() > self.until:
            raise liveness.PeerGone(f"quorum member {self.member} died")


def _store():
    from mecefo.processes import group_store

    return group_store("127.0.0.1", "127.0.0.1")


def test_a_member_that_never_arrives_ends_the_rendezvous_as_soon_as_it_is_known_dead():
    store = _store()
    t0 = time.monotonic()
    with pytest.raises(liveness.PeerGone, match="mecefo_1"):
        liveness.arrive(f"127.0.0.1:{store.port}/q1", 0, 2, _Watch("mecefo_1", 0.3), timeout_s=30)
    assert time.monotonic() - t0 < 5  # not the store's 30 s


def test_every_member_arriving_completes_the_rendezvous_and_nobody_known_dead_waits_to_the_timeout():
    store = _store()
    address = f"127.0.0.1:{store.port}/q2"
    other = threading.Thread(target=liveness.arrive, args=(address, 1, 2, _Watch(None, 0), 10))
    other.start()
    liveness.arrive(address, 0, 2, _Watch(None, 0), timeout_s=10)
    other.join()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="not every member"):
        liveness.arrive(f"127.0.0.1:{store.port}/q3", 0, 2, _Watch(None, 0), timeout_s=0.5)
    assert time.monotonic() - t0 < 5


def test_a_dead_store_host_ends_the_rendezvous_when_the_host_is_known_dead():
    """The quorum's store is its first member's: killed, its port refuses; the wait ends with the member's death."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(liveness.PeerGone):
        liveness.arrive(f"127.0.0.1:{dead}/q", 1, 2, _Watch("mecefo_0", 0.5), timeout_s=30)
    assert time.monotonic() - t0 < 10


class _Manager:
    """start_quorum fails (a timeout, after `delay` s) `fails` times, then succeeds."""

    def __init__(self, fails: int, delay: float = 0.0):
        self.fails, self.delay, self.calls, self._quorum_future = fails, delay, 0, None

    def start_quorum(self, timeout):
        import concurrent.futures

        self.calls += 1
        if self.calls <= self.fails:
            time.sleep(self.delay)
            self._quorum_future = concurrent.futures.Future()  # torchft's: the quorum's own failure
            self._quorum_future.set_exception(TimeoutError("Timeout expired"))
            raise TimeoutError("Timeout expired")


def test_a_quorum_wait_goes_on_while_quorums_form_and_ends_when_the_lighthouse_is_silent(monkeypatch):
    monkeypatch.setattr(liveness, "RETRY_GRACE_S", 0.0)
    recent = liveness.Status({}, frozenset(), 3, 0.05, 10)  # a quorum formed 50 ms ago: the others make progress
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: recent)
    manager = _Manager(fails=5, delay=0.1)
    liveness.wait_for_quorum(manager, "http://lighthouse", stall_s=0.2, try_s=1)  # 0.5 s of failed tries > stall_s
    assert manager.calls == 6 and manager._quorum_future is None  # torchft would re-raise a failed quorum's future
    stale = liveness.Status({}, frozenset(), 3, 60.0, 10)
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: stale)
    with pytest.raises(TimeoutError, match="formed no quorum for 0.2 s"):
        liveness.wait_for_quorum(_Manager(fails=10**9), "http://lighthouse", stall_s=0.2, try_s=1)
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: None)
    with pytest.raises(TimeoutError, match="did not answer for 0.2 s"):
        liveness.wait_for_quorum(_Manager(fails=10**9), "http://lighthouse", stall_s=0.2, try_s=1)


def test_a_rendezvous_its_peers_have_left_ends_when_the_lighthouse_forms_a_newer_quorum(monkeypatch):
    """A member stalled while its quorum met wakes up alone at the store: the lighthouse's current quorum is another one
    (its peers went on without it), so it stops waiting instead of sitting out the store's timeout."""
    store = _store()
    newer = liveness.Status({"mecefo_0:a": 0.1, "mecefo_1:b": 0.1}, frozenset(), 8, 0.2, 5)
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: newer)
    watch = liveness.Watch("http://lighthouse", ["mecefo_0:a", "mecefo_1:b"], quorum_id=7)
    t0 = time.monotonic()
    with pytest.raises(liveness.PeerGone, match="quorum 7 was superseded by quorum 8"):
        liveness.arrive(f"127.0.0.1:{store.port}/q7", 0, 2, watch, timeout_s=30)
    assert time.monotonic() - t0 < 5
    liveness.Watch("http://lighthouse", ["mecefo_0:a"], quorum_id=8).check()  # its own quorum: nothing to say


def test_the_arrival_checked_gloo_group_connects_its_members_and_keeps_the_long_timeout_for_collectives():
    """Two members configure a quorum's group through the arrival check: gloo is built under RENDEZVOUS_S, and its
    collectives then run under the group's own (long) timeout; an all-reduce sums across both."""
    import torch

    store = _store()
    groups = [liveness.process_group("cpu", timedelta(seconds=30)) for _ in range(2)]
    for g in groups:
        g.lighthouse = "http://127.0.0.1:9"  # unreachable: tells nothing, nobody is declared dead

    def configure(i):
        groups[i].configure(f"127.0.0.1:{store.port}/torchft/1/0", f"mecefo_{i}", i, 2, 1, 0, 1, [0, 1])

    threads = [threading.Thread(target=configure, args=(i,)) for i in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for g in groups:
        assert g._timeout == timedelta(seconds=30)
        assert g._pg._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=30)
    tensors = [torch.tensor([1.0 + i]) for i in (0, 1)]
    from torch.distributed import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    works = [g.allreduce([t], opts) for g, t in zip(groups, tensors)]
    [w.wait() for w in works]
    assert [t.item() for t in tensors] == [3.0, 3.0]


def test_a_lighthouse_back_without_a_quorum_is_waited_for_stall_s_from_its_return(monkeypatch):
    """The lighthouse does not answer for about 0.35 s, then answers restarted, with no quorum yet; the quorum comes
    0.3 s later: 0.65 s of waiting in all, more than stall_s (0.5 s), but never 0.5 s without an answer, nor 0.5 s
    since its return."""
    monkeypatch.setattr(liveness, "RETRY_GRACE_S", 0.0)
    answers = iter([None] * 35 + [liveness.Status({}, frozenset(), 0, None, None)] * 10**6)
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: next(answers))
    manager = _Manager(fails=65, delay=0.01)
    liveness.wait_for_quorum(manager, "http://lighthouse", stall_s=0.5, try_s=1)
    assert manager.calls == 66


def test_an_error_while_applying_a_heal_is_raised_not_retried(monkeypatch):
    """The quorum succeeded but loading the state it brought failed (e.g. a group of another size): start_quorum raises
    with a successful future, and the wait does not treat it as a failed quorum to retry."""
    import concurrent.futures

    class Healing(_Manager):
        def start_quorum(self, timeout):
            self.calls += 1
            self._quorum_future = concurrent.futures.Future()
            self._quorum_future.set_result(None)
            raise RuntimeError("a live group of 2 processes cannot heal a group of 1")

    monkeypatch.setattr(liveness, "RETRY_GRACE_S", 0.0)
    manager = Healing(0)
    with pytest.raises(RuntimeError, match="cannot heal"):
        liveness.wait_for_quorum(manager, "http://lighthouse", stall_s=10, try_s=1)
    assert manager.calls == 1


def test_a_restarted_lighthouse_is_given_time_to_hear_from_the_last_quorum_before_a_quorum_is_asked(monkeypatch, capsys):
    """A lighthouse restarted while this replica was stalled knows only who heartbeated since: the replica waits until
    it has heard from every member of its last quorum (a member's later process, with a new uuid, counts: the old one
    is dead) before it asks for a quorum, and not longer than the grace; a lighthouse that formed the last quorum (it
    knows its members, alive or dead) costs one read. Only a replica whose last quorum is older than CHECK_AFTER_S, or
    whose last try failed, looks."""
    members = ["mecefo_0:a", "mecefo_1:b", "mecefo_2:c"]
    fresh = liveness.Status({"mecefo_0:a": 0.0}, frozenset(), 0, None, None)
    later = liveness.Status({"mecefo_0:a": 0.0, "mecefo_1:b": 0.1, "mecefo_2:d": 0.0}, frozenset(), 0, None, None)
    assert liveness.unknown_members(fresh, members) == ["mecefo_1:b", "mecefo_2:c"]
    assert liveness.unknown_members(later, members) == []  # mecefo_2's new process stands for its dead one
    answers = iter([fresh] * 5 + [later] * 10**6)
    monkeypatch.setattr(liveness, "STATUS_EVERY_S", 0.01)
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: next(answers))
    assert liveness.await_members("http://lighthouse", members) == []
    assert next(answers) is later  # it read until the members appeared, and no further
    assert "heard nothing of mecefo_1, mecefo_2 (of the last quorum)" in capsys.readouterr().out
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: fresh)
    t0 = time.monotonic()
    assert liveness.await_members("http://lighthouse", members, grace_s=0.2) == ["mecefo_1:b", "mecefo_2:c"]
    assert 0.2 <= time.monotonic() - t0 < 2 and "never heard: mecefo_1, mecefo_2" in capsys.readouterr().out

    class Recorder:
        last, at = type("Result", (), {"replica_ids": members})(), time.monotonic()

    reads = []
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: reads.append(1) or later)
    monkeypatch.setattr(liveness, "RETRY_GRACE_S", 0.0)
    liveness.wait_for_quorum(_Manager(0), "http://lighthouse", stall_s=10, try_s=1, recorder=Recorder)
    assert reads == []  # a recent quorum: straight to the next
    liveness.wait_for_quorum(_Manager(1), "http://lighthouse", stall_s=10, try_s=1, recorder=Recorder)
    assert len(reads) == 2  # the failed try's own read, then the members' before the retry
    Recorder.at -= 2 * liveness.CHECK_AFTER_S
    liveness.wait_for_quorum(_Manager(0), "http://lighthouse", stall_s=10, try_s=1, recorder=Recorder)
    assert len(reads) == 3


def test_a_lone_quorum_from_a_restarted_lighthouse_without_members_of_the_last_one_is_refused_once():
    """Quorum ids count from 1 again at a restarted lighthouse: a quorum with a lower id than the last, holding this
    replica alone where the last had others, fails once (the wait then gives the lighthouse time to hear from them);
    the next one is taken as it is, and so is one with other members (they would wait for a refusing member), one with
    every member, or one from the same lighthouse (a higher id)."""
    Result = type("Result", (), {})

    def result(qid, ids):
        r = Result()
        r.quorum_id, r.replica_ids = qid, ids
        return r

    class Client:
        def __init__(self, results):
            self.results = iter(results)

        def _quorum(self):
            return next(self.results)

    everyone, alone = ["mecefo_0:a", "mecefo_1:b", "mecefo_2:c"], ["mecefo_0:a"]
    recorder = liveness.QuorumRecorder(Client([result(40, everyone), result(1, alone), result(2, alone), result(3, alone)]))
    assert recorder._quorum().quorum_id == 40
    with pytest.raises(RuntimeError, match="quorum 1 from a restarted lighthouse .* alone, without mecefo_1, mecefo_2 of"):
        recorder._quorum()
    assert recorder.last.quorum_id == 40  # the refused one is not the last
    assert recorder._quorum().quorum_id == 2 and recorder._quorum().quorum_id == 3  # refused once only
    taken = [result(40, everyone), result(1, everyone), result(2, everyone[:2]), result(3, alone), result(50, alone)]
    whole = liveness.QuorumRecorder(Client(taken))
    assert [whole._quorum().quorum_id for _ in range(5)] == [40, 1, 2, 3, 50]  # 1: everyone; then ids go up
    known = liveness.QuorumRecorder(Client([result(40, everyone), result(1, alone)]))
    known.gone = lambda members: {"mecefo_1:b", "mecefo_2:c"} & set(members)  # the launcher marked them down
    assert [known._quorum().quorum_id for _ in range(2)] == [40, 1]  # nobody to wait for: taken


def test_a_quorum_that_repeats_the_id_of_this_replicas_group_gets_a_new_group_where_every_member_would_decide_so():
    """A restarted lighthouse counts quorum ids from 1 again, and torchft builds a new process group only when the id
    changes. A replica stalled across the restart holds the old lighthouse's group 3 when the new one's quorum 3 (the
    same members) brings it back behind its peers: it must build the new group its peers wait for at the store (it
    healed through the old one and left them waiting 30 s). Decided from the quorum alone, as every member does: a
    member behind (a heal), or other members than the group's. A steady quorum (the same id, members, nobody behind)
    keeps its group."""
    Result = type("Result", (), {})

    def result(qid, ids, at_max):
        r = Result()
        r.quorum_id, r.replica_ids, r.max_world_size, r.replica_world_size = qid, ids, at_max, len(ids)
        return r

    class Client:
        def __init__(self, results):
            self.results = iter(results)

        def _quorum(self):
            return next(self.results)

    class Manager:
        _quorum_id = 3

    everyone = ["mecefo_0:a", "mecefo_1:b", "mecefo_2:c"]
    recorder = liveness.QuorumRecorder(Client([result(3, everyone, 3), result(3, everyone, 2), result(3, everyone[:2], 2),
                                               result(4, everyone, 2)]), manager=Manager())
    recorder.configured = sorted(everyone)
    recorder._quorum()
    assert recorder.manager._quorum_id == 3  # steady: the group is kept
    recorder._quorum()
    assert recorder.manager._quorum_id == -1  # a member behind: a new group (torchft compares -1 with 3)
    recorder.manager._quorum_id = 3
    recorder._quorum()
    assert recorder.manager._quorum_id == -1  # other members
    recorder.manager._quorum_id = 3
    recorder._quorum()
    assert recorder.manager._quorum_id == 3  # a new id: torchft builds a new group by itself


def test_a_quorum_try_that_failed_in_another_process_of_the_group_is_tried_again_here(monkeypatch):
    """A group's processes agree on each try: this one's succeeded, another's failed (its part of the process group
    could not be configured), so this one asks again instead of going on to wait for it in the group's collectives;
    the next try succeeds everywhere."""
    monkeypatch.setattr(liveness, "RETRY_GRACE_S", 0.0)
    recent = liveness.Status({}, frozenset(), 3, 0.05, 10)
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: recent)
    votes, answers = [], iter([False, True])

    def agree(ok):
        votes.append(ok)
        return next(answers)

    manager = _Manager(fails=0)
    liveness.wait_for_quorum(manager, "http://lighthouse", stall_s=5, try_s=1, agree=agree)
    assert manager.calls == 2 and votes == [True, True]
    failing = _Manager(fails=1)  # and a try that failed here is voted down by this process
    liveness.wait_for_quorum(failing, "http://lighthouse", stall_s=5, try_s=1, agree=lambda ok: ok)
    assert failing.calls == 2


def test_members_the_runs_files_say_hold_no_state_are_not_waited_for(tmp_path, monkeypatch):
    """A lone survivor whose peers died as the lighthouse restarted: rank 1's file says "down" (the launcher saw it
    die), rank 2's that its next process is starting; rank 3 last said it trained a step (stalled, or alive behind a
    slow reconnect) and is waited for; this replica's own rank is never judged by its file."""
    from mecefo.ft import FtMembership, ReplicaFiles

    (tmp_path / "replicas").mkdir()
    (tmp_path / "replicas" / "rank1.status").write_text("down 1.0\n")
    (tmp_path / "replicas" / "rank2.status").write_text("starting 1.0\n")
    (tmp_path / "replicas" / "rank3.status").write_text("step 12 1.0\n")
    (tmp_path / "replicas" / "rank0.status").write_text("down 1.0\n")
    files = ReplicaFiles.__new__(ReplicaFiles)
    files.out = tmp_path
    replica = type("Replica", (), {"replica_files": files, "rank": 0})()
    members = ["mecefo_0:a", "mecefo_1:b", "mecefo_2:c", "mecefo_3:d", "mecefo_4:e"]  # (rank 4: no file yet)
    gone = FtMembership.members_gone(replica, members)
    assert gone == {"mecefo_1:b", "mecefo_2:c"}
    fresh = liveness.Status({"mecefo_0:a": 0.0}, frozenset(), 0, None, None)
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: fresh)
    monkeypatch.setattr(liveness, "STATUS_EVERY_S", 0.01)
    t0 = time.monotonic()
    assert liveness.await_members("http://lighthouse", members[:3], grace_s=5, gone=lambda m: gone & set(m)) == []
    assert time.monotonic() - t0 < 1  # not the grace
    assert liveness.await_members("http://lighthouse", members[:4], grace_s=0.2,
                                  gone=lambda m: gone & set(m)) == ["mecefo_3:d"]
    looks = []  # rank 3 dies while the replica waits: its file says so after the third look; the next ends the wait
    monkeypatch.setattr(liveness, "read_status", lambda address, timeout_s=1.0: looks.append(1) or fresh)
    t0 = time.monotonic()
    assert liveness.await_members("http://lighthouse", members[:4], grace_s=5, gone=lambda m: (
        gone | ({"mecefo_3:d"} if len(looks) >= 3 else set())) & set(m)) == []
    assert time.monotonic() - t0 < 1 and len(looks) == 4  # the look after its death, not the grace
