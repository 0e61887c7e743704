import json
import math
import subprocess
import sys

import pytest
import torch

from experiments.common import CONFIGS, ROOT
from mecefo import config as config_mod
from mecefo import data as data_mod
from mecefo.config import OptimConfig
from mecefo.errors import UsageError
from mecefo.train import lr_at, main, run

from .conftest import cuda


def test_loss_falls_within_a_few_dozen_nano_steps(nano_cfg, tmp_path):
    cfg = config_mod.with_overrides(nano_cfg, train={"steps": 40, "eval_every": 40})
    summary = run(cfg, tmp_path / "run", quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
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
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert whole["final_val_loss"] == resumed["final_val_loss"]
    strip = lambda p: [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "wall_time_s")}  # noqa: E731
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
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    assert main(argv + ["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


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
