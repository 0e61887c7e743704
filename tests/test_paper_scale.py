"""The path a researcher with GPUs takes, checked on the CPU: bf16 autocast on every neighbour path, one
low-rank subspace on every rank, the torch backend's grad-error tracking and run reuse, FSDP2 sharding,
non-finite values and all-down runs."""

import dataclasses
import json
import math

import pytest
import torch

from mecefo import checkpoint
from mecefo.engine import Batched
from mecefo.model import group_of
from mecefo.policies import trainer_policies
from mecefo.model import GPT, preset
from mecefo.neighbour import MECEFO, LowRankWgrad, Neighbour, Techniques, exact_right_basis, randomized_right_basis
from mecefo.train import main
from tests.conftest import NANO, TRACE, metrics, model_params, torchrun

pytestmark = pytest.mark.filterwarnings("ignore")
NANO = [*NANO, "--quiet"]
BF16_REL = 2e-4  # 4.4e-5 measured at most over the trainer's policies (8 nano steps, 4 ranks)


# ------------------------------------------------------------------------------------------------ bf16
@pytest.mark.parametrize("policy", trainer_policies())
def test_every_policy_trains_under_bf16_with_failures(tmp_path, policy):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    args = NANO + ["--steps", "8", "--ranks", "4", "--failures", str(trace), "--seconds_per_step", "1",
                   "--policy", policy, "--restart_every", "3"]
    assert main(args + ["--precision", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    assert main(args + ["--precision", "fp32", "--out", str(tmp_path / "fp32")]) == 0
    rows, fp32 = metrics(tmp_path / "bf16")[1:], metrics(tmp_path / "fp32")[1:]
    if policy == "checkpoint-restart":
        assert rows[-1]["replayed_steps"] > 0
    else:
        assert sum(bool(r["failed"]) for r in rows) == 6  # the failure path really ran
    assert len(rows) == len(fp32) >= 8 and all(math.isfinite(r["loss"]) for r in rows)  # replays add rows
    # bf16 autocast follows the fp32 run step by step (a NaN or an inf fails this too)
    assert max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rows, fp32)) < BF16_REL


def _group_grads(model, idx, techniques, bf16):
    model.zero_grad(set_to_none=True)
    lowrank = LowRankWgrad(r=0.125, svd="exact").bind(model)
    nb = None if techniques == Techniques() else Neighbour(techniques, lowrank)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(idx, idx.roll(-1, 1), neighbour=nb)
    loss.backward()
    if nb is not None:
        nb.finish()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative_error_by_group(a, b):
    out = {}
    for n in a:
        g = group_of(n).split(".")[0]
        d, e = out.get(g, (0.0, 0.0))
        out[g] = (d + ((a[n] - b[n]) ** 2).sum().item(), e + (a[n] ** 2).sum().item())
    return {g: (d / e) ** 0.5 for g, (d, e) in out.items()}


@pytest.mark.parametrize("spec", ["mecefo", "skip_attention", "recompute_ffn", "low_rank_wgrad", "skip_ffn",
                                  "mecefo+low_rank_head"])
def test_bf16_neighbour_gradients_agree_with_fp32(spec):
    """Tolerance: 2% relative (Frobenius, per parameter group), and no more than 1.5x the bf16 error of the
    plain path on the same batch (measured: 0.3-0.7% on nano and tiny, equal to the plain path's)."""
    torch.manual_seed(0)
    model = GPT(preset("nano", vocab_size=512))
    idx = torch.randint(0, 512, (4, 64))
    plain = _relative_error_by_group(_group_grads(model, idx, Techniques(), False),
                                     _group_grads(model, idx, Techniques(), True))
    t = dataclasses.replace(MECEFO, low_rank_head=True) if spec == "mecefo+low_rank_head" else Techniques.parse(spec)
    err = _relative_error_by_group(_group_grads(model, idx, t, False), _group_grads(model, idx, t, True))
    assert err, spec
    for group, e in err.items():
        assert e < 0.02 and e < 1.5 * plain[group] + 1e-3, (group, e, plain[group])


