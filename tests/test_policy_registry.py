"""A new policy is one file: tests/policy_example.py, registered through MECEFO_POLICY_MODULES, is run by
the trainer (in process and from the CLI), simulated by the simulator, selected by the sweep, and shown in
the docs' generated policy table - without a change to any other file."""

import pytest

from experiments import sweep
from experiments.common import CONFIGS
from mecefo import policies
from mecefo.failures import Event
from mecefo.simulator import Job, simulate
from mecefo.train import main, run
from tests.conftest import metrics

NAME = "neighbour-half"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.setenv("MECEFO_POLICY_MODULES", "tests.policy_example")
    yield policies.get(NAME)
    policies.unregister("tests.policy_example")  # leave the registry as the other tests know it


def test_a_policy_module_cannot_replace_a_built_in_policy(monkeypatch, tmp_path, capsys):
    (tmp_path / "impostor.py").write_text(
        "from mecefo.policies import register\nfrom mecefo.policies.drop import Drop\n\n"
        "@register\nclass Impostor(Drop):\n    name = 'mecefo'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MECEFO_POLICY_MODULES", "impostor")
    try:
        assert main(["--config", str(CONFIGS / "nano.toml"), "--steps", "2", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert "policy 'mecefo' of impostor.Impostor would replace mecefo.policies.mecefo" in err and err.count("\n") == 1
        monkeypatch.delenv("MECEFO_POLICY_MODULES")
        assert policies.get("mecefo").__module__ == "mecefo.policies.mecefo"  # the built-in one is kept
    finally:
        policies.unregister("impostor")


def test_the_registry_finds_the_policy_and_the_cli_accepts_it(example, tmp_path, capsys):
    assert NAME in policies.trainer_policies() and NAME in policies.simulator_policies()
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,node1\n0,add,node2\n0,add,node3\n2000,remove,node2\n4000,add,node2\n")
    args = ["--config", str(CONFIGS / "nano.toml"), "--steps", "6", "--ranks", "3", "--failures", str(trace),
            "--seconds_per_step", "1", "--policy", NAME, "--quiet", "--out", str(tmp_path / "o")]
    assert main(args) == 0
    rows = metrics(tmp_path / "o")[1:]
    assert [r["samples"] for r in rows] == [24, 24, 20, 20, 24, 24]  # 8 rows per rank; half of rank 1's covered
    assert [r["neighbours"] for r in rows][2] == {"1": 2}
    assert main(args[:-1] + [str(tmp_path / "p"), "--policy", "nope"]) == 2
    assert NAME in capsys.readouterr().err  # the allowed names list it


def test_the_simulator_simulates_it(example):
    job = Job(model="llama-350m", dp=8, pp=1, micro_batch=4, global_batch=256)
    events = [Event(600.0, "remove", 3), Event(1800.0, "add", 3)]
    free, ours = simulate(job, NAME, [], 3600.0), simulate(job, NAME, events, 3600.0)
    assert ours.policy == NAME and ours.throughput < free.throughput
    assert simulate(job, "drop", events, 3600.0).throughput > ours.throughput  # costs more than dropping


def test_the_sweep_selects_it(example, tmp_path):
    grid = sweep.cells("quick", (NAME,))
    mine = [c for c in grid if c.policy == NAME]
    assert mine and all(c.level != "none" for c in mine)
    cfg = sweep.cell_config("sweep-quick", mine[0])
    assert cfg.cluster.policy == NAME
    summary = run(cfg, tmp_path / "cell", quiet=True)
    assert summary["final_val_ppl"] > 0
    with pytest.raises(Exception, match="cluster.policy='nope'"):
        sweep.cells("quick", ("nope",))


def test_the_generated_table_lists_the_policy(example):
    assert f"| `{NAME}` |" in policies.table()


def test_the_docs_policy_table_is_the_registrys():
    """docs/training.md's table is generated (python -m paper_figures.readme, run by run_all.sh)."""
    from paper_figures.readme import block_text

    assert block_text("policies").strip() == policies.table().strip()
