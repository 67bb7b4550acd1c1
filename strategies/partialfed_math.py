"""PartialFed's math (Sun et al., "PartialFed: Cross-Domain Personalized Federated Learning
via Partial Initialization", NeurIPS 2021), as pure torch functions (no Flower).

Fix (Sec. 3.2, Alg. 1): client c starts round t from
``W_init[i] = W_t[i] if A[i] = 1 else W_{t-1}^c[i]`` with a hand-designed strategy A given
by a named rule over the model's units (:func:`fix_global_keys`).

Adaptive (Sec. 3.3, Alg. 2, Eq. 5-6): per unit u two logits ``theta_u = (local, global)``;
each batch samples a hard gate with Gumbel-softmax and the straight-through trick
(:func:`gumbel_gates`: forward value one-hot, gradient of the soft sample), and the batch's
weights are ``W_b[i] = g_u[1] W_t[i] + g_u[0] W_{t-1}^c[i]`` (:func:`compose_weights`),
i.e. exactly the global tensor where the gate is 1 and the local one where it is 0, with
gradients flowing to the chosen copy and, through the straight-through estimator, to the
logits. The temperature anneals from 5.0 towards 0 over the rounds (:func:`anneal_tau`).
At the end of a round the client's model is the probability-weighted mix (soft, then
fine-tuned) or the argmax copy (hard) per unit (:func:`merge_by_unit`).

The method's part that server and client both read is here too: ``PartialFedFixOptions`` and
``PartialFedAdaptiveOptions`` (the options of ``conf/strategy/partialfed-*.yaml``) and the
wire name ``P_GLOBAL_METRIC``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import torch

from common.options import MethodOptions, check_choice, check_finite, check_option


@dataclasses.dataclass(frozen=True)
class PartialFedFixOptions(MethodOptions):
    """PartialFed-Fix: the named loading rule (``strategies.partialfed_math.FIX_RULES``)."""

    rule: str

    def __post_init__(self) -> None:
        check_choice("rule", self.rule, ("all", "no-bn", "no-fc", "no-bn-fc", "s1", "s1-s2", "s1-s3", "s1-s4",
                                    "fc", "s4-fc", "s3-fc", "s2-fc", "ABCD", "abcd"))


@dataclasses.dataclass(frozen=True)
class PartialFedAdaptiveOptions(MethodOptions):
    """PartialFed-Adaptive: unit granularity, Gumbel temperature schedule, the f_m/f_s
    alternation, the logits' learning rate and how the round's model is taken."""

    granularity: str
    tau_start: float
    tau_end: float
    tau_schedule: str
    model_batches: int
    strategy_batches: int
    gate_lr: float | None
    final: str
    finetune_epochs: int

    def __post_init__(self) -> None:
        check_choice("granularity", self.granularity, ("stage", "block", "layer"))
        check_finite("tau_start", self.tau_start, 0.0, strict=True)
        check_finite("tau_end", self.tau_end, 0.0, strict=True)
        check_choice("tau_schedule", self.tau_schedule, ("exp", "linear"))
        check_option(self.model_batches >= 1, f"strategy.model_batches (f_m) must be >= 1, got {self.model_batches}")
        check_option(self.strategy_batches >= 1,
                     f"strategy.strategy_batches (f_s) must be >= 1, got {self.strategy_batches}")
        check_option(self.gate_lr is None or self.gate_lr > 0, f"strategy.gate_lr must be > 0 or null, got {self.gate_lr}")
        check_choice("final", self.final, ("soft", "hard"))
        check_option(self.finetune_epochs >= 0, f"strategy.finetune_epochs must be >= 0, got {self.finetune_epochs}")


# wire name, read by both sides: PartialFed-Adaptive's P(load global) metric, p_global/<unit>
P_GLOBAL_METRIC = "p_global/"


FIX_RULES = ("all", "no-bn", "no-fc", "no-bn-fc", "s1", "s1-s2", "s1-s3", "s1-s4",
             "fc", "s4-fc", "s3-fc", "s2-fc", "ABCD", "abcd")
LOCAL, GLOBAL = 0, 1     # column of the two logits / gates


def fix_global_keys(stages: Mapping[str, list[str]], blocks: Mapping[str, list[str]],
                    bn_keys: Iterable[str], rule: str) -> set[str]:
    """The state-dict keys a Fix rule loads from the global model (the rest: from local).

    ``stages``/``blocks``: :func:`learning.units.model_units` at those granularities.
    ``no-bn``/``no-fc``/``no-bn-fc``: everything but the BN keys (parameters and running
    statistics) / the classifier / both. ``s1``..``s1-s4``: stages bottom-up (fc local);
    ``fc``, ``s4-fc``..``s2-fc``: top-down (stage k up to the model's last stage, + fc). ``ABCD`` (``abcd``): the first (second)
    residual block of every ResNet stage, plus the stem and fc, which the paper loads
    "as default". A rule naming a unit the model lacks is an error.
    """
    every = {k for keys in stages.values() for k in keys}
    bn = set(bn_keys)
    head = set(stages.get("fc", []))

    def units_of(table: Mapping[str, list[str]], names: list[str]) -> set[str]:
        missing = [n for n in names if n not in table]
        if missing:
            raise ValueError(f"PartialFed rule {rule!r} needs units {missing} that this model lacks "
                             f"(its units: {', '.join(table)}); choose another strategy.rule")
        return {k for n in names for k in table[n]}

    if rule == "all":
        return every
    if rule in ("no-bn", "no-fc", "no-bn-fc"):
        drop = (bn if "bn" in rule else set()) | (head if "fc" in rule else set())
        return every - drop
    bottom_up = {"s1": 1, "s1-s2": 2, "s1-s3": 3, "s1-s4": 4}
    if rule in bottom_up:
        return units_of(stages, [f"s{i}" for i in range(1, bottom_up[rule] + 1)])
    top_down = {"s4-fc": 4, "s3-fc": 3, "s2-fc": 2}
    if rule == "fc":
        return units_of(stages, ["fc"])
    if rule in top_down:                     # from stage k up to the model's last stage, + fc
        last = max(int(u[1:]) for u in stages if u[:1] == "s" and u[1:].isdigit())
        return units_of(stages, [f"s{i}" for i in range(top_down[rule], max(last, top_down[rule]) + 1)] + ["fc"])
    if rule in ("ABCD", "abcd"):
        return units_of(blocks, ["stem", *rule, "fc"])
    raise ValueError(f"unknown PartialFed rule {rule!r}; valid: {', '.join(FIX_RULES)}")


def anneal_tau(server_round: int, total_rounds: int, start: float, end: float,
               schedule: str = "exp") -> float:
    """Temperature of round ``server_round`` (1-based): ``start`` in round 1, ``end`` in the
    last round; ``exp`` = geometric (start * (end/start)^((t-1)/(R-1))), ``linear``."""
    if not (start > 0 and end > 0):
        raise ValueError(f"temperatures must be > 0, got start={start}, end={end}")
    frac = 0.0 if total_rounds <= 1 else min(1.0, max(0.0, (server_round - 1) / (total_rounds - 1)))
    if schedule == "exp":
        return start * math.exp(frac * math.log(end / start))
    if schedule == "linear":
        return start + frac * (end - start)
    raise ValueError(f"unknown temperature schedule {schedule!r}; valid: exp, linear")


def gumbel_gates(logits: torch.Tensor, tau: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Hard Gumbel-softmax samples with the straight-through estimator, one row per unit.

    ``logits`` (U, 2); returns (U, 2) whose forward value is one-hot and whose gradient is
    that of ``softmax((logits + G) / tau)``, G i.i.d. standard Gumbel (drawn from
    ``generator`` so that a round is reproducible)."""
    u = torch.rand(logits.shape, generator=generator, device="cpu").to(logits.device)
    neg_log_u = (-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20)   # in (0, 46]
    gumbel = -torch.log(neg_log_u)
    soft = torch.softmax((logits + gumbel) / tau, dim=-1)
    hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
    return hard - soft.detach() + soft


def compose_weights(gates: torch.Tensor, unit_index: Mapping[str, int],
                    global_tensors: Mapping[str, torch.Tensor],
                    local_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One batch's tensors: ``g[u,1] * global + g[u,0] * local`` for trainable tensors (with
    one-hot gates, exactly the chosen copy, and gradients to the chosen copy and, through
    the straight-through gates, to the logits); other tensors (BN running statistics and
    counters) are the chosen copy itself, so that BN updates that copy's statistics."""
    out = {}
    for k, glob in global_tensors.items():
        row = gates[unit_index[k]]
        loc = local_tensors[k]
        if glob.requires_grad or loc.requires_grad:
            out[k] = row[GLOBAL] * glob + row[LOCAL] * loc
        else:
            out[k] = glob if bool(row[GLOBAL] > 0.5) else loc
    return out


def merge_by_unit(p_global: torch.Tensor, unit_index: Mapping[str, int],
                  global_tensors: Mapping[str, torch.Tensor], local_tensors: Mapping[str, torch.Tensor],
                  mode: str = "soft") -> dict[str, torch.Tensor]:
    """The round's final model. ``soft``: ``p_u W_global + (1 - p_u) W_local`` per unit (the
    paper's soft sampling, followed by a fine-tune); ``hard``: the copy with the larger
    probability. Non-floating tensors always come from the more probable copy."""
    if mode not in ("soft", "hard"):
        raise ValueError(f"unknown merge mode {mode!r}; valid: soft, hard")
    out = {}
    for k, glob in global_tensors.items():
        p = float(p_global[unit_index[k]])
        loc = local_tensors[k]
        if mode == "soft" and glob.is_floating_point():
            out[k] = (p * glob.double() + (1.0 - p) * loc.double()).to(glob.dtype)
        else:
            out[k] = (glob if p >= 0.5 else loc).clone()
    return out
