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
Policies (what a failure set F changes; a synchronous step is as slow as its slowest GPU):
    mecefo         the neighbour (next alive replica, same stage) runs its own and k failed micro-batch sets
                   with the three techniques: its t_mb grows by alpha_k = ((k + 1) c_nb m + a) / (c m), c and
                   c_nb the normal and neighbour FLOPs of a micro-batch, a the once-per-step low-rank apply
    ndb-exact      the same with exact computation: alpha_k = k + 1
    spread         (ReCycle) the failed GPU's m micro-batches go to the d alive peers of its stage, filling
                   their bubbles first: extra time max(0, m f / d t_mb - (pp - 1) t_mb)
    spread-mecefo  the same, the extra shares computed with the techniques (c_nb / c of the time)
    drop           (torchft) step time unchanged; a replica with a failed GPU drops its samples; a quorum
                   pause per event
    oobleck        pipelines re-instantiated on the N - f remaining GPUs: step time x N / (N - f); a
                   reconfiguration pause per event (failure and recovery)
    bamboo         redundant computation every step (each stage also runs its successor's forward, in the
                   bubbles where it fits); on a failure the predecessor takes over at `bamboo_fallback`x
                   speed for `bamboo_reconfig_s`, then pipelines run on the remaining GPUs; two failed
                   GPUs adjacent in one pipeline (or adjacent replicas when pp = 1) force a full restart
    checkpoint-restart  a checkpoint (cost C) every K steps at the Young/Daly interval sqrt(2 C MTBF); a
                   failure loses the work since the last checkpoint plus `restart_s`; spare GPUs replace
                   the failed ones, so it then runs at full speed
Every policy loses the partial step in flight when a GPU fails. Throughput = trained tokens / wall time;
dropped samples and rolled-back steps are not trained tokens. The time breakdown (compute, bubble,
communication, redundant, degraded, pause, checkpoint, lost_work) sums to the wall time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .costs import Shape, analytic_flops
from .failures import REFERENCE_RANKS, Event, FailureScenario, generate
from .model import count_parameters, preset
from .neighbour import MECEFO, Techniques

POLICIES = ("mecefo", "ndb-exact", "spread", "spread-mecefo", "drop", "oobleck", "bamboo", "checkpoint-restart")
GPUS = {"A100": {"peak_flops": 312e12, "memory_bytes": 80e9}, "H100": {"peak_flops": 989e12, "memory_bytes": 80e9}}
# Reconfiguration pauses of Oobleck's copy of Bamboo's simulator (SIMULATORS.md): GPT-3 medium (350M) 100 s,
# 2.7B 230 s, 6.7B 450 s; 1B interpolated in log-parameters.
BAMBOO_RECONFIG_S = {"llama-350m": 100.0, "llama-1b": 150.0, "llama-7b": 450.0}
BREAKDOWN = ("compute", "bubble", "communication", "redundant", "degraded", "pause", "checkpoint", "lost_work")


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
    ib_bytes_s: float = 200e9
    overlap: float = 0.5  # share of the all-reduce hidden behind the backward pass
    low_rank: float = 0.125
    low_rank_tau: int = 50
    # policy constants (defaults from the public simulators, SIMULATORS.md)
    event_pause_s: float = 0.0  # mecefo / spread: detection and re-routing per failure event
    torchft_quorum_s: float = 5.0
    oobleck_reconfig_s: float = 10.0
    bamboo_fallback: float = 1.5
    bamboo_restart_s: float = 30.0
    checkpoint_s: float = 60.0
    restart_s: float = 300.0

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
    flops_apply: int = 0
    t_mb: float = 0.0
    t_mb_neighbour: float = 0.0
    t_apply: float = 0.0
    allreduce: float = 0.0

    def __post_init__(self):
        j = self.job
        cfg = preset(j.model)
        shape = Shape(j.micro_batch, j.seq_len)
        normal = analytic_flops(cfg, shape, Techniques(), j.low_rank)
        nb = analytic_flops(cfg, shape, MECEFO, j.low_rank)
        self.flops_normal, self.flops_neighbour, self.flops_apply = normal["total"], nb["total"] - nb["wgrad_apply"], nb["wgrad_apply"]
        rate = GPUS[j.gpu]["peak_flops"] * j.mfu * j.pp  # layers split evenly over the stages
        self.t_mb, self.t_mb_neighbour, self.t_apply = self.flops_normal / rate, self.flops_neighbour / rate, self.flops_apply / rate
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

    def alpha(self, k: int, exact: bool = False) -> float:
        """Time of a neighbour covering k failed GPUs, relative to a normal GPU (per step)."""
        m = self.job.micro_batches
        if exact:
            return float(k + 1)
        return ((k + 1) * self.t_mb_neighbour * m + self.t_apply) / (self.t_mb * m)


