"""HF transformers + fla baseline for bench/e2e.py: the official Kimi-Linear remote code (modeling_kimi.py and
configuration_kimi.py of moonshotai/Kimi-Linear-48B-A3B-Instruct, kept outside this repository) run on the SAME
random weights as our engine. Nothing is copied: every hub-named parameter of the HF model is a view of our model's
parameter (backend.model.loader.checkpoint_plan, the hub name -> our parameter map, read backwards), except where
the HF parameter has another dtype (KDA conv weights, e_score_correction_bias: cast like from_pretrained would).

The third-party files and their wheels travel beside the repository (not in it):
    .hf/kimi-linear/{modeling_kimi.py, configuration_kimi.py, config.json, SOURCE}   the official remote code
    .hf/whl/*.whl   transformers 4.57 (the config's transformers_version) with the huggingface_hub / tokenizers it
                    pins, fla-core + flash-linear-attention 0.4.0 (the fla release the remote code calls: its
                    fused_kda_gate(g, A, head_k_dim, g_bias=) and fla.layers.utils are gone from later releases)
activate() installs the wheels into their own folder and puts it first on sys.path, so the device's own packages
(tokenizers, huggingface_hub, fla-core 0.6 in .whl) stay as they are for everything else.

One deviation from the official code, forced by the device: KimiLinearModel.__init__ forces
config._attn_implementation = "flash_attention_2" and the flash-attn package cannot be installed there (no wheel
for this torch); the MLA layers run through transformers' "sdpa" (torch.nn.functional.scaled_dot_product_attention)
instead, set on the config after construction. Everything else (KDA via fla, MoE expert loop, KimiDynamicCache,
GenerationMixin.generate) is the official code path.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = "/tmp/hfsite"
_ISOLATED = ("transformers", "huggingface_hub", "tokenizers", "fla")


def activate(wheels: str, site: str = SITE) -> str:
    """Install the carried wheels into `site` (once) and put it first on sys.path -> transformers version.
    wheels '': use the transformers and fla that are importable."""
    if wheels:
        clash = [m for m in _ISOLATED if m in sys.modules]
        if clash:
            raise RuntimeError(f"{clash} already imported from {[sys.modules[m].__file__ for m in clash]}: the HF "
                               "baseline must import its own pinned copies first")
        files = sorted(os.path.join(wheels, f) for f in os.listdir(wheels) if f.endswith(".whl"))
        stamp = os.path.join(site, ".installed")
        if not os.path.exists(stamp) or open(stamp).read() != "\n".join(files):
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--disable-pip-version-check", "--upgrade", "--target", site, *files], check=True)
            with open(stamp, "w") as f:
                f.write("\n".join(files))
        sys.path.insert(0, site)
    os.environ.setdefault("HF_HOME", os.path.join(tempfile.gettempdir(), "hf_home"))  # remote-code module cache
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    return transformers.__version__


def source(hf_dir: str) -> str:
    """The SOURCE note beside the remote code (where the files came from), one line."""
    try:
        with open(os.path.join(hf_dir, "SOURCE")) as f:
            return " ".join(f.read().split())
    except OSError:
        return "(no SOURCE file)"


def hub_tensors(model) -> dict:
    """Our model's parameters under the official checkpoint names -> {hub name: view of our parameter}."""
    from backend.model.loader import checkpoint_plan

    assert model.tp.world == 1, "the HF baseline runs unsharded"
    params = dict(model.named_parameters())
    out = {}
    for name, t in checkpoint_plan(model.config).items():
        out[name] = params[t.param].data[t.index].reshape(t.shape)  # a view: rows/slices of a packed parameter
    return out


