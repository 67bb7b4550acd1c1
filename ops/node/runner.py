"""The ClientApp runner of ``pflower-supernode``: every message of a node in one process.

Flower 1.39's SuperNode has its SuperExec start one ``flwr-clientapp`` process per message
(``flwr/supernode/runtime/run_clientapp.py``: pull one task, run it, exit). That process
imports Flower, installs the FAB and loads the ClientApp, which imports torch, reads its data
and starts CUDA, to train a few batches: start-up costs far more than the work (measured in
docs/benchmarks.md, (d)).

``pflower-supernode`` starts this runner next to the SuperNode and puts a stand-in
``flwr-clientapp`` first on the SuperExec's ``PATH`` (:func:`write_stand_in`): a few lines
of Python without site-packages that hand the task's arguments (its token) to the runner
and exit with its exit code. The runner does for each task what Flower's runner does, with
Flower's own functions (pull the task input, run the ClientApp, push the reply and the
Context, heartbeats meanwhile), in a process that imported torch and the ClientApp once and
keeps its data cache and CUDA context.

It runs pflower's ClientApp in process only when the run's FAB carries this installation's
code (the same files, :func:`fab_matches`); any other FAB (a changed checkout, another
app) runs in a fresh process of its own code (:func:`run_in_fab_process`), as with Flower's
runner. When the runner is not there (it crashed, or the socket is gone) the stand-in runs
Flower's real ``flwr-clientapp``. Private client state is on disk and in the Context Flower
keeps, never only in the runner, so a runner that dies loses nothing but the message it was
handling: its SuperNode starts another (:class:`RunnerKeeper`) and fails the task it died
with at once, so that the server sends that message again (``common/flower_compat.py``,
items 1 and 16), instead of the 10 minutes Flower would wait for the task's heartbeats.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import secrets
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import zipfile
from logging import ERROR, INFO, WARNING
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from common.flower_compat import (
    context_from_bytes,
    context_to_bytes,
    fail_task_now,
    install_fab,
    load_fab_clientapp,
    message_from_bytes,
    message_to_bytes,
    run_clientapp_task,
    set_task_identity,
    shorten_object_pull_backoff,
    task_identity,
)
from common.timing import profiled, timing_enabled
from ops.deployment.launch import pid_alive
from ops.node.keepers import Keeper

RUNNER_ENV = "PFLOWER_NODE_RUNNER"          # the runner's socket, for the stand-in
REAL_CLIENTAPP_ENV = "PFLOWER_REAL_CLIENTAPP"  # Flower's flwr-clientapp, the stand-in's fallback
ROOT = Path(__file__).resolve().parents[2]   # where this installation's packages live
CODE_DIRS = ("client", "common", "learning", "strategies", "server", "ops", "conf")
CLIENTAPP_REF = "client.app:app"

STAND_IN = '''#!{python} -S
"""pflower-supernode's stand-in for flwr-clientapp: this task goes to the node's runner
(ops/node/runner.py); Flower's own flwr-clientapp runs it when the runner is not there.
Whichever runs it, a task whose process is killed leaves its token for the SuperNode, which
fails the task at once instead of waiting for its heartbeats (Flower's flwr-clientapp answers
its own errors; one that exits non-zero before its task, say on a bad argument, is left to
Flower: failing its task would start it again at once, without end)."""
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Client

argv = sys.argv[1:]
token = sys.stdin.readline().strip() if "--token-stdin" in argv else ""   # one line, as Flower reads it
args = ([a for a in argv if a != "--token-stdin"] + ["--token", token]) if token else argv
if not token and "--token" in argv[:-1]:
    token = argv[argv.index("--token") + 1]
address = os.environ.get("{runner_env}", "")


def leave_token():
    # the SuperNode's keeper fails the task by its token (a token is longer than a file name may
    # be: it goes in the file, written whole and renamed); a finished task's token is ignored
    if not (token and address):
        return
    ended = os.path.join(address + ".ended", str(os.getpid()))
    try:
        os.makedirs(address + ".ended", mode=0o700, exist_ok=True)
        with open(ended + ".tmp", "w") as f:
            f.write(token)
        os.replace(ended + ".tmp", ended)
    except OSError:
        pass


try:
    with open(os.path.join(os.path.dirname(address), "key"), "rb") as f:
        conn = Client(address, family="AF_UNIX", authkey=f.read())
except Exception as err:   # no runner (gone, being started again, refusing): Flower's own runs the task
    sys.stderr.write("pflower stand-in: no runner (%r); the task runs in Flower's flwr-clientapp\\n" % (err,))
    real = os.environ["{real_env}"]
    child = None

    def pass_on(number, frame):   # a stop of the task is the child's (in a group of its own: once)
        if child is None:
            sys.exit(128 + number)
        child.send_signal(number)

    stand_in = os.getpid()

    def die_with_the_stand_in():   # in a session of its own, a kill of ours would not reach it
        if sys.platform.startswith("linux"):
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        if os.getppid() != stand_in:   # ended before that was set
            os._exit(1)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, pass_on)
    child = subprocess.Popen([real, *argv], stdin=subprocess.PIPE if "--token-stdin" in argv else None,
                             start_new_session=True, preexec_fn=die_with_the_stand_in)
    if child.stdin is not None:
        child.stdin.write((token + "\\n").encode())
        child.stdin.close()
    code = child.wait()
    if code < 0:   # killed: a task it had not finished is failed now (one it had is ignored)
        sys.stderr.write("pflower stand-in: Flower's flwr-clientapp was ended by signal %d\\n" % -code)
        leave_token()
    sys.exit(code if code >= 0 else 128 - code)
with conn:
    try:
        conn.send_bytes("\\0".join(args).encode())
        code = int(conn.recv_bytes())
    except Exception as err:   # the runner ended during the task: its SuperNode fails the task now
        code = 1
        sys.stderr.write("pflower stand-in: the runner ended during the task (%r)\\n" % (err,))
        leave_token()
sys.exit(code)
'''


def write_stand_in(folder: Path) -> Path:
    """The stand-in ``flwr-clientapp`` in ``folder`` (to go first on ``PATH``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "flwr-clientapp"
    text = STAND_IN.format(python=sys.executable, runner_env=RUNNER_ENV, real_env=REAL_CLIENTAPP_ENV)
    tmp = folder / f".flwr-clientapp.{os.getpid()}"
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)   # atomic: a SuperExec never sees half a file
    return path


