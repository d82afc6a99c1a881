"""backend.proto is LocalAI's (package backend): every RPC and the field numbers/types this backend relies on."""

from google.protobuf.descriptor import FieldDescriptor as F

from server_harness import pb

T = {"string": F.TYPE_STRING, "int32": F.TYPE_INT32, "float": F.TYPE_FLOAT, "bool": F.TYPE_BOOL,
     "bytes": F.TYPE_BYTES, "double": F.TYPE_DOUBLE, "uint64": F.TYPE_UINT64, "message": F.TYPE_MESSAGE,
     "enum": F.TYPE_ENUM}

RPCS = {  # name: (request, response, server streaming)
    "Health": ("HealthMessage", "Reply", False), "Free": ("HealthMessage", "Result", False),
    "Predict": ("PredictOptions", "Reply", False), "LoadModel": ("ModelOptions", "Result", False),
    "PredictStream": ("PredictOptions", "Reply", True), "Embedding": ("PredictOptions", "EmbeddingResult", False),
    "TokenizeString": ("PredictOptions", "TokenizationResponse", False),
    "Detokenize": ("DetokenizeRequest", "DetokenizeResponse", False),
    "Status": ("HealthMessage", "StatusResponse", False), "GetMetrics": ("MetricsRequest", "MetricsResponse", False),
    "Score": ("ScoreRequest", "ScoreResponse", False), "TTSStream": ("TTSRequest", "Reply", True),
    "ModelMetadata": ("ModelOptions", "ModelMetadataResponse", False),
}
OTHER_RPCS = ["GenerateImage", "UpscaleImage", "GenerateVideo", "Generate3D", "AudioTranscription",
              "AudioTranscriptionStream", "AudioTranscriptionLive", "TTS", "SoundGeneration", "Detect",
              "SoundDetection", "Depth", "FaceVerify", "FaceAnalyze", "VoiceVerify", "VoiceAnalyze", "VoiceEmbed",
              "StoresSet", "StoresDelete", "StoresGet", "StoresFind", "Rerank", "TokenClassify", "VAD", "Diarize",
              "AudioEncode", "AudioDecode", "AudioTransform", "AudioTransformStream", "AudioToAudioStream",
              "StartFineTune", "FineTuneProgress", "StopFineTune", "ListCheckpoints", "ExportModel",
              "StartQuantization", "QuantizationProgress", "StopQuantization", "Forward"]

FIELDS = {
    "ModelOptions": {"Model": (1, "string"), "ContextSize": (2, "int32"), "Seed": (3, "int32"),
                     "Threads": (15, "int32"), "ModelFile": (21, "string"), "GPUMemoryUtilization": (50, "float"),
                     "TrustRemoteCode": (51, "bool"), "EnforceEager": (52, "bool"), "MaxModelLen": (54, "int32"),
                     "TensorParallelSize": (55, "int32"), "ModelPath": (59, "string"), "Options": (62, "string"),
                     "DType": (67, "string"), "EngineArgs": (73, "string")},
    "PredictOptions": {"Prompt": (1, "string"), "Seed": (2, "int32"), "Tokens": (4, "int32"), "TopK": (5, "int32"),
                       "Temperature": (9, "float"), "Penalty": (10, "float"), "StopPrompts": (13, "string"),
                       "IgnoreEOS": (14, "bool"), "FrequencyPenalty": (17, "float"), "PresencePenalty": (18, "float"),
                       "LogitBias": (23, "string"), "TopP": (32, "float"), "UseTokenizerTemplate": (43, "bool"),
                       "Messages": (44, "message"), "Tools": (48, "string"), "ToolChoice": (49, "string"),
                       "Logprobs": (50, "int32"), "TopLogprobs": (51, "int32"), "Metadata": (52, "message"),
                       "MinP": (53, "float"), "ModelIdentity": (54, "string")},
    "Message": {"role": (1, "string"), "content": (2, "string"), "name": (3, "string"),
                "tool_call_id": (4, "string"), "reasoning_content": (5, "string"), "tool_calls": (6, "string")},
    "Reply": {"message": (1, "bytes"), "tokens": (2, "int32"), "prompt_tokens": (3, "int32"),
              "timing_prompt_processing": (4, "double"), "timing_token_generation": (5, "double"),
              "audio": (6, "bytes"), "logprobs": (7, "bytes"), "chat_deltas": (8, "message")},
    "ChatDelta": {"content": (1, "string"), "reasoning_content": (2, "string"), "tool_calls": (3, "message")},
    "ToolCallDelta": {"index": (1, "int32"), "id": (2, "string"), "name": (3, "string"),
                      "arguments": (4, "string")},
    "Result": {"message": (1, "string"), "success": (2, "bool")},
    "TokenizationResponse": {"length": (1, "int32"), "tokens": (2, "int32")},
    "DetokenizeRequest": {"tokens": (1, "int32")}, "DetokenizeResponse": {"content": (1, "string")},
    "StatusResponse": {"state": (1, "enum"), "memory": (2, "message")},
    "MemoryUsageData": {"total": (1, "uint64"), "breakdown": (2, "message")},
    "MetricsResponse": {"slot_id": (1, "int32"), "prompt_json_for_slot": (2, "string"),
                        "tokens_per_second": (3, "float"), "tokens_generated": (4, "int32"),
                        "prompt_tokens_processed": (5, "int32")},
}


def test_package_and_service():
    assert pb.DESCRIPTOR.package == "backend"
    svc = pb.DESCRIPTOR.services_by_name["Backend"]
    assert svc.full_name == "backend.Backend"
    methods = {m.name: m for m in svc.methods}
    for name, (req, resp, stream) in RPCS.items():
        m = methods[name]
        assert (m.input_type.name, m.output_type.name, m.server_streaming) == (req, resp, stream), name
    for name in OTHER_RPCS:
        assert name in methods, name
    assert len(methods) >= len(RPCS) + len(OTHER_RPCS)


def test_field_numbers_and_types():
    for msg, fields in FIELDS.items():
        d = pb.DESCRIPTOR.message_types_by_name[msg]
        for name, (number, typ) in fields.items():
            f = d.fields_by_name[name]
            assert (f.number, f.type) == (number, T[typ]), f"{msg}.{name}"
    assert 24 not in pb.PredictOptions.DESCRIPTOR.fields_by_number  # reserved in LocalAI's proto


def test_status_enum_values():
    assert pb.StatusResponse.UNINITIALIZED == 0 and pb.StatusResponse.BUSY == 1
    assert pb.StatusResponse.READY == 2 and pb.StatusResponse.ERROR == -1


def test_wire_roundtrip_of_a_reply():
    r = pb.Reply(message="héllo".encode(), tokens=3, prompt_tokens=5, timing_prompt_processing=1.5,
                 chat_deltas=[pb.ChatDelta(content="héllo", tool_calls=[pb.ToolCallDelta(index=0, name="f")])])
    assert pb.Reply.FromString(r.SerializeToString()) == r
