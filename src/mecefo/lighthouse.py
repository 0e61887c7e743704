"""torchft's lighthouse, the one place that knows how we run it and how we read it.

The lighthouse (torchft's `torchft_lighthouse` binary) forms the quorums: every replica's manager heartbeats to it
and asks it who takes part in a step. `mecefo.launch` runs it on the loopback beside the replicas (`Lighthouse`);
on a Slurm allocation `python -m mecefo.slurm lighthouse` runs it on every interface of the first node (`command`).
Both use the settings below. Its status page is the only view of it we read (`read_status`): who heartbeats, who
it counts dead, the current quorum and its age.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .errors import TrainingStopped, UsageError
from .processes import die_with_parent

# How long the lighthouse waits for a live (heartbeating) replica that has not asked for the quorum yet before
# forming one without it; a dead one drops out at the heartbeat timeout (0.5 s) whatever this is. It must exceed
# the longest step plus heal: with 500 ms, a replica kept waiting through a peer's 5 s heal made the next quorum
# form the moment one other peer arrived, leaving the third out by milliseconds, which then had to heal: the
# replicas took turns healing every 2-3 steps for ever (measured). Below the quorum timeout (MECEFO_FT_TIMEOUT_S).
JOIN_TIMEOUT_MS = int(os.environ.get("MECEFO_FT_LIGHTHOUSE_JOIN_MS", "20000"))
# A replica whose manager has not heartbeated (every 100 ms, from torchft's manager server thread, which Python's GIL
# does not hold up) for this long is dead to the lighthouse: the floor of the time from a kill to the next step. The
# chaos harness: with 1000 ms, kill -> next step was 1.0-1.1 s at best (p95 3.8 s); with 500 ms, 0.5-0.6 s.
HEARTBEAT_TIMEOUT_MS = int(os.environ.get("MECEFO_FT_HEARTBEAT_MS", "500"))
QUORUM_TICK_MS = 20
PORT = 29510  # the Slurm recipe's port (MECEFO_LIGHTHOUSE_PORT)
START_S = 60.0  # a lighthouse started here must answer within this long


def binary() -> str:
    """torchft's torchft_lighthouse, installed beside this interpreter (a virtual environment's bin/) or on PATH."""
    beside = Path(sys.executable).with_name("torchft_lighthouse")
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise UsageError("torchft's torchft_lighthouse is not installed (pip install -r requirements.txt)")
    return found


def command(bind: str) -> list[str]:
    """The lighthouse's command line, listening on `bind` (host:port), with our settings."""
    return [binary(), "--bind", bind, "--min_replicas", "1", "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
            "--quorum_tick_ms", str(QUORUM_TICK_MS), "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]


def environment() -> dict:
    """The lighthouse's environment: ours, its Rust log at warn unless RUST_LOG says otherwise (it logs every quorum
    at info)."""
    return {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}


@dataclass(frozen=True)
class Status:
    """The lighthouse's view (its status page): seconds since each replica's last heartbeat, the replicas it
    counts dead (heartbeat older than its timeout), the current quorum id and seconds since the last quorum."""

    heartbeats: dict
    dead: frozenset
    quorum_id: int
    quorum_age_s: float | None
    max_step: int | None  # the highest step among the last quorum's members (None: no quorum yet)


_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(\S+): seen ([0-9.]+)s ago')
_QUORUM_ID = re.compile(r"Current quorum_id: (\d+)")
_QUORUM_AGE = re.compile(r"Quorum age:\s*([0-9.]+)s")
_MEMBER_STEP = re.compile(r"Step: (-?\d+)")


def parse_status(html: str) -> Status:
    """torchft 0.2.0's status page (templates/status.html) as a Status."""
    beats = {m.group(2): float(m.group(3)) for m in _HEARTBEAT.finditer(html)}
    dead = frozenset(m.group(2) for m in _HEARTBEAT.finditer(html) if m.group(1))
    qid, age = _QUORUM_ID.search(html), _QUORUM_AGE.search(html)
    steps = [int(m.group(1)) for m in _MEMBER_STEP.finditer(html)]
    return Status(beats, dead, int(qid.group(1)) if qid else 0, float(age.group(1)) if age else None,
                  max(steps) if steps else None)


def read_status(address: str, timeout_s: float = 1.0) -> Status | None:
    """The lighthouse's view, or None if it cannot be reached (down, restarting, another server)."""
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout_s) as r:
            return parse_status(r.read().decode("utf-8", "replace"))
    except (OSError, urllib.error.URLError, ValueError):
        return None


def wait_until_up(address: str, seconds: float, alive=lambda: True, where: str = "") -> None:
    """Wait until the lighthouse at `address` answers; TrainingStopped after `seconds`, or once alive() is False (the
    process we started died)."""
    deadline = time.monotonic() + seconds
    while read_status(address, timeout_s=0.5) is None:
        if not alive():
            raise TrainingStopped(f"torchft's lighthouse did not start on {address}{where}")
        if time.monotonic() > deadline:
            raise TrainingStopped(f"the lighthouse at {address} did not answer for {seconds:g} s{where}")
        time.sleep(0.05)


class Lighthouse:
    """The lighthouse as a process of ours, listening on 127.0.0.1 (one node), dying with us; a chaos event can
    SIGKILL it and start a new one on the same address (its quorums and heartbeats are gone, as after a crash).
    Its log: `log`."""

    def __init__(self, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address, self.log, self.proc = f"http://127.0.0.1:{self.port}", Path(log), None
        self.start()
        try:
            wait_until_up(self.address, START_S, alive=lambda: self.proc.poll() is None, where=f" (see {self.log})")
        except TrainingStopped:
            self.kill()
            raise

    def start(self) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(command(f"127.0.0.1:{self.port}"), stdout=log, stderr=subprocess.STDOUT,
                                         env=environment(), start_new_session=True, preexec_fn=die_with_parent)

    def died(self) -> int | None:
        """Its exit status if it died (None while it lives)."""
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.start()
