"""Telling "the cluster is gone" from "the cluster is recovering" on the torchft backend.

torchft's lighthouse knows who is alive: every replica's manager heartbeats to it, and it counts a replica
dead once its last heartbeat is older than its heartbeat timeout (0.5 s under mecefo.launch, MECEFO_FT_HEARTBEAT_MS). The lighthouse
publishes that view on its status page, with the age of the last quorum it formed. This module reads it, and
uses it where a torchft wait would otherwise run to a fixed timeout:

- the rendezvous of a new quorum's process group (`ArrivalCheckedGloo`, `ArrivalCheckedNCCL`): torchft's
  process group waits for every member at the quorum's TCPStore for its whole timeout (30 s), so a member
  killed just after the quorum formed (two ranks killed at one step; the rank whose store the quorum uses)
  held every survivor for 30 s. Here every member first marks its arrival at the store, and the wait ends,
  as a failed reconfiguration (the step is void and redone with the next quorum), as soon as the
  lighthouse counts a member dead, or has formed a newer quorum (a member stalled while the others met
  wakes in a rendezvous they have left);
- the quorum itself (`wait_for_quorum`): a replica waits as long as the cluster makes progress (the
  lighthouse formed a quorum within MECEFO_FT_STALL_S) and the lighthouse answers (a restarted lighthouse
  included), instead of stopping at a fixed timeout while the others are recovering;
- a restarted lighthouse (`await_members`): it knows only the replicas that heartbeat to it since it started,
  and torchft's managers reconnect their heartbeat with a backoff of up to 10 s, so its split-brain guard (more
  than half of the heartbeating replicas) can pass with one replica alone. A replica stalled while its peers
  went on, and woken first, would then train a second history from a step they passed (chaos seed 13). Before
  a quorum, a replica that may have fallen behind (its last quorum is older than CHECK_AFTER_S, or its last try
  failed) waits until the lighthouse knows every member of its last quorum, or REJOIN_GRACE_S.

The process group's store prefix is also made unique per quorum (its id, step and members): a restarted
lighthouse counts quorum ids from 1 again, and a store that served an earlier quorum of the same id still
holds its keys.
"""

from __future__ import annotations

import time
from datetime import timedelta

from . import torchft_private as private
from .lighthouse import Status, read_status  # noqa: F401 (Status: the view read_status returns)
from .records import stable_hash

POLL_S = 0.005  # between checks of the store for the members' arrival
STATUS_EVERY_S = 0.1  # between reads of the lighthouse's status page while waiting
# After a failed quorum try, wait this long before the next: a lighthouse that was down and is back must hear every
# live replica's heartbeat (every 100 ms) before a quorum forms, or its split-brain guard (more than half of the
# replicas heartbeating) could pass with the first replica alone, at a step the others have passed.
RETRY_GRACE_S = 1.0
# A replica whose last quorum is older than this may have been left behind (the lighthouse counts a replica dead after
# its heartbeat timeout: 0.5 s under mecefo.launch): before its next quorum it checks that the lighthouse knows its peers.
CHECK_AFTER_S = 0.5
# How long a replica waits for a restarted lighthouse to hear from the members of its last quorum: torchft's managers
# retry their connection with a backoff that grows to 10 s (and 0.1 s of jitter), so a live member reappears within it.
REJOIN_GRACE_S = 11.0
# Once every member has marked its arrival, gloo's own rendezvous (each member's address through the store, then a
# connection to each) takes milliseconds; a member that died just after arriving would still hold it for the process
# group's whole timeout, so it runs under this one, and the collectives get the long one back after it.
RENDEZVOUS_S = 5.0
# One try to reach the quorum's store, between checks of the lighthouse's view: a store whose host died is tried
# until the lighthouse counts that host dead. With 1 s tries (torch's client retries within a try), a survivor
# saw the death 1.6 s after the kill instead of 0.5 s (the chaos harness's kill -> next step tail).
CONNECT_S = 0.25


class Awake:
    """Seconds this process has been awake while waiting: each look adds the time since the previous one, at most
    cap_s. A process stopped for longer (SIGSTOP, swap, a VM paused) wakes with its own deadlines where they were,
    not expired by time it did not live (measured: a replica stopped for 45 s while its peers finished)."""

    def __init__(self, cap_s: float):
        self.cap_s, self.last, self.total = cap_s, time.monotonic(), 0.0

    def __call__(self) -> float:
        now = time.monotonic()
        self.total += min(now - self.last, self.cap_s)
        self.last = now
        return self.total


