import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo.model import GPT, PRESETS, ModelConfig, apply_rope, count_parameters, preset, rope_tables


@pytest.mark.parametrize("name", ["nano", "tiny", "small"])
def test_parameter_count_matches_instantiated_model(name):
    model = GPT(PRESETS[name])
    assert sum(p.numel() for p in model.parameters()) == count_parameters(PRESETS[name])


@pytest.mark.parametrize("name", ["llama-60m", "llama-130m", "llama-350m", "llama-1b", "llama-7b"])
def test_paper_presets_instantiate_on_meta(name):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count_parameters(PRESETS[name])


def test_parameter_counts_of_known_models():
    # LLaMA-7B has 6,738,415,616 parameters (Touvron et al., 2023); GaLore's 60M config has 58.07M.
    assert count_parameters(PRESETS["llama-7b"]) == 6_738_415_616
    assert count_parameters(PRESETS["nano"]) <= 100_000
    assert 1_000_000 <= count_parameters(PRESETS["tiny"]) <= 5_000_000
    assert 15_000_000 <= count_parameters(PRESETS["small"]) <= 25_000_000


def test_causality():
    torch.manual_seed(0)
    model = GPT(preset("nano")).eval()
    idx = torch.randint(0, 512, (2, 40))
    changed = idx.clone()
    changed[:, 21] = (changed[:, 21] + 7) % 512
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :21], b[:, :21])
    assert not torch.allclose(a[:, 21:], b[:, 21:])


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 60), n=st.integers(0, 60), shift=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_rope_scores_depend_only_on_relative_position(m, n, shift, seed):
    """<R_m q, R_n k> = <R_{m+s} q, R_{n+s} k>: rotary embeddings encode relative position."""
    g = torch.Generator().manual_seed(seed)
    hd = 16
    cos, sin = rope_tables(hd, 128, 10000.0)
    q, k = torch.randn(hd, generator=g, dtype=torch.float64), torch.randn(hd, generator=g, dtype=torch.float64)
    rot = lambda x, p: apply_rope(x.view(1, 1, 1, hd), cos[p].double(), sin[p].double()).view(hd)  # noqa: E731
    assert torch.allclose(rot(q, m) @ rot(k, n), rot(q, m + shift) @ rot(k, n + shift), atol=1e-5)
    assert torch.allclose(rot(q, m).norm(), q.norm())


def test_rope_against_complex_rotation():
    """Independent computation: pairs (i, i + hd/2) as complex numbers multiplied by exp(j t theta^(-2i/hd))."""
    hd, t = 8, 5
    x = torch.randn(1, 1, t, hd, dtype=torch.float64)
    cos, sin = rope_tables(hd, t, 10000.0)
    ours = apply_rope(x, cos.double(), sin.double())
    z = torch.complex(x[..., : hd // 2], x[..., hd // 2 :])
    freqs = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    z = z * torch.exp(1j * torch.outer(torch.arange(t, dtype=torch.float64), freqs))
    assert torch.allclose(ours, torch.cat([z.real, z.imag], -1), atol=1e-6)


def test_loss_at_init_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(preset("nano"))
    idx = torch.randint(0, 512, (4, 32))
    loss = model(idx, idx)
    assert abs(loss.item() - math.log(512)) < 0.1


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(vocab_size=10, dim=30, n_layers=1, n_heads=4, ffn_dim=8)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("llama-3b")
    with pytest.raises(ValueError, match="max_seq_len"):
        GPT(preset("nano", max_seq_len=8))(torch.zeros(1, 9, dtype=torch.long))
