"""Cluster-scale throughput of fault-tolerance policies on failure traces: a discrete-event simulation whose
step time comes from a cost model, not from lookup tables.

Layout: dp data-parallel replicas x pp pipeline stages (one GPU each; tensor parallelism is folded into
the MFU). Failure unit: one GPU = one (replica, stage) cell; unit u is replica u // pp, stage u % pp.
Cost model of one optimizer step, m = global_batch / (dp * b) micro-batches of b sequences per replica:
    t_mb   = FLOPs(micro-batch, one stage) / (peak * MFU)   (costs.analytic_flops, layers split evenly)
    1F1B   compute = (m + pp - 1) t_mb, of which (pp - 1) t_mb is bubble
    ring all-reduce of a stage's bf16 gradients over dp replicas: 2 (dp - 1) / dp * bytes / bandwidth
      (NVLink when the replicas fit in one node, else InfiniBand), of which a fraction `overlap` is hidden
    step time = compute + (1 - overlap) all-reduce
    a neighbour covering k failed GPUs: (k + 1) m micro-batches under the techniques, and per step the low-rank
      factors' V1^T products and 1/tau of a V1 refresh (its stage's SVDs: costs.refresh_flops' estimate)
Policies come from the registry (mecefo.policies): each gives the breakdown and trained tokens of a step
with a failed set held fixed (a synchronous step is as slow as its slowest GPU), the pause of a failure
or recovery event, and, for checkpoint-restart, a checkpoint interval after which work is safe.
Every policy loses the partial step in flight when a GPU fails. Throughput = trained tokens / wall time;
dropped samples and rolled-back steps are not trained tokens. The time breakdown (compute, bubble,
communication, redundant, degraded, pause, checkpoint, lost_work) sums to the wall time.

The baselines' constants (pauses, restart and checkpoint times, Bamboo's fallback) are read from
simulator_constants.json, each with its public source; a Job field left at None takes that value. Four
fields are hypotheses about the paper's setting, neutral by default (experiments/hypotheses.py sweeps them):
neighbour_slack (H2), neighbour_alpha (H3), failure_unit (H4) and spread_width (H5).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import numpy as np

from .costs import Shape, analytic_flops, refresh_flops
from .failures import REFERENCE_RANKS, Event, FailureScenario, generate
from .model import count_parameters, preset
from .neighbour import Techniques
from .policies import Policy, get, simulator_policies

GPUS = {"A100": {"peak_flops": 312e12, "memory_bytes": 80e9}, "H100": {"peak_flops": 989e12, "memory_bytes": 80e9}}
BREAKDOWN = ("compute", "bubble", "communication", "redundant", "degraded", "pause", "checkpoint", "lost_work")


CONSTANTS = Path(__file__).with_name("simulator_constants.json")


@cache
def constants() -> dict:
    """name -> {"value", "source"} from simulator_constants.json; a value may be a per-model table."""
    data = json.loads(CONSTANTS.read_text())
    return {k: v for k, v in data.items() if k != "about"}


def per_model(table: dict, model: str) -> float:
    """A per-model constant; a model not in the table takes the entry nearest in log-parameters."""
    if model in table:
        return table[model]
    size = math.log(count_parameters(preset(model)))
    return table[min(table, key=lambda m: abs(math.log(count_parameters(preset(m))) - size))]


@dataclass(frozen=True)
class Job:
    model: str = "llama-7b"
    gpu: str = "A100"
    mfu: float = 0.45
    dp: int = 8
    pp: int = 4
    gpus_per_node: int = 8
    micro_batch: int = 2  # sequences
    global_batch: int = 1024  # sequences
    seq_len: int = 256
    nvlink_bytes_s: float = 600e9
    # the all-reduce's bus bandwidth across nodes: the paper's 200 GB/s InfiniBand per node is eight 200 Gb/s HDR
    # NICs, one per GPU; NCCL runs a ring per NIC, each carrying 1/8 of the gradient, so the time of
    # 2 (n-1)/n S / bandwidth is set by the node's 200 GB/s, not one GPU's 25 GB/s
    ib_bytes_s: float = 200e9
    overlap: float = 0.5  # share of the all-reduce hidden behind the backward pass
    techniques: str = "mecefo"  # what a neighbour applies (mecefo.neighbour.Techniques.parse)
    r: float = 0.125  # low-rank width
    low_rank_tau: int = 50
    # the baselines' constants: None = simulator_constants.json's value for this model (Job.const)
    reform_s: float | None = None
    bamboo_fallback: float | None = None
    bamboo_reconfig_s: float | None = None
    bamboo_reconfig_threshold: float | None = None
    bamboo_restart_s: float | None = None
    bamboo_stages: int | None = None
    oobleck_reinstantiate_s: float | None = None
    oobleck_min_stages: int | None = None
    oobleck_rejoin: str | None = None
    checkpoint_s: float | None = None
    restart_s: float | None = None
    replacement_delay_s: float | None = None
    # hypotheses about the paper's setting (neutral defaults)
    neighbour_slack: float = 0.0  # H2: share of a neighbour's extra time hidden in idle time
    neighbour_alpha: float | None = None  # H3: a neighbour's step time / a normal GPU's (None: exact FLOPs)
    neighbour_time_scale: float = 1.0  # a neighbour's micro-batch and apply times / their FLOP times (a measured reading)
    failure_unit: int = 1  # H4: GPUs that fail together (8: a node); the failed fraction is kept
    spread_width: int = 0  # H5: survivors a failed GPU's work is spread over by spread policies (0: all)

    def const(self, name: str):
        """This job's value of a baseline constant: its field, else the data file's (for its model)."""
        own = getattr(self, name)
        if own is not None:
            return own
        value = constants()[name]["value"]
        return per_model(value, self.model) if isinstance(value, dict) else value

    @property
    def gpus(self) -> int:
        return self.dp * self.pp

    @property
    def micro_batches(self) -> int:
        m = self.global_batch // (self.dp * self.micro_batch)
        if m < 1:
            raise ValueError(f"global batch {self.global_batch} < dp {self.dp} x micro-batch {self.micro_batch}")
        return m

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.dp * self.micro_batch * self.seq_len


@dataclass
class CostModel:
    """Times of one step of `job` in seconds, from exact FLOPs."""

    job: Job
    flops_normal: int = 0  # one micro-batch through the whole model, forward + backward
    flops_neighbour: int = 0  # the same with MeCeFO's techniques (without the per-step apply)
    flops_apply: float = 0  # per step: the low-rank factors' V1^T products and one V1 refresh's SVDs / tau
    t_mb: float = 0.0
    t_mb_neighbour: float = 0.0
    t_apply: float = 0.0
    allreduce: float = 0.0

    def __post_init__(self):
        j = self.job
        cfg = preset(j.model)
        shape = Shape(j.micro_batch, j.seq_len)
        normal = analytic_flops(cfg, shape, Techniques(), j.r)
        nb = analytic_flops(cfg, shape, Techniques.parse(j.techniques), j.r)
        self.flops_normal, self.flops_neighbour, self.flops_apply = normal["total"], nb["total"] - nb["wgrad_apply"], nb["wgrad_apply"]
        if Techniques.parse(j.techniques).low_rank_wgrad:  # every GPU computes its stage's V1 (the torch backend shares it)
            self.flops_apply += refresh_flops(cfg, j.r) / j.low_rank_tau
        rate = GPUS[j.gpu]["peak_flops"] * j.mfu * j.pp  # layers split evenly over the stages
        self.t_mb, self.t_mb_neighbour, self.t_apply = self.flops_normal / rate, self.flops_neighbour / rate, self.flops_apply / rate
        self.t_mb_neighbour *= j.neighbour_time_scale
        self.t_apply *= j.neighbour_time_scale
        grad_bytes = 2 * count_parameters(cfg) / j.pp
        bandwidth = j.nvlink_bytes_s if j.gpus <= j.gpus_per_node else j.ib_bytes_s
        self.allreduce = 2 * (j.dp - 1) / j.dp * grad_bytes / bandwidth if j.dp > 1 else 0.0

    @property
    def communication(self) -> float:
        return (1 - self.job.overlap) * self.allreduce

    @property
    def base(self) -> dict[str, float]:
        m, pp = self.job.micro_batches, self.job.pp
        return {"compute": m * self.t_mb, "bubble": (pp - 1) * self.t_mb, "communication": self.communication}

    def parts(self) -> dict[str, float]:
        """The failure-free breakdown of one step, every BREAKDOWN key present."""
        return dict.fromkeys(BREAKDOWN, 0.0) | self.base

    def alpha(self, k: int, exact: bool = False) -> float:
        """Time of a neighbour covering k failed GPUs (its own micro-batches and theirs, all with the
        techniques), relative to a normal GPU (per step); Job.neighbour_alpha replaces alpha(1) (H3)."""
        m = self.job.micro_batches
        if exact:
            return float(k + 1)
        if self.job.neighbour_alpha is not None:
            return 1 + k * (self.job.neighbour_alpha - 1)
        return ((k + 1) * self.t_mb_neighbour * m + self.t_apply) / (self.t_mb * m)

    @property
    def relative_cost(self) -> float:
        """c: the cost of computing one failed GPU's micro-batches with the techniques (the per-step
        low-rank apply and the V1 refresh's SVDs / tau included), relative to computing them normally."""
        m = self.job.micro_batches
        return (self.t_mb_neighbour * m + self.t_apply) / (self.t_mb * m)


