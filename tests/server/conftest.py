"""Fixtures for the server tests; the helpers live in server_harness.py."""

import pytest

from server_harness import AioServer


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
