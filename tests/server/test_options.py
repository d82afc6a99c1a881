"""LoadModel options (backend/options.py) and PredictOptions -> SamplingParams (backend/predict.py)."""

import json
import math

import pytest

from backend.options import OptionsError, build_load_spec, engine_config, parse_options
from backend.predict import BadRequest, logit_bias, messages_to_dicts, sampling_params
from server_harness import pb


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    return tmp_path


def spec(model_dir, **kw):
    o = dict(Model="m", ModelPath=str(model_dir))
    o.update(kw)
    return build_load_spec(pb.ModelOptions(**o))


def test_parse_options_coerces():
    assert parse_options(["a:1", "b:0.5", "c:true", "d:False", "e:x:y", "--max-num-seqs:4", "flag", ""]) == {
        "a": 1, "b": 0.5, "c": True, "d": False, "e": "x:y", "max_num_seqs": 4, "flag": True}


def test_model_resolution(model_dir, tmp_path):
    assert spec(model_dir).model_dir == str(model_dir / "m")
    s = spec(model_dir, ModelFile=str(model_dir / "m"), Model="alias")  # ModelFile wins when it exists
    assert s.model_dir == str(model_dir / "m") and s.model_name == "alias"
    assert spec(model_dir, Model=str(model_dir / "m"), ModelPath="").model_dir == str(model_dir / "m")
    with pytest.raises(OptionsError, match="not found"):
        spec(model_dir, Model="missing")
    with pytest.raises(OptionsError, match="no model"):
        build_load_spec(pb.ModelOptions())
    (tmp_path / "file").write_text("x")
    with pytest.raises(OptionsError, match="directory"):
        spec(model_dir, Model=str(tmp_path / "file"))