def spread_bound(f: float, c: float) -> float:
    """The least throughput drop of a policy that trains every sample while a fraction f of the GPUs is
    down, covering the missing work at relative cost c and spreading it perfectly over the survivors
    (each survivor does 1 + f c / (1 - f) times its work; no pause, no bubble absorbs it):
        drop >= 1 - 1 / (1 + f c / (1 - f))"""
    return 1 - 1 / (1 + f * c / (1 - f))


def cost_needed(drop: float, f: float) -> float:
    """The c at which spread_bound(f, c) equals `drop`."""
    return (1 / (1 - drop) - 1) * (1 - f) / f


@dataclass
class Outcome:
    policy: str
    wall_s: float
    tokens: float
    breakdown: dict[str, float] = field(default_factory=dict)
    events: int = 0

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s


def simulate(job: Job, policy: str | Policy, events: list[Event], horizon_s: float, mtbf_s: float = float("inf"),
             initially_down: frozenset[int] = frozenset(), cost: CostModel | None = None) -> Outcome:
    """Run `policy` (a registered name or a Policy) for horizon_s seconds over the events (GPU u = unit u)."""
    if isinstance(policy, str):
        try:
            policy = get(policy)()
        except Exception as e:
            raise ValueError(f"policy {policy!r}; allowed: {', '.join(simulator_policies())}") from e
    policy.sim_validate(job)
    job = policy.sim_job(job)  # e.g. Bamboo runs a pipeline layout of the same GPUs
    cost = cost if cost is not None and cost.job == job else CostModel(job)
    interval = policy.sim_checkpoint_interval(job, cost, mtbf_s)  # work since the last checkpoint is lost at a failure
    acc = dict.fromkeys(BREAKDOWN, 0.0)
    down, t, tokens, since_ckpt = set(initially_down), 0.0, 0.0, []  # since_ckpt: (breakdown, tokens) per step
    queue = sorted((e for e in events if e.time_s < horizon_s), key=lambda e: e.time_s)  # stable, as failures.from_events
    sim: dict = {}  # the policy's own state for this run
    n_events = 0

    def add(parts: dict, scale: float = 1.0) -> None:
        for k, v in parts.items():
            acc[k] += v * scale

    def charge(pause: float) -> float:
        """The pause of one event; of a group of simultaneous ones, only their longest."""
        nonlocal group_pause
        extra = max(0.0, pause - group_pause)
        group_pause = max(group_pause, pause)
        return extra

    def run_until(limit: float) -> None:
        nonlocal t, tokens
        while True:
            parts, tok, until = policy.sim_step(job, cost, frozenset(down), t, sim)
            dt = sum(parts.values())
            if not math.isfinite(dt):  # no one left to compute: idle until the next event
                acc["pause"] += limit - t
                t = limit
                return
            n = math.floor((limit - t) / dt) if limit > t else 0
            if until is not None:  # this step time holds until then
                n = min(n, max(1, math.ceil((until - t) / dt)))
            if interval:  # stop at the next checkpoint
                n = min(n, interval - len(since_ckpt))
            if n <= 0:
                return
            add(parts, n)
            tokens += tok * n
            t += dt * n
            if interval:
                since_ckpt.extend([(parts, tok)] * n)
                if len(since_ckpt) >= interval:
                    acc["checkpoint"] += job.const("checkpoint_s")
                    t += job.const("checkpoint_s")
                    since_ckpt.clear()

    previous, group_pause = None, 0.0
    for e in queue + [Event(horizon_s, "end", -1)]:
        # GPUs that fail (or return) at the same instant, e.g. a node (Job.failure_unit), are one event: one pause
        together, previous = previous == (e.time_s, e.kind), (e.time_s, e.kind)
        if not together:
            group_pause = 0.0
        if e.time_s < t:  # an event during a pause: it applies now
            e = replace(e, time_s=t)
        run_until(e.time_s)
        if e.kind == "end":
            break
        if e.kind == "remove":
            n_events += not together
            lost = max(0.0, e.time_s - t)  # the partial step in flight is lost
            acc["lost_work"] += lost
            t = e.time_s
            if interval:
                for parts, tok in since_ckpt:  # roll back: those steps were not trained after all
                    for k, v in parts.items():
                        acc[k] -= v
                        acc["lost_work"] += v
                    tokens -= tok
                since_ckpt.clear()
            pause = charge(policy.sim_on_failure(job, e.rank, frozenset(down), t, sim))
            acc["pause"] += pause
            t += pause
            down.add(e.rank)
        else:
            down.discard(e.rank)
            pause = charge(policy.sim_on_recovery(job, e.rank, frozenset(down), t, sim))
            acc["pause"] += pause
            t += pause
    # the tail (< one step before the horizon) is idle time
    acc["lost_work"] += max(0.0, horizon_s - t)
    wall = max(horizon_s, t)
    return Outcome(policy.name, wall, tokens, acc, n_events)


