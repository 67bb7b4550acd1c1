"""The behaviour set: short runs of nine configurations whose numbers a refactor must not move.

    python3 -m bench.behaviour --out /tmp/before.json             # before the change
    python3 -m bench.behaviour --out /tmp/after.json --against /tmp/before.json

Each configuration is a ``pflower run`` of the default experiment for three rounds (one method
per line of ``CONFIGURATIONS``, every server rule and client path: FedAvg, fine-tuning, BN kept
local, Ditto's two models, FedBABU's frozen head, FDSE, FEDORA's propagation, PartialFed's
gates, FedBasis' coefficients). Its record is ``summary.json`` and every line of
``metrics.jsonl`` with what depends on the clock or the machine taken out (``elapsed_s``,
``machine``, ``run_name``), and its SHA-256. ``--against`` compares two records configuration by
configuration and names the first key that differs; exit status 1 when any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIGURATIONS: dict[str, list[str]] = {
    "fedavg": ["strategy=fedavg"],
    "fedavg-ft": ["strategy=fedavg-ft"],
    "fedbn": ["strategy=fedbn"],
    "ditto": ["strategy=ditto"],
    "fedbabu": ["strategy=fedbabu"],
    "fdse": ["strategy=fdse"],
    "fedora": ["strategy=fedora"],
    "partialfed-adaptive": ["strategy=partialfed-adaptive"],
    "fedbasis": ["strategy=fedbasis"],
}
COMMON = ["rounds=3", "eval_every=1", "train.local_epochs=1"]
CLOCK_KEYS = frozenset({"elapsed_s", "machine", "run_name"})


def without_clock(value: Any) -> Any:
    """``value`` with every key that depends on the clock or the machine removed, at any depth."""
    if isinstance(value, dict):
        return {k: without_clock(v) for k, v in value.items() if k not in CLOCK_KEYS}
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    return value


def record_of(run_dir: Path) -> dict[str, Any]:
    summary = without_clock(json.loads((run_dir / "summary.json").read_text()))
    rounds = [without_clock(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    text = json.dumps({"summary": summary, "rounds": rounds}, sort_keys=True)
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "summary": summary, "rounds": rounds}


def run_all(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    records = {}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in names:
        args = [*CONFIGURATIONS[name], *COMMON, f"results_root={root}", f"run_name={name}"]
        done = subprocess.run([sys.executable, "-m", "ops.cli", "run", *args], cwd=REPO, env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name}: pflower run {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}")
        records[name] = record_of(root / name)
        print(f"{name}: {records[name]['sha256'][:16]} accuracy {records[name]['summary']['accuracy_mean']:.4f}",
              flush=True)
    return records


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The first key path at which ``a`` and ``b`` differ, with both values; None if equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}: only in {'the first' if key in a else 'the second'}"
            if (found := first_difference(a[key], b[key], f"{path}.{key}")) is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if (found := first_difference(x, y, f"{path}[{i}]")) is not None:
                return found
        return None
    return None if a == b else f"{path}: {a!r} against {b!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="write the records here (JSON)")
    parser.add_argument("--against", default="", help="records of an earlier run of this command to compare with")
    parser.add_argument("--only", default="", help="comma list of configurations (default: all nine)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGURATIONS)
    with tempfile.TemporaryDirectory(prefix="pflower-behaviour-") as root:
        records = run_all(Path(root), names)
    Path(args.out).write_text(json.dumps(records, sort_keys=True, indent=1))
    if not args.against:
        return 0
    before = json.loads(Path(args.against).read_text())
    differs = 0
    for name in names:
        found = first_difference(before.get(name), records[name]) if name in before else "not in --against"
        print(f"{name}: {'identical' if found is None else 'DIFFERS at ' + found}")
        differs += found is not None
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
