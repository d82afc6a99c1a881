"""Write a small but complete Kimi-style tokenizer for the tiny test checkpoints.

A byte-level BPE (256 byte tokens plus merges learned deterministically from a built-in English + Chinese + code
sample), then 256 special ids laid out exactly like Kimi-Linear's (offsets from n_base: 0 [BOS], 1 [EOS],
2 <|im_end|>, ...). Files: tiktoken.model (or tokenizer.json for kind="json"), tokenizer_config.json,
special_tokens_map.json, chat_template.jinja.

    python -m tools.tiny_tokenizer OUT_DIR [--kind tiktoken|json]
"""

import argparse
import base64
import json
import os
from collections import Counter

import regex

from backend.tokenizer import KIMI_PAT_STR, NUM_RESERVED_SPECIAL, bytes_to_unicode, default_chat_template

NUM_MERGES = 256

# offset from n_base -> (content, special); the other offsets are unnamed reserved slots
SPECIAL_LAYOUT = {
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|im_end|>", True),
    3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True),
    6: ("<|start_header_id|>", True),
    7: ("<|end_header_id|>", True),
    9: ("[EOT]", True),
    10: ("<|im_system|>", True),
    11: ("<|tool_calls_section_begin|>", False),
    12: ("<|tool_calls_section_end|>", False),
    13: ("<|tool_call_begin|>", False),
    14: ("<|tool_call_argument_begin|>", False),
    15: ("<|tool_call_end|>", False),
    17: ("<|im_middle|>", True),
    18: ("<|media_start|>", True),
    19: ("<|media_content|>", True),
    20: ("<|media_end|>", True),
    21: ("<|media_pad|>", True),
    254: ("[PAD]", True),
    255: ("[UNK]", True),
}

ADDITIONAL_SPECIAL = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]

SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog. It's a sentence that uses every letter of the alphabet;
we've used it for testing typewriters, fonts and tokenizers since the 1880s. They'll keep using it.
Hello, world! How are you today? I'm fine, thank you, and you? The weather is nice and the sun is shining.
Kimi Linear is a hybrid linear attention architecture with Kimi Delta Attention and multi-head latent attention.
It supports a context length of up to one million tokens, and it runs the model in a mixture of experts.
The assistant answers the question of the user, then the user asks another question about the answer.
人工智能是计算机科学的一个分支，它试图理解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。
今天天气很好，我们一起去公园散步吧。你好，世界！我是一个语言模型，可以回答问题、写代码和翻译文章。
月之暗面发布了新的模型，这个模型使用线性注意力，支持一百万个词元的上下文长度。谢谢你的帮助。
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"fib({i}) = {fibonacci(i)}")

class Tokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [self.vocab[ch] for ch in text if ch in self.vocab]

