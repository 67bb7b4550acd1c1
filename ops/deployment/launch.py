"""Start and stop Flower processes that pflower owns, and submit runs with ``flwr run``.

``flwr run`` against the ``:local:`` address starts a *detached* SuperLink that outlives
the command. pflower instead starts its own ``flower-superlink`` (simulation or
deployment mode) on free loopback ports, in its own process group, points a private
``$FLWR_HOME/config.toml`` at it, and kills the whole group when done, also on failure
or Ctrl-C. So a pflower command leaves no Flower or Ray process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from common.flower_compat import fleet_over_http

APP_DIR = Path(__file__).resolve().parents[2]
FEDERATION = "pflower"


class LaunchError(RuntimeError):
    """A Flower process could not be started or a run could not be submitted."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_reason(code: int) -> str:
    """``-15`` -> ``killed by signal 15 (SIGTERM)``; other codes as they are."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"process {Path(str(proc.args[0])).name!r} {exit_reason(proc.returncode)} "
                              f"before listening on {host}:{port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.2)
    raise LaunchError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group of ``proc`` (it must be a session leader), then SIGKILL.

    Flower 1.39 starts ``flower-superexec`` and the app processes *detached* (in their own
    sessions), so descendants outside the group are signalled too (they would otherwise
    linger until they notice their parent is gone)."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return
    detached = [p for p in process_tree(proc.pid)[1:] if _pgid(p) not in (proc.pid, None)]
    # their groups too: a simulation killed on its own leaves Ray's agents orphaned (their
    # parent is gone, so they are no descendants) in its SuperExec's group
    groups = ({proc.pid} | {g for g in map(_pgid, detached) if g is not None}) - {os.getpgrp()}
    _signal_groups(groups, signal.SIGTERM)
    _signal_all(detached, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(map(_group_alive, groups)) or any(map(pid_alive, detached))):
        time.sleep(0.1)
        with contextlib.suppress(Exception):
            proc.poll()
    _signal_groups(groups, signal.SIGKILL)
    _signal_all([p for p in detached if pid_alive(p)], signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=2)


# Process checks through psutil (Linux's /proc, macOS's sysctl; slim container images have no `ps`).
def cmdline(pid: int) -> str:
    """The command line of ``pid`` (empty when it is gone)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants (children, grandchildren, ...), parents first."""
    try:
        return [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
    except psutil.Error:
        return [root]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _signal_groups(pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(_pgid(p.pid) == pgid and p.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
               for p in psutil.process_iter(["status"]))


def kill_pids(pids: Sequence[int], timeout: float = 5.0) -> None:
    """SIGKILL ``pids`` and wait (up to ``timeout``) until none of them runs."""
    _signal_all(pids, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(pid_alive, pids)):
        time.sleep(0.05)


def kill_tree(root: int) -> None:
    """SIGKILL ``root``, its descendants and their process groups (Flower starts the
    SuperLink, its SuperExec and the simulation in separate sessions; Ray's processes are
    in the simulation's group). Never touches the caller's own process group."""
    own = os.getpgrp()
    for _ in range(3):  # processes may spawn while we walk: repeat until nothing is left
        pids = [p for p in process_tree(root) if pid_alive(p)]
        if not pids:
            return
        groups = {g for g in map(_pgid, pids) if g is not None}
        for pgid in groups - {own}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.2)


@dataclass
class SuperLink:
    """A ``flower-superlink`` in its own process group, on free loopback ports."""

    simulation: bool = True
    host: str = "127.0.0.1"
    extra_args: Sequence[str] = ()
    insecure: bool = True
    fleet_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    # Flower 1.39's Fleet API is gRPC on ``fleet_port`` (``--fleet-api-address``); 1.42's is HTTP
    # on ``http_port`` and the flag is deprecated. False leaves the flag out (1.39 then listens
    # on its default, 0.0.0.0:9092: the containers' command, good for both releases).
    grpc_fleet: bool = field(default_factory=lambda: not fleet_over_http())
    stock: bool = False   # Flower's own ``flower-superlink`` (60 s task heartbeats), not pflower's
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pflower-link-")))
    proc: subprocess.Popen | None = None

    @property
    def control_address(self) -> str:
        """Flower serves the Control API on the SuperLink's HTTP port (1.39 and 1.42)."""
        return f"{self.host}:{self.http_port}"

    @property
    def fleet_address(self) -> str:
        """Where SuperNodes connect: the HTTP port on Flower 1.42 (its Fleet API is HTTP there),
        a gRPC port of its own on 1.39 (``--fleet-api-address``)."""
        return f"{self.host}:{self.fleet_port}" if self.grpc_fleet else self.control_address

    def command(self) -> list[str]:
        """``python -m ops.node.superlink`` (Flower's SuperLink with a 10-minute task heartbeat
        timeout, ``common/flower_compat.py``) and :meth:`args`; Flower's own ``flower-superlink``
        with ``stock``."""
        if self.stock:
            return [executable("flower-superlink"), *self.args()]
        return [sys.executable, "-m", "ops.node.superlink", *self.args()]

    def args(self) -> list[str]:
        """The SuperLink's flags: ports, database, isolation, simulation or deployment."""
        cmd = []
        if self.insecure:
            cmd.append("--insecure")
        cmd += ["--isolation", "subprocess"]
        if self.grpc_fleet:   # 1.39: the gRPC Fleet API on a port of its own
            cmd += ["--fleet-api-address", f"{self.host}:{self.fleet_port}"]
        cmd += ["--host", self.host, "--port", str(self.http_port),
                "--database", str(self.workdir / "state.db"),
                "--disable-runtime-dependency-installation"]
        if self.simulation:
            cmd.append("--simulation")
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 60.0, attempts: int = 2, keep_ports: bool = False) -> SuperLink:
        """Start and wait until the Control API listens. A start that fails (e.g. killed
        under load, or a port taken between choosing and binding it) is retried once on
        fresh ports (on the same ports with ``keep_ports``: a restart that SuperNodes must
        find again); the error names the cause, the ports and the SuperLink's own output."""
        try:
            return self._start(timeout, attempts, keep_ports)
        except LaunchError:
            raise   # stopped already, each attempt
        except BaseException:
            # e.g. Ctrl-C or SIGTERM while it starts: the SuperLink runs in a session of its
            # own, so nothing else would stop it (``with SuperLink()`` never reached __exit__)
            with contextlib.suppress(Exception):   # the interrupt is what the caller must see
                self.stop()
            raise

    def _start(self, timeout: float, attempts: int, keep_ports: bool) -> SuperLink:
        errors = []
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, attempts + 1):
            log_path = self.workdir / "superlink.log"
            self.proc = subprocess.Popen(self.command(), stdout=log_path.open("a"), stderr=subprocess.STDOUT,
                                         start_new_session=True, env=flower_env())
            try:
                wait_for_port(self.host, self.http_port, timeout, self.proc)
                return self
            except LaunchError as err:
                self.stop()
                log = tail_of(log_path) or "(empty: it stopped before writing anything)"
                errors.append(f"attempt {attempt}: {err} (fleet port {self.fleet_port}); SuperLink log:\n{log}")
                if attempt < attempts:
                    print(f"pflower: the SuperLink did not start ({err}); retrying on "
                          f"{'the same' if keep_ports else 'fresh'} ports", file=sys.stderr, flush=True)
                    if keep_ports:
                        time.sleep(2.0)
                    else:
                        self.fleet_port, self.http_port = free_port(), free_port()
        raise LaunchError("\n".join(errors) + "\nThe SuperLink failed twice. If it was killed (signal), "
                          "the machine may be short of memory or another tool stops processes; if a port "
                          "is taken, run again (ports are chosen afresh each time).")

    def stop(self) -> None:
        """Stop the SuperLink's process group and every process left of its runs."""
        if self.proc is not None:
            kill_group(self.proc)
        kill_pids(self.leftovers())

    def leftovers(self) -> list[int]:
        """Live processes started for this SuperLink's runs (its SuperExec, ServerApps,
        simulations), found by the SuperLink's runtime address on their command line. Flower
        starts them detached, in sessions of their own: a SuperLink that was killed leaves them
        outside its process tree, and a ServerApp left so reconnects to the SuperLink started
        again on the same ports and goes on with the run that is being resumed (holding its
        results folder, so the resumed run refused to start)."""
        flag = f"--runtime-api-address {self.control_address} "
        return [pid for pid in psutil.pids() if pid != os.getpid() and pid_alive(pid) and flag in cmdline(pid) + " "]

    def __enter__(self) -> SuperLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def executable(name: str) -> str:
    """The path of an installed command (``flwr``, ``pflower-supernode``): on ``PATH``, else
    next to this Python; a missing one names the fix."""
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).exists():
        raise LaunchError(f"{name} not found; install pflower's dependencies (pip install -e .)")
    return found


