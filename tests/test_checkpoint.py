"""mecefo.checkpoint: the latest is always OUT/checkpoint (a link to a whole folder); the K - 1 highest steps written
before it stay beside it (train.keep_checkpoints), each holding what was written at its step; DCP checkpoints load
into another layout."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo import checkpoint
from mecefo import config as config_mod
from mecefo.errors import UsageError
from mecefo.train import main
from tests.conftest import NANO


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.integers(0, 30), min_size=1, max_size=12), keep=st.integers(1, 4))
def test_the_latest_and_the_highest_earlier_steps_are_kept_each_with_its_own_contents(tmp_path_factory, steps, keep):
    """Any sequence of writes, rollbacks (a lower step after a higher one) and rewrites of a step included."""
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint"
    written = {}  # step -> the write (its index) that was current last at that step, before being replaced
    for i, step in enumerate(steps):
        if i:
            written[steps[i - 1]] = i - 1
        checkpoint.save(path, step, "h", {"write": i}, keep=keep)
        assert checkpoint.read(path)["step"] == step and checkpoint.read(path)["write"] == i
    expected = sorted(written)[-(keep - 1):] if keep > 1 else []
    kept = checkpoint.earlier(path)
    assert [checkpoint.read(p)["step"] for p in kept] == expected
    assert [checkpoint.read(p)["write"] for p in kept] == [written[s] for s in expected]
    assert not list(path.parent.glob(".*"))  # no temporary file or link left


def test_keep_checkpoints_is_checked_and_does_not_change_a_runs_identity(nano_cfg):
    assert config_mod.with_overrides(nano_cfg, train={"keep_checkpoints": 3}).hash() == nano_cfg.hash()
    with pytest.raises(UsageError, match="keep_checkpoints=0 must be at least 1"):
        config_mod.with_overrides(nano_cfg, train={"keep_checkpoints": 0})


def test_a_run_keeps_its_earlier_checkpoints_and_resumes_from_one_copied_back(tmp_path):
    """--keep_checkpoints 2 over checkpoints at steps 4 and 8: step 4 stays beside the latest; linked back as
    OUT/checkpoint, --resume trains steps 5-8 again, to the same losses (the CPU run is deterministic)."""
    import os

    from tests.conftest import metrics

    out = tmp_path / "run"
    args = [*NANO, "--steps", "8", "--eval_every", "8", "--checkpoint_every", "4", "--quiet", "--out", str(out)]
    assert main([*args, "--keep_checkpoints", "2"]) == 0
    first = [r["loss"] for r in metrics(out)[1:]]
    kept = checkpoint.earlier(out / "checkpoint")
    assert [p.name.split("-")[1] for p in kept] == ["00000004"] and checkpoint.read(kept[0])["step"] == 4
    (out / "checkpoint").unlink()
    os.symlink(kept[0].name, out / "checkpoint")
    (out / "summary.json").unlink()  # (a finished run is reused, not resumed)
    assert main([*args, "--keep_checkpoints", "2", "--resume"]) == 0
    assert [r["loss"] for r in metrics(out)[1:]] == first
