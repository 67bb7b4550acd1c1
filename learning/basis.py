"""FedBasis' model (Chen et al., arXiv 2304.07882): K basis copies of one architecture,
combined per unit by a client's coefficients into the one network that runs.

For unit b (a stage, block or layer: ``learning/units.py``) with coefficient logits
``psi_b`` (K numbers) and ``alpha_b = softmax(psi_b)``, every tensor of the unit is

    theta_b = 1/2 v'_b + 1/2 sum_k alpha_b[k] v_k,b      (with the major basis v', Sec. 4.4)
    theta_b =            sum_k alpha_b[k] v_k,b          (without it, Eq. 4)

The combination is built once per forward pass (one mini-batch), not per sample, and the
network then runs once: inference costs one model, whatever K is.

The state dict holds ``major.<key>``, ``bases.<k>.<key>`` (shared: what the server averages)
and ``coeff_logits`` (U x K, the client's own; ``common/roles.py`` rule ``fedbasis``).
Sharpening (Sec. 4.2) is ``psi <- psi / tau``, so ``softmax(psi)`` is always the
coefficient in use.

BN running statistics are buffers, not trained: a forward pass in training mode runs BN on
the combined statistics, and the change BN makes to them (Delta) is added to every basis
(and the major one). As the weights sum to one, the combined statistics then move by
exactly Delta, and the differences between bases are kept. With ``track_stats`` off (the
coefficient phase of a round) the bases' statistics are not touched at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call

from learning.units import model_units, unit_of

COEFF_KEY = "coeff_logits"
MAJOR_PREFIX = "major."
HEAD_OVERRIDE = "head_override"


def basis_prefix(k: int) -> str:
    return f"bases.{k}."


def combine_weights(alpha: torch.Tensor, unit_index: Mapping[str, int],
                    bases: Sequence[Mapping[str, torch.Tensor]],
                    major: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The combined tensors ``{key: theta}`` (the module docstring's formula).

    ``alpha`` is (units x K), rows on the simplex; ``unit_index[key]`` its row for each key.
    Floating tensors are mixed (differentiably in ``alpha`` and the bases); integer ones
    (BN's ``num_batches_tracked``) are taken from the major basis, else the first one.
    """
    out: dict[str, torch.Tensor] = {}
    first = major if major is not None else bases[0]
    for key, ref in first.items():
        if not torch.is_floating_point(ref):
            out[key] = ref
            continue
        stacked = torch.stack([b[key] for b in bases])                  # (K, *shape)
        a = alpha[unit_index[key]].to(stacked.dtype)
        mix = torch.tensordot(a, stacked, dims=1)
        out[key] = 0.5 * major[key] + 0.5 * mix if major is not None else mix
    return out


