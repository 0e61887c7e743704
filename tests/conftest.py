import os

# pyproject's addopts run the tests two at a time (-n 2, pytest-xdist): one thread each, for torch and for the children
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import gzip
import json

import numpy as np
import pytest
import torch

from experiments.common import CONFIGS
from mecefo import config as config_mod


@pytest.fixture
def nano_cfg():
    """The nano test config, shortened; individual tests override further."""
    return config_mod.load(CONFIGS / "nano.toml", {"steps": "20", "eval_every": "10"})


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def write_c4_shard(folder, split: str, n_docs: int, seed: int) -> None:
    """A small c4-<split>.00000-of-00001.json.gz in C4's layout (one JSON document per line)."""
    rng = np.random.default_rng(seed)
    words = ["the", "colossal", "clean", "crawled", "corpus", "web", "page", "text", "of", "and", "a", "model"]
    with gzip.open(folder / f"c4-{split}.00000-of-00001.json.gz", "wt") as f:
        for i in range(n_docs):
            text = " ".join(rng.choice(words, size=60)) + "."
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T00:00:00Z", "url": f"https://x/{i}"}) + "\n")


# ------------------------------------------------------------------ helpers the test files share
# (imported as `from tests.conftest import ...`)
ROOT = CONFIGS.parent.parent
NANO = ["--config", str(CONFIGS / "nano.toml")]
# at 1 s per step: rank 1 down at steps 2-5, rank 0 at steps 4-7 (of 4 ranks); both at steps 4-5
TRACE = "0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n2000,remove,node2\n4000,remove,node1\n6000,add,node2\n8000,add,node1\n"


def write_trace(folder):
    path = folder / "trace.csv"
    path.write_text(TRACE)
    return path


def metrics(out) -> list[dict]:
    """OUT/metrics.jsonl's rows (the first is the evaluation at step 0)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def model_params(out) -> dict:
    """The model's tensors in OUT/checkpoint."""
    from mecefo import checkpoint

    return checkpoint.read_model(out / "checkpoint")


def subprocess_env(**extra) -> dict:
    """The environment of a child python: this checkout importable, one thread per process (torch jobs on
    few cores slow each other down otherwise; the twins' tolerances were measured so)."""
    import os

    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1", **extra}


def python_module(*args, env=None, timeout=300):
    """python -m ARGS from the repository root; the CompletedProcess, output captured."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=subprocess_env(**(env or {})),
                          cwd=ROOT, timeout=timeout)


def torchrun(n: int, args: list[str], timeout=300):
    """mecefo.train under torchrun with n processes on this machine."""
    return python_module("torch.distributed.run", "--standalone", "--nproc_per_node", str(n), "-m", "mecefo.train",
                         *args, timeout=timeout)


def launch(out, *args, env=None, timeout=240):
    """mecefo.launch on nano into OUT."""
    return python_module("mecefo.launch", *NANO, "--out", str(out), *args, env=env, timeout=timeout)


def lock_holding_process(out):
    """Another process holding OUT/run.lock as a live run does (mecefo.runfolder.take_lock), until killed."""
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from mecefo.runfolder import take_lock; "
            "take_lock(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder
