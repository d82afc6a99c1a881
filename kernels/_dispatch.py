"""One rule for choosing the Triton kernel or the torch reference."""
import os

import torch

_FORCE = os.environ.get("KIMI_KERNELS", "")


def use_triton(t: torch.Tensor) -> bool:
    """CUDA tensors run Triton; CPU tensors run the torch reference unless KIMI_KERNELS=triton (interpreter)."""
    if _FORCE == "ref":
        return False
    return t.is_cuda or _FORCE == "triton"