def scenario_failures(scenario: FailureScenario, job: Job, horizon_s: float, seed: int, start: str = "stationary",
                      recovery: str = "fixed") -> tuple[list[Event], frozenset[int]]:
    """Table 1's process on the job's GPUs in continuous time (each failure unit at the per-rank rate of a
    32-rank cluster, so the failed fraction is Table 1's for any unit size); a unit of `job.failure_unit`
    GPUs fails and recovers as a whole (units 0.. are consecutive GPUs, i.e. whole nodes at 8). Returns the
    events and the GPUs already down at time 0 (start='stationary'; none at start='cold')."""
    g = job.failure_unit
    if g < 1 or job.gpus % g:
        raise ValueError(f"failure_unit={g} must divide the job's {job.gpus} GPUs")
    if scenario.interval_h == float("inf"):
        return [], frozenset()
    s = generate(scenario, job.gpus // g, 1, horizon_s, seed, recovery, start=start)
    events = [Event(e.time_s, e.kind, e.rank * g + i) for e in s.events for i in range(g)]
    return events, frozenset(u * g + i for u in s.initially_down for i in range(g))


def mtbf(scenario: FailureScenario, gpus: int) -> float:
    """Mean time between failures of the whole job, seconds."""
    return scenario.interval_h * 3600 * REFERENCE_RANKS / gpus


def ci95(values: list[float]) -> tuple[float, float, float]:
    """Mean and a 95% t-interval."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return float(v.mean()), float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half)
