"""The tests' fault injector (mecefo.faults): read once from the environment at a replica's start, into an object its
membership asks; a restarted replica runs clean but for the persistent fault and the heal delay."""

from mecefo.faults import Faults

ENV = {"MECEFO_FT_FAULT_VOID_FROM": "5", "MECEFO_FT_FAULT_DIE_IN_QUORUM": "1,2:4;0:9", "MECEFO_FT_FAULT_CRASH": "1:6",
       "MECEFO_FT_FAULT_HEAL": "1/1", "MECEFO_FT_FAULT_ABANDON": "1:7", "MECEFO_FT_FAULT_LONE_COMMIT": "2:8",
       "MECEFO_FT_HEAL_DELAY_S": "1.5"}


def test_no_fault_without_the_environment():
    faults = Faults.from_environ(1, 0, rejoin=False, environ={})
    assert faults == Faults(1, 0)
    assert not any([faults.voids(10), faults.dies_in_quorum(True, 10), faults.crashes(10), faults.heal_fails(),
                    faults.abandons(10), faults.refuses_commit(10), faults.dies_after_commit(10), faults.heal_delay(False)])


def test_each_fault_fires_where_and_as_often_as_named():
    one = Faults.from_environ(1, 1, rejoin=False, environ=ENV)
    assert one.voids(4) is None and "VOID_FROM=5" in one.voids(5)
    assert one.dies_in_quorum(True, 4) and not one.dies_in_quorum(False, 4) and not one.dies_in_quorum(True, 3)
    assert one.crashes(5) is None and "crash at step 6" in one.crashes(6)
    assert one.heal_fails() and not Faults.from_environ(1, 0, rejoin=False, environ=ENV).heal_fails()
    assert one.abandons(5) is None and one.abandons(6) and one.abandons(6) is None  # once
    assert one.refuses_commit(7) and one.refuses_commit(7) is None  # rank 2 commits step 8 alone; once
    two = Faults.from_environ(2, 0, rejoin=False, environ=ENV)
    assert two.refuses_commit(7) is None and two.dies_after_commit(8) and not two.dies_after_commit(7)
    assert one.heal_delay(False) == 1.5 and one.heal_delay(True) == 0.0
    assert Faults.from_environ(1, 0, False, {**ENV, "MECEFO_FT_HEAL_DELAY_EVERY": "1"}).heal_delay(True) == 1.5


def test_a_restarted_replica_keeps_only_the_persistent_fault_and_the_heal_delay():
    again = Faults.from_environ(1, 1, rejoin=True, environ=ENV)
    assert again.voids(5) and again.heal_delay(False) == 1.5
    assert not any([again.dies_in_quorum(True, 10), again.crashes(10), again.heal_fails(), again.abandons(6),
                    again.refuses_commit(7)])
