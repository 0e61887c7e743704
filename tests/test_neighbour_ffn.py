"""mecefo.neighbour.NeighbourFFN: the FFN sublayer under recompute_ffn and/or low_rank_wgrad as one Function, against
the implementation it replaced (torch's checkpoint of the sublayer, each linear as the low-rank Function), in fp32 and
under bf16 autocast (the default dtype here is fp32: test_neighbour.py's fp64 is not autocast-eligible)."""

import pytest
import torch

from mecefo.neighbour import MECEFO, LowRankWgrad, Neighbour, Techniques, low_rank_linear


def _before(block, h, t, lowrank):
    """The FFN sublayer as it ran before NeighbourFFN: torch's non-reentrant checkpoint of the whole sublayer (which
    reran the down projection under low_rank_wgrad), each linear as the low-rank Function. The reference."""
    from torch.utils.checkpoint import checkpoint

    project = (lambda lin, x: low_rank_linear(lin, x, lowrank)) if t.low_rank_wgrad else None
    if t.recompute_ffn:
        return checkpoint(block.ffn_sublayer, h, project, use_reentrant=False)
    return block.ffn_sublayer(h, project)


def _ffn_grads(block, h0, gys, t, fused: bool, bf16: bool) -> dict:
    block.zero_grad(set_to_none=True)
    lowrank = LowRankWgrad(r=0.125, svd="exact").bind(block)
    grads_h = []
    for i, gy in enumerate(gys):  # several micro-batches: the low-rank factors accumulate
        h = (h0 * (1 + i)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = Neighbour(t, lowrank).ffn(block, h) if fused else _before(block, h, t, lowrank)
        y.backward(gy)
        grads_h.append(h.grad)
    lowrank.finish()
    ffn = block.ffn
    return {"h": torch.cat(grads_h), "norm": block.ffn_norm.weight.grad,
            **{n: getattr(ffn, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")}}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["recompute_ffn", "low_rank_wgrad", "recompute_ffn+low_rank_wgrad"])
def test_neighbour_ffn_gives_the_gradients_of_the_implementation_it_replaces(spec, bf16):
    """Input, norm and weight gradients (the low-rank ones after finish()) over three micro-batches, against the
    checkpoint-and-per-linear-Function path in fp32 and under bf16 autocast: the same kernels, except that the
    low-rank factors are summed over the micro-batches by autograd (mm, then add) where the old path added in the GEMM
    (addmm), so the sums may differ in the last bits; the tolerance is far above that and far below a change of
    algorithm."""
    from mecefo.model import Block, ModelConfig

    torch.manual_seed(0)
    block = Block(ModelConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, ffn_dim=176))
    h0, gys = torch.randn(2, 16, 64), [torch.randn(2, 16, 64) for _ in range(3)]
    t = Techniques.parse(spec)
    new, old = _ffn_grads(block, h0, gys, t, True, bf16), _ffn_grads(block, h0, gys, t, False, bf16)
    for k in new:
        assert new[k].dtype == old[k].dtype, k
        assert torch.allclose(new[k], old[k], rtol=1e-2 if bf16 else 1e-5, atol=1e-6), k


def test_the_low_rank_factors_accumulate_in_one_fp32_buffer_per_matrix_allocated_once():
    """Under bf16 autocast the factor buffers (the carriers' .grad) are fp32, the same storage from one micro-batch and
    one step to the next (zeroed after each finish()), one per FFN matrix."""
    from mecefo.model import Block, ModelConfig

    torch.manual_seed(0)
    block = Block(ModelConfig(vocab_size=8, dim=32, n_layers=1, n_heads=2, ffn_dim=64))
    lowrank = LowRankWgrad(r=4, svd="exact").bind(block)
    storage = None
    for _ in range(2):
        for _ in range(2):
            h = torch.randn(1, 8, 32, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = Neighbour(MECEFO, lowrank).ffn(block, h)
            y.float().sum().backward()
        factors = lowrank.pending
        assert len(factors) == 3 and all(f.dtype == torch.float32 for f in factors.values())
        ptrs = sorted(f.data_ptr() for f in factors.values())
        assert storage in (None, ptrs)
        storage = ptrs
        del factors
        lowrank.finish()
        assert not lowrank.pending and all(not c.grad.any() for c in lowrank._carriers.values())


def test_the_fsdp_hand_off_of_the_low_rank_factors_applies_each_once():
    """engine.add_low_rank_rows (FSDP2: the factors summed over a group's processes, each adding its rows) takes this
    step's factors and clears them: nothing is left pending for finish() or for the next step (the reused buffers once
    carried a step's factors into the next under FSDP2, and sharded runs drifted from unsharded ones by 4e-4)."""
    from mecefo.engine import add_low_rank_rows
    from mecefo.model import GPT, ModelConfig
    from mecefo.plan import Piece, StepPlan

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=16, dim=32, n_layers=2, n_heads=2, ffn_dim=64))
    lowrank = LowRankWgrad(r=4, svd="exact").bind(model)
    x = torch.randint(0, 16, (2, 8))
    model(x, x, neighbour=Neighbour(MECEFO, lowrank)).backward()
    assert len(lowrank.pending) == 6
    expected = torch.cat([lowrank.pending[m].reshape(-1) for m in lowrank.matrices(model)])  # (in the model's order)
    for linear in lowrank.matrices(model):
        linear.weight.grad = None  # (no DTensor shard to add rows to here: only the hand-off is under test)
    reduced = []
    plan = StepPlan(step=1, failed=frozenset({1}), neighbours={1: 0}, pieces={0: (Piece(1, 0, 0, 2, 2, MECEFO),)})
    add_low_rank_rows(model, lowrank, plan, 0, 2, lambda flat: reduced.append(flat.clone()))
    assert torch.equal(reduced[0], expected)
    assert not lowrank.pending and all(not c.grad.any() for c in lowrank._carriers.values())
    with pytest.raises(TypeError):
        lowrank.pending[model] = expected  # read-only: a caller cannot pop a factor and leave its buffer behind
