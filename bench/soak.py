"""gRPC soak / load benchmark: N concurrent PredictStream clients of mixed prompt and output lengths for a fixed time
against a kimi-linear server (spawned here with run.sh on a loopback port, or an --addr), then checks that nothing
failed, every request completed, the KV pages / state slots are all free again and Status is READY. Reports
completed requests, errors, TTFT and inter-token latency p50/p99, output tokens/s, RSS (and CUDA memory) at start and
end. Exit status 1 when a check fails.

    # any checkpoint directory (real weights):
    python bench/soak.py --model-dir /models/Kimi-Linear-48B-A3B-Instruct --streams 64 --duration 300
    # H200, full size, random bf16 weights made on the device (nothing downloaded or written but config/tokenizer):
    python bench/soak.py --random-full /tmp/kimi-random --streams 32,64 --duration 120
    # a server that is already running and loaded:
    python bench/soak.py --addr 127.0.0.1:50051 --no-load --streams 64 --duration 60

--random-full DIR writes DIR/config.json (the official Kimi-Linear-48B-A3B config) and a synthetic tiktoken.model with
the official 163584 ranks + 256 specials (so vocab 163840 matches), then loads it with `random_weights:true`.
"""

import argparse
import asyncio
import base64
import itertools
import json
import os
import random
import socket
import string
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import grpc  # noqa: E402

import backend_pb2 as pb  # noqa: E402
import backend_pb2_grpc as pb_grpc  # noqa: E402

N_BASE_OFFICIAL = 163584
WORDS = ("the of and to in is was for that with as on by it at from his an were are which this be or had not but "
         "model engine token stream latency kernel memory cache batch request server tensor layer expert").split()


# ------------------------------------------------------------------------------------------ random full-size dir

def synthetic_ranks(n: int) -> list:
    """n distinct byte strings: the 256 bytes, then letter/space pairs, triples, ... (BPE-reachable or not, any
    dense rank table is a valid tiktoken model)."""
    out = [bytes([b]) for b in range(256)]
    alphabet = [c.encode() for c in string.ascii_lowercase + " "]
    size = 2
    while len(out) < n:
        for t in itertools.product(alphabet, repeat=size):
            out.append(b"".join(t))
            if len(out) == n:
                break
        size += 1
    return out


def official_config() -> dict:
    ref = "/work/shared/reference/kimi-linear.md"
    if os.path.exists(ref):
        text = open(ref, encoding="utf-8").read()
        start = text.find("```json", text.find("## 1. config.json"))
        if start >= 0:
            try:
                return json.loads(text[start + 7:text.find("```", start + 7)])
            except ValueError:
                pass
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from e2e import OFFICIAL  # noqa: E402  (same dict, kept in bench/e2e.py)

    return dict(OFFICIAL)


def write_random_full_dir(out: str, layers: int = 0) -> str:
    """config.json (official, optionally cut to `layers`) + synthetic tokenizer files; no weights."""
    from backend.tokenizer import default_chat_template
    from tools.tiny_tokenizer import ADDITIONAL_SPECIAL, tokenizer_config

    os.makedirs(out, exist_ok=True)
    cfg = official_config()
    if layers:
        lin = dict(cfg["linear_attn_config"])
        full = [i for i in lin["full_attn_layers"] if i <= layers] or [layers]
        lin.update(full_attn_layers=full, kda_layers=[i for i in range(1, layers + 1) if i not in full])
        cfg.update(num_hidden_layers=layers, linear_attn_config=lin)
    cfg.pop("auto_map", None)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tik = os.path.join(out, "tiktoken.model")
    if not os.path.exists(tik):
        with open(tik, "w", encoding="ascii") as f:
            for rank, tok in enumerate(synthetic_ranks(N_BASE_OFFICIAL)):
                f.write(f"{base64.b64encode(tok).decode('ascii')} {rank}\n")
    template = default_chat_template()
    tc = tokenizer_config(N_BASE_OFFICIAL, template)
    tc.pop("auto_map", None)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"additional_special_tokens": ADDITIONAL_SPECIAL, "bos_token": "[BOS]", "eos_token": "[EOS]",
                   "pad_token": "[PAD]", "unk_token": "[UNK]"}, f)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(template)
    return out


# ------------------------------------------------------------------------------------------ server

