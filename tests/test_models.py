"""Models build, run on the data they are meant for, and expose their parameter groups."""

from __future__ import annotations

import pytest
import torch
from helpers import model_config

from learning.models import MODELS, ModelError, build_model, parameter_groups, resolve_device

SHAPES = {"cnn": (1, 8, 8), "cnn4": (3, 32, 32), "mobilenet": (3, 32, 32), "alexnet-bn": (3, 32, 32),
          "resnet18": (3, 32, 32), "mlp": (1, 28, 28)}
CFG = {"cnn": {}, "cnn4": {}, "mobilenet": {"width_mult": 0.25}, "alexnet-bn": {"width": 0.1},
       "resnet18": {"small_input": True}, "mlp": {"hidden": [128, 128]}}


@pytest.mark.parametrize("name", list(SHAPES))
def test_model_forward_and_groups(name):
    model = build_model(model_config(name, **CFG[name]), SHAPES[name], num_classes=7)
    model.eval()
    out = model(torch.randn(2, *SHAPES[name]))
    assert out.shape == (2, 7)
    groups = parameter_groups(model)
    assert groups["head"] == ["head.weight", "head.bias"]
    assert set(groups["head"]).isdisjoint(groups["body"])
    assert set(groups["head"]) | set(groups["body"]) == set(model.state_dict())
    assert set(groups["bn_stats"]) <= set(groups["bn"]) <= set(groups["body"])
    if name != "mlp":
        assert groups["bn"], f"{name} should have BatchNorm layers"


def test_large_alexnet_input():
    model = build_model(model_config("alexnet-bn", width=0.1), (3, 96, 96), 5).eval()
    assert model(torch.randn(2, 3, 96, 96)).shape == (2, 5)


def test_unknown_model_and_missing_weights(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'vgg'"):
        build_model({"name": "vgg"}, (3, 32, 32), 10)
    with pytest.raises(ModelError, match="does not exist"):
        build_model(model_config("resnet18", pretrained_path=str(tmp_path / "no.pt")), (3, 32, 32), 10)
    assert "cnn" in MODELS


def test_resnet18_loads_local_pretrained_weights(tmp_path):
    import torchvision

    ref = torchvision.models.resnet18(weights=None)
    path = tmp_path / "r18.pt"
    torch.save(ref.state_dict(), path)
    model = build_model(model_config("resnet18", pretrained_path=str(path), small_input=False), (3, 64, 64), 4)
    torch.testing.assert_close(model.body.layer1[0].conv1.weight, ref.layer1[0].conv1.weight)


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="CUDA is not available"):
            resolve_device("cuda")


def test_alexnet_bn_sizes_match_fedbn_and_fdse_table_a5():
    """On 256x256 inputs: FedBN's AlexNet-BN (hidden 4096) has about 5.7e7 parameters, FDSE's
    baseline (Table A5: hidden 1024, max-pool after conv5) about 1.3e7."""
    import torch

    from learning.models import AlexNetBN

    def count(hidden: int) -> int:
        return sum(p.numel() for p in AlexNetBN(3, 10, 256, 1.0, hidden).parameters())

    assert 5.6e7 < count(4096) < 5.8e7
    assert 1.25e7 < count(1024) < 1.35e7
    out = AlexNetBN(3, 10, 256, 1.0, 1024).eval()(torch.randn(2, 3, 256, 256))
    assert out.shape == (2, 10)


@pytest.mark.parametrize(("strategy", "extra"), [("fedavg", ""), ("fedbasis", ""), ("partialfed-adaptive", ""),
                                                  ("fdse", "model=fdse-alexnet")])
def test_a_process_builds_a_model_once_and_copies_are_the_built_model(strategy: str, extra: str) -> None:
    """build_method_model hands out copies of a per-process template: each copy equals a
    model built from scratch, later random draws (dropout) are the same as after building,
    and training one copy does not change the next."""
    import torch

    from common import methods
    from common.config import compose_config

    cfg = compose_config({"strategy": strategy, "overrides": extra})
    methods._BUILT.clear()
    fresh = methods.build_method_model(cfg, (1, 8, 8), 10)
    draw_fresh = torch.rand(5)
    copied = methods.build_method_model(cfg, (1, 8, 8), 10)
    draw_copied = torch.rand(5)
    assert len(methods._BUILT) == 1
    for (k, a), b in zip(fresh.state_dict().items(), copied.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
        if a.is_floating_point():
            a.add_(1.0)  # train the first model
    assert torch.equal(draw_fresh, draw_copied)
    again = methods.build_method_model(cfg, (1, 8, 8), 10)
    for a, b in zip(again.state_dict().values(), copied.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the template was not touched by training a copy


@pytest.mark.parametrize(("shape", "out"), [((2, 3, 8, 8), 2), ((2, 3, 2, 2), 6), ((2, 3, 7, 5), (3, 2)),
                                            ((1, 4, 13, 13), 6), ((1, 2, 1, 1), 6), ((1, 2, 6, 6), 6)])
def test_deterministic_adaptive_pool_equals_torchs(shape: tuple[int, ...], out: int | tuple[int, int]) -> None:
    """Our matrix-product pool (deterministic on CUDA) gives torch's adaptive average pool,
    down- and up-sampling, values and gradients."""
    import torch.nn.functional as F

    from learning.backbones import AdaptiveAvgPool2d

    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    ours = AdaptiveAvgPool2d(out)(x)
    ref = F.adaptive_avg_pool2d(x, out)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(ours, x, g)
    (rx,) = torch.autograd.grad(F.adaptive_avg_pool2d(x, out), x, g)
    torch.testing.assert_close(gx, rx, rtol=0, atol=1e-12)
