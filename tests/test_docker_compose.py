"""docker/compose.yml (+ compose.tls.yml) agree with the loopback deployment the tests run.

No Docker engine exists on the build machine, so the compose files are parsed with PyYAML,
merged the way ``docker compose -f a -f b`` merges them (``command`` replaced, ``volumes``
merged by container path, new services added), and every service's command, ports,
volumes and node-config are checked against ``ops/deployment/deploy.py``: the same functions
build the SuperLink and SuperNode command lines for the loopback deployment.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from common.config import compose_config
from learning.datasets.config import num_clients
from ops.deployment import deploy
from ops.deployment.deploy import (
    CONTAINER_CERTS,
    CONTAINER_DATA,
    CONTAINER_RESULTS,
    CONTAINER_STATE,
    CONTROL_PORT,
    FLEET_PORT,
    SUPERLINK_SERVICE,
    Deployment,
    container_superlink_command,
    container_supernode_command,
    parse_node_config,
)

DOCKER = Path(__file__).resolve().parent.parent / "docker"


def load(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def volumes_by_target(service: dict) -> dict[str, str]:
    """container path -> source (named volume or host path), dropping ':ro'."""
    out = {}
    for v in service.get("volumes", []):
        source, target, *mode = v.split(":")
        out[target] = source + (":" + mode[0] if mode else "")
    return out


def merge(base: dict, overlay: dict) -> dict:
    """``docker compose -f base -f overlay`` for the keys used here."""
    services = {k: dict(v) for k, v in base["services"].items()}
    for name, over in overlay.get("services", {}).items():
        svc = services.setdefault(name, {})
        for key, value in over.items():
            if key == "volumes":
                vols = {**volumes_by_target(svc), **volumes_by_target(over)}
                svc["volumes"] = [f"{s.split(':')[0]}:{t}" + (":ro" if s.endswith(":ro") else "")
                                  for t, s in vols.items()]
            else:
                svc[key] = value
    return {**base, "services": services}


def supernodes(compose: dict) -> dict[int, dict]:
    out = {}
    for name, svc in compose["services"].items():
        m = re.fullmatch(r"supernode-(\d+)", name)
        if m:
            out[int(m.group(1))] = svc
    return dict(sorted(out.items()))


CASES = {"insecure": lambda: load("compose.yml"),
         "tls": lambda: merge(load("compose.yml"), load("compose.tls.yml"))}


@pytest.mark.parametrize("mode", list(CASES))
def test_superlink_service_matches_deploy(mode):
    compose = CASES[mode]()
    link = compose["services"][SUPERLINK_SERVICE]
    assert link["command"] == container_superlink_command(mode)
    # no --fleet-api-address: deprecated on Flower 1.42, and 1.39's default is 0.0.0.0:FLEET_PORT
    assert "--fleet-api-address" not in link["command"]
    # published on loopback unless PFLOWER_BIND says otherwise
    assert set(link["ports"]) == {f"${{PFLOWER_BIND:-127.0.0.1}}:{FLEET_PORT}:{FLEET_PORT}",
                                  f"${{PFLOWER_BIND:-127.0.0.1}}:{CONTROL_PORT}:{CONTROL_PORT}"}
    vols = volumes_by_target(link)
    db = link["command"][link["command"].index("--database") + 1]
    assert Path(db).parent == Path(CONTAINER_STATE) and CONTAINER_STATE in vols
    assert CONTAINER_RESULTS in vols
    assert link["build"]["dockerfile"] == "docker/Dockerfile.superlink"
    if mode == "tls":
        assert vols[CONTAINER_CERTS] == "./certs:ro"
        for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
            assert link["command"][link["command"].index(flag) + 1].startswith(CONTAINER_CERTS + "/")
        assert "--insecure" not in link["command"] and "--enable-supernode-auth" in link["command"]
    else:
        assert "--insecure" in link["command"]


@pytest.mark.parametrize("mode", list(CASES))
def test_supernode_services_match_deploy(mode):
    compose = CASES[mode]()
    nodes = supernodes(compose)
    n = len(nodes)
    assert list(nodes) == list(range(n)) and n == 3
    # the demo's dataset has exactly one client per SuperNode
    assert num_clients(compose_config({"experiment": "deploy-3"}).dataset) == n
    sources = []
    for i, svc in nodes.items():
        assert svc["command"] == container_supernode_command(i, n, mode)
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.supernode"
        assert SUPERLINK_SERVICE in svc["depends_on"] and svc["restart"] == "on-failure"
        assert "ports" not in svc  # SuperNodes only dial out
        cmd = svc["command"]
        # Flower 1.42's HTTP Fleet API unless PFLOWER_FLEET_PORT names 1.39's gRPC one
        assert cmd[cmd.index("--superlink") + 1] == f"{SUPERLINK_SERVICE}:${{PFLOWER_FLEET_PORT:-{CONTROL_PORT}}}"
        cfg = parse_node_config(cmd[cmd.index("--node-config") + 1])
        assert set(cfg) <= set(deploy.NODE_CONFIG_KEYS)
        assert cfg["partition-id"] == i and cfg["num-partitions"] == n
        # the same node-config keys the loopback deployment gives its SuperNodes
        assert set(cfg) == set(parse_node_config(Deployment(n, mode, workdir=Path("/tmp"), data_root="/d").node_config(i)))
        vols = volumes_by_target(svc)
        assert cfg["state-dir"] == CONTAINER_STATE and cfg["data-root"] == CONTAINER_DATA
        assert vols[CONTAINER_STATE] == f"supernode-{i}-state" and vols[CONTAINER_DATA] == f"supernode-{i}-data"
        sources += [vols[CONTAINER_STATE], vols[CONTAINER_DATA]]
        if mode == "tls":
            assert vols[CONTAINER_CERTS] == "./certs:ro"
            assert cmd[cmd.index("--auth-supernode-private-key") + 1] == f"{CONTAINER_CERTS}/supernode-{i}"
    assert len(set(sources)) == len(sources)  # every SuperNode has its own volumes
    assert set(sources) <= set(compose["volumes"])


def test_tls_overlay_registers_every_supernode_key():
    compose = merge(load("compose.yml"), load("compose.tls.yml"))
    reg = compose["services"]["register"]
    script = " ".join(reg["command"])
    assert "flwr supernode register" in script and f"superlink:{CONTROL_PORT}" in script
    loop = re.search(r"for i in ([\d ]+); do", script)
    assert loop and [int(x) for x in loop.group(1).split()] == list(supernodes(compose))
    assert "/certs/supernode-$$i.pub" in script and "root-certificates = \"/certs/ca.crt\"" in script


def test_dockerfiles_expose_and_mount_what_compose_uses():
    link = (DOCKER / "Dockerfile.superlink").read_text()
    node = (DOCKER / "Dockerfile.supernode").read_text()
    assert f"EXPOSE {FLEET_PORT} {CONTROL_PORT}" in link
    assert f'VOLUME ["{CONTAINER_STATE}", "{CONTAINER_RESULTS}"]' in link
    assert f'VOLUME ["{CONTAINER_DATA}", "{CONTAINER_STATE}"]' in node
    for text in (link, node):
        assert "ARG BASE_IMAGE=" in text and "FROM ${BASE_IMAGE}" in text
        assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in text
        for pkg in ("conf", "learning", "client", "strategies", "server"):
            assert f"COPY {pkg} ./{pkg}" in text
