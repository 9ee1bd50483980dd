"""Real models from timm and torchvision, converted, against the unconverted model
trained in one process on the concatenated batch; and a subclass opted in.

Runs at any world size (``test_launch.py``: 1 rank plainly, 3 ranks under mpirun). What the converter refuses and keeps, which does not depend on the world size,
is tested once in ``unit/test_torch_layer.py``. Every rank builds the same model from a seed, keeps an
unconverted copy and trains it on the whole batch, and trains the converted model on
its own shard (2, 3 and 0 images at 3 ranks: unequal, one empty).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvd_syncbn.torch import SyncBatchNorm, SyncBatchNormAct2d, convert_sync_batchnorm, revert_sync_batchnorm
from oracle import assert_as_accurate, assert_close, global_batch, shard_sizes, shard_slice
from vision import import_vision

hvd = pytest.importorskip("horovod.torch")
torchvision, timm = import_vision()

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()
SHARDS = (2, 3, 0)  # images per rank, cycled: unequal at 2 ranks, one empty at 3


def timm_model(name):
    return lambda: timm.create_model(name, pretrained=False, num_classes=3, drop_rate=0.0)


def segmentation(name):
    return lambda: getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None, num_classes=3)


# name: (builder, BN class after conversion, dtype of the converted model); images are
# 64x64, and the first four models hold timm's BatchNormAct2d. deeplabv3 trains in
# float64: its ASPP pooling branch normalises one value per image (5 per channel), where
# float32 gradients, plain BN's as ours, are 2% off float64 after one step; in float32,
# local BN on the shards would be only 2.5-4x further off than plain BN (measured).
MODELS = {
    "timm-efficientnet_b0": (timm_model("efficientnet_b0"), SyncBatchNormAct2d, torch.float32),
    "timm-mobilenetv3_small_100": (timm_model("mobilenetv3_small_100"), SyncBatchNormAct2d, torch.float32),
    "timm-cspresnet50": (timm_model("cspresnet50"), SyncBatchNormAct2d, torch.float32),
    "timm-regnety_002": (timm_model("regnety_002"), SyncBatchNormAct2d, torch.float32),
    "timm-resnet18": (timm_model("resnet18"), SyncBatchNorm, torch.float32),
    "torchvision-deeplabv3_resnet50": (segmentation("deeplabv3_resnet50"), SyncBatchNorm, torch.float64),
    "torchvision-lraspp_mobilenet_v3_large": (segmentation("lraspp_mobilenet_v3_large"), SyncBatchNorm,
                                              torch.float32),
}
SIZE = 64


def logits(model, x):
    out = model(x)
    return out["out"] if isinstance(out, dict) else out  # (N, 3) or (N, 3, H, W)


def bn_classes(model):
    return [type(m) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize("name", MODELS)
def test_converted_model_trains_like_one_process(name):
    """Two SGD steps: loss, every parameter and every buffer as the unconverted model's
    on the concatenated batch; then revert gives the model back. (No eval outputs: after
    two steps the running statistics are too far from the batch ones for deep nets
    such as efficientnet_b0 to stay finite in eval mode, converted or not.)"""
    build, sync_class, dtype = MODELS[name]
    torch.manual_seed(0)
    plain = build().train()
    for m in plain.modules():
        if isinstance(m, nn.Dropout):  # deeplabv3's head: no randomness between the two models
            m.p = 0.0
    sync = copy.deepcopy(plain)
    classes = bn_classes(plain)
    convert_sync_batchnorm(sync)
    assert {type(m) for m in sync.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)} == {sync_class}
    assert len(bn_classes(sync)) == len(classes)
    assert list(sync.state_dict()) == list(plain.state_dict()), "state_dict keys changed"
    sync.load_state_dict(plain.state_dict())  # a checkpoint of the original loads
    # Alone, the converted layers are plain BN: the reference is the same model as it is,
    # and the results are equal. Across ranks the reference is plain BN in float64, and
    # ours must be as close to it as plain BN in float32 is (assert_as_accurate): an
    # element-wise tolerance cannot tell a wrong statistic from float32's own noise in
    # these nets (plain float32 BN is up to 1e-3 off float64 in cspresnet50's gradients).
    plain32 = copy.deepcopy(plain).float() if WORLD > 1 else None
    plain.to(torch.float64 if WORLD > 1 else dtype), sync.to(dtype)

    sizes = shard_sizes(SHARDS, WORLD)
    mine, total = shard_slice(sizes, RANK), sum(sizes)
    runs = [(model, torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9), slice(None))
            for model in (plain, plain32) if model is not None]
    runs.append((sync, hvd.DistributedOptimizer(torch.optim.SGD(sync.parameters(), lr=0.005, momentum=0.9),
                                                named_parameters=sync.named_parameters(), op=hvd.Sum), mine))
    losses = [{} for _ in runs]  # per run: {"step 0": loss, ...}
    for step in range(2):
        x_all = torch.from_numpy(global_batch(60 + step, total, (3, SIZE, SIZE)))
        per_image = (SIZE, SIZE) if name.startswith("torchvision") else ()  # segmentation: a class per pixel
        labels = torch.randint(0, 3, (total, *per_image), generator=torch.Generator().manual_seed(step))
        for (model, optim, rows), loss_of in zip(runs, losses):
            optim.zero_grad()
            # this rank's share of the global mean loss; the optimizer sums the shares
            x = x_all[rows].to(next(model.parameters()).dtype)
            loss = F.cross_entropy(logits(model, x), labels[rows], reduction="sum") / labels.numel()
            loss.backward()
            optim.step()
            loss_of[f"step {step}"] = loss.detach()
        ours = losses[-1]
        ours[f"step {step}"] = hvd.allreduce(ours[f"step {step}"], op=hvd.Sum, name=f"test.loss.{name}.{step}")
    # losses[-2]: plain float32's, or alone plain's, as state32
    state32 = (plain if plain32 is None else plain32).state_dict()
    assert_as_accurate(losses[-1], losses[-2], losses[0], f"{name} loss", alone=WORLD == 1)
    assert_as_accurate(sync.state_dict(), state32, plain.state_dict(), f"{name} after 2 SGD steps, rank {RANK} of "
                       f"{sizes}", alone=WORLD == 1)

    state = {k: v.clone() for k, v in sync.state_dict().items()}
    revert_sync_batchnorm(sync)
    assert bn_classes(sync) == classes, "revert did not give the original BN classes back"
    assert [type(m) for m in sync.modules()] == [type(m) for m in plain.modules()]
    for key, value in sync.state_dict().items():
        assert torch.equal(value, state[key]), f"revert changed {key}"


def test_opt_in_for_a_custom_subclass_computes_what_it_did():
    class ScaledBN(nn.BatchNorm2d):
        def __init__(self, c, factor):
            super().__init__(c)
            self.factor = factor

        def forward(self, x):
            return self.factor * super().forward(x)

    class SyncScaledBN(SyncBatchNorm):
        def forward(self, x):
            return self.factor * super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), ScaledBN(4, 3.0))
    ref = copy.deepcopy(model)
    convert_sync_batchnorm(model, classes={ScaledBN: SyncScaledBN})
    assert type(model[1]) is SyncScaledBN and model[1].factor == 3.0
    sizes = shard_sizes(SHARDS, WORLD)
    x_all = torch.from_numpy(global_batch(80, sum(sizes), (3, 4, 4)))
    assert_close(model(x_all[shard_slice(sizes, RANK)]), ref(x_all)[shard_slice(sizes, RANK)], "opted-in subclass")
    assert type(revert_sync_batchnorm(model)[1]) is ScaledBN
    with pytest.raises(TypeError, match="expected classes to map _BatchNorm subclasses to SyncBatchNorm"):
        convert_sync_batchnorm(model, classes={ScaledBN: nn.BatchNorm2d})


