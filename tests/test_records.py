"""One record schema on every backend: the rows of metrics.jsonl and summary.json have the keys of
mecefo.records (EVAL_ROW, STEP_ROW, SUMMARY) whether the run trained on the local backend, under torchrun
(unsharded or FSDP2) or on torchft under mecefo.launch; the backend's own entries sit under "backend"."""

import json

import pytest

from mecefo.records import EVAL_ROW, STEP_ROW, SUMMARY
from mecefo.train import main
from tests.conftest import NANO, launch, metrics, torchrun

pytestmark = pytest.mark.filterwarnings("ignore")
ARGS = [*NANO, "--steps", "4", "--eval_every", "2", "--ranks", "2", "--quiet"]


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _check(out, backend: str) -> None:
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4], backend
    assert set(rows[0]) == set(EVAL_ROW), backend
    for r in rows[1:]:
        assert set(r) == set(STEP_ROW) | ({"val_loss"} if r["step"] % 2 == 0 else set()), (backend, r["step"])
        assert isinstance(r["backend"], dict)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == set(SUMMARY), backend
    assert summary["backend"]["name"] == backend and summary["rank_agreement"]["identical"]
    assert summary["final_val_loss"] == pytest.approx(rows[-1]["val_loss"])


@pytest.mark.slow
def test_every_backend_writes_the_same_record_schema(tmp_path):
    assert main([*ARGS, "--out", str(tmp_path / "local")]) == 0
    _check(tmp_path / "local", "local")
    _ok(torchrun(2, [*ARGS, "--backend", "torch", "--out", str(tmp_path / "torch")]))
    _check(tmp_path / "torch", "torch")
    _ok(torchrun(2, [*ARGS, "--backend", "torch", "--shard", "fsdp", "--out", str(tmp_path / "fsdp")]))
    _check(tmp_path / "fsdp", "torch")
    _ok(launch(tmp_path / "torchft", *ARGS[2:]))
    _check(tmp_path / "torchft", "torchft")
    assert {"rank", "time"} <= set(metrics(tmp_path / "torchft")[1]["backend"])  # the replica that wrote the row, and its wall clock


def test_the_docs_backend_table_is_the_registrys():
    """docs/training.md's table of backends is generated (python -m paper_figures.readme, run by run_all.sh)."""
    from mecefo.cluster import backends_table
    from paper_figures.readme import block_text

    assert block_text("backends").strip() == backends_table().strip()
