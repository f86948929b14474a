"""The router's settings, and how flags and `VSURGE_ROUTER_*` variables become them (pure).

Like `vsurge serve`: a flag wins over its environment variable, the variable over the default, and a bad
value stops the command with a message naming the flag or variable.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vsurge.contracts.env_options import add_env_arguments, flag_or_env_values, parse_env


class RouteConfigError(ValueError):
    """A flag or variable has an invalid value; the message names which."""


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    static_config: str | None = None
    kubernetes: bool | None = None  # None: decided by `use_kubernetes`
    wake_timeout_seconds: float = 300.0
    retry_after_seconds: float = 5.0
    connect_timeout_seconds: float = 5.0
    eject_seconds: float = 10.0
    max_attempts: int = 2  # one retry on another pod
    max_body_bytes: int = 8 * 1024 * 1024
    static_reload_seconds: float = 5.0
    watch_timeout_seconds: int = 300
    drain_timeout_seconds: float = 55.0  # under the chart's terminationGracePeriodSeconds (60)
    log_level: str = "info"
    routing: str | None = None  # None: auto (prefix where the pods report odriver, else least-load)
    prefix_epsilon: float = 0.25
    prefix_block_bytes: int = 256
    prefix_key_blocks: int = 4
    prefix_index_size: int = 65536
    load_poll_seconds: float = 0.2
    lora_poll_seconds: float = 1.0
    endpoint_slices: bool = True
    api_keys_file: str | None = None
    api_keys_reload_seconds: float = 5.0
    tenant_limit_replicas: int = 1  # each replica enforces 1/N of every tenant limit (ratelimit.py)
    ext_proc_port: int = 0  # 0: no endpoint picker (extproc.py)
    ext_proc_fallbacks: int = 2

    @property
    def use_kubernetes(self) -> bool:
        """Watch InferenceModels unless told not to; by default, unless only a static file is given."""
        if self.kubernetes is not None:
            return self.kubernetes
        return bool(self.namespaces) or self.static_config is None


def _float(minimum: float, strict: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        if v < minimum or (strict and v == minimum):
            raise ValueError(f"must be {'>' if strict else '>='} {minimum:g}, got {v:g}")
        return v

    return parse


def _int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        if v < minimum or (maximum is not None and v > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
            raise ValueError(f"must be {bound}, got {v}")
        return v

    return parse


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _namespaces(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))


def _routing(text: str) -> str | None:
    t = text.strip().lower()
    if t == "auto":
        return None
    if t not in ("least-load", "prefix", "round-robin"):
        raise ValueError(f"must be one of least-load, prefix, round-robin, auto, got {text!r}")
    return t


def _log_level(text: str) -> str:
    t = text.strip().lower()
    if t not in ("critical", "error", "warning", "info", "debug"):
        raise ValueError(f"must be one of critical, error, warning, info, debug, got {text!r}")
    return t


@dataclass(frozen=True)
class Option:
    flag: str
    parse: Callable[[str], Any]
    help: str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "VSURGE_ROUTER_" + self.dest.upper()


# Every option but --namespace (repeatable), --all-namespaces and --kubernetes (switches), added apart.
OPTIONS: tuple[Option, ...] = (
    Option("--host", str, "address to bind", "HOST"),
    Option("--port", _int(0, 65535), "port of the OpenAI API, the probes and /metrics", "PORT"),
    Option(
        "--static-config",
        str,
        "YAML file listing models and their upstream URLs (see docs/router.md)",
        "FILE",
    ),
    Option(
        "--wake-timeout-seconds",
        _float(0, strict=True),
        "how long a request for a model without ready replicas is held (scale from zero) before a 503",
        "S",
    ),
    Option("--retry-after-seconds", _float(1), "Retry-After sent with 503 answers", "S"),
    Option("--connect-timeout-seconds", _float(0, strict=True), "connect timeout to an upstream", "S"),
    Option(
        "--eject-seconds",
        _float(0),
        "how long an upstream that refused a connection is passed over",
        "S",
    ),
    Option("--max-attempts", _int(1), "upstreams tried per request before a 503", "N"),
    Option("--max-body-bytes", _int(1), "largest request body; bigger ones get 413", "N"),
    Option("--static-reload-seconds", _float(0), "how often the static file is re-read (0: never)", "S"),
    Option(
        "--watch-timeout-seconds",
        _int(1),
        "server-side timeout of each Kubernetes watch, after which the router relists",
        "S",
    ),
    Option("--drain-timeout-seconds", _float(0), "on SIGTERM, how long open requests may finish", "S"),
    Option("--log-level", _log_level, "critical, error, warning, info or debug", "LEVEL"),
    Option(
        "--routing",
        _routing,
        "how a model's pod is picked: least-load, prefix (prefix-cache affinity with bounded load), "
        "round-robin, or auto: prefix for models whose pods run the paged odriver, else least-load",
        "POLICY",
    ),
    Option(
        "--prefix-epsilon",
        _float(0, strict=True),
        "prefix routing: no pod gets more than (1 + EPS) x the mean load",
        "EPS",
    ),
    Option("--prefix-block-bytes", _int(16), "prefix routing: bytes of prompt per hashed block", "N"),
    Option(
        "--prefix-key-blocks",
        _int(1),
        "prefix routing: leading blocks that place a prompt on the hash ring",
        "N",
    ),
    Option(
        "--prefix-index-size",
        _int(1),
        "prefix routing: block hashes remembered per model (which pod got them last)",
        "N",
    ),
    Option(
        "--load-poll-seconds",
        _float(0),
        "how often each pod's GET /load is polled (0: never; pods are then compared by in-flight counts)",
        "S",
    ),
    Option(
        "--lora-poll-seconds",
        _float(0),
        "how often each pod's LoRA adapters (GET /v1/models, the vllm:lora_requests_info gauge) are read "
        "(0: never; adapters are then routed by the InferenceModels' spec.adapters and the static file only)",
        "S",
    ),
    Option(
        "--api-keys-file",
        str,
        "YAML file of tenants, their API keys, limits and models (see docs/router.md); without it the router is open",
        "FILE",
    ),
    Option("--api-keys-reload-seconds", _float(0), "how often the API keys file is re-read (0: never)", "S"),
    Option(
        "--tenant-limit-replicas",
        _int(1),
        "router replicas the tenants' limits are split over: each replica enforces 1/N of every limit "
        "(the chart sets router.replicas)",
        "N",
    ),
    Option(
        "--ext-proc-port",
        _int(0, 65535),
        "serve the Gateway API Inference Extension's endpoint-picker protocol (Envoy ext_proc gRPC) on this "
        "port, for InferencePools that name the router as their endpoint picker (0: off)",
        "PORT",
    ),
    Option(
        "--ext-proc-fallbacks",
        _int(0, 8),
        "endpoint picker: fallback pods named after the primary one (the proxy tries them in order)",
        "N",
    ),
)


_DEFAULTS = RouterConfig()


def _default(opt: Option) -> Any:
    return getattr(_DEFAULTS, opt.dest)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        metavar="NS",
        help="watch InferenceModels in NS (repeatable; default: all namespaces) [env VSURGE_ROUTER_NAMESPACES, "
        "comma-separated]",
    )
    parser.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        default=None,
        help="watch InferenceModels in every namespace (the default without --namespace)",
    )
    parser.add_argument(
        "--kubernetes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="discover InferenceModels from the Kubernetes API (default: yes, unless only --static-config "
        "is given) [env VSURGE_ROUTER_KUBERNETES]",
    )
    parser.add_argument(
        "--endpoint-slices",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="in Kubernetes, send requests to the ready pods of each model's Service, from its "
        "EndpointSlices (default: yes; no: to the Service) [env VSURGE_ROUTER_ENDPOINT_SLICES]",
    )
    add_env_arguments(parser, OPTIONS, _default)


def config_from_args(ns: argparse.Namespace, env: Mapping[str, str]) -> RouterConfig:
    """Flags over `VSURGE_ROUTER_*` over defaults; an invalid variable raises naming it."""
    values = flag_or_env_values(ns, env, OPTIONS, _default, RouteConfigError)
    namespaces = tuple(dict.fromkeys(getattr(ns, "namespaces", None) or ()))
    if not namespaces and env.get("VSURGE_ROUTER_NAMESPACES", ""):
        namespaces = _namespaces(env["VSURGE_ROUTER_NAMESPACES"])
    if getattr(ns, "all_namespaces", None) and namespaces:
        raise RouteConfigError("--all-namespaces and --namespace exclude each other")
    kubernetes = getattr(ns, "kubernetes", None)
    if kubernetes is None and env.get("VSURGE_ROUTER_KUBERNETES", ""):
        kubernetes = parse_env("VSURGE_ROUTER_KUBERNETES", env, _bool, RouteConfigError)
    if getattr(ns, "all_namespaces", None) and kubernetes is None:
        kubernetes = True
    values["namespaces"] = namespaces
    values["kubernetes"] = kubernetes
    slices = getattr(ns, "endpoint_slices", None)
    if slices is None and env.get("VSURGE_ROUTER_ENDPOINT_SLICES", ""):
        slices = parse_env("VSURGE_ROUTER_ENDPOINT_SLICES", env, _bool, RouteConfigError)
    values["endpoint_slices"] = True if slices is None else slices
    cfg = RouterConfig(**values)
    if not cfg.use_kubernetes and not cfg.static_config:
        raise RouteConfigError(
            "with --no-kubernetes, give --static-config FILE: the router needs some models"
        )
    if namespaces and cfg.kubernetes is False:
        raise RouteConfigError("--namespace needs Kubernetes discovery; drop --no-kubernetes")
    return cfg
