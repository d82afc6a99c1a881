"""LocalAI path: `run.sh` backend, LoadModel with TensorParallelSize=2 (rank 0 in the backend process, rank 1 a
follower it spawns), greedy Predict equal to the single-process backend's, then a killed follower: Status ERROR and
Predict refused with a clear message, bounded in time. torchrun path: two ranks launched together, rank 0 serving."""
import os
import subprocess
import sys
import time

import grpc
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "server"))
from server_harness import BackendProcess, free_port, pb, pb_grpc  # noqa: E402


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


@pytest.fixture(scope="module")
def want(ckpt, tmp_path_factory):
    """The single-process backend's greedy text."""
    one = BackendProcess(str(tmp_path_factory.mktemp("log") / "one.log"))
    try:
        r = one.stub.LoadModel(load_opts(ckpt), timeout=300)
        assert r.success, r.message
        return greedy(one.stub)
    finally:
        one.close()


def test_tensor_parallel_backend(ckpt, want, tmp_path):
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


def test_torchrun(ckpt, want, tmp_path):
    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "backend.server", "--addr", f"127.0.0.1:{port}"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(tmp_path / "torchrun.log", "wb") as log:
        p = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    try:
        stub = pb_grpc.BackendStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        t0 = time.monotonic()
        while True:
            try:
                stub.Health(pb.HealthMessage(), timeout=2)
                break
            except grpc.RpcError:
                assert p.poll() is None and time.monotonic() - t0 < 90, (tmp_path / "torchrun.log").read_text()
                time.sleep(0.3)
        for context in (128, 64):  # a second LoadModel: the followers rebuild their runners
            r = stub.LoadModel(load_opts(ckpt, ContextSize=context), timeout=300)
            assert r.success, r.message
            assert greedy(stub) == want
        assert (tmp_path / "torchrun.log").read_text().count("rank 1: following rank 0") == 2
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