{"name": "get_weather", "arguments": {"city": "Beijing", "unit": "celsius"}, "id": 12345}
if (x > 0 && y < 10) { return x * y; } else { return -1; }  // comment: 3.14159 2718 42
"""


def pretokenize(text):
    return regex.findall(KIMI_PAT_STR, text, flags=regex.V1)


def learn_merges(text, num_merges):
    """Byte-level BPE training: returns token byte strings in rank order (256 bytes first)."""
    words = Counter(tuple(bytes([b]) for b in piece.encode("utf-8")) for piece in pretokenize(text))
    ranks = [bytes([i]) for i in range(256)]
    known = set(ranks)
    while len(ranks) < 256 + num_merges:
        pair = _best_pair(words, known)
        if pair is None:
            raise ValueError(f"sample text supports only {len(ranks) - 256} merges, {num_merges} asked")
        ranks.append(pair[0] + pair[1])
        known.add(pair[0] + pair[1])
        words = _apply_merge(words, pair)
    return ranks


def _best_pair(words, known):
    counts = Counter()
    for word, freq in words.items():
        for a, b in zip(word, word[1:]):
            counts[a, b] += freq
    # highest count, ties broken by the bytes themselves; skip pairs whose result is already a token
    best = None
    for (a, b), n in counts.items():
        if a + b in known:
            continue
        key = (n, a + b, a)
        if best is None or key > best[0]:
            best = (key, (a, b))
    return None if best is None else best[1]


def _apply_merge(words, pair):
    a, b = pair
    out = Counter()
    for word, freq in words.items():
        merged, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                merged.append(a + b)
                i += 2
            else:
                merged.append(word[i])
                i += 1
        out[tuple(merged)] += freq
    return out


def special_tokens(n_base):
    """All 256 special slots: id -> (content, special flag); unnamed slots are <|reserved_token_{id}|>."""
    table = {}
    for off in range(NUM_RESERVED_SPECIAL):
        content, special = SPECIAL_LAYOUT.get(off, (f"<|reserved_token_{n_base + off}|>", True))
        table[n_base + off] = (content, special)
    return table


def tokenizer_config(n_base, chat_template):
    decoder = {}
    for off, (content, special) in SPECIAL_LAYOUT.items():
        decoder[str(n_base + off)] = {"content": content, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": special}
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def write_tiktoken_model(path, ranks):
    with open(path, "w", encoding="ascii") as f:
        for rank, token in enumerate(ranks):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def hf_merges(ranks):
    """Merges equivalent to tiktoken's rank-driven BPE: every split of a token into two lower-ranked tokens."""
    rank_of = {tok: r for r, tok in enumerate(ranks)}
    merges = []
    for rank, tok in enumerate(ranks):
        local = []
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in rank_of and right in rank_of and rank_of[left] < rank and rank_of[right] < rank:
                local.append((rank_of[left], rank_of[right], left, right))
        merges.extend((l, r) for _, _, l, r in sorted(local))
    return merges


def write_tokenizer_json(path, ranks, specials):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    to_str = lambda tok: "".join(b2u[b] for b in tok)  # noqa: E731
    vocab = {to_str(tok): r for r, tok in enumerate(ranks)}
    merges = [(to_str(a), to_str(b)) for a, b in hf_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    for tid in sorted(specials):
        content, special = specials[tid]
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        if tok.token_to_id(content) != tid:
            raise AssertionError(f"special token {content!r} got id {tok.token_to_id(content)}, want {tid}")
    tok.save(path)


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_tokenizer_files(out_dir, kind="tiktoken", num_merges=NUM_MERGES, corpus=None):
    """Write the tokenizer files into out_dir; returns the ids the checkpoint's config.json needs.

    corpus: text to learn the BPE merges from (default: the built-in SAMPLE_TEXT)."""
    if kind not in ("tiktoken", "json"):
        raise ValueError(f"kind must be 'tiktoken' or 'json', got {kind!r}")
    os.makedirs(out_dir, exist_ok=True)
    ranks = learn_merges(SAMPLE_TEXT if corpus is None else corpus, num_merges)
    n_base = len(ranks)
    specials = special_tokens(n_base)
    template = default_chat_template()
    if kind == "tiktoken":
        write_tiktoken_model(os.path.join(out_dir, "tiktoken.model"), ranks)
    else:
        write_tokenizer_json(os.path.join(out_dir, "tokenizer.json"), ranks, specials)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(n_base, template))
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), {
        "additional_special_tokens": ADDITIONAL_SPECIAL, "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[PAD]", "unk_token": "[UNK]"})
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    return {
        "vocab_size": n_base + NUM_RESERVED_SPECIAL,
        "n_base": n_base,
        "bos_token_id": n_base + 0,
        "eos_token_id": n_base + 2,          # <|im_end|>, the config eos
        "tokenizer_eos_token_id": n_base + 1,  # [EOS]
        "pad_token_id": n_base + 254,
        "unk_token_id": n_base + 255,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--kind", choices=("tiktoken", "json"), default="tiktoken")
    ap.add_argument("--corpus", help="UTF-8 text file to learn the merges from (default: built-in sample)")
    ap.add_argument("--merges", type=int, default=NUM_MERGES, help="number of BPE merges")
    args = ap.parse_args()
    corpus = None
    if args.corpus:
        with open(args.corpus, encoding="utf-8") as f:
            corpus = f.read()
    print(json.dumps(write_tokenizer_files(args.out_dir, args.kind, args.merges, corpus)))


if __name__ == "__main__":
    main()
