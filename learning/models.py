"""Models with named parameter groups.

Every model exposes its final classifier as the attribute ``head`` (an ``nn.Linear``), so
"head" and "body" are defined the same way for every method: head = the ``head.*`` keys of
the state dict, body = every other key (BN parameters and buffers are body). BN keys and
coarse stages are found by :func:`parameter_groups`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from learning.backbones import AdaptiveAvgPool2d, ModelError, resnet18
from learning.fdse_model import FDSEAlexNetConfig, FDSEResNet18Config, build_fdse_model
from learning.registry import Registry
from learning.typed import check, finite, read_typed


class SmallCNN(nn.Module):
    """Default model: conv-BN-ReLU x2 (+pool), one hidden linear layer, linear head."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, width: int = 32,
                 hidden: int = 128) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            AdaptiveAvgPool2d(4 if image_size >= 8 else 2),
        )
        pooled = 4 if image_size >= 8 else 2
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * pooled * pooled, hidden),
                                nn.ReLU(inplace=True))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.features(x)))


class CNN4(nn.Module):
    """FedBABU's 4-conv CNN: four conv3x3-BN-ReLU-maxpool blocks, linear head."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, width: int = 64,
                 bn_running_stats: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, size = in_channels, image_size
        for _ in range(4):
            layers += [nn.Conv2d(c, width, 3, padding=1),
                       nn.BatchNorm2d(width, track_running_stats=bn_running_stats), nn.ReLU(inplace=True)]
            if size >= 2:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            c = width
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.head = nn.Linear(width * max(size, 1) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MobileNetCIFAR(nn.Module):
    """MobileNet (v1) for 32x32 inputs as used by FedBABU (13 depthwise-separable blocks)."""

    CFG: tuple[int | tuple[int, int], ...] = (
        64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024,
    )

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 width_mult: float = 1.0, bn_running_stats: bool = True) -> None:
        super().__init__()
        c0 = int(32 * width_mult)
        layers: list[nn.Module] = [nn.Conv2d(in_channels, c0, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(c0, track_running_stats=bn_running_stats),
                                   nn.ReLU(inplace=True)]
        c = c0
        for item in self.CFG:
            out, stride = (item if isinstance(item, tuple) else (item, 1))
            out = int(out * width_mult)
            layers += [
                nn.Conv2d(c, c, 3, stride=stride, padding=1, groups=c, bias=False),
                nn.BatchNorm2d(c, track_running_stats=bn_running_stats), nn.ReLU(inplace=True),
                nn.Conv2d(c, out, 1, bias=False),
                nn.BatchNorm2d(out, track_running_stats=bn_running_stats), nn.ReLU(inplace=True),
            ]
            c = out
        self.features = nn.Sequential(*layers, AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class AlexNetBN(nn.Module):
    """AlexNet with BatchNorm after every conv and hidden linear layer (FedBN / FDSE backbone).

    Channel widths 64-192-384-256-256 and the two hidden layers (``hidden``: 4096 in FedBN's
    code, 1024 in FDSE's baseline, Table A5) scaled by ``width``; for inputs of 64 px and
    more, max-pools after conv1, conv2 and conv5 as both, then an adaptive pool, so any
    input size works (the papers use 256x256 images: 1.3e7 parameters with hidden 1024).
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 width: float = 1.0, hidden: int = 4096) -> None:
        super().__init__()
        w = [max(8, int(c * width)) for c in (64, 192, 384, 256, 256)]
        hidden = max(16, int(hidden * width))
        big = image_size >= 64
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, w[0], 11 if big else 3, stride=4 if big else 1,
                      padding=2 if big else 1),
            nn.BatchNorm2d(w[0]), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2) if big else nn.Identity(),
            nn.Conv2d(w[0], w[1], 5 if big else 3, padding=2 if big else 1),
            nn.BatchNorm2d(w[1]), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2) if big else nn.Identity(),
            nn.Conv2d(w[1], w[2], 3, padding=1), nn.BatchNorm2d(w[2]), nn.ReLU(inplace=True),
            nn.Conv2d(w[2], w[3], 3, padding=1), nn.BatchNorm2d(w[3]), nn.ReLU(inplace=True),
            nn.Conv2d(w[3], w[4], 3, padding=1), nn.BatchNorm2d(w[4]), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2) if big else nn.Identity(),
            AdaptiveAvgPool2d(6 if big else 2),
            nn.Flatten(),
        )
        pooled = 6 if big else 2
        self.fc = nn.Sequential(
            nn.Linear(w[4] * pooled * pooled, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.features(x)))


