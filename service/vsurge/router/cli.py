"""`vsurge route`: the command line of the router.

`vsurge.cli` imports this module and registers its `route` subcommand (HELP, add_route_arguments,
run_route); the router never imports the cli, so the two do not form a circle. It imports nothing heavy,
so `vsurge --help` stays instant. Starlette,
httpx, uvicorn and the kubernetes client load only when the router runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import RouteConfigError, RouterConfig, add_arguments, config_from_args

HELP = "run the OpenAI router in front of every model (Kubernetes or a static file)"


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vsurge route` (each also read from a VSURGE_ROUTER_* variable)."""
    add_arguments(parser)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="[vsurge-router] %(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The kubernetes client logs every request at DEBUG and urllib3 retries at WARNING: too chatty.
    logging.getLogger("kubernetes").setLevel(max(logging.INFO, getattr(logging, level.upper())))
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _describe(cfg: RouterConfig) -> str:
    parts = []
    if cfg.static_config:
        parts.append(f"static config {cfg.static_config}")
    if cfg.use_kubernetes:
        where = ", ".join(cfg.namespaces) if cfg.namespaces else "all namespaces"
        parts.append(f"InferenceModels in {where}")
    return " + ".join(parts)


def run_route(args: argparse.Namespace) -> int:
    """Run the router until SIGTERM/SIGINT; 0 after a clean stop, 2 for bad settings, 1 otherwise."""
    try:
        cfg = config_from_args(args, os.environ)
    except RouteConfigError as e:
        print(f"vsurge route: {e}", file=sys.stderr)
        return 2
    _configure_logging(cfg.log_level)

    import uvicorn

    from .app import build_app
    from .static import StaticConfigError, load_static_config
    from .tenants import ApiKeysError, load_api_keys

    # Fail here, with the file's problem, not in the lifespan.
    try:
        if cfg.static_config:
            load_static_config(cfg.static_config)
        if cfg.api_keys_file:
            load_api_keys(cfg.api_keys_file)
    except (StaticConfigError, ApiKeysError) as e:
        print(f"vsurge route: {e}", file=sys.stderr)
        return 2
    try:
        app = build_app(cfg)
    except Exception as e:
        import kubernetes

        if isinstance(e, kubernetes.config.ConfigException):
            print(
                f"vsurge route: no Kubernetes configuration ({e}); run in a cluster, set KUBECONFIG, or give "
                "--static-config FILE (with --no-kubernetes) for local use",
                file=sys.stderr,
            )
            return 2
        raise
    logging.getLogger("vsurge.router").info("routing for %s", _describe(cfg))
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=cfg.log_level == "debug",
        lifespan="on",
        # SIGTERM: stop accepting, let open requests and streams finish for this long.
        timeout_graceful_shutdown=cfg.drain_timeout_seconds,
        server_header=False,
        # The router appends the peer address to X-Forwarded-For itself; uvicorn rewriting the peer from
        # that header would record the client twice.
        proxy_headers=False,
    )
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
