"""The trainer on a Hugging Face model (mecefo.hf, --hf_config): docs/huggingface.md's three commands (local,
torchrun, mecefo.launch) run as written, MeCeFO under failures; the torchft run equals its local twin; bad
input is refused with one line; the cost accounting says what it cannot count."""

import json

import pytest

from mecefo.errors import UsageError
from tests.conftest import ROOT, metrics, python_module

pytest.importorskip("transformers")

HF = "experiments/configs/hf/llama-nano.json"
ARGS = ["--config", "experiments/configs/nano.toml", "--hf_config", HF, "--ranks", "4", "--failures", "high",
        "--seconds_per_step", "600", "--steps", "30"]
COMMANDS = {  # docs/huggingface.md's, word for word (checked below)
    "local": ["mecefo.train", *ARGS, "--out", "results/hf/local"],
    "torchrun": ["torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m", "mecefo.train", *ARGS,
                 "--backend", "torch", "--out", "results/hf/torch"],
    "launch": ["mecefo.launch", *ARGS, "--min_step_s", "0.2", "--out", "results/hf/ft"],
}


def readme_line(module_args: list[str]) -> str:
    head = "torchrun" if module_args[0] == "torch.distributed.run" else f"python -m {module_args[0]}"
    return " ".join([head, *module_args[1:]])


def test_the_readme_gives_these_commands():
    readme = " ".join((ROOT / "docs" / "huggingface.md").read_text().replace("\\\n", " ").split())
    for args in COMMANDS.values():
        assert readme_line(args) in readme, readme_line(args)


@pytest.mark.slow
@pytest.mark.parametrize("how", list(COMMANDS))
def test_the_readme_commands_train_a_llama_config_under_failures_with_mecefo(tmp_path, how):
    args = [a if not a.startswith("results/hf/") else str(tmp_path / "out") for a in COMMANDS[how]]
    r = python_module(*args, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["model"]["hf_config"] == HF and summary["cost_accounting"] == "exact"
    rows = metrics(out)[1:]
    assert len(rows) == 30 and any(row["failed"] and row["neighbours"] for row in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    if how == "launch":  # real failures: equal to the local backend replaying them
        from mecefo.train import main

        twin = tmp_path / "twin"
        assert main([*ARGS, "--quiet", "--out", str(twin), "--failures", f"steps:{out / 'failed_steps.json'}"]) == 0
        for a, b in zip(rows, metrics(twin)[1:], strict=True):
            assert a["failed"] == b["failed"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--hf_config", "nowhere/config.json"], "cannot be read as a Hugging Face config.json"),
    (["--hf_config", "BAD:gpt2"], "model_type 'gpt2'; supported: llama, mistral, qwen2"),
    (["--hf_config", HF, "--backend", "torch", "--shard", "fsdp"], "trains with cluster.shard='none'"),
    (["--hf_config", HF, "--loss_rows", "64"], "train.loss_rows applies to our GPT"),
    (["--hf_config", "BAD:small_vocab"], "vocab_size 100 < the tokenizer's 512"),
    (["--hf_config", "BAD:heads"], "num_attention_heads 5 does not divide hidden_size 32"),
    (["--hf_config", "BAD:kv_heads"], "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (["--hf_config", "BAD:odd_heads"], "hidden_size/num_attention_heads = 1 must be even"),
    (["--hf_config", "BAD:no_layers"], "num_hidden_layers must be a positive integer, not None"),
])
def test_bad_hf_input_exits_2_with_one_line(extra, message, tmp_path, capsys):
    from mecefo.train import main

    values = json.loads((ROOT / HF).read_text())
    bad = {"BAD:gpt2": values | {"model_type": "gpt2"}, "BAD:small_vocab": values | {"vocab_size": 100},
           "BAD:heads": values | {"num_attention_heads": 5}, "BAD:kv_heads": values | {"num_key_value_heads": 3},
           "BAD:odd_heads": values | {"num_attention_heads": 32, "num_key_value_heads": 32},
           "BAD:no_layers": {k: v for k, v in values.items() if k != "num_hidden_layers"}}
    if extra[1] in bad:
        (tmp_path / "c.json").write_text(json.dumps(bad[extra[1]]))
        extra = [extra[0], str(tmp_path / "c.json"), *extra[2:]]
    assert main(["--config", str(ROOT / "experiments/configs/nano.toml"), "--steps", "2", *extra,
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_the_cost_accounting_says_what_it_cannot_count():
    from mecefo.hf import model_config

    values = json.loads((ROOT / HF).read_text())
    cfg, how = model_config(values, 512)
    assert how == "exact" and (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.ffn_dim) == (32, 2, 4, 96)
    _, how = model_config(values | {"model_type": "mistral", "num_key_value_heads": 2}, 512)
    assert "grouped key/value heads (2 of 4)" in how
    _, how = model_config(values | {"model_type": "qwen2"}, 512)
    assert "attention biases" in how
    with pytest.raises(UsageError):
        model_config(values | {"vocab_size": 10}, 512)


def test_a_configs_identity_is_its_content_not_its_path(tmp_path):
    from mecefo import config as config_mod

    copy = tmp_path / "config.json"
    copy.write_text((ROOT / HF).read_text())
    a = config_mod.load(None, {"hf_config": str(ROOT / HF)}).hash()
    assert config_mod.load(None, {"hf_config": str(copy)}).hash() == a
    copy.write_text(json.dumps(json.loads(copy.read_text()) | {"intermediate_size": 64}))
    assert config_mod.load(None, {"hf_config": str(copy)}).hash() != a
    assert config_mod.load(None, {}).hash() == config_mod.load(None, {"hf_config": ""}).hash()