def tail_of(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file (empty when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# Ray's tip about a future default (ray/_private/worker.py: "Tip: In future versions of Ray, Ray
# will no longer override accelerator visible devices env var if num_gpus=0 ..."), a
# FutureWarning printed by every simulation: pflower gives each client its GPU share itself,
# and Flower pins the Ray release. A warnings filter for that one warning, nothing else.
RAY_TIP_FILTER = "ignore:Tip:FutureWarning:ray._private.worker"


def flower_env(flwr_home: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS", ""), RAY_TIP_FILTER) if w)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env.setdefault("RAY_DEDUP_LOGS", "0")
    # how often a SuperExec looks for a message to start a ClientApp/ServerApp process for
    # (Flower's default 1 s is up to a second of idle per message, twice per round)
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def write_flwr_config(flwr_home: Path, control_address: str, root_certificates: str | None = None) -> Path:
    """A ``$FLWR_HOME/config.toml`` with one connection named ``pflower``."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{FEDERATION}"', "", f"[superlink.{FEDERATION}]",
             f'address = "{control_address}"']
    if root_certificates:
        lines.append(f'root-certificates = "{root_certificates}"')
    else:
        lines.append("insecure = true")
    path = flwr_home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class AppWatch:
    """Whether a run's processes are still there, asked once a second while ``flwr run
    --stream`` waits (``flwr_run``'s ``alive``): False once the SuperLink has exited, or once
    the run's own process, ``app`` (``flwr-simulation`` under ``pflower run``, the
    ``flwr-serverapp`` of ``pflower deploy``; seen before, in the SuperLink's process tree),
    has been gone for ``grace_s``. Why: the SuperLink takes a run whose process died for dead
    only when its heartbeats have been missing for pflower's 10 minutes; a run that completes
    ends its stream within a second of its process exiting. ``reason`` says which ended.
    Processes of ``app`` already there when the watch starts (the previous run's ServerApp,
    still exiting) are not this run's."""

    def __init__(self, link: object, app: str, grace_s: float = 20.0) -> None:
        self.link, self.app, self.grace_s = link, app, grace_s
        self.seen, self.gone_since, self.reason = False, None, ""
        self.link_gone = False   # which ended: the SuperLink (True) or the app (``reason`` without it)
        self.pid: int | None = None   # the app's, once found: then one /proc read a call
        proc = getattr(link, "proc", None)
        self.others = set(self._apps(proc.pid)) if proc is not None and proc.poll() is None else set()

    def _apps(self, root: int) -> list[int]:
        return [p for p in process_tree(root)[1:] if self.app in cmdline(p)]

    @property
    def app_gone(self) -> bool:
        """The run's own process ended before the run did (the SuperLink lives)."""
        return bool(self.reason) and not self.link_gone

    def __call__(self) -> bool:
        proc = getattr(self.link, "proc", None)
        if proc is None or proc.poll() is not None:
            self.link_gone, self.reason = True, "the SuperLink exited"
            return False
        if self.pid is None or not pid_alive(self.pid) or self.app not in cmdline(self.pid):
            self.pid = next((p for p in self._apps(proc.pid) if p not in self.others), None)
        if self.pid is not None:
            self.seen, self.gone_since = True, None
            return True
        if self.seen:
            self.gone_since = self.gone_since or time.monotonic()
            if time.monotonic() - self.gone_since > self.grace_s:
                what = {"flwr-simulation": "simulation", "flwr-serverapp": "ServerApp"}.get(self.app, self.app)
                self.reason = f"the {what} process exited and the run had not ended {self.grace_s:.0f} s later"
                return False
        return True


EXIT_WORK_GONE = -1000   # flwr_run: ``alive`` said the run's processes are gone


def flwr_run(app_dir: Path, flwr_home: Path, run_config: str, federation_config: str = "",
             timeout: float | None = None, alive: Callable[[], bool] | None = None,
             on_line: Callable[[str], None] | None = None) -> int:
    """``flwr run <app> pflower --stream`` with our FLWR_HOME; returns its exit code.

    With ``alive``, asked every second, the stream is stopped as soon as it says the run's
    processes are gone (returns :data:`EXIT_WORK_GONE`): the SuperLink would otherwise keep
    a dead run "running" until its heartbeat timeout. With ``on_line`` the stream's lines go
    to it (a progress bar prints them above itself) instead of straight to the terminal."""
    cmd = [executable("flwr"), "run", str(app_dir), FEDERATION, "--stream", "--run-config", run_config]
    if federation_config:
        cmd += ["--federation-config", federation_config]
    piped = {} if on_line is None else {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT,
                                        "text": True, "errors": "replace"}
    proc = subprocess.Popen(cmd, env=flower_env(flwr_home), start_new_session=True, **piped)
    reader = None
    if on_line is not None:
        def forward() -> None:
            for line in proc.stdout:
                on_line(line)

        reader = threading.Thread(target=forward, daemon=True)
        reader.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                code = proc.wait(timeout=step)
                if reader is not None:
                    reader.join(timeout=5)
                return code
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                if alive is not None and not alive():
                    kill_group(proc)
                    return EXIT_WORK_GONE
    except BaseException:
        kill_group(proc)
        raise


def list_runs(flwr_home: Path) -> list[dict[str, Any]] | None:
    """Every run on our SuperLink as ``flwr ls --format json`` gives it (``run-id``,
    ``status``, details, times, ...), oldest first (Flower lists the newest first); None when
    the SuperLink cannot be asked."""
    try:
        out = subprocess.run([executable("flwr"), "ls", FEDERATION, "--format", "json"], env=flower_env(flwr_home),
                             capture_output=True, text=True, timeout=60)
        runs = [dict(r) for r in json.loads(out.stdout).get("runs", [])]
    except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError):
        return None
    return oldest_first(runs)


def oldest_first(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs in the order they were submitted (``pending-at``, "YYYY-MM-DD HH:MM:SS..." or
    "N/A"). Why: a deployment's SuperLink holds every run it was given, and the run just
    submitted is the one to follow; the order of Flower's listing is not ours to rely on."""
    def submitted(run: dict[str, Any]) -> str:
        at = str(run.get("pending-at") or "")
        return at if at[:1].isdigit() else ""
    return sorted(reversed(runs), key=submitted)   # Flower's newest-first, reversed: ties (to the second) in order


def run_info(flwr_home: Path) -> dict[str, Any] | None:
    """The latest run on our SuperLink (:func:`list_runs`); None when there is none or the
    SuperLink cannot be asked."""
    runs = list_runs(flwr_home)
    return runs[-1] if runs else None


def stop_unfinished_runs(flwr_home: Path) -> list[str]:
    """Stop (``flwr stop``) every run our SuperLink does not count as finished; returns their
    ids. Why: a SuperLink started again on its database after it died still counts the run it
    was serving as running, though that run's ServerApp is gone. It would hand that run's
    undelivered messages to the SuperNodes, whose arrays it no longer holds; each SuperNode
    then waits on them (~1,000 s) instead of serving the run that is being resumed."""
    stopped = [str(r["run-id"]) for r in list_runs(flwr_home) or [] if not str(r.get("status", "")).startswith("finished")]
    for run_id in stopped:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run([executable("flwr"), "stop", run_id, FEDERATION], env=flower_env(flwr_home),
                           capture_output=True, timeout=60)
    return stopped


def run_log(flwr_home: Path, run_id: str) -> str:
    """The run's log as the SuperLink stored it (``flwr log <run> --show``: the ServerApp's
    and the simulation's output); empty when the SuperLink cannot be asked."""
    try:
        out = subprocess.run([executable("flwr"), "log", str(run_id), FEDERATION, "--show"], env=flower_env(flwr_home),
                             capture_output=True, text=True, timeout=60)
    except (subprocess.TimeoutExpired, OSError):
        return ""
    return out.stdout


def run_status(flwr_home: Path) -> str | None:
    """Status of the latest run on our SuperLink (``running``, ``finished:completed``, ...);
    None when the SuperLink cannot be asked."""
    info = run_info(flwr_home)
    return (str(info.get("status", "")) or None) if info else None


ACTIVE = ("pending", "starting", "running")


def follow_after_stream_loss(code: int, flwr_home: Path, run_dir: Path, rounds: int,
                             poll_s: float = 3.0, alive: Callable[[], bool] | None = None,
                             deadline: float | None = None) -> str | None:
    """``flwr run --stream`` can exit while the run goes on: the log stream to the SuperLink
    dropped (a SuperLink too busy to answer in time), or ``flwr run`` itself was killed. Ask
    the SuperLink (a few times: the same load may delay that answer): while the run is still
    active, follow its progress from ``metrics.jsonl`` until it finishes or its processes are
    gone (``alive``), instead of killing a healthy run or leaving it unwatched (``pflower
    run`` and ``pflower deploy`` alike). Returns the run's last status seen (None: the
    SuperLink could not be asked). Past ``deadline`` (``time.monotonic()``; the run's
    ``--timeout``), raises ``subprocess.TimeoutExpired`` as ``flwr_run`` does."""
    status = None
    def past_deadline() -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired("flwr run (followed from its metrics)", poll_s)

    for _ in range(5):
        past_deadline()
        status = run_status(flwr_home)
        if status is not None or (alive is not None and not alive()):
            break
        time.sleep(poll_s)
    if status is None or not status.startswith(ACTIVE):
        return status
    print(f"pflower: the log stream ended (flwr exit code {code}) but the run is still {status} on "
          "the SuperLink; following it from its metrics", file=sys.stderr, flush=True)
    metrics, seen, unreachable = run_dir / "metrics.jsonl", 0, 0
    while True:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        for line in lines[seen:]:
            with contextlib.suppress(json.JSONDecodeError, KeyError):
                rec = json.loads(line)
                ev = rec.get("evaluate", {})
                acc = f" accuracy mean {ev['accuracy_mean']:.4f}" if ev else ""
                print(f"pflower: [round {rec['round']}/{rounds}]{acc}", flush=True)
        seen = len(lines)
        status = run_status(flwr_home)
        unreachable = unreachable + 1 if status is None else 0
        if alive is not None and not alive():
            print("pflower: the run's processes are gone", file=sys.stderr, flush=True)
            return status
        if unreachable >= 5 or (status is not None and not status.startswith(ACTIVE)):
            print(f"pflower: the run is {status or 'unreachable'}", file=sys.stderr, flush=True)
            return status
        past_deadline()
        time.sleep(poll_s)


def remove_private_files(folder: Path) -> None:
    """Delete a work folder, private keys first (so an interrupted removal never leaves a
    key behind while less sensitive files are gone)."""
    if not folder.exists():
        return
    for key in folder.rglob("*.key"):
        key.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def simulation_superlink(keep_in: Path | None = None) -> Iterator[tuple[SuperLink, Path]]:
    """A private simulation SuperLink plus a FLWR_HOME that points at it. Its temporary
    folder (database, log, FLWR_HOME) is removed afterwards (copied to ``keep_in`` first if given)."""
    link = SuperLink(simulation=True)
    flwr_home = link.workdir / "flwr-home"
    write_flwr_config(flwr_home, link.control_address)
    try:
        with link:
            yield link, flwr_home
    finally:
        if keep_in is not None:
            with contextlib.suppress(OSError):
                shutil.copytree(link.workdir, keep_in, dirs_exist_ok=True)
        remove_private_files(link.workdir)