class Spawned:
    """`bash run.sh --addr 127.0.0.1:PORT` (as LocalAI starts a backend), or `python -m backend.server` with this
    interpreter when direct=True or this interpreter is not in a venv run.sh can use (e.g. a bare python3 + wheels
    on PYTHONPATH)."""

    def __init__(self, log_path: str, env: dict = None, direct: bool = False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.addr = f"127.0.0.1:{port}"
        e = dict(os.environ, KIMI_STANDALONE="true")
        e.setdefault("KIMI_VENV", os.path.dirname(os.path.dirname(sys.executable)))
        e.update(env or {})
        self.log = open(log_path, "wb")
        if not os.path.exists(os.path.join(e["KIMI_VENV"], "bin", "python")):
            direct = True
        cmd = ([sys.executable, "-m", "backend.server", "--addr", self.addr] if direct
               else ["bash", os.path.join(ROOT, "run.sh"), "--addr", self.addr])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=self.log, stderr=subprocess.STDOUT)

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


async def wait_healthy(stub, proc=None, timeout=120.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the backend exited with {proc.returncode}")
        try:
            if (await stub.Health(pb.HealthMessage(), timeout=2)).message == b"OK":
                return
        except grpc.RpcError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the backend is not healthy after {timeout}s")


async def metrics(stub) -> dict:
    return json.loads((await stub.GetMetrics(pb.MetricsRequest(), timeout=30)).prompt_json_for_slot or "{}")


async def memory(stub) -> dict:
    st = await stub.Status(pb.HealthMessage(), timeout=30)
    return dict(st.memory.breakdown)


def pools_full(s: dict) -> bool:
    return (s.get("free_blocks") == s.get("num_blocks") and s.get("free_slots") == s.get("num_slots")
            and s.get("running", 0) == 0 and s.get("waiting", 0) == 0 and s.get("active_requests", 0) == 0)


# ------------------------------------------------------------------------------------------ load

def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def make_prompts(stub, lens, max_prompt, per_len=8, seed=0) -> list:
    """Prompts of about `lens` tokens (measured with TokenizeString), a few variants of each length."""
    rng = random.Random(seed)
    out = []
    for n in lens:
        for v in range(per_len):
            words = []
            text = ""
            # grow by doubling, then trim by tokens (Detokenize of a prefix of the ids)
            while True:
                words += [rng.choice(WORDS) for _ in range(max(8, n))]
                text = f"[{n}/{v}] " + " ".join(words)
                ids = list((await stub.TokenizeString(pb.PredictOptions(Prompt=text), timeout=60)).tokens)
                if len(ids) >= n:
                    break
            ids = ids[:min(n, max_prompt)]
            text = (await stub.Detokenize(pb.DetokenizeRequest(tokens=ids), timeout=60)).content
            out.append(text)
    return out


RSS_SAMPLES = 8  # server RSS samples during the measured run


async def soak(addr: str, streams: int = 64, duration: float = 60.0, prompt_lens=(16, 128, 512),
               output_lens=(8, 32, 128), context: int = 0, warmup: float = 5.0, seed: int = 0,
               call_timeout: float = 600.0, drain_timeout: float = 120.0, log=print) -> dict:
    """Drive `streams` concurrent PredictStream clients for `duration` s against a loaded server -> report dict."""
    rng = random.Random(seed)
    channel = grpc.aio.insecure_channel(addr, options=[("grpc.max_receive_message_length", 50 << 20)])
    stub = pb_grpc.BackendStub(channel)
    m0 = await metrics(stub)
    context = context or m0.get("max_model_len") or 4096
    max_out = max(output_lens)
    prompts = await make_prompts(stub, [n for n in prompt_lens if n < context - max_out] or [8],
                                 context - max_out - 1, seed=seed)
    rec = dict(ttft=[], itl=[], tpot=[], tokens=0, started=0, completed=0, errors=[], chunks=0)

    async def one(prompt, n_out):
        rec["started"] += 1
        req = pb.PredictOptions(Prompt=prompt, Tokens=n_out, IgnoreEOS=True, Temperature=0.8, TopP=0.95,
                                Seed=rng.randint(1, 2 ** 31 - 1))
        t0 = time.perf_counter()
        first = last = None
        try:
            async for r in stub.PredictStream(req, timeout=call_timeout):
                now = time.perf_counter()
                if r.message:
                    if first is None:
                        first = now
                        rec["ttft"].append(now - t0)
                    else:
                        rec["itl"].append(now - last)
                    last = now
                    rec["chunks"] += 1
                if r.tokens:
                    rec["tokens"] += r.tokens
                    if first is not None and r.tokens > 1:
                        rec["tpot"].append((last - first) / (r.tokens - 1))
            rec["completed"] += 1
        except grpc.RpcError as e:
            rec["errors"].append(f"{e.code().name}: {e.details()}")

    async def worker(stop_at):
        while time.monotonic() < stop_at:
            await one(rng.choice(prompts), rng.choice(output_lens))

    if warmup > 0:  # compile/allocator warm-up, not measured
        t = time.monotonic() + warmup
        await asyncio.gather(*(worker(t) for _ in range(streams)))
        rec.update(ttft=[], itl=[], tpot=[], tokens=0, started=0, completed=0, chunks=0)
        for _ in range(100):
            if pools_full(await metrics(stub)):
                break
            await asyncio.sleep(0.1)
    mem0 = await memory(stub)
    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(worker(t0 + duration)) for _ in range(streams)]
    rss = [(0.0, mem0.get("rss", 0), 0)]  # (s since start, server RSS bytes, requests completed): leak vs plateau

    async def sample_rss():
        while True:
            await asyncio.sleep(duration / RSS_SAMPLES)
            m = await memory(stub)
            rss.append((time.monotonic() - t0, m.get("rss", 0), rec["completed"]))

    sampler = asyncio.ensure_future(sample_rss())
    done, pending = await asyncio.wait(tasks, timeout=duration + drain_timeout)
    sampler.cancel()
    for p in pending:
        p.cancel()
    wall = time.monotonic() - t0
    s = {}
    for _ in range(100):  # pools back to full once the last request is out
        s = await metrics(stub)
        if pools_full(s):
            break
        await asyncio.sleep(0.1)
    mem1 = await memory(stub)
    state = (await stub.Status(pb.HealthMessage(), timeout=30)).state
    await channel.close()
    rep = dict(
        streams=streams, duration_s=round(wall, 1), started=rec["started"], completed=rec["completed"],
        errors=len(rec["errors"]), error_samples=rec["errors"][:5], stuck=len(pending),
        output_tokens=rec["tokens"], output_tok_per_s=round(rec["tokens"] / wall, 1),
        ttft_p50_ms=round(1e3 * pct(rec["ttft"], 50), 1), ttft_p99_ms=round(1e3 * pct(rec["ttft"], 99), 1),
        itl_p50_ms=round(1e3 * pct(rec["itl"], 50), 2), itl_p99_ms=round(1e3 * pct(rec["itl"], 99), 2),
        tpot_p50_ms=round(1e3 * pct(rec["tpot"], 50), 2), tpot_p99_ms=round(1e3 * pct(rec["tpot"], 99), 2),
        prompt_lens=list(prompt_lens), output_lens=list(output_lens),
        rss_start_mb=round(mem0.get("rss", 0) / 2 ** 20, 1), rss_end_mb=round(mem1.get("rss", 0) / 2 ** 20, 1),
        rss_timeline=[(round(t, 1), round(b / 2 ** 20, 1), n) for t, b, n in rss + [(wall, mem1.get("rss", 0),
                                                                                      rec["completed"])]],
        pools_full=pools_full(s), status_ready=state == pb.StatusResponse.READY, pool_stats={
            k: s.get(k) for k in ("free_blocks", "num_blocks", "free_slots", "num_slots", "preemptions")},
    )
    if "cuda_allocated" in mem0:
        rep.update(cuda_allocated_start_mb=round(mem0["cuda_allocated"] / 2 ** 20, 1),
                   cuda_allocated_end_mb=round(mem1.get("cuda_allocated", 0) / 2 ** 20, 1),
                   cuda_reserved_end_mb=round(mem1.get("cuda_reserved", 0) / 2 ** 20, 1))
    # growth over the second half of the run: a leak keeps growing with requests served, a warm-up plateau does not
    tl = rep["rss_timeline"]
    mid = min(tl, key=lambda x: abs(x[0] - wall / 2))
    rep.update(rss_mid_mb=mid[1], rss_growth_2nd_half_mb=round(tl[-1][1] - mid[1], 1),
               requests_2nd_half=tl[-1][2] - mid[2])
    rep["ok"] = (rep["errors"] == 0 and rep["stuck"] == 0 and rep["completed"] == rep["started"]
                 and rep["pools_full"] and rep["status_ready"])
    return rep


