"""Host-side helpers shared by the kernel wrappers: argument preparation and the device's SM count."""
from typing import Optional

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. triton.cdiv / triton.next_power_of_2 are constexpr functions in Triton 3.9: a host
    call costs ~30x the arithmetic (their __call__ unwraps constexprs), and launch paths call them many times."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def unit_last_stride(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`t` in `dtype` with unit stride in its last dim; unchanged (a view, no copy) when it already is, since the
    kernels take the other strides as arguments."""
    if (dtype is not None and t.dtype != dtype) or t.stride(-1) != 1:
        t = t.to(dtype or t.dtype).contiguous()
    return t


_SM_COUNT: dict = {}


def num_sms(device, cpu: int = 132) -> int:
    """Streaming multiprocessors of `device` (cached per index), for launch-config pickers; `cpu` for a non-CUDA
    device (interpreter runs: 132 = H200, so the pickers choose what they would there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


_SMEM: dict = {}
# opt-in shared memory per block: H100 / H200 (sm_90) 227 KB; GB10 (sm_121) and other consumer Blackwell ~99 KB
H200_SMEM = 232448


def max_shared_mem(device, cpu: int = H200_SMEM) -> int:
    """Bytes of shared memory one block may opt into on `device` (cached per index), for launch-config pickers whose
    fastest config needs more than a GB10 (sm_121, 101376 B) has; `cpu` for a non-CUDA device (interpreter runs:
    the H200's, so the pickers choose what they would there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMEM:
        smem = getattr(torch.cuda.get_device_properties(i), "shared_memory_per_block_optin", 0)
        if not smem:                                     # older torch: ask Triton's driver
            import triton

            smem = triton.runtime.driver.active.utils.get_device_properties(i)["max_shared_mem"]
        _SMEM[i] = int(smem)
    return _SMEM[i]


WORKSPACES: dict = {}  # (name, device) -> the workspaces made so far, the newest last (all kept alive)


def workspace(name: str, device, fits, make):
    """The newest workspace `name` of device if fits(it), else make(newest or None), kept as the newest. Workspaces
    are grown on demand and never freed or shrunk: a CUDA graph that captured a launch keeps pointing at the buffers
    it was captured with when a larger one is made."""
    bufs = WORKSPACES.setdefault((name, torch.device(device)), [])
    if not bufs or not fits(bufs[-1]):
        bufs.append(make(bufs[-1] if bufs else None))
    return bufs[-1]


def arrival_counters(device, n: int) -> torch.Tensor:
    """A zeroed i32 buffer of >= n arrival counters for "last program to arrive does the tail" kernels (KDA decode,
    the decode router). Every launch leaves the counters it used at zero, so kernels on one stream can share it; two
    streams running such kernels at once would need their own."""
    return workspace("arrival_counters", device, lambda b: b.numel() >= n,
                     lambda _: torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
