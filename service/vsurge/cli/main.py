"""`vsurge serve | route | bench`: the command line's commands.

Every `serve` option also reads a `VSURGE_*` environment variable (the operator configures pods that
way); the options, their parsing and ServeConfig live in serve_options.py (re-exported here). Nothing
heavy (jax, transformers) is imported until a command runs, so `vsurge --help` is instant.

Adding a subcommand (the router's `route`): `register_subcommand(...)` here, with the arguments and the
run function from a module that imports nothing heavy at the top (vsurge/router/cli.py). The cli imports
its subcommands; they never import the cli.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the parser's names, as callers have always imported them from here
from vsurge.cli.serve_options import (  # noqa: F401
    DEFAULT_PORT,
    ENGINE_FIELDS,
    ENGINE_OPTIONS,
    SERVE_OPTIONS,
    ConfigError,
    Option,
    ServeConfig,
    add_serve_arguments,
    config_from_namespace,
    parse_serve_config,
)
from vsurge.router import cli as router_cli

# ---------------------------------------------------------------------------------------- serve


def build_surge(cfg: ServeConfig, model: Any, processor: Any, mesh: Any = None) -> Any:
    """The Surge for `cfg.engine.driver` with the engine options of `cfg` (the mesh given, as the model's)."""
    from vsurge.surge import Surge

    return Surge.from_config(model, processor, cfg.engine.replace(mesh=mesh), name=cfg.model_name)


def size_engine(cfg: ServeConfig, model: Any, mesh: Any, say: Callable[[str], None]) -> None:
    """Slots and context the flags left unset, sized from the memory the loaded weights leave
    (vsurge/cli/sizing.py); says the numbers it used."""
    import jax

    from vsurge.cli import sizing

    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    sized = sizing.measure(cfg.engine, cfg.set_knobs, model, cfg.dtype, devices)
    cfg.engine = sizing.apply(cfg.engine, sized)
    say(f"sized: {sized.slots} slots x {sized.context} tokens of context ({sized.describe()})")


def build_api(cfg: ServeConfig) -> Any:
    """The server with `cfg`'s server options and no model yet (startup adds it)."""
    from vsurge.server import vSurgeApiServer

    return vSurgeApiServer(
        api_key=cfg.api_key,
        admin_key=cfg.admin_key,
        profile_dir=cfg.profile_dir,
        max_body_bytes=cfg.max_body_bytes,
        drain_timeout_s=cfg.drain_timeout,
        tool_call_parser=cfg.tool_call_parser,
        lora_runtime_updates=cfg.enable_lora_runtime_updates,
    )


def run_serve(cfg: ServeConfig) -> int:
    from vsurge import multihost
    from vsurge.server import vSurgeApiServer
    from vsurge.server.runner import serve

    try:  # a multi-host slice: join the group first; a worker only replays the leader (vsurge/multihost)
        group = multihost.start_group(cfg)
    except (ValueError, RuntimeError) as e:
        print(f"vsurge serve: {e}", file=sys.stderr)
        return 1
    if group is not None and not group.group.is_leader:
        multihost.run_worker(cfg, group)  # ends the process
    leader = multihost.Leader(group) if group is not None else None
    api = build_api(cfg)

    def startup(api: vSurgeApiServer, say: Callable[[str], None]) -> None:
        say(f"loading model {cfg.model}")
        t0 = time.perf_counter()
        from vsurge.models.compiled.compilation_cache import enable_compilation_cache
        from vsurge.models.loader import load_model

        enable_compilation_cache()

        mesh = None
        if cfg.engine.mesh:
            from vsurge.models.sharding import make_mesh

            mesh = make_mesh(cfg.engine.mesh)
        if leader is not None:
            mesh = leader.mesh(cfg)
        model, processor = load_model(
            cfg.model, dtype=cfg.dtype, mesh=mesh, quantization=cfg.engine.quantization
        )
        load_s = time.perf_counter() - t0
        say(f"loaded {cfg.model_name} in {load_s:.1f}s")
        if leader is None:  # a multi-host group keeps the plain defaults: every process must agree
            size_engine(cfg, model, mesh, say)
        if leader is not None:
            surge = leader.surge(cfg, model, processor, mesh, api)
        else:
            surge = build_surge(cfg, model, processor, mesh)
        for name, source in cfg.loras:  # read and checked now: a bad adapter fails the start, with why
            say(f"loading LoRA adapter {name} from {source}")
            if surge.lora is None:
                raise RuntimeError("--lora: this engine has no adapter bank (EngineConfig.enable_lora)")
            surge.lora.add(name, source)
        api.add_model(cfg.model_name, surge, load_seconds=load_s, root=str(cfg.model))
        from vsurge.models.sources import load_phases

        phases = load_phases(cfg.model) or {"place": load_s}  # remote sources add "download"
        for phase, seconds in phases.items():
            api.metrics.load_seconds.labels(cfg.model_name, phase).set(seconds)

    code, error = 0, None
    try:
        serve(
            api,
            host=cfg.host,
            port=cfg.port,
            uds=cfg.uds,
            metrics_port=cfg.resolved_metrics_port if cfg.port or cfg.uds else cfg.metrics_port,
            log_level=cfg.log_level,
            ssl_keyfile=cfg.ssl_keyfile,
            ssl_certfile=cfg.ssl_certfile,
            startup=startup,
        )
    except Exception as e:
        print(f"vsurge serve: {type(e).__name__}: {e}", file=sys.stderr)
        from vsurge.models.sources.errors import write_termination_log

        write_termination_log(e)  # the pod's termination message: the operator reads it
        code, error = 1, e
    if leader is not None:
        leader.finish(code, error)  # the workers learn why; the process ends here
    return code


# ---------------------------------------------------------------------------------------- bench


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "benchmarks"


def run_bench(args: argparse.Namespace) -> int:
    """`vsurge bench NAME [ARGS...]` runs benchmarks/NAME.py from a source checkout."""
    path = _benchmarks_dir() / f"{args.name}.py"
    if not path.exists():
        available = (
            sorted(p.stem for p in _benchmarks_dir().glob("*.py")) if _benchmarks_dir().exists() else []
        )
        print(
            f"vsurge bench: no benchmark {args.name!r} (available: {', '.join(available) or 'none'})",
            file=sys.stderr,
        )
        return 2
    saved = sys.argv
    sys.argv = [str(path), *args.bench_args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    finally:
        sys.argv = saved
    return 0


# ---------------------------------------------------------------------------------------- subcommands


@dataclass
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(
    name: str,
    help: str,  # noqa: A002 - argparse's word
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name", nargs="?", default="serving", help="benchmark to run: benchmarks/NAME.py (default serving)"
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")


def _run_serve_ns(ns: argparse.Namespace) -> int:
    try:
        cfg = config_from_namespace(ns, os.environ)
    except ConfigError as e:
        print(f"vsurge serve: {e}", file=sys.stderr)
        return 2
    if getattr(ns, "print_config", False):
        from vsurge.cli.print_config import print_config

        return print_config(cfg)
    return run_serve(cfg)


register_subcommand("serve", "run the OpenAI-compatible server", add_serve_arguments, _run_serve_ns)
register_subcommand("bench", "run a benchmark from benchmarks/", _add_bench_arguments, run_bench)
# `vsurge route` lives in the router package (vsurge/router/cli.py), which never imports this module
register_subcommand("route", router_cli.HELP, router_cli.add_route_arguments, router_cli.run_route)


def build_parser() -> argparse.ArgumentParser:
    from vsurge.version import __version__

    parser = argparse.ArgumentParser(prog="vsurge", description="vSurge: JAX LLM serving")
    parser.add_argument("--version", action="version", version=f"vsurge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return int(args._run(args) or 0)
