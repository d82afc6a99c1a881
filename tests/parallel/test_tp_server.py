"""LocalAI path: `run.sh` backend, LoadModel with TensorParallelSize=2 (rank 0 in the backend process, rank 1 a
follower it spawns), greedy Predict equal to the single-process backend's, then a killed follower: Status ERROR and
Predict refused with a clear message, bounded in time."""
import os
import sys
import time

import grpc
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
from server_harness import BackendProcess, pb  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tools.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("models")
    write_tiny_checkpoint(str(root / "tiny-kimi"), seed=3, dtype="float32", layers="KMK")
    return root


def load_opts(ckpt, **kw):
    o = dict(Model="tiny-kimi", ModelPath=str(ckpt), ContextSize=128, Options=["max_num_seqs:4", "dtype:float32"])
    o.update(kw)
    return pb.ModelOptions(**o)


def followers_of(pid: int) -> list:
    """pids of parallel_worker processes descending from `pid`."""
    parents, cmd = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd[int(d)] = f.read()
            except OSError:
                pass
    out = []
    for p, c in cmd.items():
        if b"backend.model.parallel_worker" not in c:
            continue
        q = p
        while q in parents and q > 1:
            q = parents[q]
            if q == pid:
                out.append(p)
                break
    return out


def greedy(stub):
    return stub.Predict(pb.PredictOptions(Prompt="hello world", Tokens=12, Temperature=0, IgnoreEOS=True),
                        timeout=120).message


def test_tensor_parallel_backend(ckpt, tmp_path):
    one = BackendProcess(str(tmp_path / "one.log"))
    try:
        r = one.stub.LoadModel(load_opts(ckpt), timeout=300)
        assert r.success, r.message
        want = greedy(one.stub)
    finally:
        one.close()
    two = BackendProcess(str(tmp_path / "two.log"))
    try:
        r = two.stub.LoadModel(load_opts(ckpt, TensorParallelSize=2), timeout=300)
        assert r.success, r.message
        assert greedy(two.stub) == want
        assert two.stub.Status(pb.HealthMessage()).state == pb.StatusResponse.READY
        pids = followers_of(two.proc.pid)
        assert len(pids) == 1, pids
        os.kill(pids[0], 9)
        t0 = time.monotonic()
        while two.stub.Status(pb.HealthMessage()).state != pb.StatusResponse.ERROR:
            assert time.monotonic() - t0 < 15, "Status did not report ERROR"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:
            greedy(two.stub)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "tensor-parallel rank 1" in e.value.details() and "LoadModel" in e.value.details()
        # a new LoadModel brings the model back
        r = two.stub.LoadModel(load_opts(ckpt, TensorParallelSize=2), timeout=300)
        assert r.success, r.message
        assert greedy(two.stub) == want
    finally:
        two.close()