DIR_ENV = "PFLOWER_RUNNER_DIR"


def runner_dir() -> Path:
    """A folder only this user may enter (the sockets, the key and the stand-in live there)."""
    folder = Path(os.environ.get(DIR_ENV) or tempfile.gettempdir()) / f"pflower-runners-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(f"{folder} must belong to this user and be private (mode 700), it is "
                              f"{oct(stat.S_IMODE(info.st_mode))} owned by uid {info.st_uid}; remove it "
                              f"or set {DIR_ENV} to another folder")
    return folder


def auth_key(folder: Path) -> bytes:
    """The per-user key the stand-in and the runner authenticate with (created once, mode 600)."""
    path = folder / "key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path.read_bytes()


def socket_path(owner: int) -> Path:
    return runner_dir() / f"runner-{owner}.sock"


# ---------------------------------------------------------------------- which code
def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_FAB_MATCHES: dict[str, bool] = {}


def fab_matches(fab_hash: str, fab_content: bytes) -> bool:
    """True when the FAB's ClientApp is this installation's: ``client.app:app`` and every
    file the FAB has under the code folders equal to the file here (cached per FAB hash)."""
    if fab_hash not in _FAB_MATCHES:
        _FAB_MATCHES[fab_hash] = _same_code(fab_content)
    return _FAB_MATCHES[fab_hash]


def _same_code(fab_content: bytes) -> bool:
    with zipfile.ZipFile(io.BytesIO(fab_content)) as fab:
        names = fab.namelist()
        if "pyproject.toml" not in names:
            return False
        components = tomllib.loads(fab.read("pyproject.toml").decode()).get("tool", {}).get(
            "flwr", {}).get("app", {}).get("components", {})
        if components.get("clientapp") != CLIENTAPP_REF:
            return False
        for name in names:
            if name.split("/", 1)[0] not in CODE_DIRS or name.endswith("/"):
                continue
            local = ROOT / name
            if not local.is_file() or _digest(local.read_bytes()) != _digest(fab.read(name)):
                return False
    return True


# ---------------------------------------------------------------------- one task
def run_task(argv: list[str], app: Any, lock: threading.Lock) -> int:
    """What ``flwr-clientapp <argv>`` does (``run_clientapp``), in this process: pflower's
    ClientApp in process when the run's FAB is this installation's code, else the FAB's own
    ClientApp in a process of its own."""

    def handle(message: Any, context: Any, run: Any, fab: Any) -> tuple[Any, Any]:
        if fab_matches(fab.hash_str, fab.content):
            return app(message=message, context=context), context
        log(INFO, "pflower runner: run %s's FAB is not this installation's code; running it "
            "in its own process", run.run_id)
        return run_in_fab_process(fab, run, message, context)

    return run_clientapp_task(argv, handle, lock)


