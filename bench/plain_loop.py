"""The reference the simulation is measured against: the same FedAvg work in one process,
plain PyTorch and numpy, no Flower: the same config, data, model, local training function
(``ClientTrainer.fit``), aggregation (``weighted_mean``) and evaluation of every client
every round (``ClientTrainer.evaluate``), each client's split read as the simulation's
clients read it (``load_client_data``, from the data cache).

    python -m bench.plain_loop rounds=5 [more Hydra overrides]

Prints one JSON line per round (``{"round": r, "wall": <unix time at its end>}``) after a
line ``{"ready": <unix time when round 1 starts>}``.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
    from client.handlers import trainer_class
    from client.round import ClientRound
    from common.config import compose_run
    from common.methods import build_method_model
    from learning.datasets.cache import cache_key, fill_cache, load_client_data, resolve_cache_dir
    from learning.models import resolve_device, set_deterministic
    from learning.params import get_arrays, weighted_mean
    from learning.training import seed_everything

    composed = compose_run({}, argv)
    cfg, settings = composed.cfg, composed.settings
    run = settings.run
    if settings.strategy != "fedavg":
        raise SystemExit("the plain loop is FedAvg's; compare it with strategy=fedavg")
    # each client's split as the simulation's clients read it: from the data cache (filled
    # here as `pflower run` fills it) when it holds this dataset, else as built
    cache = resolve_cache_dir(run.data_cache)
    data = fill_cache(cfg.dataset, run.seed, cache)
    cached = cache is not None and (cache / cache_key(cfg.dataset, run.seed) / "info.json").is_file()
    splits = {cid: load_client_data(cfg.dataset, run.seed, cid, cache)[0] if cached else data.client(cid)
              for cid in data.client_ids}
    device = resolve_device(run.device)
    set_deterministic(run.deterministic)
    seed_everything(run.seed)
    trainer = trainer_class(settings.method)(cfg, settings)
    global_arrays = get_arrays(build_method_model(cfg, data.input_shape, data.num_classes))
    states: dict[str, dict] = {}
    print(json.dumps({"ready": time.time()}), flush=True)
    for r in range(1, run.rounds + 1):
        uploads, sizes = [], []
        for cid in data.client_ids:
            rnd = ClientRound(settings, cid, splits[cid], data.num_classes, data.input_shape, device, r,
                              {"server-round": r})
            result = trainer.fit(rnd, global_arrays, states.get(cid, {}))
            states[cid] = result.state
            uploads.append(result.upload)
            sizes.append(result.num_examples)
        global_arrays = {**global_arrays, **weighted_mean(uploads, [float(s) for s in sizes])}
        accuracies = []
        for cid in data.client_ids:
            rnd = ClientRound(settings, cid, splits[cid], data.num_classes, data.input_shape, device, r,
                              {"server-round": r, "final": r == run.rounds})
            accuracies.append(trainer.evaluate(rnd, global_arrays, states[cid])["accuracy"])
        print(json.dumps({"round": r, "wall": time.time(),
                          "accuracy_mean": sum(accuracies) / len(accuracies)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
