"""The loopback deployment: certificates, node-config, and real SuperLink + 3 SuperNodes runs
over the installed Flower's Fleet API (HTTP on 1.42, gRPC on 1.39), insecure and TLS + SuperNode
authentication, Flower's own CLIs running pflower with the simulation's numbers, with a SuperNode killed and restarted
mid-run, an unregistered SuperNode refused, and every process stopped on Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from common.flower_compat import flower_series
from common.overrides import to_toml_run_config
from learning.storage import read_meta
from ops.deployment import deploy
from ops.deployment.certs import make_node_keys, make_tls, san_of, subject_alt_names
from ops.deployment.deploy import (
    Deployment,
    node_config,
    parse_node_config,
    run_result,
    supernode_command,
)
from ops.deployment.launch import SuperLink, free_port, kill_group, pid_alive

REPO = Path(__file__).resolve().parent.parent
# Small and tolerant of a busy 2-core machine: every message starts a ClientApp process.
FAST = ["wait_for_clients=120", "round_timeout=150", "eval_every=2", "train.local_epochs=1"]


# ---------------------------------------------------------------------- fast unit tests
def test_node_config_round_trips_through_flowers_parser(tmp_path):
    state = tmp_path / "state dir"  # a space must survive the quoting
    text = node_config(2, 3, state, data_root="/data/x", client_id="c-2")
    parsed = parse_node_config(text)
    assert parsed == {"partition-id": 2, "num-partitions": 3, "client-id": "c-2",
                      "state-dir": str(state), "data-root": "/data/x"}
    assert set(parsed) <= set(deploy.NODE_CONFIG_KEYS)
    assert parse_node_config(node_config(0, 1)) == {"partition-id": 0, "num-partitions": 1}
    with pytest.raises(ValueError, match="partition-id 3"):
        node_config(3, 3)


def test_supernode_command_flags(tmp_path):
    insecure = supernode_command("127.0.0.1:9092", node_config(0, 3), 1234)
    assert "--insecure" in insecure and "--root-certificates" not in insecure
    assert insecure[insecure.index("--port") + 1] == "1234"
    secure = supernode_command("link:9092", node_config(0, 3), root_certificates=tmp_path / "ca.crt",
                               private_key=tmp_path / "k")
    assert "--insecure" not in secure
    assert secure[secure.index("--root-certificates") + 1] == str(tmp_path / "ca.crt")
    assert secure[secure.index("--auth-supernode-private-key") + 1] == str(tmp_path / "k")


def test_certificates_have_sans_and_chain_to_the_ca(tmp_path):
    files = make_tls(tmp_path, ["10.1.2.3", "superlink", "127.0.0.1"])
    assert san_of(files.server_cert) == ["localhost", "127.0.0.1", "10.1.2.3", "superlink"]
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert oct(files.server_key.stat().st_mode)[-3:] == "600"
    with pytest.raises(ValueError, match="placeholder"):
        subject_alt_names(["<SUPERLINK_IP>"])


def test_node_keys_are_what_flower_accepts(tmp_path):
    from flwr.cli.supernode.register import try_load_public_key

    private, public = make_node_keys(tmp_path, "supernode-0")
    key = load_ssh_private_key(private.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert load_ssh_public_key(public.read_bytes()).public_numbers() == key.public_key().public_numbers()
    assert try_load_public_key(public)  # flwr supernode register's own check


def test_run_result_needs_a_fresh_summary(tmp_path):
    started = time.time() - 1
    ok, text, _ = run_result(tmp_path, started, 0)
    assert not ok and "did not complete" in text
    (tmp_path / "summary.json").write_text(json.dumps(
        {"accuracy_mean": 0.5, "accuracy_min": 0.25, "accuracy_std": 0.1}))
    assert run_result(tmp_path, started, 0).ok
    # flwr run killed (or its stream dropped) while the run went on to write its summary
    assert run_result(tmp_path, started, -9).ok
    assert not run_result(tmp_path, time.time() + 10, 0).ok  # stale summary
    assert not run_result(tmp_path, started, 0).said_why
    (tmp_path / "FAILED").write_text("RoundFailedError: boom")
    ok, text, said_why = run_result(tmp_path, started, 0)
    assert not ok and said_why and "boom" in text


def test_the_latest_run_is_the_last_submitted_whatever_flowers_order(monkeypatch):
    """A deployment's SuperLink holds every run of its jobs; Flower lists the newest first. The
    run ``pflower deploy`` follows after its stream ended must be the one just submitted."""
    from ops.deployment import launch

    listed = [{"run-id": "3", "status": "running", "pending-at": "2026-12-07 22:08:01.5Z"},
              {"run-id": "9", "status": "finished:completed", "pending-at": "2026-12-07 22:07:10.1Z"},
              {"run-id": "1", "status": "pending", "pending-at": "N/A"}]
    assert [r["run-id"] for r in launch.oldest_first(listed)] == ["1", "9", "3"]
    # Flower prints pending-at to the second: two runs of one second stay in submission order
    same_second = [{"run-id": "new", "pending-at": "2026-12-07 22:08:01Z"},
                   {"run-id": "old", "pending-at": "2026-12-07 22:08:01Z"}]
    assert [r["run-id"] for r in launch.oldest_first(same_second)] == ["old", "new"]

    class Listing:
        stdout = json.dumps({"success": True, "runs": listed})

    monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: Listing())
    monkeypatch.setattr(launch, "executable", lambda name: name)
    assert launch.run_status(Path("home")) == "running"


def test_a_run_followed_after_its_stream_ended_is_followed_to_its_end_or_its_timeout(tmp_path, monkeypatch, capsys):
    """``follow_after_stream_loss``: while the SuperLink says the run is active, its rounds are
    printed from metrics.jsonl; it returns the status that ended it; ``--timeout`` still holds."""
    import subprocess

    from ops.deployment import launch

    statuses = iter(["running", "running", "finished:completed"])
    monkeypatch.setattr(launch, "run_status", lambda home: next(statuses))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 1, "evaluate": {"accuracy_mean": 0.5}}) + "\n")
    assert launch.follow_after_stream_loss(-9, tmp_path, tmp_path, 2, poll_s=0.01) == "finished:completed"
    out = capsys.readouterr()
    assert "[round 1/2] accuracy mean 0.5000" in out.out and "the log stream ended (flwr exit code -9)" in out.err
    monkeypatch.setattr(launch, "run_status", lambda home: "running")
    with pytest.raises(subprocess.TimeoutExpired):
        launch.follow_after_stream_loss(-9, tmp_path, tmp_path, 2, poll_s=0.01, deadline=time.monotonic() + 0.05)
    assert launch.follow_after_stream_loss(-9, tmp_path, tmp_path, 2, poll_s=0.01, alive=lambda: False) == "running"


def test_deploy_refuses_a_dataset_that_does_not_match_the_nodes(capsys):
    code = deploy.main(["--nodes", "3", "strategy=fedavg"])  # digits-domains has 8 clients
    assert code == 2
    assert "--nodes 8" in capsys.readouterr().err


def test_deploy_fills_the_data_cache_before_any_supernode_starts(tmp_path, monkeypatch):
    """The SuperNodes' ClientApp processes on this machine then read their own split from the
    cache: none of them builds the federated data set."""
    from learning.datasets.cache import cache_key

    started = []

    class NoDeployment:
        def __init__(self, *args, **kwargs) -> None:
            started.append(sorted(p.name for p in tmp_path.joinpath("cache").iterdir()))
            raise RuntimeError("stop before starting processes")

    monkeypatch.setattr(deploy, "Deployment", NoDeployment)
    with pytest.raises(RuntimeError, match="stop before"):
        deploy.main(["--nodes", "3", "experiment=deploy-3", f"results_root={tmp_path}",
                     f"data_cache={tmp_path / 'cache'}"])
    from common.config import compose_config

    cfg = compose_config({"experiment": "deploy-3"})
    assert started == [[cache_key(cfg.dataset, int(cfg.seed))]]
    assert (tmp_path / "cache" / started[0][0] / "info.json").is_file()


# ---------------------------------------------------------------------- helpers
def _stop_tree(proc: subprocess.Popen) -> None:
    """Never leave a deployment behind, whatever happened in the test: Ctrl-C, then kill
    the command and every descendant that is still there."""
    from ops.deployment.launch import process_tree

    if proc.poll() is None:
        tree = process_tree(proc.pid)[1:]
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        for pid in [*tree, *process_tree(proc.pid)[1:]]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _processes_mentioning(*texts: str) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(t in line for t in texts)
            and line.split()[1][0] != "Z" and "ps -eo" not in line]


def _leftovers(work: Path) -> list[str]:
    """Processes of a deployment in ``work``: anything naming the folder, or the loopback
    ports of its SuperLink / SuperNodes (Flower's detached SuperExec and app processes)."""
    ports = set(re.findall(r"--port (\d+)", " ".join(
        p.read_text(errors="replace") for p in work.glob("supernode-*.log"))))
    ports |= set(re.findall(r"127\.0\.0\.1:(\d+)", " ".join(
        p.read_text(errors="replace") for p in work.glob("superlink/superlink.log"))))
    pattern = re.compile(r"127\.0\.0\.1:({})\b".format("|".join(ports))) if ports else None
    return [line for line in _processes_mentioning("flower-", "flwr", str(work))
            if str(work) in line or (pattern is not None and pattern.search(line))]


def _summary(results: Path, run_name: str) -> dict:
    path = results / run_name / "summary.json"
    assert path.exists(), f"no {path}"
    return json.loads(path.read_text())


def _check_summary(s: dict, rounds: int) -> None:
    assert s["status"] == "completed" and s["rounds"] == rounds
    assert set(s["clients"]) == {"0", "1", "2"}
    assert 0.0 <= s["accuracy_min"] <= s["accuracy_mean"] <= 1.0
    assert s["accuracy_mean"] > 0.15  # better than chance (0.1) after 2 rounds on digits


def _rounds(results: Path, run_name: str) -> list[dict]:
    path = results / run_name / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_cfg(strategy: str, run_name: str, results: Path, rounds: int = 2) -> str:
    return to_toml_run_config({"experiment": "deploy-3", "strategy": strategy, "rounds": str(rounds),
                               "run-name": run_name, "results-root": str(results)}, FAST)


def _run_past_round_one(dep: Deployment, results: Path, strategy: str, run_name: str,
                        rounds: int) -> tuple[threading.Thread, dict[str, int]]:
    """Submit a run in a thread and return once its round 1 is recorded (the thread puts
    flwr's exit code in the dict under "code")."""
    holder: dict[str, int] = {}
    runner = threading.Thread(target=lambda: holder.setdefault(
        "code", dep.run(_run_cfg(strategy, run_name, results, rounds=rounds), timeout=900)))
    runner.start()
    deadline = time.monotonic() + 900
    while not _rounds(results, run_name) and time.monotonic() < deadline and runner.is_alive():
        time.sleep(0.1)
    assert _rounds(results, run_name), "round 1 never finished:" + dep.logs()
    return runner, holder


# ---------------------------------------------------------------------- deployments
def test_a_stopped_superlink_takes_the_processes_of_its_runs_with_it(tmp_path):
    """A ServerApp started for a SuperLink's run lives in a session of its own: when the
    SuperLink was killed it is outside the SuperLink's process tree, and it must not outlive a
    restart (it would reconnect and go on with the run being resumed). Found by the SuperLink's
    runtime address: only this SuperLink's, not another one's on a port sharing its prefix."""
    link = SuperLink(simulation=False, http_port=free_port(), workdir=tmp_path)
    other = f"{link.host}:{link.http_port}1"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", "--runtime-api-address"]
    mine = subprocess.Popen([*sleeper, link.control_address, "--parent-pid", "1"], start_new_session=True)
    theirs = subprocess.Popen([*sleeper, other], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and mine.pid not in link.leftovers():
            time.sleep(0.05)
        assert link.leftovers() == [mine.pid]
        link.stop()                        # no SuperLink process of its own: only the leftovers
        assert mine.wait(timeout=10) == -signal.SIGKILL
        assert pid_alive(theirs.pid) and link.leftovers() == []
    finally:
        for proc in (mine, theirs):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)


@pytest.mark.e2e
def test_tls_auth_deployment_runs_fedavg_and_fedbn_via_the_cli(tmp_path):
    """``pflower deploy`` (default: TLS + SuperNode authentication): 3 SuperNodes with
    registered keys, FedAvg then FedBN for 2 rounds each against the same SuperLink, both
    with secure aggregation (SecAgg+) and distributed differential privacy of the shared part
    (docs/privacy.md; the other deployment tests run without them); results checked; no
    process left behind."""
    work = tmp_path / "work"
    results = tmp_path / "results"
    # DP needs Flower 1.42's accountant (the 1.39 lane runs this test without it); small noise: learns in 2 rounds
    dp = flower_series() != "1.39"
    private = ["privacy.secure_aggregation=secagg+"]    # SecAgg+ needs only Flower's primitives (1.39 too)
    # the clients add the noise (distributed DP, under SecAgg+), small: the run learns in 2 rounds
    private += ["privacy.dp=distributed", "privacy.noise_multiplier=0.001", "privacy.clip_norm=10"] if dp else []
    cmd = [sys.executable, "-m", "ops.cli", "deploy", "--workdir", str(work), "--timeout", "900",
           "experiment=deploy-3", "strategy=fedavg,fedbn", "rounds=2", f"results_root={results}", *private, *FAST]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("pflower deploy: done") == 2 and "(tls)" in out.stdout
    assert "https://" in (work / "superlink" / "superlink.log").read_text()  # TLS is on
    assert sorted(p.name for p in (work / "certs").glob("supernode-*.pub")) == \
        [f"supernode-{i}.pub" for i in range(3)]
    for strategy in ("fedavg", "fedbn"):
        runs = [p.name for p in results.iterdir() if p.name.startswith(f"deploy-3-{strategy}-")]
        assert len(runs) == 1, runs
        _check_summary(_summary(results, runs[0]), 2)
        recs = _rounds(results, runs[0])
        assert [r["round"] for r in recs] == [1, 2]
        assert all(sorted(r["sampled"]) == ["0", "1", "2"] and not r["failed"] for r in recs)
        # each round's shared part was summed under SecAgg+ by all three clients
        assert all(r["secure_aggregation"]["clients"] == 3 for r in recs), [r.get("secure_aggregation") for r in recs]
        assert _summary(results, runs[0])["secure_aggregation"]["protocol"] == "secagg+"
        if dp:      # each round clipped and noised by the clients, accounted by the server
            assert all(r["privacy"]["noise_added_by"] == "clients" for r in recs)
            spent = [r["privacy"]["epsilon"] for r in recs]
            assert 0 < spent[0] < spent[1] == _summary(results, runs[0])["privacy"]["epsilon"]
        # each SuperNode kept its state in its own node-config state-dir, under the results
        # (client state is data: it outlives the deployment's temporary folder)
        for i in range(3):
            folder = results / "supernode-state" / f"node-{i}" / runs[0] / str(i)
            assert list(folder.glob("state-r*.npz"))
            assert not list(folder.glob("secagg-round.json*")), "a round's secrets outlived the round"
    assert not _leftovers(work), "processes left behind"


@pytest.fixture(scope="module")
def fedbn_twin(tmp_path_factory) -> list[dict]:
    """The rounds of FedBN on ``deploy-3`` for 3 rounds in the simulation, where nothing fails:
    what a deployment disturbed by a restart must give, digit for digit."""
    results = tmp_path_factory.mktemp("twin")
    env = {k: v for k, v in os.environ.items() if k != "PFLOWER_FAULTS"}
    twin = subprocess.run([sys.executable, "-m", "ops.cli", "run", "experiment=deploy-3", "strategy=fedbn",
                           "rounds=3", "run_name=twin", f"results_root={results}", *FAST], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=env)
    assert twin.returncode == 0, twin.stdout[-2000:] + twin.stderr[-2000:]
    twins = _rounds(results, "twin")
    assert [r["failed"] for r in twins] == [{}, {}, {}]
    return twins


@pytest.mark.e2e
def test_insecure_deployment_survives_a_supernode_restart(tmp_path, fedbn_twin):
    """Insecure mode (asked for explicitly): FedAvg for 2 rounds, then FedBN for 3 rounds
    while SuperNode 1 is killed (its whole process group) after round 1 is recorded and
    restarted with the same node-config. Its round-2 train message is lost with the node (the
    SuperLink answers it ``NODE_UNAVAILABLE``); the ServerApp identifies the restarted node (a
    new node id) and sends that message again (``common/flower_compat.py: send_and_receive``;
    had the kill come before round 2 was sampled, round 2 would have waited for the new node
    instead: either way client 1 trains round 2 on its new node, which this asserts).
    The run completes with no client failed, client 1's private state continues (the restarted
    SuperNode trains on top of the state saved before the kill), and every client's numbers
    in every round are those of the same run in the simulation, where nothing restarts, digit
    for digit: the restart costs time, not results."""
    results = tmp_path / "results"
    with Deployment(3, "insecure", workdir=tmp_path / "work") as dep:
        code = dep.run(_run_cfg("fedavg", "fedavg", results), timeout=900)
        assert run_result(results / "fedavg", 0, code)[0], dep.logs()
        _check_summary(_summary(results, "fedavg"), 2)

        runner, holder = _run_past_round_one(dep, results, "fedbn", "fedbn", rounds=3)
        old_pid = dep.nodes[1].proc.pid
        dep.nodes[1].stop()
        assert not _processes_mentioning(str(dep.state_dir(1)))  # the whole group is gone
        node = dep.nodes[1].start()
        assert node.proc.pid != old_pid and node.starts == 2
        runner.join(timeout=960)
        assert holder.get("code") == 0, dep.logs()

    assert run_result(results / "fedbn", 0, 0)[0]
    recs = _rounds(results, "fedbn")
    assert [r["round"] for r in recs] == [1, 2, 3]
    assert [r["failed"] for r in recs] == [{}, {}, {}], [r["failed"] for r in recs]
    assert all(sorted(r["sampled"]) == ["0", "1", "2"] for r in recs)
    assert recs[-1]["clients"].keys() == {"0", "1", "2"}  # every client evaluated at the end
    state_dir = tmp_path / "work" / "nodes" / "1" / "state" / "fedbn" / "1"
    meta = read_meta(max(state_dir.glob("state-r*.npz")))
    # state saved by the restarted process descends from the one saved before the kill
    assert meta["trained_rounds"] == [1, 2, 3], meta
    log = (tmp_path / "work" / "supernode-1.log").read_text().split("===== pflower: start #2")[1]
    # the restarted SuperNode was identified, then trained rounds 2 (the message sent again) and 3
    assert log.count("Receiving: query message") >= 1 and log.count("Receiving: train message") == 2, log[-3000:]
    assert not _leftovers(tmp_path / "work")

    twins = fedbn_twin
    for deployed, simulated in zip(recs, twins, strict=True):
        assert deployed.get("clients") == simulated.get("clients"), deployed["round"]   # none in round 1
    # the restarted client's accuracy in the kill's round is the undisturbed one (not the 0.0 of old)
    assert recs[1]["clients"]["1"] == twins[1]["clients"]["1"] and recs[1]["clients"]["1"]["accuracy"] > 0.3


@pytest.mark.e2e
def test_a_runner_that_dies_during_a_task_is_replaced_and_its_message_sent_again(
        tmp_path, monkeypatch, fedbn_twin):
    """Insecure deployment, FedBN for 3 rounds; the ClientApp runner of SuperNode 1 exits in
    the middle of client 1's round-2 training (``exit_clients``, once), while its SuperNode
    lives on. Found by bench/chaos.py: the SuperNode then waited 10 minutes for the task's
    heartbeats and the round lost the client. Now the stand-in that held the task leaves its
    token, the SuperNode fails the task at once (``CLIENT_APP_CRASHED``) and starts another
    runner (ops/node/runner.py: RunnerKeeper), and the ServerApp sends the message again: no
    client fails, and every round equals the fault-free simulation's, digit for digit."""
    results = tmp_path / "results"
    exited = tmp_path / "exited"
    monkeypatch.setenv("PFLOWER_FAULTS", json.dumps({"exit_clients": ["1"], "exit_round": 2,
                                                     "exit_once": str(exited)}))
    with Deployment(3, "insecure", workdir=tmp_path / "work") as dep:
        code = dep.run(_run_cfg("fedbn", "fedbn", results, rounds=3), timeout=900)
        assert code == 0, dep.logs()
    assert exited.exists()                               # the runner did exit, in round 2
    recs = _rounds(results, "fedbn")
    assert [r["failed"] for r in recs] == [{}, {}, {}], [r["failed"] for r in recs]
    log = (tmp_path / "work" / "supernode-1.log").read_text()
    assert "exited (code 1); starting another" in log and "it is failed now" in log, log[-3000:]
    meta = read_meta(max((tmp_path / "work" / "nodes" / "1" / "state" / "fedbn" / "1").glob("state-r*.npz")))
    assert meta["trained_rounds"] == [1, 2, 3], meta
    for deployed, simulated in zip(recs, fedbn_twin, strict=True):
        assert deployed.get("clients") == simulated.get("clients"), deployed["round"]
    assert not _leftovers(tmp_path / "work")


@pytest.mark.e2e
def test_a_supernode_killed_for_good_is_one_missing_client_and_slows_one_round(tmp_path):
    """Insecure deployment, FedAvg for 4 rounds; SuperNode 2 is killed after round 1 and
    never comes back. The run completes on the other two, says it is partial with client 2
    missing once (by its id, with a true reason), and the rounds after the kill are not
    each held up by the 120 s wait for clients."""
    results = tmp_path / "results"
    with Deployment(3, "insecure", workdir=tmp_path / "work") as dep:
        runner, holder = _run_past_round_one(dep, results, "fedavg", "dead", rounds=4)
        dep.nodes[2].stop()
        killed_at = _rounds(results, "dead")[0]["elapsed_s"]
        runner.join(timeout=960)
        assert holder.get("code") == 0, dep.logs()
    s = _summary(results, "dead")
    assert s["status"] == "partial" and (s["clients_expected"], s["clients_reported"]) == (3, 2)
    assert list(s["clients_missing"]) == ["2"] and "2" not in s["clients"]
    assert not any(k.startswith("node-") for k in s["client_failures"]), s["client_failures"]
    recs = _rounds(results, "dead")
    assert [r["round"] for r in recs] == [1, 2, 3, 4]
    # three rounds after the kill, each with a train and (rounds 2, 4) an evaluation step:
    # far less than one 120 s wait per step
    assert recs[-1]["elapsed_s"] - killed_at < 200, [r["elapsed_s"] for r in recs]


@pytest.mark.e2e
def test_unregistered_supernodes_are_refused_and_ctrl_c_stops_everything(tmp_path):
    """While ``pflower deploy`` (TLS + auth) runs, a SuperNode with an unregistered key and
    one with no key are refused; then Ctrl-C stops every process it started."""
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "ops.cli", "deploy", "--workdir", str(work),
           "experiment=deploy-3", "strategy=fedavg", "rounds=50", f"results_root={tmp_path}", *FAST]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _refuse_and_interrupt(proc, work, tmp_path)
    finally:
        _stop_tree(proc)


