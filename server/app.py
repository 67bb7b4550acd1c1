"""The pflower ServerApp: compose the config, build the strategy, run, write results."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig
from threadpoolctl import threadpool_limits

from common.config import ConfigError, compose_run, run_settings
from common.flower_compat import (
    check_flower_version,
    index_undelivered_messages,
    log_refusals_as_one_line,
    shorten_object_pull_backoff,
)
from common.methods import ResolvedMethod, build_method_model, load_named
from common.overrides import run_config_to_overrides
from common.settings import RunKeys
from learning.datasets.cache import DataSummary, load_data_summary, resolve_cache_dir
from learning.datasets.federated import FederatedData
from learning.datasets.sources import DatasetError
from learning.params import get_arrays
from learning.storage import atomic_write_text
from server.loop import run_federation
from server.results import RunRecorder
from server.run_folder import RunFolderError, finished_summary, run_config_hint
from strategies.base import PersonalizedStrategy, RunSettings

app = ServerApp()


class RunRefused(RuntimeError):
    """A run the ServerApp does not start (its folder holds another run): the run fails on
    the SuperLink with this message, logged as one line."""


def strategy_class(resolved: ResolvedMethod) -> type[PersonalizedStrategy]:
    """The server Strategy class of the resolved method (its variant's when its options set one)."""
    cls: type[PersonalizedStrategy] = load_named(resolved.row.server)
    return cls


def record_dp_summary(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """summary.json's ``record_dp``: each client's epsilon of record-level DP-SGD after its last
    training (rounds' ``record_dp``), and the largest; None without DP-SGD."""
    latest: dict[str, float] = {}
    delta = None
    for record in rounds:
        if "record_dp" in record:
            latest.update(record["record_dp"]["epsilon"])
            delta = record["record_dp"]["delta"]
    if not latest:
        return None
    return {"epsilon_max": max(latest.values()), "epsilon": latest, "delta": delta}


def build_strategy(cfg: DictConfig, data: FederatedData | DataSummary) -> PersonalizedStrategy:
    """Initial model from the run seed, then the configured strategy around it."""
    model = build_method_model(cfg, data.input_shape, data.num_classes)
    settings = run_settings(cfg)
    cls = strategy_class(settings.method)
    return cls(initial_arrays=get_arrays(model), client_ids=data.client_ids,
               run=RunSettings.from_run_keys(settings.run, len(data.client_ids), settings.privacy),
               method=settings.method, model=model, data=data)


def client_info(data: FederatedData | DataSummary) -> dict[str, dict[str, object]]:
    return {cid: {"num_train": c.num_train, "domain": c.domain} for cid, c in data.clients.items()}


def say_finished(run: RunKeys) -> bool:
    """The reuse rule of ``pflower run`` for a run submitted with ``flwr run``: a folder that
    holds this configuration's finished run is reported (one line, in ``--run-config``
    syntax) and nothing is run; True then."""
    run_dir = run.run_dir
    s = finished_summary(run_dir, run)
    if s is None:
        return False
    result = (f": accuracy mean {s['accuracy_mean']:.4f} min {s['accuracy_min']:.4f}"
              if {"accuracy_mean", "accuracy_min"} <= s.keys() else "")
    log(INFO, "pflower: %s already holds this run, finished%s -> %s; nothing run (--run-config "
        "\"overrides='overwrite=true'\" runs it again, --run-config \"run-name='<new name>'\" keeps both)",
        run_dir, result, run_dir / "summary.json")
    return True


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy's BLAS on one thread in the ServerApp's process, for the whole run.

    OpenBLAS's fork handler stops its thread pool; a fork in any thread of the process (Ray
    starting its processes, a subprocess) while another thread waits in a threaded BLAS call
    leaves that call waiting for ever (OpenBLAS issues #294, #2270, #5520). The ServerApp's
    math calls BLAS on vectors of a model's size (FedBasis' cosines of its bases, FEDORA's
    similarities), which OpenBLAS threads, so a run hung in ``FedBasis.__init__`` on a busy
    2-core machine (issue 65). One thread runs no pool, so no fork can stop it; the cost is
    nothing at the sizes the server sees, and the server's sums no longer depend on the
    machine's core count. torch keeps its own threads (its BLAS is not numpy's)."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp: one run, its BLAS on one thread (:func:`one_blas_thread`)."""
    with one_blas_thread():
        serve(grid, context)


def serve(grid: Grid, context: Context) -> None:
    """Compose the run, build its strategy, run the rounds, write the summary."""
    check_flower_version()
    shorten_object_pull_backoff()   # replies' arrays: see common/flower_compat.py
    index_undelivered_messages()    # the simulation's message lookup, linear in the clients (item 7)
    log_refusals_as_one_line(RunRefused, ConfigError, DatasetError)
    composed = compose_run(dict(context.run_config))
    cfg, settings = composed.cfg, composed.settings
    run = settings.run
    if not run.resume and say_finished(run):
        return
    # the summary from the data cache (no split is loaded on the server); built if not cached
    data = load_data_summary(cfg.dataset, run.seed, resolve_cache_dir(run.data_cache))
    try:
        recorder = RunRecorder(cfg, settings, resume=bool(run.resume),
                               overrides=run_config_to_overrides(dict(context.run_config)))
    except RunFolderError as err:   # `pflower run` refuses this before Flower starts; `flwr run .` here
        raise RunRefused(f"pflower: {run_config_hint(err) if err.run_dir else err}") from None
    log(INFO, "pflower: strategy=%s dataset=%s (%d clients) model=%s rounds=%d -> %s",
        cfg.strategy.name, cfg.dataset.name, len(data.clients), cfg.model.name, cfg.rounds, recorder.dir)
    try:
        strategy = build_strategy(cfg, data)
        run_federation(strategy, grid, settings, recorder)
        (recorder.dir / "FAILED").unlink(missing_ok=True)
        extras = strategy.summary_extras()
        if strategy.privacy is not None:
            extras["privacy"] = strategy.privacy.summary()
        if strategy.secure is not None:
            extras["secure_aggregation"] = strategy.secure.summary()
        if (spent := record_dp_summary(recorder.rounds)) is not None:
            extras["record_dp"] = spent
        summary = recorder.finish(client_info(data), extras)
    except Exception as err:
        log(ERROR, "pflower run failed: %s", err)
        try:
            atomic_write_text(recorder.dir / "FAILED", f"{type(err).__name__}: {err}\n")
        except OSError as why:   # e.g. the full disk that failed the run: the log says it
            log(ERROR, "pflower: could not write FAILED either: %s", why)
        raise
    finally:
        recorder.close()
    log(INFO, "pflower: accuracy mean %.4f min %.4f std %.4f (best round %d by validation) -> %s",
        summary["accuracy_mean"], summary["accuracy_min"], summary["accuracy_std"],
        summary["best_round"], recorder.dir / "summary.json")
    if summary["clients_missing"]:
        log(WARNING, "pflower: %d of %d clients reported; missing: %s", summary["clients_reported"],
            summary["clients_expected"], "; ".join(f"{c} ({r})" for c, r in summary["clients_missing"].items()))
