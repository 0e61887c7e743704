"""The GPT rate check's pieces: the two-halves estimate of the squared gradient norm against the full-sample
gradient computed independently, its unbiasedness on a problem with a known gradient, and the slope words."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.rate import _fit, rate_word
from experiments import rate_gpt
from mecefo.data import TokenData
from mecefo.model import GPT, preset


def test_plug_in_is_the_full_sample_gradient_and_splits_into_unbiased_plus_floor(nano_cfg, monkeypatch):
    monkeypatch.setattr(rate_gpt, "HELD_OUT_WINDOWS", 16)
    data = TokenData(nano_cfg.data)
    torch.manual_seed(0)
    model = GPT(preset("nano", vocab_size=data.vocab_size))
    est = rate_gpt.held_out_gradient_sq(model, data)
    assert all(p.grad is None for p in model.parameters())  # gradients left cleared
    x, y = next(data.eval_batches("val", batch=16))
    model.zero_grad()
    model(torch.from_numpy(x), torch.from_numpy(y)).backward()  # the mean loss over all 16 windows at once
    full = sum(float((p.grad.double() ** 2).sum()) for p in model.parameters())
    assert np.isclose(est["plug_in"], full, rtol=1e-5)
    assert np.isclose(est["plug_in"], est["unbiased"] + est["floor"], rtol=1e-12)
    assert est["floor"] > 0


def test_the_inner_product_of_two_halves_is_unbiased_where_the_plug_in_is_not():
    """Mean of W noisy draws g_i = mu + xi_i: E[g_A . g_B] = |mu|^2, E|g_all|^2 = |mu|^2 + tr(Sigma)/W."""
    rng = np.random.default_rng(0)
    mu, w, trials = np.full(20, 0.1), 8, 20000
    draws = mu + rng.normal(size=(trials, w, 20))
    a, b = draws[:, ::2].mean(1), draws[:, 1::2].mean(1)
    unbiased, plug_in = (a * b).sum(1), (((a + b) / 2) ** 2).sum(1)
    truth = float(mu @ mu)  # 0.2, against tr(Sigma)/W = 2.5
    assert abs(unbiased.mean() - truth) < 4 * unbiased.std() / np.sqrt(trials)
    assert abs(plug_in.mean() - (truth + 20 / w)) < 4 * plug_in.std() / np.sqrt(trials)


@settings(max_examples=60, deadline=None)
@given(lo=st.floats(-3, 2), width=st.floats(0.001, 3))
def test_slope_words_follow_the_interval(lo, width):
    hi = lo + width
    word = rate_word((lo, hi))
    if lo <= -0.5 <= hi:
        assert word == ("falls as 1/sqrt(nT)" if hi < 0 else "not decided")
    elif hi < -0.5:
        assert word == "falls faster than 1/sqrt(nT)"
    elif hi < 0:
        assert word == "falls, slower than 1/sqrt(nT)"
    else:
        assert word in ("grows with nT", "no decrease resolved") and (word == "grows with nT") == (lo > 0)


def test_a_fit_recovers_minus_one_half_and_refuses_a_non_positive_cell():
    rng = np.random.default_rng(1)
    rows = [{"nT": n * t, "y": 3.0 * (n * t) ** -0.5 * np.exp(rng.normal(0, 0.02))} for n in (1, 2, 4, 8, 16) for t in (40, 126, 400)]
    f = _fit(rows, "y")
    assert f["word"] == "falls as 1/sqrt(nT)" and abs(f["slope"] + 0.5) < 0.02
    rows[3]["y"] = -1e-3  # an unbiased estimate below zero: the gradient is below its noise there
    assert _fit(rows, "y") is None


def test_every_split_cuts_the_held_out_windows_into_two_equal_disjoint_halves():
    idx = np.arange(rate_gpt.HELD_OUT_WINDOWS)
    for name, rule in rate_gpt.SPLITS.items():
        first = rule(idx)
        assert first.sum() == (~first).sum() == len(idx) // 2, name


def test_the_training_windows_of_the_rate_estimate_are_ones_the_run_never_reads(nano_cfg):
    """experiments.rate_gpt.unseen_training_windows against the sampler itself: no window a run of 6 steps on 3 ranks
    reads (inputs and targets, every rank) is among them, and they are distinct windows."""
    import numpy as np

    from experiments import rate_gpt
    from mecefo.data import TokenData

    data = TokenData(nano_cfg.data)
    b, t = nano_cfg.data.micro_batch_size, nano_cfg.data.seq_len
    steps, n = 6, 3
    starts = rate_gpt.unseen_training_windows(data, nano_cfg.train.seed, steps * b // rate_gpt.PER_RANK_BATCH + 1, n)
    unseen = {data.tokens["train"][s:s + t + 1].tobytes() for s in starts}
    assert len(unseen) == len(starts) == rate_gpt.HELD_OUT_WINDOWS
    for step in range(steps):
        for rank in range(n):
            for micro in range(nano_cfg.data.grad_accum):
                x, y = data.micro_batch(nano_cfg.train.seed, step, rank, micro, n)
                read = {np.concatenate([xi, yi[-1:]]).astype(data.tokens["train"].dtype).tobytes() for xi, yi in zip(x, y)}
                assert not read & unseen
