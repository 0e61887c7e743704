"""n data-parallel ranks under failures: the run's cluster configuration, the paper's aggregation rule, and
the registry of backends. A backend is a composition of two parts that mecefo.train.Run drives: a membership
(mecefo.membership: who is alive at a step and whether it counts: a failure schedule, or torchft's quorum)
and a step engine (mecefo.engine: how a planned step is computed and exchanged: every rank in one process,
one process per rank, or FSDP2-sharded), chosen by cluster.backend and cluster.shard; the run's files
(mecefo.runfiles) are the third part. Who computes what at a step is the policy's (mecefo.policies,
mecefo.plan).

Aggregation (the paper's rule, generalised by weights). Parameters fall in groups (mecefo.model.group_of):
attention of layer l (projections and their RMSNorm), FFN of layer l (projections and their RMSNorm),
embedding, head, final norm. For each group G,
        g_G = sum_{pieces p giving G a gradient} w_p grad_G(loss_p)  /  sum_{those pieces} w_p.
With MeCeFO (neighbours skip attention on both their micro-batches) this is the paper's
G_l = (1/|N_l|) sum_{i in N_l} G_{i,l} for attention, N_l the ranks neither failed nor neighbours, and the
average over all n micro-batches for every other parameter. When no piece gives a group a gradient
(N_l empty), that group gets no gradient and the optimizer leaves it unchanged for the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import policies
from .errors import UsageError
from .neighbour import Techniques


@dataclass(frozen=True)
class ClusterConfig:
    ranks: int = 1  # data-parallel size n
    backend: str = "local"  # a registered backend (mecefo.cluster.BACKENDS; `--help` lists them)
    shard: str = "none"  # none (every rank holds the whole model) | fsdp (FSDP2: torch, over the ranks; torchft, in each group)
    failures: str = "none"  # none | low | mid | high | custom:<interval_h>:<recovery_h> | path/to/trace.csv
    policy: str = "mecefo"  # a registered policy (mecefo.policies.trainer_policies())
    techniques: str = "mecefo"  # what mecefo's neighbours / spread-mecefo's extra shares apply
    seconds_per_step: float = 44.0  # maps the scenarios' hours to steps (see docs/training.md)
    recovery: str = "fixed"  # fixed | exponential
    failure_start: str = "stationary"  # stationary (ranks already down at step 0 as in steady state) | cold (all alive)
    failable: str = ""  # asymmetric mode: comma-separated ranks that can fail ("" = all)
    failure_free_steps: int = 0  # the first k steps see no failure (a warm start shared by every policy of a seed)
    all_down: str = "skip"  # skip (log and skip the step) | error
    restart_every: int = 50  # checkpoint-restart: steps between checkpoints
    r: float = 0.125  # low-rank width of low_rank_wgrad (>= 1 absolute, < 1 a fraction of min(m, n))
    low_rank_tau: int = 50  # optimizer steps between SVD refreshes of V1
    low_rank_svd: str = "auto"  # exact | randomized | auto (randomized when min(m, n) > 1024)
    low_rank_refresh: str = "shared"  # shared (torch ranks, FSDP2 shard groups: each 1/n of the SVDs, then broadcast) | local
    neighbour_pass: str = "sequential"  # sequential (each micro-batch its own pass) | fused (a neighbour's own + failed as one)
    failure_seed: int = -1  # seed of the failure process (-1: the training seed)
    track_grad_error: bool = False  # also compute the failure-free gradient and log Assumption 3's relative error

    def validate(self) -> None:
        if self.ranks < 1:
            raise UsageError(f"cluster.ranks={self.ranks} must be at least 1")
        spec = backend_spec(self.backend)
        if self.shard not in spec.engines:
            raise UsageError(f"cluster.shard={self.shard!r} is not available on cluster.backend={self.backend!r}; "
                             f"allowed there: {', '.join(map(repr, spec.engines))}"
                             + ("" if any(self.shard in s.engines for s in BACKENDS.values()) else
                                " (the shard modes: 'none', 'fsdp')"))
        if not spec.rollbacks and policies.get(self.policy, trainer=True).rolls_back:
            raise UsageError(f"cluster.backend={self.backend!r} cannot send a run back to an earlier step: not with "
                             f"cluster.policy={self.policy!r}")
        if self.low_rank_refresh not in ("shared", "local"):
            raise UsageError(f"cluster.low_rank_refresh={self.low_rank_refresh!r}; allowed: 'shared', 'local'")
        if self.neighbour_pass not in ("sequential", "fused"):
            raise UsageError(f"cluster.neighbour_pass={self.neighbour_pass!r}; allowed: 'sequential', 'fused'")
        if self.low_rank_svd not in ("exact", "randomized", "auto"):
            raise UsageError(f"cluster.low_rank_svd={self.low_rank_svd!r}; allowed: 'exact', 'randomized', 'auto'")
        policies.get(self.policy, trainer=True).validate(self)
        try:
            Techniques.parse(self.techniques)
        except ValueError as e:
            raise UsageError(f"cluster.techniques: {e}") from None
        if self.seconds_per_step <= 0:
            raise UsageError(f"cluster.seconds_per_step={self.seconds_per_step} must be positive")
        if self.failure_start not in ("stationary", "cold"):
            raise UsageError(f"cluster.failure_start={self.failure_start!r}; allowed: 'stationary', 'cold'")
        if self.all_down not in ("skip", "error"):
            raise UsageError(f"cluster.all_down={self.all_down!r}; allowed: 'skip', 'error'")
        if self.failure_free_steps < 0:
            raise UsageError(f"cluster.failure_free_steps={self.failure_free_steps} must be non-negative")
        if self.restart_every < 1 or self.low_rank_tau < 1 or self.r <= 0:
            raise UsageError("cluster.restart_every, cluster.low_rank_tau and cluster.r must be positive")
        self.failable_ranks()

    def failable_ranks(self) -> tuple[int, ...] | None:
        if not self.failable:
            return None
        try:
            ranks = tuple(int(r) for r in self.failable.split(","))
        except ValueError:
            raise UsageError(f"cluster.failable={self.failable!r} must be comma-separated rank numbers") from None
        if any(not 0 <= r < self.ranks for r in ranks):
            raise UsageError(f"cluster.failable={self.failable!r} must name ranks in 0..{self.ranks - 1}")
        return ranks


# ---------------------------------------------------------------------------------------------- backends
@dataclass(frozen=True)
class BackendSpec:
    """A registered backend: its name (cluster.backend), one line for --help, the command that starts its
    processes and the entry point they run, its membership and its step engines by shard mode ("module:Class",
    imported when used), and whether a policy may send its runs back to an earlier step (checkpoint-restart's
    rollback)."""

    name: str
    summary: str
    started_by: str
    entry: str  # the module whose main() starts a run: mecefo.train, or mecefo.launch for torchft
    membership: str
    engines: dict
    rollbacks: bool = True


BACKENDS = {s.name: s for s in (  # the only place backends are named
    BackendSpec("local", "n ranks simulated in one process (pieces batched across ranks)", "python -m mecefo.train",
                "mecefo.train", "mecefo.membership:Static", {"none": "mecefo.engine:Batched"}),
    BackendSpec("torch", "one process per rank under torchrun (gloo on CPU, nccl on CUDA); --shard fsdp: FSDP2",
                "torchrun --nproc_per_node N -m mecefo.train", "mecefo.train", "mecefo.membership:TorchStatic",
                {"none": "mecefo.engine:TorchReplicated", "fsdp": "mecefo.engine:Sharded"}),
    BackendSpec("torchft", "one process per rank under torchft's Manager: real process deaths, healing from a peer; "
                "--shard fsdp: a replica group of --group_size processes per rank, FSDP2 inside",
                "python -m mecefo.launch", "mecefo.launch", "mecefo.ft:FtMembership",
                {"none": "mecefo.engine:Replicated", "fsdp": "mecefo.engine:Sharded"}, rollbacks=False),
)}


def backends_table() -> str:
    """The README's table of backends (a test keeps the README's copy equal to it)."""
    rows = [f"| `{b.name}` | {b.summary} | `{b.started_by}` | {', '.join(f'`{k}`' for k in b.engines)} |"
            for b in BACKENDS.values()]
    return "\n".join(["| `--backend` | what it runs | started by | `--shard` |", "|---|---|---|---|", *rows])


def backend_spec(name: str) -> BackendSpec:
    if name not in BACKENDS:
        raise UsageError(f"cluster.backend={name!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    return BACKENDS[name]


def backend_parts(cc: ClusterConfig) -> tuple[type, type]:
    """The membership and step-engine classes of cc's backend and shard mode (cc is validated)."""
    import importlib

    spec = backend_spec(cc.backend)

    def load(where: str):
        module, name = where.split(":")
        return getattr(importlib.import_module(module), name)

    return load(spec.membership), load(spec.engines[cc.shard])
