# syntax=docker/dockerfile:1
# The vSurge service image: `vsurge serve` on the model pods (the router has its own: router.Dockerfile).
# Build from the repository root (BuildKit reads docker/service.Dockerfile.dockerignore):
#   docker build -f docker/service.Dockerfile -t vsurge-service:0.1.0 .
# One image per accelerator (the chart's images.model.{tpu,gpu,cpu}; docker/build-images.sh builds all three):
#   docker build -f docker/service.Dockerfile --build-arg ACCELERATOR=cuda -t vsurge-service-cuda:0.1.0 .
#   docker build -f docker/service.Dockerfile --build-arg ACCELERATOR=cpu  -t vsurge-service-cpu:0.1.0 .
# cuda: JAX's CUDA 12 wheels (the node's driver comes from the NVIDIA container runtime); cpu: JAX alone.
# The base, pinned by digest (a tag moves; a digest is one image): CPython 3.11, the Python the test suite runs
# on, so the locks resolve to the library versions it tested. Refresh: docs/development.md (Images).
ARG PYTHON_IMAGE=python:3.11.10-slim-bookworm@sha256:5148c0e4bbb64271bca1d3322360ebf4bfb7564507ae32dd639322e4952a6b16

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# ACCELERATOR picks the lock, pyproject's extras serve (the engine) plus tpu (jax[tpu] brings libtpu from
# PyPI), cuda (jax[cuda12] brings the CUDA libraries as pip wheels, so no CUDA base image is needed) or cpu
# (nothing more): docker/locks/service-<accelerator>.txt, every distribution pinned with its hashes
# (docker/locks.py; docker/build-images.sh --check verifies them against pyproject.toml).
ARG ACCELERATOR=tpu
COPY docker/locks ./docker/locks
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --require-hashes -r docker/locks/build.txt \
 && /opt/venv/bin/pip install --require-hashes -r docker/locks/service-${ACCELERATOR}.txt
# Only what the wheel is built from (see service.Dockerfile.dockerignore); vsurge itself, nothing more.
COPY pyproject.toml README.md ./
COPY service ./service
COPY operator ./operator
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .

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