# ---------------------------------------------------------------------- another FAB's code
# A Message crosses to that process the way Flower moves it between processes: as its
# objects (``deflate``/``inflate``, no pickle), framed as a JSON header and the bytes
# (common/flower_compat.py item 13).
encode_message = message_to_bytes
decode_message = message_from_bytes


def _frames(*parts: bytes) -> bytes:
    return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def _unframe(data: bytes) -> list[bytes]:
    out, offset = [], 0
    while offset < len(data):
        (n,) = struct.unpack_from("<Q", data, offset)
        out.append(data[offset + 8:offset + 8 + n])
        offset += 8 + n
    return out


def run_in_fab_process(fab: Any, run: Any, message: Any, context: Any) -> tuple[Any, Any]:
    """Run a FAB that is not this installation's code as Flower would: installed, loaded
    by Flower's loader, in a process of its own (``--one-task``)."""
    install_fab(fab.content)
    request = _frames(json.dumps([run.fab_id, run.fab_version, fab.hash_str, *task_identity()]).encode(),
                      encode_message(message), context_to_bytes(context))
    out = subprocess.run([sys.executable, "-m", "ops.node.runner", "--one-task"], input=request,
                         capture_output=True, cwd="/", check=False)
    sys.stderr.write(out.stderr.decode(errors="replace"))
    if out.returncode != 0:
        raise RuntimeError(f"the FAB's ClientApp process exited with code {out.returncode}; its output "
                           "is above in this SuperNode's log")
    reply_bytes, context_bytes = _unframe(out.stdout)
    return decode_message(reply_bytes), context_from_bytes(context_bytes)


def one_task() -> None:
    """``--one-task``: load the FAB's ClientApp with Flower's loader and run one message
    (stdin: identity, message, context; stdout: reply, context). An exception fails the
    process, as in Flower's runner."""
    ident, message_bytes, context_bytes = _unframe(sys.stdin.buffer.read())
    fab_id, fab_version, fab_hash, run_id, node_id, task_id = json.loads(ident)
    set_task_identity(run_id, node_id, task_id)
    message = decode_message(message_bytes)
    context = context_from_bytes(context_bytes)
    for name in [m for m in sys.modules if m.split(".")[0] in CODE_DIRS]:
        del sys.modules[name]   # the FAB's packages of these names, not this installation's
    app = load_fab_clientapp(fab_id, fab_version, fab_hash)
    reply = app(message=message, context=context)
    sys.stdout.buffer.write(_frames(encode_message(reply), context_to_bytes(context)))


# ---------------------------------------------------------------------- the runner
class WarmUp(threading.Thread):
    """Loads what the ClientApp's handlers need (torch, the trainers; a first optimiser step,
    which imports more of torch; CUDA when there is a GPU) while the runner already listens."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.error: BaseException | None = None

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            import torch

            import client.handlers  # noqa: F401

            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            weight = torch.nn.Parameter(torch.ones(2, device=device))
            opt = torch.optim.SGD([weight], lr=0.1)
            weight.sum().backward()
            opt.step()
            log(INFO, "pflower runner %d: loaded in %.2f s (%s)", os.getpid(), time.perf_counter() - t0, device)
        except BaseException as err:   # the tasks then load it themselves and fail as they would
            self.error = err
            log(ERROR, "pflower runner: loading the ClientApp's modules failed: %r", err)


class Runner:
    """Accepts tasks from the stand-ins until its SuperNode (``owner``) is gone."""

    def __init__(self, address: Path, owner: int) -> None:
        self.address, self.owner, self.lock = address, owner, threading.Lock()

    def serve(self) -> None:
        listener = Listener(str(self.address), family="AF_UNIX", authkey=auth_key(self.address.parent))
        warm = WarmUp()   # torch, the handlers, a first optimiser step: before the first task
        warm.start()
        threading.Thread(target=self._watch, daemon=True).start()
        log(INFO, "pflower runner %d: running the ClientApps of SuperNode %d", os.getpid(), self.owner)
        shorten_object_pull_backoff()   # the task's message, while its SuperNode still receives it
        from client.app import app

        while True:
            try:
                conn = listener.accept()
            except OSError as err:
                log(WARNING, "pflower runner: refused a connection (%s)", err)
                continue
            threading.Thread(target=self._task, args=(conn, app, warm), daemon=True).start()

    def _task(self, conn: Connection, app: Any, warm: WarmUp) -> None:
        with conn:
            try:
                argv = conn.recv_bytes().decode().split("\0")
            except (EOFError, OSError):
                return
            warm.join()
            t0 = time.perf_counter()
            try:
                code = profiled(lambda: run_task(list(argv), app, self.lock), "runner-task")
            except BaseException as err:   # e.g. a bad token: SystemExit from Flower's parser
                log(ERROR, "pflower runner: task failed before it started: %r", err)
                code = 1
            if timing_enabled():
                log(INFO, "pflower timing: task in the runner: %.2f s (exit code %d)", time.perf_counter() - t0, code)
            try:
                conn.send_bytes(str(code).encode())
            except OSError:
                pass

    def _watch(self) -> None:
        """Exit when the SuperNode is gone (its socket with it)."""
        while pid_alive(self.owner):
            time.sleep(1.0)
        log(INFO, "pflower runner %d: SuperNode %d is gone, exiting", os.getpid(), self.owner)
        self.address.unlink(missing_ok=True)
        os._exit(0)


def ended_dir(address: Path) -> Path:
    """Where the stand-ins of a runner that died during their task leave the task's token
    (one file per stand-in, named by its pid) for the runner's SuperNode (:class:`RunnerKeeper`)."""
    return address.with_name(address.name + ".ended")


