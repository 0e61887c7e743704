import pytest
import torch

from experiments.common import CONFIGS
from mecefo import config as config_mod


@pytest.fixture
def nano_cfg():
    """The nano test config, shortened; individual tests override further."""
    return config_mod.load(CONFIGS / "nano.toml", {"steps": "20", "eval_every": "10"})


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
