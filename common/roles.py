"""One parameter partition: the role of every state-dict key, for client and server alike.

A method labels every key of the model's state dict with one role:

======== ======================= ========================== ===========================
role     client loads it from     client trains / uploads     server
======== ======================= ========================== ===========================
shared   the payload             trains, uploads             aggregates into the global
personal the payload (its own    trains, uploads             keeps one copy per client
         server-side copy),
         else its private state
local    its private state (the  trains, never uploads       never holds or sends it
         payload only before      (private state)             (except as the initial
         the client has any)                                  model of the first round)
frozen   the payload / private   never trains, never         sends it (once), never
         state                    uploads                     changes it
======== ======================= ========================== ===========================

``common.methods.roles_of`` is the single place that says which key has which role; the
rule of each method is named in the method table (``common/methods.py``). Everything
else (what a client keeps, trains and uploads; what the server averages, mixes per
client or rejects) is derived from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from learning.registry import Registry

SHARED, PERSONAL, LOCAL, FROZEN = "shared", "personal", "local", "frozen"
ROLES = (SHARED, PERSONAL, LOCAL, FROZEN)
UPLOADED = (SHARED, PERSONAL)        # roles a client sends back
KEPT = (PERSONAL, LOCAL)             # roles a client keeps in its private state


def _all(role: str) -> Callable[[nn.Module], dict[str, str]]:
    def rule(model: nn.Module) -> dict[str, str]:
        return {k: role for k in model.state_dict()}
    rule.__doc__ = f"every key is {role}"
    return rule


def _bn_local(model: nn.Module) -> dict[str, str]:
    """FedBN: BN weights, biases and running statistics are local, the rest shared."""
    from learning.models import parameter_groups

    bn = set(parameter_groups(model)["bn"])
    return {k: LOCAL if k in bn else SHARED for k in model.state_dict()}


def _head_frozen(model: nn.Module) -> dict[str, str]:
    """FedBABU: the head is frozen (fixed at its initialisation), the body shared."""
    from learning.models import parameter_groups

    head = set(parameter_groups(model)["head"])
    if not head:
        raise ValueError(f"model {type(model).__name__} has no head.* keys; this method needs a head")
    return {k: FROZEN if k in head else SHARED for k in model.state_dict()}


RULES: Registry[Callable[[nn.Module], dict[str, str]]] = Registry("parameter-role rule")
RULES.add("all-shared", _all(SHARED))
RULES.add("all-local", _all(LOCAL))
RULES.add("all-personal", _all(PERSONAL))
RULES.add("bn-local", _bn_local)
RULES.add("head-frozen", _head_frozen)


def roles_by_rule(rule: str, model: nn.Module,
                  own: Callable[[nn.Module], dict[str, str]] | None = None) -> dict[str, str]:
    """Apply ``rule`` to ``model``: ``{state-dict key: role}`` in state-dict order.

    ``rule`` names one of :data:`RULES`, or, with ``own``, a method's own rule (FDSE's and
    FedBasis' live in their ``strategies/<name>_math.py``; the method's YAML row names it as
    ``"module:function"`` and ``common/methods.py`` loads it)."""
    if own is None and rule not in RULES:
        raise ValueError(f"unknown parameter-role rule {rule!r}; valid: {', '.join(RULES)} "
                         "or a method's own rule as 'module:function'")
    roles = (own or RULES[rule])(model)
    bad = {k: r for k, r in roles.items() if r not in ROLES}
    if bad:
        raise ValueError(f"rule {rule!r} gave unknown roles {bad}")
    return roles


def keys_with(roles: Mapping[str, str], *wanted: str) -> list[str]:
    """Keys whose role is one of ``wanted`` (state-dict order)."""
    return [k for k, r in roles.items() if r in wanted]
