"""A synthetic byte-level vocabulary of any size, for grammar work where no real tokenizer is at hand (tests of the
grammar masks at Kimi's 163,840 ids, bench/e2e.py --grammar on random weights): the 256 single bytes, runs of 2-64
spaces, random 2-12 byte pieces of an English / JSON alphabet, and special ids at the end."""

import random


def synthetic_grammars(vocab: int, seed: int = 0):
    """-> backend.engine.structured.Grammars over `vocab` ids: 256 special ids at the end (8 for vocab <= 1024),
    EOS the second of them; encode is the identity on bytes."""
    from backend.engine.structured import Grammars

    rng = random.Random(seed)
    n_special = 256 if vocab > 1024 else 8
    base = vocab - n_special
    alpha = 'etaoinshrdlucmfwypvbgkjqxzETAOIN0123456789 _-.,:;"{}[]()\n\t/\\'
    toks = {bytes([i]) for i in range(256)}
    toks.update((" " * n).encode() for n in range(2, 65))
    while len(toks) < base:
        toks.add("".join(rng.choice(alpha) for _ in range(rng.choice([2, 3, 3, 4, 5, 6, 8, 12]))).encode())
    tb = sorted(toks, key=lambda b: (len(b), b))[:base] + [f"<|s{i}|>".encode() for i in range(n_special)]
    return Grammars(tb, range(base, vocab), [base + 1], None, lambda t: list(t.encode()))
