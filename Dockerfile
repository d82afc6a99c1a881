# syntax=docker/dockerfile:1
# kimi-linear backend image, in the shape of LocalAI's backend/Dockerfile.python: a builder stage installs the
# backend with its Makefile's default goal (`make` -> install.sh -> requirements-${profile}.txt + gRPC stubs),
# and the final stage is FROM scratch with the backend directory as the image root (run.sh at /), which is what
# `local-ai backends install ocifile://...` / the backend gallery unpack into the backends path.
#
#   docker build -t local-ai-backend:kimi-linear .                                              # cpu
#   docker build --build-arg BUILD_TYPE=cublas --build-arg CUDA_MAJOR_VERSION=12 \
#                --build-arg CUDA_MINOR_VERSION=8 -t local-ai-backend:kimi-linear-cuda12 .       # cublas12
#   docker build --build-arg BUILD_TYPE=cublas --build-arg CUDA_MAJOR_VERSION=13 \
#                --build-arg CUDA_MINOR_VERSION=0 -t local-ai-backend:kimi-linear-cuda13 .       # cublas13
#   docker build --platform linux/arm64 --build-arg BUILD_TYPE=l4t --build-arg CUDA_MAJOR_VERSION=13 \
#                --build-arg CUDA_MINOR_VERSION=0 -t local-ai-backend:kimi-linear-l4t13 .        # l4t13 (GB10)
#
# With a LocalAI checkout as the named build context `localai`
# (`docker build --build-context localai=/path/to/LocalAI ...`) its backend/python/common/ is copied in, so
# install.sh / run.sh use libbackend.sh exactly as in LocalAI's images (PORTABLE_PYTHON=true: a relocatable
# python-build-standalone interpreter inside the image, Python 3.12). Without it the scripts run standalone with
# the base image's python3 (3.12 on ubuntu:24.04). Inside LocalAI's own tree (backend/python/kimi-linear) use
# LocalAI's backend/Dockerfile.python with BACKEND=kimi-linear instead; both run the same `make`.
#
# CUDA: torch (PyPI / cu128 index) ships the CUDA runtime libraries and Triton ships ptxas, so no toolkit is
# installed; the host provides the driver. Triton builds a small C module (its CUDA driver glue) at first use with
# the system's C compiler, which LocalAI's runtime image lacks: `make` prebuilds it here, in the builder stage
# (prebuilt/, kernels/_prebuilt.py), and the kernels hand it to Triton when no compiler is found at run time.

ARG BASE_IMAGE=ubuntu:24.04

# empty unless `--build-context localai=<LocalAI checkout>` is given
FROM scratch AS localai

FROM ${BASE_IMAGE} AS builder
ARG BACKEND=kimi-linear
ARG BUILD_TYPE
ENV BUILD_TYPE=${BUILD_TYPE}
ARG CUDA_MAJOR_VERSION
ARG CUDA_MINOR_VERSION
ARG SKIP_DRIVERS=false
ENV CUDA_MAJOR_VERSION=${CUDA_MAJOR_VERSION}
ENV CUDA_MINOR_VERSION=${CUDA_MINOR_VERSION}
ENV DEBIAN_FRONTEND=noninteractive
ARG TARGETARCH
ARG UBUNTU_VERSION=2404

RUN apt-get update && \
    apt-get install -y --no-install-recommends \
        build-essential ca-certificates curl git \
        python3-pip python-is-python3 python3-dev python3-venv \
        libnuma1 libgomp1 make && \
    apt-get clean && \
    rm -rf /var/lib/apt/lists/*

# uv, as LocalAI's images (install.sh uses it when it is on PATH; USE_PIP=true forces pip)
RUN curl -LsSf https://astral.sh/uv/install.sh | UV_INSTALL_DIR=/usr/bin sh
ENV UV_HTTP_TIMEOUT=180

COPY . /${BACKEND}
RUN --mount=type=bind,from=localai,target=/localai \
    if [ -f /localai/backend/python/common/libbackend.sh ]; then \
        cp -r /localai/backend/python/common /${BACKEND}/common; \
    fi

# the Makefile's default goal installs: venv + requirements for BUILD_TYPE/CUDA_MAJOR_VERSION + gRPC stubs
RUN cd /${BACKEND} && PORTABLE_PYTHON=true make

# backend-specific packaging hook, as in LocalAI's Dockerfile.python
RUN if [ -f "/${BACKEND}/package.sh" ]; then \
        cd /${BACKEND} && bash package.sh; \
    fi

FROM scratch
ARG BACKEND=kimi-linear
COPY --from=builder /${BACKEND}/ /
