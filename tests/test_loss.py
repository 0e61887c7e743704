"""mecefo.loss.ChunkedCrossEntropy against torch's cross-entropy of the whole logits (an independent computation): loss
and gradients in fp64 for any shape and chunk, under bf16 autocast within its rounding, inside the GPT, and what it
keeps for backward (nothing of size rows x vocabulary)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo.loss import chunked_cross_entropy


def _whole(x, w, y, upstream=1.0):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    logits = x @ w.T
    loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), y)
    (loss * upstream).backward()
    return loss.detach(), x.grad, w.grad


def _chunked(x, w, y, rows, upstream=1.0):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = chunked_cross_entropy(x, w, y, rows)
    (loss * upstream).backward()
    return loss.detach(), x.grad, w.grad


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), vocab=st.integers(2, 50), dim=st.integers(1, 12), rows=st.integers(1, 50),
       upstream=st.floats(0.1, 4.0), seed=st.integers(0, 2**16))
def test_loss_and_gradients_equal_the_whole_logits_in_fp64(n, vocab, dim, rows, upstream, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(n, dim, generator=g, dtype=torch.float64), torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    for a, b in zip(_chunked(x, w, y, rows, upstream), _whole(x, w, y, upstream)):
        assert a.dtype == b.dtype == torch.float64
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_under_bf16_autocast_it_matches_the_whole_logits_within_bf16_rounding():
    torch.manual_seed(0)
    x, w, y = torch.randn(96, 32), torch.randn(200, 32) * 0.2, torch.randint(0, 200, (96,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = _chunked(x, w, y, 40)
        old = _whole(x, w, y)  # (the matmul in bf16 under autocast, as the LM head)
    assert new[0].dtype == torch.float32 and new[1].dtype == new[2].dtype == torch.float32
    assert new[0].item() == pytest.approx(old[0].item(), rel=2e-3)
    for a, b in zip(new[1:], old[1:]):
        assert (a - b).norm() <= 2e-2 * b.norm()


def test_it_keeps_no_logits_for_backward():
    """Saved for backward: the input gradient (N x D) and the weight gradient (V x D), nothing of N x V."""
    torch.manual_seed(0)
    n, vocab, dim = 64, 300, 16
    x, w = torch.randn(n, dim, requires_grad=True), torch.randn(vocab, dim, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        chunked_cross_entropy(x, w, torch.randint(0, vocab, (n,)), 16)
    assert sorted(saved) == sorted([(n, dim), (vocab, dim)])


def test_the_gpt_loss_in_chunks_equals_the_whole_one():
    from mecefo.model import GPT, ModelConfig
    from mecefo.neighbour import MECEFO, Neighbour

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, ffn_dim=64)).double()
    idx, tgt = torch.randint(0, 64, (3, 10)), torch.randint(0, 64, (3, 10))
    results = []
    for rows in (0, 7):
        model.loss_rows = rows
        model.zero_grad(set_to_none=True)
        loss = model(idx, tgt, neighbour=Neighbour(MECEFO))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (a, ga), (b, gb) = results  # (the whole path takes the loss of fp64 logits in fp32, as the model always has)
    assert b.dtype == torch.float64 and a.item() == pytest.approx(b.item(), rel=1e-6) and len(ga) == len(gb)
    assert all(torch.allclose(u, v, rtol=1e-5, atol=1e-9) for u, v in zip(ga, gb))


def test_bad_chunk_and_config_values():
    from mecefo.config import TrainConfig
    from mecefo.errors import UsageError

    with pytest.raises(ValueError, match="at least 1"):
        chunked_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1]), 0)
    with pytest.raises(UsageError, match="train.loss_rows=-2"):
        TrainConfig(loss_rows=-2).validate()
    assert TrainConfig(device="cpu").resolved_loss_rows() == 0 and TrainConfig(device="cuda").resolved_loss_rows() == 4096
    assert TrainConfig(device="cpu", loss_rows=512).resolved_loss_rows() == 512
    from dataclasses import replace

    from mecefo.config import Config

    cfg = replace(Config(), train=TrainConfig(device="cpu"))  # auto is the whole logits on a CPU: one identity
    assert replace(cfg, train=TrainConfig(device="cpu", loss_rows=0)).hash() == cfg.hash()
    assert replace(cfg, train=TrainConfig(device="cuda")).hash() != replace(cfg, train=TrainConfig(device="cuda", loss_rows=0)).hash()


@pytest.mark.slow
def test_fsdp_and_a_neighbour_train_with_the_loss_in_chunks_as_with_the_whole_one(tmp_path):
    """nano on 4 gloo ranks, FSDP2, ranks 1 and 0 failing (neighbours cover with MeCeFO): the loss in chunks of 7 rows (the LM
    head's weight unsharded for the chunks, its gradient reduce-scattered by FSDP2) against the whole logits."""
    from tests.conftest import NANO, TRACE, metrics, model_params, torchrun

    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    args = [*NANO, "--quiet", "--steps", "6", "--eval_every", "3", "--failures", str(trace), "--seconds_per_step", "1",
            "--ranks", "4", "--cluster.r", "4", "--backend", "torch", "--shard", "fsdp"]
    for rows in (0, 7):
        proc = torchrun(4, [*args, "--loss_rows", str(rows), "--out", str(tmp_path / str(rows))])
        assert proc.returncode == 0, proc.stderr[-3000:]
    whole, chunked = metrics(tmp_path / "0"), metrics(tmp_path / "7")
    assert any(row.get("failed") for row in whole[1:])
    for a, b in zip(whole[1:], chunked[1:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    pa, pb = model_params(tmp_path / "0"), model_params(tmp_path / "7")  # (the sums' order differs: AdamW moves a
    assert all(torch.allclose(pa[k], pb[k], rtol=1e-4, atol=1e-5) for k in pa)  # parameter with a ~0 gradient by up to
    # lr either way; 4.0e-6 measured at most here, losses within 1e-7; the sharded-vs-unsharded test's tolerance)


def test_without_grad_it_computes_the_loss_only():
    """Under no_grad (an evaluation) the loss equals the one with gradients, and torch counts only the logits' GEMM."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    x, w, y = torch.randn(12, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True), torch.randint(0, 20, (12,))
    with FlopCounterMode(display=False) as counter:
        loss = chunked_cross_entropy(x, w, y, 5)
    assert counter.get_total_flops() == 3 * 2 * 12 * 8 * 20  # the logits, G_x and G_W (addmm with out= is counted)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        evaluated = chunked_cross_entropy(x, w, y, 5)
    assert counter.get_total_flops() == 2 * 12 * 8 * 20 and torch.equal(evaluated, loss.detach())
