"""FDSE models: DSE blocks, the FDSE AlexNet, ResNet conversion, parameter classes and the
consistency regulariser (Wang et al., "Federated Domain Shift Eraser", CVPR 2025).

Pure torch; no Flower import.

DSE block (paper Sec. 4.1, Eq. 2-3, Tables A6/A7; authors' code ``algorithm/fdse.py``)
------------------------------------------------------------------------------------
For a layer with S inputs and T outputs and the expansion factor G::

    x1  = act( BN_DSE( DFE(x) ) )           DFE: conv/linear S -> ceil(T/G)     (shared)
                                            BN_DSE: BN over ceil(T/G)           (personal)
    x2  = DSE(x1)                           depthwise conv, every channel -> G-1 channels
                                            (groups = ceil(T/G), kernel dw)     (personal)
    z   = Concat(x1, x2)[:, :T] (+ b)       the "DSE output"; Table A7 keeps the identity
                                            map (GhostNet style); b = optional shared bias
    out = ReLU( BN_DFE(z) )                 BN_DFE over T channels              (shared)

Choices (the config's default is the authors' code, which produced the published tables; the
paper's text is the option; the keyword defaults of these classes are the paper's):

* ``dse_activation``: ``"none"`` in the authors' code (config default); ``"relu"`` after
  BN_DSE in the paper (Eq. 3 / Table A7); ``"leaky_relu"`` is the code's other option.
* ``out_bias``: the code adds a shared bias ``dfe_bias`` after the concat (``True``, config
  default); the paper has none (``False``).
* The depthwise conv has no bias (code; GhostNet). Its padding is ``dw // 2``.
* Channel order of the concat is [x1, x2] (code), truncated to T channels if G does not
  divide T (paper: the cheap conv outputs T - ceil(T/G) channels).
* ``G = 1``: no expansion; the cheap conv maps each channel to itself and is added
  residually (``x1 + DSE(x1)``), as in the code.

Module names follow the code (``dfe_conv``, ``dse_bn``, ``dse_conv``, ``dfe_bias``,
``dfe_bn``), so name filters such as "dfe"/"dse" also work; :func:`parameter_classes` is
structural and does not depend on names.

Parameter classes (methods.md): ``shared`` = DFE conv/linear, BN_DFE (affine and running
statistics), the optional bias, and everything outside DSE blocks (the head);
``personal`` = the depthwise conv and BN_DSE's affine; ``local`` = BN_DSE's running
statistics and ``num_batches_tracked`` (never uploaded).

Consistency regulariser (Sec. 4.2, Eq. 4-7)
-------------------------------------------
During a training forward pass every block records the batch mean/variance (Eq. 4) of its
DSE output z (the input of BN_DFE): per channel, over batch (and spatial) positions, with
the biased variance. :func:`consistency_loss` then forms the running estimates (Eq. 5) and
the per-layer loss against the received global running statistics of BN_DFE (Eq. 6), and
weights the layers by ``softmax(beta * l)``, l = 1..L in depth order (Eq. 7). See its
docstring for the ``"paper"`` and ``"code"`` forms. Call :func:`reset_consistency_state`
at the start of every local round and :func:`consistency_loss` exactly once per step.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from learning.backbones import AdaptiveAvgPool2d, resnet18
from learning.typed import check, finite

__all__ = [
    "DSEConv",
    "DSELinear",
    "FDSEAlexNet",
    "convert_resnet18_to_fdse",
    "dse_blocks",
    "parameter_classes",
    "keys_by_class",
    "shared_bn_stats",
    "consistency_loss",
    "reset_consistency_state",
    "adaptation_mode",
    "build_fdse_model",
    "FDSE_MODELS",
    "FDSEAlexNetConfig",
    "FDSEResNet18Config",
    "SHARED",
    "PERSONAL",
    "LOCAL",
]

SHARED, PERSONAL, LOCAL = "shared", "personal", "local"
_BN_STAT_NAMES = ("running_mean", "running_var", "num_batches_tracked")
_ACTIVATIONS = ("relu", "none", "leaky_relu")
_CODE_CARRY_ATTR = "_fdse_code_carry"


def _make_activation(kind: str) -> nn.Module:
    if kind == "relu":
        return nn.ReLU()
    if kind == "none":
        return nn.Identity()
    if kind == "leaky_relu":
        return nn.LeakyReLU(negative_slope=0.01)
    raise ValueError(f"dse_activation must be one of {_ACTIVATIONS}, got {kind!r}")


class _DSEBase(nn.Module):
    """Shared logic of :class:`DSEConv` and :class:`DSELinear` (stat recording, combine)."""

    out_features: int
    G: int

    def _init_common(
        self, out_features: int, G: int, dse_activation: str, relu: bool, out_bias: bool
    ) -> int:
        if out_features < 1:
            raise ValueError(f"out_features/out_channels must be >= 1, got {out_features}")
        if G < 1:
            raise ValueError(f"G must be >= 1, got {G}")
        self.out_features = out_features
        self.G = G
        self.use_relu = relu
        self.dse_act = _make_activation(dse_activation)
        self.dfe_bias = nn.Parameter(torch.zeros(out_features)) if out_bias else None
        self.record_stats = True
        self.batch_mean: torch.Tensor | None = None
        self.batch_var: torch.Tensor | None = None
        self._ema: tuple[torch.Tensor, torch.Tensor] | None = None
        return math.ceil(out_features / G) if G > 1 else out_features

    def _combine(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        z = x1 + x2 if self.G == 1 else torch.cat([x1, x2], dim=1)[:, : self.out_features]
        if self.dfe_bias is not None:
            shape = (1, -1) + (1,) * (z.dim() - 2)
            z = z + self.dfe_bias.view(shape)
        return z

    def _record(self, z: torch.Tensor) -> None:
        if self.training and self.record_stats:
            dims = [0] + list(range(2, z.dim()))
            self.batch_mean = z.mean(dim=dims)
            self.batch_var = z.var(dim=dims, unbiased=False)
        else:
            self.batch_mean = None
            self.batch_var = None

    def _finish(self, z: torch.Tensor, bn: nn.Module) -> torch.Tensor:
        self._record(z)
        out = bn(z)
        return torch.relu(out) if self.use_relu else out


class DSEConv(_DSEBase):
    """Convolution decomposed into DFE (shared) + DSE (personal) (FDSE Eq. 2-3, Table A7).

    Parameters
    ----------
    in_channels, out_channels, kernel_size, stride, padding, dilation : as the original
        ``nn.Conv2d`` (the DFE conv keeps them, with ``ceil(T/G)`` output channels).
    G : expansion factor (paper: 2).
    dw_size : kernel of the personal depthwise conv (paper: 3 for convs).
    relu : apply the final ReLU (False when replacing a conv+BN inside a ResNet block).
    dse_activation : activation after BN_DSE: "relu" (paper), "none" (authors' code
        default), "leaky_relu".
    out_bias : add the code's shared bias after the concat.
    bias : bias of the DFE conv (PyTorch default True, as in paper and code).
    bn_eps, bn_momentum : BatchNorm settings (both BNs).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int] = 1,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        G: int = 2,
        dw_size: int = 3,
        relu: bool = True,
        dse_activation: str = "relu",
        out_bias: bool = False,
        bias: bool = True,
        dilation: int | tuple[int, int] = 1,
        bn_eps: float = 1e-5,
        bn_momentum: float | None = 0.1,
    ) -> None:
        super().__init__()
        init = self._init_common(out_channels, G, dse_activation, relu, out_bias)
        new = init * (G - 1) if G > 1 else init
        self.dfe_conv = nn.Conv2d(
            in_channels, init, kernel_size, stride, padding, dilation=dilation, bias=bias
        )
        self.dse_bn = nn.BatchNorm2d(init, eps=bn_eps, momentum=bn_momentum)
        self.dse_conv = nn.Conv2d(init, new, dw_size, 1, dw_size // 2, groups=init, bias=False)
        self.dfe_bn = nn.BatchNorm2d(out_channels, eps=bn_eps, momentum=bn_momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.dse_act(self.dse_bn(self.dfe_conv(x)))
        return self._finish(self._combine(x1, self.dse_conv(x1)), self.dfe_bn)


class DSELinear(_DSEBase):
    """Linear layer decomposed into DFE (shared) + DSE (personal); Table A6 layers 7-8.

    DFE = ``nn.Linear(S, ceil(T/G))``, BN_DSE = ``BatchNorm1d``, DSE = depthwise 1x1 conv
    (each unit scaled into G-1 units, paper ``dw=1``; the code implements it with 1x1
    ``Conv2d`` on [B, C, 1, 1], identical maths), BN_DFE = ``BatchNorm1d(T)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        G: int = 2,
        relu: bool = True,
        dse_activation: str = "relu",
        out_bias: bool = False,
        bias: bool = True,
        bn_eps: float = 1e-5,
        bn_momentum: float | None = 0.1,
    ) -> None:
        super().__init__()
        init = self._init_common(out_features, G, dse_activation, relu, out_bias)
        new = init * (G - 1) if G > 1 else init
        self.dfe_conv = nn.Linear(in_features, init, bias=bias)
        self.dse_bn = nn.BatchNorm1d(init, eps=bn_eps, momentum=bn_momentum)
        self.dse_conv = nn.Conv1d(init, new, 1, groups=init, bias=False)
        self.dfe_bn = nn.BatchNorm1d(out_features, eps=bn_eps, momentum=bn_momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.dse_act(self.dse_bn(self.dfe_conv(x)))
        x2 = self.dse_conv(x1.unsqueeze(-1)).squeeze(-1)
        return self._finish(self._combine(x1, x2), self.dfe_bn)


_DSE_TYPES = (DSEConv, DSELinear)


class FDSEAlexNet(nn.Module):
    """AlexNet-with-BN where every conv and hidden linear layer is a DSE block (Table A6).

    Paper (``stem="paper"``, input 224 or any size >= ~64):
    DSEConv(C,64,11,4,2)-MaxPool(3,2)-DSEConv(64,192,5,1,2)-MaxPool(3,2)-DSEConv(192,384,3,1,1)
    -DSEConv(384,256,3,1,1)-DSEConv(256,256,3,1,1)-MaxPool(3,2)-AdaptiveAvgPool(6)
    -DSELinear(9216,1024)-DSELinear(1024,1024)-Linear(1024,classes) (shared head ``head``).

    ``stem="small"`` for 8x8 ... 32x32 inputs: first conv 3x3/stride 1/padding 1 and padded
    max-pools ``MaxPool(3,2,padding=1)`` so no spatial size collapses to 0; everything else
    as in the paper. ``stem=None`` picks "small" if ``input_size`` < 64, else "paper".
    ``stem="alexnet-bn-small"`` copies the small-input layout of
    :class:`learning.models.AlexNetBN` (conv1 and conv2 3x3/stride 1/padding 1, no
    max-pools; use ``pool_size=2``) so FDSE and the plain AlexNet-BN baselines can be
    compared layer for layer on tiny images (e.g. 8x8 digits).
    ``width`` scales all conv channels and the hidden width (``hidden``, paper 1024; FedBN's
    AlexNet uses 4096). ``conv_padding`` is the padding of conv3-5 (paper 1; the authors'
    code leaves it at 0; ``None``: 0 with the paper stem, 1 with the small stems). Other options are passed to every block.
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        G: int = 2,
        width: float = 1.0,
        hidden: int = 1024,
        dw_size: int = 3,
        stem: str | None = None,
        input_size: int | None = None,
        pool_size: int = 6,
        dse_activation: str = "relu",
        out_bias: bool = False,
        conv_padding: int | None = 1,
    ) -> None:
        super().__init__()
        if num_classes < 1 or in_channels < 1:
            raise ValueError("num_classes and in_channels must be >= 1")
        if not (width > 0):
            raise ValueError(f"width must be > 0, got {width}")
        if stem is None:
            stem = "small" if (input_size is not None and input_size < 64) else "paper"
        if stem not in ("paper", "small", "alexnet-bn-small"):
            raise ValueError(f"stem must be 'paper', 'small' or 'alexnet-bn-small', got {stem!r}")
        self.stem = stem
        c1, c2, c3, c4, c5 = (max(1, round(c * width)) for c in (64, 192, 384, 256, 256))
        h = max(1, round(hidden * width))
        kw = {"G": G, "dse_activation": dse_activation, "out_bias": out_bias}
        if stem == "paper":
            conv1 = DSEConv(in_channels, c1, 11, 4, 2, dw_size=dw_size, **kw)

            def pool() -> nn.Module:
                return nn.MaxPool2d(kernel_size=3, stride=2)
        elif stem == "small":
            conv1 = DSEConv(in_channels, c1, 3, 1, 1, dw_size=dw_size, **kw)

            def pool() -> nn.Module:
                return nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:  # "alexnet-bn-small": the layout of learning.models.AlexNetBN for small inputs
            conv1 = DSEConv(in_channels, c1, 3, 1, 1, dw_size=dw_size, **kw)

            def pool() -> nn.Module:
                return nn.Identity()

        k2, p2 = (3, 1) if stem == "alexnet-bn-small" else (5, 2)
        # None: the authors' 0 with the paper's stem; 1 with the small stems (ours, for inputs of
        # 8-32 px, whose maps are 2-8 px there: a 3x3 conv without padding would collapse them)
        p = conv_padding if conv_padding is not None else (0 if stem == "paper" else 1)
        self.features = nn.Sequential(
            OrderedDict(
                [
                    ("conv1", conv1),
                    ("maxpool1", pool()),
                    ("conv2", DSEConv(c1, c2, k2, 1, p2, dw_size=dw_size, **kw)),
                    ("maxpool2", pool()),
                    ("conv3", DSEConv(c2, c3, 3, 1, p, dw_size=dw_size, **kw)),
                    ("conv4", DSEConv(c3, c4, 3, 1, p, dw_size=dw_size, **kw)),
                    ("conv5", DSEConv(c4, c5, 3, 1, p, dw_size=dw_size, **kw)),
                    ("maxpool5", pool()),
                ]
            )
        )
        self.avgpool = AdaptiveAvgPool2d((pool_size, pool_size))
        self.fc1 = DSELinear(c5 * pool_size * pool_size, h, **kw)
        self.fc2 = DSELinear(h, h, **kw)
        self.head = nn.Linear(h, num_classes)

    def features_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Representation before the head."""
        x = self.avgpool(self.features(x))
        return self.fc2(self.fc1(torch.flatten(x, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features_forward(x))


# ----------------------------------------------------------------- ResNet conversion
def _dse_from_conv_bn(
    conv: nn.Conv2d, bn: nn.BatchNorm2d, G: int, dw_size: int, dse_activation: str, out_bias: bool
) -> DSEConv:
    if conv.groups != 1:
        raise ValueError("convert_resnet18_to_fdse: grouped convolutions are not supported")
    return DSEConv(
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        G=G,
        dw_size=dw_size,
        relu=False,
        dse_activation=dse_activation,
        out_bias=out_bias,
        bias=conv.bias is not None,
        dilation=conv.dilation,
        bn_eps=bn.eps,
        bn_momentum=bn.momentum,
    )


def convert_resnet18_to_fdse(
    model: nn.Module,
    G: int = 2,
    dw_size: int = 3,
    convert_downsample: bool = True,
    dse_activation: str = "relu",
    out_bias: bool = False,
) -> nn.Module:
    """Replace every conv+BN pair of a (torchvision-style) ResNet with a DSE block, in place.

    A pair is either sibling attributes ``conv<s>`` / ``bn<s>`` (stem and basic/bottleneck
    blocks) or consecutive ``Conv2d`` -> ``BatchNorm2d`` children of an ``nn.Sequential``
    (the ``downsample`` shortcut; skipped if ``convert_downsample`` is False). The conv
    becomes ``DSEConv(..., relu=False)`` (its BN_DFE plays the role of the old BN; the
    ResNet's own ReLU / residual add are unchanged) and the BN becomes ``nn.Identity``.
    Weights are freshly initialised. The final ``fc`` stays a plain, shared layer.
    Works for ResNet-18 and other torchvision ResNets; returns ``model``.
    """
    converted = 0

    def visit(module: nn.Module) -> None:
        nonlocal converted
        children = dict(module.named_children())
        done: set[str] = set()
        if isinstance(module, nn.Sequential):
            names = list(children)
            for a, b in zip(names, names[1:], strict=False):
                ca, cb = children[a], children[b]
                if (
                    isinstance(ca, nn.Conv2d)
                    and isinstance(cb, nn.BatchNorm2d)
                    and convert_downsample
                ):
                    setattr(
                        module, a, _dse_from_conv_bn(ca, cb, G, dw_size, dse_activation, out_bias)
                    )
                    setattr(module, b, nn.Identity())
                    done.update((a, b))
                    converted += 1
        for name, child in children.items():
            if name.startswith("conv") and isinstance(child, nn.Conv2d):
                bn_name = "bn" + name[len("conv") :]
                bn = children.get(bn_name)
                if isinstance(bn, nn.BatchNorm2d):
                    setattr(
                        module,
                        name,
                        _dse_from_conv_bn(child, bn, G, dw_size, dse_activation, out_bias),
                    )
                    setattr(module, bn_name, nn.Identity())
                    done.update((name, bn_name))
                    converted += 1
        for name, child in children.items():
            if name not in done and not isinstance(child, _DSE_TYPES):
                visit(child)

    visit(model)
    if converted == 0:
        raise ValueError("convert_resnet18_to_fdse: no conv+BN pairs found")
    return model


# ------------------------------------------------------------------ parameter classes
def dse_blocks(model: nn.Module) -> list[tuple[str, _DSEBase]]:
    """All DSE blocks of ``model`` as (module name, block), in registration (depth) order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _DSE_TYPES)]


