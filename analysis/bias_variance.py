"""Bias, variance and MSE of the aggregated gradient at checkpoints early / middle / late in training, for
each policy, each technique subset and each low-rank r, per parameter group; and the drop-vs-MeCeFO MSE
comparison (unbiased with fewer samples against biased with all samples: when is which better?).

    python -m analysis.bias_variance [--quick]

Estimators (n data-parallel ranks, the global batch split over them): `failure-free` (the unbiased
baseline), `drop`, and MeCeFO's neighbour with skip_attention alone, low_rank_wgrad alone at each r, and all
three at each r, each with one failed rank (rank 1, covered by rank 2); then `mecefo` and `drop` under each
failure level, drawing failures independently per rank with the level's expected failed fraction.
Reference gradient: the failure-free aggregated gradient averaged over many batches (its standard error is
reported). Monte Carlo over batches (and failure draws), bootstrap intervals (mecefo.stats).
Writes results/analysis/bias_variance-<profile>.json; python -m paper_figures.bias_variance draws it.
"""

from __future__ import annotations

import shutil
import sys
from contextlib import nullcontext

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from mecefo import checkpoint
from mecefo.errors import guarded
from mecefo.results import load_config, measurement, quick_flag, reusable, run_dir, sources_digest

SOURCES = ("analysis/bias_variance.py", "src/mecefo")  # the code a measurement depends on: reused only if unchanged
from mecefo.engine import Batched
from mecefo.policies import plan_step
from mecefo.data import TokenData
from mecefo.failures import SCENARIOS
from mecefo.model import GPT, GROUP_KINDS, group_kind, group_of, preset
from mecefo.neighbour import LowRankWgrad, Techniques
from mecefo.records import atomic_write_json, git_commit
from mecefo.stats import estimator_stats, reference_gradient
from mecefo.train import run

GROUPS = GROUP_KINDS  # attention (with its norm), ffn (with its norm), embedding, head, final norm (mecefo.model)


def group_name(param: str) -> str:
    return group_kind(group_of(param))


class GradientSampler:
    """Flat aggregated gradients of a policy at fixed parameters, parameters ordered by group."""

    def __init__(self, cfg, model: GPT, data: TokenData):
        self.cfg, self.model, self.n = cfg, model, cfg.cluster.ranks
        self.order = sorted(model.named_parameters(), key=lambda kv: GROUPS.index(group_name(kv[0])))
        sizes = {g: sum(p.numel() for n, p in self.order if group_name(n) == g) for g in GROUPS}
        starts = np.cumsum([0] + [sizes[g] for g in GROUPS])
        self.groups = {g: slice(int(a), int(b)) for g, a, b in zip(GROUPS, starts[:-1], starts[1:])}
        self.data = data

    def draw(self, policy: str, failed: frozenset[int], address: int, techniques: Techniques, r: float) -> np.ndarray:
        lowrank = LowRankWgrad(r=r, tau=10**9, svd="exact")
        cluster = Batched(self.model, self.data, self.cfg.train.seed, torch.device("cpu"), lowrank, nullcontext,
                          n_ranks=self.n)
        plan = plan_step(policy, address, failed, self.n, 1, self.cfg.data.micro_batch_size, techniques)
        cluster.prepare(plan)
        cluster.step(plan)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in self.order])
        self.model.zero_grad(set_to_none=True)
        return flat.numpy().astype(np.float32)


def estimators(quick: bool, n: int) -> list[dict]:
    """name, policy, techniques, r, failure level (None: one fixed failed rank)."""
    r_values = (2, 8) if quick else (4, 16, 64, 128)
    out = [{"name": "failure-free", "policy": "mecefo", "techniques": "normal", "r": 0, "level": "none"},
           {"name": "drop", "policy": "drop", "techniques": "normal", "r": 0, "level": None},
           {"name": "skip_attention", "policy": "mecefo", "techniques": "skip_attention", "r": 0, "level": None}]
    for r in r_values:
        out.append({"name": f"low_rank_wgrad r={r}", "policy": "mecefo", "techniques": "low_rank_wgrad", "r": r, "level": None})
        out.append({"name": f"mecefo r={r}", "policy": "mecefo", "techniques": "mecefo", "r": r, "level": None})
    for level in ("low", "mid", "high"):
        for policy in ("mecefo", "drop"):
            out.append({"name": f"{policy} @ {level}", "policy": policy, "techniques": "mecefo", "r": 0.125, "level": level})
    return out


