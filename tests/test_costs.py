import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo.costs import Shape, analytic_flops, counted_flops, neighbour_step_flops, peak_memory, saved_activation_bytes
from mecefo.model import count_parameters, ffn_shapes, preset
from mecefo.neighbour import MECEFO, Techniques, resolve_r

MODES = ["normal", "skip_attention", "recompute_ffn", "low_rank_wgrad", "skip_ffn", "low_rank_head",
         "skip_attention+recompute_ffn", "mecefo"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@settings(max_examples=20, deadline=None)
@given(mode=st.sampled_from(MODES), batch=st.integers(1, 4), seq=st.integers(2, 48),
       r=st.sampled_from([0.125, 0.5, 3, 40, 1000]))
def test_counted_flops_equal_closed_forms_on_nano(mode, batch, seq, r):
    cfg, shape, t = preset("nano"), Shape(batch, seq), Techniques.parse(mode)
    assert counted_flops(cfg, shape, t, r) == analytic_flops(cfg, shape, t, r)


@pytest.mark.parametrize("name", ["tiny", "llama-350m"])
@pytest.mark.parametrize("mode", ["normal", "mecefo", "recompute_ffn"])
def test_counted_flops_equal_closed_forms_on_larger_presets(name, mode):
    cfg, shape, t = preset(name), Shape(1, 64), Techniques.parse(mode)
    assert counted_flops(cfg, shape, t, 64) == analytic_flops(cfg, shape, t, 64)


def test_recomputation_stops_before_the_down_projection():
    """Non-reentrant checkpoint rebuilds gate and up only: +4NDF, not the full FFN forward (+6NDF)."""
    cfg, shape = preset("tiny"), Shape(2, 32)
    extra = counted_flops(cfg, shape, Techniques(recompute_ffn=True))["ffn"] - counted_flops(cfg, shape, Techniques())["ffn"]
    assert extra == 4 * shape.tokens * cfg.dim * cfg.ffn_dim


def test_flops_move_in_the_expected_direction():
    cfg, shape = preset("tiny"), Shape(8, 128)
    total = {m: counted_flops(cfg, shape, Techniques.parse(m), 16)["total"] for m in MODES}
    assert total["skip_attention"] < total["normal"] and total["skip_ffn"] < total["normal"]
    assert total["recompute_ffn"] > total["normal"]
    assert total["low_rank_wgrad"] < total["normal"]  # 1024 tokens amortise the 2rmn term at r = 16
    assert total["skip_ffn"] < total["skip_attention"]  # FFN backward costs more than attention's here


def test_low_rank_costs_more_than_exact_at_few_tokens():
    """The 2rmn term does not scale with tokens: one token per micro-batch, large r."""
    cfg, shape = preset("tiny"), Shape(1, 1)
    exact = counted_flops(cfg, shape, Techniques())["ffn"]
    low = counted_flops(cfg, shape, Techniques(low_rank_wgrad=True), 64)
    assert low["ffn"] + low["wgrad_apply"] / cfg.n_layers > exact


def test_neighbour_step_applies_v1_once():
    cfg, shape = preset("tiny"), Shape(4, 64)
    per = analytic_flops(cfg, shape, MECEFO, 32)
    assert neighbour_step_flops(cfg, shape, MECEFO, 32) == 2 * per["total"] - per["wgrad_apply"]


def test_saved_bytes_move_in_the_expected_direction_and_scale_with_tokens():
    cfg, shape = preset("tiny"), Shape(4, 64)
    saved = {m: saved_activation_bytes(cfg, shape, Techniques.parse(m), 16) for m in MODES}
    assert saved["skip_attention"] < saved["normal"]
    assert saved["recompute_ffn"] < saved["normal"]
    assert saved["low_rank_wgrad"] < saved["normal"]
    assert saved["mecefo"] < saved["skip_attention"]
    # the three x V1 (N x r, fp32) the low-rank factors need are kept beside the FFN input (recomputing them would
    # cost 2 N (2 D r + F r) FLOPs a layer for 3 N r bytes)
    r = [resolve_r(16, m, n) for m, n in ffn_shapes(cfg)]
    assert saved["mecefo"] == saved["skip_attention+recompute_ffn"] + cfg.n_layers * shape.tokens * sum(r) * 4
    doubled = saved_activation_bytes(cfg, Shape(8, 64), Techniques())
    assert abs(doubled - 2 * saved["normal"]) <= 16  # linear in tokens, up to a few saved scalars


def test_saved_bytes_count_each_storage_once_and_include_checkpoint_inputs():
    """Independent count for one FFN block under recompute_ffn + skip_attention: per layer only the FFN
    input (N x D fp32) is held; what remains is the model-level embedding/head/loss part, shared by both."""
    cfg, shape = preset("tiny"), Shape(2, 16)
    n = shape.tokens
    both = saved_activation_bytes(cfg, shape, Techniques(skip_attention=True, recompute_ffn=True))
    skip_ffn_too = saved_activation_bytes(cfg, shape, Techniques(skip_attention=True, skip_ffn=True))
    assert both - skip_ffn_too == cfg.n_layers * n * cfg.dim * 4


def test_peak_memory_by_category():
    cfg, shape = preset("nano"), Shape(4, 32)
    normal = peak_memory(cfg, shape, Techniques())
    mecefo = peak_memory(cfg, shape, MECEFO)
    params = 4 * count_parameters(cfg)  # fp32
    assert normal["parameters"] == params
    assert normal["optimizer_states"] >= 2 * params  # AdamW's two moments
    assert mecefo["activations"] < normal["activations"]
    assert normal["total"] >= normal["parameters"] + normal["activations"]
