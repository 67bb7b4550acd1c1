"""A real Flower deployment on this machine: one SuperLink, N SuperNodes, over the installed
Flower's Fleet API (HTTP on the SuperLink's port on 1.42, gRPC ``grpc-rere`` on a port of its own
on 1.39: ``common/flower_compat.py: fleet_over_http``).

``pflower deploy`` starts ``flower-superlink`` in deployment mode
and one ``pflower-supernode`` (``ops/node/supernode.py``) per client, each in its own process group, each given its
identity, data and state directory by ``--node-config``; submits one run per strategy with
``flwr run . pflower --stream``; checks every run wrote a fresh ``summary.json``; and stops
every process it started, also on failure, Ctrl-C or SIGTERM.

Modes:
- ``tls`` (default): a fresh CA and SuperLink certificate (``ops/deployment/certs.py``), TLS on
  the Fleet, Control and runtime APIs, and SuperNode authentication: the SuperLink runs
  with ``--enable-supernode-auth``, each SuperNode's public key is registered with
  ``flwr supernode register`` and the SuperNode signs in with
  ``--auth-supernode-private-key``; a SuperNode whose key is not registered is refused.
- ``insecure``: plain text, any SuperNode may join. Only when asked for.

The node-config keys and container ports here are the single source of truth the
``docker/compose*.yml`` files are checked against (``tests/test_docker_compose.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from common import flower_compat
from ops.deployment.launch import (
    APP_DIR,
    FEDERATION,
    AppWatch,
    LaunchError,
    SuperLink,
    executable,
    flower_env,
    flwr_run,
    follow_after_stream_loss,
    free_port,
    kill_group,
    remove_private_files,
    stop_unfinished_runs,
    tail_of,
    wait_for_port,
    write_flwr_config,
)

# Node-config keys the ClientApp reads (client/handlers.py, client/identity.py).
NODE_CONFIG_KEYS = ("partition-id", "num-partitions", "client-id", "state-dir", "data-root")
# Ports used inside containers and in the README's multi-machine guide.
FLEET_PORT = 9092      # Fleet API on Flower 1.39 (gRPC grpc-rere): SuperNodes connect here
CONTROL_PORT = 9093    # HTTP: Control API (`flwr run`, `flwr supernode register`), and on
                       # Flower 1.42 the Fleet API too: SuperNodes connect here
# The SuperNodes' address of the SuperLink in the containers: one compose file for both
# releases, PFLOWER_FLEET_PORT=9092 for images built with Flower 1.39 (docker/build-images.sh).
CONTAINER_FLEET_PORT = f"${{PFLOWER_FLEET_PORT:-{CONTROL_PORT}}}"
SUPERNODE_PORT = 9094  # each SuperNode's own runtime API (ClientApp processes; local only)
MODES = ("tls", "insecure")


def node_config(partition_id: int, num_partitions: int, state_dir: str | Path | None = None,
                data_root: str | Path | None = None, client_id: str | None = None) -> str:
    """The ``--node-config`` string for one SuperNode (TOML values: strings are quoted)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is not in [0, {num_partitions})")
    items: list[tuple[str, Any]] = [("partition-id", partition_id), ("num-partitions", num_partitions)]
    if client_id:
        items.append(("client-id", str(client_id)))
    if state_dir:
        items.append(("state-dir", str(state_dir)))
    if data_root:
        items.append(("data-root", str(data_root)))
    return " ".join(f"{k}={json.dumps(v)}" for k, v in items)


def parse_node_config(text: str) -> dict[str, Any]:
    """Parse a ``--node-config`` string exactly as ``flower-supernode`` does."""
    return flower_compat.parse_node_config(text)


def superlink_tls_args(certs: Path) -> list[str]:
    """SuperLink flags for TLS on all its APIs plus SuperNode authentication."""
    return ["--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth"]


def supernode_command(superlink: str, config: str, runtime_port: int = SUPERNODE_PORT,
                      root_certificates: str | Path | None = None,
                      private_key: str | Path | None = None, runtime_host: str = "127.0.0.1",
                      exe: str | None = None) -> list[str]:
    """``pflower-supernode`` (Flower's SuperNode with short waits and a ClientApp runner,
    ``ops/node/supernode.py``) for one client: insecure unless ``root_certificates`` is given."""
    cmd = [exe or executable("pflower-supernode"), "--superlink", superlink]
    cmd += ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    if private_key is not None:
        cmd += ["--auth-supernode-private-key", str(private_key)]
    return cmd + ["--node-config", config, "--host", runtime_host, "--port", str(runtime_port)]