def print_report(rep: dict, out=print):
    out(f"soak: {rep['streams']} streams, {rep['duration_s']} s: {rep['completed']}/{rep['started']} requests "
        f"completed, {rep['errors']} errors, {rep['stuck']} stuck; {rep['output_tokens']} output tokens "
        f"({rep['output_tok_per_s']} tok/s)")
    out(f"  TTFT p50 {rep['ttft_p50_ms']} ms  p99 {rep['ttft_p99_ms']} ms | inter-token (stream gaps) p50 "
        f"{rep['itl_p50_ms']} ms  p99 {rep['itl_p99_ms']} ms | per-request decode time/token p50 "
        f"{rep['tpot_p50_ms']} ms  p99 {rep['tpot_p99_ms']} ms")
    mem = (f"  RSS {rep['rss_start_mb']} -> {rep['rss_mid_mb']} (mid-run) -> {rep['rss_end_mb']} MB "
           f"({rep['rss_growth_2nd_half_mb']:+.1f} MB over the second half, {rep['requests_2nd_half']} requests)")
    if "cuda_allocated_start_mb" in rep:
        mem += (f"; CUDA allocated {rep['cuda_allocated_start_mb']} -> {rep['cuda_allocated_end_mb']} MB "
                f"(reserved {rep['cuda_reserved_end_mb']} MB)")
    out(mem + f"; pools full: {rep['pools_full']} {rep['pool_stats']}; Status READY: {rep['status_ready']}")
    for e in rep["error_samples"]:
        out(f"  error: {e}")
    out(f"| {rep['streams']} streams | {rep['completed']} req | {rep['errors']} err | TTFT p50/p99 "
        f"{rep['ttft_p50_ms']}/{rep['ttft_p99_ms']} ms | ITL p50/p99 {rep['itl_p50_ms']}/{rep['itl_p99_ms']} ms | "
        f"{rep['output_tok_per_s']} tok/s |")
    out("RESULT: " + ("PASS" if rep["ok"] else "FAIL"))


