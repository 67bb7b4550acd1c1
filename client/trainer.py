"""Client trainers: what a client does with a round's payload, written once.

:class:`ClientTrainer` is the FedAvg client. A method subclasses it and overrides only
what differs (which keys stay private, which are uploaded, an extra loss term, how the
personalised model is formed). Trainers are plain Python (no Flower import): the ClientApp
in ``client/handlers.py`` is the thin glue that turns messages into these calls.

Private state is a flat dict of numpy arrays with prefixed names (``model/<key>`` for a
client's own copy of model tensors); the ClientApp persists it with ClientStateStore.
"""

from __future__ import annotations

import copy
import hashlib
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from omegaconf import DictConfig
from torch import nn

from client.finetune import (
    FINETUNED,
    finetune_and_evaluate,
    finetune_trainable,
    finetunes_this_round,
)
from client.round import ClientRound, evaluate_splits
from common.methods import build_method_model, roles_of
from common.roles import FROZEN, KEPT, LOCAL, PERSONAL, UPLOADED, keys_with
from common.settings import BN_OWN, Settings
from common.timing import part
from learning.dpsgd import DPSGDConfig
from learning.params import NDArrays, get_arrays, set_arrays
from learning.training import (
    LossTerm,
    LossTerms,
    OptimConfig,
    has_bn_running_stats,
    recompute_bn_statistics,
    train_epochs,
)

MODEL_PREFIX = "model/"


@dataclass
class FitResult:
    upload: NDArrays
    metrics: dict[str, float]
    state: NDArrays
    num_examples: int
    extra: dict[str, NDArrays] = field(default_factory=dict)


def prefixed(arrays: Mapping[str, np.ndarray], prefix: str) -> NDArrays:
    return {prefix + k: v for k, v in arrays.items()}


def unprefixed(state: Mapping[str, np.ndarray], prefix: str) -> NDArrays:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


@dataclass
class LocalRound:
    """One client training round in progress: what its steps read and write.

    ``payload`` is what the server sent (completed by :meth:`ClientTrainer.receive`),
    ``state`` the client's private state as loaded, ``roles`` the parameter partition,
    ``model`` the model being trained (set by the ``start_model`` step), ``metrics`` what
    the ``train`` step reported, ``scratch`` values one step hands to a later one.
    """

    rnd: ClientRound
    payload: NDArrays
    state: NDArrays
    roles: dict[str, str]
    model: nn.Module = field(default_factory=nn.Module)
    metrics: dict[str, float] = field(default_factory=dict)
    scratch: dict[str, Any] = field(default_factory=dict)


