"""A progress bar for a run you can watch: round i/N, ETA, the last mean and worst-client
accuracy, drawn with ``rich`` below the run's log (which keeps streaming above it).

The numbers come from the run's own ``metrics.jsonl`` (read once a second), so the bar shows
what the results will say, in ``pflower run``, ``sweep`` and ``deploy`` alike. It is on only
when standard output is a terminal (``PFLOWER_PROGRESS=0`` turns it off there too); in a log
file or CI the output is the plain log as before.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

RUN_LOG = "run.log"   # a run's whole log stream, in its folder (pflower run)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*")
_ROUND_LINE = re.compile(r"^\[round \d+/\d+\] ")


@dataclass(frozen=True)
class RoundsSeen:
    """What a run's metrics say so far: rounds recorded, and the last evaluated round's
    mean and worst-client accuracy (None before the first evaluation)."""

    done: int
    mean: float | None = None
    worst: float | None = None


def rounds_seen(metrics: Path) -> RoundsSeen:
    """Read ``metrics.jsonl`` as the recorder does (a line cut short by the writer is dropped)."""
    from server.run_folder import read_rounds

    try:
        records = read_rounds(metrics)
    except OSError:   # not written yet
        return RoundsSeen(0)
    evaluated = [r["evaluate"] for r in records if r.get("evaluate")]
    last = evaluated[-1] if evaluated else {}
    return RoundsSeen(max((int(r.get("round", 0)) for r in records), default=0),
                      last.get("accuracy_mean"), last.get("accuracy_min"))


def progress_wanted(stream: IO[str] | None = None) -> bool:
    """On for a terminal, unless ``PFLOWER_PROGRESS=0``."""
    if os.environ.get("PFLOWER_PROGRESS", "").strip() in ("0", "false", "no", "off"):
        return False
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)())


class RunProgress:
    """The bar of one run; :meth:`print` writes a log line above it."""

    def __init__(self, run_dir: Path, rounds: int, label: str, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        from server.run_folder import METRICS_FILE

        self.metrics = Path(run_dir) / METRICS_FILE
        self._seen, self._stat = RoundsSeen(0), None   # re-read only when the file changed
        self.console = console or Console()
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("rounds"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[accuracy]}"), console=self.console, transient=False)
        self.task = self.progress.add_task(label, total=rounds, accuracy="")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> RunProgress:
        self.progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.update()
        self.progress.stop()

    def update(self) -> None:
        try:
            st = self.metrics.stat()
            stat = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            stat = None
        if stat != self._stat:   # once a round: the file is large with many clients
            self._seen, self._stat = rounds_seen(self.metrics), stat
        seen = self._seen
        accuracy = "" if seen.mean is None else f"accuracy mean {seen.mean:.4f} worst {seen.worst:.4f}"
        self.progress.update(self.task, completed=seen.done, accuracy=accuracy)

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            self.update()

    def print(self, line: str) -> None:
        """A line of the run's log, above the bar (Flower's colours kept)."""
        from rich.text import Text

        self.console.print(Text.from_ansi(line.rstrip("\n")), soft_wrap=True)


@contextmanager
def run_progress(run_dir: Path, rounds: int, label: str, enabled: bool | None = None
                 ) -> Iterator[RunProgress | None]:
    """The bar while the block runs, or None when it is off (not a terminal)."""
    if not (progress_wanted() if enabled is None else enabled):
        yield None
        return
    with RunProgress(run_dir, rounds, label) as bar:
        yield bar


def shown_off_terminal(message: str, level: str) -> bool:
    """Off a terminal ``pflower run`` shows one line per round (``server/loop.py: round_line``),
    warnings and errors; the rest of the stream is in the run folder's log."""
    return level in ("WARNING", "ERROR", "CRITICAL") or bool(_ROUND_LINE.match(message))


class RunOutput:
    """Where the lines of a run's log stream go: every line to the run folder's log
    (``run.log``, colours removed), and to the screen either above the progress bar (a
    terminal) or, off a terminal, only :func:`shown_off_terminal`'s lines. Flower's notices
    that do not apply to ``pflower run`` (``common/flower_compat.py``, item 11) are not shown."""

    def __init__(self, log_path: Path, bar: RunProgress | None = None, stream: IO[str] | None = None,
                 append: bool = False) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("a" if append else "w", encoding="utf-8", errors="replace")
        self.bar, self.stream = bar, stream or sys.stdout

    def __call__(self, line: str) -> None:
        from common.flower_compat import is_inapplicable_notice

        text = _ANSI.sub("", line.rstrip("\n"))
        self._log.write(text + "\n")
        self._log.flush()
        if is_inapplicable_notice(text):
            return
        if self.bar is not None:
            self.bar.print(line)
            return
        level = _LEVEL.match(text)
        message = text[level.end():] if level else text
        if shown_off_terminal(message, level.group(1) if level else ""):
            print(message if level and level.group(1) == "INFO" else text, file=self.stream, flush=True)

    def close(self) -> None:
        self._log.close()

    def __enter__(self) -> RunOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PhaseProgress:
    """Progress of a phase of known length outside the rounds (FedBasis' new-client
    personalisation after the last round, minutes on a CPU): a ``rich`` bar on a terminal,
    otherwise a line at most every ``every_s`` seconds (what, i of N, time left), so that no
    phase longer than a few seconds is silent."""

    def __init__(self, what: str, total: int, every_s: float = 10.0, enabled: bool | None = None,
                 stream: IO[str] | None = None) -> None:
        self.what, self.total, self.every_s, self.done = what, max(int(total), 1), float(every_s), 0
        self.stream = stream or sys.stdout
        self._clock = time.monotonic
        self._start = self._last = self._clock()
        self._bar: Any = None
        if progress_wanted(self.stream) if enabled is None else enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[detail]}"), transient=True)
            self._task = self._bar.add_task(what, total=self.total, detail="")
            self._bar.start()

    def left_s(self) -> float | None:
        """Seconds left at the mean pace so far (None before the first step)."""
        if not self.done:
            return None
        return (self._clock() - self._start) / self.done * (self.total - self.done)

    def step(self, detail: str = "") -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, detail=detail)
            return
        now = self._clock()
        if now - self._last >= self.every_s or self.done == self.total:
            self._last = now
            left = self.left_s()
            eta = "" if left is None or self.done == self.total else f", about {_duration(left)} left"
            print(f"pflower: {self.what}: {self.done}/{self.total}" + (f" ({detail})" if detail else "") + eta,
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

    def __enter__(self) -> PhaseProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"
