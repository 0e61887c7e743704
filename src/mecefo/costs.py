"""Exact cost accounting of normal and neighbour micro-batches: FLOPs and activation memory, every preset.

FLOPs are matrix-multiply FLOPs (2 per multiply-add) as torch.utils.flop_counter.FlopCounterMode counts
them (mm, bmm, addmm, SDPA; elementwise work and the loss are not counted), measured on the meta device
(no memory, so llama-7b is as cheap as nano) next to closed forms. Notation: N = B*T tokens of the
micro-batch, T sequence length, D width, F FFN width, V vocabulary, r the low-rank width.

Per layer and micro-batch (attention scores as the unfused math SDPA path computes them: full T x T,
causal masking not discounted; backward = two products per forward product):
    attention forward   A_f = 8 N D^2 + 4 N T D          backward A_b = 16 N D^2 + 8 N T D
    FFN forward         F_f = 6 N D F                    backward F_b = 12 N D F
    skip_attention      A_b -> 0                         skip_ffn    F_b -> 0
    recompute_ffn       + 4 N D F (gate and up are recomputed in mecefo.neighbour.NeighbourFFN's backward; the
                        down projection's output is not needed there and is not rerun)
    low_rank_wgrad      forward + sum_W 2 N n r (x V1 of gate, up, down; W is m x n, V1 is n x r), kept;
                        backward 6 N D F (exact Dgrad) + sum_W 2 N m r (the factors G_y^T x V1);
                        with recompute_ffn the same + 4 N D F (gate and up; the x V1 were kept)
    per optimizer step  + sum_W 2 r m n (factor V1^T; once, however many micro-batches: 6 r D F for equal r)
Model level: LM head 2 N D V forward, 4 N D V backward; the embedding lookup costs no FLOPs.
SVD refresh (not counted by FlopCounterMode; estimated): exact thin SVD 4 m n^2 + 8 n^3 (m >= n),
randomized 2 m n q (2 niter + 2) + 4 (niter + 1) m q^2 (q = r + oversample), amortised over tau steps.

Activation memory: bytes of tensors saved for backward (torch.autograd.graph.saved_tensors_hooks),
counted once per storage (several ops save the same tensor), parameters excluded, plus the inputs that
torch's checkpoint keeps outside those hooks (the neighbour reports them). Peak memory by category comes
from torch's MemTracker under FakeTensorMode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from .model import GPT, ModelConfig, ffn_shapes
from .neighbour import LowRankWgrad, Neighbour, Techniques, resolve_r


@dataclass(frozen=True)
class Shape:
    batch: int  # sequences per micro-batch
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


def ffn_matrices(cfg: ModelConfig, r: float) -> list[tuple[int, int, int]]:
    """(m, n, r) of the gate, up and down projections (W is m x n, V1 is n x r)."""
    return [(m, n, resolve_r(r, m, n)) for m, n in ffn_shapes(cfg)]


def analytic_flops(cfg: ModelConfig, shape: Shape, techniques: Techniques, r: float = 0.125) -> dict[str, int]:
    """Closed-form FLOPs of one micro-batch's forward and backward (see the module docstring).
    Returns per-layer 'attention' and 'ffn', model-level 'head', the per-step 'wgrad_apply' and 'total'
    (one micro-batch plus one wgrad_apply)."""
    n, t, d, f, v = shape.tokens, shape.seq_len, cfg.dim, cfg.ffn_dim, cfg.vocab_size
    a_f, a_b = 8 * n * d * d + 4 * n * t * d, 16 * n * d * d + 8 * n * t * d
    attention = a_f + (0 if techniques.skip_attention else a_b)
    mats = ffn_matrices(cfg, r)
    lowrank_fwd = sum(2 * n * cols * w for _, cols, w in mats)  # x V1
    lowrank_factor = sum(2 * n * rows * w for rows, _, w in mats)  # G_y^T (x V1)
    if techniques.skip_ffn:
        ffn = 6 * n * d * f
    elif techniques.low_rank_wgrad:
        ffn = 6 * n * d * f + lowrank_fwd + 6 * n * d * f + lowrank_factor + (4 * n * d * f if techniques.recompute_ffn else 0)
    else:
        ffn = 18 * n * d * f + (4 * n * d * f if techniques.recompute_ffn else 0)
    wgrad_apply = cfg.n_layers * sum(2 * w * rows * cols for rows, cols, w in mats) if techniques.low_rank_wgrad else 0
    head = 6 * n * d * v
    if techniques.low_rank_head:
        rh = resolve_r(r, v, d)
        head = 2 * n * d * v + 2 * n * d * rh + 2 * n * d * v + 2 * n * v * rh
        wgrad_apply += 2 * rh * v * d
    total = cfg.n_layers * (attention + ffn) + head + wgrad_apply
    return {"attention": attention, "ffn": ffn, "head": head, "wgrad_apply": wgrad_apply, "total": total}


def svd_flops(m: int, n: int, r: int, method: str, oversample: int, niter: int) -> int:
    """Estimated FLOPs of one refresh of V1 for an m x n matrix (see the module docstring); oversample is
    the number of extra columns (LowRankWgrad.oversample_columns)."""
    m, n = max(m, n), min(m, n)
    if method == "exact":
        return 4 * m * n * n + 8 * n ** 3
    q = min(r + oversample, n)
    return 2 * m * n * q * (2 * niter + 2) + 4 * (niter + 1) * m * q * q


def refresh_flops(cfg: ModelConfig, r: float = 0.125, lowrank: LowRankWgrad | None = None) -> int:
    """Estimated FLOPs of one refresh of V1 over the model: every FFN matrix's SVD (svd_flops), by the method, extra
    columns and power iterations the LowRankWgrad picks (default: LowRankWgrad(r), exact up to min(m, n) = 1024)."""
    lr = lowrank or LowRankWgrad(r=r)
    return cfg.n_layers * sum(svd_flops(m, n, w, lr.method(m, n, w), lr.oversample_columns(w), lr.niter)
                              for m, n, w in ffn_matrices(cfg, r))


def _meta_model(cfg: ModelConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def counted_flops(cfg: ModelConfig, shape: Shape, techniques: Techniques, r: float = 0.125,
                  model: GPT | None = None) -> dict[str, int]:
    """FlopCounterMode's count of one micro-batch's forward + backward (+ the per-step wgrad apply),
    on the meta device, with the same keys as analytic_flops."""
    model = model or _meta_model(cfg)
    idx = torch.zeros(shape.batch, shape.seq_len, dtype=torch.long, device="meta")
    neighbour = None if techniques == Techniques() else Neighbour(techniques, LowRankWgrad(r=r, svd="exact"))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx, neighbour=neighbour).backward()
    with FlopCounterMode(display=False) as apply_counter:
        if neighbour is not None:
            neighbour.finish()
    by_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    first = f"{type(model).__name__}.layers.0"  # FlopCounterMode names modules by their path in the model
    layer, attention = by_module.get(first, 0), by_module.get(f"{first}.attention", 0)
    model.zero_grad(set_to_none=True)
    # every layer costs the same; what is left is the LM head's (the embedding lookup counts no FLOPs)
    return {"attention": attention, "ffn": layer - attention, "head": counter.get_total_flops() - cfg.n_layers * layer,
            "wgrad_apply": apply_counter.get_total_flops(),
            "total": counter.get_total_flops() + apply_counter.get_total_flops()}


def saved_activation_bytes(cfg: ModelConfig, shape: Shape, techniques: Techniques, r: float = 0.125,
                           model: GPT | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Bytes kept for backward by one micro-batch: saved tensors once per storage, parameters excluded,
    plus checkpoint-held inputs. Counted on the meta device in `dtype`."""
    model = model or _meta_model(cfg)
    model = model.to(dtype)
    params = {p.untyped_storage()._cdata for p in model.parameters()} | {
        b.untyped_storage()._cdata for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
        return t

    idx = torch.zeros(shape.batch, shape.seq_len, dtype=torch.long, device="meta")
    neighbour = None if techniques == Techniques() else Neighbour(techniques, LowRankWgrad(r=r, svd="exact"))
    held: list[torch.Tensor] = []
    if neighbour is not None:
        neighbour.held = held
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx, neighbour=neighbour)
    for t in held:
        seen.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
    del loss
    return sum(seen.values())


