"""The pflower ServerApp: compose the config, build the strategy, run, write results."""

from __future__ import annotations

from logging import ERROR, INFO, WARNING

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig

from common.config import compose_config, run_config_to_overrides
from common.flower_compat import (
    check_flower_version,
    index_undelivered_messages,
    shorten_object_pull_backoff,
)
from common.methods import build_method_model, strategy_class
from learning.data import FederatedData
from learning.data_cache import DataSummary, load_data_summary, resolve_cache_dir
from learning.params import get_arrays
from server.loop import run_federation
from server.results import RunRecorder
from strategies.base import PersonalizedStrategy, RunSettings

app = ServerApp()


def build_strategy(cfg: DictConfig, data: FederatedData | DataSummary) -> PersonalizedStrategy:
    """Initial model from the run seed, then the configured strategy around it."""
    model = build_method_model(cfg, data.input_shape, data.num_classes)
    cls = strategy_class(str(cfg.strategy.name), cfg.strategy)
    return cls(initial_arrays=get_arrays(model), client_ids=data.client_ids,
               run=RunSettings.from_config(cfg, len(data.client_ids)), options=dict(cfg.strategy),
               model=model, data=data)


def client_info(data: FederatedData | DataSummary) -> dict[str, dict[str, object]]:
    return {cid: {"num_train": c.num_train, "domain": c.domain} for cid, c in data.clients.items()}


@app.main()
def main(grid: Grid, context: Context) -> None:
    check_flower_version()
    shorten_object_pull_backoff()   # replies' arrays: see common/flower_compat.py
    index_undelivered_messages()    # the simulation's message lookup, linear in the clients (item 7)
    cfg = compose_config(dict(context.run_config))
    # the summary from the data cache (no split is loaded on the server); built if not cached
    data = load_data_summary(cfg.dataset, int(cfg.seed), resolve_cache_dir(str(cfg.data_cache)))
    recorder = RunRecorder(cfg, resume=bool(cfg.resume),
                           overrides=run_config_to_overrides(dict(context.run_config)))
    log(INFO, "pflower: strategy=%s dataset=%s (%d clients) model=%s rounds=%d -> %s",
        cfg.strategy.name, cfg.dataset.name, len(data.clients), cfg.model.name, cfg.rounds, recorder.dir)
    try:
        strategy = build_strategy(cfg, data)
        run_federation(strategy, grid, cfg, recorder)
        (recorder.dir / "FAILED").unlink(missing_ok=True)
        summary = recorder.finish(client_info(data), strategy.summary_extras())
    except Exception as err:
        log(ERROR, "pflower run failed: %s", err)
        (recorder.dir / "FAILED").write_text(f"{type(err).__name__}: {err}\n")
        raise
    finally:
        recorder.close()
    log(INFO, "pflower: accuracy mean %.4f min %.4f std %.4f (best round %d by validation) -> %s",
        summary["accuracy_mean"], summary["accuracy_min"], summary["accuracy_std"],
        summary["best_round"], recorder.dir / "summary.json")
    if summary["clients_missing"]:
        log(WARNING, "pflower: %d of %d clients reported; missing: %s", summary["clients_reported"],
            summary["clients_expected"], "; ".join(f"{c} ({r})" for c, r in summary["clients_missing"].items()))
