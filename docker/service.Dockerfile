# syntax=docker/dockerfile:1
# The vSurge service image: `vsurge serve` on the model pods, `vsurge route` for the router.
# Build from the repository root (BuildKit reads docker/service.Dockerfile.dockerignore):
#   docker build -f docker/service.Dockerfile -t vsurge-service:0.1.0 .
# One image per accelerator (the chart's images.model.{tpu,gpu,cpu}; docker/build-images.sh builds all three):
#   docker build -f docker/service.Dockerfile --build-arg ACCELERATOR=cuda -t vsurge-service-cuda:0.1.0 .
#   docker build -f docker/service.Dockerfile --build-arg ACCELERATOR=cpu  -t vsurge-service-cpu:0.1.0 .
# cuda: JAX's CUDA 12 wheels (the node's driver comes from the NVIDIA container runtime); cpu: JAX alone.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the wheel is built from (see service.Dockerfile.dockerignore).
COPY pyproject.toml README.md ./
COPY service ./service
COPY operator ./operator
# ACCELERATOR picks the extras: serve (the engine) plus tpu (jax[tpu] brings libtpu from PyPI), cuda
# (jax[cuda12] brings the CUDA libraries as pip wheels, so no CUDA base image is needed) or cpu (nothing more).
ARG ACCELERATOR=tpu
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --upgrade pip \
 && /opt/venv/bin/pip install ".[serve,${ACCELERATOR}]"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="vsurge-service" \
      org.opencontainers.image.description="vSurge Stack: vsurge serve (OpenAI-compatible LLM server on JAX) and vsurge route" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG UID=10001
ARG GID=10001
# A fixed numeric user, so that the kubelet can enforce runAsNonRoot; /cache is the model cache.
RUN groupadd --system --gid "${GID}" vsurge \
 && useradd --system --uid "${UID}" --gid vsurge --home-dir /home/vsurge --create-home \
      --shell /usr/sbin/nologin vsurge \
 && mkdir -p /cache \
 && chown "${UID}:${GID}" /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VSURGE_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface
VOLUME ["/cache"]
WORKDIR /home/vsurge
USER ${UID}:${GID}
# `vsurge serve`: 11556 the OpenAI API, 11557 its metrics. `vsurge route` listens on its --port (8080 in the chart).
EXPOSE 11556 11557
ENTRYPOINT ["vsurge"]
CMD ["serve"]
