"""Where a simulated client message's time goes, from the lines ``PFLOWER_TIMING=<folder>``
makes each ClientApp process write (``common/timing.py``).

Inside the handler, each part is timed where it happens (configuration, data lookup, state
load and save, model build, training, evaluation, (de)serialisation). Outside it, what a
message costs cannot be timed from the client, so it is what is left of the round: in a round
of ``n`` messages run by ``w`` worker processes, ``w`` x the round's length is the workers'
time, and ``(w x length - sum of the handlers) / n`` is the time per message a worker was not
in a handler (Flower's and Ray's hand-offs, its queues, the server's work between rounds while
the workers wait). The gap between rounds is also given on its own (the round's last handler
end to the next round's first handler start: the server's work and the hand-offs both ways),
and the server's own parts from its lines.

    python -m bench.message_parts <folder> [--first-round 2]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

# the parts in the order a training message meets them (client/handlers.py, ClientTrainer.fit)
PART_ORDER = ("config", "data", "decode", "state load", "evaluate", "model build", "train", "upload",
              "state save", "encode")
# the parts the plain loop (bench/plain_loop.py) does too: the rest is the federation's cost
PLAIN_LOOP_PARTS = ("evaluate", "model build", "train", "upload")


@dataclass(frozen=True)
class MessageParts:
    """Mean milliseconds per message, by part, over the rounds summarised."""

    rounds: int               # rounds summarised
    messages: int             # messages in them
    workers: float            # mean worker processes per round
    parts_ms: dict[str, float]
    handler_ms: float         # the whole handler (the parts plus what no part covers)
    outside_ms: float         # per message, a worker's time not in any handler
    between_rounds_ms: float  # per round: last handler end to the next round's first start (server + hand-offs)
    round_s: float            # mean round length (first start to the next round's first start)
    server_ms: dict[str, float] = field(default_factory=dict)   # per round, the server's parts


def read_lines(folder: Path, role: str = "client") -> list[dict]:
    """Every line of every ``<role>-*.jsonl`` in ``folder`` (``client`` or ``server``)."""
    files = sorted(folder.glob(f"{role}-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no {role}-*.jsonl in {folder}: was the run started with PFLOWER_TIMING={folder}?")
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


def server_parts(lines: Iterable[dict], first_round: int = 2) -> dict[str, float]:
    """Mean ms per round of each part of the server's rounds ``first_round`` .. last-but-one,
    and ``round``: the whole round."""
    lines = [x for x in lines if x.get("type") == "round"]
    last = max((int(x.get("server_round", 0)) for x in lines), default=0)
    # as for the clients: the last round (its final evaluation by evaluate messages) left out
    rounds = [x for x in lines if first_round <= int(x.get("server_round", 0)) < last]
    if not rounds:
        raise ValueError(f"no server round from round {first_round} on: run more rounds")
    total: dict[str, float] = defaultdict(float)
    for x in rounds:
        for name, seconds in x["parts"].items():
            total[name] += seconds
        total["round"] += x["handler_s"]
    return {k: 1e3 * v / len(rounds) for k, v in total.items()}


def read_summary(folder: Path, first_round: int = 2) -> MessageParts:
    """The clients' lines summarised, with the server's parts when its lines are there."""
    summary = summarise(read_lines(folder), first_round)
    if any(folder.glob("server-*.jsonl")):
        summary = replace(summary, server_ms=server_parts(read_lines(folder, "server"), first_round))
    return summary


def summarise(lines: Iterable[dict], first_round: int = 2) -> MessageParts:
    """The messages of rounds ``first_round`` .. last-but-one (a round's length runs to the next
    round's first start, so the last round has none), summarised per message."""
    by_round: dict[int, list[dict]] = defaultdict(list)
    for line in lines:
        # a round's messages: training (with the last round's evaluation, by default) and any
        # evaluate message; a message that failed is left out (its time is not a message's)
        if line.get("type") in ("train", "evaluate") and "server_round" in line and "error" not in line:
            by_round[int(line["server_round"])].append(line)
    rounds = sorted(r for r in by_round if r >= first_round and r + 1 in by_round)
    if not rounds:
        raise ValueError(f"no two consecutive training rounds from round {first_round} on: run more rounds")
    parts: dict[str, float] = defaultdict(float)
    handler = outside = between = length = workers = 0.0
    messages = 0
    for r in rounds:
        msgs, nxt = by_round[r], by_round[r + 1]
        start, next_start = min(m["start"] for m in msgs), min(m["start"] for m in nxt)
        w = len({m["pid"] for m in msgs})
        busy = sum(m["handler_s"] for m in msgs)
        length += next_start - start
        workers += w
        between += next_start - max(m["end"] for m in msgs)
        outside += w * (next_start - start) - busy
        handler += busy
        messages += len(msgs)
        for m in msgs:
            for name, seconds in m["parts"].items():
                parts[name] += seconds
    n = len(rounds)
    return MessageParts(
        rounds=n, messages=messages, workers=workers / n,
        parts_ms={k: 1e3 * v / messages for k, v in sorted(parts.items(), key=lambda kv: _order(kv[0]))},
        handler_ms=1e3 * handler / messages, outside_ms=1e3 * outside / messages,
        between_rounds_ms=1e3 * between / n, round_s=length / n)


def _order(name: str) -> int:
    return PART_ORDER.index(name) if name in PART_ORDER else len(PART_ORDER)


def markdown(columns: dict[str, MessageParts]) -> str:
    """One column per setting: ms per message by part, then the totals."""
    names = list(dict.fromkeys(k for s in columns.values() for k in s.parts_ms))
    head = "| ms per client message | " + " | ".join(columns) + " |"
    rows = [head, "|---" * (len(columns) + 1) + "|"]

    def row(label: str, values: Iterable[float], fmt: str = "{:.1f}") -> None:
        rows.append(f"| {label} | " + " | ".join(fmt.format(v) for v in values) + " |")

    for name in names:
        tag = "" if name in PLAIN_LOOP_PARTS else " (not in the plain loop)"
        row(f"{name}{tag}", (s.parts_ms.get(name, 0.0) for s in columns.values()))
    row("in the handler, in no part", (s.handler_ms - sum(s.parts_ms.values()) for s in columns.values()))
    row("**handler**", (s.handler_ms for s in columns.values()))
    row("**outside the handler** (hand-offs, queues, the server between rounds)",
        (s.outside_ms for s in columns.values()))
    row("of a round: gap between rounds, last handler end to next start (server and hand-offs; ms a round)",
        (s.between_rounds_ms for s in columns.values()))
    row("round, s", (s.round_s for s in columns.values()), "{:.3f}")
    row("worker processes", (s.workers for s in columns.values()), "{:.1f}")
    rows.append("| rounds / messages summarised | " + " | ".join(
        f"{s.rounds} / {s.messages}" for s in columns.values()) + " |")
    server = list(dict.fromkeys(k for s in columns.values() for k in s.server_ms))
    if server:
        rows += ["", "| server, ms a round | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for name in server:
            label = {"replies": "replies (waiting for the clients)", "round": "**round**"}.get(name, name)
            row(label, (s.server_ms.get(name, 0.0) for s in columns.values()))
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="the PFLOWER_TIMING folder of a run")
    ap.add_argument("--first-round", type=int, default=2, help="leave out the rounds before (start-up)")
    args = ap.parse_args()
    print(markdown({args.folder.name: read_summary(args.folder, args.first_round)}))


if __name__ == "__main__":
    main()
