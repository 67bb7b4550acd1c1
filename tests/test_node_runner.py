"""``pflower-supernode`` and its ClientApp runner, without a deployment (the deployment
tests in test_deploy.py run them for real): the stand-in ``flwr-clientapp`` hands its task to
the runner or falls back to Flower's; which FABs run in process; another FAB's ClientApp in a
process of its own, its Message carried without pickle; the SuperNode's shortened waits."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from common.flower_compat import capped_time, object_pull_backoff, shorten_object_pull_backoff
from ops.node import runner as node_runner
from ops.node.supernode import split_poll_interval, use_runner

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- the stand-in
@pytest.fixture()
def runner_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(node_runner.DIR_ENV, str(tmp_path))
    return node_runner.runner_dir()


def _run_stand_in(stand_in: Path, env: dict[str, str], args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([str(stand_in), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60, check=False, input=stdin)


def test_stand_in_hands_the_task_to_the_runner_and_returns_its_exit_code(runner_dir: Path) -> None:
    stand_in = node_runner.write_stand_in(runner_dir / "bin")
    address = runner_dir / "runner-test.sock"
    got: list[list[str]] = []
    with Listener(str(address), family="AF_UNIX", authkey=node_runner.auth_key(runner_dir)) as listener:
        def serve() -> None:
            with listener.accept() as conn:
                got.append(conn.recv_bytes().decode().split("\0"))
                conn.send_bytes(b"7")
        thread = threading.Thread(target=serve)
        thread.start()
        out = _run_stand_in(stand_in, {node_runner.RUNNER_ENV: str(address),
                                       node_runner.REAL_CLIENTAPP_ENV: "/nonexistent"},
                            ["--runtime-api-address", "127.0.0.1:1", "--token", "abc", "--insecure"])
        thread.join(timeout=30)
    assert out.returncode == 7, out.stderr
    assert got == [["--runtime-api-address", "127.0.0.1:1", "--token", "abc", "--insecure"]]
    assert not node_runner.ended_dir(address).exists()   # the runner answered: no task to fail


def _real_clientapp(folder: Path, body: str) -> Path:
    """A stand-in for Flower's own flwr-clientapp: prints its arguments and what it read from
    stdin (the token of ``--token-stdin``), then runs ``body``."""
    real = folder / "real-flwr-clientapp"
    real.write_text(f"#!{sys.executable}\nimport os, signal, sys\n"
                    "stdin = sys.stdin.read() if '--token-stdin' in sys.argv else ''\n"
                    f"print('REAL', *sys.argv[1:], stdin, flush=True)\n{body}\n")
    real.chmod(0o755)
    return real


def test_stand_in_runs_flowers_clientapp_when_no_runner_listens(runner_dir: Path, tmp_path: Path) -> None:
    stand_in = node_runner.write_stand_in(runner_dir / "bin")
    gone = runner_dir / "runner-gone.sock"
    real = _real_clientapp(tmp_path, "sys.exit(0)")
    out = _run_stand_in(stand_in, {node_runner.RUNNER_ENV: str(gone), node_runner.REAL_CLIENTAPP_ENV: str(real)},
                        ["--token", "xyz"])
    assert out.returncode == 0 and out.stdout.strip() == "REAL --token xyz"
    assert not node_runner.ended_dir(gone).exists()      # it finished its task: nothing to fail
    # Flower's own reads the token from stdin, as the SuperExec gave it
    out = _run_stand_in(stand_in, {node_runner.RUNNER_ENV: str(gone), node_runner.REAL_CLIENTAPP_ENV: str(real)},
                        ["--insecure", "--token-stdin"], stdin="t0ken")
    assert out.returncode == 0 and out.stdout.strip() == "REAL --insecure --token-stdin t0ken"
    assert not node_runner.ended_dir(gone).exists()


@pytest.mark.parametrize(("body", "code", "left"), [("os.kill(os.getpid(), signal.SIGKILL)", 137, True),
                                                     ("sys.exit(3)", 3, False)])
def test_stand_in_leaves_its_token_when_flowers_clientapp_is_killed(
        runner_dir: Path, tmp_path: Path, body: str, code: int, left: bool) -> None:
    """The fallback killed during its task leaves the token, as a dead runner's stand-in does:
    the keeper fails the task at once (a finished task's token is ignored). One that exits with
    an error answered its task itself, or failed before it (a bad argument): failing that task
    would only start it again at once, so it is left to Flower."""
    stand_in = node_runner.write_stand_in(runner_dir / "bin")
    gone = runner_dir / "runner-gone.sock"
    token = "beef" * 64
    out = _run_stand_in(stand_in, {node_runner.RUNNER_ENV: str(gone),
                                   node_runner.REAL_CLIENTAPP_ENV: str(_real_clientapp(tmp_path, body))},
                        ["--token", token])
    assert out.returncode == code, out.stderr
    assert ("ended by signal 9" in out.stderr) == left
    ended = node_runner.ended_dir(gone)
    assert ([p.read_text() for p in ended.iterdir()] if ended.exists() else []) == ([token] if left else [])


def test_stand_in_passes_a_stop_to_flowers_clientapp_once(runner_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to the stand-in (the SuperExec stopping a task) reaches Flower's flwr-clientapp,
    which runs in a process group of its own (a signal to the stand-in's group reaches it once)."""
    stand_in = node_runner.write_stand_in(runner_dir / "bin")
    marker = tmp_path / "terms"
    real = _real_clientapp(tmp_path, f"def term(n, f):\n    open({str(marker)!r}, 'a').write('T')\n    time.sleep(1)\n    sys.exit(0)\n"
                                     "import time\nsignal.signal(signal.SIGTERM, term)\nprint('READY', flush=True)\ntime.sleep(60)")
    proc = subprocess.Popen([str(stand_in), "--token", "abc"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, node_runner.RUNNER_ENV: str(runner_dir / "runner-gone.sock"),
                                 node_runner.REAL_CLIENTAPP_ENV: str(real)}, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("REAL")   # it runs
        assert proc.stdout.readline().strip() == "READY"   # its handler is set
        os.killpg(proc.pid, signal.SIGTERM)   # the stand-in's whole group
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert marker.read_text() == "T"
    assert not node_runner.ended_dir(runner_dir / "runner-gone.sock").exists()   # it ended its task itself


def test_flowers_clientapp_dies_with_a_stand_in_killed_outright(runner_dir: Path, tmp_path: Path) -> None:
    """A SIGKILL to the stand-in's group (a SuperNode stopped hard) does not reach Flower's
    flwr-clientapp, in a session of its own: it dies with the stand-in, not left running."""
    stand_in = node_runner.write_stand_in(runner_dir / "bin")
    real = _real_clientapp(tmp_path, "print(os.getpid(), flush=True)\nimport time\ntime.sleep(60)")
    proc = subprocess.Popen([str(stand_in), "--token", "abc"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, node_runner.RUNNER_ENV: str(runner_dir / "runner-gone.sock"),
                                 node_runner.REAL_CLIENTAPP_ENV: str(real)}, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("REAL")
    child = int(proc.stdout.readline())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"   # a zombie (not yet reaped) is dead
    except OSError:
        return False


def test_stand_in_leaves_its_token_when_the_runner_dies_during_its_task(runner_dir: Path) -> None:
    """The runner takes the task and ends without an answer (killed): the stand-in exits 1 and
    leaves the task's token for the SuperNode's keeper, which fails the task at once."""
    stand_in = node_runner.write_stand_in(runner_dir / "bin")
    address = runner_dir / "runner-test.sock"
    token = "c0ffee" * 43   # Flower's are 256 characters: longer than a file name may be
    with Listener(str(address), family="AF_UNIX", authkey=node_runner.auth_key(runner_dir)) as listener:
        def serve_and_die() -> None:
            with listener.accept() as conn:
                conn.recv_bytes()   # the task taken, then the runner is gone
        thread = threading.Thread(target=serve_and_die)
        thread.start()
        out = _run_stand_in(stand_in, {node_runner.RUNNER_ENV: str(address),
                                       node_runner.REAL_CLIENTAPP_ENV: "/nonexistent"},
                            ["--runtime-api-address", "127.0.0.1:1", "--token-stdin", "--insecure"], stdin=token)
        thread.join(timeout=30)
    assert out.returncode == 1, out.stderr
    assert [p.read_text() for p in node_runner.ended_dir(address).iterdir()] == [token]


class _Exited:
    """A runner process that has exited."""

    pid, returncode = 4242, -9

    def poll(self) -> int:
        return self.returncode


def test_the_keeper_restarts_a_dead_runner_and_fails_the_tasks_it_died_with(
        runner_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    address = runner_dir / "runner-1.sock"
    started: list[int] = []
    monkeypatch.setattr(node_runner, "start_runner", lambda owner: (started.append(owner) or _Exited(), address))
    failed: list[str] = []
    monkeypatch.setattr(node_runner, "fail_task_now", lambda token: failed.append(token) or token == "ab12")
    keeper = node_runner.RunnerKeeper(owner=1)
    ended = node_runner.ended_dir(address)
    ended.mkdir()
    (ended / "101").write_text("ab12")      # a task still running when the runner died
    (ended / "102").write_text("cd34")      # one that had finished meanwhile (no longer known)
    (ended / "103.tmp").write_text("ef")    # one being written: read at a later look
    keeper.check(now=keeper.started_at + 30)   # it ran 30 s: started again at once
    assert started == [1, 1]
    assert sorted(failed) == ["ab12", "cd34"] and [p.name for p in ended.iterdir()] == ["103.tmp"]
    (ended / "103.tmp").rename(ended / "103")
    t0 = keeper.started_at
    keeper.check(now=t0 + 1)                # the new one died within 10 s: started again after 1 s
    assert started == [1, 1] and sorted(failed) == ["ab12", "cd34", "ef"] and not list(ended.iterdir())
    keeper.check(now=t0 + 2.1)
    assert started == [1, 1, 1]
    t1 = keeper.started_at
    keeper.check(now=t1 + 1)                # another quick death: 2 s
    keeper.check(now=t1 + 2.5)
    assert started == [1, 1, 1] and keeper.restart_at == pytest.approx(t1 + 3)
    keeper.check(now=t1 + 3.1)
    assert started == [1, 1, 1, 1]
    keeper.proc = SimpleNamespace(pid=4243, returncode=-15, poll=lambda: -15)
    keeper.check(now=keeper.started_at + 60)   # stopped by SIGTERM: its node may be stopping
    assert started == [1, 1, 1, 1] and keeper.restart_at == pytest.approx(keeper.started_at + 63)


def test_the_keeper_goes_on_after_an_error(runner_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    address = runner_dir / "runner-2.sock"
    monkeypatch.setattr(node_runner, "start_runner", lambda owner: (SimpleNamespace(poll=lambda: None), address))

    def broken(token: str) -> bool:
        raise RuntimeError("no state")

    monkeypatch.setattr(node_runner, "fail_task_now", broken)
    keeper = node_runner.RunnerKeeper(owner=2)
    node_runner.ended_dir(address).mkdir()
    (node_runner.ended_dir(address) / "7").write_text("tok")
    keeper.look()                            # logged, not raised; the file is not read again
    assert not list(node_runner.ended_dir(address).iterdir())


def test_a_task_of_a_dead_clientapp_is_failed_at_once_and_its_message_answered_crashed() -> None:
    """``fail_task_now`` on Flower's own NodeState: a started task's message is answered
    ``CLIENT_APP_CRASHED`` (what Flower answers after 10 minutes without heartbeats), a task
    still starting goes back to pending (started again), a finished task's or an unknown token
    is no task."""
    from common import flower_compat

    drill = flower_compat.crash_drill(run_id=3)
    assert drill == {"started": [(flower_compat.CLIENT_APP_CRASHED, "ClientApp stopped responding.")],
                     "starting": "pending", "finished": False,
                     # a runner that died between its reply and its outcome: its task is finished,
                     # and the message the run's next (running) task took is not answered for it
                     "answered": (True, "finished", "running", 0)}
    assert not flower_compat.fail_task_now("unknown") and not flower_compat._NODE_STATES


def test_runner_folder_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(node_runner.DIR_ENV, str(tmp_path))
    folder = node_runner.runner_dir()
    assert oct(folder.stat().st_mode)[-3:] == "700"
    folder.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 700"):
        node_runner.runner_dir()


# ---------------------------------------------------------------------- which FABs run in process
def test_a_fab_of_this_checkout_runs_in_process_a_changed_one_does_not(tmp_path: Path) -> None:
    from flwr.cli.build import build_fab_from_disk

    ours = build_fab_from_disk(REPO)
    assert node_runner._same_code(ours)
    changed = tmp_path / "changed"
    shutil.copytree(REPO, changed, ignore=shutil.ignore_patterns(".git", "results", "__pycache__", ".gpu",
                                                                 "*.egg-info", ".ruff_cache", ".pytest_cache"))
    path = changed / "client" / "trainer.py"
    path.write_text(path.read_text() + "\n# a local change\n")
    assert not node_runner._same_code(build_fab_from_disk(changed))


def _foreign_app(root: Path) -> Path:
    """A Flower app whose ClientApp is ``client.app:app`` too (the name pflower uses), so
    only a process of its own can load it; it answers with a metric only it knows."""
    (root / "client").mkdir(parents=True)
    (root / "client" / "__init__.py").write_text("")
    (root / "client" / "app.py").write_text(
        "from flwr.app import Message, MetricRecord, RecordDict, ConfigRecord\n"
        "from flwr.clientapp import ClientApp\n"
        "app = ClientApp()\n"
        "@app.train()\n"
        "def train(msg, context):\n"
        "    x = float(msg.content.array_records['arrays']['w'].numpy().sum())\n"
        "    context.state['seen'] = ConfigRecord({'count': 1})\n"
        "    return Message(RecordDict({'metrics': MetricRecord({'foreign': 1.0, 'sum': x})}), reply_to=msg)\n")
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "foreign"\nversion = "1.0.0"\ndependencies = ["flwr"]\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["client"]\n'
        '[tool.flwr.app]\npublisher = "tests"\n'
        '[tool.flwr.app.components]\nserverapp = "client.app:app"\nclientapp = "client.app:app"\n'
        '[tool.flwr.app.config]\n')
    return root


@pytest.mark.usefixtures("flower_task")
def test_another_fabs_clientapp_runs_in_its_own_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.cli.build import build_fab_from_disk

    content = build_fab_from_disk(_foreign_app(tmp_path / "app"))
    import hashlib

    fab = SimpleNamespace(content=content, hash_str=hashlib.sha256(content).hexdigest())
    assert not node_runner.fab_matches(fab.hash_str, fab.content)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    run = SimpleNamespace(fab_id="tests/foreign", fab_version="1.0.0", run_id=1)
    message = Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.arange(4.0))})}), dst_node_id=5,
                      message_type="train")
    context = Context(run_id=1, node_id=5, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reply, new_context = node_runner.run_in_fab_process(fab, run, message, context)
    metrics = reply.content.metric_records["metrics"]
    assert metrics["foreign"] == 1.0 and metrics["sum"] == 6.0          # the FAB's code ran ...
    assert new_context.state.config_records["seen"]["count"] == 1        # ... and its state came back
    assert reply.metadata.reply_to_message_id == message.object_id


@pytest.mark.usefixtures("flower_task")
def test_a_message_crosses_processes_as_flowers_objects_not_pickle() -> None:
    message = Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.random.default_rng(0).random((3, 2)))}),
                                  "config": ConfigRecord({"server-round": 4}),
                                  "metrics": MetricRecord({"a": 0.5})}), dst_node_id=9, message_type="evaluate")
    data = node_runner.encode_message(message)
    assert b"\x80\x04" not in data[:2]   # not a pickle stream
    back = node_runner.decode_message(data)
    assert back.object_id == message.object_id and back.metadata.message_id == message.object_id
    np.testing.assert_array_equal(back.content.array_records["arrays"]["w"].numpy(),
                                  message.content.array_records["arrays"]["w"].numpy())
    assert back.content.config_records["config"]["server-round"] == 4
    assert back.metadata.message_type == "evaluate" and back.metadata.dst_node_id == 9


