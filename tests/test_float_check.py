"""experiments.float_check without training: the environment a setting runs under, and the row-by-row comparison of
an original table with a rerun's (on synthetic sweep indices)."""

import json

import numpy as np
import pytest

from experiments import float_check, table3
from tests.test_table3 import cell, index


def test_a_setting_runs_with_every_other_float_knob_unset(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    env = float_check.environment("onednn-avx2")
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and "ATEN_CPU_CAPABILITY" not in env and "MKL_CBWR" not in env
    own = float_check.environment(None)
    assert not float_check.KNOBS & set(own)


def test_every_table_cell_is_rerun_and_keyed_like_the_index():
    cells = float_check.table_cells("quick")
    n = {c.n for c in cells}
    assert len(n) == 1 and len({float_check.cell_key(c) for c in cells}) == len(cells)
    as_dict = {**cells[0].__dict__}
    assert float_check.cell_key(as_dict) == float_check.cell_key(cells[0])


def test_the_comparison_counts_changed_words_and_the_printed_words_a_rerun_was_expected_to_lose(tmp_path, monkeypatch):
    monkeypatch.setattr(table3, "RESULTS", tmp_path)
    (tmp_path / "sweep").mkdir()
    rng = np.random.default_rng(4)
    effect = {"none": 0.0, "mecefo": 3.0, "drop": 0.4, "spread-mecefo": 0.0}
    cells = [cell(lvl, p, s, 100 * np.exp((s + (effect[p] if lvl != "none" else 0) + rng.normal(0, 0.3)) / 100))
             for lvl, ps in (("none", ("none",)), ("high", ("mecefo", "drop", "spread-mecefo"))) for p in ps for s in range(3)]
    (tmp_path / "sweep" / "index-default.json").write_text(json.dumps(index(cells, "default")))
    original = table3.decide_table(*table3.load_cells("default"))
    same = float_check.compare(original, original)
    assert same["words_changed"] == 0 and same["directions_lost"] == 0 and same["directions_printed"] >= 1
    assert same["directions_lost_new_seeds"] == pytest.approx(sum(1 - r["repeat"] for r in original["rows"]
                                                                  if r["word"].startswith(("worse", "better"))))
    moved = [dict(c, val_ppl=c["val_ppl"] * (1.04 if c["policy"] == "drop" else 1.0)) for c in cells]
    (tmp_path / "sweep" / "index-default.json").write_text(json.dumps(index(moved, "default")))
    rerun = table3.decide_table(*table3.load_cells("default"))
    diff = float_check.compare(original, rerun)
    drop = diff["rows"]["main:high:drop:mecefo/main:none:none:mecefo"]
    assert drop["original"]["word"] != drop["rerun"]["word"] and diff["words_changed"] >= 1


def test_the_printed_rows_runs_are_the_ones_rerun_and_the_rows_they_touch_are_compared(tmp_path, monkeypatch):
    monkeypatch.setattr(table3, "RESULTS", tmp_path)
    (tmp_path / "sweep").mkdir()
    rng = np.random.default_rng(5)
    effect = {"none": 0.0, "mecefo": 4.0, "drop": 0.0, "spread-mecefo": 0.0}
    cells = [cell(lvl, p, s, 100 * np.exp((s + (effect[p] if lvl != "none" else 0) + rng.normal(0, 0.2)) / 100))
             for lvl, ps in (("none", ("none",)), ("high", ("mecefo", "drop", "spread-mecefo"))) for p in ps for s in range(3)]
    (tmp_path / "sweep" / "index-default.json").write_text(json.dumps(index(cells, "default")))
    loaded, meta = table3.load_cells("default")
    table = table3.decide_table(loaded, meta)
    printed = [r for r in table["rows"] if not r["word"].startswith("not decided")]
    keys = float_check.printed_cells(table, loaded)
    # printed: mecefo − failure-free and mecefo − drop (4 points against noise of ~0.3); spread's runs are not behind them
    assert {r["comparison"] for r in printed} == {"mecefo − failure-free", "mecefo − drop"}
    assert keys == {float_check.cell_key(c) for c in loaded
                    if (c["level"], c["policy"]) in {("none", "none"), ("high", "mecefo"), ("high", "drop")}}
    rows = float_check.touched(table, keys, loaded)
    assert {r["id"] for r in printed} <= rows and "main:high:spread-mecefo:mecefo/main:none:none:mecefo" in rows
