"""ModelRunner.prepare against ForwardBatch.build (the model owner's reference builder), and memory sizing."""

import pytest
import torch

from backend.engine.engine import EngineConfig
from backend.engine.request import Request, SamplingParams
from backend.engine.runner import ModelRunner, graph_batch_sizes
from backend.engine.scheduler import ScheduledSeq, SchedulerOutput
from backend.model.batch import ForwardBatch


def req(prompt, output, computed, slot, blocks):
    r = Request(prompt, SamplingParams())
    r.output_token_ids, r.num_computed_tokens, r.state_slot, r.block_ids = list(output), computed, slot, blocks
    return r


def test_prepare_matches_forward_batch_build(tiny_dir):
    runner = ModelRunner(tiny_dir, EngineConfig(block_size=4, max_num_seqs=4, max_model_len=64, device="cpu"))
    bs = runner.block_size
    # a decode, a decode that is a 1-token chunk inside a recomputed output, a first chunk, a middle chunk
    a = req([1, 2, 3, 4, 5], [6, 7], 6, 1, [3, 5])
    b = req([9] * 10, [8, 7, 6], 11, 2, [1, 2, 6])
    c = req(list(range(10, 17)), [], 0, 3, [4, 7])
    d = req(list(range(20, 33)), [44], 4, 4, [8, 9, 10, 11])
    seqs = [ScheduledSeq(a, 6, 1, True), ScheduledSeq(b, 11, 1, False), ScheduledSeq(c, 0, 7, True),
            ScheduledSeq(d, 4, 10, True)]
    out = SchedulerOutput(seqs, num_decodes=2, num_tokens=19)
    got = runner.prepare(out)
    toks = [[7], [7], list(range(10, 17)), list(range(24, 33)) + [44]]
    ref = ForwardBatch.build([(t, s.start, s.request.state_slot, s.request.block_ids) for t, s in zip(toks, seqs)],
                             2, bs, torch.device("cpu"), logits_positions=[0, 8, 18])
    for name in ("input_ids", "cu_seqlens", "prefill_cu_seqlens", "seq_lens", "state_slots", "has_initial_state",
                 "block_table", "slot_mapping", "logits_index"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert got.num_decodes == 2 and got.max_query_len == 10


def test_sizes_and_graph_batch_sizes(tiny_dir):
    runner = ModelRunner(tiny_dir, EngineConfig(block_size=16, max_num_seqs=3, max_model_len=100, device="cpu"))
    assert runner.num_slots == 4 and runner.num_blocks == 1 + 3 * 7 and runner.max_blocks_per_seq == 7
    assert runner.page_bytes() == 1 * 16 * (32 + 8) * 4
    assert runner.slot_bytes() == 2 * (3 * 3 * 4 * 16 * 4 + 4 * 16 * 16 * 4)
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError, match="max_model_len 100 exceeds"):
        ModelRunner(tiny_dir, EngineConfig(block_size=16, num_blocks=4, max_model_len=100, device="cpu"))
