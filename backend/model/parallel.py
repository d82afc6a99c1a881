"""Tensor parallelism over torch.distributed: the rank's shard, the collectives the model uses, the per-step broadcast
of the runner's inputs, follower launch, and rank-failure detection.

World size W. Rank r holds KDA and MLA heads [r*H/W, (r+1)*H/W) (q/k/v/f_b/g_b/b/q/kv_b projections sharded by head,
o_proj sharded by input columns), 1/W of every dense MLP's intermediate dim (gate/up by rows, down by columns), the
experts [r*E/W, (r+1)*E/W) (expert parallel, router replicated) and vocab rows [r*V/W, (r+1)*V/W) of the embedding and
lm_head. Each decoder layer all-reduces its mixer output and its FFN output (the MoE's routed and shared partial sums
in one all-reduce); the embedding all-reduces, the logits are all-gathered.

Rank 0 runs the scheduler and the sampler; ranks > 0 run `ModelRunner.follow()`: each step rank 0 broadcasts one
packed int64 message (header + the batch's ints; a second broadcast only when a step outgrows FIRST ints), the
followers rebuild the same ForwardBatch (or graph inputs) and run the same forward. While idle, rank 0 broadcasts a
PING every PING_S so that no follower's collective runs into the timeout.

Control plane: a TCPStore (rank 0 hosts it, or torchrun's). Followers wait there for the load spec (model dir +
EngineConfig), beat `hb/<rank>` every HEARTBEAT_S; rank 0 watches its child processes and the beats, and reports a
follower that exits or goes silent for LIVENESS_S through `Group.on_failure` (the engine then fails every request).
"""
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEAT_S = 1.0
LIVENESS_S = float(os.environ.get("KIMI_TP_LIVENESS_S", "15"))
PING_S = 5.0
TIMEOUT_S = float(os.environ.get("KIMI_TP_TIMEOUT_S", "300"))  # collectives (gloo / NCCL watchdog)
# message kinds; header = [kind, payload length, meta...]
STOP, PING, EAGER, REPLAY, COPY = 0, 1, 2, 3, 4  # COPY: prefix-cache state slot / page copies (engine/runner.py)
HEADER = 10  # kind, payload length, up to 8 meta ints
FIRST = 4096  # int64s of a step's first broadcast (header + payload); larger steps send the rest in a second one


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot continue."""


@dataclass(frozen=True, slots=True)
class TP:
    rank: int = 0
    world: int = 1

    def part(self, n: int) -> slice:
        """This rank's contiguous 1/W of range(n)."""
        k = n // self.world
        return slice(self.rank * k, (self.rank + 1) * k)


def folds_shared_expert(cfg, tp: TP) -> bool:
    """Whether KimiMoE stacks its shared expert as expert E of w13 / w2 (one fused_moe call, no separate dense MLP):
    unsharded (W = 1) and exactly one shared expert, which then has a routed expert's shape."""
    return tp.world == 1 and cfg.num_shared_experts == 1


