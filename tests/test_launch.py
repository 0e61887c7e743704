"""mecefo.launch's bookkeeping on replica files written by hand: the merge into one run's records, what it
refuses, and what a resume drops."""

import json
import types

import pytest

from experiments.common import CONFIGS
from mecefo import checkpoint
from mecefo import config as config_mod
from mecefo.errors import TrainingStopped, UsageError
from mecefo.launch import merge, resume_point
from mecefo.records import SUMMARY

CFG = config_mod.load(CONFIGS / "nano.toml", {"steps": "3", "ranks": "2", "backend": "torchft"})


def _row(step, rank, t, failed=(), loss=None):
    return {"step": step, "loss": loss if loss is not None else 5.0 - step, "failed": list(failed), "down": list(failed),
            "tokens_trained": 100 * step, "backend": {"rank": rank, "time": t}}


def _replicas(tmp_path, rows: dict, digests=((1.0,), (1.0,)), heals=None):
    folder = tmp_path / "replicas"
    folder.mkdir(parents=True, exist_ok=True)
    for r, rs in rows.items():
        (folder / f"rank{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rs))
    for r, digest in enumerate(digests):
        summary = dict.fromkeys(SUMMARY) | {"final_val_loss": 4.0, "backend": {"name": "torchft", "rank": r, "digest": list(digest)}}
        (folder / f"rank{r}.summary.json").write_text(json.dumps(summary))
    for r, hs in (heals or {}).items():
        (folder / f"rank{r}.heals.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hs))
    return types.SimpleNamespace(events=[{"time": 10.5, "kind": "kill", "rank": 1, "why": "scheduled", "step": 1},
                                         {"time": 11.5, "kind": "start", "rank": 1, "why": "restart after a kill", "step": 2}],
                                 t0=0.0)


def test_merge_joins_the_replicas_rows_into_the_trainers_records(tmp_path):
    """Rank 1 dies after step 1 and heals at step 2; rank 0 commits steps 2 alone; both commit step 3."""
    rows = {0: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 0, 10.0), _row(2, 0, 11.0, [1]), _row(3, 0, 12.0)],
            1: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 1, 10.0), _row(3, 1, 12.0)]}
    supervisor = _replicas(tmp_path, rows, heals={1: [{"healed_at_step": 2, "time": 11.8}]})
    summary = merge(tmp_path, CFG, supervisor.events, supervisor.t0)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3] and metrics[2]["failed"] == [1]
    assert json.loads((tmp_path / "failed_steps.json").read_text())["failed"] == [[], [1], []]
    assert summary["rank_agreement"] == {"ranks_checked": [0, 1], "identical": True}
    assert summary["final_train_loss"] == 2.0 and summary["tokens_trained"] == 300
    assert summary["failure_schedule"] == {"fraction_failed": pytest.approx(1 / 6), "events": 1}  # as it happened
    assert summary["backend"]["kills"] == 1
    # the kill at 10.5 s: the first step without rank 1 committed at 11.0; the restart at 11.5: it trained at 12.0
    assert summary["backend"]["timings"] == {"kill_to_step_s": [pytest.approx(0.5)], "restart_to_rejoin_s": [pytest.approx(0.5)]}
    assert json.loads((tmp_path / "events.json").read_text())["healed"] == [{"rank": 1, "healed_at_step": 2, "time": 11.8}]


@pytest.mark.parametrize("rows, digests, message", [
    ({0: [_row(1, 0, 1.0), _row(3, 0, 3.0)]}, ((1.0,),), "steps [2] were never committed"),
    ({0: [_row(1, 0, 1.0), _row(2, 0, 2.0), _row(3, 0, 3.0)], 1: [_row(1, 1, 1.0, loss=9.0)]}, ((1.0,), (1.0,)),
     "step 1: replicas disagree"),
    ({0: [_row(1, 0, 1.0), _row(2, 0, 2.0), _row(2, 0, 2.5), _row(3, 0, 3.0)]}, ((1.0,),), "rank 0 committed a step twice"),
    ({0: [_row(1, 0, 1.0), _row(2, 0, 2.0), _row(3, 0, 3.0)]}, ((1.0,), (2.0,)), "ended with different parameters"),
])
def test_merge_refuses_records_that_are_not_one_run(tmp_path, rows, digests, message):
    supervisor = _replicas(tmp_path, rows, digests)
    with pytest.raises(TrainingStopped, match=message.replace("[", r"\[").replace("]", r"\]")):
        merge(tmp_path, CFG, supervisor.events, supervisor.t0)
    if "different parameters" in message:  # written anyway, saying so
        assert json.loads((tmp_path / "summary.json").read_text())["rank_agreement"]["identical"] is False


def test_resume_point_drops_what_came_after_the_checkpoint(tmp_path):
    rows = {0: [{"step": 0, "val_loss": 6.0, "tokens_seen": 0}, _row(1, 0, 1.0), _row(2, 0, 2.0), _row(3, 0, 3.0)]}
    _replicas(tmp_path, rows, heals={0: [{"healed_at_step": 1, "time": 1.0}, {"healed_at_step": 3, "time": 3.0}]})
    checkpoint.save(tmp_path / "checkpoint.pt", 2, CFG.hash(), {})
    assert resume_point(tmp_path, CFG) == 2
    kept = [json.loads(line)["step"] for line in (tmp_path / "replicas" / "rank0.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]
    heals = (tmp_path / "replicas" / "rank0.heals.jsonl").read_text().splitlines()
    assert [json.loads(h)["healed_at_step"] for h in heals] == [1]
    assert not list((tmp_path / "replicas").glob("*.summary.json"))  # the run is not finished any more


def test_a_checkpoint_of_another_config_or_a_torn_one_is_refused(tmp_path):
    checkpoint.save(tmp_path / "checkpoint.pt", 2, "another", {})
    with pytest.raises(UsageError, match="belongs to another config"):
        resume_point(tmp_path, CFG)
    (tmp_path / "checkpoint.pt").write_bytes((tmp_path / "checkpoint.pt").read_bytes()[:40])
    with pytest.raises(UsageError, match="cannot be read as data"):
        checkpoint.load(tmp_path / "checkpoint.pt", CFG.hash())
