"""Host-side argument preparation shared by the kernel wrappers."""
from typing import Optional

import torch


def unit_last_stride(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`t` in `dtype` with unit stride in its last dim; unchanged (a view, no copy) when it already is, since the
    kernels take the other strides as arguments."""
    if (dtype is not None and t.dtype != dtype) or t.stride(-1) != 1:
        t = t.to(dtype or t.dtype).contiguous()
    return t
