"""mecefo.checkpoint: the latest is always OUT/checkpoint (a link to a whole folder); the K - 1 highest steps written
before it stay beside it (train.keep_checkpoints), each holding what was written at its step; DCP checkpoints load
into another layout."""

import json
import os

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


# ------------------------------------------------------------------ checkpoints that prove themselves

DAMAGES = ("truncate", "flip", "remove", "add", "no_digest")


def _damage(folder, how: str, pick: int) -> str:
    """Damage one file of a checkpoint folder as a torn copy, a bad disk or a stray write would; returns the file."""
    files = sorted(p for p in folder.iterdir() if p.name != checkpoint.DIGEST)
    target = files[pick % len(files)]
    if how == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif how == "flip":  # the same size, one byte changed
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif how == "remove":
        target.unlink()
    elif how == "add":
        (folder / "__9_0.distcp").write_bytes(b"x")
        return "__9_0.distcp"
    else:
        (folder / checkpoint.DIGEST).unlink()
        return checkpoint.DIGEST
    return target.name


@settings(max_examples=30, deadline=None)
@given(how=st.sampled_from(DAMAGES), pick=st.integers(0, 10))
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path_factory, how, pick):
    """Every file a checkpoint holds (DCP's tensors and metadata, state.pt) is in its digest with its size and SHA-256;
    truncated, changed in place (the same size), missing, added or unsealed: the load refuses it in one line naming the
    file, before anything is read."""
    import torch

    path = tmp_path_factory.mktemp("ckpt") / "checkpoint"
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    checkpoint.save(path, 7, "h", {"progress": {"step": 7}}, checkpoint.tensors(model, optimizer))
    assert checkpoint.load(path, "h")["step"] == 7  # intact: verifies
    folder = path.resolve()
    written = json.loads((folder / checkpoint.DIGEST).read_text())["files"]
    assert sorted(written) == sorted(p.name for p in folder.iterdir() if p.name != checkpoint.DIGEST)
    name = _damage(folder, how, pick)
    with pytest.raises(checkpoint.Corrupt) as e:
        checkpoint.load(path, "h")
    assert name in str(e.value) and "\n" not in str(e.value)


def _run(out, *extra):
    return main([*NANO, "--steps", "8", "--eval_every", "8", "--checkpoint_every", "2", "--quiet", "--out", str(out),
                 *extra])


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_newest_intact_one_and_the_run_equals_its_twin(tmp_path, capsys):
    """--keep_checkpoints 2, stopped after step 6 (checkpoints 4 and 6), one shard of step 6's truncated (a torn copy):
    --resume says in one line which was skipped and why, continues from step 4's and ends with the losses of the run
    that was never interrupted (the CPU run is deterministic); the torn folder is set aside (<name>.corrupt), not
    deleted. With no intact checkpoint left, the resume is refused in one line (exit 2) and nothing is touched."""
    from tests.conftest import metrics

    twin = tmp_path / "twin"
    assert _run(twin) == 0
    out = tmp_path / "run"
    assert _run(out, "--keep_checkpoints", "2", "--stop-after", "6") == 0
    newest = (out / "checkpoint").resolve()
    shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    assert _run(out, "--keep_checkpoints", "2", "--resume") == 0
    err = capsys.readouterr().err.strip().splitlines()
    note = [line for line in err if "skipped" in line]
    assert len(note) == 1 and "step 4" in note[0] and newest.name in note[0] and shard.name in note[0]
    assert newest.with_name(newest.name + checkpoint.CORRUPT).is_dir()
    assert [r.get("loss") for r in metrics(out)] == [r.get("loss") for r in metrics(twin)]
    assert [r["step"] for r in metrics(out)] == list(range(9))

    # none intact: refused, nothing touched
    again = tmp_path / "again"
    assert _run(again, "--keep_checkpoints", "2", "--stop-after", "4") == 0
    for folder in [(again / "checkpoint").resolve(), *checkpoint.earlier(again / "checkpoint")]:
        (folder / "state.pt").write_bytes(b"torn")
    before = {p: p.read_bytes() for p in again.rglob("*") if p.is_file()}
    link = os.readlink(again / "checkpoint")
    capsys.readouterr()
    assert _run(again, "--keep_checkpoints", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no checkpoint in") and "is intact" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in again.rglob("*") if p.is_file()} == before and os.readlink(again / "checkpoint") == link


def test_a_checkpoint_written_before_digests_loads_once_sealed_by_hand(tmp_path, capsys):
    """A checkpoint without digest.json (a version before digests) is refused, naming that; `python -m mecefo.checkpoint
    seal` records the digest of one the user trusts, and it loads; one with a digest is not resealed."""
    path = tmp_path / "checkpoint"
    checkpoint.save(path, 3, "h", {})
    (path.resolve() / checkpoint.DIGEST).unlink()
    with pytest.raises(checkpoint.Corrupt, match="no digest.json"):
        checkpoint.load(path, "h")
    assert checkpoint.main(["seal", str(path)]) == 0 and checkpoint.load(path, "h")["step"] == 3
    assert checkpoint.main(["seal", str(path)]) == 2 and "has a digest already" in capsys.readouterr().err


def test_the_launchers_last_line_names_the_checkpoint_resume_will_use_verified(tmp_path):
    """A stopped launch's last line (Supervisor.after_stop) names the newest intact checkpoint, not the newest."""
    from types import SimpleNamespace

    from mecefo.launch import Supervisor

    cfg = config_mod.load(NANO[1], {})
    path = tmp_path / "checkpoint"
    checkpoint.save(path, 20, cfg.hash(), {}, keep=2)
    checkpoint.save(path, 40, cfg.hash(), {}, keep=2)
    view = SimpleNamespace(out=tmp_path, cfg=cfg, stop=lambda: None)
    assert "step 40" in Supervisor.after_stop(view) and "verified" in Supervisor.after_stop(view)
    (path.resolve() / "state.pt").write_bytes(b"")
    line = Supervisor.after_stop(view)
    assert "--resume continues from the checkpoint of step 20" in line and "state.pt is 0 bytes" in line
    (checkpoint.earlier(path)[0] / "state.pt").write_bytes(b"")
    assert "--resume refuses" in Supervisor.after_stop(view) and "is intact" in Supervisor.after_stop(view)
