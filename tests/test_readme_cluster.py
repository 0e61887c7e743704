"""docs/gpus.md's Slurm path ("On a Slurm cluster"), every command of its block run as written on a fake two-node
allocation (tests/fake_slurm: sbatch, srun and scontrol as local processes with the variables Slurm sets), with the
run's flags scaled down (nano, a few steps, C4 shards of a few hundred documents, the CPU) and every other flag
kept. Not run: `pip install` (CI's first step), `tail -f`, and the download, which is checked against
mecefo.data.c4_download (no network here)."""

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from mecefo import config as config_mod
from mecefo.data import c4_download
from mecefo.train import main as train_main
from tests.conftest import ROOT, metrics, subprocess_env, write_c4_shard

pytestmark = pytest.mark.filterwarnings("ignore")
FAKE = ROOT / "tests" / "fake_slurm"
# the run's flags, scaled down; every flag not named here is kept as written
SMALL = {"preset": "nano", "vocab_size": "300", "seq_len": "32", "micro_batch_size": "2", "grad_accum": "1",
         "steps": "40", "warmup_steps": "2", "eval_every": "20", "checkpoint_every": "10", "device": "cpu"}
C4_SMALL = "--c4_val_tokens 1200 --c4_tokenizer_docs 100 --val_windows 8"
SCALED = {"--nodes=4": "--nodes=2", "--nodes 4": "--nodes 2", "--ranks 4": "--ranks 2", "--gpus_per_node 8": "--gpus_per_node 1",
          "--kill 1:200:30s": "--kill 1:8:2s"}
# what each line of the block is: run by a test here (RUN), or why not
RUN = ("srun ", "export ", "FLAGS=", "python -m mecefo.launch --prepare", "MECEFO_INJECT=", "sbatch ",
       "python -m mecefo.slurm submit", "python -m mecefo.launch --out $RUN --merge")
NOT_RUN = {"pip install -r requirements.txt": "CI's first step", "huggingface-cli download": "checked, not run (no network)",
           "tail -f": "a view"}