def check_divisible(cfg, world: int):
    """Every sharded dimension must split evenly over `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    dims = {"KDA heads (linear_attn_config.num_heads)": cfg.kda_num_heads,
            "MLA heads (num_attention_heads)": cfg.num_attention_heads, "experts (num_experts)": cfg.num_experts,
            "vocab_size": cfg.vocab_size, "intermediate_size": cfg.intermediate_size,
            "shared expert dim (moe_intermediate_size * num_shared_experts)":
                cfg.moe_intermediate_size * cfg.num_shared_experts}
    bad = [f"{name} = {n}" for name, n in dims.items() if n % world]
    if bad:
        raise ValueError(f"tensor_parallel_size {world} must divide " + ", ".join(bad) +
                         ": pick a tensor_parallel_size that divides the number of heads and experts")


def all_reduce(x: torch.Tensor, tp: TP) -> torch.Tensor:
    if tp.world > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor, tp: TP) -> torch.Tensor:
    """[M, n] per rank -> [M, W*n], rank-major along the last dim."""
    parts = [torch.empty_like(x) for _ in range(tp.world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=TIMEOUT_S)


def _init_group(store, rank: int, world: int, device: torch.device):
    # NCCL: a timed-out collective aborts the communicator and raises instead of killing the serving process
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=world, timeout=_timeout())


def local_device(device: str, local_rank: int) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda":
        d = torch.device("cuda", local_rank)
        torch.cuda.set_device(d)
    return d


class Group:
    """This process's place in the tensor-parallel world; rank 0's also launches and watches the followers."""

    def __init__(self, tp: TP, local_rank: int, raw_store, owned: bool, procs=()):
        """raw_store: the store the process group is (or will be) built on; ours lives under the prefix kimi/.
        owned: the group was created at load time for this model (not by torchrun), and ends with it."""
        self.tp, self.local_rank, self.raw_store, self.owned = tp, local_rank, raw_store, owned
        self.store = dist.PrefixStore("kimi/", raw_store)
        self.procs = list(procs)  # [(rank, Popen)] followers this process started
        self.device = torch.device("cpu")
        self.error = None
        self.on_failure = None  # rank 0: called once with a message when a follower dies
        self.ping_s = PING_S
        self._closed = threading.Event()
        self._buf = None

    @property
    def rank(self) -> int:
        return self.tp.rank

    def bind(self, device: torch.device):
        self.device = device
        self._buf = torch.empty(FIRST, dtype=torch.int64, device=device)

    # ---- rank 0
    def send(self, kind: int, meta=(), ints=()) -> torch.Tensor:
        """Broadcast one step's message -> the payload as an int64 tensor on the device (the same on every rank)."""
        if self.error is not None:
            # a follower is known dead: a collective could only wait for its timeout
            raise RankFailure(self.error)
        n = len(ints)
        assert len(meta) <= HEADER - 2, "meta does not fit the header"
        head = [kind, n, *meta] + [0] * (HEADER - 2 - len(meta))
        msg = torch.tensor(head + list(ints[:FIRST - HEADER]), dtype=torch.int64)
        self._buf[:msg.numel()].copy_(msg)
        try:
            dist.broadcast(self._buf, 0)
            if n <= FIRST - HEADER:
                return self._buf[HEADER:HEADER + n]
            rest = torch.tensor(list(ints[FIRST - HEADER:]), dtype=torch.int64).to(self.device)
            dist.broadcast(rest, 0)
        except Exception as e:  # noqa: BLE001 - any collective error is fatal here
            raise self.fail(f"tensor-parallel broadcast failed: {e}") from e
        return torch.cat([self._buf[HEADER:], rest])

    def fail(self, msg: str) -> RankFailure:
        if self.error is None:
            self.error = msg
            log.error("%s", msg)
            if self.on_failure is not None:
                self.on_failure(msg)
        return RankFailure(self.error)

    def watch(self):
        threading.Thread(target=self._watch, name="kimi-tp-watch", daemon=True).start()

    def _watch(self):
        beats = {}
        while not self._closed.wait(HEARTBEAT_S) and self.error is None:
            for rank, p in self.procs:
                if p.poll() is not None:
                    self.fail(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.returncode}")
            now = time.monotonic()
            for rank in range(1, self.tp.world):
                try:
                    v = self.store.add(f"hb/{rank}", 0)
                except Exception as e:  # noqa: BLE001
                    self.fail(f"tensor-parallel control store failed: {e}")
                    break
                # silence counts from the first beat on (before it, joining the world is bounded by its timeout)
                if v == 0:
                    continue
                if beats.get(rank, (None,))[0] != v:
                    beats[rank] = (v, now)
                elif now - beats[rank][1] > LIVENESS_S:
                    self.fail(f"tensor-parallel rank {rank} sent no heartbeat for {LIVENESS_S:.0f} s")

    def close(self):
        """Rank 0: stop the followers' step loop, end the followers this process started, leave the world."""
        self._closed.set()
        if self.error is None:
            try:
                self.send(STOP)
            except RankFailure:
                pass
        if not self.owned:
            return
        try:
            release(self)
        except Exception:  # noqa: BLE001 - followers also exit when the store goes away
            pass
        deadline = time.monotonic() + 30
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        dist.destroy_process_group()

    # ---- followers
    def recv(self) -> tuple:
        """-> (kind, meta list, payload int64 tensor on the device)."""
        dist.broadcast(self._buf, 0)
        head = self._buf[:HEADER].tolist()
        kind, n, meta = head[0], head[1], head[2:]
        if n <= FIRST - HEADER:
            return kind, meta, self._buf[HEADER:HEADER + n]
        rest = torch.empty(n - (FIRST - HEADER), dtype=torch.int64, device=self.device)
        dist.broadcast(rest, 0)
        return kind, meta, torch.cat([self._buf[HEADER:], rest])

    def beat(self):
        """Follower: heartbeat thread; exits the process when rank 0's store is gone."""
        def run():
            while True:
                try:
                    self.store.add(f"hb/{self.rank}", 1)
                except Exception:  # noqa: BLE001
                    log.error("rank %d: lost rank 0's control store; exiting", self.rank)
                    os._exit(3)
                time.sleep(HEARTBEAT_S)

        threading.Thread(target=run, name="kimi-tp-beat", daemon=True).start()

    def next_spec(self, gen: int):
        """Follower: block until rank 0 publishes load spec number `gen` -> dict."""
        key = f"spec/{gen}"
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=30))
                return json.loads(self.store.get(key))
            except dist.DistStoreError:
                continue


