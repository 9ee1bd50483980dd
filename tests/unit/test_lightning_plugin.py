"""The Lightning plugin without a Trainer: what :meth:`apply` converts and with which
layer arguments, what :meth:`revert` gives back, and arguments refused at construction.
Its training at 2 ranks is ``tests/test_lightning.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from vision import import_vision  # noqa: E402

import_vision()  # before lightning: torchmetrics imports torchvision (see tests/vision.py)
pytest.importorskip("lightning", reason="bash launch/test.sh installs Lightning")
from lightning.pytorch.plugins import LayerSync  # noqa: E402
from torch import nn  # noqa: E402

from hvd_syncbn.lightning import SyncBatchNormPlugin  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm  # noqa: E402


def test_apply_converts_with_the_layer_arguments_and_revert_gives_back_only_what_it_converted():
    mine = SyncBatchNorm(3, name="mine")
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, momentum=0.3), mine, nn.BatchNorm1d(3))
    weight, plugin = model[1].weight, SyncBatchNormPlugin(process_group="group", comm="mpi", check_finite=True)
    assert isinstance(plugin, LayerSync)
    model = plugin.apply(model)
    assert [type(m) for m in model[1:]] == [SyncBatchNorm] * 3 and model[2] is mine
    assert [(m.comm, m.check_finite, m.process_set) for m in (model[1], model[3])] == [("mpi", True, "group")] * 2
    assert SyncBatchNormPlugin(group_size="node").apply(nn.BatchNorm2d(3)).group_size == "node"
    model = plugin.revert(model)
    assert [type(m) for m in model[1:]] == [nn.BatchNorm2d, SyncBatchNorm, nn.BatchNorm1d] and model[2] is mine
    assert model[1].weight is weight and model[1].momentum == 0.3 and not hasattr(model[1], "comm")


@pytest.mark.parametrize("kwargs, match", [
    (dict(comm="nccl"), r"comm: expected one of auto, horovod, mpi, torch, got 'nccl'"),
    (dict(stats="gpu"), r"expected stats to be 'auto', 'host' or 'device', got 'gpu'"),
    (dict(process_set=1, process_group=2), r"SyncBatchNormPlugin: expected process_set or process_group"),
    (dict(process_set=[0, 1], group_size=2), r"SyncBatchNormPlugin: expected group_size or an explicit group"),
    (dict(group_size=0), r"SyncBatchNormPlugin: expected group_size to be a positive int or 'node', got 0"),
])
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyncBatchNormPlugin(**kwargs)
