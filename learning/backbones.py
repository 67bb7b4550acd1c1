"""Backbones shared by the plain models (``learning.models``) and the FDSE models
(``learning.fdse_model``): torchvision networks wrapped so that the classifier is the
attribute ``head`` (every method defines head/body by the ``head.*`` keys)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class ModelError(ValueError):
    """A model cannot be built as configured; the message names the fix."""


def resnet18(in_channels: int, num_classes: int, pretrained_path: str, small_input: bool) -> nn.Module:
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    if pretrained_path:
        path = Path(pretrained_path)
        if not path.is_file():
            raise ModelError(
                f"model.pretrained_path {pretrained_path!r} does not exist; give a local "
                "torchvision resnet18 state_dict file or leave it empty"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    if small_input or in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 3 if small_input else 7, stride=1 if small_input else 2,
                                padding=1 if small_input else 3, bias=False)
        if small_input:
            model.maxpool = nn.Identity()
    head = nn.Linear(model.fc.in_features, num_classes)
    model.fc = nn.Identity()
    return WithHead(model, head)


class WithHead(nn.Module):
    """Wrap a backbone so its classifier is the attribute ``head``."""

    def __init__(self, body: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class AdaptiveAvgPool2d(nn.Module):
    """``nn.AdaptiveAvgPool2d`` as two averaging-matrix products, ``P_h x P_w^T``.

    Same bins as torch (output cell i averages input rows floor(i*H/h) .. ceil((i+1)*H/h)-1),
    but deterministic on CUDA: torch's ``adaptive_avg_pool2d`` backward adds with atomics
    where bins overlap or an input cell feeds several outputs (an 8x8 digit reaching a 2x2
    map pooled to 6x6), so ``deterministic=true`` runs could not be bit-identical there.
    No parameters: state dicts are those of the torch module."""

    def __init__(self, output_size: int | tuple[int, int]) -> None:
        super().__init__()
        self.output_size = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
        self._matrices: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}   # built once per input size

    @staticmethod
    def bins(out: int, size: int) -> torch.Tensor:
        """(out, size) matrix whose row i averages torch's bin i of an axis of ``size``."""
        m = torch.zeros(out, size, dtype=torch.float64)
        for i in range(out):
            start, end = (i * size) // out, -((-(i + 1) * size) // out)
            m[i, start:end] = 1.0 / (end - start)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (oh, ow), (h, w) = self.output_size, x.shape[-2:]
        if (oh, ow) == (h, w):
            return x
        key = (h, w, x.device, x.dtype)
        if key not in self._matrices:   # no host-to-device copy (and sync) per step
            self._matrices[key] = (self.bins(oh, h).to(device=x.device, dtype=x.dtype),
                                   self.bins(ow, w).to(device=x.device, dtype=x.dtype).T.contiguous())
        ph, pw_t = self._matrices[key]
        return ph @ x @ pw_t

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"
