"""Threads in a node's own process (``pflower-superlink``, ``pflower-supernode``) that start a
helper process again when it dies: the node's ClientApp runner (``ops/node/runner.py:
RunnerKeeper``) and Flower's ``flower-superexec`` (:class:`SuperExecKeeper`).

Why the SuperExec: Flower's SuperLink and SuperNode each start one ``flower-superexec``, which
starts every app process of their runs, ServerApps or ClientApps. Neither starts it again when
it dies, and then no later app process starts: the SuperLink's next run (a run being resumed,
the next job of ``pflower deploy``) stays ``pending`` with no end, and a SuperNode pulls its
messages but runs none of them. (The app processes it had started go on: they watch its pid
with ``kill(pid, 0)``, which a zombie passes, and Flower does not reap it.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from logging import ERROR, WARNING

import psutil
from flwr.common.logger import log


class Keeper(threading.Thread):
    """A daemon thread that looks every ``POLL_S`` (:meth:`check`, an error logged and the
    next look tried), and the delay before a dead process is started again: at once after a
    long life, 1, 2, 4, ... up to 60 s when it keeps dying within ``SHORT_LIFE_S`` of its start
    (it cannot start at all, say), and 3 s after SIGTERM or SIGINT, by which time a node that
    is being stopped with it has exited (and this thread, a daemon, with it)."""

    POLL_S = 0.5
    SHORT_LIFE_S = 10.0   # a process that dies sooner after its start counts as a quick death
    MAX_DELAY_S = 60.0
    STOP_GRACE_S = 3.0

    def __init__(self, name: str) -> None:
        super().__init__(daemon=True, name=name)
        self.quick_deaths = 0
        self.started_at = time.monotonic()
        self.restart_at: float | None = None

    def run(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            self.look()

    def look(self) -> None:
        """:meth:`check`, and an error logged, not ending the keeper."""
        try:
            self.check()
        except Exception as err:   # the next look tries again
            log(ERROR, "pflower %s: %r", self.name, err)

    def check(self, now: float | None = None) -> None:
        raise NotImplementedError

    def _delay(self, code: int | None, now: float) -> float:
        if code in (-signal.SIGTERM, -signal.SIGINT):   # its node may be being stopped as well
            return self.STOP_GRACE_S
        self.quick_deaths = self.quick_deaths + 1 if now - self.started_at < self.SHORT_LIFE_S else 0
        return min(self.MAX_DELAY_S, 2.0 ** (self.quick_deaths - 1)) if self.quick_deaths else 0.0


def is_superexec(argv: list[str]) -> bool:
    """``flower-superexec ...`` (its console script, or Python, with flags, running it)."""
    return any(part.rsplit("/", 1)[-1] == "flower-superexec" for part in argv[:3])


def exit_status(pid: int) -> int | None:
    """How child ``pid`` ended, as ``Popen.returncode`` says it (``-N``: signal N), read without
    reaping it; None when it is not a dead child of this process. Why not reaped: the app
    processes a SuperExec started watch its pid with ``kill(pid, 0)`` and exit once it is
    gone; a zombie keeps them going."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


def own_child(pid: int) -> None:
    """Take child ``pid`` off the list of dropped ``Popen`` objects that every later ``Popen``
    of this process reaps (``subprocess._active``): Flower's SuperNode starts its SuperExec
    with a ``Popen`` it does not keep, so the next process the node starts (a runner, say)
    would reap the dead SuperExec and end the apps it had started. The keeper reaps it."""
    active = getattr(subprocess, "_active", None)
    if isinstance(active, list):
        active[:] = [p for p in active if getattr(p, "pid", None) != pid]


class SuperExecKeeper(Keeper):
    """Starts Flower's ``flower-superexec`` of this process (``owner``, the SuperLink's or the
    SuperNode's) again, with the command line it had, when it has died (see the module's
    docstring for why). It only watches: until Flower has started its own SuperExec, and while
    one lives, it does nothing. One SIGKILLed is started again at once (then after 1, 2, 4, ...
    s if it keeps dying); one that exited cleanly (Flower's SuperExec exits 0 on SIGTERM, SIGINT
    and SIGQUIT), was ended by SIGTERM or SIGINT, or ended unknown, after 3 s, in which a node
    being stopped exits. A replacement runs in the owner's process group, so stopping the
    node's group stops it; it is started with ``posix_spawn`` (a ``subprocess.Popen`` would
    reap a dead SuperExec, ending the apps it started), and a dead SuperExec, Flower's or a
    replacement, is reaped only once no live process names it as its ``--parent-pid``."""

    POLL_S = 1.0

    def __init__(self, owner: int) -> None:
        super().__init__("superexec-keeper")
        self.owner = owner
        self.argv: list[str] | None = None   # the SuperExec's command line, once seen
        self.pid: int | None = None
        self.started: set[int] = set()   # the replacements this keeper started
        self.dead: list[int] = []   # dead SuperExecs, not yet reaped

    def live_superexec(self) -> psutil.Process | None:
        for child in psutil.Process(self.owner).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and is_superexec(child.cmdline()):
                    return child
            except psutil.Error:   # gone meanwhile
                continue
        return None

    def check(self, now: float | None = None) -> None:
        """One look: the SuperExec's command line remembered while it lives; started again when
        it has been gone for its delay."""
        now = time.monotonic() if now is None else now
        self._reap_unwatched()
        live = self.live_superexec()
        if live is not None:
            if live.pid != self.pid:
                self.argv, self.pid = live.cmdline(), live.pid
                own_child(live.pid)
            return
        if self.argv is None:   # Flower has not started it yet
            return
        if self.restart_at is None:
            code = exit_status(self.pid) if self.pid is not None else None
            delay = self.STOP_GRACE_S if code in (None, 0) else self._delay(code, now)
            self.restart_at = now + delay
            log(WARNING, "pflower: Flower's SuperExec (pid %s) exited (%s); starting it again in %.1f s (without "
                "it no app process of a later task would start)", self.pid,
                "end unknown" if code is None else f"code {code}", delay)
        if now >= self.restart_at:
            self.restart_at = None
            if self.pid is not None:
                self.dead.append(self.pid)
            pid = os.posix_spawnp(self.argv[0], self.argv, dict(os.environ))   # in the owner's group
            self.started.add(pid)
            self.pid, self.started_at = pid, now
            log(WARNING, "pflower: started Flower's SuperExec again (pid %d)", pid)

    def _reap_unwatched(self) -> None:
        """Reap the dead SuperExecs no live app process names as its ``--parent-pid``."""
        if not self.dead:
            return
        watched = set()
        for proc in psutil.process_iter(["cmdline"]):
            argv = proc.info.get("cmdline") or []
            watched.update(argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--parent-pid")
        for pid in [p for p in self.dead if str(p) not in watched]:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            self.dead.remove(pid)