class PeerGone(RuntimeError):
    """A member of the quorum died before the quorum's process group was built."""


class Watch:
    """The lighthouse's view of a quorum's members, read at most every STATUS_EVERY_S."""

    def __init__(self, lighthouse: str, members: list[str], quorum_id: int | None = None):
        self.lighthouse, self.members, self.quorum_id, self.last = lighthouse, set(members), quorum_id, 0.0

    def check(self) -> None:
        """PeerGone if the lighthouse counts a member dead, or has formed another quorum since this one (its members
        went on without a member stalled while they met: it wakes in a rendezvous nobody else will come to); an
        unreachable lighthouse tells nothing."""
        now = time.monotonic()
        if now - self.last < STATUS_EVERY_S:
            return
        self.last = now
        status = read_status(self.lighthouse)
        if status is None:
            return
        dead = sorted(self.members & status.dead)
        if dead:
            raise PeerGone(f"quorum member {dead[0]} died (its last heartbeat {status.heartbeats[dead[0]]:.1f} s ago)")
        if self.quorum_id is not None and status.quorum_id != self.quorum_id:
            raise PeerGone(f"quorum {self.quorum_id} was superseded by quorum {status.quorum_id} at the lighthouse")


def arrive(store_addr: str, rank: int, world_size: int, watch: Watch, timeout_s: float) -> None:
    """Mark this member's arrival at the quorum's store (host:port/prefix) and wait for every member's, ending
    with PeerGone as soon as one of them is counted dead (the store's host included: a store that cannot be
    reached is retried while its host lives), or TimeoutError after timeout_s."""
    from torchft.process_group import create_store_client

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store = create_store_client(store_addr, timeout=timedelta(seconds=CONNECT_S))
            break
        except (RuntimeError, TimeoutError) as e:  # (torch's DistNetworkError and DistStoreError are RuntimeErrors)
            watch.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the quorum's store {store_addr.partition('/')[0]} cannot be reached ({e})") from None
    store.set(f"mecefo/arrived/{rank}", "1")
    keys = [f"mecefo/arrived/{r}" for r in range(world_size)]
    while not store.check(keys):
        watch.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every member of the quorum arrived at its store within {timeout_s:g} s")
        time.sleep(POLL_S)


