"""The command line, configuration, handler registration, and the `kopf run` entrypoint."""

from __future__ import annotations

import subprocess
import sys

import kopf
import pytest
from kmock_harness import REPO, wait_for
from operator_harness import OperatorProcess, inference_model

from vsurge_operator import __main__ as cli
from vsurge_operator import handlers, kube
from vsurge_operator.config import OperatorConfig


def test_namespaces_and_scope():
    args = cli.build_parser().parse_args(["-n", "team-a", "--namespace=team-b"])
    assert args.namespaces == ["team-a", "team-b"]
    assert cli.build_parser().parse_args(["--all-namespaces"]).namespaces == []
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["-n", "a", "-A"])


def test_flags_override_the_environment():
    env = {
        "VSURGE_OPERATOR_RESYNC_SECONDS": "60",
        "VSURGE_OPERATOR_DEFAULT_IMAGE": "img:env",
        "VSURGE_OPERATOR_RETRY_DELAY_SECONDS": "2.5",
    }
    base = OperatorConfig.from_env(env)
    assert (base.resync_seconds, base.default_image, base.retry_delay_seconds) == (60, "img:env", 2.5)
    args = cli.build_parser().parse_args(["--resync-seconds=5", "--default-image=img:flag"])
    config = cli.config_from_args(args, base)
    assert (config.resync_seconds, config.default_image, config.retry_delay_seconds) == (5, "img:flag", 2.5)
    assert OperatorConfig.from_env({}) == OperatorConfig()


def test_register_wires_every_handler():
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig(resync_seconds=7))
    changing = {h.id for h in registry._changing.get_all_handlers()}
    spawning = {h.id: h for h in registry._spawning.get_all_handlers()}
    assert changing == {"reconcile", "forget"}
    assert set(spawning) == {"resync", "autoscaler"}
    assert spawning["resync"].interval == 7
    activities = {h.id for h in registry._activities.get_all_handlers()}
    assert {
        "register.<locals>.configure",
        "register.<locals>.login",
        "register.<locals>.cleanup",
    } <= activities


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'service'}"}
    return subprocess.run(
        [sys.executable, "-m", "vsurge_operator", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )


def test_module_entrypoint_help_and_version():
    out = _run("--help")
    assert out.returncode == 0 and "--all-namespaces" in out.stdout and "--liveness" in out.stdout
    out = _run("--version")
    assert out.returncode == 0 and "vsurge-operator" in out.stdout


@pytest.mark.timeout(60)
def test_kopf_run_entrypoint(cluster, namespace, tmp_path):
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    proc = OperatorProcess(
        kubeconfig,
        tmp_path / "kopf-run.log",
        [f"--namespace={namespace}"],
        kopf_run=True,
        env={"VSURGE_OPERATOR_DEFAULT_IMAGE": "img:default", "VSURGE_OPERATOR_RESYNC_SECONDS": "1"},
    )
    try:
        proc.start()
        body = inference_model("viakopf", namespace)
        del body["spec"]["image"]  # taken from VSURGE_OPERATOR_DEFAULT_IMAGE
        cluster.client().create(kube.INFERENCE_MODEL, namespace, body)
        dep = wait_for(
            lambda: cluster.obj("apps/v1/deployments", namespace, "viakopf"),
            20,
            message=f"Deployment created by `kopf run`:\n{proc.log()}",
        )
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "img:default"
    finally:
        proc.stop()
