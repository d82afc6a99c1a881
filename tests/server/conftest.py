"""Fixtures for the server tests; the helpers live in server_harness.py."""

import pytest

from server_harness import AioServer, BackendProcess


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from tools.tiny_tokenizer import write_tokenizer_files

    d = str(tmp_path_factory.mktemp("tiny_tok"))
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="session")
def tok(tok_dir):
    from backend.tokenizer import load_tokenizer

    return load_tokenizer(tok_dir)


@pytest.fixture
def aio():
    s = AioServer()
    yield s
    s.close()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A directory holding the tiny checkpoint tiny-kimi (official layout, seed 3, fp32), written once per session;
    tests copy it before changing anything. Modules wanting the checkpoint itself override: ckpt / "tiny-kimi"."""
    from tools.tiny_checkpoint import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("models")
    write_tiny_checkpoint(str(root / "tiny-kimi"), seed=3, dtype="float32")
    return root


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """run.sh started as LocalAI does, no model loaded (modules that need one loaded override this)."""
    p = BackendProcess(str(tmp_path_factory.mktemp("log") / "backend.log"))
    yield p
    p.close()
