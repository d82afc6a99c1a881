#!/bin/bash
# Start the kimi-linear gRPC backend. LocalAI runs `run.sh --addr 127.0.0.1:PORT` (workdir = this directory).
#   bash run.sh --addr 127.0.0.1:50051
# Environment: PYTHON_GRPC_MAX_WORKERS (default 1, LocalAI's knob), KIMI_VENV (venv to use, default ./venv),
# KIMI_LOG_LEVEL (default INFO).
set -euo pipefail

backend_dir=$(cd "$(dirname "$0")" && pwd)
export KIMI_LAUNCH_CWD="${KIMI_LAUNCH_CWD:-$PWD}"

libbackend=""
if [ -f "${backend_dir}/common/libbackend.sh" ]; then
    libbackend="${backend_dir}/common/libbackend.sh"
elif [ -f "${backend_dir}/../common/libbackend.sh" ]; then
    libbackend="${backend_dir}/../common/libbackend.sh"
fi

if [ -n "${libbackend}" ] && [ "x${KIMI_STANDALONE:-}" != "xtrue" ] && [ -z "${KIMI_VENV:-}" ]; then
    # LocalAI layout: reuse libbackend's venv activation / portable-python relocation / bundled lib/ path,
    # but start our package with -m (startBackend only knows single-file servers).
    cd "${backend_dir}"
    # shellcheck disable=SC1090
    source "${libbackend}"
    ensureVenv
    if [ "x${PORTABLE_PYTHON}" == "xtrue" ] || [ -x "$(_portable_python)" ]; then
        _makeVenvPortable --update-pyvenv-cfg
    fi
    if [ -d "${EDIR}/lib" ]; then
        export LD_LIBRARY_PATH="${EDIR}/lib:${LD_LIBRARY_PATH:-}"
    fi
    PY="${EDIR}/venv/bin/python"
else
    VENV="${KIMI_VENV:-${backend_dir}/venv}"
    PY="${VENV}/bin/python"
    if [ ! -x "${PY}" ]; then
        echo "run.sh: no Python at ${PY}; install first with 'make' (or set KIMI_VENV)" >&2
        exit 1
    fi
    export VIRTUAL_ENV="${VENV}"
    export PATH="${VENV}/bin:${PATH}"
    if [ -d "${backend_dir}/lib" ]; then
        export LD_LIBRARY_PATH="${backend_dir}/lib:${LD_LIBRARY_PATH:-}"
    fi
fi

cd "${backend_dir}"
export PYTHONPATH="${backend_dir}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
exec "${PY}" -m backend.server "$@"
