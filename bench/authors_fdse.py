"""FDSE against its authors' code on identical inputs (not CI; needs their checkout and FLGo).

    pip install cvxopt prettytable && pip install --no-deps flgo      # what their code imports
    python3 -m bench.authors_fdse --repo /path/to/FDSE_CVPR25          # a checkout of WwZzz/FDSE_CVPR25

Nothing of the authors' code is in this repository: the script imports ``algorithm/fdse.py``
from the folder given (``PACSModel``, ``Server``, ``Client``) and runs it, with FLGo's own
``GeneralCalculator`` for the loss and the optimiser, on what pflower's FDSE sees in
``experiment=fdse-pacs`` (AlexNet with DSE blocks in the authors' code forms, lambda 0.5,
tau 0.5, beta 0.001, weight decay 1e-3, clip 10, momentum 0) on generated PACS-shaped images
(``dataset.synthetic=true``, 120 images of 256 px, one local epoch of batch 10: the data do not
matter for equality, their shape does). Their server and client objects are made without
FLGo's simulator: the attributes their methods read are set from pflower's config, and their
``communicate``/``get_batch_data`` hand them pflower's uploads and mini-batches.

1. the model: pflower's ``fdse-alexnet`` and their ``PACSModel`` with the same weights give the
   same logits (eval and train mode);
2. the server: round 1 of the four clients trained by pflower, aggregated by their
   ``Server.iterate`` (MGDA min-norm consensus per shared tensor through cvxopt, BN_DFE
   statistics averaged, attention over the personal tensors) and by pflower's strategy;
3. the client: round 2 of client 0 (the consistency loss on) from what pflower's server sends,
   by their ``Client.train`` on exactly the mini-batches pflower's ``train_epochs`` draws and
   by pflower's ``FDSETrainer.fit``.

Each line prints the largest absolute difference; float32 round-off (and cvxopt's interior
point tolerance for the consensus weights) is the size to expect. One difference is by
design and printed as such: the authors sum BN_DFE's ``num_batches_tracked`` over clients,
pflower averages it (the counter is unused: the BN momentum is fixed).
"""

from __future__ import annotations

import sys
from itertools import chain
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from bench.authors import checkout_args, recorded_training, replay_of

OVERRIDES = ["experiment=fdse-pacs", "dataset.synthetic=true", "dataset.synthetic_samples=[120]",
             "train.local_epochs=1", "train.batch_size=10"]


def theirs_key(key: str) -> str:
    """pflower's FDSE AlexNet names its blocks at the top level; the authors' model nests
    them in ``encoder`` beside the ``head``."""
    return key if key.startswith("head.") else f"encoder.{key}"


