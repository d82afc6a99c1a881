"""LoadModel (ModelOptions) -> where the model is + engine settings + server settings. Pure Python, no torch.

Sources, later ones win: ModelOptions fields (ContextSize, MaxModelLen, DType, Seed, GPUMemoryUtilization,
EnforceEager, TensorParallelSize), then `Options` ("key:value" strings, unknown keys logged and ignored), then
`EngineArgs` (a JSON object, strict: an unknown key is an error).
"""

import difflib
import json
import logging
import math
import os
from dataclasses import dataclass, field

log = logging.getLogger("kimi-linear")

# key -> (type, meaning). Engine keys go to EngineConfig when it has a field of that name.
ENGINE_KEYS = {
    "max_model_len": (int, "max tokens per sequence (prompt + output); overrides ContextSize/MaxModelLen"),
    "max_num_seqs": (int, "most sequences in one batch"),
    "max_num_batched_tokens": (int, "token budget of one engine step (chunked prefill)"),
    "max_prefill_tokens_with_decode": (int, "prefill tokens per step while requests decode (bounds inter-token "
                                            "stalls; 0 = no cap, default 2048)"),
    "block_size": (int, "MLA latent cache page size in tokens"),
    "gpu_memory_utilization": (float, "fraction of device memory the engine may use"),
    "enforce_eager": (bool, "no CUDA graphs for decode"),
    "dtype": (str, "bfloat16 | float16 | float32 (default: the checkpoint's)"),
    "device": (str, "cuda | cpu (default: cuda if available)"),
    "router_biased_weights": (bool, "MoE: weight experts by the bias-corrected scores"),
    "seed": (int, "default sampling seed of requests that set none"),
    "num_slots": (int, "KDA state slots incl. the null slot (default: max_num_seqs + 1)"),
    "num_blocks": (int, "MLA pages incl. the null page (default: sized from gpu_memory_utilization)"),
    "prefix_cache_slots": (int, "prefix caching: prompts kept for reuse by later prompts that extend them (each holds "
                                "a KDA state slot, ~42 MB for Kimi-Linear, and its MLA pages); 0 = off (default)"),
    "prefix_cache_min_tokens": (int, "prefix caching: shortest prompt worth keeping (default 64)"),
    "max_graph_batch_size": (int, "largest decode batch captured in a CUDA graph (default: max_num_seqs)"),
    "prefill_graph_tokens": (int, "CUDA graphs for prefill-only steps of up to this many tokens (buckets 256..4096, "
                                  "up to 4 fresh prompts; the largest bucket's activations stay allocated); 0 = off "
                                  "(default 4096)"),
    "warmup": (bool, "at load on CUDA, run a few requests (common sampling settings, long prompts) so that kernels "
                     "compile before the first request (default true)"),
    "random_weights": (bool, "benchmarks only: random weights from config.json, no safetensors needed"),
    "tp_size": (int, "tensor-parallel world size, all nodes together (= TensorParallelSize)"),
    "master_addr": (str, "multi-node: node 0's address that the other nodes reach (default 127.0.0.1)"),
    "master_port": (int, "tensor-parallel control port on node 0 (default: any free port; set it for multi-node)"),
    "nnodes": (int, "multi-node: number of nodes (tp_size / nnodes GPUs each)"),
    "node_rank": (int, "this node's index; the gRPC server runs on node 0"),
}
SERVER_KEYS = {
    "tool_parser": (str, "kimi_k2 (default) | none: parse Kimi tool-call markup into ToolCallDelta"),
    "default_max_tokens": (int, "max new tokens when a request sets none (0 = until EOS / end of context)"),
}
ALL_KEYS = {**ENGINE_KEYS, **SERVER_KEYS}
TOOL_PARSERS = ("kimi_k2", "none")
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32", "float": "float32", "auto": None, "": None}


class OptionsError(ValueError):
    """A LoadModel setting is wrong; the message says which and what would be right."""


