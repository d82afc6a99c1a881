import pytest
import torch

from tools.tiny_checkpoint import write_tiny_checkpoint

# the CI box is small and shared: one intra-op thread is several times faster than oversubscribed ones
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Tiny float32 checkpoint: KDA (dense MLP), MLA (MoE), KDA (MoE); vocab 256, eos 252."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("engine_tiny")), tokenizer=None, seed=3,
                                 dtype="float32", layers="KMK")
