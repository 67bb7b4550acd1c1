"""Tests of learning/fdse_model.py."""

import math

import pytest
import torch
import torch.nn as nn

from learning.fdse_model import (
    LOCAL,
    PERSONAL,
    SHARED,
    DSEConv,
    DSELinear,
    FDSEAlexNet,
    adaptation_mode,
    consistency_loss,
    convert_resnet18_to_fdse,
    dse_blocks,
    keys_by_class,
    parameter_classes,
    reset_consistency_state,
    shared_bn_stats,
)


def small_model(in_channels=3, input_size=32, **kw):
    torch.manual_seed(0)
    return FDSEAlexNet(
        10, in_channels=in_channels, input_size=input_size, width=0.125, hidden=32, **kw
    )


# ---------------------------------------------------------------------- shapes
@pytest.mark.parametrize("in_channels,size", [(1, 8), (3, 32), (1, 28)])
def test_alexnet_shapes_small_inputs(in_channels, size):
    model = small_model(in_channels, size)
    assert model.stem == "small"
    out = model(torch.randn(4, in_channels, size, size))
    assert out.shape == (4, 10)
    model.eval()
    assert model(torch.randn(2, in_channels, size, size)).shape == (2, 10)


def test_alexnet_paper_stem_architecture():
    model = FDSEAlexNet(7, width=0.125, hidden=64)
    assert model.stem == "paper"
    c1 = model.features.conv1
    assert c1.dfe_conv.kernel_size == (11, 11) and c1.dfe_conv.stride == (4, 4)
    assert c1.dfe_conv.out_channels == math.ceil(8 / 2) and c1.dfe_bn.num_features == 8
    assert model.fc1.dfe_conv.in_features == 32 * 6 * 6
    assert model(torch.randn(2, 3, 96, 96)).shape == (2, 7)


def test_dse_block_structure_and_odd_channels():
    blk = DSEConv(3, 7, 3, 1, 1, G=2, dw_size=3)
    assert blk.dfe_conv.out_channels == 4
    assert blk.dse_conv.groups == 4 and blk.dse_conv.out_channels == 4
    assert blk.dfe_bn.num_features == 7
    assert blk(torch.randn(2, 3, 5, 5)).shape == (2, 7, 5, 5)
    blk3 = DSEConv(3, 9, 3, 1, 1, G=3)
    assert blk3.dfe_conv.out_channels == 3 and blk3.dse_conv.out_channels == 6
    assert blk3(torch.randn(2, 3, 4, 4)).shape == (2, 9, 4, 4)
    lin = DSELinear(10, 5, G=2, out_bias=True, dse_activation="none")
    assert lin(torch.randn(3, 10)).shape == (3, 5)
    g1 = DSEConv(3, 4, 3, 1, 1, G=1)
    assert g1(torch.randn(2, 3, 4, 4)).shape == (2, 4, 4, 4)
    with pytest.raises(ValueError):
        DSEConv(3, 4, G=2, dse_activation="tanh")


# -------------------------------------------------------------- parameter classes
@pytest.mark.parametrize("builder", ["alexnet", "resnet"])
def test_parameter_classes_partition(builder):
    if builder == "alexnet":
        model = small_model(out_bias=True)
    else:
        tv = pytest.importorskip("torchvision")
        model = convert_resnet18_to_fdse(tv.models.resnet18(num_classes=5))
    classes = parameter_classes(model)
    keys = list(model.state_dict().keys())
    assert list(classes) == keys  # every key exactly once
    assert set(classes.values()) == {SHARED, PERSONAL, LOCAL}
    groups = keys_by_class(model)
    assert sorted(sum(groups.values(), [])) == sorted(keys)
    assert len(set(groups[SHARED]) & set(groups[PERSONAL])) == 0
    for k, c in classes.items():
        if ".dse_bn.running_" in k or ".dse_bn.num_batches_tracked" in k:
            assert c == LOCAL, k
        elif ".dse_bn." in k or ".dse_conv." in k:
            assert c == PERSONAL, k
        else:
            assert c == SHARED, k
    head = "head.weight" if builder == "alexnet" else "fc.weight"
    assert classes[head] == SHARED


# -------------------------------------------------------------- consistency loss
def _global_from(model):
    return {
        name: (b.batch_mean.detach().clone(), b.batch_var.detach().clone())
        for name, b in dse_blocks(model)
    }


def test_consistency_loss_zero_when_stats_match():
    model = small_model()
    model.train()
    reset_consistency_state(model)
    model(torch.randn(8, 3, 32, 32))
    gs = _global_from(model)
    loss = consistency_loss(model, gs, beta=0.001)
    assert loss.item() == pytest.approx(0.0, abs=1e-10)


def test_consistency_loss_positive_differentiable_and_matches_formula():
    model = small_model()
    model.train()
    reset_consistency_state(model)
    x = torch.randn(8, 3, 32, 32)
    gs = shared_bn_stats(model.state_dict())  # fresh BN: mean 0, var 1
    assert set(gs) == {n for n, _ in dse_blocks(model)}
    model(x)
    loss = consistency_loss(model, gs, beta=0.05)
    # explicit Eq. 6-7 on the first step (running estimate = batch statistics)
    blocks = dse_blocks(model)
    w = torch.softmax(0.05 * torch.arange(1, len(blocks) + 1, dtype=torch.float64), 0)
    ref = 0.0
    for (name, b), wl in zip(blocks, w, strict=True):
        mu, var = b.batch_mean.detach(), b.batch_var.detach()
        d = mu.numel()
        ref += float(wl) * (
            float(((mu - gs[name][0]) ** 2).sum()) / d
            + ((float(var.sum()) - float(gs[name][1].sum())) / d) ** 2
        )
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert loss.item() > 0
    loss.backward()
    assert model.features.conv1.dse_conv.weight.grad is not None
    assert model.features.conv1.dse_conv.weight.grad.abs().sum() > 0
    # second step: running estimate mixes detached previous estimate and current batch
    model.zero_grad()
    model(x)
    loss2 = consistency_loss(model, gs, beta=0.05)
    assert loss2.item() > 0
    loss2.backward()


