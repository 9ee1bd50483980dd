"""``nn.DataParallel``'s replicas without a GPU, for the replica tests (the unit tier's
``test_replicas.py`` and the rank-side ``ranks_replicas.py``): made by the seam
DataParallel uses, run in threads as it runs them."""

from __future__ import annotations

import threading

import torch
from torch import nn

from hvd_syncbn.torch import convert_sync_batchnorm


def replicate(network: nn.Module, copies: int) -> list:
    """``copies`` replicas of ``network`` as ``torch.nn.parallel.replicate`` makes them
    (module by module, each module's replicas in a row), sharing its tensors."""
    modules = list(network.modules())
    made = [[None] * len(modules) for _ in range(copies)]
    for i, module in enumerate(modules):
        for j in range(copies):
            made[j][i] = module._replicate_for_data_parallel()
    index = {m: i for i, m in enumerate(modules)}
    for i, module in enumerate(modules):
        for j in range(copies):
            replica = made[j][i]
            for key, child in module._modules.items():
                setattr(replica, key, made[j][index[child]])
            for key, param in module._parameters.items():
                replica.__dict__[key] = param  # not a parameter of the replica: the module's, shared
    return [m[0] for m in made]


def parallel_apply(replicas: list, inputs: list) -> list:
    """Each replica's output, one thread each; a replica's exception as its output."""
    out: list = [None] * len(replicas)

    def run(r):
        try:
            out[r] = replicas[r](inputs[r])
        except BaseException as e:  # noqa: BLE001 - returned
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def net(sync: bool) -> nn.Module:
    """A small CNN with two BN layers (one a cumulative average): converted (float32, the
    device path), or plain in float64, the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5, momentum=None), nn.ReLU())
    return convert_sync_batchnorm(model, stats="device") if sync else model.double()
