"""``python -m vsurge_operator``: run the operator.

    python -m vsurge_operator --all-namespaces --liveness=http://0.0.0.0:8080/healthz
    python -m vsurge_operator -n team-a -n team-b --resync-seconds 60

Credentials: the pod's service account inside a cluster, else ``$KUBECONFIG`` / ``~/.kube/config``.
Every flag can also be set through the environment (see ``config.OperatorConfig.from_env``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

import kopf

from vsurge_operator import __version__, handlers, peering
from vsurge_operator.config import OperatorConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vsurge_operator", description="vSurge InferenceModel operator"
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=[],
        help="namespace (or glob pattern) to watch; repeat for several",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch every namespace (the default when no --namespace is given)",
    )
    p.add_argument(
        "-L",
        "--liveness",
        dest="liveness_endpoint",
        default=os.environ.get("VSURGE_OPERATOR_LIVENESS"),
        help="serve kopf's health probe, e.g. http://0.0.0.0:8080/healthz",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        default=None,
        help="do not coordinate with other operator instances through KopfPeering objects",
    )
    p.add_argument("-P", "--peering", dest="peering_name", default=None, help="KopfPeering name to use")
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority (the highest live one is active); default: by seniority, see peering.py",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=None,
        help="seconds a silent peer counts as alive: how long a standby waits for a killed leader "
        f"(default {OperatorConfig().peering_lifetime_seconds})",
    )
    p.add_argument("--default-image", default=None, help="image for models whose spec.image is empty")
    p.add_argument("--resync-seconds", type=float, default=None, help="drift-repair interval per model")
    p.add_argument(
        "--retry-delay-seconds", type=float, default=None, help="delay before retrying an API error"
    )
    p.add_argument(
        "--scrape-timeout-seconds", type=float, default=None, help="timeout of one /metrics scrape"
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve the operator's Prometheus /metrics on this port"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-d", "--debug", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("--log-format", choices=[f.name.lower() for f in kopf.LogFormat], default="full")
    p.add_argument("--version", action="version", version=f"vsurge-operator {__version__}")
    return p


def config_from_args(args: argparse.Namespace, base: OperatorConfig | None = None) -> OperatorConfig:
    config = base or OperatorConfig.from_env()
    overrides = {
        "default_image": args.default_image,
        "resync_seconds": args.resync_seconds,
        "retry_delay_seconds": args.retry_delay_seconds,
        "scrape_timeout_seconds": args.scrape_timeout_seconds,
        "peering_lifetime_seconds": args.peering_lifetime,
        "metrics_port": args.metrics_port,
    }
    return replace(config, **{k: v for k, v in overrides.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kopf.configure(
        debug=args.debug,
        verbose=args.verbose,
        quiet=args.quiet,
        log_format=kopf.LogFormat[args.log_format.upper()],
    )
    config = config_from_args(args)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, config)
    kopf.run(
        registry=registry,
        namespaces=args.namespaces,
        clusterwide=not args.namespaces,
        standalone=args.standalone,
        peering_name=args.peering_name,
        priority=args.priority if args.priority is not None else peering.seniority_priority(),
        liveness_endpoint=args.liveness_endpoint,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
