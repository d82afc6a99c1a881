"""PredictOptions -> prompt token ids + SamplingParams + stop strings; logprobs -> OpenAI JSON. No torch.

LocalAI semantics (proto3: 0 / "" / false mean "not set"):
  Temperature 0 = greedy;  TopK <= 0 = off (LocalAI sends -1 for Kimi);  TopP 0 = 1.0;  MinP 0 = off;
  Penalty 0 = 1.0 (off);  Tokens 0 = the load's default_max_tokens (0 = until EOS / end of context);
  Seed 0 = the load's seed, else drawn by the engine;  Logprobs > 0 or TopLogprobs > 0 = return logprobs.
"""

import json
import logging
import math

from backend.engine.request import MAX_TOP_LOGPROBS, SamplingParams
from backend.engine.structured import JSON_DEFAULTS
from backend.toolcalls import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGINS, SECTION_ENDS

log = logging.getLogger("kimi-linear")


class BadRequest(ValueError):
    """The request is malformed; answered with INVALID_ARGUMENT and this message."""


def _loads(raw: str, what: str):
    """json.loads naming the field on failure; nesting too deep for the parser (RecursionError) is bad input too."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply") from None


def messages_to_dicts(messages) -> list:
    """proto Message -> chat-template dicts (tool_calls JSON decoded, function.arguments decoded to objects)."""
    out = []
    for i, m in enumerate(messages):
        d = {"role": m.role, "content": m.content or ""}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = _loads(m.tool_calls, f"Messages[{i}].tool_calls")
            if not isinstance(calls, list):
                raise BadRequest(f"Messages[{i}].tool_calls must be a JSON array")
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except (json.JSONDecodeError, RecursionError):
                        pass
            d["tool_calls"] = calls
        out.append(d)
    return out


def _tools(request):
    if not request.Tools.strip():
        return None
    tools = _loads(request.Tools, "Tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("Tools must be a JSON array of OpenAI tool objects")
    if _tool_choice(request) == "none":
        return None
    return tools or None


def _tool_choice(request):
    """ToolChoice -> "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}} (or as sent)."""
    choice = request.ToolChoice.strip()
    if not choice:
        return "auto"
    try:
        return json.loads(choice)
    except json.JSONDecodeError:
        return choice  # LocalAI may send a bare string
    except RecursionError:
        raise BadRequest("ToolChoice is nested too deeply") from None


# Kimi-K2 tool-call markup (backend/toolcalls.py); in a grammar these are the special tokens, by name
_TOOL_MARKERS = (SECTION_BEGINS[0], SECTION_ENDS[0], CALL_BEGIN, ARG_BEGIN, CALL_END)
# arguments: bounded whitespace (as for any JSON schema) and keywords llguidance does not implement ignored
_ARGS_GUIDANCE = {**JSON_DEFAULTS, "lenient": True}


def tool_choice_grammar(request, tok):
    """ToolChoice "required" or a named function (OpenAI semantics, with Tools rendered by the chat template) -> a
    Lark grammar (llguidance) of the Kimi tool-call section the answer must then be: one or more calls of the
    declared functions ("required"), or exactly one call of the named one, each function's arguments constrained by
    its JSON schema. None when nothing is forced ("auto", "none", no tools, or a tokenizer without the markup)."""
    choice = _tool_choice(request)
    tools = _tools(request) if request.UseTokenizerTemplate else None
    if not tools or choice in ("auto", "none"):
        return None
    funcs = [t.get("function", t) for t in tools if isinstance(t, dict)]
    funcs = [f for f in funcs if isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]]
    name = None
    if isinstance(choice, dict):  # chat completions: {"type": "function", "function": {"name"}}; responses: flat
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if isinstance(name, str) and name:
        funcs = [f for f in funcs if f["name"] == name]
        if not funcs:
            raise BadRequest(f"ToolChoice names the function '{name}', which is not in Tools")
        calls = "call"
    elif choice == "required":
        if not funcs:
            raise BadRequest('ToolChoice is "required" but Tools declares no function')
        calls = "call+"
    else:  # a shape this backend does not know: the model stays free, as before ToolChoice was enforced
        log.warning("ToolChoice %r not understood (auto, none, required or a function): not enforced", choice)
        return None
    if any(tok.token_to_id(m) is None for m in _TOOL_MARKERS):
        log.warning("ToolChoice %r not enforced: the tokenizer lacks the Kimi tool-call tokens", choice)
        return None
    b, e, cb, ab, ce = _TOOL_MARKERS
    rules = [f"start: {b} {calls} {e}", f"call: {cb} ({' | '.join(f'fn_{i}' for i in range(len(funcs)))}) {ce}"]
    for i, f in enumerate(funcs):
        params = f.get("parameters")
        schema = dict(params) if isinstance(params, dict) else {}
        schema.setdefault("type", "object")  # OpenAI function arguments are a JSON object, even if the schema omits it
        schema["x-guidance"] = {**_ARGS_GUIDANCE, **(schema.get("x-guidance") or {})}
        rules.append(f'fn_{i}: {json.dumps("functions." + f["name"] + ":")} /[0-9]{{1,3}}/ {ab} args_{i}')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def _template_kwargs(request) -> dict:
    kw = {}
    meta = dict(request.Metadata)
    raw = meta.pop("chat_template_kwargs", "")
    for k in ("enable_thinking", "thinking"):
        if k in meta:
            kw[k] = meta[k].strip().lower() in ("true", "1", "yes", "on")
    if "reasoning_effort" in meta and meta["reasoning_effort"]:
        kw["reasoning_effort"] = meta["reasoning_effort"]
    if raw.strip():
        extra = _loads(raw, "Metadata['chat_template_kwargs']")
        if not isinstance(extra, dict):
            raise BadRequest("Metadata['chat_template_kwargs'] must be a JSON object")
        kw.update(extra)
    for k in ("messages", "tools", "add_generation_prompt"):
        kw.pop(k, None)
    return kw


