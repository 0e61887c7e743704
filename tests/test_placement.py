"""GPU placement (mecefo.placement): every process of a node on a GPU of its own, CUDA_VISIBLE_DEVICES honoured,
and a placement NCCL would refuse refused with one line."""

import pytest

from mecefo.errors import UsageError
from mecefo.placement import launcher_gpus, local_device, visible_gpus


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus(4, {}) == ["0", "1", "2", "3"]
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "4,6"}) == ["4", "6"]  # Slurm's allocation on a shared node
    assert visible_gpus(1, {"CUDA_VISIBLE_DEVICES": "GPU-ab12,GPU-cd34"}) == ["GPU-ab12"]  # torch's count rules
    assert visible_gpus(0, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_the_launcher_gives_each_process_its_own_gpu_from_the_inherited_set():
    env = {"CUDA_VISIBLE_DEVICES": "2,3,5,7"}
    placed = launcher_gpus(2, 2, visible_gpus(4, env), env)
    assert placed == [["2", "3"], ["5", "7"]]
    assert len({g for group in placed for g in group}) == 4


@pytest.mark.parametrize("ranks,group", [(2, 1), (3, 1), (1, 2), (2, 2)])
def test_more_processes_than_gpus_is_refused_in_one_line(ranks, group):
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(UsageError) as e:
        launcher_gpus(ranks, group, visible_gpus(1, env), env)
    msg = str(e.value)
    assert "\n" not in msg and "NCCL" in msg and "CUDA_VISIBLE_DEVICES=0" in msg and f"{ranks * group} processes" in msg


def test_torchrun_workers_take_their_local_rank_and_are_refused_beyond_the_visible_gpus():
    assert local_device(8, {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"}) == 5
    assert local_device(1, {}) == 0  # a process started alone: its starter gave it one GPU
    with pytest.raises(UsageError, match="2 processes on this node .* see 1 GPU"):
        local_device(1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3"})


def test_fsdp_on_a_torch_without_unused_parameter_reduce_scatter_is_refused_in_one_line(monkeypatch):
    """The GPU check met torch 2.11 (the device's image), whose FSDP2 lacks set_reduce_scatter_unused_params: a
    neighbour's pieces leave attention unused, and without it the processes' reduce-scatters would not match."""
    from torch.distributed.fsdp import FSDPModule

    from mecefo.engine import shard_model

    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    with pytest.raises(UsageError, match="--shard fsdp needs FSDP2's set_reduce_scatter_unused_params"):
        shard_model(None, None)


def test_the_gpu_check_keeps_a_torchrun_workers_own_traceback():
    """torchrun prefixes a worker's lines with [rankN]: and ends with a traceback of its own (ChildFailedError);
    the check records the worker's (the device's log, shortened)."""
    from experiments.gpu_check import worker_error

    stderr = "\n".join([
        "/x/c10d_logger.py:83: UserWarning: barrier(): using the device under current context.",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/work/main/src/mecefo/engine.py", line 620, in shard_model',
        "[rank0]:     model.set_reduce_scatter_unused_params(True)",
        "[rank0]: AttributeError: 'FSDPGPT' object has no attribute 'set_reduce_scatter_unused_params'",
        "Traceback (most recent call last):",
        '  File "/x/torch/distributed/run.py", line 994, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "mecefo.train FAILED"])
    error = worker_error(stderr)
    assert error.startswith("Traceback") and error.endswith("no attribute 'set_reduce_scatter_unused_params'")
    assert "ChildFailedError" not in error and "[rank0]" not in error
    assert worker_error("error: 2 processes on this node see 1 GPU(s)\n") == "error: 2 processes on this node see 1 GPU(s)"


def test_a_process_given_one_gpu_by_the_launcher_is_its_local_rank_0():
    """mecefo.launch --group_size 2 on CUDA: process 1 of a group sees one GPU; as LOCAL_RANK 1 it would ask for
    cuda:1 (an invalid ordinal). The review found it; now it is local rank 0 of 1, and a local rank beyond the
    visible GPUs is refused in one line."""
    from mecefo.placement import one_gpu

    env = {"RANK": "1", "LOCAL_RANK": "1"} | one_gpu("5")
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and local_device(1, env) == 0 and env["RANK"] == "1"
    with pytest.raises(UsageError, match="LOCAL_RANK=1 but this process sees 1 GPU"):
        local_device(1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": "5"})