# ---------------------------------------------------------------------- containers
# docker/compose.yml (+ compose.tls.yml) run exactly these command lines; the test
# tests/test_docker_compose.py checks the files against these functions.
SUPERLINK_SERVICE = "superlink"
CONTAINER_STATE = "/state"
CONTAINER_DATA = "/data"
CONTAINER_CERTS = "/certs"
CONTAINER_RESULTS = "/results"


def container_superlink_command(mode: str) -> list[str]:
    """The SuperLink container's command: deployment mode, listening on all interfaces, as
    ``pflower-superlink`` (Flower's SuperLink with the 10-minute task heartbeat that ``pflower
    deploy`` gives its own, ``common/flower_compat.py`` item 3)."""
    link = SuperLink(simulation=False, host="0.0.0.0", insecure=mode == "insecure", grpc_fleet=False,
                     fleet_port=FLEET_PORT, http_port=CONTROL_PORT, workdir=Path(CONTAINER_STATE),
                     extra_args=superlink_tls_args(Path(CONTAINER_CERTS)) if mode == "tls" else ())
    return ["pflower-superlink", *link.args()]


def container_supernode_command(index: int, num_nodes: int, mode: str) -> list[str]:
    """SuperNode ``index``'s container command: its partition, its own /data and /state."""
    certs = Path(CONTAINER_CERTS)
    return supernode_command(
        f"{SUPERLINK_SERVICE}:{CONTAINER_FLEET_PORT}", node_config(index, num_nodes, CONTAINER_STATE, CONTAINER_DATA),
        SUPERNODE_PORT, certs / "ca.crt" if mode == "tls" else None,
        certs / f"supernode-{index}" if mode == "tls" else None, exe="pflower-supernode")