def test_consistency_gradients_reach_only_intended_params():
    model = small_model()
    model.train()
    reset_consistency_state(model)
    gs = shared_bn_stats(model.state_dict())
    model(torch.randn(8, 3, 32, 32))
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    consistency_loss(model, gs, beta=0.001).backward()
    # head and the last block's BN_DFE are downstream of every DSE output: no gradient
    for p in list(model.head.parameters()) + list(model.fc2.dfe_bn.parameters()):
        assert p.grad is None or p.grad.abs().sum() == 0
    # the received global statistics are constants
    for mean, var in gs.values():
        assert not mean.requires_grad and not var.requires_grad
    # upstream shared and personal params do receive gradient in local training
    assert model.features.conv1.dfe_conv.weight.grad.abs().sum() > 0
    assert model.features.conv1.dse_bn.weight.grad.abs().sum() > 0
    # the loss itself does not modify any parameter or BN buffer
    for k, v in model.state_dict().items():
        assert torch.equal(v, state_before[k]), k

    # unseen-domain adaptation (Algorithm 3): only personal params train, BN_DFE frozen
    model2 = small_model()
    model2.train()
    trainable = adaptation_mode(model2)
    classes = parameter_classes(model2)
    assert {classes[n] for n, p in model2.named_parameters() if p.requires_grad} == {PERSONAL}
    assert len(trainable) == sum(1 for _, p in model2.named_parameters() if p.requires_grad)
    stats_before = {k: v.clone() for k, v in model2.state_dict().items() if "dfe_bn.running" in k}
    reset_consistency_state(model2)
    gs2 = shared_bn_stats(model2.state_dict())
    model2(torch.randn(8, 3, 32, 32))
    consistency_loss(model2, gs2, beta=0.001).backward()
    for n, p in model2.named_parameters():
        if classes[n] != PERSONAL:
            assert p.grad is None, n
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    for k, v in stats_before.items():
        assert torch.equal(model2.state_dict()[k], v), k


def test_consistency_loss_code_form_and_errors():
    model = small_model()
    model.train()
    reset_consistency_state(model)
    gs = shared_bn_stats(model.state_dict())
    for _ in range(2):  # the code form carries a running pair across steps
        model.zero_grad()
        model(torch.randn(8, 3, 32, 32))
        loss = consistency_loss(model, gs, beta=0.1, form="code")
        assert torch.isfinite(loss)
        loss.backward()
        assert model.features.conv2.dse_conv.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        consistency_loss(model, gs, beta=0.1, form="other")
    with pytest.raises(ValueError):
        consistency_loss(model, {}, beta=0.1)
    bad = {k: (m[:1], v[:1]) for k, (m, v) in gs.items()}
    with pytest.raises(ValueError):
        consistency_loss(model, bad, beta=0.1)
    reset_consistency_state(model)
    with pytest.raises(ValueError):  # no forward pass recorded
        consistency_loss(model, gs, beta=0.1)
    model.eval()
    model(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError):  # eval forward does not record
        consistency_loss(model, gs, beta=0.1)


def test_shared_bn_stats_extracts_dfe_bn_only():
    model = small_model()
    sd = model.state_dict()
    stats = shared_bn_stats(sd)
    assert len(stats) == len(dse_blocks(model)) == 7
    m, v = stats["features.conv3"]
    assert torch.equal(m, sd["features.conv3.dfe_bn.running_mean"])
    assert torch.equal(v, sd["features.conv3.dfe_bn.running_var"])
    m.add_(1.0)  # copies, not views
    assert not torch.equal(m, sd["features.conv3.dfe_bn.running_mean"])
    np_sd = {k: t.numpy() for k, t in sd.items()}
    assert set(shared_bn_stats(np_sd)) == set(stats)


# -------------------------------------------------------------------- resnet
def test_convert_resnet18_runs_forward_and_trains():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = convert_resnet18_to_fdse(tv.models.resnet18(num_classes=5))
    blocks = dse_blocks(model)
    assert len(blocks) == 20  # stem + 16 block convs + 3 downsample convs
    assert not any(
        isinstance(m, nn.BatchNorm2d) and n.split(".")[-1].startswith("bn")
        for n, m in model.named_modules()
    )
    assert isinstance(model.layer2[0].downsample[0], DSEConv)
    assert all(not b.use_relu for _, b in blocks)
    model.train()
    out = model(torch.randn(4, 3, 32, 32))
    assert out.shape == (4, 5)
    gs = shared_bn_stats(model.state_dict())
    loss = nn.functional.cross_entropy(out, torch.randint(0, 5, (4,))) + 0.1 * consistency_loss(
        model, gs, 0.001
    )
    loss.backward()
    model.eval()
    assert model(torch.randn(2, 1 * 3, 8, 8)).shape == (2, 5)
    no_ds = convert_resnet18_to_fdse(tv.models.resnet18(num_classes=5), convert_downsample=False)
    assert len(dse_blocks(no_ds)) == 17
    with pytest.raises(ValueError):
        convert_resnet18_to_fdse(nn.Linear(3, 4))
