"""`vsurge serve | route | bench`: the command line.

Every `serve` option also reads a `VSURGE_*` environment variable (the operator configures pods that
way); a flag on the command line wins over the variable, the variable over the default. Parsing is pure
(`parse_serve_config(argv, env)`), so it is tested without starting anything; nothing heavy (jax,
transformers) is imported until a command runs, so `vsurge --help` is instant.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vsurge.compilation_cache import enable_compilation_cache as _enable_compilation_cache
from vsurge.engine_config import EngineConfig, env_name, flag_name, serve_fields
from vsurge.env_options import (
    add_env_arguments,
    flag_or_env_values,
    parse_choice,
    parse_float,
    parse_int,
)
from vsurge.multihost.group import parse_address, parse_non_negative
from vsurge.router import cli as router_cli

DEFAULT_PORT = 11556


# ---------------------------------------------------------------------------------------- value types


_int = parse_int
_float = parse_float
_choice = parse_choice


def _positive_int(text: str) -> int:
    v = _int(text)
    if v < 1:
        raise ValueError(f"must be >= 1, got {v}")
    return v


def _port(text: str) -> int:
    v = _int(text)
    if not 0 <= v <= 65535:
        raise ValueError(f"must be a port number 0-65535, got {v}")
    return v


def _metrics_port(text: str) -> int:
    v = _int(text)
    if v != -1 and not 0 <= v <= 65535:
        raise ValueError(f"must be a port number 0-65535, or -1 for /metrics on the main port, got {v}")
    return v


def _positive_float(text: str) -> float:
    v = _float(text)
    if not v > 0:
        raise ValueError(f"must be > 0, got {v}")
    return v


@dataclass(frozen=True)
class Option:
    """One `serve` option: its flag, its environment variable, how to parse it, its default.

    ``shown``: the default as `--help` prints it, where ``default`` is None ("decided later")."""

    flag: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str | None = None
    shown: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _engine_option(f: Any) -> Option:
    """The `serve` option of an EngineConfig field: flag, variable, parser and help all come from it."""
    meta = f.metadata
    text, check = meta["text"], meta["check"]

    def parse(value: str) -> Any:
        parsed = text(value)
        return parsed if check is None else check(parsed)

    parse.__name__ = f.name
    return Option(flag_name(f), env_name(f), parse, f.default, meta["help"], meta["metavar"], meta["shown"])


# Engine knobs are declared once, in EngineConfig (fields with serve=True); the rest are the server's own.
ENGINE_OPTIONS: tuple[Option, ...] = tuple(_engine_option(f) for f in serve_fields())
ENGINE_FIELDS = frozenset(o.dest for o in ENGINE_OPTIONS)


def _tool_call_parser(text: str) -> str:
    # read at parse time: importing the server package for its list would slow every `vsurge` command
    from vsurge.server.tool_parsers import PARSERS

    return parse_choice(*PARSERS)(text)


SERVE_OPTIONS: tuple[Option, ...] = (
    Option(
        "--model",
        "VSURGE_MODEL",
        str,
        "default",
        "HF model directory, .gguf file, 'default' (SmolLM2-135M-Instruct), or hf://, gs://, s3://, pvc://",
        "PATH",
    ),
    Option(
        "--served-model-name",
        "VSURGE_SERVED_MODEL_NAME",
        str,
        None,
        "name clients send as `model` (default: from the model path)",
        "NAME",
    ),
    *ENGINE_OPTIONS,
    Option(
        "--dtype",
        "VSURGE_DTYPE",
        _choice("float32", "bfloat16", "float16"),
        None,
        "parameter dtype (default: float32 on CPU, bfloat16 elsewhere)",
    ),
    Option("--host", "VSURGE_HOST", str, "0.0.0.0", "address to bind", "HOST"),
    Option("--port", "VSURGE_PORT", _port, DEFAULT_PORT, "HTTP port", "PORT"),
    Option(
        "--metrics-port",
        "VSURGE_METRICS_PORT",
        _metrics_port,
        None,
        "Prometheus port (default port+1; -1: /metrics on the main port)",
        "PORT",
    ),
    Option(
        "--api-key",
        "VSURGE_API_KEY",
        str,
        None,
        "require `Authorization: Bearer KEY` (probes and metrics exempt); prefer the env var",
        "KEY",
    ),
    Option("--ssl-keyfile", "VSURGE_SSL_KEYFILE", str, None, "TLS private key (PEM)", "FILE"),
    Option("--ssl-certfile", "VSURGE_SSL_CERTFILE", str, None, "TLS certificate chain (PEM)", "FILE"),
    Option(
        "--log-level",
        "VSURGE_LOG_LEVEL",
        _choice("critical", "error", "warning", "info", "debug"),
        "info",
        "log level",
    ),
    Option(
        "--max-body-bytes",
        "VSURGE_MAX_BODY_BYTES",
        _positive_int,
        8 * 1024 * 1024,
        "largest request body; bigger ones get 413",
        "N",
    ),
    Option(
        "--drain-timeout",
        "VSURGE_DRAIN_TIMEOUT",
        _positive_float,
        300.0,
        "seconds SIGTERM waits for requests in flight",
        "S",
    ),
    Option(
        "--tool-call-parser",
        "VSURGE_TOOL_CALL_PARSER",
        _tool_call_parser,
        None,
        "how tool calls read back under tool_choice auto: hermes, llama3_json or mistral "
        "(default: the family the chat template writes)",
        "NAME",
    ),
    # A multi-host slice (vsurge/multihost/group.py): unset, a LeaderWorkerSet's LWS_* variables decide.
    # The step lane's secret (VSURGE_LANE_SECRET_FILE) and failure bound (VSURGE_LANE_TIMEOUT_S) are
    # environment only: a secret never goes on a command line.
    Option(
        "--coordinator-address",
        "VSURGE_COORDINATOR_ADDRESS",
        parse_address,
        None,
        "multi-host: the JAX coordinator HOST:PORT on process 0 (the step lane listens on PORT+1)",
        "HOST:PORT",
    ),
    Option("--num-processes", "VSURGE_NUM_PROCESSES", _positive_int, None, "multi-host: processes", "N"),
    Option(
        "--process-id",
        "VSURGE_PROCESS_ID",
        parse_non_negative,
        None,
        "multi-host: this process (0 serves HTTP; the others replay its engine calls)",
        "N",
    ),
    Option(
        "--join-timeout",
        "VSURGE_JOIN_TIMEOUT",
        _positive_float,
        300.0,
        "multi-host: seconds to wait for the other processes to join and reach the step lane (a worker "
        "without a leader exits then)",
        "S",
    ),
    Option(
        "--start-timeout",
        "VSURGE_START_TIMEOUT",
        _positive_float,
        1800.0,
        "multi-host: seconds the group may take to load the model on every process (a slow leader is "
        "waited for while it beats; past this the whole group exits)",
        "S",
    ),
)


@dataclass
class ServeConfig:
    """`vsurge serve`'s configuration: the server's own options, and the engine's as an EngineConfig.

    The engine knobs also read as attributes (``cfg.page_size``, ``cfg.driver``), as they always did."""

    model: str = "default"
    served_model_name: str | None = None
    dtype: str | None = None
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    metrics_port: int | None = None
    api_key: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    log_level: str = "info"
    max_body_bytes: int = 8 * 1024 * 1024
    drain_timeout: float = 300.0
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    join_timeout: float = 300.0
    start_timeout: float = 1800.0
    tool_call_parser: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        if name in ENGINE_FIELDS:  # only reached for names that are not the server's own fields
            value = getattr(self.engine, name)
            return list(value) if isinstance(value, tuple) else value  # prefill_lengths reads as a list
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def model_name(self) -> str:
        """The served name: explicit, else derived from the model path."""
        if self.served_model_name:
            return self.served_model_name
        if self.model == "default":
            return "SmolLM2-135M-Instruct"
        p = Path(self.model.rstrip("/"))
        name = p.stem if p.suffix == ".gguf" else p.name
        return name.partition("@")[0] if self.model.startswith("hf://") else name  # hf://org/name@rev

    @property
    def resolved_metrics_port(self) -> int:
        return self.port + 1 if self.metrics_port is None else self.metrics_port


class ConfigError(ValueError):
    """A flag or environment variable has an invalid value; the message names which."""


def _default(opt: Option) -> Any:
    return opt.default


def _shown_default(opt: Option) -> Any:
    return opt.default if opt.shown is None else opt.shown


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_arguments(parser, SERVE_OPTIONS, _shown_default)
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the engine configuration this machine would run (each knob, where it came from and why) "
        "and exit",
    )


def config_from_namespace(ns: argparse.Namespace, env: Mapping[str, str]) -> ServeConfig:
    """Flags over environment over defaults; an invalid env value raises ConfigError naming the variable."""
    values = flag_or_env_values(ns, env, SERVE_OPTIONS, _default, ConfigError)
    knobs = {name: values.pop(name) for name in ENGINE_FIELDS}
    try:
        engine = EngineConfig(**knobs)
    except ValueError as e:  # each value was checked as it was parsed; this is a combination of them
        raise ConfigError(str(e)) from None
    cfg = ServeConfig(**values, engine=engine)
    if bool(cfg.ssl_keyfile) != bool(cfg.ssl_certfile):
        raise ConfigError(
            "TLS needs both --ssl-keyfile and --ssl-certfile (VSURGE_SSL_KEYFILE / VSURGE_SSL_CERTFILE)"
        )
    if cfg.metrics_port not in (None, -1) and cfg.metrics_port == cfg.port and cfg.port != 0:
        raise ConfigError(
            f"--metrics-port {cfg.metrics_port} equals --port; use -1 to serve /metrics on the main port"
        )
    return cfg


def parse_serve_config(argv: Sequence[str], env: Mapping[str, str] | None = None) -> ServeConfig:
    """`vsurge serve` arguments (without the 'serve') plus the environment -> ServeConfig."""
    parser = argparse.ArgumentParser(prog="vsurge serve")
    add_serve_arguments(parser)
    ns = parser.parse_args(list(argv))
    return config_from_namespace(ns, os.environ if env is None else env)


# ---------------------------------------------------------------------------------------- serve


def build_surge(cfg: ServeConfig, model: Any, processor: Any, mesh: Any = None) -> Any:
    """The vSurge for `cfg.driver` with the engine options of `cfg` (the mesh given, as the model's)."""
    from vsurge.surge import vSurge

    return vSurge.create(model, processor, cfg.engine.replace(mesh=mesh), vsurge_name=cfg.model_name)


def build_api(cfg: ServeConfig) -> Any:
    """The server with `cfg`'s server options and no model yet (startup adds it)."""
    from vsurge.server import vSurgeApiServer

    return vSurgeApiServer(
        api_key=cfg.api_key,
        max_body_bytes=cfg.max_body_bytes,
        drain_timeout_s=cfg.drain_timeout,
        tool_call_parser=cfg.tool_call_parser,
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
        from vsurge.models.loader import load_model

        _enable_compilation_cache()

        mesh = None
        if cfg.mesh:
            from vsurge.models.sharding import make_mesh

            mesh = make_mesh(cfg.mesh)
        if leader is not None:
            mesh = leader.mesh(cfg)
        model, processor = load_model(cfg.model, dtype=cfg.dtype, mesh=mesh, quantization=cfg.quantization)
        load_s = time.perf_counter() - t0
        say(f"loaded {cfg.model_name} in {load_s:.1f}s")
        if leader is not None:
            surge = leader.surge(cfg, model, processor, mesh, api)
        else:
            surge = build_surge(cfg, model, processor, mesh)
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
            metrics_port=cfg.resolved_metrics_port if cfg.port else cfg.metrics_port,
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
        from vsurge.print_config import print_config

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


if __name__ == "__main__":
    from vsurge.cli import main as _main  # plugins register into vsurge.cli, not this __main__ copy

    sys.exit(_main())
