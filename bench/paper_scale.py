"""Each paper's setting at its real size (not CI): does it run, how much memory, how long?

    python3 -m bench.paper_scale                       # every setting, full data (a GPU box)
    python3 -m bench.paper_scale --only fdse-pacs --fraction 0.1   # a 2-core machine
    python3 -m bench.paper_scale --out results/paper_scale.md

Each setting is its experiment file run unchanged with ``dataset.synthetic=true`` (generated
images of the real dataset's shape: clients, classes, samples per domain, image size; see
``learning/datasets/sources.py: SyntheticImages``) for 2 rounds through ``pflower run``. FedBasis' warm-up
is one round (``strategy.warm_fraction=0.5``) so that round 2 follows the K-means seeding.

Measured: seconds of round 2 (training, the carried evaluation of round 1, aggregation; from
the run's ``metrics.jsonl``; a round waits up to a day for its clients, and clients that still
failed are counted in the row), bytes up and down in round 2, the peak resident memory of the
server (the ``flwr-simulation`` process: ServerApp and Ray driver) and of the largest client
(a Ray ``ClientAppActor``), sampled from ``/proc`` every 0.2 s. ``--fraction F`` keeps a
fraction F of every domain's samples (the clients, model and image size stay real) where the
machine is too slow for the full data: the projected full-run time is then
``paper rounds x s/round / F``, an upper bound (the per-round overhead scales with it too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.run import machine
from common.overrides import override_key

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Setting:
    """One paper setting: its experiment file and what it needs to run 2 rounds."""

    experiment: str
    extra: tuple[str, ...]
    paper_rounds: int
    what: str


SETTINGS: dict[str, Setting] = {
    "fedbabu-cifar100-cnn4": Setting("fedbabu-cifar100-tau10", ("model=cnn4",), 32,
                                     "FedBABU CIFAR-100, 100 clients, f=0.1, tau=10, 4-layer CNN"),
    "fedbabu-cifar100-mobilenet": Setting("fedbabu-cifar100-tau10", (), 32,
                                          "FedBABU CIFAR-100, 100 clients, f=0.1, tau=10, MobileNet"),
    "partialfed-office-home": Setting("partialfed-office-home", (), 50,
                                      "PartialFed-Adaptive Office-Home, 4 clients, ResNet-18 224 px"),
    "fedbasis-pacs": Setting("fedbasis-pacs", ("strategy.warm_fraction=0.5",), 100,
                             "FedBasis PACS PFLBED, 80 + 40 new clients, ResNet-18 224 px, K = 4 + 1"),
    "fedbasis-office-home": Setting("fedbasis-office-home", ("strategy.warm_fraction=0.5",), 100,
                                    "FedBasis Office-Home PFLBED, 80 + 40 new clients, ResNet-18 224 px, K = 4 + 1"),
    "fdse-pacs": Setting("fdse-pacs", (), 500, "FDSE PACS, 4 clients, AlexNet 256 px, 5 local epochs"),
    "fdse-office-caltech10": Setting("fdse-office-caltech10", (), 500,
                                     "FDSE Office-Caltech10, 4 clients, AlexNet 256 px, 1 local epoch"),
    "fdse-domainnet": Setting("fdse-domainnet", (), 500, "FDSE DomainNet, 6 clients, AlexNet 256 px, 5 local epochs"),
    "fedora-rotated-mnist": Setting("fedora-rotated-mnist", (), 500, "FEDORA Rotated MNIST, 36 clients, MLP"),
}


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class PeakMemory(threading.Thread):
    """Peak RSS of a run's server process and of its largest client actor, from /proc."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.server_mb, self.client_mb, self.done = root, 0.0, 0.0, False

    def run(self) -> None:
        from ops.deployment.launch import cmdline, process_tree

        while not self.done:
            for pid in process_tree(self.root)[1:]:
                cmd = cmdline(pid)
                if "flwr-simulation" in cmd:
                    self.server_mb = max(self.server_mb, _rss_mb(pid))
                elif "ClientAppActor" in cmd:
                    self.client_mb = max(self.client_mb, _rss_mb(pid))
            time.sleep(0.2)


def scaled_samples(setting: Setting, fraction: float) -> list[str]:
    """The override that keeps ``fraction`` of every domain's synthetic samples."""
    if fraction >= 1.0:
        return []
    from common.config import compose_config

    cfg = compose_config({}, [f"experiment={setting.experiment}", "dataset.synthetic=true", *setting.extra])
    counts = [max(1, round(n * fraction)) for n in cfg.dataset.synthetic_samples]
    return [f"dataset.synthetic_samples=[{','.join(map(str, counts))}]"]


