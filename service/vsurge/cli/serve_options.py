"""`vsurge serve`'s options: every flag, the `VSURGE_*` variable it also reads, how it parses, and the
`ServeConfig` they make.

A flag on the command line wins over the variable, the variable over the default. Parsing is pure
(`parse_serve_config(argv, env)`), so it is tested without starting anything, and imports nothing heavy:
`vsurge --help` stays instant. The engine's knobs come from EngineConfig's fields (serve=True); the rest
are the server's own. The commands that run a config live in cli.py.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vsurge.contracts.engine_config import EngineConfig, env_name, flag_name, serve_fields
from vsurge.contracts.env_options import (
    add_env_arguments,
    flag_or_env_values,
    parse_choice,
    parse_float,
    parse_int,
)
from vsurge.multihost.group import parse_address, parse_non_negative

DEFAULT_PORT = 11556
DTYPES = ("float32", "bfloat16", "float16")  # --dtype: the parameters' (InferenceModel spec.engine.dtype too)


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
        _choice(*DTYPES),
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
        "Prometheus port (default port+1; -1: /metrics on the main port; with --uds, on the socket)",
        "PORT",
    ),
    Option(
        "--uds",
        "VSURGE_UDS",
        str,
        None,
        "listen on this Unix-domain socket instead of --host/--port (a sidecar in the pod, a machine "
        "without TCP); the file is removed at shutdown",
        "PATH",
    ),
    Option(
        "--api-key",
        "VSURGE_API_KEY",
        str,
        None,
        "require `Authorization: Bearer KEY` (probes and metrics exempt); prefer the env var",
        "KEY",
    ),
    Option(
        "--admin-key",
        "VSURGE_ADMIN_KEY",
        str,
        None,
        "the admin routes' own key (POST /v1/load_lora_adapter, /v1/unload_lora_adapter, /debug/profile): "
        "they need `Authorization: Bearer KEY`, the API key does not open them; prefer the env var",
        "KEY",
    ),
    Option(
        "--profile-dir",
        "VSURGE_PROFILE_DIR",
        str,
        None,
        "where POST /debug/profile?seconds=N (guarded as the admin routes) writes a jax.profiler trace of N "
        "seconds of serving; unset, that route is off",
        "DIR",
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
    """`vsurge serve`'s configuration: the server's own options, and the engine's as an EngineConfig
    (``cfg.engine.page_size``)."""

    model: str = "default"
    served_model_name: str | None = None
    dtype: str | None = None
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    metrics_port: int | None = None
    uds: str | None = None
    api_key: str | None = None
    admin_key: str | None = None
    profile_dir: str | None = None
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
    # LoRA adapters served from the start (--lora NAME=SOURCE, repeatable), and the run-time routes
    loras: tuple[tuple[str, str], ...] = ()
    enable_lora_runtime_updates: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    # the engine knobs a flag or a variable set: serve sizes the others from the device (vsurge/cli/sizing.py);
    # None (a ServeConfig built in Python): those that differ from EngineConfig's defaults
    explicit: frozenset[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

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
    def set_knobs(self) -> frozenset[str]:
        """The engine knobs given, which sizing keeps (``explicit``, else those off their defaults)."""
        if self.explicit is not None:
            return self.explicit
        base = EngineConfig()
        return frozenset(n for n in ENGINE_FIELDS if getattr(self.engine, n) != getattr(base, n))

    @property
    def resolved_metrics_port(self) -> int:
        """-1: /metrics on the main listener (the default on a Unix socket, where no port is opened)."""
        if self.metrics_port is None:
            return -1 if self.uds else self.port + 1
        return self.metrics_port


class ConfigError(ValueError):
    """A flag or environment variable has an invalid value; the message names which."""


def _default(opt: Option) -> Any:
    return opt.default


def _shown_default(opt: Option) -> Any:
    return opt.default if opt.shown is None else opt.shown


LORA_RUNTIME_ENV = "VSURGE_ENABLE_LORA_RUNTIME_UPDATES"


def parse_lora(text: str) -> tuple[str, str]:
    """``NAME=SOURCE`` (a PEFT adapter directory in any model source) -> (name, source)."""
    name, eq, source = text.partition("=")
    if not eq or not name.strip() or not source.strip():
        raise ValueError(f"--lora takes NAME=SOURCE (a PEFT adapter directory), got {text!r}")
    return name.strip(), source.strip()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_arguments(parser, SERVE_OPTIONS, _shown_default)
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=SOURCE",
        help="serve the PEFT LoRA adapter at SOURCE (a path, hf://, gs://, s3:// or pvc://) as model NAME; "
        "repeatable (the InferenceModel's spec.adapters)",
    )
    parser.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --admin-key, only to "
        f"requests that carry it; else, with an API key, to those that carry that) [env {LORA_RUNTIME_ENV}=1]",
    )
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
    explicit = frozenset(
        o.dest for o in ENGINE_OPTIONS if getattr(ns, o.dest, None) is not None or env.get(o.env, "").strip()
    )
    try:
        loras = tuple(parse_lora(t) for t in getattr(ns, "lora", None) or ())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    names = [n for n, _ in loras]
    if len(set(names)) != len(names):
        raise ConfigError(f"--lora names must be unique, got {', '.join(names)}")
    runtime = bool(getattr(ns, "enable_lora_runtime_updates", False))
    runtime = runtime or env.get(LORA_RUNTIME_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    try:  # the adapter bank exists only when adapters can be served (EngineConfig.enable_lora)
        engine = EngineConfig(**knobs, enable_lora=bool(loras) or runtime)
    except ValueError as e:  # each value was checked as it was parsed; this is a combination of them
        raise ConfigError(str(e)) from None
    cfg = ServeConfig(
        **values, loras=loras, enable_lora_runtime_updates=runtime, engine=engine, explicit=explicit
    )
    if cfg.model_name in names:
        raise ConfigError(f"--lora {cfg.model_name}: an adapter cannot take the served model's name")
    if cfg.admin_key and cfg.admin_key == cfg.api_key:
        raise ConfigError("--admin-key (VSURGE_ADMIN_KEY) must differ from --api-key (VSURGE_API_KEY)")
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
