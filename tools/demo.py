"""Demo: start the backend the way LocalAI does (`run.sh --addr`), load a model, print a streamed answer.

    python tools/demo.py [--model models/kimi-linear-tiny] [--prompt TEXT] [--tokens 48] [--temperature 0]
    make demo

The default model is the embedded tiny Kimi-Linear (models/kimi-linear-tiny, trained on English prose by
tools/train_tiny.py), so the answer is English-looking text, not a useful reply. Any Kimi-Linear checkpoint
directory works (--chat renders the prompt with its chat template, for instruction-tuned checkpoints).
"""
import argparse
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, "models", "kimi-linear-tiny")
DEFAULT_PROMPT = "The function"


def _stubs():
    if not os.path.exists(os.path.join(ROOT, "backend_pb2.py")):
        subprocess.run(["bash", os.path.join(ROOT, "install.sh"), "--protogen"], check=True)
    import backend_pb2
    import backend_pb2_grpc

    return backend_pb2, backend_pb2_grpc


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(addr, log_file):
    """run.sh --addr as LocalAI spawns it; the venv is this interpreter's (unless KIMI_VENV is set)."""
    env = dict(os.environ)
    if sys.prefix != sys.base_prefix:
        env.setdefault("KIMI_VENV", sys.prefix)
    env.setdefault("KIMI_STANDALONE", "true")
    return subprocess.Popen(["bash", os.path.join(ROOT, "run.sh"), "--addr", addr], cwd=ROOT, env=env,
                            stdout=log_file, stderr=subprocess.STDOUT)


def wait_healthy(pb, stub, proc, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the backend exited with status {proc.returncode}")
        try:
            if stub.Health(pb.HealthMessage(), timeout=2).message == b"OK":
                return time.monotonic() - t0
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the backend did not answer Health within {timeout:.0f}s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory (default: the embedded tiny model)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--repeat-penalty", type=float, default=1.3)
    ap.add_argument("--addr", default="", help="use a running backend at HOST:PORT instead of starting one")
    ap.add_argument("--log", default="", help="backend log file (default: a temporary file, shown on failure)")
    args = ap.parse_args(argv)
    pb, pb_grpc = _stubs()

    proc, log_path = None, args.log
    addr = args.addr
    if not addr:
        import tempfile

        addr = f"127.0.0.1:{_free_port()}"
        log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="kimi-demo-"), "backend.log")
        log_file = open(log_path, "wb")
        proc = start_server(addr, log_file)
    channel = grpc.insecure_channel(addr)
    stub = pb_grpc.BackendStub(channel)
    try:
        if proc is not None:
            up = wait_healthy(pb, stub, proc)
            print(f"[backend up on {addr} in {up:.1f}s; log: {log_path}]", file=sys.stderr)
        model = os.path.abspath(args.model)
        r = stub.LoadModel(pb.ModelOptions(Model=model, ContextSize=2048, Options=["dtype:float32"]), timeout=600)
        if not r.success:
            raise RuntimeError(f"LoadModel failed: {r.message}")
        print(f"[{r.message}]", file=sys.stderr)
        req = pb.PredictOptions(Tokens=args.tokens, Temperature=args.temperature, Penalty=args.repeat_penalty,
                                TopK=-1, TopP=1.0, Seed=1)
        if args.chat:
            req.UseTokenizerTemplate = True
            req.Messages.append(pb.Message(role="user", content=args.prompt))
        else:
            req.Prompt = args.prompt
            print(args.prompt, end="", flush=True)
        last = None
        for chunk in stub.PredictStream(req, timeout=600):
            if chunk.message:
                print(chunk.message.decode("utf-8", errors="replace"), end="", flush=True)
            last = chunk
        print()
        m = stub.GetMetrics(pb.MetricsRequest())
        if last is not None:
            print(f"[{last.tokens} tokens, prompt {last.prompt_tokens} tokens, prefill "
                  f"{last.timing_prompt_processing:.0f} ms, generation {last.timing_token_generation:.0f} ms; "
                  f"{m.tokens_per_second:.1f} tokens/s]", file=sys.stderr)
        return 0
    except Exception:
        if proc is not None:
            log_file.flush()
            with open(log_path, "rb") as f:
                sys.stderr.write(f.read().decode(errors="replace")[-3000:])
        raise
    finally:
        channel.close()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log_file.close()


if __name__ == "__main__":
    sys.exit(main())