# ---------------------------------------------------------------------- the SuperNode's waits
def test_poll_interval_flag_is_taken_out_of_flowers_arguments() -> None:
    assert split_poll_interval(["--superlink", "x:1", "--poll-interval", "0.5", "--insecure"]) == \
        (0.5, ["--superlink", "x:1", "--insecure"])
    assert split_poll_interval(["--poll-interval=1"]) == (1.0, [])
    assert split_poll_interval(["--insecure"])[0] == 0.2
    for bad in (["--poll-interval", "soon"], ["--poll-interval", "0"], ["--poll-interval"]):
        with pytest.raises(SystemExit, match="poll-interval"):
            split_poll_interval(bad)
    assert use_runner(["--no-runner", "--insecure"]) == (False, ["--insecure"])
    assert use_runner(["--insecure"]) == (True, ["--insecure"])


def test_capped_time_shortens_sleeps_only() -> None:
    capped = capped_time(0.05)
    t0 = time.monotonic()
    capped.sleep(3)                       # the SuperNode's idle wait
    assert time.monotonic() - t0 < 1.0
    assert capped.monotonic is time.monotonic and capped.time is time.time


def test_object_pull_back_off_starts_short_in_this_flower() -> None:
    (initial, cap), *_ = object_pull_backoff()
    try:
        assert shorten_object_pull_backoff(0.05, 2.0)   # False would mean Flower changed its API
        assert object_pull_backoff() == [(0.05, 2.0), (0.05, 2.0)]
    finally:
        assert shorten_object_pull_backoff(initial, cap)
    assert object_pull_backoff() == [(initial, cap), (initial, cap)]


