import os

import pytest
import torch

# collectives of the test worlds give up after 60 s instead of 300 (spawned followers inherit it)
os.environ["KIMI_TP_TIMEOUT_S"] = "60"

from backend.model import parallel  # noqa: E402
from tools.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

parallel.TIMEOUT_S = 60.0
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tp_dir(tmp_path_factory):
    """Tiny float32 checkpoint (4 KDA heads, 4 MLA heads, 8 experts, vocab 256: all divisible by 2):
    KDA (dense MLP), MLA (MoE), KDA (MoE)."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tp_tiny")), tokenizer=None, seed=5, dtype="float32",
                                 layers="KMK")
