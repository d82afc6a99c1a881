"""Kernel tests: Triton kernels run on CUDA, or on CPU through the interpreter (TRITON_INTERPRET=1)."""
import os

import pytest
import torch


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
requires_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def device() -> str:
    return _device()