def parameter_classes(model: nn.Module) -> dict[str, str]:
    """Map every ``state_dict`` key of ``model`` to "shared", "personal" or "local".

    Inside a DSE block: ``dse_conv.*`` and ``dse_bn.weight/bias`` are personal;
    ``dse_bn.running_mean/running_var/num_batches_tracked`` are local; ``dfe_conv.*``,
    ``dfe_bn.*`` (incl. its running statistics) and ``dfe_bias`` are shared. Everything
    outside DSE blocks (e.g. the head) is shared.
    """
    classes: dict[str, str] = {}
    for name, block in dse_blocks(model):
        prefix = f"{name}." if name else ""
        for key in block.state_dict():
            if key.startswith("dse_bn."):
                cls = LOCAL if key.rsplit(".", 1)[-1] in _BN_STAT_NAMES else PERSONAL
            elif key.startswith("dse_conv."):
                cls = PERSONAL
            else:
                cls = SHARED
            classes[prefix + key] = cls
    out = {}
    for key in model.state_dict():
        out[key] = classes.get(key, SHARED)
    return out


def keys_by_class(model: nn.Module) -> dict[str, list[str]]:
    """``{"shared": [...], "personal": [...], "local": [...]}`` in state_dict order."""
    out: dict[str, list[str]] = {SHARED: [], PERSONAL: [], LOCAL: []}
    for key, cls in parameter_classes(model).items():
        out[cls].append(key)
    return out


