"""A ClientApp runner SIGKILLed in the middle of its tasks, in a loopback deployment.

    python3 -m bench.runner_kill [--rounds 6] [--kill-at 2,4,5] [--after 0.5]

FedAvg on ``experiment=deploy-3`` (insecure, 3 SuperNodes, ``train.local_epochs=8`` so that a
task lasts seconds). Each time SuperNode 1 has received its k-th train message (k in
``--kill-at``), its runner is SIGKILLed ``--after`` seconds after the task reached it (its
stand-in ``flwr-clientapp`` runs), in the middle of the task.
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
from pathlib import Path

import psutil

from common.overrides import to_toml_run_config
from ops.deployment.deploy import Deployment

SAID = ("stand-in", "exited", "failed now", "finished already")


def runners_of(owner: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if "ops.node.runner" in " ".join(p.info["cmdline"] or []) and f"--owner-pid {owner}" in
            " ".join(p.info["cmdline"] or [])]


def wait_for_task(owner: int, run: threading.Thread, limit_s: float = 60.0) -> bool:
    """Until a task of SuperNode ``owner`` is with its runner (its stand-in ``flwr-clientapp``
    runs); False when none came within ``limit_s``."""
    end = time.monotonic() + limit_s
    while run.is_alive() and time.monotonic() < end:
        try:
            children = psutil.Process(owner).children(recursive=True)
            if any("flwr-clientapp" in " ".join(c.cmdline()) for c in children):
                return True
        except psutil.Error:
            pass
        time.sleep(0.05)
    return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kill-at", default="2,4,5", help="the train messages (counted on SuperNode 1) to kill at")
    ap.add_argument("--after", type=float, default=0.5, help="seconds after the task reaches the runner")
    args = ap.parse_args(argv)
    kill_at = {int(k) for k in args.kill_at.split(",")}
    root = Path(tempfile.mkdtemp(prefix="runner-kill-"))
    results, kills, holder = root / "results", [], {}
    cfg = to_toml_run_config({"experiment": "deploy-3", "strategy": "fedavg", "rounds": str(args.rounds),
                              "run-name": "kill", "results-root": str(results)},
                             ["wait_for_clients=120", "round_timeout=150", "eval_every=3", "train.local_epochs=8"])
    with Deployment(3, "insecure", workdir=root / "work") as dep:
        run = threading.Thread(target=lambda: holder.setdefault("code", dep.run(cfg, timeout=1500)))
        run.start()
        owner, log, seen = dep.nodes[1].proc.pid, root / "work" / "supernode-1.log", 0
        while run.is_alive():
            time.sleep(0.2)
            count = log.read_text().count("Receiving: train message") if log.exists() else 0
            if count > seen:
                seen = count
                if count in kill_at and wait_for_task(owner, run):
                    time.sleep(args.after)
                    for proc in runners_of(owner):
                        proc.send_signal(signal.SIGKILL)
                        kills.append(count)
        run.join()
        said = [line for line in log.read_text().splitlines() if any(s in line for s in SAID)]
    rounds = [json.loads(line) for line in (results / "kill" / "metrics.jsonl").read_text().splitlines()]
    print(f"flwr run exit {holder.get('code')}; runner SIGKILLed at train messages {kills}")
    for r in rounds:
        print(f"round {r['round']}: {r['elapsed_s']:.1f} s, failed {r['failed'] or '-'}")
    print("SuperNode 1 said:\n  " + "\n  ".join(said))
    return 1 if holder.get("code") != 0 or any(r["failed"] for r in rounds) else 0


if __name__ == "__main__":
    raise SystemExit(main())
