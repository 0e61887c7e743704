"""cluster.neighbour_pass: a process's pieces each in its own forward and backward pass (sequential), or those of one
micro-batch index and technique set as one pass (fused: a neighbour's own and failed micro-batch together)."""

import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mecefo import config as config_mod
from mecefo.engine import Sharded
from mecefo.errors import UsageError
from mecefo.plan import fuse
from mecefo.policies import plan_step, trainer_policies
from mecefo.train import main
from tests.conftest import NANO, TRACE, model_params, torchrun

from experiments.common import CONFIGS

POLICIES = [p for p in trainer_policies() if p != "checkpoint-restart"]


def _rows(pieces):
    """Every (owner, micro, row) the pieces cover, with its multiplicity."""
    return Counter((p.owner, p.micro, r) for p in pieces for r in range(p.start, p.stop))


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES), n=st.integers(2, 6), accum=st.integers(1, 3), batch=st.integers(1, 6),
       data=st.data())
def test_fused_passes_partition_each_ranks_pieces_by_micro_batch_and_techniques(policy, n, accum, batch, data):
    failed = frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))
    plan = plan_step(policy, 0, failed, n, accum, batch)
    for pieces in plan.pieces.values():
        passes = fuse(pieces)
        assert Counter(p for ps in passes for p in ps) == Counter(pieces)  # every piece once
        assert all([p for p in pieces if p in ps] == ps for ps in passes)  # in the plan's order within its pass
        assert all(len({(p.micro, p.techniques, p.batch) for p in ps}) == 1 for ps in passes)
        assert len({(ps[0].micro, ps[0].techniques, ps[0].batch) for ps in passes}) == len(passes)
        assert len(passes) <= len(pieces)


def _sharded(plan, rank, j, k, neighbour_pass, injected):
    """Sharded's pass planning alone (no FSDP needed): process j of k, computing for `rank`."""
    engine = object.__new__(Sharded)
    engine.shard_group, engine.rank, engine.neighbour_pass = (j, k), rank, neighbour_pass
    engine.all_reduce = (lambda t: None) if injected else None
    return engine.shares(plan)


@pytest.mark.parametrize("neighbour_pass", ["sequential", "fused"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_a_replica_groups_processes_split_each_pass_by_rows(neighbour_pass, k):
    """torchft with FSDP: the k processes of the neighbour's replica group run the same number of passes, each pass's
    row shares together cover the pieces' rows exactly once, and the weights add up to the pieces' (a process without
    a row in a pass runs one row at weight 0)."""
    plan = plan_step("mecefo", 0, frozenset({1}), 3, 2, 4)
    mine = plan.pieces[2]  # the neighbour's own and the failed rank's micro-batches
    shares = [_sharded(plan, 2, j, k, neighbour_pass, injected=True) for j in range(k)]
    assert len({len(s) for s in shares}) == 1
    assert len(shares[0]) == (2 if neighbour_pass == "fused" else 4)
    covered = Counter()
    for s in shares:
        for pieces, weight in s:
            if weight:
                covered += _rows(pieces)
                assert weight == pytest.approx(sum(p.weight for p in pieces))
    assert covered == _rows(mine)
    assert sum(w for s in shares for _, w in s) == pytest.approx(sum(p.weight for p in mine))


@pytest.mark.parametrize("neighbour_pass", ["sequential", "fused"])
def test_fsdp_ranks_run_as_many_passes_as_the_busiest(neighbour_pass):
    """The torch backend with FSDP (one process per rank): FSDP's collectives need every rank in every pass, so a rank
    with fewer passes than the neighbour runs weight-0 fillers; fused, the neighbour's passes are as many as anyone's."""
    plan = plan_step("mecefo", 0, frozenset({1}), 3, 2, 4)
    shares = {r: _sharded(plan, r, r, 3, neighbour_pass, injected=False) for r in range(3)}
    assert {len(s) for s in shares.values()} == {2 if neighbour_pass == "fused" else 4}
    assert [w for _, w in shares[1]] == [0.0] * len(shares[1])  # the failed rank: fillers only
    assert _rows([p for ps, w in shares[2] for p in ps]) == _rows(plan.pieces[2])


def test_neighbour_pass_is_validated_and_hashed_where_it_changes_the_arithmetic(tmp_path, capsys):
    cfg = config_mod.load(CONFIGS / "nano.toml", {})
    with pytest.raises(UsageError, match="cluster.neighbour_pass='both'"):
        dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, neighbour_pass="both")).validate()
    fused = lambda c: dataclasses.replace(c, cluster=dataclasses.replace(c.cluster, neighbour_pass="fused"))  # noqa: E731
    assert fused(cfg).hash() == cfg.hash()  # the local backend fuses every rank's micro-batch m anyway
    torch_cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend="torch"))
    assert fused(torch_cfg).hash() != torch_cfg.hash()
    assert main([*NANO, "--neighbour_pass", "both", "--out", str(tmp_path / "x")]) == 2
    assert "neighbour_pass" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_fused_passes_on_gloo_and_fsdp_end_where_the_local_run_does(tmp_path):
    """nano on 4 gloo ranks through failures of ranks 1 and 0 (MeCeFO): with the neighbours' passes fused, replicated
    and FSDP-sharded, the parameters end equal to the local backend's (which runs every rank's micro-batch m as one
    pass), within the tolerance the sequential twins are held to."""
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    common = [*NANO, "--quiet", "--steps", "10", "--eval_every", "5", "--failures", str(trace), "--seconds_per_step",
              "1", "--ranks", "4", "--cluster.r", "4", "--policy", "mecefo"]
    assert main(common + ["--out", str(tmp_path / "local")]) == 0
    for out, extra in (("gloo", []), ("fsdp", ["--shard", "fsdp"])):
        proc = torchrun(4, common + ["--backend", "torch", "--neighbour_pass", "fused", *extra,
                                     "--out", str(tmp_path / out)])
        assert proc.returncode == 0, proc.stderr[-3000:]
    local = model_params(tmp_path / "local")
    for out in ("gloo", "fsdp"):
        got = model_params(tmp_path / out)
        for name in local:
            assert torch.allclose(local[name], got[name], atol=1e-5, rtol=1e-4), (out, name)


def test_the_memory_check_sizes_a_fused_pass_by_its_rows():
    """A fused neighbour pass holds its own and the failed micro-batch: its saved tensors are those of 2b rows under the
    techniques, which with low_rank_wgrad alone outgrow a normal pass of b rows."""
    from mecefo.costs import Shape, saved_activation_bytes, training_memory
    from mecefo.model import preset
    from mecefo.neighbour import Techniques

    cfg, t = preset("tiny"), Techniques.parse("low_rank_wgrad")
    sequential = training_memory(cfg, Shape(4, 64), techniques=t)
    fused = training_memory(cfg, Shape(4, 64), techniques=t, neighbour_rows=8)
    assert fused["activations"] == saved_activation_bytes(cfg, Shape(8, 64), t) > sequential["activations"]
    assert fused["total"] - fused["activations"] == sequential["total"] - sequential["activations"]