class ClientTrainer:
    """FedAvg client, and the round every method runs, as named steps.

    :meth:`fit` runs ``receive`` -> ``start_model`` -> ``train`` -> ``upload`` ->
    ``private_state``; a method overrides the steps that differ, never the round. What
    each parameter is (shared / personal / local / frozen) comes from the method table's
    parameter-role rule (``common/roles.py``), so the default steps already load local and
    personal keys from the private state, keep frozen ones out of the optimiser, and upload
    the shared and personal ones.
    """

    name: ClassVar[str] = "fedavg"
    finetunes: ClassVar[bool] = False      # personalised accuracy = after fine-tuning
    has_global_model: ClassVar[bool] = True

    def __init__(self, cfg: DictConfig, settings: Settings) -> None:
        """``cfg`` is the composed configuration (its ``model`` and ``strategy`` groups build the
        model and the options), ``settings`` its typed settings, read once at composition."""
        self.cfg = cfg
        self.settings = settings
        self.options = settings.method.options

    # ---------------------------------------------------------------- model pieces
    def new_model(self, rnd: ClientRound) -> nn.Module:
        return build_method_model(self.cfg, rnd.input_shape, rnd.num_classes)

    def roles(self, model: nn.Module) -> dict[str, str]:
        """``{state-dict key: role}`` of this method (its row's role rule, ``common.methods.roles_of``)."""
        return roles_of(self.settings.method.row, model)

    def trainable(self, model: nn.Module) -> Callable[[str], bool] | None:
        frozen = set(keys_with(self.roles(model), FROZEN))
        return (lambda n: n not in frozen) if frozen else None

    def loss_terms(self, work: LocalRound) -> list[LossTerm]:
        """Terms added to the cross-entropy loss (each reports its mean as a metric)."""
        return []

    def optim(self, rnd: ClientRound) -> OptimConfig:
        train = self.settings.train
        if train.lr_schedule == "step":   # exp or step, checked at composition
            scale = step_lr_scale(rnd.server_round, self.settings.run.rounds,
                                  list(train.lr_milestones), train.lr_gamma)
        else:
            scale = train.lr_decay ** max(0, rnd.server_round - 1)
        return train.optim(lr_scale=scale)

    def load_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """The payload, overlaid with the private state's local keys and with its personal
        keys the payload does not carry. Before a client has state, the payload (the server's
        initial model) is its starting point for every key."""
        model = self.new_model(rnd)
        roles = self.roles(model)
        set_arrays(model, payload)
        own = unprefixed(state, MODEL_PREFIX)
        keep = {k: v for k, v in own.items()
                if roles.get(k) == LOCAL or (roles.get(k) == PERSONAL and k not in payload)}
        set_arrays(model, keep)
        return model

    def personal_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> nn.Module:
        """The model evaluated as this client's personalised model."""
        return self.load_model(rnd, payload, state)

    def own_model(self, rnd: ClientRound, payload: NDArrays, state: NDArrays,
                  prefix: str = MODEL_PREFIX) -> nn.Module:
        """A whole model the client keeps in its state under ``prefix`` (FEDORA's theta_k,
        PartialFed's last model, Ditto's v), or the payload before the client has one."""
        model = self.new_model(rnd)
        own = unprefixed(state, prefix)
        set_arrays(model, own if own else payload)
        return model

    def reference_models(self, rnd: ClientRound, payload: NDArrays) -> dict[str, nn.Module]:
        """Models evaluated besides the personalised one, by metric prefix (FedAvg: the
        global model as ``global_*``)."""
        if not self.has_global_model:
            return {}
        model = self.new_model(rnd)
        set_arrays(model, payload)
        return {"global_": model}

    # ---------------------------------------------------------------- round steps
    def receive(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> NDArrays:
        """Step 0 (train and evaluate): the payload as the later steps use it."""
        return payload

    def start_model(self, work: LocalRound) -> nn.Module:
        """Step 1: the model this round trains, from the payload and the private state."""
        return self.load_model(work.rnd, work.payload, work.state)

    def train(self, work: LocalRound) -> dict[str, float]:
        """Step 2: train ``work.model`` in place; return the metrics (loss terms' included)."""
        rnd = work.rnd
        terms = LossTerms(self.loss_terms(work))
        metrics = train_epochs(work.model, rnd.data.train, self.optim(rnd), rnd.device, seed=rnd.seed,
                               trainable=self.trainable(work.model), extra_loss=terms or None,
                               after_step=self.after_step(work), dpsgd=self.record_dp(rnd))
        return {**metrics, **terms.metrics()}

    def record_dp(self, rnd: ClientRound) -> DPSGDConfig | None:
        """Record-level DP-SGD of the training whose result leaves the client
        (``privacy.record_dp=dpsgd``), or None. A personal model trained only on this client's
        data and never uploaded is trained without it (Ditto's)."""
        p = self.settings.privacy
        if not p.dpsgd:
            return None
        # the noise's and the batches' seed: the OS's randomness (secret), or privacy.noise_seed's
        # (reproducible, protects nothing against whoever knows it; tests and tables)
        seed = secrets.randbits(63) if p.noise_seed is None else \
            int(hashlib.sha256(f"{p.noise_seed}/{rnd.seed}".encode()).hexdigest()[:15], 16)
        return DPSGDConfig(p.record_noise_multiplier, p.record_clip, p.delta, seed)

    def after_step(self, work: LocalRound) -> Callable[[nn.Module], None] | None:
        """An update applied after every optimiser step, outside the optimiser (none by
        default; FEDORA's decoupled penalty)."""
        return None

    def upload(self, work: LocalRound) -> tuple[NDArrays, dict[str, NDArrays]]:
        """Step 3: the arrays sent back (shared and personal keys) and extra records."""
        return get_arrays(work.model, keys_with(self.roles(work.model), *UPLOADED)), {}

    def private_state(self, work: LocalRound) -> NDArrays:
        """Step 4: the private state to keep: the previous one updated with this round's
        personal and local keys."""
        kept = get_arrays(work.model, keys_with(self.roles(work.model), *KEPT))
        return {**work.state, **prefixed(kept, MODEL_PREFIX)}

    def fit(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> FitResult:
        """One training round: the steps above, in order (methods override steps, not this)."""
        with part("model build"):
            work = LocalRound(rnd, self.receive(rnd, payload, state), state, {})
            work.model = self.start_model(work).to(rnd.device)
            work.roles = self.roles(work.model)
        with part("train"):
            work.metrics = self.train(work)
        with part("upload"):
            upload, extra = self.upload(work)
            return FitResult(upload, work.metrics, self.private_state(work), rnd.data.num_train, extra)

    def evaluate(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> dict[str, float]:
        """Step 5: personalised accuracy (``accuracy``, ``val_accuracy``) and, where the
        method has them, the reference models' (``global_*``) and the fine-tuned one's
        (``ft_*``)."""
        payload = self.receive(rnd, payload, state)
        out: dict[str, float] = {}
        references = self.reference_models(rnd, payload)
        for prefix, model in references.items():
            out.update(evaluate_splits(model, rnd, prefix))
        if self.finetunes:
            glob = references.get("global_")
            base = glob if glob is not None else self.personal_model(rnd, payload, state)
            if finetunes_this_round(rnd):
                out.update(finetune_and_evaluate(base, rnd, final=bool(rnd.message_config.get("final", False))))
                out["accuracy"], out["val_accuracy"] = out["ft_accuracy"], out["ft_val_accuracy"]
                out["loss"] = out["ft_loss"]
                out[FINETUNED] = 1.0
            else:   # the model before fine-tuning, flagged so: never a best-round candidate
                out.update(evaluate_splits(base, rnd, ""))
                out[FINETUNED] = 0.0
        elif self.personal_was_tested(references):
            # FedAvg, FedProx: the personalised model is the global model just tested, the
            # same weights and statistics (tested once: the same numbers, half the work)
            out.update({key.removeprefix("global_"): value for key, value in out.items()
                        if key.startswith("global_")})
        else:
            out.update(self.evaluate_personal(rnd, payload, state))
        return out

    def personal_was_tested(self, references: Mapping[str, nn.Module]) -> bool:
        """Whether the personalised model's numbers are the global reference's: it is the
        global model (:meth:`personal_is_global`), built and tested as the base class builds
        and tests it (a trainer that changes any of those steps is tested apart)."""
        glob = references.get("global_")
        same_steps = all(getattr(type(self), step) is getattr(ClientTrainer, step) for step in _PERSONAL_STEPS)
        return glob is not None and same_steps and self.personal_is_global(glob)

    def personal_is_global(self, model: nn.Module) -> bool:
        """Whether the personalised model is the server's model as sent (FedAvg, FedProx: the
        method keeps no key of its own and forms no model of its own). Such a model is the
        global baseline and is tested with the statistics the server holds."""
        return (type(self).personal_model is ClientTrainer.personal_model
                and not keys_with(self.roles(model), LOCAL, PERSONAL))

    def bn_protocols(self, model: nn.Module) -> tuple[str, ...]:
        """Which BN statistics ``model`` is tested with, the headline's first: ``own``
        (recomputed on this client's train split) and/or ``stored`` (as training, aggregation
        or propagation left them); none for a model without BN running statistics or the
        server's own model. ``eval_bn_statistics`` picks the headline, ``eval_bn_compare``
        adds the other."""
        if self.personal_is_global(model) or not has_bn_running_stats(model):
            return ()
        return self.settings.run.bn_protocols

    def evaluate_personal(self, rnd: ClientRound, payload: NDArrays, state: NDArrays) -> dict[str, float]:
        """The personalised model's accuracy under its BN protocol (``accuracy``,
        ``val_accuracy``) and, for a model with BN, under each protocol measured
        (``own_bn_*``, ``stored_bn_*``), from the same weights: a gap between the two is the
        statistics' share of the client's accuracy. The state is never changed."""
        model = self.personal_model(rnd, payload, state)
        protocols = self.bn_protocols(model)
        if not protocols:
            return evaluate_splits(model, rnd, "")
        out: dict[str, float] = {}
        for protocol in protocols:
            tested = self.with_own_bn_statistics(model, rnd) if protocol == BN_OWN else model
            result = evaluate_splits(tested, rnd, "")
            if protocol == protocols[0]:             # the headline's protocol
                out.update(result)
            out[f"{protocol}_bn_accuracy"] = result["accuracy"]
            out[f"{protocol}_bn_val_accuracy"] = result["val_accuracy"]
        return out

    def with_own_bn_statistics(self, model: nn.Module, rnd: ClientRound) -> nn.Module:
        """A copy of ``model`` whose BN running statistics are recomputed on this client's
        train split, weights untouched (:func:`learning.training.recompute_bn_statistics`); a
        model made of combined parts (FedBasis' bases) becomes the plain network it combines
        to first, so its statistics are the combined network's own."""
        combined = getattr(model, "combined_model", None)
        plain = combined() if callable(combined) else copy.deepcopy(model)
        return recompute_bn_statistics(plain, rnd.data.train, self.settings.train.batch_size, rnd.device)

    # ---------------------------------------------------------------- new clients
    def new_client_modes(self) -> tuple[str, ...]:
        """How this method personalises a client that never took part (FedBasis' protocol,
        Sec. 6): ``ft`` fine-tunes the whole global model, ``lp`` only its classifier."""
        return ("ft", "lp")

    def new_client_lr_scales(self) -> dict[str, float]:
        """Parameters a new client trains at a multiple of the swept learning rate (none by
        default): a sweep over lrs then moves every learned parameter's lr alike."""
        return {}

    def adapt_new_client(self, rnd: ClientRound, groups: Mapping[str, NDArrays],
                         settings: Mapping[str, Any]) -> dict[str, float]:
        """Label-free adaptation of a client that never took part, from the server's final
        state (``groups``: the checkpoint's array groups); ``pflower personalize --adapt``.
        Only FDSE has one (its Algorithm 3); every other method refuses."""
        raise ValueError(f"{self.name} has no label-free adaptation of new clients; FDSE has "
                         "(strategy=fdse); use the supervised modes of pflower personalize")

    def new_client_model(self, rnd: ClientRound, payload: NDArrays,
                         mode: str) -> tuple[nn.Module, Callable[[str], bool]]:
        """The starting model of a new client for ``mode`` and which parameters it learns."""
        if mode not in ("ft", "lp"):
            raise ValueError(f"{self.name} personalises new clients by ft or lp, not {mode!r}")
        model = self.new_model(rnd)
        set_arrays(model, self.receive(rnd, payload, {}))
        return model, finetune_trainable(model, "full" if mode == "ft" else "head")


def step_lr_scale(server_round: int, total_rounds: int, milestones: list[float], gamma: float) -> float:
    """Step decay (``train.lr_schedule: step``; FedBABU's schedule): the lr is multiplied by
    ``gamma`` once for every milestone m (a fraction of ``total_rounds``) that round
    ``server_round`` (1-based) is past, i.e. rounds r > floor(m * total_rounds) are decayed.
    With milestones [0.5, 0.75] and R rounds this is the authors' rule "lr *= 0.1 after
    rounds R//2 and 3R//4" (a milestone at round 0 never fires; equal ones fire once)."""
    bad = [m for m in milestones if not 0 < float(m) < 1]
    if bad:
        raise ValueError(f"train.lr_milestones must be fractions of the rounds in (0, 1), got {bad}")
    steps = {int(float(m) * total_rounds) for m in milestones}  # coinciding milestones decay once
    return float(gamma) ** sum(1 for s in steps if server_round > s >= 1)


# the steps that make and test a personalised model: a trainer whose steps are all the base
# class' tests the same model as its global reference (ClientTrainer.personal_was_tested)
_PERSONAL_STEPS = ("evaluate_personal", "personal_model", "load_model", "new_model", "bn_protocols",
                   "with_own_bn_statistics", "reference_models")
