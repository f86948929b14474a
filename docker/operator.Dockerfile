# syntax=docker/dockerfile:1
# The vSurge operator image: kopf reconciling InferenceModels. The core install only (no serve extra): no JAX,
# no model libraries, no storage clients (tests/operator/test_operator_lean_install.py proves it imports).
# Build from the repository root (BuildKit reads docker/operator.Dockerfile.dockerignore):
#   docker build -f docker/operator.Dockerfile -t vsurge-operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY operator ./operator
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --upgrade pip \
 && /opt/venv/bin/pip install .

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="vsurge-operator" \
      org.opencontainers.image.description="vSurge Stack: the InferenceModel operator (kopf)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG UID=10001
ARG GID=10001
RUN groupadd --system --gid "${GID}" vsurge \
 && useradd --system --uid "${UID}" --gid vsurge --home-dir /home/vsurge --create-home \
      --shell /usr/sbin/nologin vsurge
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/vsurge
USER ${UID}:${GID}
# kopf's health endpoint (--liveness=http://0.0.0.0:8080/healthz, set by the Helm chart).
EXPOSE 8080
ENTRYPOINT ["python", "-m", "vsurge_operator"]