class QuorumRecorder:
    """torchft's ManagerClient with the last quorum's result kept (its members, step and store), which the
    process group's configure is not given."""

    def __init__(self, client, after=None, manager=None):
        self.inner, self.last, self.after = client, None, after  # after(result): a hook (the tests' faults)
        self.at = time.monotonic()  # when the last quorum returned
        self.manager = manager  # the torchft Manager whose client this is (set by the backend once it exists)
        self.configured = None  # the members of the process group last configured (set by its configure)

    def _quorum(self, *args, **kwargs):
        result = private.ask_quorum(self.inner, *args, **kwargs)
        self.refuse_from_a_restarted_lighthouse(result)
        self.reconfigure_a_repeated_id(result)
        self.last, self.at = result, time.monotonic()
        if self.after is not None:
            self.after(self.last)
        return self.last

    refused = None  # the last quorum before a restart, once a quorum was refused for it
    gone = None  # await_members's gone: members known to hold no state are not missed

    def refuse_from_a_restarted_lighthouse(self, result) -> None:
        """A quorum whose id is lower than this replica's last one comes from a restarted lighthouse (ids count from 1
        again). If it holds this replica alone, and the last quorum had others, the lighthouse may not have heard from
        them yet (torchft retries a quorum request inside the manager server, so a replica whose request was in flight
        when the lighthouse died meets the new one without a failure it could see; chaos seed 18): refused once (a
        RuntimeError fails this quorum; wait_for_quorum then waits for those members, await_members, and asks again,
        and the next is taken). A quorum with other members is taken: they would wait for a refusing member in vain."""
        last = self.last
        if last is None or result.quorum_id >= last.quorum_id or self.refused is last:
            return
        missing = sorted(set(last.replica_ids) - set(result.replica_ids))
        if missing and self.gone is not None:  # (the run's files say they hold no state: nobody to wait for)
            missing = [m for m in missing if m not in self.gone(missing)]
        if missing and len(result.replica_ids) == 1:
            self.refused = last
            why = (f"quorum {result.quorum_id} from a restarted lighthouse (the last was {last.quorum_id}) holds this "
                   f"replica alone, without {', '.join(map(replica_name, missing))} of the last quorum: refused once")
            print(why, flush=True)  # (torchft does not log a failed quorum)
            raise RuntimeError(why)

    def reconfigure_a_repeated_id(self, result) -> None:
        """torchft builds a new process group only when the quorum id changes, and a restarted lighthouse counts ids
        from 1 again, so a quorum can come with the very id this replica's group was built for under the old one. The
        replica would then go on with that group while the other members build the new one and wait at its store for
        it, for the whole timeout (30 s). Measured: a replica stalled across a lighthouse restart woke in the new
        lighthouse's quorum 3 holding the old one's group 3, tried to heal through it ("Connection closed by peer") and
        left its peers at the store, 30 s; 2 launches in 4 of the in-flight-lighthouse test with the fork server.
        So the manager is told it has no group (it builds one) when, by the quorum alone, every member decides so alike:
        - a member is behind (max_world_size < replica_world_size: a heal in this quorum). On a lighthouse that did
          not restart, such a quorum always has a new id (a member joined, or failed to commit), so this costs nothing;
        - its members are not those of the group this replica last built (the same id for other members)."""
        manager = self.manager
        if manager is None or result.quorum_id != private.quorum_id(manager):
            return  # torchft builds a new group anyway
        behind = result.max_world_size < result.replica_world_size
        if behind or (self.configured is not None and sorted(result.replica_ids) != self.configured):
            private.forget_process_group(manager)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _ArrivalChecked:
    """torchft's reconfigurable process group whose configure first checks every member's arrival (arrive), on
    a store prefix unique to the quorum. lighthouse and recorder are set by the backend after the Manager exists."""

    lighthouse: str = ""
    recorder: QuorumRecorder | None = None
    session: str = ""  # this quorum's identity, the same in every member (its store prefix), and this member's rank in it
    member_rank: int = -1
    rendezvous_timeout_applies = True  # gloo connects at creation; NCCL's communicator is made at its first collective

    def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                  group_world_size=None, global_ranks=None):
        last = self.recorder.last if self.recorder is not None else None
        members = sorted(last.replica_ids) if last is not None else []
        if self.recorder is not None:
            self.recorder.configured = members
        self.session = stable_hash([quorum_id, last.max_step if last else None, members])  # (mecefo.heal binds its
        self.member_rank = rank  # MACs to the quorum and the ranks: the same session in every member)
        store_addr = f"{store_addr}/mecefo-{self.session}"
        long = private.group_timeout(self)
        arrive(store_addr, rank, world_size, Watch(self.lighthouse, members, quorum_id), long.total_seconds())
        short = timedelta(seconds=min(RENDEZVOUS_S, long.total_seconds()))
        private.set_group_timeout(self, short if self.rendezvous_timeout_applies else long)
        try:
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks)
        finally:
            private.set_group_timeout(self, long)
        if self.rendezvous_timeout_applies:
            private.set_collective_timeout(self, long)  # the collectives' timeout


