"""Soak check (not CI): long simulations side by side on a loaded machine all finish, each
with the numbers it gets alone.

    python3 -m bench.soak [--rounds 300] [--hogs 1] [--out results/soak]

Starts ``--hogs`` busy-loop processes, then four ``pflower run`` simulations at once (FedAvg,
FedBN, Local and FedProx on the default data and CNN, ``--rounds`` rounds each), waits for
all, stops the hogs, then runs each configuration again alone. Passes when every run exits
0 and each concurrent run's summary (final accuracy, every client's accuracy, and every
round's mean accuracy) equals its lone twin's exactly (the CPU path is deterministic, and
a recovered run resumes bit for bit). Writes ``<out>/soak.json`` and prints a table with
each run's wall time, recoveries and status. On this 2-core machine the default takes
about 45 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STRATEGIES = ("fedavg", "fedbn", "local", "fedprox")


def pflower_run(overrides: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "ops.cli", "run", *overrides], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def numbers(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"accuracy_mean": s["accuracy_mean"], "clients": {c: v["accuracy"] for c, v in s["clients"].items()},
            "per_round": [r.get("evaluate", {}).get("accuracy_mean") for r in rounds]}


def run_batch(names: list[str], rounds: int, root: Path, together: bool) -> dict[str, dict]:
    out: dict[str, dict] = {}
    procs = {}
    for name in names:
        args = [f"strategy={name}", f"rounds={rounds}", f"results_root={root}", f"run_name={name}",
                "overwrite=true"]
        procs[name] = (pflower_run(args, root / f"{name}.log"), time.monotonic())
        if not together:
            code = procs[name][0].wait()
            out[name] = {"code": code, "wall_s": round(time.monotonic() - procs[name][1], 1)}
        else:
            time.sleep(20)   # stagger the Ray start-ups
    if together:
        for name, (proc, t0) in procs.items():
            code = proc.wait()
            out[name] = {"code": code, "wall_s": round(time.monotonic() - t0, 1)}
    for name, rec in out.items():
        summary = root / name / "summary.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            rec.update(status=s["status"], recoveries=s.get("recoveries", 0), accuracy_mean=s["accuracy_mean"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes beside the runs")
    parser.add_argument("--out", default="results/soak")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args(argv)
    names = args.strategies.split(",")
    out = Path(args.out).resolve()
    (out / "together").mkdir(parents=True, exist_ok=True)
    (out / "alone").mkdir(parents=True, exist_ok=True)

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    t0 = time.monotonic()
    try:
        together = run_batch(names, args.rounds, out / "together", together=True)
    finally:
        for hog in hogs:
            hog.kill()
    together_s = time.monotonic() - t0
    alone = run_batch(names, args.rounds, out / "alone", together=False)

    ok = True
    print("| run | together: exit, wall s, status, recoveries | alone: exit, wall s | equal |")
    print("|---|---|---|---|")
    for name in names:
        a, b = together[name], alone[name]
        equal = (a["code"] == 0 and b["code"] == 0
                 and numbers(out / "together" / name) == numbers(out / "alone" / name))
        ok &= equal
        a["equal_to_alone"] = equal
        print(f"| {name} | {a['code']}, {a['wall_s']}, {a.get('status')}, {a.get('recoveries')} | "
              f"{b['code']}, {b['wall_s']} | {'yes' if equal else 'NO'} |")
    report = {"rounds": args.rounds, "hogs": args.hogs, "cpus": os.cpu_count(), "together_s": round(together_s, 1),
              "together": together, "alone": alone, "passed": ok}
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    print(f"soak {'PASSED' if ok else 'FAILED'}: {len(names)} runs of {args.rounds} rounds beside "
          f"{args.hogs} busy loop(s) in {together_s:.0f} s; report {out / 'soak.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
