#!/bin/bash
# Install the kimi-linear backend: ./venv + requirements for the build profile + gRPC stubs.
#
#   bash install.sh                      # cpu profile (default)
#   BUILD_TYPE=cublas CUDA_MAJOR_VERSION=12 bash install.sh   # cublas12
#   BUILD_TYPE=cublas CUDA_MAJOR_VERSION=13 bash install.sh   # cublas13 (H100/H200/B200)
#   BUILD_TYPE=l4t    CUDA_MAJOR_VERSION=13 bash install.sh   # l4t13 (GB10 / DGX Spark, arm64, Python 3.12)
#
# Inside LocalAI's tree (backend/python/kimi-linear/ with ../common/libbackend.sh, or a packaged image with
# ./common/libbackend.sh) the shared library does the work: installRequirements + runProtogen.
# Standalone it does the same steps itself: venv (uv if present, else python -m venv + pip), requirements.txt,
# requirements-${BUILD_PROFILE}.txt, requirements-${BUILD_PROFILE}-after.txt, protoc, import check.
# `install.sh --test-deps` adds requirements-test.txt to the venv (test.sh does, when pytest & co. are missing).
set -euo pipefail

backend_dir=$(cd "$(dirname "$0")" && pwd)

getBuildProfileStandalone() {
    if [ "x${BUILD_TYPE:-}" == "xcublas" ] || [ "x${BUILD_TYPE:-}" == "xl4t" ]; then
        echo "${BUILD_TYPE}${CUDA_MAJOR_VERSION:-}"
    elif [ -n "${BUILD_TYPE:-}" ]; then
        echo "${BUILD_TYPE}"
    else
        echo "cpu"
    fi
}
PROFILE=$(getBuildProfileStandalone)

# GB10 / l4t13: PyPI's aarch64 CUDA 13 torch wheels are cp312 only (LocalAI's vllm/sglang pin the same).
if [ "x${PROFILE}" == "xl4t13" ]; then
    PYTHON_VERSION="3.12"
    PYTHON_PATCH="12"
    PY_STANDALONE_TAG="20251120"
fi

requireSupportedProfile() {
    case "$1" in
        cpu|cublas12|cublas13|l4t13) ;;
        *) echo "install.sh: build profile '$1' is not supported (cpu, cublas12, cublas13, l4t13)" >&2; exit 1 ;;
    esac
}
requireSupportedProfile "${PROFILE}"

# CPU torch first, so nothing can resolve torch==2.13.0 to PyPI's CUDA build. A local wheel house (pip's
# find-links) is tried first, then PyTorch's CPU index (TORCH_CPU_INDEX; empty disables it).
TORCH_CPU_INDEX="${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
installCpuTorch() {
    local pipcmd=("$@")
    if "${pipcmd[@]}" --only-binary=:all: "torch==2.13.0+cpu" 2>/dev/null; then
        return 0
    fi
    if [ -n "${TORCH_CPU_INDEX}" ]; then
        echo "install.sh: torch==2.13.0+cpu not found locally; trying ${TORCH_CPU_INDEX}"
        "${pipcmd[@]}" --only-binary=:all: --extra-index-url "${TORCH_CPU_INDEX}" "torch==2.13.0+cpu"
        return $?
    fi
    echo "install.sh: could not install torch==2.13.0+cpu (set TORCH_CPU_INDEX to a CPU wheel index)" >&2
    return 1
}

checkCpuTorch() {
    if ! "$1" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)'; then
        echo "install.sh: the cpu profile ended up with a CUDA torch; remove ./venv and re-run with TORCH_CPU_INDEX set" >&2
        exit 1
    fi
}

# GPU profiles: Triton's C driver module built now, where a compiler is (an image's builder stage), for runtime
# images without one (kernels/_prebuilt.py). Not fatal: with a compiler at run time Triton builds it itself.
prebuildTriton() {
    (cd "${backend_dir}" && "$1" -m kernels._prebuilt) || true
}

# Generate backend_pb2.py / backend_pb2_grpc.py into the repo root with the venv's grpc_tools (pinned in
# requirements.txt next to grpcio, so gencode <= protobuf runtime), then check that both import.
runProtogenStandalone() {
    local py="${backend_dir}/venv/bin/python"
    if [ ! -x "${py}" ]; then
        echo "install.sh: no venv at ${backend_dir}/venv; run 'make' first" >&2
        exit 1
    fi
    (
        cd "${backend_dir}"
        rm -f backend_pb2.py backend_pb2.pyi backend_pb2_grpc.py
        rm -rf __pycache__/backend_pb2*.pyc
        "${py}" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. backend.proto
        if ! "${py}" -c 'import backend_pb2, backend_pb2_grpc' ; then
            echo "install.sh: generated stubs do not import with ${py}" >&2
            exit 1
        fi
    )
    echo "install.sh: generated backend_pb2.py, backend_pb2_grpc.py"
}

# ---------------------------------------------------------------------------------------------- LocalAI tree
libbackend=""
if [ -f "${backend_dir}/common/libbackend.sh" ]; then
    libbackend="${backend_dir}/common/libbackend.sh"
elif [ -f "${backend_dir}/../common/libbackend.sh" ]; then
    libbackend="${backend_dir}/../common/libbackend.sh"
fi

