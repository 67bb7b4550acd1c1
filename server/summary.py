"""A run's summary: its final and best-by-validation personalised accuracy over clients,
per BN protocol, which clients it covers, and the machine it ran on (``summary.json``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from common.protocol import client_sort_key
from common.settings import BN_PROTOCOLS, RunKeys, Settings
from strategies.replies import NO_NODE_AT_EVALUATION


def evaluated_rounds(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rounds that carry an evaluation (every ``eval_every`` rounds and the last)."""
    return [r for r in rounds if r.get("evaluate")]


def build_summary(settings: Settings, rounds: list[dict[str, Any]],
                  client_info: Mapping[str, Mapping[str, Any]], status: str) -> dict[str, Any]:
    """Final (last evaluated round) and best-by-validation personalised accuracy."""
    evals = evaluated_rounds(rounds)
    if not evals:
        raise RuntimeError("no evaluation round completed; nothing to summarise")
    last = evals[-1]
    by = best_round_metric(settings.run)
    best = max(best_round_candidates(evals), key=lambda r: r["evaluate"].get(by, -1.0))
    per_client = last["clients"]
    summary: dict[str, Any] = {
        "status": status,
        "strategy": settings.strategy,
        "dataset": settings.dataset,
        "model": settings.model,
        "seed": settings.run.seed,
        "run_name": settings.run.run_name,
        "rounds": int(rounds[-1]["round"]),
        "accuracy_mean": last["evaluate"]["accuracy_mean"],
        "accuracy_min": last["evaluate"]["accuracy_min"],
        "accuracy_std": last["evaluate"]["accuracy_std"],
        "val_accuracy_mean": last["evaluate"].get("val_accuracy_mean"),
        "best_round": best["round"],
        "best_accuracy_mean": best["evaluate"]["accuracy_mean"],
        "best_accuracy_min": best["evaluate"]["accuracy_min"],
        "best_val_accuracy_mean": best["evaluate"].get("val_accuracy_mean"),
        "best_round_by": by,
        "best_val_accuracy": best["evaluate"].get(by),
        # per-client test accuracy at the best round (R-Acc/PTR there, as FEDORA's authors)
        "best_clients": {cid: m["accuracy"] for cid, m in best.get("clients", {}).items()},
        "clients": {},
    }
    for key in ("global_accuracy", "ft_accuracy"):
        if f"{key}_mean" in last["evaluate"]:
            summary[f"{key}_mean"] = last["evaluate"][f"{key}_mean"]
            summary[f"{key}_min"] = last["evaluate"][f"{key}_min"]
            summary[f"{key}_std"] = last["evaluate"][f"{key}_std"]
    curve = {k[len("ft_acc_e"):]: v for k, v in last["evaluate"].items()
             if k.startswith("ft_acc_e") and k.endswith("_mean")}
    if curve:
        summary["finetune_curve"] = {k[: -len("_mean")]: v for k, v in sorted(
            curve.items(), key=lambda kv: int(kv[0].split("_")[0]))}
    for cid, m in sorted(per_client.items(), key=lambda kv: client_sort_key(kv[0])):
        entry = {"accuracy": m["accuracy"], "num_train": int(client_info.get(cid, {}).get("num_train", 0))}
        for key in ("val_accuracy", "global_accuracy", "ft_accuracy"):
            if key in m:
                entry[key] = m[key]
        if "domain" in client_info.get(cid, {}):
            entry["domain"] = client_info[cid]["domain"]
        summary["clients"][cid] = entry
    summary.update(pooled_accuracy(per_client))
    summary.update(bn_protocol_summary(settings.run, evals))
    summary.update(client_coverage(rounds, last, client_info))
    if summary["clients_missing"]:
        summary["status"] = f"{status}-partial" if status != "completed" else "partial"
    comm = [r.get("communication", {}) for r in rounds]
    up = [sum(c.get("bytes_up", {}).values()) for c in comm if c]
    down = [sum(c.get("bytes_down", {}).values()) for c in comm if c]
    if up:
        summary["bytes_up_per_round"] = float(np.mean(up))
        summary["bytes_down_per_round"] = float(np.mean(down))
        per_client_up = [np.mean(list(c["bytes_up"].values())) for c in comm if c.get("bytes_up")]
        summary["bytes_up_per_client_round"] = float(np.mean(per_client_up)) if per_client_up else 0.0
    summary["elapsed_s"] = rounds[-1].get("elapsed_s")
    return summary


