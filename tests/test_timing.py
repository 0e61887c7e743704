"""Where a step's time goes (mecefo.timing), the launchers' progress line (mecefo.progress) and the TensorBoard
view of the rows (mecefo.board)."""

import json
import threading

import pytest

from mecefo import timing
from mecefo.progress import ProgressLine
from mecefo.timing import PHASES, Clock, rows_total
from mecefo.train import main as train_main
from tests.conftest import NANO, metrics


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_nested_phases_are_not_counted_twice_and_an_interval_adds_up(monkeypatch):
    t = FakeTime()
    monkeypatch.setattr(timing.time, "perf_counter", t)
    clock = Clock()
    t.now += 0.5  # before any phase: other
    with clock("quorum"):
        t.now += 1.0
        with clock("heal"):
            t.now += 2.0
        clock.add("pace", 0.25)  # (already elapsed inside: a phase measured by hand, as mecefo.ft's quorum is)
    with clock("compute"):
        t.now += 3.0
        with clock("exchange"):
            t.now += 0.75
    row = clock.row()
    assert row["heal_s"] == 2.0 and row["quorum_s"] == 0.75 and row["pace_s"] == 0.25
    assert row["compute_s"] == 3.0 and row["exchange_s"] == 0.75 and row["other_s"] == 0.5
    assert row["total_s"] == 7.25 == sum(row[f"{k}_s"] for k in PHASES) + row["other_s"]
    t.now += 1.0
    assert clock.row()["total_s"] == 1.0  # the next interval starts at the previous row
    summary = clock.summary()
    assert summary["total_s"] == 8.25 and summary["share"]["heal"] == pytest.approx(2 / 8.25, abs=1e-4)
    assert sum(summary["share"].values()) == pytest.approx(1.0, abs=1e-3)


def test_time_in_another_thread_is_not_the_steps():
    clock = Clock()
    worker = threading.Thread(target=lambda: clock("compute").__enter__())
    worker.start()
    worker.join()
    assert clock.totals["compute"] == 0.0 and clock._inner == []


def test_rows_total_sums_the_intervals_of_the_rows():
    rows = [{"compute_s": 1.0, "quorum_s": 0.5, "other_s": 0.5, "total_s": 2.0},
            {"compute_s": 2.0, "heal_s": 1.0, "other_s": 1.0, "total_s": 4.0}]
    total = rows_total(rows)
    assert total["compute_s"] == 3.0 and total["heal_s"] == 1.0 and total["total_s"] == 6.0 and total["other_s"] == 1.5
    assert total["share"]["compute"] == 0.5


def test_the_progress_line_says_the_step_the_ranks_the_last_heal_and_the_time_left():
    p = ProgressLine(steps=300, every_s=10)
    assert p.line(0, 4, 4, now=0.0) is None  # the first line comes every_s after the first look
    for t in range(1, 10):
        assert p.line(2 * t, 4, 4, now=float(t)) is None
    p.healed(2, 17, now=9.6)
    line = p.line(20, 3, 4, now=10.0)
    assert line == ("step 20/300 (7%), 3/4 ranks training, last heal: rank 2 at step 17, 0 s ago; "
                    "120.0 steps/min, ETA 2m20s")
    assert p.rate_per_min() == 120.0
    idle = ProgressLine(10, every_s=1)
    idle.line(3, 1, 2, now=0.0)
    assert "ETA unknown" in idle.line(3, 1, 2, now=2.0)


def test_rows_and_summary_carry_the_timing(tmp_path):
    out = tmp_path / "run"
    assert train_main([*NANO, "--ranks", "2", "--steps", "6", "--eval_every", "3", "--checkpoint_every", "2", "--quiet",
                       "--out", str(out)]) == 0
    rows = metrics(out)[1:]
    for row in rows:
        t = row["timing"]
        assert t["total_s"] == pytest.approx(sum(t[f"{k}_s"] for k in PHASES) + t["other_s"], abs=1e-5)
        assert t["compute_s"] > 0 and t["quorum_s"] == t["heal_s"] == t["exchange_s"] == 0  # one process, no quorum
    assert [row["timing"]["checkpoint_s"] > 0 for row in rows] == [False, False, True, False, True, False]  # the row after
    assert [row["timing"]["evaluate_s"] > 0 for row in rows] == [True, False, True, False, False, True]  # (step 0's: row 1)
    summary = json.loads((out / "summary.json").read_text())["timing"]
    assert summary["compute_s"] >= sum(row["timing"]["compute_s"] for row in rows) - 1e-5


def test_tensorboard_shows_the_rows(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert train_main([*NANO, "--ranks", "2", "--steps", "6", "--eval_every", "3", "--quiet", "--out", str(out),
                       "--tensorboard", str(tmp_path / "tb")]) == 0
    rows = metrics(out)[1:]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == pytest.approx(
        [(row["step"], row["loss"]) for row in rows], rel=1e-6)
    assert [e.step for e in events.Scalars("train/val_loss")] == [0, 3, 6]  # (the step-0 evaluation too)
    assert len(events.Scalars("timing/compute")) == 6


def test_tensorboard_without_the_package_is_one_line(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("no tensorboard")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    assert train_main([*NANO, "--steps", "2", "--quiet", "--out", str(tmp_path / "r"), "--tensorboard",
                       str(tmp_path / "tb")]) == 2
