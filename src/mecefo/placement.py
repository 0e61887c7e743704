"""Which GPU each process of a node uses. NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU
detected"), and it refuses it again at every restart: a placement that puts two processes of one communicator on
one GPU is refused here, with one line, before anything starts. The communicators: a torchrun job's world (the
torch backend), a replica group's processes (torchft with --shard fsdp), and process j of every replica group
(torchft's cross-replica all-reduce), so under mecefo.launch every process on the node needs a GPU of its own.

The GPUs a node offers are the ones CUDA_VISIBLE_DEVICES lists when it is set (Slurm sets it to the allocation's
GPUs; ids or UUIDs), else every device torch sees."""

from __future__ import annotations

import os

from .errors import UsageError

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_gpus(count: int, environ=os.environ) -> list[str]:
    """The node's GPUs as CUDA_VISIBLE_DEVICES names them (count: torch.cuda.device_count() under that setting)."""
    listed = environ.get(VISIBLE)
    if listed is None:
        return [str(i) for i in range(count)]
    names = [g.strip() for g in listed.split(",") if g.strip()]
    return names[:count]  # (CUDA stops at the first invalid entry: torch's count says how many it took)


def launcher_gpus(ranks: int, group_size: int, gpus: list[str], environ=os.environ) -> list[list[str]]:
    """mecefo.launch on one node: the CUDA_VISIBLE_DEVICES of process j of rank r, gpus[r * group_size + j];
    refused when the node has fewer GPUs than processes (two would share one in a communicator)."""
    need = ranks * group_size
    if need > len(gpus):
        raise UsageError(f"{ranks} ranks x --group_size {group_size} = {need} processes need as many GPUs on this node, "
                         f"one each (NCCL refuses two ranks of one communicator on one GPU); it has {len(gpus)}"
                         f"{_shown(environ)}")
    return [[gpus[r * group_size + j] for j in range(group_size)] for r in range(ranks)]


def one_gpu(gpu: str) -> dict:
    """The environment of a process its starter gives one GPU (mecefo.launch): that GPU alone visible, and the
    process local rank 0 of 1 (its group rank stays in RANK)."""
    return {VISIBLE: gpu, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def local_device(count: int, environ=os.environ) -> int:
    """The CUDA device index of this process: torchrun's LOCAL_RANK among the LOCAL_WORLD_SIZE processes of the node
    (0 for a process started alone, which its starter gave one GPU); refused when the node's processes outnumber
    the GPUs they see."""
    local, processes = int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_WORLD_SIZE", "1"))
    shown = _shown(environ)
    if processes > count:
        raise UsageError(f"{processes} processes on this node (torchrun's --nproc_per_node) see {count} GPU(s){shown}: "
                         "NCCL refuses two ranks of one communicator on one GPU; start at most one process per GPU")
    if local >= count:
        raise UsageError(f"LOCAL_RANK={local} but this process sees {count} GPU(s){shown}: give each process its own "
                         "GPU (one visible: LOCAL_RANK=0), or all of the node's")
    return local


def _shown(environ) -> str:
    """The inherited CUDA_VISIBLE_DEVICES, for a refusal's line."""
    return f" ({VISIBLE}={environ[VISIBLE]})" if VISIBLE in environ else ""
