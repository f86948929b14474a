"""The LeaderWorkerSet's pods set exactly what `vsurge serve` reads to join a multi-host group."""

from __future__ import annotations

import re

from vsurge.cli.main import SERVE_OPTIONS, parse_serve_config
from vsurge.multihost import group as distributed
from vsurge.multihost.channel import SECRET_ENV
from vsurge_operator import manifests, spec


def _model() -> spec.ModelSpec:
    body = {
        "metadata": {"name": "big", "namespace": "team", "uid": "u", "generation": 1},
        "spec": {
            "model": {"source": "default"},
            "image": "img:1",
            "tpu": {"accelerator": "tpu-v6e-slice", "topology": "4x4"},
        },
    }
    return spec.parse(body)


def _containers():
    t = manifests.leader_worker_set(_model())["spec"]["leaderWorkerTemplate"]
    return t, {role: t[role]["spec"]["containers"][0] for role in ("leaderTemplate", "workerTemplate")}


def _expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def test_every_vsurge_variable_of_a_group_pod_is_a_serve_option():
    served = {o.env for o in SERVE_OPTIONS}
    _, containers = _containers()
    for c in containers.values():
        names = {e["name"] for e in c["env"] if e["name"].startswith("VSURGE_")}
        # the step lane's secret is a file named by the environment only (a secret never goes on a command
        # line); the multi-host package reads that variable
        assert names - served <= {"VSURGE_CACHE_DIR", "VSURGE_CREDENTIALS_DIR", SECRET_ENV}, names - served
        assert SECRET_ENV in names
        assert set(manifests.GROUP_ENV) <= names


def test_the_group_variables_expand_to_the_group_the_server_joins():
    t, containers = _containers()
    assert t["restartPolicy"] == "RecreateGroupOnPodRestart" and t["size"] == 4
    for index, c in enumerate(containers.values()):
        # what the LeaderWorkerSet controller prepends to the container's environment
        lws = {"LWS_LEADER_ADDRESS": "big-0.big.team", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": str(index)}
        assert set(lws) == set(distributed.LWS_VARIABLES)
        env = dict(lws)
        for e in c["env"]:
            if "value" in e:
                env[e["name"]] = _expand(e["value"], env)
        cfg = parse_serve_config([], env=env)
        group = distributed.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id, env={})
        assert group.coordinator_address == f"big-0.big.team:{distributed.COORDINATOR_PORT}"
        assert (group.num_processes, group.process_id) == (4, index)
        # the server, reading the LeaderWorkerSet's variables alone, joins the same group
        alone = distributed.resolve(env=lws)
        assert (alone.coordinator_address, alone.num_processes, alone.process_id) == (
            group.coordinator_address,
            4,
            index,
        )
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["coordinator"] == distributed.COORDINATOR_PORT == manifests.COORDINATOR_PORT
        assert ports["step-lane"] == distributed.COORDINATOR_PORT + distributed.LANE_PORT_OFFSET


def test_only_the_leader_serves_and_is_probed():
    m = _model()
    _, containers = _containers()
    assert "readinessProbe" in containers["leaderTemplate"]
    assert "readinessProbe" not in containers["workerTemplate"]
    selector = manifests.service(m)["spec"]["selector"]
    assert selector[manifests.LWS_WORKER_INDEX_LABEL] == "0"