class BasisModel(nn.Module):
    """``num_bases`` copies of the network built by ``make`` (+ a major copy), combined per
    unit of ``granularity`` by ``softmax(coeff_logits)``; see the module docstring."""

    def __init__(self, make: Callable[[int], nn.Module], num_bases: int, major: bool = True,
                 granularity: str = "stage") -> None:
        super().__init__()
        if num_bases < 1:
            raise ValueError(f"FedBasis needs at least one basis, got num_bases={num_bases}")
        template = make(0)
        self.major = make(0) if major else None
        self.bases = nn.ModuleList([make(k + 1) for k in range(num_bases)])
        units = model_units(template, granularity)
        self.unit_names = list(units)
        names = self.unit_names
        self.unit_index = {key: names.index(u) for key, u in unit_of(units).items()}
        self.coeff_logits = nn.Parameter(torch.zeros(len(units), num_bases))
        self.head_override: nn.ParameterDict | None = None
        # whether training-mode forward passes move the bases' BN statistics (off while
        # only the coefficients learn: the bases stay exactly as received)
        self.track_stats = True
        # the network the combined tensors run in; not a submodule (its own tensors are
        # never used, and it must not appear in the state dict)
        self._template = [template]

    @property
    def num_bases(self) -> int:
        return len(self.bases)

    @property
    def template(self) -> nn.Module:
        return self._template[0]

    def coefficients(self) -> torch.Tensor:
        """alpha = softmax(psi) per unit (units x K)."""
        return torch.softmax(self.coeff_logits, dim=-1)

    def basis_tensors(self) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]:
        def tensors(m: nn.Module) -> dict[str, torch.Tensor]:
            return {**dict(m.named_parameters()), **dict(m.named_buffers())}
        return [tensors(b) for b in self.bases], (tensors(self.major) if self.major is not None else None)

    def combined(self) -> dict[str, torch.Tensor]:
        """The combined tensors (parameters carry gradients to the bases and the logits)."""
        bases, major = self.basis_tensors()
        buffers = {k for k, _ in self.template.named_buffers()}
        alpha = self.coefficients()
        params = combine_weights(alpha, self.unit_index,
                                 [{k: v for k, v in b.items() if k not in buffers} for b in bases],
                                 None if major is None else {k: v for k, v in major.items() if k not in buffers})
        with torch.no_grad():
            bufs = combine_weights(alpha.detach(), self.unit_index,
                                   [{k: v for k, v in b.items() if k in buffers} for b in bases],
                                   None if major is None else {k: v for k, v in major.items() if k in buffers})
        bufs = {k: v.clone() for k, v in bufs.items()}    # BN updates these in place
        if self.head_override is not None:
            params.update({k.replace("__", "."): v for k, v in self.head_override.items()})
        return {**params, **bufs}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = self.combined()
        buffers = [k for k, _ in self.template.named_buffers()]
        track = self.training and self.track_stats
        before = {k: tensors[k].clone() for k in buffers} if track else {}
        self.template.train(self.training)        # not a submodule: follow this module's mode
        out = functional_call(self.template, tensors, (x,))
        if track:
            self._apply_buffer_change(tensors, before)
        return out

    @torch.no_grad()
    def _apply_buffer_change(self, after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> None:
        copies = [*self.bases] + ([self.major] if self.major is not None else [])
        for key, old in before.items():
            for m in copies:
                buf = m.get_buffer(key)
                if torch.is_floating_point(buf):
                    buf.add_(after[key] - old)
                else:
                    buf.copy_(after[key])

    @torch.no_grad()
    def sharpen(self, tau: float) -> None:
        """Sec. 4.2: alpha <- softmax(psi / tau) (kept as the logits psi / tau)."""
        if not tau > 0:
            raise ValueError(f"sharpening temperature must be > 0, got {tau}")
        self.coeff_logits.div_(tau)

    def free_head(self) -> list[nn.Parameter]:
        """New-client personalisation "plus the classifier" (Sec. 6): the classifier becomes
        free parameters, initialised to its current combination; returns them."""
        head = {k: v.detach().clone() for k, v in self.combined().items() if k.startswith("head.")}
        if not head:
            raise ValueError(f"{type(self.template).__name__} has no head.* classifier to personalise")
        self.head_override = nn.ParameterDict({k.replace(".", "__"): nn.Parameter(v) for k, v in head.items()})
        return list(self.head_override.values())

    def combined_model(self) -> nn.Module:
        """A plain network holding the current combination (e.g. to export or deploy)."""
        import copy

        net = copy.deepcopy(self.template)
        with torch.no_grad():
            net.load_state_dict({k: v.detach().clone() for k, v in self.combined().items()})
        return net


__all__ = ["BasisModel", "combine_weights", "COEFF_KEY", "MAJOR_PREFIX", "basis_prefix", "HEAD_OVERRIDE"]


def wrap_in_bases(make: Callable[[int], nn.Module], options: object) -> BasisModel:
    """The method table's model wrapper for ``fedbasis`` (``FedBasisOptions``)."""
    return BasisModel(make, int(options.num_bases), bool(options.major),  # type: ignore[attr-defined]
                      str(options.granularity))  # type: ignore[attr-defined]
