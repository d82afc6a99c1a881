"""backend/predict.py score_inputs: the Score RPC's tokens (joined tokenization as LocalAI's vLLM backend does it),
where scoring starts, and the prefix cache points; with the shipped tiny model's byte-level BPE, which merges
across the prompt / candidate boundary."""

import os

import pytest

import backend_pb2 as pb
from backend.predict import BadRequest, score_inputs
from backend.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer(os.path.join(ROOT, "models", "kimi-linear-tiny"))


def test_candidates_after_the_prompt(bpe):
    prompt = "The capital of France is"
    P = bpe.encode(prompt)
    (ids, sf, points), (e_ids, e_sf, _) = score_inputs(pb.ScoreRequest(prompt=prompt, candidates=[" Paris", ""]), bpe)
    assert ids == bpe.encode(prompt + " Paris") and ids[:len(P)] == P and sf == len(P) < len(ids)
    assert points == (len(P) - 1,)  # one token before the candidate: its scoring starts from that state
    assert e_ids == P and e_sf == len(P)  # an empty candidate: nothing to score


def test_a_merge_across_the_boundary_is_scored_from_where_the_tokens_part(bpe):
    prompt = "Once upon a ti"
    P, J = bpe.encode(prompt), bpe.encode(prompt + "me")
    assert J[:-1] == P[:-1] and J[-1] != P[-1]  # "ti" + "me" -> one "time" token
    (ids, sf, points), = score_inputs(pb.ScoreRequest(prompt=prompt, candidates=["me"]), bpe)
    assert ids == J and sf == len(P) - 1 and points == (len(P) - 2,)


def test_no_context_gets_bos(bpe):
    for prompt, cand in (("", "Once"), ("a", "b")):  # empty prompt; "a" + "b" merge into the first token
        (ids, sf, points), = score_inputs(pb.ScoreRequest(prompt=prompt, candidates=[cand]), bpe)
        assert ids == [bpe.bos_token_id] + bpe.encode(prompt + cand) and sf == 1 and points == ()


def test_stable_prefix_point(bpe):
    stable = "Classify the ticket as billing, outage or other. Ticket: "
    prompt = stable + "my invoice is wrong"
    S, P = bpe.encode(stable), bpe.encode(prompt)
    k = next(i for i, (a, b) in enumerate(zip(S + [-1], P)) if a != b)
    assert 0 < k <= len(S)
    (_, sf, points), = score_inputs(pb.ScoreRequest(prompt=prompt, candidates=[" billing"],
                                                    stable_prefix_len=len(stable.encode())), bpe)
    assert points == (k, sf - 1)
    # a byte length inside a multi-byte character is cut to the whole characters before it
    (_, sf, points), = score_inputs(pb.ScoreRequest(prompt="é" + prompt, candidates=[" x"], stable_prefix_len=1),
                                    bpe)
    assert points == (sf - 1,)


def test_too_long_is_refused(bpe):
    with pytest.raises(BadRequest, match="candidate 1: prompt \\+ candidate are"):
        score_inputs(pb.ScoreRequest(prompt="x", candidates=["y", "z" * 500]), bpe, max_model_len=64)
