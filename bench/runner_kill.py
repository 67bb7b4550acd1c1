"""A ClientApp runner SIGKILLed in the middle of its tasks, in a loopback deployment.

    python3 -m bench.runner_kill [--rounds 6] [--kill-at 2,4,5] [--after 0.5] [--target runner|fallback]

FedAvg on ``experiment=deploy-3`` (insecure, 3 SuperNodes, ``train.local_epochs=8`` so that a
task lasts seconds). Each time SuperNode 1 has received its k-th train message (k in
``--kill-at``), its runner is SIGKILLed ``--after`` seconds after the task reached it (its
stand-in ``flwr-clientapp`` runs), in the middle of the task.

``--target fallback``: Flower's own ``flwr-clientapp``, which runs a task when the stand-in
finds no runner (a runner dead and loading again), is SIGKILLed instead. To send the k-th task
there, the runner's socket is hidden (renamed) once SuperNode 1 has sent its (k-1)-th train
reply, and put back once that process was killed ``--after`` seconds after it started.
Prints the kills, each round's time and failures, and what the SuperNode's log says of each
(the stand-in, the keeper). Exit status 1 when a round recorded a failure.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from common.overrides import to_toml_run_config
from ops.deployment.deploy import Deployment
from ops.node.runner import socket_path

SAID = ("stand-in", "exited", "failed now", "finished already")


def runners_of(owner: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if "ops.node.runner" in " ".join(p.info["cmdline"] or []) and f"--owner-pid {owner}" in
            " ".join(p.info["cmdline"] or [])]


def clientapps_of(owner: int) -> list[psutil.Process]:
    """The ``flwr-clientapp`` processes under SuperNode ``owner``: stand-ins, and Flower's own
    where a stand-in fell back to it (a child of the stand-in)."""
    def named(proc: psutil.Process) -> bool:
        try:
            return "flwr-clientapp" in " ".join(proc.cmdline())
        except psutil.Error:   # gone, or a zombie not yet reaped
            return False

    try:
        return [c for c in psutil.Process(owner).children(recursive=True) if named(c)]
    except psutil.Error:
        return []


def fallbacks_of(owner: int) -> list[psutil.Process]:
    """Flower's own ``flwr-clientapp`` under SuperNode ``owner`` (its parent is the stand-in)."""
    apps = clientapps_of(owner)
    return [c for c in apps if any(c.ppid() == a.pid for a in apps)]


def wait_for(find: Callable[[], list[psutil.Process]], run: threading.Thread,
             limit_s: float = 60.0) -> list[psutil.Process]:
    """The processes ``find`` gives once it gives some, while the run goes on; [] after ``limit_s``."""
    end = time.monotonic() + limit_s
    while run.is_alive() and time.monotonic() < end:
        found = find()
        if found:
            return found
        time.sleep(0.05)
    return []


def kill(procs: list[psutil.Process]) -> int:
    killed = 0
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        except psutil.Error:
            pass
    return killed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kill-at", default="2,4,5", help="the train messages (counted on SuperNode 1) to kill at")
    ap.add_argument("--after", type=float, default=0.5,
                    help="seconds after the process to kill appears (Flower's flwr-clientapp takes 1-2 s to "
                         "import before it pulls its task: give the fallback 3 or more)")
    ap.add_argument("--target", choices=("runner", "fallback"), default="runner",
                    help="the runner in the middle of a task, or Flower's flwr-clientapp that runs a task "
                         "while the runner is gone")
    args = ap.parse_args(argv)
    kill_at = {int(k) for k in args.kill_at.split(",")}
    if args.target == "fallback" and 1 in kill_at:
        ap.error("--target fallback kills at train messages 2 and later (the runner is hidden after a reply)")
    root = Path(tempfile.mkdtemp(prefix="runner-kill-"))
    results, kills, holder = root / "results", [], {}
    cfg = to_toml_run_config({"experiment": "deploy-3", "strategy": "fedavg", "rounds": str(args.rounds),
                              "run-name": "kill", "results-root": str(results)},
                             ["wait_for_clients=120", "round_timeout=150", "eval_every=3", "train.local_epochs=8"])
    with Deployment(3, "insecure", workdir=root / "work") as dep:
        run = threading.Thread(target=lambda: holder.setdefault("code", dep.run(cfg, timeout=1500)))
        run.start()
        owner, log, seen, replied = dep.nodes[1].proc.pid, root / "work" / "supernode-1.log", 0, 0
        socket = socket_path(owner)
        hidden = socket.with_name(socket.name + ".hidden")
        while run.is_alive():
            time.sleep(0.05)
            text = log.read_text() if log.exists() else ""
            count, sent = text.count("Receiving: train message"), text.count("Sending: train message")
            if args.target == "fallback" and sent > replied:
                replied = sent
                if sent + 1 in kill_at and socket.exists():   # between tasks: the next one finds no runner
                    socket.rename(hidden)
            if count > seen:
                seen = count
                if count not in kill_at:
                    continue
                target = (lambda: runners_of(owner) if clientapps_of(owner) else []) if args.target == "runner" \
                    else (lambda: fallbacks_of(owner))
                if wait_for(target, run):
                    time.sleep(args.after)
                    if kill(target()):
                        kills.append(count)
                if hidden.exists():
                    hidden.rename(socket)
        run.join()
        said = [line for line in log.read_text().splitlines() if any(s in line for s in SAID)]
    rounds = [json.loads(line) for line in (results / "kill" / "metrics.jsonl").read_text().splitlines()]
    print(f"flwr run exit {holder.get('code')}; {args.target} SIGKILLed at train messages {kills}")
    for r in rounds:
        print(f"round {r['round']}: {r['elapsed_s']:.1f} s, failed {r['failed'] or '-'}")
    print("SuperNode 1 said:\n  " + "\n  ".join(said))
    return 1 if holder.get("code") != 0 or any(r["failed"] for r in rounds) else 0


if __name__ == "__main__":
    raise SystemExit(main())
