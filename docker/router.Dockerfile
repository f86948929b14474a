# syntax=docker/dockerfile:1
# The vSurge router image: `vsurge route` alone (the chart's router.image). Only what the router imports
# (pyproject's router extra: starlette, uvicorn, httpx, prometheus-client, OpenTelemetry, PyYAML, the
# Kubernetes client), none of JAX, the model libraries, the storage clients or kopf
# (tests/helm/test_router_image_install.py installs this lock the same way and starts the router).
# Build from the repository root (BuildKit reads docker/router.Dockerfile.dockerignore):
#   docker build -f docker/router.Dockerfile -t vsurge-router:0.1.0 .
# The base, pinned by digest (a tag moves; a digest is one image): CPython 3.11, the Python the test suite runs
# on, so the locks resolve to the library versions it tested. Refresh: docs/development.md (Images).
ARG PYTHON_IMAGE=python:3.11.10-slim-bookworm@sha256:5148c0e4bbb64271bca1d3322360ebf4bfb7564507ae32dd639322e4952a6b16

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The locks first: every distribution pinned with its hashes (docker/locks.py; docker/build-images.sh
# --check verifies them against pyproject.toml).
COPY docker/locks ./docker/locks
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --require-hashes -r docker/locks/build.txt \
 && /opt/venv/bin/pip install --require-hashes -r docker/locks/router.txt
COPY pyproject.toml README.md ./
COPY service ./service
COPY operator ./operator
# vsurge itself with --no-deps: the core's other dependencies (kopf, pydantic) are the operator's, not the
# router's, and stay out
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation .

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="vsurge-router" \
      org.opencontainers.image.description="vSurge Stack: vsurge route, one endpoint for every model" \
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
# `vsurge route` listens on its --port (8080 in the chart).
EXPOSE 8080
ENTRYPOINT ["vsurge"]
CMD ["route"]
