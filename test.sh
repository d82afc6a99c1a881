#!/bin/bash
# Run the test suite (pytest prints its summary). Extra arguments go to pytest:
#   bash test.sh                 # everything under tests/
#   bash test.sh tests/server -x # one directory
# Without a CUDA device the Triton kernels run through the interpreter (TRITON_INTERPRET=1).
set -euo pipefail

backend_dir=$(cd "$(dirname "$0")" && pwd)
cd "${backend_dir}"

libbackend=""
if [ -f "${backend_dir}/common/libbackend.sh" ]; then
    libbackend="${backend_dir}/common/libbackend.sh"
elif [ -f "${backend_dir}/../common/libbackend.sh" ]; then
    libbackend="${backend_dir}/../common/libbackend.sh"
fi

if [ -n "${libbackend}" ] && [ "x${KIMI_STANDALONE:-}" != "xtrue" ] && [ -z "${KIMI_VENV:-}" ]; then
    # shellcheck disable=SC1090
    source "${libbackend}"
    ensureVenv
    PY="${EDIR}/venv/bin/python"
else
    VENV="${KIMI_VENV:-${backend_dir}/venv}"
    PY="${VENV}/bin/python"
    if [ ! -x "${PY}" ]; then
        echo "test.sh: no Python at ${PY}; install first with 'make'" >&2
        exit 1
    fi
    export VIRTUAL_ENV="${VENV}"
    export PATH="${VENV}/bin:${PATH}"
fi

# the test-only packages (requirements-test.txt) are not part of the install (`make`): added here on first use
if ! "${PY}" -c 'import pytest, xdist, hypothesis, yaml, pyflakes' 2>/dev/null; then
    echo "test.sh: installing the test requirements (requirements-test.txt)"
    bash "${backend_dir}/install.sh" --test-deps
fi

if [ ! -f backend_pb2.py ] || [ ! -f backend_pb2_grpc.py ]; then
    echo "test.sh: gRPC stubs missing; generating them"
    bash "${backend_dir}/install.sh" --protogen
fi

if [ -z "${TRITON_INTERPRET:-}" ]; then
    if ! "${PY}" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        export TRITON_INTERPRET=1
        echo "test.sh: no CUDA device; TRITON_INTERPRET=1"
    fi
fi

if [ "$#" -eq 0 ]; then
    set -- tests
    # the whole suite on a CPU box: one pytest worker per core (pytest-xdist, up to 4), each test file kept in one
    # worker (module fixtures build tiny checkpoints once); KIMI_TEST_JOBS=0 runs in this process
    jobs="${KIMI_TEST_JOBS:-$(nproc 2>/dev/null || echo 1)}"
    [ "${jobs}" -gt 4 ] && jobs=4
    if [ "${jobs}" -ge 2 ] && [ "${TRITON_INTERPRET:-}" = "1" ] && "${PY}" -c 'import xdist' 2>/dev/null; then
        set -- -n "${jobs}" --dist loadfile tests
    fi
fi
exec "${PY}" -m pytest "$@"