@dataclass
class SuperNode:
    """One ``pflower-supernode`` in its own process group; restartable with the same config."""

    index: int
    command: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    threads: int | None = None   # torch's CPU threads for its ClientApps (OMP_NUM_THREADS)

    def start(self, wait: bool = True) -> SuperNode:
        """Start the SuperNode and, with ``wait``, :meth:`settle` it (a deployment starts all its
        nodes first and settles them after, so that their start-ups overlap)."""
        self.starts += 1
        self._spawn(f"===== pflower: start #{self.starts}")
        return self.settle() if wait else self

    def settle(self, attempts: int = 3, listen_timeout: float = 20.0) -> SuperNode:
        """Wait until the runtime port listens. A SuperNode that exited before (the port,
        chosen free a moment before its start, was taken by another process meanwhile: "address
        already in use") is started again on a fresh port, up to ``attempts`` starts in all;
        one still starting after ``listen_timeout`` seconds is left to go on."""
        for attempt in range(1, attempts + 1):
            assert self.proc is not None
            try:
                wait_for_port(*self._runtime_address(), listen_timeout, self.proc)
                return self
            except LaunchError as err:
                if self.proc.poll() is None or attempt == attempts:   # still starting, or given up
                    return self
                print(f"pflower: SuperNode {self.index} {err}; starting it again on a fresh port",
                      file=sys.stderr, flush=True)
                self.command[self.command.index("--port") + 1] = str(free_port())
                self._spawn(f"----- pflower: start #{self.starts} again, on a fresh port: it exited before listening "
                            f"(its port taken, or the error above)")
        return self

    def _spawn(self, marker: str) -> None:
        env = flower_env()
        if self.threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(self.threads))
        with self.log_path.open("a") as log:
            log.write(f"\n{marker}: {' '.join(self.command)}\n")
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)

    def _runtime_address(self) -> tuple[str, int]:
        """The host and port of the SuperNode's runtime API (its ``--host`` / ``--port``)."""
        host = self.command[self.command.index("--host") + 1] if "--host" in self.command else "127.0.0.1"
        return host, int(self.command[self.command.index("--port") + 1])

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Deployment:
    """A loopback deployment: one SuperLink (deployment mode) and ``num_nodes`` SuperNodes.

    Use as a context manager; leaving it (normally, on error or Ctrl-C) stops everything.
    """

    num_nodes: int
    mode: str = "tls"
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pflower-deploy-")))
    data_root: str | None = None
    state_root: Path | None = None   # node i keeps client state in <state_root>/node-<i>
    # Flower's own flower-superlink and flower-supernode (its 3 s idle wait, a ClientApp process
    # per message), as a Flower user starts them, instead of pflower-superlink/-supernode
    stock: bool = False
    node_flags: Sequence[str] = ()   # more flags for every SuperNode (e.g. pflower-supernode's --no-runner)
    link: SuperLink | None = None
    nodes: list[SuperNode] = field(default_factory=list)
    watch: AppWatch | None = None   # the last run's: why its stream was stopped

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
        if self.num_nodes < 1:
            raise ValueError("a deployment needs at least one SuperNode")
        self.workdir = Path(self.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def secure(self) -> bool:
        return self.mode == "tls"

    @property
    def certs(self) -> Path:
        return self.workdir / "certs"

    @property
    def flwr_home(self) -> Path:
        return self.workdir / "flwr-home"

    def state_dir(self, index: int) -> Path:
        if self.state_root is not None:
            return Path(self.state_root) / f"node-{index}"
        return self.workdir / "nodes" / str(index) / "state"

    def node_config(self, index: int) -> str:
        return node_config(index, self.num_nodes, self.state_dir(index), self.data_root)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Deployment:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from ops.deployment.certs import make_node_keys, make_tls

        extra_args: list[str] = []
        if self.secure:
            make_tls(self.certs, ["localhost", "127.0.0.1"])
            extra_args = superlink_tls_args(self.certs)
        self.link = SuperLink(simulation=False, insecure=not self.secure, extra_args=extra_args,
                              workdir=self.workdir / "superlink", stock=self.stock)
        self.link.workdir.mkdir(parents=True, exist_ok=True)
        write_flwr_config(self.flwr_home, self.link.control_address,
                          str(self.certs / "ca.crt") if self.secure else None)
        self.link.start()
        for i in range(self.num_nodes):
            key = None
            if self.secure:
                key, pub = make_node_keys(self.certs, f"supernode-{i}")
                self.register(pub)
            self.nodes.append(self._node(i, self.node_config(i), key).start(wait=False))
        for node in self.nodes:      # started together, settled after (a taken port: started again)
            node.settle()

    def _node(self, index: int, config: str, key: Path | None, name: str = "") -> SuperNode:
        assert self.link is not None
        cmd = supernode_command(self.link.fleet_address, config, free_port(),
                                self.certs / "ca.crt" if self.secure else None, key,
                                exe=executable("flower-supernode") if self.stock else None) + list(self.node_flags)
        # the nodes share this machine's cores (each would take all of them: 3 nodes on 2
        # cores spent most of a round switching threads); OMP_NUM_THREADS set by the user wins
        threads = max(1, (os.cpu_count() or 1) // self.num_nodes)
        return SuperNode(index, cmd, self.workdir / f"supernode-{name or index}.log", threads=threads)

    def register(self, public_key: Path) -> None:
        """``flwr supernode register <public key> pflower`` against our SuperLink."""
        out = subprocess.run([executable("flwr"), "supernode", "register", str(public_key), FEDERATION],
                             env=flower_env(self.flwr_home), capture_output=True, text=True, timeout=120)
        if out.returncode != 0 or "registered successfully" not in out.stdout:
            raise LaunchError(f"could not register {public_key}: {out.stdout}{out.stderr}")

    def link_alive(self) -> bool:
        return self.link is not None and self.link.proc is not None and self.link.proc.poll() is None

    def restart_link(self) -> None:
        """Start the SuperLink again on its database, ports and certificates (after it
        died): registered SuperNode keys stay registered, and the SuperNodes reconnect by
        themselves (Flower retries the Fleet connection without limit by default). What the
        dead SuperLink left is cleared: its runs' processes (``SuperLink.stop``) and, in its
        database, the runs it was serving (stopped: their ServerApps are gone)."""
        assert self.link is not None
        self.link.stop()   # whatever is left of its process group and its runs' processes
        self.link.start(attempts=5, keep_ports=True)
        stopped = stop_unfinished_runs(self.flwr_home)
        if stopped:
            print(f"pflower deploy: stopped the runs the restarted SuperLink still counted as running: "
                  f"{', '.join(stopped)}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        if self.link is not None:
            self.link.stop()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ runs
    def run(self, run_config: str, timeout: float | None = None,
            on_line: Callable[[str], None] | None = None, follow: tuple[Path, int] | None = None) -> int:
        """Submit one run with ``flwr run <app> pflower --stream``; returns flwr's exit code
        (:data:`~ops.deployment.launch.EXIT_WORK_GONE` when the SuperLink exited during the run,
        or the run's ServerApp did: ``watch.reason`` says which). With ``follow`` (the run's
        folder and rounds), a stream that ends while the run goes on (``flwr run`` killed, or
        its stream dropped) is followed from the run's metrics to the run's end, as ``pflower
        run`` does, instead of leaving the run to a manual resume."""
        if not self.link_alive():
            raise LaunchError("the SuperLink is not running" + self.logs())
        self.watch = AppWatch(self.link, "flwr-serverapp")
        deadline = None if timeout is None else time.monotonic() + timeout
        code = flwr_run(APP_DIR, self.flwr_home, run_config, timeout=timeout, alive=self.watch, on_line=on_line)
        if code != 0 and not self.watch.reason and follow is not None:
            follow_after_stream_loss(code, self.flwr_home, *follow, alive=self.watch, deadline=deadline)
        if self.server_app_gone():   # the SuperLink would count the run as running for 10 minutes
            stopped = stop_unfinished_runs(self.flwr_home)
            print(f"pflower deploy: {self.watch.reason}; stopped its run on the SuperLink: {', '.join(stopped) or '-'}",
                  file=sys.stderr, flush=True)
        return code

    def server_app_gone(self) -> bool:
        """The last run's ServerApp ended before its run did, while the SuperLink lives."""
        return self.watch is not None and self.watch.app_gone and self.link_alive()

    def logs(self, lines: int = 15) -> str:
        parts = []
        if self.link is not None:
            parts.append(f"\n--- SuperLink log ({self.link.workdir / 'superlink.log'}):\n"
                         + tail_of(self.link.workdir / "superlink.log", lines))
        for node in self.nodes:
            parts.append(f"\n--- SuperNode {node.index} log ({node.log_path}):\n" + tail_of(node.log_path, lines))
        return "".join(parts)


class RunResult(NamedTuple):
    """How a submitted run ended: ``ok`` with a fresh summary.json; ``said_why`` when its
    ServerApp wrote a fresh FAILED (the run failed for a reason of its own: resuming it would
    fail again); ``text`` for the user."""

    ok: bool
    text: str
    said_why: bool = False


def run_result(run_dir: Path, started: float, code: int) -> RunResult:
    """Did the run finish with a fresh summary.json? (``flwr run`` exits 0 on failure too, and
    not 0 when it was killed or its stream dropped while the run went on to its end.)"""
    failed = run_dir / "FAILED"
    summary = run_dir / "summary.json"
    if failed.exists() and failed.stat().st_mtime >= started:
        return RunResult(False, f"run failed: {failed.read_text().strip()}", said_why=True)
    if not summary.exists() or summary.stat().st_mtime < started:
        return RunResult(False, f"run did not complete (flwr exit code {code}, no fresh {summary})")
    s = json.loads(summary.read_text())
    return RunResult(True, f"accuracy mean {s['accuracy_mean']:.4f} min {s['accuracy_min']:.4f} "
                           f"std {s['accuracy_std']:.4f} -> {summary}")


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so cleanup runs (main thread only)."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_deploy(args: argparse.Namespace) -> int:
    from common.config import ConfigError, compose_run
    from common.overrides import expand_grid, split_overrides, to_toml_run_config
    from learning.datasets.cache import fill_cache, resolve_cache_dir
    from learning.datasets.config import num_clients
    from learning.datasets.sources import DatasetError
    from ops.recovery import expand_resume
    from server.run_folder import RunFolderError, check_run_folder

    jobs: list[tuple[str, Path, int]] = []   # run config, run folder, rounds
    nodes = args.nodes
    results_root: Path | None = None
    try:
        for combo in expand_grid(list(args.overrides)):
            run_cfg, rest = split_overrides(expand_resume(combo, "pflower deploy"))
            run_cfg["results-root"] = str(Path(run_cfg.get("results-root", "results")).resolve())
            composed = compose_run(run_cfg, rest)
            cfg, run = composed.cfg, composed.settings.run
            n = num_clients(cfg.dataset)
            if nodes == 0:
                nodes = n
            if n != nodes:
                raise ConfigError(
                    f"{' '.join(combo) or 'the default config'} has {n} clients but the deployment "
                    f"has {nodes} SuperNodes; use --nodes {n} or a dataset with {nodes} clients "
                    "(e.g. experiment=deploy-3 for 3)")
            try:
                check_run_folder(run.run_dir, bool(run.resume), run.overwrite)
            except RunFolderError as err:
                raise ConfigError(str(err)) from err
            results_root = results_root or Path(run.results_root)
            if not args.data_root:  # the SuperNodes on this machine then read their splits from the cache
                fill_cache(cfg.dataset, run.seed, resolve_cache_dir(run.data_cache))
            jobs.append((to_toml_run_config(run_cfg, rest), run.run_dir, run.rounds))
    except (ConfigError, DatasetError) as err:
        print(f"pflower deploy: {err}", file=sys.stderr)
        return 2
    if args.mode == "insecure":
        print("pflower deploy: INSECURE mode: no TLS, no SuperNode authentication", file=sys.stderr)
    workdir = Path(args.workdir) if args.workdir else None
    # the SuperNodes' client state is data (it must outlive this command): it lives under the
    # results, not in the temporary work folder
    state_root = (results_root or Path("results").resolve()) / "supernode-state"
    dep = Deployment(nodes, args.mode, **({"workdir": workdir} if workdir else {}),
                     data_root=args.data_root or None, state_root=state_root)
    try:
        return _deploy_jobs(dep, jobs, nodes, args)
    finally:
        if workdir is None:   # our temporary folder: keys first, then the rest
            if args.keep_temp and jobs:
                keep = jobs[0][1] / "deploy"
                with contextlib.suppress(OSError):
                    shutil.copytree(dep.workdir, keep, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("*.key"))
                print(f"pflower deploy: kept the work folder (logs, certificates without private keys) "
                      f"in {keep}", file=sys.stderr)
            remove_private_files(dep.workdir)


def _deploy_jobs(dep: Deployment, jobs: list[tuple[str, Path, int]], nodes: int, args: argparse.Namespace) -> int:
    failures = 0
    with _sigterm_as_interrupt():
        try:
            with dep:
                print(f"pflower deploy: SuperLink fleet {dep.link.fleet_address} control "
                      f"{dep.link.control_address} ({dep.mode}), {nodes} SuperNodes; logs in {dep.workdir}",
                      flush=True)
                for run_config, run_dir, rounds in jobs:
                    ok, text = _deploy_one(dep, run_config, run_dir, rounds, args)
                    print(f"pflower deploy: {'done' if ok else 'FAILED'}: {text}", flush=True)
                    if not ok:
                        failures += 1
                        print(dep.logs(), file=sys.stderr)
                        print(f"pflower deploy: {go_on_hint(run_dir, args)}", file=sys.stderr)
        except LaunchError as err:
            print(f"pflower deploy: could not start the deployment: {err}", file=sys.stderr)
            return 3
        except subprocess.TimeoutExpired:
            print(f"pflower deploy: a run exceeded --timeout {args.timeout}s; stopped everything",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("pflower deploy: interrupted; every SuperLink/SuperNode process was stopped",
                  file=sys.stderr)
            return 130
    return 1 if failures else 0


def go_on_hint(run_dir: Path, args: argparse.Namespace) -> str:
    """How to go on with a run that failed: its resume command when it left a checkpoint, else
    (killed before its first round was saved, when ``resume=`` has nothing to resume) the same
    command again."""
    from server.checkpoint import CHECKPOINT

    if (run_dir / CHECKPOINT).exists():
        return f"resume with: {resume_command(run_dir, args)}"
    return ("no checkpoint was written; run the same command again (add overwrite=true if it says the "
            "folder holds an earlier run)")


def resume_command(run_dir: Path, args: argparse.Namespace) -> str:
    """The command that resumes ``run_dir`` on a deployment like this one."""
    flags = [f"--mode {args.mode}"] if args.mode != "tls" else []
    flags += [f"--nodes {args.nodes}"] if args.nodes else []
    flags += [f"--data-root {args.data_root}"] if args.data_root else []
    return " ".join(["pflower deploy", *flags, f"resume={run_dir}"])


def _deploy_one(dep: Deployment, run_config: str, run_dir: Path, rounds: int,
                args: argparse.Namespace) -> tuple[bool, str]:
    """Submit one run; when the SuperLink exits during it, start the SuperLink again on its
    database and resume the run from its checkpoint (at most ``--max-recoveries`` times); when
    its ServerApp exits (killed, say) before the run ended, stop that run on the SuperLink and
    resume it the same way."""
    from common.overrides import split_overrides, to_toml_run_config
    from ops.progress import run_progress
    from ops.recovery import expand_resume
    from server.checkpoint import checkpoint_round
    from server.run_folder import record_recovery

    recoveries = 0
    while True:
        print(f"pflower deploy: flwr run {APP_DIR} {FEDERATION} --run-config '{run_config}'", flush=True)
        started = time.time()
        with run_progress(run_dir, rounds, run_dir.name) as bar:
            code = dep.run(run_config, timeout=args.timeout or None, on_line=None if bar is None else bar.print,
                           follow=(run_dir, rounds))
        ok, text, said_why = run_result(run_dir, started, code)
        server_app_gone = not ok and dep.server_app_gone() and not said_why   # a FAILED would only fail again
        if ok or (dep.link_alive() and not server_app_gone):
            return ok, text
        what = "its ServerApp" if server_app_gone else "the SuperLink"
        after = checkpoint_round(run_dir)
        if after is None or recoveries >= args.max_recoveries:
            return False, f"{text}; {what} exited during the run (not recovering: " + (
                "no checkpoint was written)" if after is None else f"--max-recoveries {args.max_recoveries})")
        recoveries += 1
        assert dep.link is not None and dep.watch is not None
        reason = dep.watch.reason if server_app_gone else f"the SuperLink exited during the run (flwr exit code {code})"
        record_recovery(run_dir, after, reason, dep.link.workdir / "superlink.log")
        if server_app_gone:
            print(f"pflower deploy: resuming {run_dir} from its checkpoint of round {after} ({recoveries} of at "
                  f"most {args.max_recoveries})", file=sys.stderr, flush=True)
        else:
            print(f"pflower deploy: {reason}; starting it again on its database and resuming {run_dir} from "
                  f"its checkpoint of round {after} ({recoveries} of at most {args.max_recoveries})",
                  file=sys.stderr, flush=True)
            dep.restart_link()
        run_config = to_toml_run_config(*split_overrides(expand_resume([f"resume={run_dir}"], "pflower deploy")))


def add_parser(sub: Any) -> None:
    """Register ``pflower deploy`` on the CLI's subparsers."""
    d = sub.add_parser(
        "deploy", help="run on a local multi-process deployment (SuperLink + SuperNodes; HTTP on Flower 1.42, gRPC on 1.39)",
        description="Start one SuperLink and one SuperNode per client on loopback, run each "
                    "strategy (comma lists are swept, e.g. strategy=fedavg,fedbn), collect "
                    "summary.json, and stop every process.")
    d.add_argument("overrides", nargs="*", help="Hydra overrides KEY=VALUE (e.g. experiment=deploy-3)")
    d.add_argument("--mode", choices=MODES, default="tls",
                   help="tls: TLS + SuperNode authentication (default); insecure: neither")
    d.add_argument("--nodes", type=int, default=0, help="SuperNodes to start (default: the dataset's clients)")
    d.add_argument("--workdir", default="", help="folder for certificates, logs, SuperLink db and node state")
    d.add_argument("--data-root", default="", help="data-root given to every SuperNode (node-config)")
    d.add_argument("--timeout", type=float, default=0.0, help="seconds per run before giving up (0 = none)")
    d.add_argument("--max-recoveries", type=int, default=3,
                   help="times a run whose SuperLink or ServerApp exited during it is resumed from its "
                        "checkpoint (0 = never)")
    d.add_argument("--keep-temp", action="store_true",
                   help="keep the temporary work folder (logs, public certificates; private keys are "
                        "always deleted) as <first run folder>/deploy")
    d.set_defaults(func=cmd_deploy)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pflower")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["deploy", *(argv or [])])
    return int(args.func(args))
