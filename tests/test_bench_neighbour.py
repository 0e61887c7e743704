"""experiments.bench_neighbour at a tiny shape: its FLOP column is what torch counts on the step it times (the replaced
implementation's too, whose recomputation reran the down projection), its activation bytes order as the techniques
promise, and paper_figures.neighbour renders every set of every shape."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from experiments import bench_neighbour as bench
from mecefo.model import rope_tables
from mecefo.neighbour import LowRankWgrad, Neighbour, Techniques
from paper_figures.neighbour import section

TOKENS, BLOCKS = 32, 2


@pytest.fixture(scope="module")
def measured():
    torch.manual_seed(0)
    return bench.measure("tiny", TOKENS, BLOCKS, 1, pair_rounds=1)


@pytest.mark.parametrize("name", ["normal", "recompute_ffn", "low_rank_wgrad", "mecefo", "mecefo_before"])
def test_the_flop_column_is_what_torch_counts_on_the_timed_step(measured, name):
    cfg = bench.layer_cfg("tiny", BLOCKS)
    stack = bench.Stack(cfg)
    lowrank = LowRankWgrad(r=bench.R, tau=bench.TAU, svd="auto").bind(stack)
    lowrank.prepare(stack)
    neighbour = None if name == "normal" else \
        (bench.Before if name.endswith("_before") else Neighbour)(Techniques.parse(bench.SETS[name]), lowrank)
    x = torch.randn(1, TOKENS, cfg.dim, requires_grad=True)
    cos, sin = (t[:TOKENS] for t in rope_tables(cfg.head_dim, TOKENS, cfg.rope_theta))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # (torch counts no FLOPs for the
        bench._step(stack, x, torch.randn(1, TOKENS, cfg.dim), cos, sin, neighbour)  # CPU's fused SDPA kernel)
    row = measured["sets"][name]
    refresh = measured["svd_flops_per_block"] / bench.TAU if Techniques.parse(bench.SETS[name]).low_rank_wgrad else 0
    assert counter.get_total_flops() / BLOCKS == pytest.approx(row["flops"] - refresh, rel=1e-12)


def test_the_techniques_keep_what_they_promise(measured):
    sets = measured["sets"]
    assert set(sets) == set(bench.SETS)
    assert sets["mecefo"]["flop_ratio"] < sets["mecefo_before"]["flop_ratio"] < sets["recompute_ffn"]["flop_ratio"]
    assert sets["skip_attention"]["flop_ratio"] < 1 < sets["recompute_ffn"]["flop_ratio"]
    assert sets["recompute_ffn"]["activation_bytes"] < sets["normal"]["activation_bytes"]
    assert sets["mecefo"]["activation_bytes"] < min(sets[k]["activation_bytes"] for k in ("skip_attention", "low_rank_wgrad"))
    assert all(v["time_ratio"] > 0 and v["time_over_flop"] > 0 for v in sets.values())


def test_the_figure_names_every_set_of_every_shape(measured):
    result = {"shapes": [measured], "c": bench.c_readings({}), "git_commit": "0" * 40, "threads": 2, "heap": "retain",
              "host_overhead": {"ratio": 0.97, "dim": 8, "tokens": 4, "blocks": 4,
                                "own_and_failed": {"fused_over_sequential": 0.543}}}
    system = {"shapes": [measured], "git_commit": "1" * 40}
    refresh = {"git_commit": "2" * 40, "shapes": [{"preset": "tiny", "matrices": 6, "svd_method": "exact", "ranks": 2,
               "local_s_per_matrix": 0.01, "shared_s_per_matrix": 0.005, "local_over_shared": 2.0, "ranks_equal": True}]}
    text = section(result, system, refresh)
    rows = [line for line in text.splitlines() if line.startswith("| tiny ")]
    assert len(rows) == len(bench.SETS) - 1 and all(line.count("|") == 8 for line in rows)
    assert "heap retain" in text and "0.97x" in text and "`111111111111`" in text
    assert f"tiny {measured['own_and_failed']['fused_over_sequential']:.3f}" in text and "proxy 0.543" in text
    assert "2.00x" in text and "`222222222222`" in text and "differed" not in text
    for model in result["c"]:
        assert model in text


def test_own_and_failed_fused_computes_what_two_passes_compute():
    """The pair the benchmark times: one pass of both sequences gives the gradients of one pass each (fp64)."""
    cfg = bench.layer_cfg("tiny", BLOCKS)
    torch.manual_seed(0)
    stack = bench.Stack(cfg).double()
    lowrank = LowRankWgrad(r=bench.R, tau=bench.TAU).bind(stack)
    lowrank.prepare(stack)
    neighbour = Neighbour(Techniques.parse("mecefo"), lowrank)
    x, grad = torch.randn(2, TOKENS, cfg.dim, dtype=torch.float64), torch.randn(2, TOKENS, cfg.dim, dtype=torch.float64)
    cos, sin = (t[:TOKENS].double() for t in rope_tables(cfg.head_dim, TOKENS, cfg.rope_theta))
    got = []
    for fused in (False, True):
        stack.zero_grad(set_to_none=True)
        bench.own_and_failed(stack, x.clone().requires_grad_(), grad, cos, sin, neighbour, fused)
        got.append({n: p.grad.clone() for n, p in stack.named_parameters() if p.grad is not None})
    assert got[0].keys() == got[1].keys() and got[0]
    assert all(torch.allclose(got[0][n], got[1][n], rtol=1e-10, atol=1e-12) for n in got[0])