class MLP(nn.Module):
    """Multi-layer perceptron on flattened inputs (FEDORA: 784-128-128-10)."""

    def __init__(self, in_features: int, num_classes: int, hidden: list[int] | tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        f = in_features
        for h in hidden:
            layers += [nn.Linear(f, int(h)), nn.ReLU(inplace=True)]
            f = int(h)
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(f, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


# ---------------------------------------------------------------------- the model registry
# One entry per model: its typed config (``conf/model/<name>.yaml`` holds the defaults; every
# key required, none unknown, see learning/typed.py) and its builder.
@dataclass(frozen=True)
class CNNConfig:
    name: str
    width: int
    hidden: int

    def __post_init__(self) -> None:
        check(self.width >= 1 and self.hidden >= 1, f"model.width and model.hidden must be >= 1, got "
              f"{self.width}, {self.hidden}")


@dataclass(frozen=True)
class CNN4Config:
    name: str
    width: int
    bn_running_stats: bool

    def __post_init__(self) -> None:
        check(self.width >= 1, f"model.width must be >= 1, got {self.width}")


@dataclass(frozen=True)
class MobileNetConfig:
    name: str
    width_mult: float
    bn_running_stats: bool

    def __post_init__(self) -> None:
        finite("model.width_mult", self.width_mult, 0.0, strict=True)


@dataclass(frozen=True)
class AlexNetBNConfig:
    name: str
    width: float
    hidden: int

    def __post_init__(self) -> None:
        finite("model.width", self.width, 0.0, strict=True)
        check(self.hidden >= 1, f"model.hidden must be >= 1, got {self.hidden}")


@dataclass(frozen=True)
class ResNet18Config:
    name: str
    pretrained_path: str
    pretrained_required: bool
    small_input: bool


@dataclass(frozen=True)
class MLPConfig:
    name: str
    hidden: tuple[int, ...]

    def __post_init__(self) -> None:
        check(all(h >= 1 for h in self.hidden), f"model.hidden must be widths >= 1, got {list(self.hidden)}")


@dataclass(frozen=True)
class ModelSpec:
    """A model: its typed config class and ``build(config, input_shape, num_classes)``."""

    config: type
    build: Callable[[Any, tuple[int, int, int], int], nn.Module]


MODELS: Registry[ModelSpec] = Registry("model", ModelError)
MODELS.add("cnn", ModelSpec(CNNConfig, lambda m, s, k: SmallCNN(s[0], k, s[1], m.width, m.hidden)))
MODELS.add("cnn4", ModelSpec(CNN4Config, lambda m, s, k: CNN4(s[0], k, s[1], m.width, m.bn_running_stats)))
MODELS.add("mobilenet", ModelSpec(MobileNetConfig,
                                  lambda m, s, k: MobileNetCIFAR(s[0], k, s[1], m.width_mult, m.bn_running_stats)))
MODELS.add("alexnet-bn", ModelSpec(AlexNetBNConfig, lambda m, s, k: AlexNetBN(s[0], k, s[1], m.width, m.hidden)))
MODELS.add("resnet18", ModelSpec(ResNet18Config,
                                 lambda m, s, k: resnet18(s[0], k, m.pretrained_path, m.small_input)))
MODELS.add("mlp", ModelSpec(MLPConfig, lambda m, s, k: MLP(s[0] * s[1] * s[2], k, list(m.hidden))))
MODELS.add("fdse-alexnet", ModelSpec(FDSEAlexNetConfig, build_fdse_model))
MODELS.add("fdse-resnet18", ModelSpec(FDSEResNet18Config, build_fdse_model))


def model_spec(name: str) -> ModelSpec:
    """The registry entry of ``name``; an unknown name lists the valid ones."""
    return MODELS[name]


def read_model_config(model_cfg: Mapping[str, Any]) -> Any:
    """The typed config of the configured model (every key of its YAML file, checked)."""
    name = str(model_cfg.get("name"))
    return read_typed(model_spec(name).config, model_cfg, "model", "conf/model/{name}.yaml")


def build_model(model_cfg: Mapping[str, Any], input_shape: tuple[int, int, int],
                num_classes: int) -> nn.Module:
    """Build the configured model for inputs of ``input_shape`` (C, H, W)."""
    config = read_model_config(model_cfg)
    return model_spec(config.name).build(config, input_shape, num_classes)


def is_head_key(key: str) -> bool:
    return key.startswith("head.")


def bn_module_prefixes(model: nn.Module) -> list[str]:
    """Names of every BatchNorm module (their weight, bias and running stats are BN keys)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def parameter_groups(model: nn.Module) -> dict[str, list[str]]:
    """State-dict keys by group: ``head``, ``body`` (everything else), ``bn`` (BN params
    and buffers, a subset of body) and ``bn_stats`` (BN running statistics only)."""
    keys = list(model.state_dict().keys())
    bn_prefixes = tuple(p + "." for p in bn_module_prefixes(model))
    bn = [k for k in keys if k.startswith(bn_prefixes)]
    bn_stats = [k for k in bn if k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")]
    head = [k for k in keys if is_head_key(k)]
    return {"head": head, "body": [k for k in keys if not is_head_key(k)], "bn": bn, "bn_stats": bn_stats,
            "all": keys}


def set_deterministic(on: bool) -> None:
    """Deterministic kernels on CUDA, so that a rerun, a resumed run and a run evaluating in
    the training message give bit-identical numbers there as they do on the CPU (cuDNN's
    default convolution backward and cuBLAS's split reductions add in varying order: last
    bits differ between two runs). Slower; ops without a deterministic CUDA kernel warn
    instead of failing. ``CUBLAS_WORKSPACE_CONFIG`` takes effect if set before cuBLAS starts."""
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False
    if on == torch.are_deterministic_algorithms_enabled():
        return   # the call imports torch._inductor (4 s in a fresh process): only on a change
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {name!r} requested but CUDA is not available; use device=auto or cpu")
    return torch.device(name)
