"""A simulation larger than one machine: ``pflower run --ray-address`` places the clients on an
existing Ray cluster. Here the cluster is a head and a second Ray node started with ``ray
start`` on this machine's loopback, one CPU each, so that the two client actors (one CPU each)
must be on different nodes; the test then reads from the cluster's own actor table which node
every ClientApp actor ran on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import pflower

from ops.resources import use_ray_cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray(*args: str, env: dict[str, str]) -> None:
    out = subprocess.run(["ray", *args], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def two_node_cluster(tmp_path: Path) -> Iterator[str]:
    """A head and a worker node on 127.0.0.1, in their own temp folder (so that no other
    Ray user on the machine finds this cluster by chance); stopped afterwards."""
    port = _free_port()
    env = {**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}
    temp = Path("/tmp") / f"ray-test-{port}"   # Ray's socket paths must stay short
    address = f"127.0.0.1:{port}"
    try:
        _ray("start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1",
             "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats", env=env)
        _ray("start", f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
             "--disable-usage-stats", env=env)
        yield address
    finally:
        _stop_cluster(f"127.0.0.1:{port}", str(port), str(temp))


def _stop_cluster(*marks: str) -> None:
    """Kill this cluster's processes only (``ray stop`` would stop every Ray on the machine):
    its GCS, raylets and agents name its address, port or temp folder on their command line;
    their workers and agents are their descendants."""
    from ops.deployment.launch import process_tree

    for _ in range(3):
        found = []
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ValueError):
                continue
            if proc.name.isdigit() and int(proc.name) != os.getpid() and any(m in cmd for m in marks) \
                    and ("ray" in cmd or "raylet" in cmd or "gcs_server" in cmd):
                found.append(int(proc.name))
        for pid in [p for root in found for p in process_tree(root)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not found:
            return
        time.sleep(1)


def _client_actor_nodes(address: str) -> list[str]:
    """The node of every ClientApp actor the cluster ran (its GCS keeps dead actors)."""
    probe = (
        "import json, ray\n"
        f"ray.init(address={address!r}, logging_level='ERROR')\n"
        "from ray._private.state import actors\n"
        "print(json.dumps([a['Address']['NodeID'] for a in actors().values()\n"
        "                  if 'ClientAppActor' in a.get('ActorClassName', '')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
def test_a_simulation_places_its_clients_on_both_nodes_of_a_ray_cluster(two_node_cluster: str,
                                                                        tmp_path: Path) -> None:
    out = pflower("run", "--ray-address", two_node_cluster, "--num-cpus", "1", "rounds=2",
                  "dataset.clients_per_domain=1", f"results_root={tmp_path}", "run_name=cluster", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"on the Ray cluster at {two_node_cluster}" in out.stdout
    summary = json.loads((tmp_path / "cluster" / "summary.json").read_text())
    assert len(summary["clients"]) == 4                     # every client trained and was evaluated
    nodes = _client_actor_nodes(two_node_cluster)
    assert len(set(nodes)) == 2, nodes                         # actors on the head and on the worker


def test_without_an_address_the_simulation_gets_a_private_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert use_ray_cluster(None) == "local" and os.environ["RAY_ADDRESS"] == "local"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert use_ray_cluster(None) == "10.0.0.1:6379"
    assert use_ray_cluster("127.0.0.1:7000") == "127.0.0.1:7000" == os.environ["RAY_ADDRESS"]
