"""Chaos run: a seeded schedule of SIGKILL and SIGSTOP/SIGCONT to random processes of a run,
and what each run ends as.

    python3 -m bench.chaos [--methods fedavg,ditto,fedora,fedbasis,fdse,partialfed-adaptive]
                           [--modes sim,deploy] [--rounds 30] [--faults 6] [--seed 0]
                           [--out results/chaos]

For each method and mode (``sim``: ``pflower run`` on the default data; ``deploy``: ``pflower
deploy experiment=deploy-3``, a loopback deployment of 3 SuperNodes), the run is made once
without faults (its *twin*) and once under chaos: every 1-6 s (seeded; ``--gap``) one live
process of the run is picked at random, a kind of process first and then one of that kind
(``pflower`` itself, the SuperLink, its SuperExec, ``flwr run``, the simulation or ServerApp,
a SuperNode, a ClientApp runner, a Ray process), and is either killed (SIGKILL) or paused
(SIGSTOP, then SIGCONT after 0.5-8 s), ``--faults`` times per run, its resumes included.
Starting a run (a deployment above all) takes longer than the gap, so a schedule of times
alone lands nearly every fault before the first round. A share of the faults
(``--during-rounds``, 0.75 by default) therefore waits, besides its time, until the attempt has
recorded a round it had not when the fault was drawn: that fault lands during the rounds, at
a random point of a round, its evaluation, its record or its checkpoint.

An attempt that ends without a completed summary must leave ``FAILED`` and print its resume
command; the harness then stops what the attempt left behind and runs that command (a
*manual resume*, itself under chaos until the fault budget is spent); a run whose attempt
after the last fault does not complete is *lost*. A completed run is compared with its twin: every
round's per-client numbers and the summary, digit for digit (*identical*), else it is
*explained* when the first difference comes at or after a round whose ``failed`` names a
client the chaos cut off (a Ray worker or a SuperNode killed mid-message is that client's
failure, recorded, as a client that drops is), else *differs*.

Writes ``<out>/chaos.json`` (every fault: run, process kind, signal, the round the run was
in, the processes alive) and prints the counts: faults by process and by moment (start-up,
before the first round is recorded; the rounds; after the last round), runs identical,
explained, that needed a manual resume, differing, lost. Passes (exit 0) when none is lost or differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

METHODS = ("fedavg", "ditto", "fedora", "fedbasis", "fdse", "partialfed-adaptive")
# what each run is made of, beyond its method: short local work, frequent checkpoints
COMMON = ["checkpoint_every=1", "eval_every=5", "train.local_epochs=1", "round_timeout=120", "wait_for_clients=120"]
MODES = {"sim": ["run"], "deploy": ["deploy", "experiment=deploy-3"]}
PROGRESS_WAIT_S = 180.0   # a fault waiting for a round fires anyway after this long (a stuck attempt)
MAX_ATTEMPTS = 100   # a run whose fault budget is spent gets one attempt without faults
# first match wins: a SuperNode's command line names its SuperLink (``--superlink host:port``), so
# SuperNodes are told apart first (before 2026-12-07 "superlink" came first, and 3 in 4 of the
# faults counted as the SuperLink's hit a SuperNode)
KINDS = (("superexec", "flower-superexec"), ("runner", "ops.node.runner"), ("supernode", "supernode"),
         ("superlink", "superlink"), ("flwr run", "bin/flwr run"), ("simulation", "flwr-simulation"),
         ("serverapp", "flwr-serverapp"), ("ray worker", "ray::"), ("ray", "/ray/"), ("pflower", "ops.cli"))


def kind_of(cmdline: str) -> str:
    """A process' role in a run, from its command line."""
    for kind, mark in KINDS:
        if mark in cmdline:
            return kind
    return f"other ({Path(cmdline.split(' ')[0]).name})"


def descendants(root: int) -> list[psutil.Process]:
    """``root`` and every process under it (empty once it is gone)."""
    try:
        proc = psutil.Process(root)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def stop_all(procs: list[psutil.Process]) -> None:
    """SIGCONT then SIGKILL every process still alive (what a killed ``pflower`` left)."""
    for p in procs:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
    psutil.wait_procs(procs, timeout=10)


def rounds_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    n = 0
    for line in path.read_text().splitlines():
        try:
            n = max(n, int(json.loads(line)["round"]))
        except (ValueError, KeyError):
            break
    return n