def load_theirs(net: torch.nn.Module, arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    """Load pflower's arrays into the authors' model (their linear DSE blocks are 1x1 convs)."""
    target = net.state_dict()
    net.load_state_dict({theirs_key(k): torch.as_tensor(v).reshape(target[theirs_key(k)].shape)
                         for k, v in arrays.items()}, strict=False)
    return net


def differences(ours: dict[str, np.ndarray], theirs: dict[str, torch.Tensor], keys: list[str]) -> dict[str, float]:
    return {k: float(np.abs(ours[k].reshape(-1) - theirs[theirs_key(k)].numpy().reshape(-1)).max()) for k in keys}


def largest_difference(ours: dict[str, np.ndarray], theirs: dict[str, torch.Tensor], keys: list[str]) -> float:
    return max(differences(ours, theirs, keys).values())


def main(argv: list[str] | None = None) -> int:
    args = checkout_args(argv, "python3 -m bench.authors_fdse", __doc__, "FDSE", "algorithm/fdse.py")
    from algorithm import fdse  # the authors' code
    from flgo.benchmark.toolkits.cv.classification import GeneralCalculator

    from client.fdse import FDSETrainer
    from client.round import ClientRound
    from client.trainer import unprefixed
    from common.config import compose_run
    from common.methods import method_options
    from learning.datasets.federated import load_federated_data
    from learning.params import get_arrays, set_arrays
    from server.app import build_strategy
    from strategies.base import ClientUpdate, TrainRound

    cpu = torch.device("cpu")
    composed = compose_run({}, [*OVERRIDES, f"seed={args.seed}"])
    cfg, settings = composed.cfg, composed.settings
    torch.manual_seed(args.seed)
    data = load_federated_data(cfg.dataset, settings.run.seed)
    strategy = build_strategy(cfg, data)
    trainer = FDSETrainer(cfg, settings)
    options = method_options(cfg.strategy)

    def work(cid: str, server_round: int) -> ClientRound:
        return ClientRound(settings=settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                           input_shape=data.input_shape, device=cpu, server_round=server_round,
                           message_config=dict(strategy.train_config))

    # 1. the forward pass
    ours_model = trainer.new_model(work("0", 1))
    set_arrays(ours_model, strategy.payload_for("0"))
    full = get_arrays(ours_model)
    their_model = load_theirs(fdse.PACSModel(), full)
    missing = sorted(set(their_model.state_dict()) - {theirs_key(k) for k in full})
    if missing:
        raise SystemExit(f"the models differ: the authors' {missing[:3]} have no pflower tensor")
    x = torch.stack([data.client("0").train[i][0] for i in range(8)])
    with torch.no_grad():
        for mode in ("eval", "train"):
            ours_model.train(mode == "train")
            their_model.train(mode == "train")
            print(f"1. forward pass ({mode} mode, 8 images of {tuple(x.shape[1:])}): "
                  f"max |pflower - authors| {float((ours_model(x) - their_model(x)).abs().max()):.2e}")

    # 2. round 1: pflower's clients train, both servers aggregate their uploads
    server = fdse.Server.__new__(fdse.Server)
    server.model, server.clients, server.device = fdse.PACSModel(), [SimpleNamespace(train_data=[0])] * 4, cpu
    server.init_algo_para = lambda defaults: server.__dict__.update(defaults)
    server.initialize()            # their key classes: shared ('dfe', 'head'), local, personal
    server.tau = options.tau
    load_theirs(server.model, strategy.global_arrays)
    ids = list(data.client_ids)
    server.client_states = [
        {k: v for k, v in load_theirs(fdse.PACSModel(), strategy.payload_for(cid)).state_dict().items()
         if k in server.personalized_weight_keys} for cid in ids]
    results = {cid: trainer.fit(work(cid, 1), strategy.payload_for(cid), {}) for cid in ids}
    trained = {cid: unprefixed(r.state, FDSETrainer.TRAINED) for cid, r in results.items()}
    server.sample = lambda: list(range(len(ids)))
    server.communicate = lambda chosen: {"model": [load_theirs(fdse.PACSModel(), trained[ids[i]]) for i in chosen]}
    fdse.Server.iterate(server)
    strategy.aggregate_updates(TrainRound.handed(1), [ClientUpdate(cid, i, r.upload, r.num_examples, dict(r.metrics))
                                   for i, (cid, r) in enumerate(results.items())])
    theirs_global = server.model.state_dict()
    weights, stats = strategy.groups["consensus"], strategy.groups["bn_stats"]
    print(f"2a. consensus step, {len(weights)} shared tensors ({', '.join(str(r.num_examples) for r in results.values())}"
          f" samples): max |pflower - authors| {largest_difference(strategy.global_arrays, theirs_global, weights):.2e}")
    print(f"2b. BN_DFE running statistics, {len(stats)} tensors (plain mean): max |pflower - authors| "
          f"{largest_difference(strategy.global_arrays, theirs_global, stats):.2e}")
    counters = strategy.groups["counters"]
    print(f"2c. BN_DFE num_batches_tracked ({len(counters)} counters, unused): pflower "
          f"{int(strategy.global_arrays[counters[0]])} (mean over clients), authors "
          f"{int(theirs_global[theirs_key(counters[0])])} (sum)")
    personal = [k for k in strategy.personal[ids[0]] if np.issubdtype(strategy.personal[ids[0]][k].dtype, np.floating)]
    mixed = max(largest_difference(strategy.personal[cid], server.client_states[i], personal)
                for i, cid in enumerate(ids))
    print(f"2d. attention mix, {len(personal)} personal tensors x {len(ids)} clients: max |pflower - authors| {mixed:.2e}")

    # 3. round 2 of client 0: the consistency loss on, from what pflower's server sends
    cid = ids[0]
    sent = strategy.payload_for(cid)
    with recorded_training() as drawn:
        result = trainer.fit(work(cid, 2), sent, results[cid].state)
    opt = drawn["opt"]
    replay = replay_of(drawn)
    own = {k: v for k, v in trained[cid].items() if k not in sent}   # the client's local BN_DSE statistics

    def their_update(start: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Their ``Client.train`` from ``start`` on the replayed mini-batches."""
        batches = iter(chain.from_iterable(replay.epochs))
        client: Any = fdse.Client.__new__(fdse.Client)
        client.server = SimpleNamespace(model=load_theirs(fdse.PACSModel(), start), current_round=2, device=cpu)
        client.initialize()
        client.__dict__.update(
            device=cpu, calculator=GeneralCalculator(cpu, optimizer_name="SGD"), get_batch_data=lambda: next(batches),
            num_steps=opt.epochs * len(replay), learning_rate=opt.lr, weight_decay=opt.weight_decay,
            momentum=opt.momentum, clip_grad=settings.train.clip, lmbd=options.lam,
            beta=options.beta)
        fdse.Client.train(client, client.model)
        return client.model.state_dict()

    start = {**own, **sent}
    theirs = their_update(start)
    after = unprefixed(result.state, FDSETrainer.TRAINED)
    weights2 = [k for k in after if np.issubdtype(after[k].dtype, np.floating) and "running_" not in k]
    # the scale of float32 round-off after these steps: their own run from a start one ulp away
    nudged = their_update({k: np.nextafter(v, np.inf, dtype=v.dtype) if k in weights2 else v
                           for k, v in start.items()})
    nudge = {k: theirs[theirs_key(k)].numpy() for k in weights2}
    print(f"3. client update at round 2 ({opt.epochs * len(replay)} steps of batch {opt.batch_size}, lr {opt.lr:.6g}, "
          f"consistency weight {cfg.strategy.lam}, {cfg.strategy.consistency_form} form): max |pflower - authors| "
          f"over the {len(weights2)} weight tensors {largest_difference(after, theirs, weights2):.2e}; their own "
          f"update from a start one float32 ulp away moves by {largest_difference(nudge, nudged, weights2):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
