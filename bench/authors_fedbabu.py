"""FedBABU against its authors' code on identical inputs (not CI; needs their checkout).

    python3 -m bench.authors_fedbabu --repo /path/to/FedBABU      # a checkout of jhoon-oh/FedBABU

Nothing of the authors' code is in this repository: the script imports it from the folder
given (``models/Nets.py: CNNCifar``, ``models/Update.py: LocalUpdate``, ``models/Fed.py: FedAvg``)
and feeds it what pflower's FedBABU sees in ``experiment=fedbabu-cifar100-tau10 model=cnn4`` on
generated CIFAR-100-shaped images (``dataset.synthetic=true``; the data do not matter for
equality, their shape does; without the random crop and flip, whose draws the replay could not
share):

1. the model: pflower's ``cnn4`` and their ``CNNCifar`` (4 x conv3x3-BN-ReLU-maxpool, 64 channels,
   a linear head) with the same weights give the same logits;
2. the client update: their ``LocalUpdate.train(net, body_lr=lr, head_lr=0)`` (one SGD with the
   head's lr 0) on exactly the mini-batches pflower's ``train_epochs`` draws, against
   ``FedBABUTrainer.fit`` from the same global model (pflower keeps the head out of the
   optimiser);
3. the aggregation: their ``FedAvg`` (a plain mean of the uploads) of three clients' updates,
   against the strategy's body average (``strategy.weighted=false``, the default).

Each line prints the largest absolute difference. The fine-tune at evaluation is their
``LocalUpdate.train`` again (all parameters at the fine-tune lr); it is not repeated here.
"""

from __future__ import annotations

import sys
from argparse import Namespace

import numpy as np
import torch

from bench.authors import checkout_args, recorded_training, replay_of


def main(argv: list[str] | None = None) -> int:
    args = checkout_args(argv, "python3 -m bench.authors_fedbabu", __doc__, "FedBABU", "models/Update.py")
    from models.Fed import FedAvg  # the authors' code
    from models.Nets import CNNCifar
    from models.Update import LocalUpdate

    from client.fedbabu import FedBABUTrainer
    from client.round import ClientRound
    from common.config import compose_run
    from learning.datasets.federated import load_federated_data
    from server.app import build_strategy
    from strategies.base import ClientUpdate, TrainRound

    composed = compose_run({}, ["experiment=fedbabu-cifar100-tau10", "strategy=fedbabu", "model=cnn4", "dataset.synthetic=true",
                                "dataset.synthetic_samples=[600]", "dataset.clients_per_domain=3",
                                "dataset.partition=dirichlet",   # unequal clients: a plain mean is not a weighted one
                                "dataset.augment=none",   # random crops would differ between the two replays
                                "model.bn_running_stats=false", f"seed={args.seed}"])
    cfg, settings = composed.cfg, composed.settings
    data = load_federated_data(cfg.dataset, settings.run.seed)
    strategy = build_strategy(cfg, data)
    trainer = FedBABUTrainer(cfg, settings)
    their_net = CNNCifar(Namespace(num_classes=data.num_classes))
    ours_keys = list(strategy.payload_for(None))
    theirs_keys = list(their_net.state_dict())
    if len(ours_keys) != len(theirs_keys):
        raise SystemExit(f"the models differ: {len(ours_keys)} tensors (pflower) vs {len(theirs_keys)} (authors)")
    to_theirs = dict(zip(ours_keys, theirs_keys, strict=True))

    def load_theirs(arrays: dict[str, np.ndarray]) -> CNNCifar:
        net = CNNCifar(Namespace(num_classes=data.num_classes))
        net.load_state_dict({to_theirs[k]: torch.as_tensor(v) for k, v in arrays.items()})
        return net

    # 1. the forward pass
    payload = strategy.payload_for("0")
    rnd0 = ClientRound(settings=settings, client_id="0", data=data.client("0"), num_classes=data.num_classes,
                       input_shape=data.input_shape, device=torch.device("cpu"), server_round=1,
                       message_config=dict(strategy.train_config))
    ours_model = trainer.new_model(rnd0)
    from learning.params import set_arrays

    set_arrays(ours_model, payload)
    x = torch.stack([data.client("0").train[i][0] for i in range(8)])
    ours_model.eval()
    their = load_theirs(payload).eval()
    with torch.no_grad():
        forward = float((ours_model(x) - their(x)).abs().max())
    print(f"1. forward pass (cnn4 vs CNNCifar, 8 images): max |pflower - authors| {forward:.2e}")

    # 2. the client update of three clients, on the batches pflower draws
    updates, worst = [], 0.0
    for i, cid in enumerate(data.client_ids[:3]):
        rnd = ClientRound(settings=settings, client_id=cid, data=data.client(cid), num_classes=data.num_classes,
                          input_shape=data.input_shape, device=torch.device("cpu"), server_round=1,
                          message_config=dict(strategy.train_config))
        sent = strategy.payload_for(cid)
        with recorded_training() as drawn:
            result = trainer.fit(rnd, sent, {})
        opt, ds = drawn["opt"], drawn["ds"]
        their_args = Namespace(local_bs=opt.batch_size, momentum=opt.momentum, wd=opt.weight_decay,  # type: ignore[attr-defined]
                               local_ep=opt.epochs, local_ep_pretrain=0, device="cpu")  # type: ignore[attr-defined]
        local = LocalUpdate(args=their_args, dataset=ds, idxs=range(len(ds)))  # type: ignore[arg-type]
        local.ldr_train = replay_of(drawn)
        w, _ = local.train(net=load_theirs(sent), body_lr=opt.lr, head_lr=0.0)  # type: ignore[attr-defined]
        worst = max(worst, max(float(np.abs(result.upload[k] - w[to_theirs[k]].numpy()).max())
                               for k in result.upload))
        updates.append((ClientUpdate(cid, i, result.upload, result.num_examples, dict(result.metrics)), w))
    print(f"2. client update ({opt.epochs} epochs, 3 clients, head frozen): max |pflower - authors| "  # type: ignore[attr-defined]
          f"over the uploaded body {worst:.2e}")

    # 3. the aggregation
    strategy.aggregate_updates(TrainRound.handed(1), [u for u, _ in updates])
    avg = FedAvg([w for _, w in updates])
    agg = max(float(np.abs(strategy.global_arrays[k] - avg[to_theirs[k]].numpy()).max())
              for k in updates[0][0].arrays if np.issubdtype(strategy.global_arrays[k].dtype, np.floating))
    print(f"3. aggregation (3 clients of {', '.join(str(u.num_examples) for u, _ in updates)} samples): "
          f"max |pflower - authors' FedAvg| over the body {agg:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