def neighbour_load(failed: frozenset[int], job: Job) -> int:
    """The most failed GPUs one GPU covers, with cluster.assign_neighbours' rule (nobody covers two while
    an alive peer of the stage covers none): ceil(f_s / (dp - f_s)) for the worst stage s; dp if a stage
    has nobody left."""
    worst = 0
    for stage in {u % job.pp for u in failed}:
        f = sum(1 for u in failed if u % job.pp == stage)
        worst = max(worst, job.dp if f >= job.dp else math.ceil(f / (job.dp - f)))
    return worst


def step(job: Job, cost: CostModel, policy: str, failed: frozenset[int]) -> tuple[dict[str, float], float]:
    """(time breakdown of one step, trained tokens) with the failed set held fixed."""
    parts = dict.fromkeys(BREAKDOWN, 0.0) | cost.base
    tokens = float(job.tokens_per_step)
    m, pp, t = job.micro_batches, job.pp, cost.t_mb
    f = len(failed)
    if policy == "bamboo":  # redundant forward of the successor's micro-batches, hidden in bubbles where it fits
        parts["redundant"] = max(0.0, m * t / 3 - (pp - 1) * t)
    if not f or policy == "checkpoint-restart":
        return parts, tokens
    busy = parts["compute"] + parts["bubble"]
    if policy in ("mecefo", "ndb-exact"):
        k = neighbour_load(failed, job)
        if k >= job.dp:
            return parts | {"degraded": float("inf")}, 0.0
        parts["degraded"] = busy * (cost.alpha(k, exact=policy == "ndb-exact") - 1)
    elif policy in ("spread", "spread-mecefo"):
        per_stage = max(sum(1 for u in failed if u % pp == s) for s in range(pp))
        if per_stage >= job.dp:
            return parts | {"degraded": float("inf")}, 0.0
        share = m * per_stage / (job.dp - per_stage) * (cost.t_mb_neighbour / t if policy == "spread-mecefo" else 1.0)
        parts["degraded"] = max(0.0, share * t - (pp - 1) * t)
    elif policy == "drop":
        replicas = len({u // pp for u in failed})
        tokens *= (job.dp - replicas) / job.dp
    elif policy in ("oobleck", "bamboo"):
        if f >= job.gpus:
            return parts | {"degraded": float("inf")}, 0.0
        parts["degraded"] = (busy + parts["redundant"]) * (job.gpus / (job.gpus - f) - 1)
    return parts, tokens


def young_daly_steps(job: Job, cost: CostModel, mtbf_s: float) -> int:
    """Checkpoint interval in steps: sqrt(2 C MTBF) / step time."""
    step_time = sum(cost.base.values())
    return max(1, round(math.sqrt(2 * job.checkpoint_s * mtbf_s) / step_time))


def _adjacent(u: int, failed: frozenset[int], job: Job) -> bool:
    r, s = divmod(u, job.pp)
    if job.pp > 1:
        return any(v in failed for v in (r * job.pp + s - 1, r * job.pp + s + 1) if 0 <= s + (v - u) < job.pp)
    return ((r - 1) % job.dp) in failed or ((r + 1) % job.dp) in failed


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


def simulate(job: Job, policy: str, events: list[Event], horizon_s: float, mtbf_s: float = float("inf"),
             initially_down: frozenset[int] = frozenset(), cost: CostModel | None = None) -> Outcome:
    """Run `policy` for horizon_s seconds over the events (GPU u = unit u)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}; allowed: {', '.join(POLICIES)}")
    cost = cost or CostModel(job)
    interval = young_daly_steps(job, cost, mtbf_s) if policy == "checkpoint-restart" and math.isfinite(mtbf_s) else None
    acc = dict.fromkeys(BREAKDOWN, 0.0)
    down, t, tokens, since_ckpt = set(initially_down), 0.0, 0.0, []  # since_ckpt: (breakdown, tokens) per step
    queue = sorted((e for e in events if e.time_s < horizon_s), key=lambda e: (e.time_s, e.kind == "remove"))
    bamboo_until = -1.0  # Bamboo runs at fallback speed until its reconfiguration completes
    n_events = 0

    def add(parts: dict, scale: float = 1.0) -> None:
        for k, v in parts.items():
            acc[k] += v * scale

    def run_until(limit: float) -> None:
        nonlocal t, tokens
        while True:
            parts, tok = step(job, cost, policy, frozenset(down))
            if policy == "bamboo" and t < bamboo_until:
                parts["degraded"] += sum(parts.values()) * (job.bamboo_fallback - 1)
            dt = sum(parts.values())
            if not math.isfinite(dt):  # no one left to compute: idle until the next event
                acc["pause"] += limit - t
                t = limit
                return
            n = math.floor((limit - t) / dt) if limit > t else 0
            if policy == "bamboo" and t < bamboo_until:
                n = min(n, max(1, math.ceil((bamboo_until - t) / dt)))
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
                    acc["checkpoint"] += job.checkpoint_s
                    t += job.checkpoint_s
                    since_ckpt.clear()

    for e in queue + [Event(horizon_s, "end", -1)]:
        if e.time_s < t:  # an event during a pause: it applies now
            e = replace(e, time_s=t)
        run_until(e.time_s)
        if e.kind == "end":
            break
        if e.kind == "remove":
            n_events += 1
            lost = max(0.0, e.time_s - t)  # the partial step in flight is lost
            acc["lost_work"] += lost
            t = e.time_s
            pause = {"drop": job.torchft_quorum_s, "oobleck": job.oobleck_reconfig_s}.get(policy, job.event_pause_s)
            if policy == "checkpoint-restart":
                for parts, tok in since_ckpt:  # roll back: those steps were not trained after all
                    for k, v in parts.items():
                        acc[k] -= v
                        acc["lost_work"] += v
                    tokens -= tok
                since_ckpt.clear()
                pause = job.restart_s
            elif policy == "bamboo":
                if _adjacent(e.rank, frozenset(down), job):
                    pause = job.bamboo_restart_s
                bamboo_until = e.time_s + pause + BAMBOO_RECONFIG_S.get(job.model, 150.0)
            acc["pause"] += pause
            t += pause
            down.add(e.rank)
        else:
            down.discard(e.rank)
            if policy in ("oobleck", "bamboo"):  # recovered GPUs rejoin through a reconfiguration
                pause = job.oobleck_reconfig_s if policy == "oobleck" else BAMBOO_RECONFIG_S.get(job.model, 150.0)
                acc["pause"] += pause
                t += pause
    # the tail (< one step before the horizon) is idle time
    acc["lost_work"] += max(0.0, horizon_s - t)
    wall = max(horizon_s, t)
    return Outcome(policy, wall, tokens, acc, n_events)


def scenario_events(scenario: FailureScenario, job: Job, horizon_s: float, seed: int,
                    per_gpu_rate_scale: float = 1.0) -> list[Event]:
    """Table 1's process on the job's GPUs (per-GPU rate of a 32-GPU cluster kept), in continuous time."""
    sc = replace(scenario, interval_h=scenario.interval_h / per_gpu_rate_scale)
    return list(generate(sc, job.gpus, 1, horizon_s, seed).events)


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
