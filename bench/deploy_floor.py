"""The floor under a deployment round: Flower's own echo app on the same loopback deployment.

``bench.run`` (d) sets ``pflower deploy``'s round beside ``pflower run``'s. This measures what a
deployment round costs with nothing of pflower's in the app and no training: a ServerApp sends
each SuperNode one message a round carrying one array of ``--kb`` kilobytes (a packed message
of pflower's default cnn is 595 KB) and waits for every reply; the ClientApp returns the array
it got. The app is a FAB of its own (made in a temporary folder), submitted with ``flwr run``
to a SuperLink and ``--nodes`` SuperNodes on this machine, insecure, in two set-ups:

- ``flower``: Flower's own ``flower-superlink`` and ``flower-supernode`` and Flower's own
  ``grid.send_and_receive``, as a Flower user runs any app;
- ``pflower-waits``: ``pflower-superlink`` and ``pflower-supernode --no-runner`` (Flower's
  processes with pflower's shorter waits, ``common/flower_compat.py`` items 1-4: a ClientApp
  process per message, as Flower starts it, since pflower's runner runs only pflower's ClientApp)
  and the ServerApp pulling replies every 0.1 s (item 1).

    python -m bench.deploy_floor [--nodes 3] [--kb 595] [--rounds 8] [--setups flower,pflower-waits]

Prints a Markdown table: seconds per round (the median of rounds 2 on) per set-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

from common.flower_compat import fleet_over_http, installed_flower_version
from ops.deployment.deploy import Deployment
from ops.deployment.launch import flwr_run

SETUPS = ("flower", "pflower-waits")

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "echo-floor"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "pflower-bench"

[tool.flwr.app.components]
serverapp = "echo_floor:server"
clientapp = "echo_floor:client"

[tool.flwr.app.config]
nodes = 3
kb = 595
rounds = 8
pflower-waits = false
"""

APP = '''\
"""Echo: a round is one message to each node and its reply, carrying the same array back."""
import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from logging import INFO

client = ClientApp()


@client.train()
def echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"arrays": msg.content.array_records["arrays"]}), reply_to=msg)


server = ServerApp()


@server.main()
def rounds(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    nodes = []
    for _ in range(1200):
        nodes = list(grid.get_node_ids())
        if len(nodes) >= int(cfg["nodes"]):
            break
        time.sleep(0.1)
    payload = np.random.default_rng(0).random(int(cfg["kb"]) * 256, dtype=np.float32)
    for r in range(int(cfg["rounds"])):
        start = time.perf_counter()
        messages = [Message(RecordDict({"arrays": ArrayRecord({"w": Array(payload)})}), dst_node_id=n,
                            message_type="train") for n in nodes]
        if cfg["pflower-waits"]:
            from common.flower_compat import send_and_receive
            replies = send_and_receive(grid, messages, timeout=600)
        else:
            replies = list(grid.send_and_receive(messages, timeout=600))
        if len(replies) != len(nodes) or any(m.has_error() for m in replies):
            raise RuntimeError(f"{len(replies)} of {len(nodes)} replies, or an error among them")
        log(INFO, "ECHO-ROUND %d %.4f", r + 1, time.perf_counter() - start)
'''


def write_app(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(PYPROJECT)
    (folder / "echo_floor.py").write_text(textwrap.dedent(APP))
    return folder


def measure(setup: str, nodes: int, kb: int, rounds: int, workdir: Path) -> list[float]:
    """Round seconds of the echo app on a fresh loopback deployment of ``setup``."""
    stock = setup == "flower"
    app = write_app(workdir / "app")
    seconds: list[float] = []

    def on_line(line: str) -> None:
        if "ECHO-ROUND" in line:
            seconds.append(float(line.split()[-1]))

    config = f"nodes={nodes} kb={kb} rounds={rounds} pflower-waits={'false' if stock else 'true'}"
    with Deployment(nodes, "insecure", workdir=workdir / "work", stock=stock,
                    node_flags=() if stock else ("--no-runner",)) as dep:
        code = flwr_run(app, dep.flwr_home, config, timeout=1800, alive=dep.link_alive, on_line=on_line)
        if code != 0 or len(seconds) != rounds:
            raise SystemExit(f"{setup}: flwr run exited {code} after {len(seconds)} of {rounds} rounds" + dep.logs())
    return seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--kb", type=int, default=595)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--setups", default=",".join(SETUPS))
    args = ap.parse_args(argv)
    rows = []
    for setup in args.setups.split(","):
        if setup not in SETUPS:
            raise SystemExit(f"--setups: {setup!r} is not one of {', '.join(SETUPS)}")
        with tempfile.TemporaryDirectory(prefix="deploy-floor-") as tmp:
            s = measure(setup, args.nodes, args.kb, args.rounds, Path(tmp))
        rows.append(f"| {setup} | {statistics.median(s[1:]):.2f} | {min(s[1:]):.2f}-{max(s[1:]):.2f} |")
    transport = "HTTP" if fleet_over_http() else "gRPC"
    print(f"Echo app, {args.nodes} SuperNodes, one {args.kb} KB array each way per node and round, "
          f"{args.rounds} rounds, insecure, Flower {installed_flower_version()} ({transport} Fleet API), "
          "this machine.\n\n| set-up | s / round (median, rounds 2 on) | range |\n|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
