"""FEDORA against its authors' code on identical inputs (not CI; needs their checkout).

    python3 -m bench.authors_fedora --repo /path/to/FEDORA      # a checkout of junwu6/FEDORA

Nothing of the authors' code is in this repository: the script imports it from the folder
given (``models/ClientUpdate.py: LocalUpdateFEDORA``, ``main_fedora.py: normalize_adj``) and
feeds it what pflower's FEDORA (its default code forms) sees, on client 0 of
``experiment=fedora-mnist5k-rotated`` (real MNIST images in [0, 1], the authors' optimiser):

1. the selective lambda: their ``get_loss`` on the validation batches of the client's own model
   and of the propagated one, ``0 or exp(diff / 2)``, against ``FEDORATrainer.selective_weight``;
2. the client update: their ``LocalUpdateFEDORA.train(net, w_fedora, lam)`` (SGD with momentum
   0.9, then the pull with the weights before each step) on exactly the mini-batches pflower's
   ``train_epochs`` draws, against ``FEDORATrainer.fit`` (the model it uploads);
3. the propagation: their ``normalize_adj`` and ``(1 - pa)(I - pa S)^-1`` with ``pa = 0.8`` on the
   top-2 graph of pflower's code-form similarity, against ``strategies/fedora_math.propagate``.

Each line prints the largest absolute difference; float32 round-off is ~1e-6.
Their similarity itself (``torch.svd_lowrank`` of the inputs with one-hot labels, the sum of
principal-angle cosines, ``exp(10 x)``, top-2) is inline in their ``run_FEDORA`` and is not called
here; ``tests/test_fedora_math.py`` checks pflower's against an independent computation.
"""

from __future__ import annotations

import sys
from argparse import Namespace

import numpy as np
import torch

from bench.authors import checkout_args, recorded_training, replay_of


def main(argv: list[str] | None = None) -> int:
    args = checkout_args(argv, "python3 -m bench.authors_fedora", __doc__, "FEDORA", "models/ClientUpdate.py")
    from main_fedora import normalize_adj  # the authors' code
    from models.ClientUpdate import LocalUpdateFEDORA

    from client.fedora import FEDORATrainer
    from client.round import ClientRound
    from client.trainer import MODEL_PREFIX
    from common.config import compose_run
    from common.methods import method_options
    from learning.datasets.federated import load_federated_data
    from learning.models import build_model
    from learning.params import get_arrays
    from learning.training import OptimConfig, make_loader, train_epochs
    from strategies.fedora_math import propagate, subspace_similarity

    composed = compose_run({}, ["experiment=fedora-mnist5k-rotated", f"seed={args.seed}"])
    cfg, settings = composed.cfg, composed.settings
    data = load_federated_data(cfg.dataset, settings.run.seed)
    rnd = ClientRound(settings=settings, client_id="0", data=data.client("0"), num_classes=data.num_classes,
                      input_shape=data.input_shape, device=torch.device("cpu"), server_round=2)
    torch.manual_seed(args.seed)
    own, hat = (build_model(cfg.model, data.input_shape, data.num_classes) for _ in range(2))
    # theta_hat: theta_k trained further (on another client's data), so that it is better on
    # this client's validation set and lambda > 0: the pull is exercised
    hat.load_state_dict(own.state_dict())
    train_epochs(hat, data.client("1").train, OptimConfig(lr=0.05, batch_size=32, momentum=0.9, epochs=5),
               torch.device("cpu"), seed=args.seed)
    own_arrays, hat_arrays = get_arrays(own), get_arrays(hat)

    # pflower: one round of the client, recording the batches train_epochs draws
    with recorded_training() as drawn:
        trainer = FEDORATrainer(cfg, settings)
        lam_ours, own_loss, hat_loss = trainer.selective_weight(rnd, build_from(cfg, data, own_arrays),
                                                                build_from(cfg, data, hat_arrays))
        result = trainer.fit(rnd, dict(hat_arrays), {MODEL_PREFIX + k: v for k, v in own_arrays.items()})
    replay, opt = replay_of(drawn), drawn["opt"]
    val = [(x, y) for x, y in make_loader(rnd.data.val, settings.train.batch_size, shuffle=False)]

    # the authors' client on the same batches, from the same theta_k and theta_hat_k
    their_args = Namespace(inner_lr=settings.train.lr, inner_wd=settings.train.weight_decay,
                           inner_steps=settings.train.local_epochs)
    theirs = LocalUpdateFEDORA(args=their_args, train_loader=replay, val_loader=val)
    with torch.no_grad():
        diff = float(theirs.get_loss(build_from(cfg, data, own_arrays), "cpu")
                     - theirs.get_loss(build_from(cfg, data, hat_arrays), "cpu"))
    lam_theirs = 0.0 if diff < 0 else float(np.exp(diff / 2))
    net = build_from(cfg, data, own_arrays)
    w_fedora = {k: torch.as_tensor(v) for k, v in hat_arrays.items()}
    w_theirs, _ = theirs.train(net, "cpu", w_fedora=w_fedora, lam=torch.tensor(lam_theirs))
    update = max(float(np.abs(result.upload[k] - w_theirs[k].numpy()).max()) for k in result.upload)
    print(f"1. selective lambda: pflower {lam_ours:.6f} (val losses {own_loss:.5f} / {hat_loss:.5f}), "
          f"authors {lam_theirs:.6f}: |diff| {abs(lam_ours - lam_theirs):.2e}")
    print(f"2. client update ({opt.epochs} epochs x {len(replay)} batches, lambda {lam_theirs:.4f}): "
          f"max |pflower - authors| over the uploaded weights {update:.2e}")

    # propagation on pflower's code-form graph of all clients
    bases = [trainer.basis(ClientRound(settings=settings, client_id=c, data=data.client(c), num_classes=data.num_classes,
                                       input_shape=data.input_shape, device=torch.device("cpu"), server_round=1), {})
             for c in data.client_ids]
    w = subspace_similarity(bases, form="code", top_k=2)
    theta = np.random.default_rng(args.seed).standard_normal((len(bases), 1000)).astype(np.float32)
    ours = propagate(theta, w, method_options(cfg.strategy).alpha)
    s = normalize_adj(torch.as_tensor(w, dtype=torch.float32))
    inv = (1 - 0.8) * torch.linalg.inv(torch.eye(len(bases)) - 0.8 * s)
    theirs_hat = (inv @ torch.as_tensor(theta)).numpy()
    print(f"3. propagation ({len(bases)} clients, top-2 graph, a = 0.8): max |pflower - authors| "
          f"{float(np.abs(ours - theirs_hat).max()):.2e}")
    return 0


def build_from(cfg, data, arrays):  # noqa: ANN001, ANN201
    """A fresh model of the run's architecture holding ``arrays``."""
    from learning.models import build_model
    from learning.params import set_arrays

    model = build_model(cfg.model, data.input_shape, data.num_classes)
    set_arrays(model, arrays)
    return model


if __name__ == "__main__":
    sys.exit(main())