def pooled_accuracy(per_client: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """FDSE's "ALL" beside the mean over clients ("AVG"): the accuracy over the pooled test
    samples of every client, sum_k acc_k n_k / sum_k n_k, with n_k the client's test size."""
    sizes = {c: float(m.get("num-examples", 0)) for c, m in per_client.items()}
    total = sum(sizes.values())
    if total <= 0:
        return {}
    return {"accuracy_all": sum(float(m["accuracy"]) * sizes[c] for c, m in per_client.items()) / total}


BN_AS_HELD = "as held (no personal BN model: the server's model, a fine-tuned model, or no BN running statistics)"


def bn_label(summary: Mapping[str, Any]) -> str:
    """The headline's BN protocol in a word or two (``own``, ``stored``, ``as held``), for
    plot titles and table cells."""
    return str(summary.get("bn_statistics", BN_AS_HELD)).split(" (")[0]


def bn_protocol_summary(run: RunKeys, evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Which BN statistics the headline accuracy was tested with (``bn_statistics``: ``own``,
    recomputed on each client's train split, or ``stored``), and every protocol the run
    measured (``bn_protocols``): accuracy at the last round and at the best round, each
    protocol's best round chosen by its own validation accuracy, as the headline's is."""
    measured = [p for p in BN_PROTOCOLS if f"{p}_bn_accuracy_mean" in evals[-1]["evaluate"]]
    if not measured:
        return {"bn_statistics": BN_AS_HELD}
    by = best_round_metric(run)
    protocols: dict[str, dict[str, Any]] = {}
    for protocol in measured:
        key = f"{protocol}_bn_"
        rounds = [r for r in evals if f"{key}accuracy_mean" in r["evaluate"]]
        best = max(rounds, key=lambda r: r["evaluate"].get(key + by, -1.0))
        last = rounds[-1]
        protocols[protocol] = {
            "accuracy_mean": last["evaluate"][f"{key}accuracy_mean"],
            "accuracy_min": last["evaluate"][f"{key}accuracy_min"],
            "best_round": best["round"],
            "best_accuracy_mean": best["evaluate"][f"{key}accuracy_mean"],
            "best_accuracy_min": best["evaluate"][f"{key}accuracy_min"],
            "clients": {cid: m[f"{key}accuracy"] for cid, m in last.get("clients", {}).items()
                        if f"{key}accuracy" in m},
        }
    return {"bn_statistics": run.bn_protocols[0],
            "bn_protocols": protocols}


def best_round_metric(run: RunKeys) -> str:
    """The evaluation metric the best round maximises: ``val_accuracy_mean`` (mean over
    clients, the default) or ``val_accuracy_weighted`` (weighted by each client's validation
    size, as flgo-based code such as FDSE's selects; ``best_round_by: weighted``)."""
    return "val_accuracy_weighted" if run.best_round_by == "weighted" else "val_accuracy_mean"


def best_round_candidates(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds the best round may be chosen from: for fine-tuning methods only evaluations
    that fine-tuned (the others measured the global model before fine-tuning, a different
    protocol), for every other method all evaluated rounds."""
    tuned = [r for r in evals if r["evaluate"].get("finetuned_mean") == 1.0]
    return tuned or evals


def client_coverage(rounds: list[dict[str, Any]], last: Mapping[str, Any],
                    client_info: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Which of the run's clients the final numbers cover, and why the others are missing
    (an accuracy mean over 7 of 8 clients must say so)."""
    expected = sorted(client_info, key=client_sort_key)
    reported = [c for c in expected if c in last.get("clients", {})]
    failed_rounds: dict[str, int] = {}
    last_reason: dict[str, str] = {}
    for r in rounds:
        for cid, reason in {**r.get("failed", {}), **r.get("rejected", {})}.items():
            if cid in client_info:
                failed_rounds[cid] = failed_rounds.get(cid, 0) + 1
                last_reason[cid] = f"round {r['round']}: {reason}"
    eval_failed = last.get("eval_failed", {})
    missing = {c: _why_missing(eval_failed.get(c), last_reason.get(c)) for c in expected if c not in reported}
    return {"clients_expected": len(expected), "clients_reported": len(reported),
            "clients_missing": missing, "client_failures": failed_rounds}


def _why_missing(final_evaluation: str | None, last_failure: str | None) -> str:
    """Why a client has no final numbers: its final evaluation's failure, unless that only says
    its node was gone and an earlier round says how it went (``round 16: ... Node Unavailable``)."""
    if final_evaluation is not None and not (final_evaluation == NO_NODE_AT_EVALUATION and last_failure):
        return f"final evaluation: {final_evaluation}"
    return last_failure or "no reply to the final evaluation"


def machine_description(device: str) -> dict[str, Any]:
    """The machine the run's numbers came from (the server's: in a simulation also the
    clients'): the same seed on another CPU, GPU or torch version may differ in the last
    digits, so a table's per-seed values name it. ``cpu_capability`` is the instruction set
    torch's CPU kernels use (``AVX512``, ``AVX2``, ...): the same code and seed on an AVX2 and
    an AVX512 machine differ by ~1e-8 after a few rounds, and by test images after hundreds
    (docs/reliability.md), while a virtual machine's CPU model often says only "AMD EPYC"."""
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else None
    return {"torch": torch.__version__, "gpu": gpu, "cpu": _cpu_model() or platform.machine(),
            "cpu_capability": cpu_capability(), "cpu_count": os.cpu_count()}


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels use here (``AVX512``, ``AVX2``, ...); a
    checkpoint records it too, so a resume on another one says so (server/checkpoint.py)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# keys whose overrides are not saved: the folder itself says where the run is