def test_low_rank_linear_computes_in_bf16_and_accumulates_its_factor_in_fp32():
    from mecefo.neighbour import low_rank_linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24, bias=False)
    lowrank = LowRankWgrad(r=4, svd="exact")
    x = torch.randn(5, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = low_rank_linear(lin, x, lowrank)
    assert y.dtype == torch.bfloat16 and lin(x).dtype == torch.float32  # as nn.Linear under autocast: bf16
    assert {t.dtype for t in saved} == {torch.bfloat16} and any(t.shape == (5, 4) for t in saved)  # x V1, bf16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert lowrank.pending and all(f.dtype == torch.float32 for f in lowrank.pending.values())
    lowrank.finish()
    assert lin.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------------------------------ subspaces
def test_randomized_subspace_does_not_depend_on_the_global_rng():
    torch.manual_seed(0)
    lin = torch.nn.Linear(300, 200, bias=False)
    a = LowRankWgrad(r=16, svd="randomized", seed=3)
    b = LowRankWgrad(r=16, svd="randomized", seed=3)
    va = a.basis(lin)
    torch.randn(1000)  # a different RNG history on the second "rank"
    torch.manual_seed(12345)
    vb = b.basis(lin)
    assert torch.equal(va, vb)
    b.steps = b.tau  # a new epoch draws a new test matrix, deterministically
    b.refresh()
    assert not torch.equal(b.basis(lin), va)


def test_randomized_basis_captures_the_energy_of_the_exact_one():
    """On a decaying spectrum the range finder with our defaults is within 1% of the exact top-r energy."""
    g = torch.Generator().manual_seed(0)
    m, n, r = 400, 160, 20
    u, _ = torch.linalg.qr(torch.randn(m, n, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    w = u @ torch.diag(torch.arange(1, n + 1, dtype=torch.float32) ** -0.5) @ v.T
    lr = LowRankWgrad()
    approx = randomized_right_basis(w, r, lr.oversample_columns(r), lr.niter, torch.Generator().manual_seed(1))
    exact = exact_right_basis(w, r)
    assert torch.allclose(approx.T @ approx, torch.eye(r), atol=1e-4)  # orthonormal columns
    assert (w @ approx).square().sum() >= 0.99 * (w @ exact).square().sum()


@pytest.mark.slow
def test_gloo_ranks_hold_one_subspace_with_randomized_svd_and_failures_of_rank_0(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)  # rank 1 down at steps 2-5, rank 0 at 4-7
    args = NANO + ["--steps", "10", "--eval_every", "5", "--failures", str(trace), "--seconds_per_step", "1",
                   "--ranks", "4", "--cluster.r", "4", "--low_rank_svd", "randomized", "--low_rank_tau", "3"]
    proc = torchrun(4, args + ["--backend", "torch", "--out", str(tmp_path / "gloo")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gloo" / "summary.json").read_text())
    assert summary["rank_agreement"] == {"ranks_checked": [0, 1, 2, 3], "identical": True}
    assert main(args + ["--out", str(tmp_path / "local")]) == 0
    a, b = model_params(tmp_path / "local"), model_params(tmp_path / "gloo")
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5, rtol=1e-4), name


# ------------------------------------------------------------------------------ torch backend, FSDP2
@pytest.mark.slow
def test_torch_backend_tracks_grad_error_like_local_and_reuses_a_finished_run(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    args = NANO + ["--steps", "8", "--eval_every", "8", "--failures", str(trace), "--seconds_per_step", "1",
                   "--ranks", "4", "--cluster.r", "4", "--track_grad_error", "true"]
    assert main(args + ["--out", str(tmp_path / "local")]) == 0
    proc = torchrun(4, args + ["--backend", "torch", "--out", str(tmp_path / "gloo")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    local, gloo = metrics(tmp_path / "local")[1:], metrics(tmp_path / "gloo")[1:]
    tracked = [(a["grad_rel_error"], b["grad_rel_error"]) for a, b in zip(local, gloo) if a["failed"]]
    assert len(tracked) == 6 and all(b is not None and b == pytest.approx(a, rel=1e-4) for a, b in tracked)
    again = torchrun(4, args + ["--backend", "torch", "--out", str(tmp_path / "gloo")], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]  # every rank returned (no barrier left waiting)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mecefo", "spread-mecefo"])
def test_fsdp_sharded_and_unsharded_runs_end_with_equal_parameters(tmp_path, policy):
    """nano on 4 gloo ranks over failures of ranks 1 and 0; sharded vs unsharded (the FSDP checkpoint written by
    every rank, shard by shard, and read whole in one process), and (mecefo) runs stopped at step 5 (rank 1 down)
    and resumed, each bit-identical to its uninterrupted twin."""
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    args = NANO + ["--steps", "10", "--eval_every", "5", "--failures", str(trace), "--seconds_per_step", "1",
                   "--ranks", "4", "--cluster.r", "4", "--policy", policy, "--backend", "torch", "--checkpoint_every", "5"]
    runs = (("plain", []), ("fsdp", ["--shard", "fsdp"]),
            ("resumed", ["--shard", "fsdp", "--stop-after", "5"]), ("resumed", ["--shard", "fsdp", "--resume"]),
            ("plain-resumed", ["--stop-after", "5"]), ("plain-resumed", ["--resume"]))
    resumes = policy == "mecefo"  # (the resumes do not depend on the policy: one policy checks them)
    for out, extra in runs if resumes else runs[:2]:
        proc = torchrun(4, args + extra + ["--out", str(tmp_path / out)])
        assert proc.returncode == 0, proc.stderr[-3000:]
    plain, fsdp = model_params(tmp_path / "plain"), model_params(tmp_path / "fsdp")  # (FSDP's shards read whole)
    written = (tmp_path / "fsdp" / "checkpoint").resolve()
    assert sorted(p.name for p in written.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]  # each its own
    for name in plain:
        assert torch.allclose(plain[name], fsdp[name], atol=1e-5, rtol=1e-4), name
    if resumes:
        resumed, plain_resumed = model_params(tmp_path / "resumed"), model_params(tmp_path / "plain-resumed")
        for name in plain:
            assert torch.equal(fsdp[name], resumed[name]), name
            assert torch.equal(plain[name], plain_resumed[name]), name  # rank 0 reads, the others receive
    summary = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert summary["rank_agreement"]["identical"]


def test_bad_shard_option_exits_2(tmp_path, capsys):
    assert main(NANO + ["--shard", "fsdp", "--out", str(tmp_path / "o")]) == 2
    assert "cluster.shard='fsdp' is not available on cluster.backend='local'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("option", ["--lr", "--optim.beta1", "--seconds_per_step", "--r", "--grad_clip"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_float_options_must_be_finite(tmp_path, capsys, option, value):
    assert main(NANO + [option, value, "--out", str(tmp_path / "o")]) == 2
    assert "must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_keeps_the_checkpoint(tmp_path, capsys, monkeypatch):
    step = Batched.step

    def poisoned(self, plan):
        result = step(self, plan)
        if plan.step == 4:  # the update that makes step 5
            result.loss = float("nan")
        return result

    monkeypatch.setattr(Batched, "step", poisoned)
    out = tmp_path / "o"
    args = NANO + ["--steps", "10", "--checkpoint_every", "2", "--ranks", "2", "--out", str(out)]
    assert main(args) == 3
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("stopped: step 5: non-finite training loss nan")
    assert checkpoint.read(out / "checkpoint")["step"] == 4  # the last good one, untouched
    assert [r["step"] for r in metrics(out)[1:]] == [1, 2, 3, 4]
    assert not (out / "summary.json").exists()


# ------------------------------------------------------------------------------ --full, the GPU check
def test_full_commands_fit_an_a100_and_a_replicated_7b_is_refused_naming_the_fix():
    from experiments.sweep import GPU_BYTES, check_fits, full_commands
    from mecefo import config as config_mod
    from mecefo.errors import UsageError

    script, memory = full_commands()
    assert set(memory) == {"llama-350m", "llama-1b", "llama-7b"}
    assert all(m["total"] <= GPU_BYTES for m in memory.values())
    assert memory["llama-7b"]["shard"] == "fsdp" and script.count("--shard fsdp") == 4
    replicated = config_mod.load(None, {"preset": "llama-7b", "vocab_size": "32000", "seq_len": "256",
                                        "micro_batch_size": "2", "ranks": "32", "backend": "torch"})
    with pytest.raises(UsageError, match=r"llama-7b .* needs 1\d\d\.\d GB per GPU > 80 GB; shard it: --shard fsdp"):
        check_fits(replicated)


@pytest.mark.slow
def test_gpu_check_runs_on_the_cpu_and_skips_cleanly_without_cuda(tmp_path, monkeypatch, capsys):
    import experiments.gpu_check as gpu_check

    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 0
    result = json.loads((tmp_path / "gpu_check-cpu.json").read_text())
    assert result["ok"] and set(result["policies"]) == set(trainer_policies())
    assert all(p["steps_with_failures"] > 0 for p in result["policies"].values())
    assert result["torchrun"]["fsdp"]["final_val_loss"] == pytest.approx(result["torchrun"]["none"]["final_val_loss"], rel=1e-5)
    assert [t["compiled"] for t in result["throughput"]] == [False, True]  # eager and --compile, each timed
    assert all(t["tokens_per_s"] > 0 and t["neighbour_over_normal_flops"] > 1 for t in result["throughput"])
    ft = result["torchft"]["run"]  # two replicas (the CPU has "two devices"), rank 1 killed and healed
    assert ft["exit"] == 0 and ft["ranks"] == 2 and ft["kills"] == 1 and ft["identical"] and ft["timing"]["quorum_s"] > 0
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0 and "no CUDA device here; skipped" in capsys.readouterr().out
        assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_on_cuda(tmp_path, monkeypatch):
    import experiments.gpu_check as gpu_check

    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path)
    assert gpu_check.main([]) == 0


# ------------------------------------------------------------------------ the --full commands, scaled down
SMALL = {"preset": "nano", "vocab_size": "300", "seq_len": "32", "micro_batch_size": "2", "grad_accum": "1",
         "steps": "6", "warmup_steps": "1", "eval_every": "3", "checkpoint_every": "3", "ranks": "4",
         "seconds_per_step": "3600", "device": "cpu"}  # every other flag as written; failures every few steps
C4_SMALL = ["--c4_train_tokens", "6000", "--c4_val_tokens", "1200", "--c4_tokenizer_docs", "100", "--val_windows", "8"]


def _scaled(line: str, shards, out, port: int, rendezvous: str = "static") -> list[list[str]]:
    """A --full torchrun line with its model, steps and shards scaled down, every flag kept: the argv of
    its two nodes, both on this machine (NODE_RANK 0 and 1, MASTER_ADDR 127.0.0.1; with rendezvous "c10d",
    torchrun's c10d rendezvous on 127.0.0.1 in place of the static master address)."""
    words = line.split()
    if rendezvous == "c10d":
        at = words.index("--master_addr")
        words[at:at + 2] = ["--rdzv_backend", "c10d", "--rdzv_id", "mecefo-test", "--rdzv_endpoint", f"127.0.0.1:{port}"]
    assert words[:2] == ["torchrun", "--nnodes"]
    for i, w in enumerate(words):
        if w.startswith("--") and w[2:] in SMALL:
            words[i + 1] = SMALL[w[2:]]
    words[words.index("--nnodes") + 1], words[words.index("--nproc_per_node") + 1] = "2", "2"
    words[words.index("--out") + 1] = str(out)
    nodes = []
    for rank in (0, 1):
        argv = [{"$NODE_RANK": str(rank), "$MASTER_ADDR": "127.0.0.1", "$C4_DIR": str(shards)}.get(w, w) for w in words]
        at = argv.index("-m")
        master = ["--master_port", str(port)] if rendezvous == "static" else []
        nodes.append(["torch.distributed.run", *argv[1:at], *master, *argv[at:], *C4_SMALL, "--quiet"])
    return nodes


def _readme_command() -> list[str]:
    """The torchrun command of docs/gpus.md's "From N nodes of 8 GPUs and a C4 copy" block."""
    from tests.conftest import ROOT

    block = (ROOT / "docs" / "gpus.md").read_text().split("### From N nodes of 8 GPUs and a C4 copy")[1].split("```")[1]
    joined = block.replace("\\\n", " ")
    return next(ln for ln in joined.splitlines() if ln.startswith("torchrun ")).split()


def _two_nodes(nodes, extra=()):
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    procs = [subprocess.Popen([sys.executable, "-m", *argv, *extra], cwd=ROOT, env=subprocess_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for argv in nodes]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("preset, rendezvous", [("llama-350m", "static"), ("llama-7b", "static"),  # replicated;
                                                ("llama-350m", "c10d")])  # FSDP2; torchrun's c10d rendezvous
def test_the_full_commands_run_scaled_down_on_two_nodes_with_failures_and_a_resume(preset, rendezvous, tmp_path,
                                                                                     monkeypatch):
    """What `experiments.sweep --full` writes for a cluster, every flag kept (torchrun over 2 nodes, C4 from
    --data_dir, failures at high, checkpoints, --shard where written), with the model, steps and shards
    scaled down: two launches rendezvous on 127.0.0.1, are interrupted after step 3 and resumed, and end with
    the parameters of the local backend on the same config."""
    import socket

    from experiments.sweep import full_commands
    from tests.conftest import write_c4_shard

    monkeypatch.setenv("MECEFO_CACHE", str(tmp_path / "cache"))
    shards = tmp_path / "c4"  # $C4_DIR; for 7B in Hugging Face's layout, the shards under en/
    (shards / "en" if preset == "llama-7b" else shards).mkdir(parents=True)
    write_c4_shard(shards / "en" if preset == "llama-7b" else shards, "train", 300, 0)
    write_c4_shard(shards / "en" if preset == "llama-7b" else shards, "validation", 40, 1)
    script, _ = full_commands()
    line = next(ln for ln in script.splitlines() if f"--preset {preset} " in ln and "--failures high" in ln)
    if preset == "llama-7b":  # docs/gpus.md's command is this line, word for word
        assert _readme_command() == line.split()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = _scaled(line, shards, tmp_path / "cluster", port, rendezvous)
    _two_nodes(nodes, ["--stop_after", "3"])
    assert not (tmp_path / "cluster" / "summary.json").exists()
    _two_nodes(nodes, ["--resume"])
    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert summary["splits"] == ["train", "val"] and summary["rank_agreement"]["identical"]
    assert summary["config"]["cluster"]["shard"] == ("fsdp" if preset == "llama-7b" else "none")
    rows = metrics(tmp_path / "cluster")
    assert [r["step"] for r in rows] == list(range(7)) and any(r["failed"] for r in rows[1:])  # failures ran
    local = nodes[0][nodes[0].index("mecefo.train") + 1:]  # the trainer's flags, on the local backend
    argv = local[:local.index("--backend")] + local[local.index("--backend") + 2:]
    if "--shard" in argv:
        argv = argv[:argv.index("--shard")] + argv[argv.index("--shard") + 2:]
    assert main(argv[:argv.index("--out")] + argv[argv.index("--out") + 2:] + ["--out", str(tmp_path / "local")]) == 0
    a, b = model_params(tmp_path / "local"), model_params(tmp_path / "cluster")
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-5, rtol=1e-4), name