def checkpoints(cfg, quick: bool) -> dict[str, str]:
    """Train failure-free once, keeping copies of the checkpoint early / middle / late."""
    out = run_dir("analysis/bias_variance", cfg)
    marks = {"early": max(1, cfg.train.steps // 10), "middle": cfg.train.steps // 2, "late": cfg.train.steps}
    paths = {}
    for name, step in marks.items():
        path = out / f"checkpoint-{step}"
        if not path.exists():
            run(cfg, out, stop_after=step, quiet=True)
            shutil.copytree((out / "checkpoint").resolve(), path)
        paths[name] = str(path)
    return paths


def measure(quick: bool) -> dict:
    n = 4 if quick else 8
    cfg = load_config("sweep-quick" if quick else "sweep", ranks=n, micro_batch_size=8 // n, failures="none")
    data = TokenData(cfg.data)
    model = GPT(preset(cfg.model.preset, vocab_size=data.vocab_size))
    sampler = GradientSampler(cfg, model, data)
    k_ref, k = (16, 12) if quick else (64, 32)
    rng = np.random.default_rng(0)
    rows = []
    work = [(c, e) for c in checkpoints(cfg, quick).items() for e in estimators(quick, n)]
    bar = tqdm(total=len(work), desc="bias/variance", disable=not sys.stderr.isatty())
    for (stage, path) in checkpoints(cfg, quick).items():
        model.load_state_dict(checkpoint.read_model(path))
        ref = reference_gradient(np.stack([sampler.draw("mecefo", frozenset(), 100_000 + i, Techniques(), 0.125)
                                           for i in range(k_ref)]))
        for est in estimators(quick, n):
            draws = []
            for i in range(k):
                if est["level"] is None:
                    failed = frozenset({1})
                elif est["level"] == "none":
                    failed = frozenset()
                else:
                    p = SCENARIOS[est["level"]].expected_failed_fraction()
                    failed = frozenset(int(r) for r in np.flatnonzero(rng.random(n) < p))
                draws.append(sampler.draw(est["policy"], failed, 200_000 + i, Techniques.parse(est["techniques"]),
                                          est["r"] or 0.125))
            result = estimator_stats(np.stack(draws), ref.mean, sampler.groups, n_boot=300)
            for group, st in result.items():
                rows.append({"stage": stage, **est, "group": group, "ref_se_norm": ref.se_norm, "draws": k,
                             **{f"{key}": v["value"] for key, v in st.items()},
                             **{f"{key}_ci": v["ci"] for key, v in st.items()}})
            bar.update(1)
            if bar.disable:
                a = result["all"]
                print(f"{stage:6s} {est['name']:24s} bias {a['bias']['value']:.4f} var {a['variance']['value']:.4f} "
                      f"mse {a['mse']['value']:.4f}", flush=True)
    bar.close()
    return {"rows": rows, "n_ranks": n, "reference_draws": k_ref, "draws": k, "config_hash": cfg.hash(),
            "git_commit": git_commit()}


def crossing(df: pd.DataFrame) -> dict:
    """Per stage: MeCeFO's MSE at each r against drop's, and the smallest r from which MeCeFO's is lower."""
    out = {}
    for stage, g in df[df["group"] == "all"].groupby("stage"):
        drop = g[g["name"] == "drop"]["mse"].iloc[0]
        mec = g[g["name"].str.startswith("mecefo r=")].sort_values("r")
        better = mec[mec["mse"] < drop]
        out[stage] = {"drop_mse": drop, "mecefo_mse_by_r": dict(zip(mec["r"].astype(int).astype(str), mec["mse"])),
                      "smallest_r_below_drop": int(better["r"].min()) if not better.empty else None}
    return out


def main(argv: list[str] | None = None) -> int:
    quick = quick_flag(argv, __doc__)
    path = measurement("analysis", "bias_variance", quick)
    digest = sources_digest(SOURCES)
    if reusable(path, digest):  # reused only when made by this code
        import json

        result = json.loads(path.read_text())
    else:
        result = measure(quick) | {"sources_digest": digest}
        result["crossing"] = crossing(pd.DataFrame(result["rows"]))
        atomic_write_json(path, result)
    for stage, c in result["crossing"].items():
        print(f"{stage}: drop MSE {c['drop_mse']:.4g}; MeCeFO MSE by r {({r: round(v, 4) for r, v in c['mecefo_mse_by_r'].items()})}; "
              f"MeCeFO below drop from r = {c['smallest_r_below_drop']}")
    print(f"-> {path} (figures: python -m paper_figures.bias_variance)")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
