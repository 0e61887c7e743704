"""Every use of torchft's internals, in this one module.

torchft's public API (its Manager, process groups, lighthouse and checkpoint transports) runs our replicas; a few
behaviours we need have no public switch, so the functions below reach inside, each for one reason. They were read
from torchft READ_FROM (requirements.txt pins it); `problems()` checks each name against the torchft installed, and
a test fails, naming the name and this version, when an upgrade moves one.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

READ_FROM = "0.2.0"

# name -> (where torchft defines it, what we use it for)
PRIVATE = {
    "Manager._client": ("torchft.manager.Manager.__init__", "the manager's lighthouse client, wrapped to keep the last "
                        "quorum's result (mecefo.liveness.QuorumRecorder)"),
    "ManagerClient._quorum": ("torchft._torchft.ManagerClient", "the quorum request the wrapper forwards"),
    "Manager._quorum_id": ("torchft.manager.Manager.__init__", "read, and reset to -1 to make the manager build a new "
                           "process group when a restarted lighthouse repeats a quorum id"),
    "Manager._quorum_future": ("torchft.manager.Manager.__init__", "a failed quorum dropped so that the next "
                               "start_quorum does not raise it again"),
    "Manager._pg": ("torchft.manager.Manager.__init__", "the replica's process group, aborted when a step does not "
                    "commit (a peer blocked on it would wait out the collective timeout)"),
    "Manager._checkpoint_transport": ("torchft.manager.Manager.__init__", "the tests' failing heal (mecefo.faults.HEAL)"),
    "torchft.manager.ManagerServer": ("torchft.manager (the name Manager instantiates)", "wrapped while a Manager is "
                                      "built, so that its server listens on the loopback (it binds [::] otherwise)"),
    "ProcessGroupGloo._timeout": ("torchft.process_group.ProcessGroupGloo.__init__", "shortened for the rendezvous of a "
                                  "new quorum's group, restored after"),
    "ProcessGroupWrapper._pg": ("torchft.process_group.ProcessGroupWrapper", "gloo's backend, whose collectives' "
                                "timeout is set back to the long one after the rendezvous"),
    "ProcessGroup._get_backend": ("torch.distributed.ProcessGroup (torch's, not torchft's)", "that backend"),
}


def problems() -> list[str]:
    """The names of PRIVATE that the installed torchft does not define where they were read (empty: all there)."""
    import torch.distributed as dist
    import torchft.manager as manager
    from torchft import process_group

    init = inspect.getsource(manager.Manager.__init__)
    found = {
        "Manager._client": "self._client" in init,
        "ManagerClient._quorum": hasattr(manager.ManagerClient, "_quorum"),
        "Manager._quorum_id": "self._quorum_id" in init,
        "Manager._quorum_future": "self._quorum_future" in init,
        "Manager._pg": "self._pg" in init,
        "Manager._checkpoint_transport": "self._checkpoint_transport" in init,
        "torchft.manager.ManagerServer": hasattr(manager, "ManagerServer") and "ManagerServer(" in init,
        "ProcessGroupGloo._timeout": "self._timeout" in inspect.getsource(process_group.ProcessGroupGloo),
        "ProcessGroupWrapper._pg": "self._pg" in inspect.getsource(process_group.ProcessGroupWrapper),
        "ProcessGroup._get_backend": hasattr(dist.ProcessGroup, "_get_backend"),
    }
    return [name for name in PRIVATE if not found[name]]


# ---------------------------------------------------------------------------------------------- the Manager
def client(manager):
    return manager._client


def set_client(manager, wrapped) -> None:
    manager._client = wrapped


def ask_quorum(client_, *args, **kwargs):
    """The lighthouse client's quorum request (what the Manager calls)."""
    return client_._quorum(*args, **kwargs)


def quorum_id(manager) -> int:
    return manager._quorum_id


def forget_process_group(manager) -> None:
    """Make the manager build a new process group at this quorum whatever its id (it builds one only when the id
    changes)."""
    manager._quorum_id = -1


def drop_failed_quorum(manager) -> bool:
    """Whether the manager's last quorum failed (its future holds the error); if so it is dropped, so that the next
    start_quorum does not raise it again."""
    future = manager._quorum_future
    if future is None or not future.done() or future.exception() is None:
        return False
    manager._quorum_future = None
    return True


def abort_process_group(manager) -> None:
    manager._pg.abort()


def wrap_heal_receiver(manager, wrap) -> None:
    """Replace the checkpoint transport's recv_checkpoint by wrap(recv_checkpoint)."""
    transport = manager._checkpoint_transport
    transport.recv_checkpoint = wrap(transport.recv_checkpoint)


class manager_server_bound_to:
    """torchft 0.2.0's Manager binds its ManagerServer to [::] with no argument to change it: while the Manager
    is built, the class it instantiates is wrapped so that the server listens on `bind` (process-local)."""

    def __init__(self, bind: str):
        self.bind = bind

    def __enter__(self):
        import torchft.manager as manager

        self.module, self.original = manager, manager.ManagerServer
        original, host = self.original, (self.bind if self.bind != "0.0.0.0" else "[::]")
        manager.ManagerServer = lambda **kw: original(**{**kw, "bind": f"{host}:{kw['bind'].rsplit(':', 1)[1]}"})

    def __exit__(self, *exc):
        self.module.ManagerServer = self.original


# ---------------------------------------------------------------------------------------------- process groups
def group_timeout(pg) -> timedelta:
    return pg._timeout


def set_group_timeout(pg, timeout: timedelta) -> None:
    """The timeout torchft's process group gives the next group it configures (its rendezvous, with gloo)."""
    pg._timeout = timeout


def set_collective_timeout(pg, timeout: timedelta) -> None:
    """The configured gloo group's collectives' timeout."""
    import torch

    pg._pg._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
