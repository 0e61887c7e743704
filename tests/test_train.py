import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch

from experiments.common import CONFIGS, ROOT
from mecefo import checkpoint
from mecefo import config as config_mod
from mecefo import data as data_mod
from mecefo.config import OptimConfig
from mecefo.errors import UsageError
from mecefo.train import lr_at, main, run
from tests.conftest import lock_holding_process, metrics

from .conftest import cuda, write_c4_shard


def test_loss_falls_within_a_few_dozen_nano_steps(nano_cfg, tmp_path):
    cfg = config_mod.with_overrides(nano_cfg, train={"steps": 40, "eval_every": 40})
    summary = run(cfg, tmp_path / "run", quiet=True)
    rows = metrics(tmp_path / "run")
    initial_val = rows[0]["val_loss"]
    assert abs(initial_val - math.log(512)) < 0.2
    assert summary["final_val_loss"] < initial_val - 0.8
    assert summary["final_val_ppl"] == pytest.approx(math.exp(summary["final_val_loss"]))
    assert [r["step"] for r in rows] == list(range(41))
    for key in ("config", "config_hash", "git_commit", "packages", "seed", "final_test_loss", "n_parameters"):
        assert key in summary


def test_resume_is_bit_identical_to_an_uninterrupted_run(nano_cfg, tmp_path):
    cfg = config_mod.with_overrides(nano_cfg, train={"steps": 16, "eval_every": 5, "checkpoint_every": 0},
                                    data={"grad_accum": 2})
    whole = run(cfg, tmp_path / "whole", quiet=True)
    assert run(cfg, tmp_path / "split", stop_after=7, quiet=True) == {"stopped_at": 7}
    resumed = run(cfg, tmp_path / "split", resume=True, quiet=True)
    a = {"model": checkpoint.read_model(tmp_path / "whole" / "checkpoint")}
    b = {"model": checkpoint.read_model(tmp_path / "split" / "checkpoint")}
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert whole["final_val_loss"] == resumed["final_val_loss"]
    strip = lambda p: [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "wall_time_s", "timing")}  # noqa: E731
                       for line in p.read_text().splitlines()]
    assert strip(tmp_path / "whole" / "metrics.jsonl") == strip(tmp_path / "split" / "metrics.jsonl")


def test_a_finished_run_is_reused_and_another_config_is_refused(nano_cfg, tmp_path):
    cfg = config_mod.with_overrides(nano_cfg, train={"steps": 3})
    first = run(cfg, tmp_path / "run", quiet=True)
    assert run(cfg, tmp_path / "run", quiet=True) == first
    before = (tmp_path / "run" / "summary.json").read_bytes()
    with pytest.raises(UsageError, match="another config"):
        run(config_mod.with_overrides(cfg, train={"seed": 1}), tmp_path / "run", quiet=True)
    assert (tmp_path / "run" / "summary.json").read_bytes() == before


def test_an_interrupted_run_without_checkpoint_starts_over(nano_cfg, tmp_path):
    cfg = config_mod.with_overrides(nano_cfg, train={"steps": 4, "checkpoint_every": 0})
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"config_hash": cfg.hash()}))
    (out / "metrics.jsonl").write_text('{"step": 0, "val_loss": 6.0}\n{"step": 1, "loss": 6.0}\n')
    summary = run(cfg, out, quiet=True)
    assert summary["steps"] == 4
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(5))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="holds no run of this config"):
        run(cfg, other, quiet=True)
    assert (other / "notes.txt").read_text() == "mine"


def test_lr_schedule_warmup_then_cosine():
    o = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, o, 110) == pytest.approx(0.1)
    assert lr_at(9, o, 110) == pytest.approx(1.0)
    assert lr_at(10, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.55)
    assert lr_at(110, o, 110) == pytest.approx(0.1)


def test_sgd_optimizer_trains(nano_cfg, tmp_path):
    cfg = config_mod.with_overrides(nano_cfg, optim={"optimizer": "sgd", "lr": 0.5}, train={"steps": 20})
    assert run(cfg, tmp_path / "sgd", quiet=True)["final_val_loss"] < math.log(512) - 0.3


