"""The Docker demo, built and run for real (marker ``docker``: its own lane, after the fast
and e2e lanes; skipped with the reason when no Docker daemon answers): the images from Debian packages
(``docker/build-images.sh``, no registry), then ``docker/compose.yml`` with the SuperLink
and 3 SuperNodes, insecure and with the TLS + authentication overlay, and a run of
``experiment=deploy-3`` for 2 rounds submitted from this machine that completes with 3 of 3
clients; ``down`` leaves no container. These are the README's Docker commands.

    python3 -m pytest -q -m docker      # ~6.5 min from no images on 2 cores, ~2 min with them
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.docker


def _docker_answers() -> str | None:
    """None when a Docker daemon answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker command (apt-get install -y docker.io)"
    try:
        out = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info did not answer in 30 s"
    return None if out.returncode == 0 else f"no Docker daemon answers ({out.stderr.strip()[-200:]})"


def _wait_for_supernodes(compose: list[str], count: int, timeout: float = 600.0) -> None:
    """Until each SuperNode container has registered with the SuperLink (its log's ``SuperNode
    ID`` line, Flower 1.39 and 1.42): on a busy machine a container can take longer to start
    than the run's ``wait_for_clients``, and the run would go on without it (a ``partial`` demo,
    which this test saw beside other work). The run itself waits as a user's does."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        registered = [i for i in range(count)
                      if "SuperNode ID" in subprocess.run([*compose, "logs", f"supernode-{i}"], capture_output=True,
                                                          text=True, timeout=120).stdout]
        if len(registered) == count:
            return
        assert time.monotonic() < deadline, f"only SuperNodes {registered} registered within {timeout:.0f} s"
        time.sleep(2)


def compose_command() -> list[str] | None:
    """``docker compose`` (v2) where it exists, else Debian's ``docker-compose`` (1.29)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def _wait_for_control_api(flwr_home: Path, timeout: float = 120.0) -> None:
    """``up -d`` returns before the SuperLink listens: ask ``flwr ls`` until it answers."""
    import time

    from ops.deployment.launch import FEDERATION, executable, flower_env

    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run([executable("flwr"), "ls", FEDERATION], env=flower_env(flwr_home),
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return
        assert time.monotonic() < deadline, f"the SuperLink's Control API did not answer in {timeout:.0f} s: {out.stdout}"
        time.sleep(2)


@pytest.fixture(scope="module")
def images() -> list[str]:
    why = _docker_answers()
    if why:
        pytest.skip(why)
    compose = compose_command()
    if compose is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    build = subprocess.run(["bash", str(REPO / "docker" / "build-images.sh")], capture_output=True,
                           text=True, timeout=1800)
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    return compose


def test_the_images_check_processes_through_proc_without_ps(images: list[str]) -> None:
    """The node runner's liveness checks work in the SuperNode image, which has no ``ps``."""
    code = ("import os, shutil, subprocess, sys; from ops.deployment.launch import pid_alive, process_tree, kill_tree; "
            "assert shutil.which('ps') is None; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "assert pid_alive(child.pid) and child.pid in process_tree(os.getpid()); "
            "kill_tree(child.pid); child.wait(); assert not pid_alive(child.pid); print('proc checks ok')")
    out = subprocess.run(["docker", "run", "--rm", "pflower-supernode", "python", "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "proc checks ok" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("mode", ["insecure", "tls"])
def test_compose_demo_runs_deploy3_for_two_rounds(images: list[str], mode: str, tmp_path: Path) -> None:
    from ops.deployment.launch import flwr_run, write_flwr_config

    docker = tmp_path / "docker"
    docker.mkdir()
    files = ["compose.yml"] + (["compose.tls.yml"] if mode == "tls" else [])
    for name in files:
        shutil.copy(REPO / "docker" / name, docker / name)
    if mode == "tls":   # the README's certificate command, into this copy's certs/
        subprocess.run([sys.executable, "-m", "ops.deployment.certs", "--out", str(docker / "certs"), "--host", "superlink",
                        "--supernodes", "3"], cwd=REPO, check=True, capture_output=True, timeout=120)
    project = f"pflower-test-{mode}"
    compose = [*images, "-p", project, *(a for f in files for a in ("-f", str(docker / f)))]
    run = f"demo-{mode}"
    try:
        up = subprocess.run([*compose, "up", "-d"], capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        home = write_flwr_config(tmp_path / "flwr-home", "127.0.0.1:9093",
                                 str(docker / "certs" / "ca.crt") if mode == "tls" else None).parent
        _wait_for_control_api(home)
        _wait_for_supernodes(compose, 3)
        code = flwr_run(REPO, home, f"experiment='deploy-3' rounds=2 run-name='{run}' results-root='/results'",
                        timeout=600)
        link = subprocess.run([*compose, "ps", "-q", "superlink"], capture_output=True, text=True).stdout.strip()
        got = subprocess.run(["docker", "cp", f"{link}:/results/{run}/summary.json", str(tmp_path / "summary.json")],
                             capture_output=True, text=True)
        if got.returncode != 0:
            logs = subprocess.run([*compose, "logs", "--tail", "40"], capture_output=True, text=True).stdout
            pytest.fail(f"no summary.json (flwr exit code {code}): {got.stderr}\n{logs[-6000:]}")
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["rounds"] == 2
        assert summary["clients_reported"] == 3 and summary["clients_expected"] == 3
        # the SuperLink runs pflower's entry point (10-minute task heartbeat, as `pflower deploy`'s),
        # and the image's Flower takes that patch
        top = subprocess.run(["docker", "top", link, "-eo", "pid,args"], capture_output=True, text=True, timeout=60)
        assert "pflower-superlink" in top.stdout and "--database" in top.stdout, top.stdout + top.stderr
        ttl = subprocess.run(["docker", "exec", link, "python", "-c",
                              "import sys; from common.flower_compat import lengthen_task_heartbeat_ttl as f; "
                              "sys.exit(0 if f() else 1)"], capture_output=True, text=True, timeout=120)
        assert ttl.returncode == 0, ttl.stdout + ttl.stderr
    finally:
        subprocess.run([*compose, "down", "-v"], capture_output=True, timeout=300)
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
                          capture_output=True, text=True).stdout.split()
    assert left == [], f"containers left after down: {left}"
