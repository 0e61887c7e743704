"""Checkpoint-restart: every rank computes (spare nodes replace the failed ones); each new failure rolls
everyone back to the last checkpoint, taken every `restart_every` steps, and the steps since are replayed.
In the simulator the checkpoint interval is Young/Daly's sqrt(2 C MTBF) (C = checkpoint_s) and a failure
costs the work since the last checkpoint, the wait for a spare (replacement_delay_s) and a full restart
(restart_s: relaunch, rendezvous, checkpoint reload); a recovered GPU returns to the spare pool."""

from __future__ import annotations

import copy
import math

from ..errors import UsageError
from . import Policy, register


def snapshot(model, optimizer) -> dict:
    """An in-memory checkpoint."""
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict())}


def restore(model, optimizer, snap: dict) -> None:
    """Back to the snapshot; copies, because load_state_dict keeps the optimizer's state tensors as given
    and training would then advance the snapshot itself (a second rollback to it would be wrong)."""
    model.load_state_dict(snap["model"])
    optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))


@register
class CheckpointRestart(Policy):
    name = "checkpoint-restart"
    summary = "each new failure rolls everyone back to the last checkpoint and replays; spare nodes replace failed ones"
    order = 5
    exact = True
    rolls_back = True

    def __init__(self, config=None, techniques=None):
        super().__init__(config, techniques)
        self.every = config.restart_every if config is not None else 50
        self.snapshot, self.snapshot_step, self.consumed, self.replayed = None, 0, [], 0

    @classmethod
    def validate(cls, config) -> None:
        if config.shard == "fsdp":
            raise UsageError("cluster.policy='checkpoint-restart' keeps a whole-model snapshot; it does not run "
                             "with cluster.shard='fsdp'")

    def effective_failed(self, failed):
        return frozenset()  # spare nodes take the failed ones' places after the restart

    def before_step(self, step, schedule, model, optimizer):
        if self.snapshot is None:  # the run's start: the first checkpoint
            self.snapshot, self.snapshot_step = snapshot(model, optimizer), step
        if schedule.new_failures(step) and step not in self.consumed:
            self.consumed.append(step)  # a new failure: everyone rolls back to the last checkpoint
            self.replayed += step - self.snapshot_step
            restore(model, optimizer, self.snapshot)
            return self.snapshot_step
        return None

    def after_step(self, step, model, optimizer):
        if step % self.every == 0:
            self.snapshot, self.snapshot_step = snapshot(model, optimizer), step

    @property
    def replayed_steps(self) -> int:
        return self.replayed

    def state_dict(self) -> dict:
        return {"snapshot": self.snapshot, "snapshot_step": self.snapshot_step, "consumed": list(self.consumed),
                "replayed": self.replayed}

    def load_state_dict(self, state: dict) -> None:
        self.snapshot, self.snapshot_step = state["snapshot"], state["snapshot_step"]
        self.consumed, self.replayed = list(state["consumed"]), state["replayed"]

    def sim_checkpoint_interval(self, job, cost, mtbf_s):
        """Young/Daly: sqrt(2 C MTBF) / step time, in steps (None without failures)."""
        if not math.isfinite(mtbf_s):
            return None
        return max(1, round(math.sqrt(2 * job.const("checkpoint_s") * mtbf_s) / sum(cost.base.values())))

    def sim_on_failure(self, job, unit, down, t, sim):
        return job.const("replacement_delay_s") + job.const("restart_s")

    def sim_on_recovery(self, job, unit, down, t, sim):
        return 0.0
