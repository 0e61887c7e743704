"""Process plumbing the launcher and its replicas share: a replica that dies with its launcher, a replica group's
TCPStore bound to one address, and the fork server that starts replica processes with their imports done."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable


def die_with_parent() -> None:
    """In a replica before it starts (Linux): SIGKILL it when the launcher dies, however the launcher dies
    (a SIGKILL of the launcher cannot run its clean-up, and the replicas are in their own session)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def group_store(host: str, bind: str):
    """A replica group's TCPStore (a bare process must host one; torchrun would), listening on `bind` only
    (a TCPStore given a host name still listens on every interface; a socket handed to it does not)."""
    import socket

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((bind, 0))
    port = sock.getsockname()[1]
    return TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())


# ---------------------------------------------------------------------------------------------- the fork server
# A restarted replica used to start a fresh interpreter and import torch, torchft and the trainer: about 3 s of CPU,
# 5-9 s on a 2-core node busy training (the chaos harness's restart -> rejoin tail), and a pool of pre-started
# spares ran dry in bursts of kills. The fork server pays the imports once: every replica process is then a fork
# of it, ready in milliseconds. A fork is reparented to the launcher (a child subreaper), which waits for it and
# signals it as for a process it started itself. Linux only, and only on the CPU (torch reads
# CUDA_VISIBLE_DEVICES once, and CUDA does not survive a fork).

PR_SET_CHILD_SUBREAPER = 36
FAULT_LATE_ADOPTION = "MECEFO_FORK_FAULT_LATE_ADOPTION"  # SECONDS: a fork sleeps this long before it waits to be adopted
PR_SET_NAME = 15


def _prctl(option: int, value) -> bool:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Make this process (the launcher) the parent of its descendants' orphans: a replica forked by the fork server
    becomes its child. False where the kernel has no such thing (not Linux)."""
    return sys.platform == "linux" and _prctl(PR_SET_CHILD_SUBREAPER, 1)


class Adopted:
    """A replica process forked by the fork server and reparented to this launcher: subprocess.Popen's poll, wait,
    send_signal and kill, on its pid."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours (never happens once adopted): it is gone for this launcher
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.002)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: `python -m mecefo.ft --out OUT --fork-server`, started with the replicas' environment.
    It says "ready" once its imports are done; then each job line {"argv", "env", "log"} is answered with the pid of
    a new replica process. Any failure (it died, a garbled answer): it is killed and spawn() returns None, and the
    launcher starts that replica as a fresh interpreter."""

    ANSWER_S = 10.0  # a ready server forks in milliseconds; this long without an answer, it is broken

    def __init__(self, out, env: dict, log_path):
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "mecefo.ft", "--out", str(out), "--fork-server"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         start_new_session=True, preexec_fn=die_with_parent)
        self.ready, self.buffer = False, b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _line(self, timeout_s: float) -> str | None:
        """The server's next line within timeout_s (None: none yet, or it died)."""
        import select

        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left < 0 or not select.select([self.proc.stdout], [], [], max(left, 0))[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:  # it died
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def is_ready(self, wait_s: float = 0.0) -> bool:
        if not self.ready and self.alive():
            line = self._line(wait_s)
            if line is not None:
                self.ready = line == "ready"
                if not self.ready:
                    self.stop()
        return self.ready and self.alive()

    def spawn(self, argv: list[str], env: dict, log: str) -> Adopted | None:
        if not self.is_ready():
            return None
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": log}) + "\n").encode())
            self.proc.stdin.flush()
            answer = self._line(self.ANSWER_S)
            return Adopted(int(answer))
        except (OSError, ValueError, TypeError):
            self.stop()
            return None

    def stop(self) -> None:
        self.ready = False
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def serve(entry: Callable[[list[str]], int]) -> int:
    """The fork server itself: imports what a replica needs, says "ready", then forks a replica per job line until
    its input ends. Each job is forked twice (the middle process exits at once), so that the replica is reparented
    to the launcher, its subreaper, before the pid is answered; the replica then takes its own session, dies with
    the launcher, writes to its log and returns `entry(ARGV)` as its exit status, with the job's environment
    (entry: mecefo.ft's, which calls this; so this module imports no replica code of its own)."""
    import torch._dynamo  # noqa: F401  (what torch.optim's first optimizer imports, ~1 s)
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torchft  # noqa: F401

    from . import train  # noqa: F401

    launcher = os.getppid()
    os.write(1, b"ready\n")
    for line in sys.stdin.buffer:
        job = json.loads(line)
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(read)
            me = os.getpid()  # (not the replica's getppid(): the middle may have exited, and the replica been
            replica = os.fork()  # adopted, before it asks; it then waited the whole adoption deadline, 10 s)
            if replica == 0:
                os.close(write)
                if os.environ.get(FAULT_LATE_ADOPTION):  # (tests: the middle is gone before the replica looks)
                    time.sleep(float(os.environ[FAULT_LATE_ADOPTION]))
                _become(job, launcher, me, entry)
            os.write(write, f"{replica}\n".encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as answer:
            pid = answer.read().strip()
        os.waitpid(middle, 0)  # gone: the replica is the launcher's now
        os.write(1, f"{pid}\n".encode())
    return 0


def _become(job: dict, launcher: int, middle: int, entry: Callable[[list[str]], int]) -> None:
    """In a forked replica: wait to be adopted by the launcher, then run the replica's command line (never returns)."""
    code = 1
    try:
        os.setsid()
        deadline = time.monotonic() + 10
        while os.getppid() == middle and time.monotonic() < deadline:
            time.sleep(0.0005)
        die_with_parent()
        if os.getppid() != launcher:  # the launcher died meanwhile (or did not adopt it)
            os._exit(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.update(job["env"])
        rank = job["argv"][job["argv"].index("--replica") + 1] if "--replica" in job["argv"] else "?"
        within = f".{os.environ.get('RANK', '0')}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        _prctl(PR_SET_NAME, f"mecefo-r{rank}{within}".encode())  # (ps -o comm, top: its command line is the server's)
        code = entry(job["argv"])
    except BaseException:  # (the entry turns its own errors into exit statuses: this is a fault of the fork's set-up)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
