"""Observability: Status and GetMetrics report tokens/s, queue depth and memory (fake engine, loopback server)."""

import json

from server_harness import FakeEngine, pb


class BusyEngine(FakeEngine):
    def stats(self):
        return {"running": 2, "waiting": 3, "tokens_per_s": 12.6, "free_blocks": 10, "num_blocks": 16}


def test_status_reports_memory_and_load(aio, tok):
    s = aio.stub.Status(pb.HealthMessage())
    assert s.state == pb.StatusResponse.UNINITIALIZED
    assert s.memory.total > 0 and s.memory.breakdown["rss"] > 0          # bytes (RSS on the CPU)
    assert s.memory.breakdown["queue_depth"] == 0 and s.memory.breakdown["tokens_per_s"] == 0
    aio.install(BusyEngine(lambda p, q: [1, 2]), tok)
    s = aio.stub.Status(pb.HealthMessage())
    assert s.state == pb.StatusResponse.READY
    b = s.memory.breakdown
    assert (b["queue_depth"], b["running"], b["tokens_per_s"], b["active_requests"]) == (3, 2, 13, 0)


def test_get_metrics_reports_rate_queue_and_memory(aio, tok):
    aio.install(BusyEngine(lambda p, q: tok.encode("Hello world") + [tok.eos_token_ids[0]]), tok)
    aio.stub.Predict(pb.PredictOptions(Prompt="hi"))
    m = aio.stub.GetMetrics(pb.MetricsRequest())
    stats = json.loads(m.prompt_json_for_slot)
    assert abs(m.tokens_per_second - 12.6) < 1e-5 and stats["tokens_per_s"] == 12.6   # proto float
    assert stats["queue_depth"] == 3 and stats["running"] == 2 and stats["active_requests"] == 0
    assert stats["memory"]["total"] > 0 and stats["memory"]["rss"] > 0
    assert m.tokens_generated == len(tok.encode("Hello world")) + 1 and m.prompt_tokens_processed == len(
        tok.encode("hi"))