def prompt_text(request, tok) -> str:
    """The text to tokenize: Messages through the chat template (UseTokenizerTemplate), else Prompt."""
    if request.UseTokenizerTemplate and len(request.Messages) > 0:
        return tok.apply_chat_template(messages_to_dicts(request.Messages), tools=_tools(request),
                                       add_generation_prompt=True, **_template_kwargs(request))
    if request.Tools.strip():
        _tools(request)  # still reject invalid JSON
    return request.Prompt


def prompt_ids(request, tok) -> list:
    text = prompt_text(request, tok)
    if not text:
        raise BadRequest("empty prompt: set Prompt, or UseTokenizerTemplate with Messages")
    ids = tok.encode(text)
    if not ids:
        raise BadRequest("the prompt encodes to no tokens")
    return ids


def cache_points(ids: list, tok) -> tuple:
    """Where a chat prompt's first user message starts: what comes before it (the tool declarations and the system
    prompt) is what new conversations share, so the prefix cache keeps it too (later turns extend whole prompts,
    which it keeps anyway). () for a prompt without a user message or with nothing before it."""
    user = tok.token_to_id("<|im_user|>")
    if user is None or user not in ids:
        return ()
    p = ids.index(user)
    return (p,) if p > 0 else ()


def _finite(name, v):
    if not math.isfinite(v):
        raise BadRequest(f"{name} must be a finite number, got {v}")
    return v


def logit_bias(raw: str) -> dict:
    if not raw.strip():
        return {}
    obj = _loads(raw, "LogitBias")
    if not isinstance(obj, dict):
        raise BadRequest('LogitBias must be a JSON object {"token_id": bias}')
    out = {}
    for k, v in obj.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"LogitBias key {k!r} is not a token id") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise BadRequest(f"LogitBias[{k}] must be a finite number, got {v!r}")
        out[tid] = float(max(-100.0, min(100.0, v)))
    return out