class Chaos:
    """The seeded schedule of one run, across its attempts (``budget`` faults in all)."""

    def __init__(self, rng: random.Random, budget: int, log: list[dict[str, Any]],
                 gap: tuple[float, float] = (1.0, 6.0), during_rounds: float = 0.75) -> None:
        self.rng, self.budget, self.log, self.gap = rng, budget, log, gap
        self.during_rounds = during_rounds

    def _draw(self, run_dir: Path) -> tuple[float, int | None]:
        """The next fault: the earliest time it may fire, and the round count the run must pass
        first (None: time alone)."""
        after = rounds_done(run_dir) if self.rng.random() < self.during_rounds else None
        return time.monotonic() + self.rng.uniform(*self.gap), after

    def attempt(self, proc: subprocess.Popen, run: str, run_dir: Path) -> list[psutil.Process]:
        """Inject faults into ``proc``'s tree until it exits; returns every process it had."""
        seen: dict[int, psutil.Process] = {}
        next_at, after = self._draw(run_dir)
        while proc.poll() is None:
            for p in descendants(proc.pid):
                seen.setdefault(p.pid, p)
            now = time.monotonic()
            progressed = after is None or rounds_done(run_dir) > after or now > next_at + PROGRESS_WAIT_S
            if self.budget > 0 and now >= next_at and progressed:
                self.fault(proc, run, run_dir, waited_for_round=after is not None)
                next_at, after = self._draw(run_dir)
            time.sleep(0.1)
        return list(seen.values())

    def fault(self, proc: subprocess.Popen, run: str, run_dir: Path, waited_for_round: bool = False) -> None:
        by_kind: dict[str, list[psutil.Process]] = {}
        for p in descendants(proc.pid):
            try:
                by_kind.setdefault(kind_of(" ".join(p.cmdline())), []).append(p)
            except psutil.Error:
                continue
        if not by_kind:
            return
        # a kind first, then one of its processes: Ray's many processes do not drown the others
        kind = self.rng.choice(sorted(by_kind))
        target = self.rng.choice(sorted(by_kind[kind], key=lambda p: p.pid))
        action = self.rng.choice(["SIGKILL", "SIGSTOP"])
        pause = round(self.rng.uniform(0.5, 8.0), 2)
        self.budget -= 1
        done = rounds_done(run_dir)
        at_round = done + 1
        try:
            if action == "SIGKILL":
                target.kill()
            else:
                target.suspend()
                time.sleep(pause)
                target.resume()
        except psutil.Error:
            pass
        self.log.append({"run": run, "process": kind, "signal": action, "pause_s": pause if action == "SIGSTOP" else 0,
                         "round": at_round, "recorded": done, "waited_for_round": waited_for_round,
                         "t": round(time.time(), 2),
                         "alive": {k: len(v) for k, v in sorted(by_kind.items())}})


