"""The fork server (mecefo.processes): a replica process forked with its imports done, adopted by the launcher, and
the fresh-process fallback when the server is gone."""

import signal
import sys

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a child subreaper is Linux's")


def test_a_forked_replica_is_the_launchers_child_runs_its_command_line_and_a_dead_server_forks_nothing(tmp_path):
    """The fork is reparented to this process (its subreaper) before its pid is answered; it runs `python -m mecefo.ft
    ARGV` with the job's environment and log (here bad input: no config.json, exit status 2, its one line in the log),
    under its own name; signals reach it; once the server is dead, spawn() says so (None) instead of hanging."""
    from mecefo.processes import ForkServer, become_subreaper

    assert become_subreaper()
    server = ForkServer(tmp_path, subprocess_env(), tmp_path / "fork-server.log")
    try:
        assert server.is_ready(wait_s=120), (tmp_path / "fork-server.log").read_text()
        log = tmp_path / "r0.log"
        argv = ["--out", str(tmp_path), "--replica", "0", "--lighthouse", "http://127.0.0.1:1"]
        bad = server.spawn(argv, {"MECEFO_TEST_MARK": "1"}, str(log))
        assert bad is not None and bad.wait(timeout=60) == 2  # (os.waitpid answers only for a child of ours: adopted)
        assert "config.json cannot be read" in log.read_text()
        proc = server.spawn(["--out", str(tmp_path)], {}, str(tmp_path / "r1.log"))  # argparse: --replica missing
        assert proc is not None
        proc.kill()  # killed like a Popen (or it exited first)
        assert proc.wait(timeout=60) in (2, -signal.SIGKILL)
        server.proc.kill()
        server.proc.wait()
        assert server.spawn(argv, {}, str(log)) is None and not server.is_ready()
    finally:
        server.stop()


def test_a_fork_that_looks_for_its_adoption_after_the_middle_process_is_gone_goes_on_at_once(tmp_path):
    """The middle process of the double fork exits as soon as it has the replica's pid; a replica scheduled after that
    (a busy node) was already adopted when it took its parent's pid as the middle's, and then waited for a change of
    parent until the 10 s deadline (the chaos harness: groups of 2 whose second process reached 'waiting' 10.2 s after
    the first; 1 restart in 8 of a scripted group run). Injected: every fork sleeps 0.3 s first."""
    import time

    from mecefo.processes import FAULT_LATE_ADOPTION, ForkServer, become_subreaper

    assert become_subreaper()
    server = ForkServer(tmp_path, subprocess_env(**{FAULT_LATE_ADOPTION: "0.3"}), tmp_path / "fork-server.log")
    try:
        assert server.is_ready(wait_s=120), (tmp_path / "fork-server.log").read_text()
        argv = ["--out", str(tmp_path), "--replica", "0", "--lighthouse", "http://127.0.0.1:1"]
        t0 = time.monotonic()
        proc = server.spawn(argv, {}, str(tmp_path / "r0.log"))
        assert proc is not None and proc.wait(timeout=60) == 2  # bad input (no config.json): it did run
        assert time.monotonic() - t0 < 5  # (was 10.3 s: the adoption deadline)
    finally:
        server.stop()