@dataclass
class Measured:
    """One ``pflower run``: its exit code, wall time, metrics.jsonl records and peak memory."""

    code: int
    wall_s: float
    rounds: list[dict]
    server_mb: float
    client_mb: float
    log_tail: str

    def round_seconds(self, index: int = -1) -> float:
        """Seconds of round ``index`` (default the last: training, the previous round's carried
        evaluation, aggregation), from the server's elapsed time at the end of each round."""
        rounds = self.rounds[: len(self.rounds) + index + 1] if index < 0 else self.rounds[: index + 1]
        return rounds[-1]["elapsed_s"] - rounds[-2]["elapsed_s"] if len(rounds) > 1 else rounds[-1]["elapsed_s"]

    def round_mb(self, index: int = -1) -> float:
        comm = self.rounds[index].get("communication", {})
        return (sum(comm.get("bytes_up", {}).values()) + sum(comm.get("bytes_down", {}).values())) / 1e6


def measure_run(name: str, overrides: list[str], root: Path, options: tuple[str, ...] = ()) -> Measured:
    """``pflower run [options] <overrides>`` into ``root/name``, memory sampled while it runs."""
    cmd = [sys.executable, "-m", "ops.cli", "run", *options, *overrides, f"results_root={root}", f"run_name={name}"]
    started = time.time()
    log_path = root / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PFLOWER_PROGRESS": "0"})
        memory = PeakMemory(proc.pid)
        memory.start()
        code = proc.wait()
    memory.done = True
    memory.join()
    metrics = root / name / "metrics.jsonl"
    rounds = [json.loads(s) for s in metrics.read_text().splitlines() if s.strip()] if metrics.exists() else []
    return Measured(code, time.time() - started, rounds, memory.server_mb, memory.client_mb,
                    log_path.read_text(errors="replace")[-2000:])


# a round of a paper setting on a small machine can take longer than the default round_timeout
# (600 s): the benchmark measures whole rounds, so it waits a day unless told otherwise
ROUND_TIMEOUT = "round_timeout=86400"


def run_setting(name: str, setting: Setting, fraction: float, extra: list[str], root: Path) -> dict[str, object]:
    timeout = [] if any(override_key(o) == "round_timeout" for o in extra) else [ROUND_TIMEOUT]
    overrides = [f"experiment={setting.experiment}", "dataset.synthetic=true", "rounds=2", *timeout,
                 *setting.extra, *scaled_samples(setting, fraction), *extra]
    m = measure_run(name, overrides, root)
    row: dict[str, object] = {"setting": name, "what": setting.what, "fraction": fraction, "exit": m.code,
                              "wall_s": round(m.wall_s, 1), "command": " ".join(overrides),
                              "server_peak_mb": round(m.server_mb), "client_peak_mb": round(m.client_mb)}
    if m.code != 0 or len(m.rounds) < 2:
        row["error"] = m.log_tail
        return row
    seconds = m.round_seconds()
    row.update({
        "s_per_round": round(seconds, 1),
        "mb_per_round": round(m.round_mb(), 1),
        "clients_trained": len(m.rounds[-1].get("sampled", [])) - len(m.rounds[-1].get("failed", {})),
        "clients_failed": len(m.rounds[-1].get("failed", {})),
        "projected_full_run_h": round(setting.paper_rounds * seconds / fraction / 3600, 1),
        "paper_rounds": setting.paper_rounds,
    })
    return row


def table(rows: list[dict[str, object]]) -> str:
    out = ["| setting | data fraction | s / round (round 2) | MB / round | server peak MB | client peak MB "
           "| projected full run h (paper rounds) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['what']} | {r['fraction']} | failed (exit {r['exit']}) | | {r['server_peak_mb']} "
                       f"| {r['client_peak_mb']} | |")
            continue
        failed = f" ({r['clients_failed']} clients failed)" if r.get("clients_failed") else ""
        out.append(f"| {r['what']} | {r['fraction']} | {r['s_per_round']}{failed} | {r['mb_per_round']} "
                   f"| {r['server_peak_mb']} | {r['client_peak_mb']} | {r['projected_full_run_h']} "
                   f"({r['paper_rounds']}) |")
    return "\n".join(out)


def report(markdown: str, rows: list[dict[str, object]], out: str) -> None:
    """Print the machine, date and table; append them and the JSON rows to ``out`` if given."""
    text = f"{machine()}, {time.strftime('%Y-%m-%d')}\n\n{markdown}\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n" + "\n".join(json.dumps(r) for r in rows) + "\n\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.paper_scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--fraction", type=float, default=1.0, help="share of each domain's samples kept")
    parser.add_argument("--set", nargs="*", default=[], help="extra overrides for every setting")
    parser.add_argument("--out", default="", help="append the Markdown table and the JSON rows here")
    args = parser.parse_args(argv)
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="paper-scale-") as tmp:
        for name in args.only:
            row = run_setting(name, SETTINGS[name], args.fraction, list(args.set), Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    report(table(rows), rows, args.out)


if __name__ == "__main__":
    main()