@pytest.mark.parametrize("argv, message", [
    (["--config", "experiments/configs/nano.toml", "--learning_rate", "1"], "unknown option --learning_rate"),
    (["--config", "experiments/configs/nano.toml", "--lr", "-1e-3"], "optim.lr=-0.001 must be positive"),
    (["--config", "experiments/configs/nano.toml", "--steps", "ten"], "train.steps='ten' must be of type int"),
    (["--config", "experiments/configs/nano.toml", "--optimizer", "lion"], "optim.optimizer='lion'"),
    (["--config", "experiments/configs/missing.toml"], "config file experiments/configs/missing.toml does not exist"),
    (["--config", "experiments/configs/nano.toml", "--failures", "custom:nan:1"], "cluster.failures='custom:nan:1'"),
    (["--config", "experiments/configs/nano.toml", "--failures", "custom:1e-12:1"], "failure arrivals"),
    (["--config", "experiments/configs/nano.toml", "--failures", "high", "--seconds_per_step", "1e12"], "failure arrivals"),
    (["--config", "experiments/configs/nano.toml", "--seed", "-1"], "train.seed=-1 must be non-negative"),
    (["--config", "experiments/configs/nano.toml", "--steps", "1000000000"], "train.steps=1000000000 must lie in"),
    (["--config", "experiments/configs/nano.toml", "--stop-after", "0"], "--stop-after 0 must be at least 1"),
    (["--config", "experiments/configs/nano.toml", "--stop_after", "0"], "--stop-after 0 must be at least 1"),
    # (sizes no machine has: the check must refuse them on any host)
    (["--config", "experiments/configs/nano.toml", "--ranks", "10000000"], "80000000 sequences of 64 tokens in one pass"),
    (["--config", "experiments/configs/nano.toml", "--micro_batch_size", "100000000"], "100000000 sequences of 64 tokens"),
    (["--config", "experiments/configs/nano.toml", "--backend", "torchft"], "under python -m mecefo.launch"),
    (["--config", "experiments/configs/nano.toml", "--backend", "mpi"], "allowed: 'local', 'torch', 'torchft'"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_an_out_that_cannot_be_a_folder_exits_2(capsys):
    assert main(["--config", str(CONFIGS / "nano.toml"), "--out", "/dev/null/run"]) == 2
    err = capsys.readouterr().err
    assert "--out /dev/null/run cannot be a run folder: /dev/null is not a directory" in err and err.count("\n") == 1


@pytest.mark.parametrize("body, message", [
    (b"\x00\xff\xfe binary \x89PNG", "is not a text TOML file"),
    (b"[train]\nsteps = true\n", "train.steps=True must be of type int"),
])
def test_a_config_file_that_is_binary_or_mistyped_exits_2(body, message, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(body)
    assert main(["--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_resume_drops_a_torn_last_metrics_line_with_a_note(nano_cfg, tmp_path, capsys):
    argv = ["--config", str(CONFIGS / "nano.toml"), "--steps", "6", "--eval_every", "3", "--checkpoint_every", "3",
            "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv + ["--stop-after", "3"]) == 0
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 5.1')  # what a SIGKILL mid-write leaves
    assert main(argv + ["--resume"]) == 0
    assert "dropping the torn last line" in capsys.readouterr().err
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(7))


def test_a_second_run_on_the_out_of_a_live_run_is_refused_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    argv = ["--config", str(CONFIGS / "nano.toml"), "--steps", "3", "--eval_every", "3", "--out", str(out), "--quiet"]
    holder = lock_holding_process(out)  # a live run training into out
    try:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"is in use by a live run (pid {holder.pid}" in err and err.count("\n") == 1
        assert [p.name for p in out.iterdir()] == ["run.lock"]  # nothing touched
    finally:
        holder.kill()
        holder.wait()
    assert (out / "run.lock").read_text() == f"{holder.pid}\n"  # what a SIGKILLed run leaves: a file nobody holds
    assert main(argv) == 0  # its process is gone: the kernel released its lock, which is taken
    assert (out / "summary.json").exists() and not (out / "run.lock").exists()  # released at the end


def test_help_lists_every_config_field_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for section in dataclasses.fields(config_mod.Config):
        for f in dataclasses.fields(section.default_factory):
            assert f"--{f.name} " in text, f.name
    assert "--lr 0.003" in text and "auto | cpu | cuda" in text and "--stop_after" in text


def test_unknown_key_in_config_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text((CONFIGS / "nano.toml").read_text().replace("[optim]", "[optim]\nlearning_rate = 1.0"))
    assert main(["--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "unknown config key optim.learning_rate" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_corrupted_corpus_exits_2(tmp_path, monkeypatch, capsys):
    import shutil

    shutil.copytree(data_mod.CORPUS_DIR, tmp_path / "corpus")
    (tmp_path / "corpus" / "shakespeare_milton.tar.xz").write_bytes(b"not an archive")
    monkeypatch.setattr(data_mod, "CORPUS_DIR", tmp_path / "corpus")
    assert main(["--config", str(CONFIGS / "nano.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "corrupted" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_c4_run_on_local_shards_ends_with_a_summary_and_resumes(tmp_path, monkeypatch):
    """C4 publishes train and validation only: the summary says so (no test loss) instead of failing after
    the last checkpoint, and an interrupted run resumes to the same summary."""
    monkeypatch.setenv("MECEFO_CACHE", str(tmp_path / "cache"))
    shards = tmp_path / "c4"
    shards.mkdir()
    write_c4_shard(shards, "train", 300, 0)
    write_c4_shard(shards, "validation", 40, 1)
    argv = ["--config", str(CONFIGS / "nano.toml"), "--dataset", "c4", "--data-dir", str(shards), "--vocab_size", "300",
            "--seq_len", "32", "--c4_train_tokens", "6000", "--c4_val_tokens", "1200", "--c4_tokenizer_docs", "100",
            "--val_windows", "8", "--steps", "6", "--eval_every", "3", "--checkpoint_every", "3", "--ranks", "2",
            "--failures", "high", "--seconds_per_step", "3600", "--quiet"]
    assert main(argv + ["--out", str(tmp_path / "whole")]) == 0
    assert main(argv + ["--out", str(tmp_path / "cut"), "--stop-after", "3"]) == 0
    assert not (tmp_path / "cut" / "summary.json").exists()
    assert main(argv + ["--out", str(tmp_path / "cut"), "--resume"]) == 0
    whole, cut = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("whole", "cut"))
    assert whole["splits"] == ["train", "val"] and whole["final_test_loss"] is None and whole["final_test_ppl"] is None
    assert math.isfinite(whole["final_val_loss"]) and whole["final_val_loss"] == cut["final_val_loss"]


def test_cli_runs_as_a_module(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mecefo.train", "--config", str(CONFIGS / "nano.toml"),
                           "--steps", "3", "--eval-every", "3", "--out", str(tmp_path / "cli")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["steps"] == 3


@cuda
def test_cuda_bf16_training(nano_cfg, tmp_path):
    cfg = config_mod.with_overrides(nano_cfg, train={"device": "cuda", "steps": 20})
    summary = run(cfg, tmp_path / "cuda", quiet=True)
    assert summary["device"].startswith("cuda") and summary["final_val_loss"] < math.log(512) - 0.3


@pytest.mark.parametrize("how", ["cli", "toml"])
def test_the_old_low_rank_key_is_refused_naming_r(tmp_path, capsys, how):
    from experiments.common import CONFIGS

    args = ["--config", str(CONFIGS / "nano.toml"), "--out", str(tmp_path / "o")]
    if how == "cli":
        args += ["--low_rank", "0.1"]
    else:
        cfg = tmp_path / "c.toml"
        cfg.write_text((CONFIGS / "nano.toml").read_text() + "\n[cluster]\nlow_rank = 0.1\n")
        args[1] = str(cfg)
    assert main(args) == 2
    assert "renamed: use" in capsys.readouterr().err and not (tmp_path / "o").exists()


class _Payload:
    """An object whose unpickling would run code."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_checkpoint_is_read_as_data_never_as_code(nano_cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = ["--config", str(CONFIGS / "nano.toml"), "--steps", "4", "--eval_every", "2", "--checkpoint_every", "2",
            "--out", str(out), "--quiet"]
    assert main(argv + ["--stop-after", "2"]) == 0
    # our own files (RNG states, numpy's too; DCP's metadata), read whole: they are rewritten below
    state, metadata = out / "checkpoint" / "state.pt", out / "checkpoint" / ".metadata"
    ckpt, meta = torch.load(state, weights_only=False), metadata.read_bytes()
    folder = (out / "checkpoint").resolve()
    for tampered in (lambda: torch.save({**ckpt, "policy": _Payload()}, state),
                     lambda: metadata.write_bytes(pickle.dumps(_Payload()))):  # DCP's metadata is a pickle too
        tampered()
        assert main(argv + ["--resume"]) == 2  # its digest refuses it first (the file is not what was written)
        err = capsys.readouterr().err
        assert "not what was written" in err or "when written" in err
        checkpoint._seal(folder)  # one who can write the run folder can rewrite the digest too: then it reads as data
        assert main(argv + ["--resume"]) == 2
        err = capsys.readouterr().err
        assert "cannot be read as data" in err and err.count("\n") == 1 and not (tmp_path / "PWNED").exists()
        torch.save(ckpt, state)  # the untampered checkpoint resumes
        metadata.write_bytes(meta)
        checkpoint._seal(folder)
    assert main(argv + ["--resume"]) == 0


def test_precision_auto_is_hashed_as_what_it_does(nano_cfg, monkeypatch):
    """auto is fp32 on a CPU and bf16 on CUDA: a CPU result must not be reused for a CUDA run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = nano_cfg.hash()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert nano_cfg.hash() != cpu
    assert nano_cfg.hash() == config_mod.with_overrides(nano_cfg, train={"precision": "bf16"}).hash()
    assert config_mod.with_overrides(nano_cfg, train={"device": "cpu"}).hash() == cpu