def _refuse_and_interrupt(proc: subprocess.Popen, work: Path, tmp_path: Path) -> None:
    lines = []
    for line in proc.stdout:  # wait until the deployment is up and the run submitted
        lines.append(line)
        if "pflower deploy: flwr run" in line:
            break
    else:
        pytest.fail("".join(lines[-40:]))
    fleet = re.search(r"SuperLink fleet (\S+) ", "".join(lines)).group(1)
    certs = work / "certs"
    rogues = []
    for name, key in (("unregistered", make_node_keys(tmp_path, "rogue")[0]), ("keyless", None)):
        log = tmp_path / f"{name}.log"
        rogues.append((name, log, subprocess.Popen(
            supernode_command(fleet, node_config(0, 3, tmp_path / "rogue-state"), _port(),
                              certs / "ca.crt", key),
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)))
    reasons = {"unregistered": "[code: 2004] Failed to activate SuperNode",
               "keyless": "SuperNode authentication is enabled. All SuperNodes must be registered"}
    try:
        for name, log, rogue in rogues:
            assert rogue.wait(timeout=300) != 0
            text = log.read_text()
            assert reasons[name] in text and "Exit Code: 305" in text, text[-2000:]  # 305: refused
    finally:
        for _, _, rogue in rogues:
            kill_group(rogue)
    assert proc.poll() is None and _processes_mentioning(str(work)), "the deployment should still run"
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, "".join(lines[-20:]) + rest[-3000:]
    assert "interrupted" in rest
    left = _leftovers(work)
    assert not left, left


