"""Process plumbing the launcher and its replicas share: a replica that dies with its launcher, and a replica
group's TCPStore bound to one address."""

from __future__ import annotations

import signal


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