def _ints(s):
    return tuple(int(x) for x in s.split(",") if x)


async def amain(args) -> dict:
    spawned = None
    addr = args.addr
    if not addr:
        spawned = Spawned(args.log, direct=args.direct)
        addr = spawned.addr
        print(f"spawned run.sh on {addr} (log {args.log})")
    try:
        channel = grpc.aio.insecure_channel(addr)
        stub = pb_grpc.BackendStub(channel)
        await wait_healthy(stub, spawned.proc if spawned else None)
        if not args.no_load:
            options = list(args.option)
            model = args.model_dir
            if args.random_full:
                model = write_random_full_dir(args.random_full, args.layers)
                options.append("random_weights:true")
            t = time.monotonic()
            r = await stub.LoadModel(pb.ModelOptions(Model=os.path.abspath(model), ContextSize=args.context,
                                                     Options=options), timeout=3600)
            print(f"LoadModel ({time.monotonic() - t:.0f} s): {r.message}")
            if not r.success:
                raise SystemExit(1)
        await channel.close()
        reps = []
        for streams in _ints(args.streams):  # phases on the same loaded server
            reps.append(await soak(addr, streams, args.duration, _ints(args.prompt_lens), _ints(args.output_lens),
                                   warmup=args.warmup, seed=args.seed))
            print_report(reps[-1])
    finally:
        if spawned is not None:
            spawned.close()
    return reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="checkpoint directory to load (spawns run.sh unless --addr)")
    src.add_argument("--random-full", metavar="DIR", help="write the official config + a synthetic tokenizer to "
                     "DIR and load it with random bf16 weights made on the device")
    ap.add_argument("--addr", help="HOST:PORT of a running server (default: spawn run.sh on a free loopback port)")
    ap.add_argument("--no-load", action="store_true", help="the server at --addr is already loaded")
    ap.add_argument("--direct", action="store_true", help="spawn `python -m backend.server` with this interpreter "
                    "instead of run.sh (automatic when this interpreter is not in a venv)")
    ap.add_argument("--layers", type=int, default=0, help="--random-full: first N layers only (0 = all 27)")
    ap.add_argument("--streams", default="64", help="concurrent PredictStream clients; a list (32,64) runs one "
                    "phase per value on the same server")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (after --warmup)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of unmeasured load first")
    ap.add_argument("--prompt-lens", default="32,256,1024,4096", help="prompt lengths in tokens (mixed)")
    ap.add_argument("--output-lens", default="16,64,256", help="output lengths in tokens (mixed, IgnoreEOS)")
    ap.add_argument("--context", type=int, default=8192, help="ContextSize for LoadModel")
    ap.add_argument("--option", action="append", default=[], help="LoadModel option key:value (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="/tmp/kimi-soak-server.log", help="log of the spawned server")
    ap.add_argument("--json", help="also write the report as JSON here")
    args = ap.parse_args(argv)
    if not (args.addr or args.model_dir or args.random_full):
        ap.error("give --model-dir, --random-full or --addr")
    if not args.option:
        args.option = [f"max_num_seqs:{max(_ints(args.streams))}"]
    reps = asyncio.run(amain(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reps, f, indent=2)
    sys.exit(0 if all(r["ok"] for r in reps) else 1)


if __name__ == "__main__":
    main()
