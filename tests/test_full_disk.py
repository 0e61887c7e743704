"""A write that cannot succeed (a full disk, a read-only file system, a quota) stops the run at its first occurrence,
with one line and exit 3, the earlier checkpoint intact: for mecefo.train, and for mecefo.launch without spending a
restart. The disk is a small tmpfs (skipped where this machine cannot mount one)."""

import errno
import json
import subprocess

import pytest

from mecefo import checkpoint
from mecefo.errors import guarded
from mecefo.train import main
from tests.conftest import NANO, launch

def _checkpoint_bytes(tmp_path) -> int:
    """The size of one nano checkpoint, written here (889,569 bytes with torch 2.13)."""
    out = tmp_path / "one"
    assert main([*NANO, "--steps", "1", "--eval_every", "1", "--quiet", "--out", str(out)]) == 0
    return sum(p.stat().st_size for p in (out / "checkpoint").resolve().iterdir())


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 1.6 nano checkpoints at tmp_path/disk (unmounted after): the first fits, the second fills it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    size = int(1.6 * _checkpoint_bytes(tmp_path)) // 1024
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine cannot mount a small tmpfs to fill ({mounted.stderr.strip() or 'mount failed'})")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_an_unwritable_write_is_one_line_and_exit_3_wherever_it_is_raised(capsys):
    """The OSError itself, or wrapped as DCP wraps a process's failure (CheckpointException, a BaseException), or as
    the cause of another error; other OSErrors are not turned into a stop."""
    from torch.distributed.checkpoint.api import CheckpointException

    def raises(e):
        def f():
            raise e
        return f

    full = OSError(errno.ENOSPC, "No space left on device", "/run/state.pt")
    for e in (full, CheckpointException("save failed", {0: (full, None)}), OSError(errno.EROFS, "Read-only file system"),
              OSError(errno.EDQUOT, "Disk quota exceeded")):
        assert guarded(raises(e)) == 3
        err = capsys.readouterr().err
        assert err.startswith("stopped: cannot write") and err.count("\n") == 1 and "not retried" in err
    with pytest.raises(FileNotFoundError):
        guarded(raises(FileNotFoundError(errno.ENOENT, "No such file")))


def test_a_full_disk_stops_training_at_once_with_the_earlier_checkpoint_intact(small_disk, capsys):
    out = small_disk / "run"
    code = main([*NANO, "--steps", "8", "--eval_every", "8", "--checkpoint_every", "2", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3 and f"cannot write {out / 'checkpoint'} (step 4): No space left on device (ENOSPC)" in err
    assert err.count("\n") == 1
    assert checkpoint.load(out / "checkpoint", json.loads((out / "config.json").read_text())["config_hash"])["step"] == 2
    assert not list(out.glob(".checkpoint.*"))  # the write that failed left no temporary folder


@pytest.mark.slow
def test_a_full_disk_stops_a_launch_at_once_without_spending_a_restart(small_disk):
    """torchft: the writing replica meets ENOSPC at its second checkpoint; the launch stops with its line and what
    --resume will use (verified), no crash is counted and no replica restarted."""
    out = small_disk / "ft"
    r = launch(out, "--ranks", "2", "--steps", "40", "--eval_every", "40", "--checkpoint_every", "5", "--min-step-s", "0.05")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert "checkpoint (step 10): No space left on device (ENOSPC)" in last
    assert "--resume continues from the checkpoint of step 5" in last
    assert "verified" in last
    assert "crashed" not in r.stdout and "restart after" not in r.stdout