def _port() -> int:
    return free_port()


@pytest.mark.e2e
def test_flowers_own_clis_run_pflower_over_tls_with_the_simulations_numbers(tmp_path):
    """Flower's own ``flower-superlink`` and three ``flower-supernode`` (its 3 s idle waits and a
    ``flwr-clientapp`` process per message, TLS + SuperNode authentication), the run submitted
    with ``flwr run . pflower --stream``, as a Flower user does it on either release's own
    transport (HTTP on 1.42, gRPC on 1.39); then the same configuration in the simulation
    (``pflower run``): every client's accuracies the same, digit for digit."""
    results = tmp_path / "results"
    with Deployment(3, "tls", workdir=tmp_path / "work", stock=True) as dep:
        assert "flower-superlink" in dep.link.command()[0]
        assert all("flower-supernode" in node.command[0] for node in dep.nodes)
        code = dep.run(_run_cfg("fedavg", "stock", results), timeout=900)
        ok, why, _ = run_result(results / "stock", 0, code)
        assert ok, why + dep.logs()
    deployed = _summary(results, "stock")
    _check_summary(deployed, 2)
    assert not _leftovers(tmp_path / "work")
    sim = subprocess.run([sys.executable, "-m", "ops.cli", "run", "experiment=deploy-3", "strategy=fedavg",
                          "rounds=2", "run_name=sim", f"results_root={results}", *FAST],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert sim.returncode == 0, sim.stdout[-2000:] + sim.stderr[-2000:]
    simulated = _summary(results, "sim")
    assert deployed["clients"] == simulated["clients"]
    assert deployed["accuracy_mean"] == simulated["accuracy_mean"]


def test_a_failed_deployment_run_is_told_to_resume_only_when_it_has_a_checkpoint(tmp_path):
    """Found by bench/chaos.py: a run killed before its first checkpoint (no run folder yet) was
    told ``resume with: pflower deploy resume=<folder>``, which refuses a folder that is not there."""
    import argparse

    from server.checkpoint import save_checkpoint

    args = argparse.Namespace(mode="tls", nodes=None, data_root=None)
    run_dir = tmp_path / "run"
    assert deploy.go_on_hint(run_dir, args).startswith("no checkpoint was written; run the same command again")
    save_checkpoint(run_dir, 1, {"global": {}}, {"strategy": "fedavg"})
    assert deploy.go_on_hint(run_dir, args) == f"resume with: pflower deploy resume={run_dir}"