def block() -> list[str]:
    """The block's commands, one per line (continuations joined, comments dropped)."""
    text = (ROOT / "docs" / "gpus.md").read_text().split("## On a Slurm cluster")[1].split("```bash")[1].split("```")[0]
    return [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")]


def command(starts: str) -> list[str]:
    found = [ln for ln in block() if ln.startswith(starts)]
    assert found, f"docs/gpus.md's Slurm block has no line starting with {starts!r}"
    return found


def flag_words() -> list[str]:
    """The words of the block's FLAGS="..." (its value unquoted, then split)."""
    return shlex.split(shlex.split(command("FLAGS=")[0].partition("=")[2])[0])


def flags_line() -> str:
    """FLAGS="..." with the run scaled down (each --name value of SMALL replaced)."""
    words = flag_words()
    for i, w in enumerate(words[:-1]):
        if w.startswith("--") and w[2:] in SMALL:
            words[i + 1] = SMALL[w[2:]]
    return " ".join(words) + " " + C4_SMALL


def scaled(line: str) -> str:
    for a, b in SCALED.items():
        line = line.replace(a, b)
    return line


def run(line: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    """A docs/gpus.md line in bash, after FLAGS is set as the block sets it (scaled down)."""
    return subprocess.run(["bash", "-c", f'FLAGS="{flags_line()}"\n{line}'], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def cluster(tmp_path):
    """The environment the block's `export` line sets (here in tmp_path), with fake Slurm commands on PATH, a free
    lighthouse port, paced steps (so that a killed node's restart rejoins a 40-step run) and C4 shards."""
    import socket

    export = command("export ")[0]
    assert [w.partition("=")[0] for w in export.split()[1:]] == ["RUN", "C4_DIR", "MECEFO_CACHE"]
    c4 = tmp_path / "c4" / "en"  # Hugging Face's layout, as the download leaves it
    c4.mkdir(parents=True)
    write_c4_shard(c4, "train", 300, 0)
    write_c4_shard(c4, "validation", 40, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess_env(PATH=f"{FAKE}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
                          RUN=str(tmp_path / "runs" / "run"), C4_DIR=str(tmp_path / "c4"), MECEFO_CACHE=str(tmp_path / "cache"),
                          MECEFO_RESULTS=str(tmp_path / "results"), MECEFO_LIGHTHOUSE_PORT=str(port),
                          MECEFO_NODE_FLAGS="--min_step_s 0.25")


def test_every_line_of_the_block_is_run_here_or_says_why_not():
    for line in block():
        assert line.startswith(RUN) or line.startswith(tuple(NOT_RUN)), f"docs/gpus.md's Slurm block: {line!r} is not run"


def test_the_download_fetches_the_shards_the_runs_tokens_need():
    """The block's download line names the shards of one pass of the run its flags describe (at its 4 nodes)."""
    words = shlex.split(command("huggingface-cli download allenai/c4")[0])
    include = words[words.index("--include") + 1:]
    flags = [w.replace("$C4_DIR", "/c4") for w in flag_words()]
    overrides = {flags[i][2:]: flags[i + 1] for i in range(0, len(flags), 2)}
    cfg = config_mod.load(None, {**overrides, "ranks": "4", "backend": "torchft"})
    assert include == c4_download(cfg.data.c4_train_tokens)["include"]
    assert c4_download(cfg.data.c4_train_tokens)["shards"] == 115 and cfg.data.c4_train_tokens == 15_790_080_257


def test_the_gpu_check_line_runs_on_a_node_and_skips_cleanly_without_cuda(cluster):
    import torch

    r = run(command("srun ")[0], cluster)
    assert r.returncode == 0, r.stderr[-2000:]
    if not torch.cuda.is_available():
        assert "no CUDA device here; skipped" in r.stdout


@pytest.mark.slow
def test_the_rehearsal_the_run_and_the_submitit_job_run_as_written(cluster, tmp_path):
    """Step 3: the flags checked and the token cache built before the job. Step 4: the job with node 1 killed after
    step 8 and back 2 s later survives it, and equals the local backend replaying its failed steps. Step 5: the run's
    sbatch line, then the same job through submitit (no --wait: it returns at once) and the merge line once its nodes
    have finished; a finished run submitted again is reused."""
    prepare, rehearsal, sbatch = (command("python -m mecefo.launch --prepare")[0], command("MECEFO_INJECT=")[0],
                                  command("sbatch ")[0])
    r = run(scaled(prepare), cluster)
    assert r.returncode == 0 and (tmp_path / "runs" / "run" / "config.json").exists(), r.stderr[-2000:]
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 1  # the token cache, built here
    r = run(scaled(rehearsal), cluster)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[watch] node 1 killed at step" in r.stdout and "merged 2 replicas' records" in r.stdout
    out = tmp_path / "runs" / "run-rehearsal"
    rows = metrics(out)
    assert [row["step"] for row in rows] == list(range(41)) and any(row["down"] == [1] for row in rows[1:])
    assert rows[-1]["down"] == [] and json.loads((out / "summary.json").read_text())["rank_agreement"]["identical"]
    twin = shlex.split(flags_line().replace("$C4_DIR", cluster["C4_DIR"]))
    at = twin.index("--shard")
    twin = twin[:at] + twin[at + 2:]  # the local backend: every rank in one process
    assert train_main([*twin, "--ranks", "2", "--quiet", "--out", str(tmp_path / "twin"), "--failures",
                       f"steps:{out / 'failed_steps.json'}"]) == 0
    for a, b in zip(rows[1:], metrics(tmp_path / "twin")[1:], strict=True):
        assert a["down"] == b["down"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)

    r = run(scaled(sbatch), cluster)
    assert r.returncode == 0 and "merged 2 replicas' records" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[watch] step " in r.stdout  # the progress line (every MECEFO_PROGRESS_S)
    run_dir = tmp_path / "runs" / "run"
    assert json.loads((run_dir / "summary.json").read_text())["rank_agreement"]["identical"]
    r = run(scaled(sbatch), cluster, timeout=120)
    assert r.returncode == 0 and "reused, nothing launched" in r.stdout, r.stderr[-2000:]

    submitted = {**cluster, "RUN": str(tmp_path / "runs" / "submitted"),  # no sbatch on PATH: submitit's local executor
                 "PATH": cluster["PATH"].replace(f"{FAKE}:", "")}
    submit, merge = command("python -m mecefo.slurm submit")[0], command("python -m mecefo.launch --out $RUN --merge")[0]
    r = run(scaled(submit), submitted)
    assert r.returncode == 0 and "submitted job" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    replicas = tmp_path / "runs" / "submitted" / "replicas"
    deadline = time.time() + 240
    while not all((replicas / f"rank{k}.status").exists() and (replicas / f"rank{k}.status").read_text().startswith(
            "finished") for k in (0, 1)):
        assert time.time() < deadline, "the submitted job did not finish"
        time.sleep(0.5)
    time.sleep(1.0)  # (the first task keeps the lighthouse until both have finished, then ends)
    r = run(merge, submitted)
    assert r.returncode == 0 and "merged 2 replicas' records" in r.stdout, r.stderr[-2000:]
    assert metrics(tmp_path / "runs" / "submitted")[-1]["loss"] == pytest.approx(metrics(run_dir)[-1]["loss"], rel=1e-5)
