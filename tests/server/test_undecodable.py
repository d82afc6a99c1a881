"""Requests whose bytes are not a valid message (raw invalid UTF-8 in a string field, sent by a client that bypasses
protobuf's check): INVALID_ARGUMENT naming the field, from our deserializer wrapper (backend/server.py add_servicer),
not grpc's UNKNOWN; the server keeps serving."""

import grpc
import pytest

from server_harness import FakeEngine, pb
from server_harness import raw_field as field


PROMPT = pb.PredictOptions.DESCRIPTOR.fields_by_name["Prompt"].number
MESSAGES = pb.PredictOptions.DESCRIPTOR.fields_by_name["Messages"].number
CONTENT = pb.Message.DESCRIPTOR.fields_by_name["content"].number


def bad_prompt() -> bytes:
    """A valid PredictOptions serialization except that the Prompt bytes are b'ab\\xff\\xfe'."""
    good = pb.PredictOptions(Prompt="abcd", Tokens=3).SerializeToString()
    assert field(PROMPT, b"abcd") in good
    raw = good.replace(field(PROMPT, b"abcd"), field(PROMPT, b"ab\xff\xfe"))
    with pytest.raises(Exception, match="UTF-8"):  # what grpc's own deserializer would have failed on
        pb.PredictOptions.FromString(raw)
    return raw


def bad_message_content() -> bytes:
    ok = pb.PredictOptions(Messages=[pb.Message(role="user", content="hi")], UseTokenizerTemplate=True)
    return ok.SerializeToString() + field(MESSAGES, field(1, b"user") + field(CONTENT, b"\xc3("))


def call(channel, method, raw):
    """-> (code, details) of a call that sends `raw` as the request bytes."""
    path = f"/backend.Backend/{method}"
    try:
        if method == "PredictStream":
            list(channel.unary_stream(path, request_serializer=lambda b: b,
                                      response_deserializer=pb.Reply.FromString)(raw, timeout=30))
        else:
            channel.unary_unary(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)(
                raw, timeout=30)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("method", ["Predict", "PredictStream", "TokenizeString"])
def test_invalid_utf8_is_invalid_argument(aio, tok, method):
    eng = FakeEngine(lambda prompt, params: tok.encode("Hi there"))
    aio.install(eng, tok)
    code, details = call(aio.channel, method, bad_prompt())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "string field Prompt is not valid UTF-8" in details and "backend.PredictOptions" in details, details
    assert eng.requests == []  # refused before the engine saw anything
    code, details = call(aio.channel, method, bad_message_content())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "Messages[1].content" in details, details
    # the server keeps serving: the next valid request succeeds
    assert aio.stub.Health(pb.HealthMessage()).message == b"OK"
    req = pb.PredictOptions(Prompt="abcd")
    if method == "TokenizeString":
        assert list(aio.stub.TokenizeString(req).tokens) == tok.encode("abcd")
    elif method == "Predict":
        assert aio.stub.Predict(req).message == b"Hi there"
    else:
        assert b"".join(r.message for r in aio.stub.PredictStream(req, timeout=30)) == b"Hi there"
    assert [p for _, p, _ in eng.requests] == [tok.encode("abcd")] * (method != "TokenizeString")


def test_not_a_message_at_all(aio, tok):
    aio.install(FakeEngine(lambda prompt, params: []), tok)
    code, details = call(aio.channel, "Predict", b"\x0a\xff\xff\xff\xff\x0f")  # a length past the end
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid backend.PredictOptions" in details, details
    code, details = call(aio.channel, "LoadModel", field(1, b"\xff"))  # ModelOptions.Model
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ModelOptions: string field Model" in details, details
    assert aio.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.READY
