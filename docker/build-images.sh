#!/usr/bin/env bash
# Builds every image the chart refers to, from the repository root:
#   images.operator         REGISTRY/vsurge-operator:TAG       (the lean core install)
#   images.service          REGISTRY/vsurge-service:TAG        (the router; also images.model.tpu)
#   images.model.gpu        REGISTRY/vsurge-service-cuda:TAG
#   images.model.cpu        REGISTRY/vsurge-service-cpu:TAG
# Usage: docker/build-images.sh REGISTRY [TAG]   (TAG defaults to the chart's appVersion)
set -euo pipefail
cd "$(dirname "$0")/.."
registry=${1:?usage: docker/build-images.sh REGISTRY [TAG]}
tag=${2:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' helm/vsurge/Chart.yaml)}
docker build -f docker/operator.Dockerfile --build-arg VERSION="$tag" -t "$registry/vsurge-operator:$tag" .
docker build -f docker/service.Dockerfile --build-arg VERSION="$tag" --build-arg ACCELERATOR=tpu -t "$registry/vsurge-service:$tag" .
docker build -f docker/service.Dockerfile --build-arg VERSION="$tag" --build-arg ACCELERATOR=cuda -t "$registry/vsurge-service-cuda:$tag" .
docker build -f docker/service.Dockerfile --build-arg VERSION="$tag" --build-arg ACCELERATOR=cpu -t "$registry/vsurge-service-cpu:$tag" .
