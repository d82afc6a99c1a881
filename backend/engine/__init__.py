"""Serving engine: continuous batching, chunked prefill, CUDA-graph decode, device sampling.

Torch is imported lazily: `from backend.engine import SamplingParams` works without it.
"""
from backend.engine.request import RequestOutput, SamplingParams

__all__ = ["SamplingParams", "RequestOutput", "EngineConfig", "LLMEngine", "RequestStream"]


def __getattr__(name):
    if name in ("EngineConfig", "LLMEngine", "RequestStream"):
        from backend.engine import engine

        return getattr(engine, name)
    raise AttributeError(name)
