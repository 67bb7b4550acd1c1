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
