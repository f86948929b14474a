# syntax=docker/dockerfile:1
# The vSurge operator image: kopf reconciling InferenceModels. The core install only (no serve extra): no JAX,
# no model libraries, no storage clients (tests/operator/test_operator_lean_install.py proves it imports).
# Build from the repository root (BuildKit reads docker/operator.Dockerfile.dockerignore):
#   docker build -f docker/operator.Dockerfile -t vsurge-operator:0.1.0 .
# The base, pinned by digest (a tag moves; a digest is one image): CPython 3.11, the Python the test suite runs
# on, so the locks resolve to the library versions it tested. Refresh: docs/development.md (Images).
ARG PYTHON_IMAGE=python:3.11.10-slim-bookworm@sha256:5148c0e4bbb64271bca1d3322360ebf4bfb7564507ae32dd639322e4952a6b16

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The locks first (a layer that changes only with them): every distribution pinned with its hashes
# (docker/locks.py; docker/build-images.sh --check verifies them against pyproject.toml).
COPY docker/locks ./docker/locks
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --require-hashes -r docker/locks/build.txt \
 && /opt/venv/bin/pip install --require-hashes -r docker/locks/operator.txt
COPY pyproject.toml README.md ./
COPY service ./service
COPY operator ./operator
# vsurge itself, nothing more: its dependencies are the lock's (a missing one fails --check, not here)
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .

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