def process_group(device_type: str, timeout: timedelta):
    """torchft's gloo (CPU) or NCCL (CUDA) process group, arrival-checked."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if device_type == "cuda" else ProcessGroupGloo
    return type(f"ArrivalChecked{base.__name__}", (_ArrivalChecked, base),
                {"rendezvous_timeout_applies": base is ProcessGroupGloo})(timeout=timeout)


def replica_name(replica_id: str) -> str:
    """A torchft replica id (NAME:uuid) without its uuid: the same for every process of one rank."""
    return replica_id.rpartition(":")[0]


def unknown_members(status: Status, members) -> list[str]:
    """The members (torchft replica ids, NAME:uuid) of which the lighthouse has heard nothing: no heartbeat from
    them, nor from a later process of the same NAME (a restarted replica has a new uuid, and its old one is dead)."""
    names = {replica_name(h) for h in status.heartbeats}
    return [m for m in members if m not in status.heartbeats and replica_name(m) not in names]


def await_members(lighthouse: str, members, grace_s: float = REJOIN_GRACE_S, gone=None) -> list[str]:
    """Wait until the lighthouse has heard from every member of this replica's last quorum (at once on a lighthouse
    that formed that quorum; a restarted one hears from them as their managers reconnect), or grace_s has passed since
    the lighthouse first answered (or grace_s without an answer). Returns those it never heard from.
    gone(members) -> the members known to hold no state (the run's files say they died, or that a later process of
    their rank is starting): not waited for. Without it, a lone survivor whose peers died as the lighthouse restarted
    waited the whole grace for them (the chaos harness: 11-15 s without a step). gone is asked again at every look: a
    member that dies while this replica waits (its file turns "down" a poll of the launcher later, or its next process
    starts) ends the wait then, not at the grace (the chaos harness met an 11.3 s rejoin)."""
    start, first = time.monotonic(), None
    members = list(members)
    while True:
        if gone is not None:
            members = [m for m in members if m not in gone(list(members))]
        status = read_status(lighthouse)
        if status is None:  # down: a quorum cannot form before it is back, and then it must hear from them
            if time.monotonic() - start > grace_s:
                return []  # (the quorum's own wait decides how long a silent lighthouse is waited for)
            time.sleep(STATUS_EVERY_S)
            continue
        missing = unknown_members(status, members)
        if first is None:
            first, start = missing, time.monotonic()  # the grace counts from the lighthouse's first answer
        if not missing or time.monotonic() - start > grace_s:
            if first:
                print(f"the lighthouse had heard nothing of {', '.join(map(replica_name, first))} (of the last quorum): "
                      f"waited {time.monotonic() - start:.1f} s for them"
                      + (f"; never heard: {', '.join(map(replica_name, missing))}" if missing else ""), flush=True)
            return missing
        time.sleep(STATUS_EVERY_S)


def wait_for_quorum(manager, lighthouse: str, stall_s: float, try_s: float, recorder: QuorumRecorder | None = None,
                    agree=None, known_gone=None) -> None:
    """torchft's start_quorum, retried while the cluster makes progress: each try waits try_s; a replica stops
    waiting (TimeoutError) only when no quorum has formed at the lighthouse for stall_s (counted from the last one seen,
    or from when a restarted lighthouse came back), or the lighthouse has not answered for stall_s (each try may add its
    own waits to that: try_s, and await_members's grace). A failed quorum is retried (and, in a replica group, one that
    failed in another process: agree); an error raised while the quorum's heal is applied (the state it received) is
    raised as it is.
    With the recorder of the manager's quorums, a try that follows a failed one, or a last quorum older than
    CHECK_AFTER_S, first waits for the lighthouse to know the last quorum's members (await_members).
    agree(ok) -> bool: whether every process of the replica group had its try succeed (a collective of the group;
    torchft's quorum is one per group, but each process configures its own part of it, and can fail alone). A try
    that failed anywhere is tried again everywhere: a process whose try succeeded and went on would wait in the group's
    next collective for one that asks its manager for a quorum the others no longer ask for. known_gone: await_members's
    gone."""
    last_progress = last_answer = time.monotonic()
    gone = retried = False
    while True:
        last = recorder.last if recorder is not None else None
        if last is not None and (retried or time.monotonic() - recorder.at > CHECK_AFTER_S):
            await_members(lighthouse, sorted(last.replica_ids), gone=known_gone)
        retried, error = True, None
        try:
            manager.start_quorum(timeout=timedelta(seconds=try_s))
        except (RuntimeError, TimeoutError) as e:
            if not private.drop_failed_quorum(manager):  # (torchft would raise it again at the next start_quorum)
                raise  # the quorum itself succeeded: applying what it brought failed
            error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if (error is None) if agree is None else agree(error is None):
            return
        error = error or "another process of the replica group failed its quorum"
        time.sleep(RETRY_GRACE_S)
        now = time.monotonic()
        status = read_status(lighthouse)
        if status is None:
            gone = True
            if now - last_answer > stall_s:
                raise TimeoutError(f"the lighthouse did not answer for {stall_s:g} s (MECEFO_FT_STALL_S; {error})")
            continue
        if gone:  # back: a restarted lighthouse (no quorum yet), the stall counted from now
            last_progress, gone = now, False
        last_answer = now
        if status.quorum_age_s is not None:
            last_progress = max(last_progress, now - status.quorum_age_s)
        if now - last_progress > stall_s:
            raise TimeoutError(f"the lighthouse has formed no quorum for {stall_s:g} s (MECEFO_FT_STALL_S; {error})")