# ------------------------------------------------------------------------------------------------ launch
def launched() -> bool:
    """Whether this process is part of a torchrun-style world created before any model was loaded."""
    return dist.is_initialized() and dist.get_world_size() > 1


def init_from_env() -> Group:
    """torchrun: join the world from RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dist.init_process_group(_backend(device), init_method="env://", rank=rank, world_size=world, timeout=_timeout())
    global _ENV_GROUP
    _ENV_GROUP = Group(TP(rank, world), local_rank, dist.distributed_c10d._get_default_store(), owned=False)
    return _ENV_GROUP


_ENV_GROUP = None  # torchrun: the world joined at startup (rank 0 reuses it for every LoadModel)


def release(g: Group):
    """torchrun rank 0 at exit: the followers waiting for the next load spec exit."""
    g.store.set(f"spec/{g.store.add('gen', 0) + 1}", json.dumps({"exit": True}))


def start(model_dir: str, cfg) -> Group:
    """Rank 0 at load time: join the existing world (torchrun) or create one and start the local followers; then
    publish the load spec that every follower builds its runner from."""
    from dataclasses import asdict

    if launched():
        if _ENV_GROUP is None:
            raise RuntimeError("torch.distributed is initialized but not by backend.model.parallel.init_from_env")
        g = _ENV_GROUP
        if cfg.tp_size not in (1, g.tp.world):
            raise ValueError(f"tensor_parallel_size {cfg.tp_size} differs from the launched world size {g.tp.world}")
        g = Group(g.tp, g.local_rank, g.raw_store, owned=False)
    else:
        world, nnodes = cfg.tp_size, cfg.nnodes
        if world % nnodes:
            raise ValueError(f"tensor_parallel_size {world} must be a multiple of nnodes {nnodes}")
        if cfg.node_rank != 0:
            raise ValueError("the gRPC server runs on node 0 (node_rank 0); start the other nodes with "
                             "python -m backend.model.parallel_worker --node-rank N ...")
        device = torch.device(cfg.device)
        if device.type == "cuda" and torch.cuda.device_count() < world // nnodes:
            raise ValueError(f"tensor_parallel_size {world} over {nnodes} node(s) needs {world // nnodes} GPUs per "
                             f"node; this node has {torch.cuda.device_count()}")
        port = cfg.master_port or free_port()
        addr = cfg.master_addr if nnodes > 1 else "127.0.0.1"
        store = dist.TCPStore(addr, port, world, is_master=True, timeout=_timeout(), wait_for_workers=False)
        procs = [(r, spawn_follower(r, r, world, addr, port)) for r in range(1, world // nnodes)]
        g = Group(TP(0, world), 0, store, owned=True, procs=procs)
    # the followers join the process group once they have the spec
    gen = g.store.add("gen", 1)
    g.store.set(f"spec/{gen}", json.dumps({"model_dir": model_dir, "engine": asdict(cfg)}))
    g.watch()
    if g.owned:
        try:
            _init_group(g.raw_store, 0, g.tp.world, local_device(cfg.device, 0))
        except Exception:
            for _, p in g.procs:
                p.kill()
            raise
    return g


def spawn_follower(rank: int, local_rank: int, world: int, addr: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "backend.model.parallel_worker", "--rank", str(rank), "--local-rank",
           str(local_rank), "--world-size", str(world), "--master-addr", addr, "--master-port", str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def join(rank: int, local_rank: int, world: int, addr: str, port: int) -> Group:
    """Follower started by rank 0 or by a node launcher: connect to rank 0's store (waits for it)."""
    store = dist.TCPStore(addr, port, world, is_master=False, timeout=_timeout())
    return Group(TP(rank, world), local_rank, store, owned=True)


def follow(g: Group, init_group: bool):
    """Follower main loop: for each load spec rank 0 publishes, build the runner and mirror rank 0's steps."""
    from backend.engine.engine import EngineConfig
    from backend.engine.runner import ModelRunner

    g.beat()
    gen = 0
    while True:
        gen += 1
        spec = g.next_spec(gen)
        if spec.get("exit"):
            break
        cfg = EngineConfig(**spec["engine"])
        device = local_device(cfg.device, g.local_rank)
        if init_group:
            _init_group(g.raw_store, g.rank, g.tp.world, device)
            init_group = False
        runner = ModelRunner(spec["model_dir"], cfg, group=g)
        log.info("rank %d: following rank 0 (%s)", g.rank, device)
        runner.follow()
        del runner
        if g.owned:
            break
    if dist.is_initialized():
        dist.destroy_process_group()
