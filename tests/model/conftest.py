"""Tiny checkpoints written by tools/tiny_checkpoint.py into session temp dirs, and models loaded from them."""
import pytest
import torch

from backend.model.loader import load_model
from tools.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session")
def fp32_dir(tmp_path_factory):
    """fp32 weights, no tokenizer files: exact comparisons against tests/reference_model.py."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_fp32")), tokenizer=None, seed=1, dtype="float32")


@pytest.fixture(scope="session")
def bf16_dir(tmp_path_factory):
    """The default tool output: bf16 weights and tiktoken tokenizer files."""
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_bf16")), seed=2)


@pytest.fixture(scope="session")
def fp32_model(fp32_dir):
    return load_model(fp32_dir, "cpu", torch.float32)
