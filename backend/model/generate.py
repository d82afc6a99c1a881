"""Greedy generation straight through the model API: prefill once (optionally chunked), then one token a step."""
import torch

from backend.model.batch import ForwardBatch

_BLOCK_SIZE = 16
_SLOT = 1  # slot 0 is the null slot


def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, prefill_chunk: int | None = None,
                    stop_ids=()) -> list[int]:
    """-> generated ids (a stop id, if hit, is the last one). The cache is never recomputed."""
    assert prompt_ids, "empty prompt"
    total = len(prompt_ids) + max_new_tokens
    blocks = list(range(1, 1 + -(-total // _BLOCK_SIZE)))
    cache = model.allocate_cache(num_slots=2, num_blocks=len(blocks) + 1, block_size=_BLOCK_SIZE)
    chunk = prefill_chunk or len(prompt_ids)
    for start in range(0, len(prompt_ids), chunk):
        logits = _step(model, cache, prompt_ids[start:start + chunk], start, blocks, num_decodes=0)
    out = []
    while len(out) < max_new_tokens:
        token = int(logits[0].argmax())
        out.append(token)
        if token in stop_ids or len(out) == max_new_tokens:
            break
        logits = _step(model, cache, [token], len(prompt_ids) + len(out) - 1, blocks, num_decodes=1)
    return out


def _step(model, cache, ids: list[int], num_cached: int, blocks: list[int], num_decodes: int) -> torch.Tensor:
    batch = ForwardBatch.build([(ids, num_cached, _SLOT, blocks)], num_decodes, _BLOCK_SIZE, model.device)
    return model.compute_logits(model(batch, cache), batch.logits_index)