def start(mode: str, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "ops.cli", *args], stdout=log.open("a"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def completed(run_dir: Path, since: float) -> bool:
    """Whether the run finished since ``since``: completed, or ``partial`` (some clients missing
    from the final numbers; then compared with its twin like any other)."""
    summary = run_dir / "summary.json"
    return (summary.exists() and summary.stat().st_mtime >= since
            and json.loads(summary.read_text()).get("status", "").startswith(("completed", "partial")))


def numbers(run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"summary": {k: s.get(k) for k in ("accuracy_mean", "accuracy_min", "clients")},
            "rounds": [{"round": r["round"], "clients": r.get("clients"), "failed": r.get("failed", {}),
                        "eval_failed": r.get("eval_failed") or {}, "train": r.get("train")} for r in rounds]}


def compare(chaos: dict[str, Any], twin: dict[str, Any]) -> str:
    """identical, explained (each round that differs, or follows one that does, comes at or
    after a round whose ``failed`` or ``eval_failed`` names a client), or differs."""
    if chaos == twin:
        return "identical"
    first_failure = next((r["round"] for r in chaos["rounds"] if r["failed"] or r["eval_failed"]), None)
    first_difference = next((a["round"] for a, b in zip(chaos["rounds"], twin["rounds"], strict=False) if a != b),
                            chaos["rounds"][-1]["round"] if chaos["rounds"] else None)   # else the summary
    if first_failure is not None and first_difference is not None and first_difference >= first_failure:
        return "explained"
    return "differs"


def resume_command(output: str) -> list[str] | None:
    """The resume command an attempt printed (``resume with: pflower ...``) in its ``output``."""
    found = re.findall(r"resume with: pflower (.+)", output)
    return found[-1].split() if found else None


def chaos_run(method: str, mode: str, rounds: int, root: Path, chaos: Chaos) -> dict[str, Any]:
    name = f"{method}-{mode}"
    base = [*MODES[mode], f"strategy={method}", f"rounds={rounds}", f"results_root={root}", *COMMON]
    twin_dir, run_dir = root / f"{name}-twin", root / name
    if not completed(twin_dir, 0):
        code = start(mode, [*base, f"run_name={name}-twin", "overwrite=true"], root / f"{name}-twin.log").wait()
        if code != 0:
            raise SystemExit(f"the fault-free twin {twin_dir} failed (exit {code}); see {root / f'{name}-twin.log'}")
    log = root / f"{name}.log"
    log.write_text("")
    t0 = time.time()
    args = [*base, f"run_name={name}", "overwrite=true"]
    outcome: dict[str, Any] = {"run": name, "attempts": 0, "manual_resumes": 0}
    while outcome["attempts"] < MAX_ATTEMPTS:
        outcome["attempts"] += 1
        fault_free = chaos.budget <= 0
        printed_before = log.stat().st_size
        proc = start(mode, args, log)
        seen = chaos.attempt(proc, name, run_dir)
        stop_all([p for p in seen if p.pid != proc.pid])   # what a killed pflower left running
        if completed(run_dir, t0) or fault_free:   # a fault-free attempt that fails: the run is lost
            break
        with log.open("rb") as f:   # this attempt's output only
            f.seek(printed_before)
            again = resume_command(f.read().decode(errors="replace"))
        outcome.setdefault("failed_markers", []).append(
            {"exit": proc.returncode, "FAILED": (run_dir / "FAILED").exists(), "resume_printed": again is not None})
        if again is None and (run_dir / "checkpoint" / "server.npz").exists():
            again = [*MODES[mode][:1], f"resume={run_dir}"]   # pflower itself was killed: nothing printed
        args = again or args   # killed before its first checkpoint: the same command again
        outcome["manual_resumes"] += 1
    outcome["completed"] = completed(run_dir, t0)
    outcome["outcome"] = compare(numbers(run_dir), numbers(twin_dir)) if outcome["completed"] else "lost"
    outcome["wall_s"] = round(time.time() - t0, 1)
    return outcome


def write_report(args: argparse.Namespace, faults: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``<out>/chaos.json``: every fault, every run, and their counts."""
    by_process = Counter(f"{f['process']} {f['signal']}" for f in faults)
    by_moment = Counter("start-up" if f["round"] == 1 and not f.get("recorded") else
                        "after the last round" if f["round"] > args.rounds else "during the rounds"
                        for f in faults)
    report = {"faults": faults, "runs": runs, "by_process": dict(by_process), "by_moment": dict(by_moment),
              "outcomes": dict(Counter(r["outcome"] for r in runs)),
              "manual_resumes": sum(r["manual_resumes"] for r in runs), "seed": args.seed,
              "rounds": args.rounds, "faults_per_run": args.faults}
    (args.out / "chaos.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--modes", default="sim,deploy")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--faults", type=int, default=6, help="faults per run (its resumes included)")
    ap.add_argument("--gap", default="1,6", help="seconds between faults: uniform in LOW,HIGH")
    ap.add_argument("--during-rounds", type=float, default=0.75,
                    help="share of faults that wait for the run to record a new round first (0 = time alone)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/chaos"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng, faults, runs = random.Random(args.seed), [], []
    low, high = (float(x) for x in args.gap.split(","))
    gap = (low, high)
    for mode in args.modes.split(","):
        for method in args.methods.split(","):
            outcome = chaos_run(method, mode, args.rounds, args.out.resolve(), Chaos(rng, args.faults, faults, gap,
                                                                                     args.during_rounds))
            runs.append(outcome)
            print(f"chaos: {outcome['run']}: {outcome['outcome']} after {outcome['attempts']} attempt(s), "
                  f"{sum(f['run'] == outcome['run'] for f in faults)} faults, {outcome['wall_s']} s", flush=True)
            report = write_report(args, faults, runs)   # after every run: a run stopped early keeps them
    print(f"chaos: {len(faults)} faults in {len(runs)} runs; by process: "
          + ", ".join(f"{k} {v}" for k, v in sorted(report["by_process"].items())))
    print("chaos: by moment: " + ", ".join(f"{k} {v}" for k, v in sorted(report["by_moment"].items())))
    print(f"chaos: outcomes {report['outcomes']}; manual resumes {report['manual_resumes']}; "
          f"report {args.out / 'chaos.json'}")
    return 0 if all(r["outcome"] in ("identical", "explained") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
