"""Golden per-step losses: nano on 4 ranks over a fixed trace with overlapping failures, 10 steps, every
trainer policy, compared exactly on the CPU in fp32 (one intra-op thread, so that the summation order is
the machine's, not the thread pool's). A change of numerics, intended or not, shows here first.

    python -m tests.test_golden --update     # rewrite tests/golden/losses.json after an intended change
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from experiments.common import CONFIGS
from mecefo import config as config_mod
from mecefo.policies import trainer_policies
from mecefo.train import run

GOLDEN = Path(__file__).parent / "golden" / "losses.json"
# ranks 1 (steps 2-5), 0 (4-7) and 3 (5-6) down: at steps 5 three of four ranks are down at once
TRACE = ("0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n2000,remove,node2\n4000,remove,node1\n"
         "5000,remove,node4\n6000,add,node2\n7000,add,node4\n8000,add,node1\n")


def losses(policy: str, folder: Path) -> list[float]:
    trace = folder / "trace.csv"
    trace.write_text(TRACE)
    cfg = config_mod.load(CONFIGS / "nano.toml", {
        "steps": "10", "eval_every": "10", "ranks": "4", "failures": str(trace), "seconds_per_step": "1",
        "policy": policy, "r": "4", "restart_every": "3"})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(cfg, folder / policy, quiet=True)
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (folder / policy / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows[1:]] + [rows[-1]["val_loss"]]


@pytest.mark.parametrize("policy", trainer_policies())
def test_per_step_losses_equal_the_golden_file(policy, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert policy in golden, f"no golden losses for {policy}: run python -m tests.test_golden --update"
    got = losses(policy, tmp_path)
    assert got == golden[policy], "\n".join(f"step {i + 1}: {a!r} != {b!r}" for i, (a, b) in
                                           enumerate(zip(got, golden[policy])) if a != b)


if __name__ == "__main__" and "--update" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        table = {p: losses(p, Path(tmp)) for p in trainer_policies()}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(table, indent=1) + "\n")
    print(f"golden losses of {len(table)} policies -> {GOLDEN}")


def _cfg(policy: str, folder: Path, **extra):
    trace = folder / "trace.csv"
    trace.write_text(TRACE)
    return config_mod.load(CONFIGS / "nano.toml", {
        "steps": "10", "eval_every": "10", "ranks": "4", "failures": str(trace), "seconds_per_step": "1",
        "policy": policy, "r": "4", "restart_every": "3", "low_rank_tau": "4", **extra})


@pytest.mark.parametrize("policy", trainer_policies())
def test_resume_under_failures_is_bit_identical(policy, tmp_path):
    """Stopped at step 5 (three ranks down) and resumed: parameters, metrics and summary equal an
    uninterrupted run's, for every policy (policy state, V1 and its epoch, counters all in the checkpoint)."""
    cfg = _cfg(policy, tmp_path, checkpoint_every="5")
    whole = run(cfg, tmp_path / "whole", quiet=True)
    run(cfg, tmp_path / "parts", stop_after=5, quiet=True)
    parts = run(cfg, tmp_path / "parts", resume=True, quiet=True)
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "parts" / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "wall_time_s")} for r in rows]  # noqa: E731
    rows = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("whole", "parts")]
    assert strip(rows[0]) == strip(rows[1])
    for key in ("final_val_loss", "replayed_steps", "tokens_trained", "skipped_steps"):
        assert whole[key] == parts[key], key
