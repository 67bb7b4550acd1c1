"""A Flower user's own ServerApp: a pflower strategy driven by Flower's own ``Strategy.start``
(no pflower round loop), with pflower's ClientApp. tests/test_flower_start.py packages it
with pflower's modules and writes what ``start`` returned to ``<results_root>/<run_name>/flower_start.json``."""

from __future__ import annotations

import json

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from common.config import compose_run
from common.protocol import to_record
from learning.datasets.cache import load_data_summary, resolve_cache_dir
from server.app import build_strategy, one_blas_thread

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    with one_blas_thread():   # numpy's BLAS on one thread, as pflower's ServerApp (server/app.py)
        start(grid, context)


def start(grid: Grid, context: Context) -> None:
    composed = compose_run(dict(context.run_config))
    cfg, run = composed.cfg, composed.settings.run
    data = load_data_summary(cfg.dataset, run.seed, resolve_cache_dir(run.data_cache))
    strategy = build_strategy(cfg, data)
    result = strategy.start(grid, to_record(strategy.global_arrays), num_rounds=run.rounds,
                            train_config=ConfigRecord({"run-name": run.run_name}),
                            evaluate_config=ConfigRecord({"run-name": run.run_name, "final": False}))
    out = run.run_dir / "flower_start.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "evaluate": {str(r): dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "train": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
        "arrays": sorted(result.arrays.keys()) if result.arrays is not None else [],
    }))
