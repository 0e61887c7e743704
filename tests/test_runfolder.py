"""mecefo.runfolder: OUT/run.lock held by the kernel (flock), so a run killed however it dies leaves no lock, two
processes racing for one folder never both hold it, and a refusal names the holder."""

import os
import signal
import subprocess
import sys

import pytest

from mecefo.errors import UsageError
from mecefo.runfolder import lock_holder, release_lock, take_lock
from tests.conftest import lock_holding_process, subprocess_env


def test_a_held_lock_refuses_others_names_its_holder_and_is_free_once_its_process_is_killed(tmp_path):
    out = tmp_path / "run"
    holder = lock_holding_process(out)
    try:
        assert lock_holder(out) == holder.pid
        with pytest.raises(UsageError, match=f"in use by a live run \\(pid {holder.pid}"):
            take_lock(out)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / "run.lock").exists() and lock_holder(out) is None  # its file remains, its lock does not
    take_lock(out)
    try:
        assert (out / "run.lock").read_text() == f"{os.getpid()}\n" and lock_holder(out) is None  # ours
        with pytest.raises(UsageError, match="in use by a run of this process"):
            take_lock(out)
    finally:
        release_lock(out)
    assert not (out / "run.lock").exists()
    release_lock(out)  # not held: nothing to do


def test_processes_racing_for_one_folder_hold_it_one_at_a_time(tmp_path):
    """Eight processes each take and release the lock 30 times, appending 'in' and 'out' to a shared file while they
    hold it: the lines alternate (nobody was ever in with another), and every take eventually succeeded or was refused
    with the one-line error, never anything else."""
    out, log = tmp_path / "run", tmp_path / "log"
    code = """
import sys, time
from pathlib import Path
from mecefo.errors import UsageError
from mecefo.runfolder import take_lock, release_lock
out, log, took = Path(sys.argv[1]), sys.argv[2], 0
for _ in range(30):
    try:
        take_lock(out)
    except UsageError as e:
        assert "is in use by a live run" in str(e), e
        continue
    with open(log, "a") as f:
        f.write("in\\n"); f.flush()
        time.sleep(0.002)
        f.write("out\\n")
    release_lock(out)
    took += 1
print(took)
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, str(out), str(log)], env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]
    lines = log.read_text().split()
    assert lines == ["in", "out"] * (len(lines) // 2) and len(lines) // 2 == sum(int(r[0]) for r in results) > 0
