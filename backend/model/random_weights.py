"""Random weights for a config alone (LoadModel `random_weights:true`, benchmarks): the full model built in place on
the device with O(1) activations; nothing is read, downloaded or written. Same init as bench/e2e.py."""

import math

import torch

from backend.config import ModelConfig

_GIB = 1 << 30


def available_bytes(device) -> int | None:
    """Free memory on `device` (CUDA: mem_get_info; CPU: MemAvailable), None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def check_fits(nbytes: int, device, what: str) -> None:
    """Raise ValueError before allocating `nbytes` that the device does not have."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {nbytes / _GIB:.2f} GiB but only {free / _GIB:.2f} GiB is free on {device}")


@torch.no_grad()
def random_model(cfg: ModelConfig, device, dtype: torch.dtype = torch.bfloat16, seed: int = 0, tp=None):
    """tp: a tensor-parallel shard (backend.model.parallel.TP); its replicated weights are not the other ranks'."""
    from backend.model.kimi_linear import KimiLinearForCausalLM
    from backend.model.parallel import TP

    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg, dtype, tp or TP())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    check_fits(nbytes, device, "the random-weight model")
    model.to_empty(device=device)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.uniform_(1.0, 16.0).log_()
        elif leaf == "dt_bias":
            dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(0.1)).exp_()
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif leaf == "conv_weight":
            p.normal_(0.0, 0.5)
        elif leaf == "e_score_correction_bias":
            p.normal_(0.0, 0.1)
        elif p.ndim == 1:  # norm weights
            p.fill_(1.0)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0)
        else:  # [.., out, in]
            gain = 2.0 if name.endswith("gate.weight") else 1.0
            p.normal_(0.0, gain / math.sqrt(p.shape[-1]))
    torch.random.set_rng_state(gen_state)
    model.tie_weights()
    return model.eval().requires_grad_(False)
