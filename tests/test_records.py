"""One record schema on every backend: the rows of metrics.jsonl and summary.json have the keys of
mecefo.records (EVAL_ROW, STEP_ROW, SUMMARY) whether the run trained on the local backend, under torchrun
(unsharded or FSDP2) or on torchft under mecefo.launch; the backend's own entries sit under "backend"."""

import json
import os
import subprocess
import sys

import pytest

from experiments.common import CONFIGS, ROOT
from mecefo.records import EVAL_ROW, STEP_ROW, SUMMARY
from mecefo.train import main

pytestmark = pytest.mark.filterwarnings("ignore")
ARGS = ["--config", str(CONFIGS / "nano.toml"), "--steps", "4", "--eval_every", "2", "--ranks", "2", "--quiet"]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}


def _module(*args):
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _check(out, backend: str) -> None:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
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
    torchrun = ["torch.distributed.run", "--standalone", "--nproc_per_node", "2", "mecefo.train", *ARGS, "--backend", "torch"]
    torchrun.insert(4, "-m")
    _module(*torchrun, "--out", str(tmp_path / "torch"))
    _check(tmp_path / "torch", "torch")
    _module(*torchrun, "--shard", "fsdp", "--out", str(tmp_path / "fsdp"))
    _check(tmp_path / "fsdp", "torch")
    _module("mecefo.launch", *ARGS, "--out", str(tmp_path / "torchft"))
    _check(tmp_path / "torchft", "torchft")
    ft = [json.loads(line) for line in (tmp_path / "torchft" / "metrics.jsonl").read_text().splitlines()]
    assert {"rank", "time"} <= set(ft[1]["backend"])  # the replica that wrote the row, and its wall clock
