"""What testing a personal model under both BN protocols costs a client, per evaluated round
(docs/benchmarks.md, "BN protocols"; not CI):

    python3 -m bench.bn_eval_cost

A Ditto client of the default data: its evaluation with the stored statistics only (the
protocol before own statistics became the default), with its own only (one pass over its train
split to recompute them), with both (the default, ``eval_bn_compare``), and its training round
for scale; interleaved, one thread, the minimum of 15 calls each.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from client.baselines import DittoTrainer
from client.round import ClientRound
from common.config import compose_run
from learning.datasets.federated import load_federated_data
from learning.models import build_model
from learning.params import get_arrays

SETTINGS = {"stored only (before)": ["eval_bn_statistics=stored", "eval_bn_compare=false"],
            "own only": ["eval_bn_compare=false"], "own + stored (default)": [], "train round": []}


def client_call(name: str, overrides: list[str]) -> tuple[Callable[[], object], ClientRound]:
    """One client's evaluation under ``overrides`` (or its training round), ready to time."""
    composed = compose_run({"strategy": "ditto"}, overrides)
    cfg, settings = composed.cfg, composed.settings
    data = load_federated_data(cfg.dataset, 0)
    rnd = ClientRound(settings=settings, client_id="0", data=data.client("0"), num_classes=data.num_classes,
                      input_shape=data.input_shape, device=torch.device("cpu"), server_round=2)
    torch.manual_seed(0)
    payload = get_arrays(build_model(cfg.model, rnd.input_shape, rnd.num_classes))
    trainer = DittoTrainer(cfg, settings)
    state = trainer.fit(rnd, payload, {}).state
    if name == "train round":
        return (lambda: trainer.fit(rnd, payload, state)), rnd
    return (lambda: trainer.evaluate(rnd, payload, state)), rnd


def main() -> int:
    torch.set_num_threads(1)
    calls = {name: client_call(name, overrides) for name, overrides in SETTINGS.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(16):                      # the first pass warms up, the rest are timed
        for name, (call, _) in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    rnd = next(iter(calls.values()))[1]
    print(f"Ditto client 0 of digits-domains ({len(rnd.data.train)} train, {len(rnd.data.val)} val, "
          f"{len(rnd.data.test)} test), cnn, 1 thread, min of 15 interleaved calls:")
    for name, ts in times.items():
        print(f"  {name}: {1000 * min(ts[1:]):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