def test_the_runner_exits_when_its_supernode_is_gone(runner_dir: Path) -> None:
    """A SuperNode killed alone (not its process group) leaves no runner behind."""
    supernode = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    address = runner_dir / f"runner-{supernode.pid}.sock"
    runner = subprocess.Popen([sys.executable, "-m", "ops.node.runner", "--address", str(address),
                               "--owner-pid", str(supernode.pid)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while not address.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert address.exists(), "the runner never listened"
        supernode.kill()
        supernode.wait()
        assert runner.wait(timeout=30) == 0
        assert not address.exists()
    finally:
        for proc in (supernode, runner):
            if proc.poll() is None:
                proc.kill()


def test_the_superexec_keeper_starts_flowers_superexec_again_with_its_command_line(tmp_path: Path) -> None:
    """Flower's SuperLink and SuperNode start their ``flower-superexec`` once; killed, no later
    ServerApp (ClientApp) started. Here the test process plays the SuperNode: it starts a
    ``flower-superexec`` with a ``Popen`` it drops (as Flower's SuperNode does), which is then
    SIGKILLed. The keeper starts it again with the same command line, at once after a SIGKILL
    that ended a long life, 3 s after a clean exit (Flower's SuperExec exits 0 on SIGTERM: its
    node may be stopping), 1 s after a quick death. No later ``Popen`` of the process reaps a
    dead SuperExec (the apps it started watch its pid); the keeper reaps one only once no live
    process names it as its ``--parent-pid``."""
    import psutil

    from ops.node.keepers import SuperExecKeeper, exit_status, is_superexec

    def zombie(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def wait_until(condition, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    script = tmp_path / "flower-superexec"   # run by Python, as Flower's console script is; exits 0 on SIGTERM
    script.write_text("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                      "print('ready', flush=True)\ntime.sleep(60)\n")
    argv = [sys.executable, str(script), "--runtime-api-address", "127.0.0.1:1", "--parent-pid", str(os.getpid())]
    assert is_superexec(argv) and is_superexec([sys.executable, "-s", "/venv/bin/flower-superexec", "--insecure"])
    assert not is_superexec(["/bin/sh", "-c", "flower-superexec-like"])
    keeper = SuperExecKeeper(os.getpid())
    keeper.check()
    assert keeper.argv is None                   # Flower has not started one: nothing to keep
    first = subprocess.Popen(argv, start_new_session=True).pid   # the Popen dropped, as Flower's SuperNode does
    app = None
    try:
        keeper.check()
        assert keeper.argv == argv and keeper.pid == first
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: zombie(first), "the SuperExec did not die")
        subprocess.run(["true"], check=True)     # a later Popen of the node (a runner, say)
        assert zombie(first) and exit_status(first) == -signal.SIGKILL   # not reaped by it
        # an app the dead SuperExec started, still running: it must not be reaped
        app = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--parent-pid", str(first)])
        now = keeper.started_at + 60             # SIGKILLed after a long life: started again at once
        keeper.check(now=now)
        replacement = keeper.pid
        assert replacement != first and replacement in keeper.started and keeper.dead == [first]
        wait_until(lambda: keeper.live_superexec() is not None, "no replacement")
        assert keeper.live_superexec().cmdline() == argv
        keeper.check(now=now + 1)                # alive: left alone; Flower's still watched by its app
        assert keeper.pid == replacement and keeper.restart_at is None and zombie(first)
        app.kill()
        app.wait()
        keeper.check(now=now + 2)
        assert not psutil.pid_exists(first) and keeper.dead == []   # reaped now
        def handles_sigterm() -> bool:           # its handler is set (SigCgt, bit SIGTERM - 1)
            for line in Path(f"/proc/{replacement}/status").read_text().splitlines():
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
            return False

        wait_until(handles_sigterm, "the replacement set no SIGTERM handler")
        os.kill(replacement, signal.SIGTERM)     # as when its node is stopped: it exits 0
        wait_until(lambda: zombie(replacement), "the replacement did not exit")
        assert exit_status(replacement) == 0
        keeper.check(now=now + 3)
        assert keeper.restart_at == pytest.approx(now + 6)
        keeper.check(now=now + 6.1)
        second = keeper.pid
        assert second not in (first, replacement)
        keeper.check(now=now + 6.2)              # nothing names the replacement: reaped
        assert not psutil.pid_exists(replacement)
        os.kill(second, signal.SIGKILL)          # a quick death: 1 s
        wait_until(lambda: zombie(second), "the second replacement did not die")
        keeper.check(now=now + 7)
        assert keeper.restart_at == pytest.approx(now + 8)
    finally:
        if app is not None and app.poll() is None:
            app.kill()
            app.wait()
        for pid in [*keeper.started, first]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