def sampling_params(request, eos_token_ids=(), default_max_tokens: int = 0, default_seed=None) -> tuple:
    """PredictOptions -> (SamplingParams, stop strings). Raises BadRequest."""
    temperature = _finite("Temperature", request.Temperature)
    if temperature < 0:
        raise BadRequest(f"Temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = _finite("TopP", request.TopP)
    if top_p == 0:
        top_p = 1.0
    if not 0 < top_p <= 1:
        raise BadRequest(f"TopP must be in (0, 1], got {top_p}")
    min_p = _finite("MinP", request.MinP)
    if not 0 <= min_p <= 1:
        raise BadRequest(f"MinP must be in [0, 1], got {min_p}")
    penalty = _finite("Penalty", request.Penalty)
    if penalty == 0:
        penalty = 1.0
    if penalty < 0:
        raise BadRequest(f"Penalty (repeat_penalty) must be > 0 (1 = off), got {penalty}")
    presence = _finite("PresencePenalty", request.PresencePenalty)
    frequency = _finite("FrequencyPenalty", request.FrequencyPenalty)
    for name, v in (("PresencePenalty", presence), ("FrequencyPenalty", frequency)):
        if not -2.0 <= v <= 2.0:
            raise BadRequest(f"{name} must be in [-2, 2], got {v}")
    max_tokens = request.Tokens if request.Tokens > 0 else default_max_tokens
    top_logprobs = max(request.TopLogprobs, 0)
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise BadRequest(f"TopLogprobs must be <= {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    want_logprobs = request.Logprobs > 0 or top_logprobs > 0
    seed = request.Seed if request.Seed != 0 else default_seed
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_k=request.TopK if request.TopK > 0 else 0,
        top_p=float(top_p),
        min_p=float(min_p),
        repetition_penalty=float(penalty),
        presence_penalty=float(presence),
        frequency_penalty=float(frequency),
        seed=seed,
        ignore_eos=request.IgnoreEOS,
        stop_token_ids=() if request.IgnoreEOS else tuple(eos_token_ids),
        logit_bias=logit_bias(request.LogitBias),
        logprobs=want_logprobs,
        top_logprobs=top_logprobs,
    )
    stops = [s for s in request.StopPrompts if s]
    return params, stops


# ----------------------------------------------------------------------------------------------- logprobs

def _token_info(tok, token_id):
    try:
        raw = tok.id_to_bytes(token_id)
    except Exception:  # noqa: BLE001 - an id outside the tokenizer: still report it
        raw = b""
    return raw.decode("utf-8", errors="replace"), list(raw)


def logprob_entry(tok, entry) -> dict:
    """Engine entry {"token_id", "logprob", "top": [(id, logprob), ...]} -> OpenAI logprobs.content item."""
    tid = int(entry["token_id"])
    text, raw = _token_info(tok, tid)
    out = {"id": tid, "token": text, "bytes": raw, "logprob": float(entry["logprob"]), "top_logprobs": []}
    for t, lp in entry.get("top") or ():
        ttext, traw = _token_info(tok, int(t))
        out["top_logprobs"].append({"id": int(t), "token": ttext, "bytes": traw, "logprob": float(lp)})
    return out


def logprobs_json(entries: list) -> bytes:
    return json.dumps({"content": entries}, ensure_ascii=False).encode("utf-8")


# ------------------------------------------------------------------------------------------------ Score


def score_inputs(request, tok, max_model_len: int = 0) -> list:
    """ScoreRequest -> per candidate (token ids, score_from, prefix cache points): score ids[score_from:].

    As LocalAI's vLLM backend does, each candidate is tokenized joined to the prompt (a BPE merge across the
    boundary gives the tokens the model would see), and its tokens are those after the first position where the
    joined tokens leave the prompt's. An empty prompt (or a candidate that merges into the prompt's first token) is
    preceded by BOS, so that every candidate token has a context. The cache points are where the prompt's stable
    part ends (stable_prefix_len, in bytes of the prompt) and one token before the candidate (a candidate's scoring
    starts from that position's state: later candidates with the same prompt start there)."""
    prompt = tok.encode(request.prompt) if request.prompt else []
    k = 0  # the stable text's tokens that the whole prompt's tokens begin with
    if request.stable_prefix_len > 0 and prompt:
        stable = request.prompt.encode("utf-8")[:request.stable_prefix_len].decode("utf-8", errors="ignore")
        k = _common_prefix(tok.encode(stable) if stable else [], prompt)
    out = []
    for i, c in enumerate(request.candidates):
        ids = tok.encode(request.prompt + c) if c else list(prompt)
        d = _common_prefix(ids, prompt)
        if d == 0 and ids:
            if tok.bos_token_id is None:
                raise BadRequest(f"candidate {i} has no context to be scored after (an empty prompt, or one that "
                                 "merges into the candidate's first token) and the tokenizer has no BOS token")
            ids, d, sk = [tok.bos_token_id] + ids, 1, 0
        else:
            sk = k if k <= d else 0
        if max_model_len and len(ids) > max_model_len:
            raise BadRequest(f"candidate {i}: prompt + candidate are {len(ids)} tokens; the context is "
                             f"{max_model_len} tokens")
        out.append((ids, d, tuple(sorted({p for p in (d - 1, sk) if p > 0}))))
    return out


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def candidate_score(tok, ids: list, scores: list, length_normalize: bool, token_logprobs: bool) -> dict:
    """One candidate's token ids and their log-probabilities -> CandidateScore fields."""
    total = float(sum(scores))
    out = {"log_prob": total, "num_tokens": len(ids)}
    if length_normalize:
        out["length_normalized_log_prob"] = total / len(ids) if ids else 0.0
    if token_logprobs:
        out["tokens"] = [{"token": _token_info(tok, t)[0], "log_prob": float(lp)} for t, lp in zip(ids, scores)]
    return out
