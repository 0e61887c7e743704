"""mecefo.chaos: the punisher's events are drawn from its seed, land only on running ranks, wait for their moment,
and respect the quiet tail; --chaos is parsed with one-line errors."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo import chaos
from mecefo.errors import UsageError


class FakeSupervisor:
    """The supervisor's verbs and view, recorded. Ranks in `joining` run but do not hold the run's state yet."""

    def __init__(self, ranks: int, step: int = 5, checkpoint: bool = False, joining=()):
        self.procs = {r: object() for r in range(ranks)}
        self.stalled, self.step, self.checkpoint, self.did = set(), step, checkpoint, []
        self.status = {r: ("waiting" if r in joining else "step") for r in range(ranks)}

    def committed(self):
        return self.step

    def alive(self):
        return sorted(self.procs)

    def training(self):
        return sorted(r for r in self.procs if r not in self.stalled and self.status.get(r) == "step")

    def statuses(self):
        return dict(self.status)

    def has_checkpoint(self):
        return self.checkpoint

    def log(self, msg, **event):
        self.did.append(("log", event.get("chaos"), event.get("outcome")))

    def kill(self, rank, why, process=None):
        self.did.append(("kill", rank, process))
        self.procs.pop(rank, None)

    def restart_after(self, rank, seconds):
        assert 0 <= seconds <= chaos.RESTART_S
        self.did.append(("restart", rank))

    def kill_unplanned(self, rank):
        self.did.append(("external", rank))

    def stall(self, rank, seconds):
        assert (chaos.STALL_S[0] <= seconds <= chaos.STALL_S[1] or chaos.LONG_STALL_S[0] <= seconds <= chaos.LONG_STALL_S[1]
                or seconds == math.inf)
        self.did.append(("stall", rank))
        self.stalled.add(rank)

    def restart_lighthouse(self, seconds):
        self.did.append(("lighthouse", round(seconds, 3)))

    def refill(self, ranks: int, joining=()):
        """The launcher restarts the killed (as joining ranks) and the stalled wake up."""
        for r in range(ranks):
            if r not in self.procs:
                self.procs[r], self.status[r] = object(), "waiting"
            elif r in joining:
                self.status[r] = "waiting"
            else:
                self.status[r] = "step"
        self.stalled.clear()


def _drive(seed: int, ranks: int, group_size: int = 1, ticks: int = 400, dt: float = 1.0) -> list:
    punisher = chaos.Punisher(seed, 30.0, group_size, steps=100)
    sup = FakeSupervisor(ranks, checkpoint=True)
    for i in range(ticks):
        punisher.poll(sup, now=i * dt)
        if i % 3 == 2:
            sup.refill(ranks)
    return sup.did


def test_the_same_seed_draws_the_same_events_and_another_seed_others():
    assert _drive(3, 4) == _drive(3, 4)
    assert _drive(3, 4) != _drive(4, 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6), st.sampled_from([1, 2]), st.sets(st.integers(0, 5), max_size=3))
def test_events_hit_only_ranks_holding_the_state_and_never_the_last_of_them(seed, ranks, group_size, joining):
    """Ranks still joining (restarted, not healed) hold no state: a kill, a stall or an unplanned kill never targets
    them, and never the last rank that holds the state (only `all` kills everyone); a two-phase event drawn while too
    few ranks train waits armed, without a victim, and fires later (it once raised IndexError there)."""
    joining = {r for r in joining if r < ranks}
    punisher = chaos.Punisher(seed, 60.0, group_size, steps=100)
    sup = FakeSupervisor(ranks, joining=joining)
    for i in range(200):
        before, n_did = set(sup.training()), len(sup.did)
        punisher.poll(sup, now=float(i))
        new = sup.did[n_did:]
        victim_phase = [w for w in new if w[0] == "kill" and w[1] == punisher.victim]
        for what in new:
            if what[0] in ("external", "stall") or (what[0] == "kill" and what not in victim_phase):
                assert what[1] in before, (what, before)
            if what[0] == "kill" and what[2] is not None:
                assert 0 <= what[2] < group_size and group_size > 1
        if not any(w == ("log", "all", "fired") for w in new) and before:
            assert set(sup.training()) & before, "the last rank holding the state was hit"
        sup.refill(ranks, joining=joining if i % 2 else ())


def test_no_event_before_the_first_step_nor_in_the_quiet_tail():
    punisher = chaos.Punisher(0, 600.0, 1, steps=100)
    for step in (0, punisher.quiet_from, 100):
        sup = FakeSupervisor(4, step=step, checkpoint=True)
        for i in range(50):
            punisher.poll(sup, now=float(i))
        assert sup.did == []
    assert punisher.quiet_from == 70  # the last 30% of the steps


def test_an_armed_event_waits_for_its_moment_and_expires_after_armed_s():
    """kill_healing kills a rank, then again while that rank heals; if it does not heal within ARMED_S, it expires."""
    kind = next(k for k in chaos.KINDS if k.name == "kill_healing")
    punisher = chaos.Punisher(0, 60.0, 1, steps=100)
    sup = FakeSupervisor(3)
    assert not punisher._fire(kind, sup)
    victim = punisher.victim
    assert sup.did[-2:] == [("kill", victim, None), ("restart", victim)]
    sup.procs[victim], sup.status[victim] = object(), "waiting"  # restarted
    for r in sup.procs:
        if r != victim:
            sup.status[r] = "healing"  # others healing: not the moment
    assert not punisher._fire(kind, sup)
    sup.status = {r: "step" for r in sup.procs} | {victim: "healing"}
    assert punisher._fire(kind, sup) and sup.did[-2] == ("kill", victim, None)
    punisher.armed, punisher.victim, punisher.next_at = (kind, 0.0), victim, 10**9
    sup2 = FakeSupervisor(3)
    punisher.poll(sup2, now=chaos.ARMED_S + 1)
    assert ("log", "kill_healing", "expired") in sup2.did and punisher.armed is None and punisher.victim is None


def test_a_two_phase_event_drawn_with_one_rank_training_is_armed_without_a_victim_and_fires_later():
    kind = next(k for k in chaos.KINDS if k.name == "kill_store")
    punisher = chaos.Punisher(0, 60.0, 1, steps=100)
    sup = FakeSupervisor(3, joining={1, 2})
    punisher.armed = (kind, 0.0)
    punisher.poll(sup, now=1.0)  # one rank trains: no first kill yet
    assert punisher.victim is None and not [w for w in sup.did if w[0] == "kill"]
    sup.status = {0: "step", 1: "step", 2: "step"}
    punisher.poll(sup, now=2.0)
    assert punisher.victim is not None and ("kill", punisher.victim, None) in sup.did


def test_the_all_event_waits_for_a_checkpoint_and_kills_the_stalled_too():
    kind = next(k for k in chaos.KINDS if k.name == "all")
    punisher = chaos.Punisher(0, 60.0, 1, steps=100)
    sup = FakeSupervisor(3, checkpoint=False)
    assert not punisher._fire(kind, sup)
    sup.checkpoint, sup.stalled = True, {1}
    assert punisher._fire(kind, sup)
    assert sorted(w[1] for w in sup.did if w[0] == "kill") == [0, 1, 2]


def test_kill_store_kills_a_rank_then_as_it_joins_again_the_first_replica_id():
    kind = next(k for k in chaos.KINDS if k.name == "kill_store")
    punisher = chaos.Punisher(1, 60.0, 1, steps=100)
    sup = FakeSupervisor(12)
    assert not punisher._fire(kind, sup)
    victim = punisher.victim
    sup.procs[victim] = object()
    sup.status = {r: "step" for r in range(12)} | {0: "healing", victim: "starting"}
    assert not punisher._fire(kind, sup)  # not joining yet
    sup.status[victim] = "waiting"
    assert punisher._fire(kind, sup)
    # the first id among the training ranks, as torchft sorts "mecefo_R:<uuid>": "mecefo_10:" before "mecefo_1:"
    assert sup.did[-2] == ("kill", 10 if victim != 10 else 11, None)


@pytest.mark.parametrize("spec, expected", [("7", (7, chaos.DEFAULT_RATE)), ("0:2.5", (0, 2.5))])
def test_parse(spec, expected):
    assert chaos.parse(spec) == expected


@pytest.mark.parametrize("spec", ["x", "-1", "3:0", "3:inf", "3:-2", "3:abc"])
def test_parse_refuses_bad_input(spec):
    with pytest.raises(UsageError, match="--chaos"):
        chaos.parse(spec)


def test_groups_only_kinds_are_left_out_of_one_process_runs():
    assert "kill_process" not in {k.name for k in chaos.kinds(1)} and "kill_process" in {k.name for k in chaos.kinds(2)}
    assert "kill_process" in chaos.describe() and "groups only" in chaos.describe()


def test_the_launchers_help_lists_every_kind_with_its_weight(capsys):
    from mecefo.launch import main as launch_main

    with pytest.raises(SystemExit) as exit_:
        launch_main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "--chaos SEED[:RATE]" in out
    for kind in chaos.KINDS:
        assert f"  {kind.name} (" in out


def _run(seed, family="one-process", **kw):
    q = [1.0, 2.0]
    return {"schedule": {"seed": seed}, "family": family, "lost": None, "violations": [], "resumed": False, "chaos": [],
            "restart_to_rejoin_s": q, "kill_to_step_s": q, "phases": [], "not_rejoined": [], "crashes": 0,
            "twin_max_rel": 1e-6, "torch_twin_max_rel": None, "superseded_rows": [], "seconds": 50.0} | kw


def test_the_summary_and_the_readme_block_count_what_the_runs_say():
    """experiments.chaos.summarise and paper_figures.chaos.section, on runs of every outcome: a run the merge refused
    has no twin (it must not break the maximum, as it once did), a lost run counts as lost and nowhere else."""
    from experiments.chaos import TARGETS, summarise
    from paper_figures.chaos import section

    slow = {"kill_to_step_s": [{"why": "chaos: kill", "clear": True}, {"why": "chaos: multi_kill", "clear": False}]}
    runs = [_run(0, twin_max_rel=3e-5, superseded_rows=[{"rank": 0, "step": 15}], causes=slow),
            _run(1, violations=["once"], twin_max_rel=None, restart_to_rejoin_s=[], kill_to_step_s=[]),
            {"schedule": {"seed": 2}, "family": "one-process", "lost": "not finished within 300 s"},
            _run(1000, family="groups of 2", torch_twin_max_rel=2e-7)]
    s = summarise(runs)
    one, groups = s["families"]["one-process"], s["families"]["groups of 2"]
    assert (one["schedules"], one["lost"], one["violations"], one["superseded_rows"]) == (3, 1, 1, 1)
    assert one["twin_max_rel"] == 3e-5 and one["torch_twins"] == 0 and groups["torch_twin_max_rel"] == 2e-7
    assert one["restart_to_rejoin_s"]["n"] == 2 and s["violated"] == [{"seed": 1, "violations": ["once"]}]
    text = section({"summary": s, "targets": TARGETS, "profile": "default", "git_commit": "0" * 40, "hold_s": 0.3,
                    "twin_rtol": 1e-4, "exact_every": 5, "runs": runs})
    # one-process kill -> step: 1.0 (a kill) and 2.0 (a kill that met a stall): above the p95 (1.95), the latter alone
    assert "kill -> next step (one-process): multi_kill 1 (1 not clear)" in text
    assert "| one-process | 3 | 1 | 1 | 0 |" in text and "seed 2: not finished within 300 s" in text
    assert "superseded by the version its peers redid: 1 (one-process), 0 (groups of 2)" in text


def test_the_once_invariant_accepts_a_lone_history_only_where_its_replica_died_with_it(tmp_path):
    """experiments.chaos's "once" check, on a run whose rank 0 trained steps 2 and 3 alone (as from a restarted
    lighthouse's lone quorum): accepted where the launcher's events show rank 0 killed after those rows and before its
    next heal (the history died with it), a violation where no death explains them."""
    import json
    import types

    from experiments.chaos import _each_step_once

    def row(step, rank, t, life, loss=None):
        return {"step": step, "loss": loss if loss is not None else 5.0 - step, "failed": [], "down": [],
                "backend": {"rank": rank, "time": t, "life": life}}

    folder = tmp_path / "replicas"
    folder.mkdir()
    rows = {0: [row(1, 0, 1.0, "a"), row(2, 0, 2.0, "a", loss=9.0), row(3, 0, 2.5, "a", loss=9.1), row(4, 0, 4.0, "c")],
            1: [row(s, 1, float(s), "b") for s in range(1, 5)]}
    for r, mine in rows.items():
        (folder / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in mine))
        (folder / f"rank{r}.summary.json").write_text(json.dumps({"backend": {"rank": r}}))
    (folder / "rank0.heals.jsonl").write_text(json.dumps({"healed_at_step": 3, "time": 3.5, "life": "c"}) + "\n")
    s = types.SimpleNamespace(ranks=2, steps=4)
    assert _each_step_once(tmp_path, s, [{"kind": "kill", "rank": 0, "time": 3.0}])
    assert not _each_step_once(tmp_path, s, [{"kind": "kill", "rank": 0, "time": 3.6}])


def test_a_supervisor_that_cannot_fire_a_kind_never_draws_it():
    """The Slurm injector fires what a node's supervisor can (mecefo.slurm.INJECTABLE): the same generator, the
    other kinds left out of the draw."""
    from mecefo.slurm import INJECTABLE

    assert {k.name for k in chaos.kinds(1, INJECTABLE)} == INJECTABLE - {"kill_process"}
    punisher = chaos.Punisher(5, 60.0, 1, steps=100, can=INJECTABLE)
    sup = FakeSupervisor(4, checkpoint=True)
    for i in range(300):
        punisher.poll(sup, now=float(i))
        sup.refill(4)
    assert punisher.fired and {e["kind"] for e in punisher.fired} <= INJECTABLE
    assert not any(w[0] == "lighthouse" for w in sup.did)


def test_the_slurm_injector_turns_the_generators_events_into_one_order_per_node(tmp_path):
    """mecefo.slurm.Injector as the Punisher's supervisor: each event becomes one order file for the node's supervisor
    (a kill and its restart together), logged in OUT/events/watch.jsonl; a node with an order pending is not drawn
    again."""
    import json

    from mecefo.runfiles import write_replica_status
    from mecefo.slurm import Injector, order_path
    from mecefo.supervise import EventLog, read_events

    for r in range(3):
        write_replica_status(tmp_path, r, "step 7")
    hands = Injector(tmp_path, 3, 100, EventLog(tmp_path, "watch"))
    assert hands.look() == (7, ["step"] * 3) and hands.training() == [0, 1, 2]
    hands.kill(1, "chaos: kill")
    hands.restart_after(1, 1.5)
    hands.stall(2, math.inf)
    assert hands.training() == [0]  # ordered: not drawn again before its supervisor acts
    hands.flush(7)
    assert json.loads(order_path(tmp_path, 1).read_text()) == {"what": "kill", "why": "chaos: kill",
                                                               "restart": {"after_s": 1.5}}
    assert json.loads(order_path(tmp_path, 2).read_text())["seconds"] is None  # a stall past the end
    assert [(e["kind"], e["node"], e["what"]) for e in read_events(tmp_path)] == [("inject", 1, "kill"),
                                                                                 ("inject", 2, "stall")]