def start_runner(owner: int) -> tuple[subprocess.Popen, Path]:
    """Start the runner for SuperNode ``owner`` (this process group); returns it and its socket."""
    address = socket_path(owner)
    for stale in address.parent.glob("runner-*.sock"):   # runners killed with their node
        pid = stale.stem.removeprefix("runner-")
        if stale == address or (pid.isdigit() and not pid_alive(int(pid))):
            stale.unlink(missing_ok=True)
    for stale in address.parent.glob("runner-*.sock.ended"):   # tokens of nodes gone
        pid = stale.name.removeprefix("runner-").removesuffix(".sock.ended")
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "-m", "ops.node.runner", "--address", str(address),
                             "--owner-pid", str(owner)], stdin=subprocess.DEVNULL)
    return proc, address


class RunnerKeeper(Keeper):
    """In the SuperNode's process: starts its runner, starts another when it dies (a task that
    finds no runner meanwhile runs in Flower's own ``flwr-clientapp``), and fails at once each
    task whose process ended before the task did, the runner or that ``flwr-clientapp`` (its
    token left in :func:`ended_dir` by the task's stand-in; ``flower_compat.fail_task_now``). Without it the SuperNode waits for that task's reply until
    its heartbeats have been missing 10 minutes, and pulls no other message meanwhile. A runner
    that keeps dying is started again after :class:`~ops.node.keepers.Keeper`'s delays."""

    def __init__(self, owner: int) -> None:
        super().__init__("runner-keeper")
        self.owner = owner
        self._start()

    def _start(self) -> None:
        self.proc, self.address = start_runner(self.owner)
        self.started_at = time.monotonic()

    def check(self, now: float | None = None) -> None:
        """One look: the runner started again when its time has come; the tasks it died with failed."""
        now = time.monotonic() if now is None else now
        code = self.proc.poll()
        if code is not None:
            if self.restart_at is None:
                delay = self._delay(code, now)
                self.restart_at = now + delay
                log(WARNING, "pflower runner %d exited (code %s); starting another in %.1f s", self.proc.pid,
                    code, delay)
            if now >= self.restart_at:
                self.restart_at = None
                self._start()
        self._fail_ended_tasks()

    def _fail_ended_tasks(self) -> None:
        ended = ended_dir(self.address)
        for left in ended.iterdir() if ended.is_dir() else []:
            if left.suffix == ".tmp":   # being written
                continue
            try:
                if fail_task_now(left.read_text().strip()):
                    log(WARNING, "pflower runner: a ClientApp task ended with its process (the runner or "
                        "Flower's flwr-clientapp); it is failed now (CLIENT_APP_CRASHED), and the server "
                        "sends its message again")
                else:
                    log(INFO, "pflower runner: a ClientApp task whose process ended had finished already")
            finally:
                left.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pflower-supernode's ClientApp runner")
    parser.add_argument("--address", type=Path)
    parser.add_argument("--owner-pid", type=int)
    parser.add_argument("--one-task", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_task:
        one_task()
        return
    if args.address is None or args.owner_pid is None:
        parser.error("--address and --owner-pid are required")
    Runner(args.address, args.owner_pid).serve()


if __name__ == "__main__":
    main()
