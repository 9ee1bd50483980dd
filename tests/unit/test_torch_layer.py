"""The PyTorch layer in one process: its argument and input checks (the same bad input on
every rank of a thread world at 1, 2 and 3 ranks), and the converter both ways, on plain
PyTorch modules and on timm's. None of it depends on the world size, so it runs once,
here, instead of in every launch of the rank-side suites."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from conftest import collective_timeout, results, run, world  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm, SyncBatchNormAct2d, convert_sync_batchnorm, revert_sync_batchnorm  # noqa: E402
from vision import import_vision  # noqa: E402


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.ones(4, 3, 2, 2), r"expected 4 channels on axis 1, got 3"),
        (torch.ones(4), r"expected an input with at least 2 dims .* got 1D input"),
        (torch.ones(4, 4, dtype=torch.int64), r"expected a floating-point input .* got torch.int64"),
        (torch.ones(4, 4, dtype=torch.complex64), r"expected a floating-point input"),
    ],
    ids=["channels", "ndim", "int", "complex"],
)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bad_input_names_layer(x, match, size):
    """The same bad input on every rank of a thread world (alone at 1: no collective;
    across ranks every rank's error goes through the poisoned collective): each raises
    naming the layer, and no rank's statistics move."""
    comms = world(size)
    layers = [SyncBatchNorm(4, name="stem.bn", comm=c) for c in comms]

    def rank(r, comm):
        bn = layers[r]
        with pytest.raises(ValueError, match=r"stem\.bn: " + match):
            bn(x)
        assert bn.num_batches_tracked.item() == 0 and bn.running_mean.abs().sum() == 0

    with collective_timeout(5.0):
        results(run(size, rank, comms))


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(num_features=0), "num_features"), (dict(num_features=4, eps=0.0), "eps > 0"),
     (dict(num_features=4, momentum=1.5), r"momentum in \[0, 1\]"),
     (dict(num_features=4, comm="nccl"), r"comm: expected one of auto, horovod, mpi, torch, got 'nccl'")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncBatchNorm(**kwargs)


def test_state_dict_loads_both_ways_and_revert_keeps_state():
    plain = nn.BatchNorm2d(6, momentum=0.2)
    plain(torch.randn(8, 6, 3, 3))
    sync = SyncBatchNorm(6, momentum=0.2)
    sync.load_state_dict(plain.state_dict())
    assert list(sync.state_dict()) == list(plain.state_dict())
    model = nn.Sequential(nn.Conv2d(3, 6, 1), plain, nn.Sequential(nn.BatchNorm1d(6)))
    model[1].weight.requires_grad_(False)
    model.eval()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    convert_sync_batchnorm(model)
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][0], SyncBatchNorm)
    assert model[1].layer_name == "1" and model[2][0].layer_name == "2.0"
    assert not model[1].training and not model[1].weight.requires_grad
    revert_sync_batchnorm(model)
    assert type(model[1]) is nn.BatchNorm2d and type(model[2][0]) is nn.BatchNorm1d
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert not model[1].training and not model[1].weight.requires_grad


def test_timm_layer_keeps_act_drop_and_attributes():
    import_vision()
    from timm.layers import BatchNormAct2d

    layer = BatchNormAct2d(6, act_layer=nn.SiLU, drop_layer=nn.Dropout2d, momentum=0.3, eps=1e-4)
    layer.weight.requires_grad_(False)
    layer.custom_tag = "kept"
    act, drop = layer.act, layer.drop
    new = convert_sync_batchnorm(layer)
    assert type(new) is SyncBatchNormAct2d and new.act is act and new.drop is drop
    assert (new.momentum, new.eps, new.custom_tag, new.weight.requires_grad) == (0.3, 1e-4, "kept", False)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input"):
        new(torch.ones(2, 6, 3))
    back = revert_sync_batchnorm(new)
    assert type(back) is BatchNormAct2d and back.act is act and back.custom_tag == "kept"
    assert not hasattr(back, "layer_name") and not hasattr(back, "process_set")


def test_unknown_bn_subclass_raises_naming_it():
    """timm's SplitBatchNorm2d (its own forward over batch splits) and a user's subclass."""
    _, timm = import_vision()
    from timm.layers import convert_splitbn_model

    model = convert_splitbn_model(timm.create_model("resnet18", pretrained=False, num_classes=3), num_splits=2)
    with pytest.raises(ValueError, match=r"'bn1' is a timm\.layers\.split_batchnorm\.SplitBatchNorm2d, a subclass "
                                         r"of BatchNorm2d this converter does not know.*classes="):
        convert_sync_batchnorm(model)

    class ScaledBN(nn.BatchNorm2d):
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match=r"'1' is a .*ScaledBN"):
        convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), ScaledBN(4)))


def test_lazy_bn_raises_until_initialised_then_converts():
    model = nn.Sequential(nn.LazyConv2d(4, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match=r"uninitialised LazyBatchNorm2d at '1'; run one forward pass"):
        convert_sync_batchnorm(model)
    model(torch.ones(2, 3, 2, 2))
    assert type(convert_sync_batchnorm(model)[1]) is SyncBatchNorm


def test_torch_sync_batchnorm_converts_and_reverts():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4, momentum=0.2))
    convert_sync_batchnorm(model)
    assert type(model[1]) is SyncBatchNorm and model[1].momentum == 0.2 and model[1].layer_name == "1"
    assert type(revert_sync_batchnorm(model)[1]) is nn.SyncBatchNorm


def test_conversion_keeps_device_dtype_training_and_requires_grad():
    model = nn.Sequential(nn.BatchNorm2d(4, dtype=torch.float64), nn.BatchNorm1d(3)).eval()
    model[0].bias.requires_grad_(False)
    params = [model[0].weight, model[1].running_mean]
    convert_sync_batchnorm(model)
    assert all(type(m) is SyncBatchNorm for m in model)
    assert model[0].weight.dtype == torch.float64 and model[0].weight.device.type == "cpu"
    assert not model[0].training and not model[0].bias.requires_grad and model[0].weight.requires_grad
    assert model[0].weight is params[0] and model[1].running_mean is params[1], "state not carried over as is"


def test_importing_the_adapter_imports_neither_timm_nor_torchvision():
    code = "import sys, hvd_syncbn.torch; print(sorted({'timm', 'torchvision'} & set(sys.modules)))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_a_users_communicator_is_used_as_it_is_even_where_a_freed_ones_id_recurs():
    """``comm=`` a Communicator: each layer uses that object. (Once remembered by ``id()``:
    a world of one, resolved to "alone" and freed, left its ``id`` to a later world's
    communicator, whose layer then ran alone, silently, while its peers waited.)"""
    from hvd_syncbn.torch.transports import resolve

    for _ in range(200):
        assert resolve(world(1)[0], None, "bn") is None  # a world of one: alone, plain BN
        mine = world(2)[0]
        assert resolve(mine, None, "bn") is mine