def build(hf_dir: str, config: dict, hub: dict, dtype: torch.dtype, attn: str = "sdpa"):
    """The official KimiLinearForCausalLM for `config` (a config.json dict) with `hub` as its parameters."""
    import transformers

    tmp = tempfile.mkdtemp(prefix="kimi_hf_")
    try:
        for f in ("configuration_kimi.py", "modeling_kimi.py"):
            shutil.copy(os.path.join(hf_dir, f), tmp)
        conf = dict(config, auto_map={"AutoConfig": "configuration_kimi.KimiLinearConfig",
                                      "AutoModel": "modeling_kimi.KimiLinearModel",
                                      "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(conf, f)
        hf_conf = transformers.AutoConfig.from_pretrained(tmp, trust_remote_code=True)
        with torch.device("meta"):  # no memory: every parameter is replaced below
            hf = transformers.AutoModelForCausalLM.from_config(hf_conf, trust_remote_code=True, dtype=dtype)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    hf.config._attn_implementation = attn  # the official __init__ forces flash_attention_2 (not installable)
    left = dict(hub)
    for name, p in list(hf.named_parameters()):
        t = left.pop(name)  # KeyError: the remote code has a parameter our checkpoint plan does not
        assert t.shape == p.shape, (name, t.shape, p.shape)
        if t.dtype != p.dtype:
            t = t.to(p.dtype)
        mod, leaf = name.rsplit(".", 1)
        setattr(hf.get_submodule(mod), leaf, torch.nn.Parameter(t, requires_grad=False))
    assert not left, f"checkpoint tensors the HF model has no parameter for: {sorted(left)[:5]}"
    meta = [n for n, b in hf.named_buffers() if b.is_meta]
    assert not meta, f"HF buffers left on meta: {meta[:5]}"
    return hf.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


@torch.no_grad()
def generate(hf, ids: torch.Tensor, new: int, processors=None):
    """Greedy HF generate with its KimiDynamicCache; exactly `new` tokens (EOS cannot end it early)."""
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, use_cache=True, pad_token_id=hf.config.pad_token_id,
                       logits_processor=processors)


class _Clock:
    """A logits processor that only timestamps: generate calls it once per new token, after that step's forward."""

    def __init__(self, device):
        self.device, self.t = device, []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.t.append(time.perf_counter())
        return scores


@torch.no_grad()
def bench(hf, prompt, vocab: int, prefill: list, batches: list, context: int, steps: int, device) -> list:
    """-> rows (name, tok/s). Prefill: one generate of 1 new token (the prompt's forward, all-position logits as the
    remote code computes them, and the sampled token), after a warm-up of the same length (fla autotunes on first
    use). Decode: one generate of `steps`+1 new tokens after a warm-up generate of the same shapes; the time from
    the first new token to the last, over `steps` (each step: prepare inputs, forward, greedy pick)."""
    from transformers import LogitsProcessorList

    rows = []
    for n in prefill:
        ids = torch.tensor([prompt(n, vocab, 7)], device=device)
        generate(hf, ids, 1)
        dt = _timed(lambda: generate(hf, ids, 1), device)
        rows.append((f"HF+fla prefill {n} (generate, 1 new token)", n / dt))
        print(f"  HF+fla prefill {n}: {dt * 1e3:.0f} ms, {n / dt:.0f} tok/s", flush=True)
    for b in batches:
        ids = torch.tensor([prompt(context, vocab, 100 + i) for i in range(b)], device=device)
        generate(hf, ids, 3)  # warm-up: prefill at this shape + the recurrent decode kernels
        clock = _Clock(device)
        total = _timed(lambda: generate(hf, ids, steps + 1, LogitsProcessorList([clock])), device)
        per = (clock.t[-1] - clock.t[0]) / steps
        rows.append((f"HF+fla decode b{b} ctx{context} greedy (generate)", b / per))
        print(f"  HF+fla decode b{b}: {per * 1e3:.2f} ms/step, {b / per:.1f} tok/s ({steps} steps; the whole "
              f"generate incl. the {context}-token prefill {total:.2f} s)", flush=True)
    return rows


@torch.no_grad()
def compare(model, hf, prompt_ids: list, new: int) -> dict:
    """Our model vs the HF model on the same weights: all-position prefill logits, then `new` greedy decode steps
    (ours through ForwardBatch + cache, HF through generate) -> max |diff| of the logits, max |logit|, token ids."""
    from backend.model.batch import ForwardBatch

    device, bs, slot = model.device, 16, 1
    blocks = list(range(1, 2 + (len(prompt_ids) + new) // bs))
    cache = model.allocate_cache(num_slots=2, num_blocks=len(blocks) + 1, block_size=bs)

    def step(ids, cached, decodes, all_pos=False):
        batch = ForwardBatch.build([(ids, cached, slot, blocks)], decodes, bs, device)
        hidden = model(batch, cache)
        index = torch.arange(len(ids), device=device) if all_pos else batch.logits_index
        return model.compute_logits(hidden, index)

    ours = [step(prompt_ids, 0, 0, all_pos=True)]
    toks = [int(ours[0][-1].argmax())]
    for i in range(new - 1):
        ours.append(step([toks[-1]], len(prompt_ids) + i, 1))
        toks.append(int(ours[-1][-1].argmax()))
    ids = torch.tensor([prompt_ids], device=device)
    hf_prefill = hf(ids, use_cache=False).logits[0].float()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=hf.config.pad_token_id)
    hf_toks = out.sequences[0, len(prompt_ids):].tolist()
    hf_steps = [x[0].float() for x in out.logits]
    dec = [float((a[-1] - b).abs().max()) for a, b in zip(ours, hf_steps)]
    return dict(prefill_max_diff=float((ours[0] - hf_prefill).abs().max()),
                prefill_max_logit=float(hf_prefill.abs().max()),
                decode_max_diff=max(dec), decode_diffs=dec, ours_tokens=toks, hf_tokens=hf_toks)