@dataclass
class LoadSpec:
    model_dir: str
    model_name: str  # ModelOptions.Model: the identity LocalAI checks requests against
    engine: dict = field(default_factory=dict)  # EngineConfig keyword arguments (only keys in ENGINE_KEYS)
    tool_parser: str = "kimi_k2"
    default_max_tokens: int = 0
    ignored: list = field(default_factory=list)  # option keys logged and ignored


def normalize_key(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_").lower()


def coerce(value: str):
    """'true'/'false' -> bool, ints, floats, else the stripped string (LocalAI's parse_options rule)."""
    v = value.strip()
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return int(v)
    except ValueError:
        pass
    try:
        return float(v)
    except ValueError:
        return v


def parse_options(options) -> dict:
    """["key:value", ...] -> {key: coerced value}. Entries without ':' are flags set to True."""
    out = {}
    for opt in options:
        if not opt or not opt.strip():
            continue
        if ":" in opt:
            k, v = opt.split(":", 1)
            out[normalize_key(k)] = coerce(v)
        else:
            out[normalize_key(opt)] = True
    return out


def _typed(key: str, value, source: str):
    typ = ALL_KEYS[key][0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
    elif typ is int:
        if isinstance(value, bool):
            pass
        elif isinstance(value, int):
            return value
        elif isinstance(value, float) and value.is_integer():
            return int(value)
        elif isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        if isinstance(value, str):
            try:
                f = float(value)
                if math.isfinite(f):
                    return f
            except ValueError:
                pass
    else:
        if isinstance(value, str):
            return value
    raise OptionsError(f"{source} '{key}': expected {typ.__name__}, got {value!r} ({ALL_KEYS[key][1]})")


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, list(ALL_KEYS), n=1)
    return f" did you mean '{close[0]}'?" if close else f" known keys: {', '.join(sorted(ALL_KEYS))}"


def resolve_model_dir(model_file: str, model: str, model_path: str, launch_cwd: str | None = None) -> str:
    """ModelFile if it exists, else Model (absolute, relative to ModelPath, or to the launch directory)."""
    tried = []
    if model_file:
        if os.path.exists(model_file):
            return os.path.abspath(model_file)
        tried.append(model_file)
    if model:
        cands = [model] if os.path.isabs(model) else []
        if not os.path.isabs(model):
            if model_path:
                cands.append(os.path.join(model_path, model))
            cands.append(os.path.join(launch_cwd or os.getcwd(), model))
        for c in cands:
            if os.path.exists(c):
                return os.path.abspath(c)
            tried.append(c)
    if not tried:
        raise OptionsError("no model given: set parameters.model in the model YAML (ModelOptions.Model/ModelFile)")
    raise OptionsError(
        "model directory not found (tried: " + ", ".join(tried) + "). Put the Hugging Face checkpoint "
        "(config.json, *.safetensors, tokenizer files) in a directory under the models path and set "
        "parameters.model to its name, or give an absolute path")


def build_load_spec(request, launch_cwd: str | None = None) -> LoadSpec:
    """ModelOptions -> LoadSpec. Raises OptionsError with an actionable message."""
    model_dir = resolve_model_dir(request.ModelFile, request.Model, request.ModelPath, launch_cwd)
    if not os.path.isdir(model_dir):
        raise OptionsError(f"{model_dir} is a file; the model must be a checkpoint directory (config.json + "
                           "safetensors shards + tokenizer files)")
    spec = LoadSpec(model_dir=model_dir, model_name=request.Model or request.ModelFile)
    settings = {}
    # 1. ModelOptions fields (proto3: 0 / "" / false = not set)
    if request.MaxModelLen > 0:
        settings["max_model_len"] = request.MaxModelLen
    elif request.ContextSize > 0:
        settings["max_model_len"] = request.ContextSize
    if request.DType:
        settings["dtype"] = request.DType
    if request.Seed:
        settings["seed"] = request.Seed
    if request.GPUMemoryUtilization:
        settings["gpu_memory_utilization"] = round(float(request.GPUMemoryUtilization), 6)  # float32 on the wire
    if request.EnforceEager:
        settings["enforce_eager"] = True
    if request.TensorParallelSize > 1:
        settings["tp_size"] = request.TensorParallelSize
    # 2. Options: tolerant
    for key, value in parse_options(request.Options).items():
        if key not in ALL_KEYS:
            log.warning("LoadModel: ignoring unknown option '%s' (known: %s)", key, ", ".join(sorted(ALL_KEYS)))
            spec.ignored.append(key)
            continue
        settings[key] = _typed(key, value, "option")
    # 3. EngineArgs: strict JSON object
    if request.EngineArgs.strip():
        try:
            args = json.loads(request.EngineArgs)
        except json.JSONDecodeError as e:
            raise OptionsError(f"engine_args is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise OptionsError(f"engine_args must be a JSON object, got {type(args).__name__}")
        for raw_key, value in args.items():
            key = normalize_key(raw_key)
            if key not in ALL_KEYS:
                raise OptionsError(f"unknown engine_args key '{raw_key}'.{_suggest(key)}")
            settings[key] = _typed(key, value, "engine_args")
    # checks and split
    for key, value in settings.items():
        if key in SERVER_KEYS:
            setattr(spec, key, value)
        else:
            spec.engine[key] = value
    if "dtype" in spec.engine:
        d = str(spec.engine["dtype"]).lower()
        if d not in DTYPES:
            raise OptionsError(f"dtype '{spec.engine['dtype']}' is not supported (bfloat16, float16, float32)")
        if DTYPES[d] is None:
            del spec.engine["dtype"]
        else:
            spec.engine["dtype"] = DTYPES[d]
    gmu = spec.engine.get("gpu_memory_utilization")
    if gmu is not None and not 0.0 < gmu <= 1.0:
        raise OptionsError(f"gpu_memory_utilization must be in (0, 1], got {gmu}")
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_slots",
                "num_blocks", "max_graph_batch_size", "tp_size", "nnodes", "prefix_cache_min_tokens"):
        if key in spec.engine and spec.engine[key] <= 0:
            raise OptionsError(f"{key} must be a positive integer, got {spec.engine[key]}")
    for key, zero in (("max_prefill_tokens_with_decode", "no cap"), ("prefix_cache_slots", "off")):
        if spec.engine.get(key, 0) < 0:
            raise OptionsError(f"{key} must be >= 0 (0 = {zero}), got {spec.engine[key]}")
    _check_parallel(spec.engine)
    if spec.tool_parser not in TOOL_PARSERS:
        raise OptionsError(f"tool_parser '{spec.tool_parser}' is not supported ({', '.join(TOOL_PARSERS)})")
    if spec.default_max_tokens < 0:
        raise OptionsError(f"default_max_tokens must be >= 0, got {spec.default_max_tokens}")
    return spec


def _check_parallel(engine: dict):
    tp, nnodes = engine.get("tp_size", 1), engine.get("nnodes", 1)
    if tp % nnodes:
        raise OptionsError(f"tensor_parallel_size {tp} must be a multiple of nnodes {nnodes} (GPUs per node)")
    if engine.get("node_rank", 0) != 0:
        raise OptionsError("node_rank must be 0 here: LocalAI talks to node 0; start the ranks of node N with "
                           "python -m backend.model.parallel_worker --node-rank N ...")
    if not 0 <= engine.get("master_port", 0) < 65536:
        raise OptionsError(f"master_port must be in [0, 65535], got {engine['master_port']}")
    if nnodes > 1 and not engine.get("master_port"):
        raise OptionsError("nnodes > 1 needs master_port (and master_addr: node 0's address on the link between "
                           "the nodes) so that the other nodes can join")


def engine_config(config_cls, engine_kwargs: dict):
    """EngineConfig(**known kwargs); keys this EngineConfig has no field for are logged and skipped."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else None
    kwargs = {}
    for k, v in engine_kwargs.items():
        if names is not None and k not in names:
            log.warning("LoadModel: engine setting '%s' is not supported by this engine build; ignored", k)
            continue
        kwargs[k] = v
    return config_cls(**kwargs)
