"""Server test helpers: gRPC stubs, an in-process grpc.aio server with a scripted fake engine, and a real
`run.sh --addr` subprocess serving a tiny checkpoint (the way LocalAI starts a backend)."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ensure_stubs():
    """backend_pb2*.py are generated at install time; regenerate here if a checkout lacks them."""
    if not (os.path.exists(os.path.join(ROOT, "backend_pb2.py"))
            and os.path.exists(os.path.join(ROOT, "backend_pb2_grpc.py"))):
        from grpc_tools import protoc

        rc = protoc.main(["protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--grpc_python_out={ROOT}",
                          os.path.join(ROOT, "backend.proto")])
        assert rc == 0, "protoc failed"


_ensure_stubs()

import backend_pb2 as pb  # noqa: E402
import backend_pb2_grpc as pb_grpc  # noqa: E402

from backend.engine.request import RequestOutput  # noqa: E402


def raw_field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2), bytes as they are (invalid UTF-8 included): for requests
    built by hand, bypassing protobuf's own UTF-8 check."""
    def varint(n):
        out = b""
        while True:
            b, n = n & 0x7F, n >> 7
            out += bytes([b | (0x80 if n else 0)])
            if not n:
                return out
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ fake engine

class FakeStream:
    """Async stream of RequestOutput for a scripted token sequence; honours max_tokens, stop ids, abort."""

    def __init__(self, engine, rid, prompt, tokens, params):
        self.engine, self.request_id, self.prompt, self.params = engine, rid, prompt, params
        self.tokens = list(tokens)
        self.pos = 0
        self.done = False
        self.t0 = time.monotonic()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        await asyncio.sleep(self.engine.delay)
        if self.request_id in self.engine.aborted:
            self.done = True
            return RequestOutput(self.request_id, [], finished=True, finish_reason="abort",
                                 num_prompt_tokens=len(self.prompt), num_output_tokens=self.pos)
        if self.engine.fail_after is not None and self.pos >= self.engine.fail_after:
            self.done = True
            return RequestOutput(self.request_id, [], finished=True, finish_reason="error", error="boom (fake)",
                                 num_prompt_tokens=len(self.prompt), num_output_tokens=self.pos)
        limit = self.params.max_tokens or 10 ** 9
        new, reason = [], None
        while len(new) < self.engine.chunk:
            if self.pos >= limit:
                reason = "length"
                break
            if self.pos >= len(self.tokens):
                reason = "length"
                break
            t = self.tokens[self.pos]
            self.pos += 1
            new.append(t)
            if t in self.params.stop_token_ids and not self.params.ignore_eos:
                reason = "stop"
                break
        if reason is None and (self.pos >= limit or self.pos >= len(self.tokens)):
            reason = "length"
        self.done = reason is not None
        lps = None
        if self.params.wants_logprobs:
            lps = [{"token_id": t, "logprob": -0.5, "top": [(t, -0.5), (3, -1.5)][:self.params.top_logprobs]}
                   for t in new]
        return RequestOutput(self.request_id, new, logprobs=lps, finished=self.done, finish_reason=reason,
                             num_prompt_tokens=len(self.prompt), num_output_tokens=self.pos,
                             prompt_time_s=0.01, gen_time_s=time.monotonic() - self.t0)


class FakeEngine:
    """Stands in for LLMEngine: replies with `script(prompt_ids, params) -> token ids`."""

    def __init__(self, script, delay=0.0, chunk=1):
        self.script = script
        self.delay = delay
        self.chunk = chunk
        self.aborted = set()
        self.requests = []
        self.fail_after = None
        self.raise_on_add = None
        self.shut = False
        self.error = None  # LLMEngine.error: set when a tensor-parallel rank died

    def add_request(self, prompt_ids, params, cache_points=()):
        self.cache_points = cache_points
        if self.raise_on_add is not None:
            raise self.raise_on_add
        rid = f"fake-{len(self.requests)}"
        self.requests.append((rid, list(prompt_ids), params))
        return FakeStream(self, rid, prompt_ids, self.script(prompt_ids, params), params)

    def abort(self, request_id):
        self.aborted.add(request_id)

    def stats(self):
        return {"num_running": 0, "num_waiting": 0}

    def shutdown(self):
        self.shut = True


class AioServer:
    """A grpc.aio server running BackendServicer on its own event loop thread (loopback, free port)."""

    def __init__(self):
        from backend.server import GRPC_OPTIONS, BackendServicer, add_servicer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            server = grpc.aio.server(options=GRPC_OPTIONS)
            servicer = BackendServicer()
            add_servicer(servicer, server)  # as serve() registers it
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, servicer, port

        self.server, self.servicer, self.port = self.run(start())
        self.addr = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.addr)
        self.stub = pb_grpc.BackendStub(self.channel)

    def run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def install(self, engine, tok, max_model_len=256, **spec_kw):
        """Put a loaded (fake) model in place, as a successful LoadModel would."""
        from backend.options import LoadSpec
        from backend.server import READY, _Loaded

        spec = LoadSpec(model_dir="/fake", model_name=spec_kw.pop("model_name", "tiny"), **spec_kw)
        self.servicer._loaded = _Loaded(engine, tok, spec, max_model_len, tok.vocab_size, "cpu", "float32")
        self.servicer._state = READY

    def close(self):
        self.channel.close()
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# ------------------------------------------------------------------------------------------ real server

class BackendProcess:
    """`bash run.sh --addr 127.0.0.1:PORT` as LocalAI spawns it; Health polled until it answers OK."""

    def __init__(self, log_path, env=None):
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        e = dict(os.environ)
        e.setdefault("KIMI_VENV", os.path.dirname(os.path.dirname(sys.executable)))
        e["KIMI_STANDALONE"] = "true"
        e.update(env or {})
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(["bash", os.path.join(ROOT, "run.sh"), "--addr", self.addr], cwd=ROOT,
                                     env=e, stdout=self.log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.addr, options=[("grpc.max_receive_message_length", 50 << 20)])
        self.stub = pb_grpc.BackendStub(self.channel)
        self.startup_s = self.wait_healthy()

    def wait_healthy(self, timeout=60.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"backend exited with {self.proc.returncode}: {self.read_log()}")
            try:
                if self.stub.Health(pb.HealthMessage(), timeout=2).message == b"OK":
                    return time.monotonic() - t0
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"backend not healthy after {timeout}s: {self.read_log()}")

    def read_log(self):
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def close(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