def peak_memory(cfg: ModelConfig, shape: Shape, techniques: Techniques, micro_batches: int = 1,
                r: float = 0.125) -> dict[str, int]:
    """Peak bytes by category (parameters, gradients, activations, temporaries, optimizer states) of one
    AdamW step over `micro_batches` sequential micro-batches, tracked by torch's MemTracker under
    FakeTensorMode (fp32; no real memory is used). The optimizer states exist before the tracked step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        idx = torch.zeros(shape.batch, shape.seq_len, dtype=torch.long)
        neighbour = None if techniques == Techniques() else Neighbour(techniques, LowRankWgrad(r=r, svd="exact"))
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            for _ in range(micro_batches):
                model(idx, idx, neighbour=neighbour).backward()
            if neighbour is not None:
                neighbour.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
        snapshot = tracker.get_tracker_snapshot("peak")
    stats = next(iter(snapshot.values()))
    names = {"PARAM": "parameters", "BUFFER": "buffers", "GRAD": "gradients", "ACT": "activations",
             "TEMP": "temporaries", "OPT": "optimizer_states", "OTH": "other"}
    out = {names[str(k).rsplit(".", 1)[-1]]: int(v) for k, v in stats.items() if str(k) != "Total"}
    out["total"] = int(stats["Total"])
    return out


def neighbour_step_flops(cfg: ModelConfig, shape: Shape, techniques: Techniques, r: float = 0.125,
                         micro_batches: int = 2) -> int:
    """A neighbour's step: its own and the failed rank's micro-batches in one mode, wgrad applied once."""
    per = analytic_flops(cfg, shape, techniques, r)
    return micro_batches * (per["total"] - per["wgrad_apply"]) + per["wgrad_apply"]


def training_memory(cfg: ModelConfig, shape: Shape, ranks: int = 1, shard: str = "none",
                    techniques: Techniques = Techniques(), r: float = 0.125, neighbour_rows: int | None = None) -> dict[str, int]:
    """Bytes one GPU needs for one rank's training step (fp32 parameters, fp32 AdamW, bf16 autocast):
        static    parameters 4P + gradients 4P + AdamW moments 8P, each divided by n under shard='fsdp'
        gathered  (fsdp) the whole-tensor copies FSDP2 holds at once: the root unit (embedding, LM head,
                  final norm) with its unsharded gradients, 2 x 4(2VD + D), and two blocks (the one computing
                  and the one prefetched), parameters and their unsharded gradients: 2 x 2 x 4(4D^2 + 3DF + 2D)
        autocast  the bf16 copies of every linear weight that autocast makes in the forward pass and backward
                  keeps: 2 (L (4D^2 + 3DF) + VD), whole-model under FSDP too (they outlive resharding)
        bases     V1 of every FFN matrix (n x r fp32) when a neighbour uses low_rank_wgrad
        activations  the larger of a normal pass's (shape.batch sequences) and a `techniques` pass's (neighbour_rows
                  sequences, default shape.batch; a fused neighbour pass holds its own and the failed micro-batch)
                  saved tensors, counted in fp32 (an upper bound under autocast, where the residual stream stays fp32
                  anyway): passes run one after another, so one is live at a time
    P = mecefo.model.count_parameters(cfg). Not included: CUDA context, allocator fragmentation, and the
    whole-model snapshot checkpoint-restart keeps (16P more; that policy is not run sharded)."""
    from .model import count_parameters

    p = count_parameters(cfg)
    div = ranks if shard == "fsdp" else 1
    out = {"parameters": 4 * p // div, "gradients": 4 * p // div, "optimizer_states": 8 * p // div}
    block = 4 * cfg.dim ** 2 + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    root = 2 * cfg.vocab_size * cfg.dim + cfg.dim
    out["gathered"] = 2 * 4 * root + 2 * 2 * 4 * block if shard == "fsdp" else 0
    out["autocast"] = 2 * (cfg.n_layers * (4 * cfg.dim ** 2 + 3 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim)
    out["bases"] = 0
    if techniques.low_rank_wgrad:
        out["bases"] = cfg.n_layers * sum(4 * n * w for _, n, w in ffn_matrices(cfg, r))
    neighbour = Shape(neighbour_rows or shape.batch, shape.seq_len)
    out["activations"] = max(saved_activation_bytes(cfg, shape, Techniques(), r),
                             saved_activation_bytes(cfg, neighbour, techniques, r))
    out["total"] = sum(out.values())
    return out
