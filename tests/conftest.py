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


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def write_c4_shard(folder, split: str, n_docs: int, seed: int) -> None:
    """A small c4-<split>.00000-of-00001.json.gz in C4's layout (one JSON document per line)."""
    rng = np.random.default_rng(seed)
    words = ["the", "colossal", "clean", "crawled", "corpus", "web", "page", "text", "of", "and", "a", "model"]
    with gzip.open(folder / f"c4-{split}.00000-of-00001.json.gz", "wt") as f:
        for i in range(n_docs):
            text = " ".join(rng.choice(words, size=60)) + "."
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T00:00:00Z", "url": f"https://x/{i}"}) + "\n")
