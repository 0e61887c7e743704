"""Property tests of the neighbour techniques against independent computations."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo.model import GPT, preset
from mecefo.neighbour import MECEFO, LowRankWgrad, Neighbour, Techniques, low_rank_linear, resolve_r



@pytest.fixture(autouse=True)
def double_precision():
    """Exact identities below are checked in double precision."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def linear_of(w):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = torch.nn.Parameter(w.clone())
    return lin


def lowrank_grads(w, x, gy, r, svd="exact"):
    """(estimated weight gradient, input gradient, V1) of y = x W^T under low_rank_wgrad."""
    lin = linear_of(w)
    x = x.clone().requires_grad_(True)
    lr = LowRankWgrad(r=r, svd=svd)
    low_rank_linear(lin, x, lr).backward(gy)
    lr.finish()
    return lin.weight.grad, x.grad, lr.basis(lin)


shapes = st.tuples(st.integers(2, 12), st.integers(2, 12), st.integers(1, 16))  # m, n, b


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), data=st.data())
def test_low_rank_estimator_properties(shape, seed, data):
    m, n, b = shape
    g = torch.Generator().manual_seed(seed)
    w, x, gy = torch.randn(m, n, generator=g), torch.randn(b, n, generator=g), torch.randn(b, m, generator=g)
    r = data.draw(st.integers(1, min(m, n)))
    exact = gy.T @ x
    est, gx, v1 = lowrank_grads(w, x, gy, r)
    p = v1 @ v1.T
    assert v1.shape == (n, r)
    assert torch.allclose(p, p.T) and torch.allclose(p @ p, p, atol=1e-10)  # symmetric, idempotent
    assert torch.allclose(est, exact @ p, atol=1e-10)  # estimate = exact gradient projected on span(V1)
    assert torch.allclose(gx, gy @ w, atol=1e-10)  # input gradient exact
    assert torch.linalg.matrix_rank(est, atol=1e-8) <= r
    err = torch.linalg.norm(exact - est)
    assert torch.isclose(err, torch.linalg.norm(exact @ (torch.eye(n) - p)))
    assert err <= torch.linalg.norm(exact) + 1e-10
    # V1 really holds the top-r right singular vectors of W (not of the gradient)
    top = torch.linalg.svd(w)[2][:r].T
    assert torch.allclose(p, top @ top.T, atol=1e-8) or torch.linalg.svdvals(w)[r - 1:r + 1].diff().abs().min() < 1e-6


@settings(max_examples=25, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_full_rank_is_exact_and_error_does_not_grow_with_r(shape, seed):
    m, n, b = shape
    g = torch.Generator().manual_seed(seed)
    w, x, gy = torch.randn(m, n, generator=g), torch.randn(b, n, generator=g), torch.randn(b, m, generator=g)
    exact = gy.T @ x
    errors = [torch.linalg.norm(exact - lowrank_grads(w, x, gy, r)[0]).item() for r in range(1, n + 1)]
    assert errors[-1] < 1e-9 * max(1.0, torch.linalg.norm(exact).item())
    assert all(later <= earlier + 1e-9 for earlier, later in zip(errors, errors[1:]))


@settings(max_examples=25, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), a=st.floats(-3, 3), c=st.floats(-3, 3))
def test_estimator_is_linear_in_the_output_gradient(shape, seed, a, c):
    m, n, b = shape
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(m, n, generator=g), torch.randn(b, n, generator=g)
    g1, g2 = torch.randn(b, m, generator=g), torch.randn(b, m, generator=g)
    r = max(1, min(m, n) // 2)
    lhs = lowrank_grads(w, x, a * g1 + c * g2, r)[0]
    rhs = a * lowrank_grads(w, x, g1, r)[0] + c * lowrank_grads(w, x, g2, r)[0]
    assert torch.allclose(lhs, rhs, atol=1e-9)


@settings(max_examples=25, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_exact_when_inputs_lie_in_span_of_v1(shape, seed):
    m, n, b = shape
    g = torch.Generator().manual_seed(seed)
    w, gy = torch.randn(m, n, generator=g), torch.randn(b, m, generator=g)
    r = max(1, min(m, n) // 2)
    v1 = LowRankWgrad(r=r, svd="exact").basis(linear_of(w))
    x = torch.randn(b, r, generator=g) @ v1.T
    est = lowrank_grads(w, x, gy, r)[0]
    assert torch.allclose(est, gy.T @ x, atol=1e-9)


def test_factor_accumulates_over_micro_batches_and_applies_once():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    lin = linear_of(w)
    lr = LowRankWgrad(r=2, svd="exact")
    xs, gys = [torch.randn(4, 5, generator=g) for _ in range(3)], [torch.randn(4, 6, generator=g) for _ in range(3)]
    for x, gy in zip(xs, gys):
        low_rank_linear(lin, x, lr).backward(gy)
    assert lin.weight.grad is None and lr.pending
    lr.finish()
    p = lr.basis(lin) @ lr.basis(lin).T
    assert torch.allclose(lin.weight.grad, sum(gy.T @ x for x, gy in zip(xs, gys)) @ p)


def test_subspace_cache_refreshes_every_tau_steps():
    w = linear_of(torch.randn(8, 6))
    lr = LowRankWgrad(r=3, tau=2, svd="exact")
    first = lr.basis(w)
    with torch.no_grad():
        w.weight.copy_(torch.randn(8, 6))
    lr.steps = 1
    assert lr.basis(w) is first and lr.svd_count == 1
    lr.steps = 2
    assert lr.basis(w) is not first and lr.svd_count == 2
    lr.refresh()
    lr.basis(w)
    assert lr.svd_count == 3


def test_randomized_svd_recovers_a_low_rank_subspace():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(60, 4, generator=g) @ torch.randn(4, 40, generator=g)  # exactly rank 4
    exact = LowRankWgrad(r=4, svd="exact").basis(linear_of(w))
    rand = LowRankWgrad(r=4, svd="randomized").basis(linear_of(w))
    assert torch.allclose(exact @ exact.T, rand @ rand.T, atol=1e-8)


def test_rank_resolution():
    assert resolve_r(32, 100, 50) == 32 and resolve_r(500, 100, 50) == 50 and resolve_r(500, 50, 100) == 100
    assert resolve_r(0.25, 100, 64) == 16 and resolve_r(0.001, 10, 10) == 1


# --------------------------------------------------------------------------------------- the model


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(preset("nano", vocab_size=64))


def grads_of(model, idx, neighbour=None):
    model.zero_grad(set_to_none=True)
    loss = model(idx, idx.roll(-1, 1), neighbour=neighbour)
    loss.backward()
    if neighbour is not None:
        neighbour.finish()
    return loss.detach(), {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("spec", ["skip_attention", "recompute_ffn", "low_rank_wgrad", "mecefo", "skip_ffn"])
def test_neighbour_leaves_the_loss_unchanged(model, spec):
    idx = torch.randint(0, 64, (3, 20))
    assert torch.equal(grads_of(model, idx)[0], grads_of(model, idx, Neighbour(Techniques.parse(spec)))[0])


def test_recompute_ffn_gradients_equal_normal_mode(model):
    idx = torch.randint(0, 64, (3, 20))
    _, normal = grads_of(model, idx)
    _, recomputed = grads_of(model, idx, Neighbour(Techniques(recompute_ffn=True)))
    for name in normal:
        assert torch.allclose(normal[name], recomputed[name], atol=1e-12), name


def test_skip_attention_gives_attention_no_gradient_and_the_rest_a_residual_only_path(model):
    idx = torch.randint(0, 64, (3, 20))
    _, grads = grads_of(model, idx, Neighbour(Techniques(skip_attention=True)))
    for name, g in grads.items():
        if ".attention" in name:  # q, k, v, o projections and the attention RMSNorm
            assert g is None, name
        else:
            assert g is not None and g.abs().sum() > 0, name


def test_skip_attention_block_input_gradient_is_the_residual_paths(model):
    """Independent computation: with a = Attention(RMSNorm(x)) held constant, out = h + FFN(RMSNorm(h)),
    h = x + a, so dL/dx = g + J_ffn(h)^T g, J_ffn from torch.autograd.functional.vjp."""
    block = model.layers[0]
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    x = torch.randn(2, 10, 32, requires_grad=True)
    g = torch.randn(2, 10, 32)
    block(x, cos, sin, Neighbour(Techniques(skip_attention=True))).backward(g)
    with torch.no_grad():
        h = x + block.attention(block.attention_norm(x), cos, sin)
    _, vjp = torch.autograd.functional.vjp(lambda u: block.ffn(block.ffn_norm(u)), h, g)
    assert torch.allclose(x.grad, g + vjp, atol=1e-12)


def test_low_rank_wgrad_touches_only_ffn_weights(model):
    idx = torch.randint(0, 64, (3, 20))
    _, normal = grads_of(model, idx)
    lowrank = LowRankWgrad(r=4, svd="exact")
    _, approx = grads_of(model, idx, Neighbour(Techniques(low_rank_wgrad=True), lowrank))
    for name in normal:
        if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            lin = model.get_submodule(name.removesuffix(".weight"))
            p = lowrank.basis(lin) @ lowrank.basis(lin).T
            assert torch.allclose(approx[name], normal[name] @ p, atol=1e-12), name
        else:
            assert torch.allclose(approx[name], normal[name], atol=1e-12), name


def test_skip_ffn_gives_ffn_no_gradient(model):
    idx = torch.randint(0, 64, (3, 20))
    _, grads = grads_of(model, idx, Neighbour(Techniques(skip_ffn=True)))
    assert all((g is None) == (".ffn" in n) for n, g in grads.items())


def test_normal_mode_after_neighbour_mode_is_unchanged(model):
    """Switching per micro-batch leaves nothing behind in the model."""
    idx = torch.randint(0, 64, (3, 20))
    before = grads_of(model, idx)
    grads_of(model, idx, Neighbour(MECEFO))
    after = grads_of(model, idx)
    assert torch.equal(before[0], after[0])
    assert all(torch.equal(before[1][n], after[1][n]) for n in before[1])


def test_parse_techniques():
    assert Techniques.parse("mecefo") == MECEFO and Techniques.parse("normal") == Techniques()
    assert Techniques.parse("skip_attention+low_rank_wgrad").names == "skip_attention+low_rank_wgrad"
    with pytest.raises(ValueError, match="unknown technique"):
        Techniques.parse("skip_everything")
