import json
import time

import pytest

from backend.tokenizer import (TemplateError, TemplateLimits, compile_chat_template, default_chat_template,
                               load_tokenizer, render_chat_template)
from tools.tiny_tokenizer import write_tokenizer_files

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string",
                                                                                  "description": "城市"}}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tmpl")
    write_tokenizer_files(str(d))
    return load_tokenizer(str(d))


def render(source, limits=None, **context):
    return render_chat_template(compile_chat_template(source, limits), context, limits)


# the Kimi format ---------------------------------------------------------------------------------------------

def test_stored_template_is_kimi_linear():
    src = default_chat_template()
    assert len(src.splitlines()) == 48
    assert src.startswith("{% macro render_content(msg) -%}\n{%- set c = msg.get('content') -%}\n")
    assert "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>" in src
    assert "You are Kimi" not in src   # no default system prompt injection


def test_spec_example_system_user(tok):
    msgs = [{"role": "system", "content": "You are a helpful assistant provided by Moonshot-AI."},
            {"role": "user", "content": "Is 123 a prime?"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant provided by Moonshot-AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Is 123 a prime?<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_no_generation_prompt_and_assistant_turn(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>hello<|im_end|>")


def test_tools_are_declared_sorted_and_compact(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "Weather in 北京?"}], tools=[WEATHER_TOOL])
    declared = ('[{"function":{"description":"Get weather","name":"get_weather","parameters":{"properties":'
                '{"city":{"description":"城市","type":"string"}},"required":["city"],"type":"object"}},'
                '"type":"function"}]')
    assert out == (f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>"
                   "<|im_user|>user<|im_middle|>Weather in 北京?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert json.loads(declared) == [WEATHER_TOOL]


def test_assistant_tool_calls_and_tool_results(tok):
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}},
            {"id": "functions.get_weather:1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "上海"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": [{"type": "text", "text": "Rain"}]},
    ]
    assert tok.apply_chat_template(msgs) == (
        "<|im_user|>user<|im_middle|>weather?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "北京"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "上海"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\nRain<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")


def test_content_parts_name_and_none_content(tok):
    msgs = [{"role": "user", "name": "alice", "content": [
                {"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "here"}]},
            {"role": "assistant", "content": None}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_user|>alice<|im_middle|>look <|media_start|>image<|media_content|><|media_pad|><|media_end|>\nhere"
        "<|im_end|><|im_assistant|>assistant<|im_middle|><|im_end|>")


def test_rendered_prompt_encodes_markers_as_special_ids(tok):
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    n = tok.n_base
    plain = lambda s: tok.encode(s, allow_special=False)  # noqa: E731
    assert ids == [n + 3] + plain("user") + [n + 17] + plain("hi") + [n + 2, n + 4] + plain("assistant") + [n + 17]


def test_template_from_tokenizer_config_when_no_jinja_file(tmp_path):
    write_tokenizer_files(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ bos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}]) == "[user:x][BOS]"


def test_tojson_filter():
    value = {"b": "é", "a": [1, 2]}
    assert render("{{ v | tojson }}", v=value) == '{"b": "é", "a": [1, 2]}'
    assert render("{{ v | tojson(separators=(',', ':')) }}", v=value) == '{"b":"é","a":[1,2]}'
    assert render("{{ v | tojson(indent=1, sort_keys=true) }}", v=value) == json.dumps(value, indent=1,
                                                                                       sort_keys=True,
                                                                                       ensure_ascii=False)


def test_hf_helpers_and_loop_controls():
    assert render("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "012"
    assert render("{% for i in range(3)|reverse %}{{ i }}{% endfor %}{{ range(4)|length }}") == "2104"
    with pytest.raises(TemplateError, match="bad role"):
        render("{{ raise_exception('bad role') }}")


# sandbox -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{% set x = messages.append(1) %}",
])
def test_python_internals_are_refused(source):
    with pytest.raises(TemplateError, match="sandbox|unsafe|blocked"):
        render(source, messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{% for i in range(10**9) %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ 'a' | center(10**10) }}",
    "{{ 'a'.ljust(10**10) }}",
    "{{ '{:>10000000000}'.format('a') }}",
    "{{ '%10000000000s' % 'a' }}",
    "{{ (9 ** 60) ** 60 ** 60 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ lipsum(10**7) }}",
])
def test_huge_values_and_recursion_fail_fast(source):
    t0 = time.monotonic()
    with pytest.raises(TemplateError):
        render(source)
    assert time.monotonic() - t0 < 2.0


def test_endless_nested_loop_stopped_by_step_budget():
    limits = TemplateLimits(max_iterations=200_000)
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="steps"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", limits)
    assert time.monotonic() - t0 < 2.0


def test_endless_loop_stopped_by_time_limit():
    limits = TemplateLimits(max_seconds=0.3, max_iterations=10**12)
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="time limit"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}", limits)
    assert time.monotonic() - t0 < 2.0


def test_output_cap():
    limits = TemplateLimits(max_output_chars=1000)
    with pytest.raises(TemplateError, match="exceeded|too large|built a value"):
        render("{% for i in range(2000) %}x{% endfor %}", limits)


def test_syntax_error_is_a_template_error():
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        compile_chat_template("ok\n{% for %}")


def test_limits_do_not_leak_between_renders(tok):
    """Each render gets a fresh step budget: three renders of 600 steps pass under a 1,000-step limit that one
    render of 1,200 steps exceeds (a budget kept across renders would fail the second)."""
    limits = TemplateLimits(max_iterations=1000)
    t = compile_chat_template("{% for i in range(600) %}{{ i }},{% endfor %}", limits)
    for _ in range(3):
        assert render_chat_template(t, {}, limits).count(",") == 600
    with pytest.raises(TemplateError, match="exceeded 1000 steps"):
        render("{% for i in range(1200) %}{{ i }},{% endfor %}", limits)
    msgs = [{"role": "user", "content": "x" * 1000}] * 200
    for _ in range(3):
        assert tok.apply_chat_template(msgs).count("<|im_end|>") == 200
