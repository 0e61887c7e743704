"""Table 2's time reading: MeCeFO simulated again with its c read from the neighbour's measured time at the model's
layer shape (experiments.bench_neighbour's time / FLOP quotient), beside the FLOP reading."""

import json

import pytest

from experiments.table2 import timed_sentence
from experiments.throughput import PAPER_JOBS, TIMED, time_readings, timed
from mecefo.failures import SCENARIOS
from mecefo.simulator import CostModel, mtbf, scenario_failures, simulate

H = 24 * 3600.0


def _bench(tmp_path, quotients: dict) -> object:
    path = tmp_path / "neighbour-default.json"
    shapes = [{"preset": m, "sets": {"mecefo": {"time_over_flop": q}}} for m, q in quotients.items()]
    path.write_text(json.dumps({"shapes": shapes, "git_commit": "a" * 40}))
    return path


def test_readings_come_from_the_bench_for_table_2s_models_only(tmp_path):
    got = time_readings(_bench(tmp_path, {"llama-350m": 1.05, "tiny": 2.0, "llama-7b": 0.98}))
    assert got == {"llama-350m": {"time_over_flop": 1.05, "git_commit": "a" * 40},
                   "llama-7b": {"time_over_flop": 0.98, "git_commit": "a" * 40}}
    assert time_readings(tmp_path / "absent.json") == {}


def _drop(job, seed: int = 0) -> float:
    events, down = scenario_failures(SCENARIOS["high"], job, H, seed)
    base = simulate(job, "mecefo", [], H).throughput
    return 1 - simulate(job, "mecefo", events, H, mtbf(SCENARIOS["high"], job.gpus), down).throughput / base


@pytest.mark.parametrize("model", ["llama-350m", "llama-7b"])
def test_a_quotient_of_one_is_the_flop_reading_and_a_slower_neighbour_drops_more(model):
    """The measured quotient q scales c and a neighbour's step time covering k failed GPUs alike (its own micro-batches
    and theirs all run under the techniques, so alpha(k) scales by q for every k, where H3's neighbour_alpha would
    give 1 + k (q alpha(1) - 1)); a normal GPU's step is unchanged."""
    job = PAPER_JOBS[model]
    flop, slow = CostModel(job), CostModel(timed(job, {"time_over_flop": 1.2}))
    assert slow.relative_cost == pytest.approx(1.2 * flop.relative_cost, rel=1e-12)
    for k in (1, 2, 3):
        assert slow.alpha(k) == pytest.approx(1.2 * flop.alpha(k), rel=1e-12)
    assert slow.t_mb == flop.t_mb and slow.base == flop.base
    assert _drop(timed(job, {"time_over_flop": 1.0})) == pytest.approx(_drop(job), rel=1e-9)
    assert _drop(timed(job, {"time_over_flop": 0.9})) <= _drop(job) < _drop(timed(job, {"time_over_flop": 1.2}))


def test_the_verdict_names_the_timed_drop_only_where_it_was_measured():
    cell = lambda mean, lo, hi: {"mean": mean, "ci95": [lo, hi]}  # noqa: E731
    row = {"none": {TIMED: cell(100.0, 100.0, 100.0)}, "high": {TIMED: cell(60.0, 59.0, 61.0)},
           "cost": {"c_time": 0.801, "time_over_flop": 1.062, "measured_by": "b" * 40}}
    text = timed_sentence(row)
    assert "c = 0.801" in text and "x 1.062" in text and "`bbbbbbbbbbbb`" in text and "40.00% [39.00, 41.00]" in text
    assert timed_sentence({"high": {"mecefo": {}}}) == ""


def test_the_full_profiles_bench_is_read_where_it_has_run(tmp_path, monkeypatch):
    """experiments.bench_neighbour --full (llama-7b's layer too) supersedes the default's file for Table 2's time
    reading and the figures; the quick profile reads its own."""
    from mecefo import results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert results.neighbour_bench(False) == tmp_path / "bench" / "neighbour-default.json"
    _bench(tmp_path, {"llama-350m": 1.05})
    (tmp_path / "bench").mkdir()
    (tmp_path / "neighbour-default.json").rename(tmp_path / "bench" / "neighbour-full.json")
    assert results.neighbour_bench(False) == tmp_path / "bench" / "neighbour-full.json"
    assert time_readings()["llama-350m"]["time_over_flop"] == 1.05
    assert results.neighbour_bench(True) == tmp_path / "bench" / "neighbour-quick.json"
