"""`vsurge route` options: flags over VSURGE_ROUTER_* over defaults, the chart's arguments, bad settings."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from vsurge.cli.main import build_parser
from vsurge.router.cli import add_route_arguments, run_route
from vsurge.router.config import RouteConfigError, RouterConfig, config_from_args


def _config(argv: list[str], env: dict[str, str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_route_arguments(parser)
    return config_from_args(parser.parse_args(argv), env or {})


def test_the_route_subcommand_is_registered_with_the_charts_arguments() -> None:
    parser = build_parser()
    # Exactly what helm/vsurge/templates/router/deployment.yaml renders (default and all-options values).
    args = parser.parse_args(["route", "--port=8080", "--namespace=team-a", "--namespace=team-b"])
    assert args._run is run_route
    cfg = config_from_args(args, {})
    assert (cfg.port, cfg.namespaces, cfg.use_kubernetes, cfg.static_config) == (
        8080,
        ("team-a", "team-b"),
        True,
        None,
    )
    args = parser.parse_args(
        ["route", "--port=9090", "--static-config=/etc/vsurge/static-config.yaml", "--log-level=debug"]
    )
    cfg = config_from_args(args, {})
    assert (cfg.port, cfg.static_config, cfg.log_level, cfg.use_kubernetes) == (
        9090,
        "/etc/vsurge/static-config.yaml",
        "debug",
        False,
    )
    assert "route" in parser.format_help()


def test_flags_win_over_environment_over_defaults() -> None:
    assert _config([]) == RouterConfig()
    env = {
        "VSURGE_ROUTER_PORT": "9000",
        "VSURGE_ROUTER_WAKE_TIMEOUT_SECONDS": "12.5",
        "VSURGE_ROUTER_NAMESPACES": "a, b,a",
        "VSURGE_ROUTER_KUBERNETES": "true",
    }
    cfg = _config([], env)
    assert (cfg.port, cfg.wake_timeout_seconds, cfg.namespaces, cfg.kubernetes) == (
        9000,
        12.5,
        ("a", "b"),
        True,
    )
    cfg = _config(
        ["--port", "9001", "--no-kubernetes", "--static-config", "f.yaml"],
        {**env, "VSURGE_ROUTER_NAMESPACES": ""},
    )
    assert (cfg.port, cfg.kubernetes, cfg.use_kubernetes, cfg.wake_timeout_seconds) == (
        9001,
        False,
        False,
        12.5,
    )
    assert _config(["-n", "x"], env).namespaces == ("x",)


def test_kubernetes_discovery_by_default_unless_only_a_static_file() -> None:
    assert _config([]).use_kubernetes
    assert not _config(["--static-config", "f.yaml"]).use_kubernetes
    assert _config(["--static-config", "f.yaml", "-n", "models"]).use_kubernetes
    assert _config(["--static-config", "f.yaml", "--all-namespaces"]).use_kubernetes
    assert _config(["--static-config", "f.yaml", "--kubernetes"]).use_kubernetes


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"VSURGE_ROUTER_PORT": "http"}, "VSURGE_ROUTER_PORT='http': expected an integer"),
        (
            [],
            {"VSURGE_ROUTER_WAKE_TIMEOUT_SECONDS": "0"},
            "VSURGE_ROUTER_WAKE_TIMEOUT_SECONDS='0': must be > 0",
        ),
        (
            [],
            {"VSURGE_ROUTER_KUBERNETES": "maybe"},
            "VSURGE_ROUTER_KUBERNETES='maybe': expected true or false",
        ),
        (["-n", "a", "--all-namespaces"], {}, "exclude each other"),
        (["--no-kubernetes"], {}, "give --static-config"),
        (["-n", "a", "--no-kubernetes", "--static-config", "f"], {}, "--namespace needs Kubernetes"),
        ([], {"VSURGE_ROUTER_ROUTING": "fastest"}, "VSURGE_ROUTER_ROUTING='fastest': must be one of"),
        ([], {"VSURGE_ROUTER_PREFIX_EPSILON": "0"}, "VSURGE_ROUTER_PREFIX_EPSILON='0': must be > 0"),
        ([], {"VSURGE_ROUTER_ENDPOINT_SLICES": "sure"}, "expected true or false"),
    ],
)
def test_bad_settings_name_their_source(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(RouteConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(argv, env)


def test_routing_and_tenant_options() -> None:
    cfg = _config([])
    assert (cfg.routing, cfg.prefix_epsilon, cfg.max_attempts, cfg.load_poll_seconds) == (None, 0.25, 2, 0.2)
    assert (cfg.endpoint_slices, cfg.api_keys_file) == (True, None)
    assert _config(["--routing=auto"]).routing is None
    assert _config(["--routing", "prefix", "--prefix-epsilon", "0.5"]).prefix_epsilon == 0.5
    env = {"VSURGE_ROUTER_ROUTING": "round-robin", "VSURGE_ROUTER_ENDPOINT_SLICES": "false"}
    assert (_config([], env).routing, _config([], env).endpoint_slices) == ("round-robin", False)
    assert _config(["--routing=least-load", "--endpoint-slices"], env).routing == "least-load"
    assert _config(["--endpoint-slices"], env).endpoint_slices is True
    assert _config(["--api-keys-file=/k.yaml", "--load-poll-seconds=0"]).api_keys_file == "/k.yaml"


@pytest.mark.parametrize(
    "flag",
    [
        "--port=70000",
        "--max-attempts=0",
        "--log-level=loud",
        "--eject-seconds=-1",
        "--routing=fast",
        "--prefix-block-bytes=8",
        "--prefix-key-blocks=0",
        "--load-poll-seconds=-1",
    ],
)
def test_bad_flags_are_usage_errors(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _config([flag])
    assert e.value.code == 2 and flag.split("=")[0] in capsys.readouterr().err


def test_run_route_refuses_a_bad_static_file_and_a_missing_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    bad = tmp_path / "static.yaml"
    bad.write_text("models:\n  - name: a\n    upstreams: [localhost:8000]\n")
    assert run_route(parser.parse_args(["route", f"--static-config={bad}"])) == 2
    err = capsys.readouterr().err
    assert "static.yaml: models[0] (a).upstreams[0]" in err and "not an http(s) URL" in err
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  - name: a\n    keys: [sk-too-short]\n")
    good = tmp_path / "good.yaml"
    good.write_text("models: []\n")
    assert (
        run_route(
            parser.parse_args(
                [
                    "route",
                    "--no-kubernetes",
                    f"--static-config={good}",
                    f"--api-keys-file={keys}",
                ]
            )
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "keys.yaml: tenants[0] (a).keys[0]: a key must be at least 16" in err and "sk-too-short" not in err

    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run_route(parser.parse_args(["route", "--port=0"])) == 2
    assert "no Kubernetes configuration" in capsys.readouterr().err