if [ -n "${libbackend}" ] && [ "x${KIMI_STANDALONE:-}" != "xtrue" ]; then
    cd "${backend_dir}"
    # LocalAI's runProtogen compiles with -I../../ -I./, and protoc refuses two backend.proto files on those paths
    # ("Input is shadowed"): in its tree LocalAI's own proto (ours is a wire-identical copy) is compiled, as for
    # every other backend, while ours steps aside.
    if [ -f "${backend_dir}/../../backend.proto" ] && [ -f "${backend_dir}/backend.proto" ]; then
        mv "${backend_dir}/backend.proto" "${backend_dir}/.backend.proto.vendored"
        trap 'mv -f "${backend_dir}/.backend.proto.vendored" "${backend_dir}/backend.proto"' EXIT
    fi
    # libbackend's default interpreter is 3.10; the backend is developed and tested on 3.11/3.12, and 3.12.12
    # (python-build-standalone 20251120) is the portable build LocalAI already uses for its l4t13 images.
    if [ -z "${PYTHON_VERSION:-}" ]; then
        PYTHON_VERSION="3.12"
        PYTHON_PATCH="12"
        PY_STANDALONE_TAG="20251120"
    fi
    # shellcheck disable=SC1090
    source "${libbackend}"
    # libbackend says intel whenever /opt/intel exists, even with BUILD_TYPE unset
    if [ "x${BUILD_PROFILE}" == "xintel" ] && [ -z "${BUILD_TYPE:-}" ]; then
        echo "install.sh: libbackend picked 'intel' (/opt/intel exists) with no BUILD_TYPE; this backend has no" \
             "intel profile: installing the cpu profile"
        BUILD_PROFILE=cpu
    fi
    requireSupportedProfile "${BUILD_PROFILE}"
    if [ "${1:-}" == "--protogen" ]; then
        runProtogen
        exit 0
    fi
    # libbackend's installer for the steps it has no function for (its installRequirements' choice)
    LB_PIP=(uv pip install ${EXTRA_PIP_INSTALL_FLAGS:-})
    if [ "x${USE_PIP}" == "xtrue" ]; then
        LB_PIP=(pip install ${EXTRA_PIP_INSTALL_FLAGS:-})
    fi
    if [ "${1:-}" == "--test-deps" ]; then
        ensureVenv
        "${LB_PIP[@]}" --requirement "${backend_dir}/requirements-test.txt"
        exit 0
    fi
    if [ "x${BUILD_PROFILE}" == "xcpu" ]; then
        ensureVenv
        installCpuTorch "${LB_PIP[@]}"
    fi
    installRequirements
    if [ "x${BUILD_PROFILE}" == "xcpu" ]; then
        checkCpuTorch "${EDIR}/venv/bin/python"
    else
        prebuildTriton "${EDIR}/venv/bin/python"
    fi
    exit 0
fi

# ---------------------------------------------------------------------------------------------- standalone
cd "${backend_dir}"
VENV="${backend_dir}/venv"

if [ "${1:-}" == "--protogen" ]; then
    runProtogenStandalone
    exit 0
fi

pickPython() {
    # a candidate must run (pyenv shims exist for versions that are not selected) and be >= 3.10
    local want="${PYTHON_VERSION:-}" cands=()
    if [ -n "${want}" ]; then
        cands=("python${want}")
    else
        cands=(python3 python3.12 python3.11 python3.10)
    fi
    for p in "${cands[@]}"; do
        if command -v "$p" >/dev/null 2>&1 && \
           "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
            echo "$p"; return 0
        fi
    done
    echo "install.sh: no usable Python found (tried: ${cands[*]}; profile ${PROFILE} needs ${want:->= 3.10})" >&2
    return 1
}

USE_UV=false
if [ "x${USE_PIP:-}" != "xtrue" ] && command -v uv >/dev/null 2>&1; then
    USE_UV=true
fi

if [ ! -x "${VENV}/bin/python" ]; then
    PY=$(pickPython)
    echo "install.sh: creating ${VENV} with ${PY} ($(${PY} --version 2>&1)), profile ${PROFILE}"
    # a failed creation leaves no half-made venv behind (a re-run would skip creation and fail later on it)
    if [ "${USE_UV}" == "true" ]; then
        uv venv --python "$(command -v "${PY}")" "${VENV}" || { rm -rf "${VENV}"; exit 1; }
    elif ! "${PY}" -m venv "${VENV}"; then
        rm -rf "${VENV}"
        echo "install.sh: '${PY} -m venv' failed; on Debian / Ubuntu install python3-venv (or uv) first" >&2
        exit 1
    fi
fi
export VIRTUAL_ENV="${VENV}"
export PATH="${VENV}/bin:${PATH}"
unset PYTHONHOME

if [ "${USE_UV}" == "true" ]; then
    PIP=(uv pip install ${EXTRA_PIP_INSTALL_FLAGS:-})
else
    PIP=("${VENV}/bin/python" -m pip install ${EXTRA_PIP_INSTALL_FLAGS:-})
fi

if [ "${1:-}" == "--test-deps" ]; then
    echo "install.sh: installing requirements-test.txt"
    "${PIP[@]}" --requirement requirements-test.txt
    exit 0
fi

if [ "x${PROFILE}" == "xcpu" ]; then
    installCpuTorch "${PIP[@]}"
fi

for req in requirements-install.txt requirements.txt "requirements-${PROFILE}.txt" "requirements-${PROFILE}-after.txt"; do
    if [ -f "${req}" ]; then
        echo "install.sh: installing ${req}"
        "${PIP[@]}" --requirement "${req}"
    fi
done

if [ "x${PROFILE}" == "xcpu" ]; then
    checkCpuTorch "${VENV}/bin/python"
else
    prebuildTriton "${VENV}/bin/python"
fi

runProtogenStandalone
echo "install.sh: done (profile ${PROFILE}, venv ${VENV})"