def shared_bn_stats(state_dict: Mapping[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Global statistics of every BN_DFE: ``{block name: (running_mean, running_var)}``.

    Reads keys ``<block>.dfe_bn.running_mean`` / ``running_var`` (numpy or torch values) and
    returns detached float copies; pass the result (taken from the received global model
    before local training) to :func:`consistency_loss`.
    """
    suffix = ".dfe_bn.running_mean"
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, val in state_dict.items():
        if key == suffix[1:] or key.endswith(suffix):
            block = key[: -len(suffix)] if key.endswith(suffix) else ""
            var_key = key[: -len("running_mean")] + "running_var"
            if var_key not in state_dict:
                raise ValueError(f"shared_bn_stats: {var_key!r} missing from state_dict")
            mean = torch.as_tensor(val).detach().clone().float()
            var = torch.as_tensor(state_dict[var_key]).detach().clone().float()
            if mean.shape != var.shape or mean.dim() != 1:
                raise ValueError(
                    f"shared_bn_stats: bad shapes for {block!r}: {mean.shape}, {var.shape}"
                )
            out[block] = (mean, var)
    return out


# ------------------------------------------------------------------ consistency loss
def reset_consistency_state(model: nn.Module) -> None:
    """Forget the running estimates of the consistency loss (call at each local round start)."""
    for _, block in dse_blocks(model):
        block._ema = None
        block.batch_mean = None
        block.batch_var = None
    if hasattr(model, _CODE_CARRY_ATTR):
        delattr(model, _CODE_CARRY_ATTR)


def consistency_loss(
    model: nn.Module,
    global_stats: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    beta: float,
    form: str = "paper",
    momentum: float | None = None,
) -> torch.Tensor:
    """Consistency regulariser L_Con of FDSE (Sec. 4.2) for the last training forward pass.

    Call once per training step after ``model(x)`` (blocks in train mode record the batch
    statistics of their DSE output z, the input of BN_DFE). Layer weights
    ``w_l = softmax(beta * l)``, l = 1..L over the DSE blocks in depth order (Eq. 7).
    ``global_stats`` = :func:`shared_bn_stats` of the received global model.

    ``form="paper"`` (default; Eq. 4-6): per channel batch mean mu_b and biased variance
    s_b (over batch and spatial positions); running estimates
    ``mu_hat = gamma * mu_hat_prev + (1 - gamma) * mu_b`` (same for s) with gamma = 1 -
    BN_DFE's PyTorch momentum (0.9 by default; ``momentum`` overrides the PyTorch-style
    momentum), previous estimates detached and the first step of a round initialised with
    the batch statistics (as the code does); per layer
    ``L_l = ||mu_hat - mu_g||^2 / d + ((||s_hat||_1 - ||s_g||_1) / d)^2``. Zero when the
    statistics match, >= 0 always.

    ``form="code"`` (authors' ``algorithm/fdse.py``): f = per-channel batch mean; scalars
    ``mf = mean_c f``, ``vf = var_c f`` (unbiased, across channels); one running pair
    ``fn = (1 - m) fn + m mf`` (same for vn) carried across layers *and* steps (as the
    code's single variables are), with m = BN_DFE momentum; per layer
    ``w_l [ mean((mu_g^2 - fn^2) / (2 vn)) + 0.5 mean(log(vn / (s_g + 1e-8)) + s_g / (vn + 1e-8)) ]``.
    This form is not zero at matching statistics and can be negative.

    Side effect: advances the running estimates (stored on the blocks / the model).
    """
    if form not in ("paper", "code"):
        raise ValueError(f"consistency_loss: form must be 'paper' or 'code', got {form!r}")
    if not math.isfinite(float(beta)):
        raise ValueError(f"consistency_loss: beta must be finite, got {beta}")
    if momentum is not None and not (0.0 < momentum <= 1.0):
        raise ValueError(f"consistency_loss: momentum must be in (0, 1], got {momentum}")
    blocks = dse_blocks(model)
    if not blocks:
        raise ValueError("consistency_loss: model has no DSE blocks")
    weights = torch.softmax(float(beta) * torch.arange(1, len(blocks) + 1, dtype=torch.float64), 0)
    total: torch.Tensor | None = None
    carry = getattr(model, _CODE_CARRY_ATTR, None)
    fn, vn = carry if carry is not None else (None, None)
    for (name, block), w in zip(blocks, weights.tolist(), strict=True):
        if block.batch_mean is None or block.batch_var is None:
            raise ValueError(
                f"consistency_loss: block {name!r} has no recorded statistics; run a forward "
                "pass with the model in train mode first"
            )
        if name not in global_stats:
            raise ValueError(f"consistency_loss: no global statistics for block {name!r}")
        mu_b, var_b = block.batch_mean, block.batch_var
        g_mean, g_var = (
            torch.as_tensor(t).detach().to(mu_b.device, mu_b.dtype) for t in global_stats[name]
        )
        if g_mean.shape != mu_b.shape or g_var.shape != mu_b.shape:
            raise ValueError(
                f"consistency_loss: block {name!r}: global stats {tuple(g_mean.shape)}/"
                f"{tuple(g_var.shape)} do not match {tuple(mu_b.shape)}"
            )
        bn_m = block.dfe_bn.momentum if block.dfe_bn.momentum is not None else 0.1
        m = float(momentum) if momentum is not None else float(bn_m)
        if form == "paper":
            if block._ema is None:
                mu_hat, var_hat = mu_b, var_b
            else:
                mu_hat = (1.0 - m) * block._ema[0] + m * mu_b
                var_hat = (1.0 - m) * block._ema[1] + m * var_b
            block._ema = (mu_hat.detach(), var_hat.detach())
            d = mu_hat.numel()
            term = ((mu_hat - g_mean) ** 2).sum() / d + ((var_hat.sum() - g_var.sum()) / d) ** 2
        else:
            mf = mu_b.mean()
            vf = mu_b.var() if mu_b.numel() > 1 else torch.zeros_like(mf)
            fn = mf if fn is None else (1.0 - m) * fn + m * mf
            vn = vf if vn is None else (1.0 - m) * vn + m * vf
            term = ((g_mean.pow(2) - fn.pow(2)) / (2 * vn)).mean() + 0.5 * (
                torch.log(vn / (g_var + 1e-8)) + g_var / (vn + 1e-8)
            ).mean()
        total = w * term if total is None else total + w * term
    if form == "code":
        setattr(model, _CODE_CARRY_ATTR, (fn.detach(), vn.detach()))
    assert total is not None
    return total


def adaptation_mode(model: nn.Module, trainable: Iterable[str] = (PERSONAL,)) -> list[nn.Parameter]:
    """Prepare label-free unseen-domain adaptation (paper Algorithm 3).

    Freezes every parameter whose class is not in ``trainable`` (default: only the DSE
    modules train) and puts every BN_DFE in eval mode so its (global) running statistics
    stay fixed. Call after ``model.train()``. Returns the trainable parameters.
    """
    trainable = set(trainable)
    classes = parameter_classes(model)
    params = []
    for name, p in model.named_parameters():
        keep = classes.get(name, SHARED) in trainable
        p.requires_grad_(keep)
        if keep:
            params.append(p)
    for _, block in dse_blocks(model):
        block.dfe_bn.eval()
    return params


# ------------------------------------------------------------------------- builder
FDSE_MODELS = ("fdse-alexnet", "fdse-resnet18")


@dataclass(frozen=True)
class FDSEAlexNetConfig:
    """``conf/model/fdse-alexnet.yaml``: :class:`FDSEAlexNet`'s options."""

    name: str
    G: int
    width: float
    hidden: int
    dw_size: int
    stem: str | None
    pool_size: int
    dse_activation: str
    out_bias: bool
    conv_padding: int | None

    def __post_init__(self) -> None:
        check(self.G >= 1 and self.dw_size >= 1 and self.hidden >= 1 and self.pool_size >= 1,
              "model.G, model.dw_size, model.hidden and model.pool_size must be >= 1")
        finite("model.width", self.width, 0.0, strict=True)
        check(self.conv_padding is None or self.conv_padding >= 0,
              f"model.conv_padding must be null or >= 0, got {self.conv_padding}")


@dataclass(frozen=True)
class FDSEResNet18Config:
    """``conf/model/fdse-resnet18.yaml``: the ResNet-18 and :func:`convert_resnet18_to_fdse`'s options."""

    name: str
    G: int
    dw_size: int
    convert_downsample: bool
    dse_activation: str
    out_bias: bool
    small_input: bool
    pretrained_path: str
    pretrained_required: bool

    def __post_init__(self) -> None:
        check(self.G >= 1 and self.dw_size >= 1, "model.G and model.dw_size must be >= 1")


def build_fdse_model(config: FDSEAlexNetConfig | FDSEResNet18Config, input_shape: tuple[int, int, int],
                     num_classes: int) -> nn.Module:
    """Build an FDSE model from its typed config (``learning.models.build_model``'s registry).

    ``fdse-alexnet``: :class:`FDSEAlexNet` (``stem`` null = by input size). ``fdse-resnet18``:
    the torchvision ResNet-18 of ``learning.models`` (same ``small_input``/``pretrained_path``)
    converted with :func:`convert_resnet18_to_fdse`; its head stays shared.
    """
    c, h, _ = input_shape
    if isinstance(config, FDSEAlexNetConfig):
        return FDSEAlexNet(
            num_classes, in_channels=c, G=config.G, width=config.width, hidden=config.hidden,
            dw_size=config.dw_size, stem=None if config.stem in (None, "", "auto") else str(config.stem),
            input_size=h, pool_size=config.pool_size, dse_activation=config.dse_activation,
            out_bias=config.out_bias, conv_padding=config.conv_padding,
        )
    model = resnet18(c, num_classes, config.pretrained_path, config.small_input)
    convert_resnet18_to_fdse(model.body, G=config.G, dw_size=config.dw_size,
                             convert_downsample=config.convert_downsample,
                             dse_activation=config.dse_activation, out_bias=config.out_bias)
    return model