def test_fields_options_engine_args_precedence(model_dir):
    s = spec(model_dir, ContextSize=4096, DType="bf16", Seed=7, GPUMemoryUtilization=0.8, EnforceEager=True,
             Options=["max_num_seqs:16", "block_size:32", "unknown_knob:1", "tool_parser:none",
                      "default_max_tokens:100"],
             EngineArgs=json.dumps({"max_num_batched_tokens": 2048, "max-num-seqs": 8}))
    assert s.engine == {"max_model_len": 4096, "dtype": "bfloat16", "seed": 7, "gpu_memory_utilization": 0.8,
                        "enforce_eager": True, "max_num_seqs": 8, "block_size": 32, "max_num_batched_tokens": 2048}
    assert s.tool_parser == "none" and s.default_max_tokens == 100 and s.ignored == ["unknown_knob"]
    assert spec(model_dir, ContextSize=4096, MaxModelLen=1024).engine["max_model_len"] == 1024
    assert spec(model_dir, ContextSize=4096, Options=["max_model_len:512"]).engine["max_model_len"] == 512
    assert "dtype" not in spec(model_dir, DType="auto").engine
    assert spec(model_dir, TensorParallelSize=2).engine == {"tp_size": 2}
    assert spec(model_dir, Options=["tp_size:4", "nnodes:2", "master_addr:10.0.0.1", "master_port:29500"]).engine == \
        {"tp_size": 4, "nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29500}


@pytest.mark.parametrize("kw,needle", [
    (dict(TensorParallelSize=4, Options=["nnodes:3"]), "multiple of nnodes"),
    (dict(TensorParallelSize=2, Options=["node_rank:1"]), "node_rank must be 0"),
    (dict(TensorParallelSize=2, Options=["nnodes:2"]), "needs master_port"),
    (dict(EngineArgs="{x"), "not valid JSON"),
    (dict(EngineArgs="[1]"), "JSON object"),
    (dict(EngineArgs='{"max_num_seq": 1}'), "did you mean 'max_num_seqs'"),
    (dict(EngineArgs='{"max_num_seqs": "many"}'), "expected int"),
    (dict(Options=["max_num_seqs:lots"]), "expected int"),
    (dict(Options=["gpu_memory_utilization:1.5"]), "gpu_memory_utilization"),
    (dict(Options=["block_size:0"]), "block_size"),
    (dict(Options=["max_prefill_tokens_with_decode:-1"]), "max_prefill_tokens_with_decode must be >= 0"),
    (dict(EngineArgs='{"max_prefill_tokens_with_decode": "lots"}'), "expected int"),
    (dict(Options=["prefix_cache_slots:-1"]), "prefix_cache_slots must be >= 0"),
    (dict(Options=["prefix_cache_min_tokens:0"]), "prefix_cache_min_tokens must be a positive integer"),
    (dict(DType="int4"), "dtype"),
    (dict(Options=["tool_parser:hermes"]), "tool_parser"),
])
def test_bad_load_options(model_dir, kw, needle):
    with pytest.raises(OptionsError, match=needle):
        spec(model_dir, **kw)


def test_prefix_cache_options_reach_engine_config(model_dir):
    from backend.engine import EngineConfig

    s = spec(model_dir, Options=["prefix_cache_slots:8", "prefix_cache_min_tokens:32"])
    c = engine_config(EngineConfig, s.engine)
    assert (c.prefix_cache_slots, c.prefix_cache_min_tokens) == (8, 32)
    for bad in (dict(prefix_cache_slots=-1), dict(prefix_cache_min_tokens=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(device="cpu", **bad)


def test_prefill_cap_option_reaches_engine_config(model_dir):
    from backend.engine import EngineConfig

    s = spec(model_dir, Options=["max_prefill_tokens_with_decode:512"])
    assert s.engine == {"max_prefill_tokens_with_decode": 512}
    assert engine_config(EngineConfig, s.engine).max_prefill_tokens_with_decode == 512
    s = spec(model_dir, EngineArgs='{"max-prefill-tokens-with-decode": 0}')  # 0 = no cap
    assert engine_config(EngineConfig, s.engine).max_prefill_tokens_with_decode == 0


def test_engine_config_skips_unknown_fields(caplog):
    from dataclasses import dataclass

    @dataclass
    class Cfg:
        max_num_seqs: int = 1

    assert engine_config(Cfg, {"max_num_seqs": 4, "router_biased_weights": True}) == Cfg(4)
    assert "router_biased_weights" in caplog.text


def test_sampling_mapping_localai_semantics():
    p, stops = sampling_params(pb.PredictOptions(), eos_token_ids=[5, 6])
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.0, 0, 1.0, 0.0, 1.0)
    assert p.max_tokens == 0 and p.seed is None and p.stop_token_ids == (5, 6) and stops == []
    assert not p.wants_logprobs and p.greedy
    r = pb.PredictOptions(Temperature=0.6, TopK=-1, TopP=0.95, MinP=0.01, Penalty=1.1, PresencePenalty=0.5,
                          FrequencyPenalty=-0.5, Seed=42, Tokens=77, StopPrompts=["\n\n", ""], IgnoreEOS=True,
                          LogitBias='{"12": 3.5, "13": -200}', Logprobs=1, TopLogprobs=4)
    p, stops = sampling_params(r, eos_token_ids=[5], default_max_tokens=9, default_seed=3)
    assert p.temperature == pytest.approx(0.6) and p.top_k == 0 and p.top_p == pytest.approx(0.95)
    assert p.min_p == pytest.approx(0.01) and p.repetition_penalty == pytest.approx(1.1)
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.5 and p.seed == 42 and p.max_tokens == 77
    assert stops == ["\n\n"] and p.ignore_eos and p.stop_token_ids == ()
    assert p.logit_bias == {12: 3.5, 13: -100.0} and p.logprobs and p.top_logprobs == 4
    assert sampling_params(pb.PredictOptions(TopK=40))[0].top_k == 40
    p, _ = sampling_params(pb.PredictOptions(), default_max_tokens=9, default_seed=3)
    assert p.max_tokens == 9 and p.seed == 3
    p, _ = sampling_params(pb.PredictOptions(Logprobs=1))
    assert p.logprobs and p.top_logprobs == 0


@pytest.mark.parametrize("kw", [dict(Temperature=math.nan), dict(Temperature=-1), dict(TopP=2.0),
                                dict(TopP=-0.5), dict(MinP=1.5), dict(Penalty=-1), dict(PresencePenalty=3),
                                dict(FrequencyPenalty=math.inf), dict(TopLogprobs=21), dict(LogitBias="[1]"),
                                dict(LogitBias='{"x": 1}'), dict(LogitBias='{"1": "a"}')])
def test_sampling_mapping_rejects(kw):
    with pytest.raises(BadRequest):
        sampling_params(pb.PredictOptions(**kw))


def test_logit_bias_clamps():
    assert logit_bias("") == {} and logit_bias('{"1": 1000}') == {1: 100.0}


def test_messages_to_dicts():
    calls = [{"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    out = messages_to_dicts([pb.Message(role="assistant", content="", tool_calls=json.dumps(calls)),
                             pb.Message(role="tool", content="42", tool_call_id="functions.f:0", name="f")])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[1] == {"role": "tool", "content": "42", "tool_call_id": "functions.f:0", "name": "f"}
    with pytest.raises(BadRequest):
        messages_to_dicts([pb.Message(role="assistant", tool_calls="{bad")])
