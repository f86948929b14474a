#!/usr/bin/env bash
# Builds every image the chart refers to, from the repository root:
#   images.operator         REGISTRY/vsurge-operator:TAG       (the lean core install)
#   router.image            REGISTRY/vsurge-router:TAG         (vsurge route alone: the router extra)
#   images.service          REGISTRY/vsurge-service:TAG        (vsurge serve; also images.model.tpu)
#   images.model.gpu        REGISTRY/vsurge-service-cuda:TAG
#   images.model.cpu        REGISTRY/vsurge-service-cpu:TAG
# Each installs its lock (docker/locks/*.txt, every distribution pinned with its hashes) on a base image
# pinned by digest, so two builds install the same files.
# Usage: docker/build-images.sh REGISTRY [TAG]   (TAG defaults to the chart's appVersion)
#        docker/build-images.sh --check          (offline: each lock matches pyproject.toml, each
#                                                 Dockerfile pins its base by digest and installs its lock)
#        docker/build-images.sh --lock [NAME..]  (re-resolve the locks: needs uv and the package index)
# PYTHON: the interpreter that runs docker/locks.py (needs `packaging`; default .venv/bin/python if present).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
case "${1:-}" in
  --check) exec "$python" docker/locks.py check ;;
  --lock) shift; exec "$python" docker/locks.py lock "$@" ;;
esac
registry=${1:?usage: docker/build-images.sh REGISTRY [TAG] | --check | --lock}
tag=${2:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' helm/vsurge/Chart.yaml)}
"$python" docker/locks.py check  # a stale lock would build an image pyproject.toml does not describe
docker build -f docker/operator.Dockerfile --build-arg VERSION="$tag" -t "$registry/vsurge-operator:$tag" .
docker build -f docker/router.Dockerfile --build-arg VERSION="$tag" -t "$registry/vsurge-router:$tag" .
docker build -f docker/service.Dockerfile --build-arg VERSION="$tag" --build-arg ACCELERATOR=tpu -t "$registry/vsurge-service:$tag" .
docker build -f docker/service.Dockerfile --build-arg VERSION="$tag" --build-arg ACCELERATOR=cuda -t "$registry/vsurge-service-cuda:$tag" .
docker build -f docker/service.Dockerfile --build-arg VERSION="$tag" --build-arg ACCELERATOR=cpu -t "$registry/vsurge-service-cpu:$tag" .
