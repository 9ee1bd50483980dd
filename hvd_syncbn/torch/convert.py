"""Conversion between ``nn.BatchNorm*d`` and :class:`SyncBatchNorm`, in both directions.

Each converted layer keeps all state: parameters, buffers, ``training``, device, dtype
and ``requires_grad``; every other module is left untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .batchnorm import SyncBatchNorm


def _copy_state(src: _BatchNorm, dst: _BatchNorm) -> _BatchNorm:
    with torch.no_grad():
        for name in ("weight", "bias"):
            p = getattr(src, name)
            if p is not None:
                getattr(dst, name).copy_(p)
                getattr(dst, name).requires_grad_(p.requires_grad)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            b = getattr(src, name)
            if b is not None:
                getattr(dst, name).copy_(b)
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def _factory(bn: _BatchNorm) -> dict:
    ref = bn.weight if bn.weight is not None else bn.running_mean
    kwargs = dict(eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
                  track_running_stats=bn.track_running_stats)
    if ref is not None:
        kwargs.update(device=ref.device, dtype=ref.dtype)
    if bn.affine:
        kwargs["bias"] = bn.bias is not None
    return kwargs


def convert_sync_batchnorm(module: nn.Module, process_set: Any = None, _prefix: str = "") -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` by :class:`SyncBatchNorm`.

    Args:
        module: a model, or a single BN layer.
        process_set: Horovod process set the new layers synchronise within.
            Default: all ranks.

    Returns:
        ``module`` with its BN children replaced in place, or the new layer if
        ``module`` itself is a BN layer. Each new layer is named by its module path
        (e.g. ``layer1.0.bn1``), which is also its collective's name.

    Examples::

        >>> model = hvd_syncbn.torch.convert_sync_batchnorm(torchvision_model)
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(module.num_features, process_set=process_set,
                             name=_prefix or None, **_factory(module))
        sync._plain_class = type(module)
        return _copy_state(module, sync)
    for child_name, child in module.named_children():
        new = convert_sync_batchnorm(child, process_set, f"{_prefix}.{child_name}" if _prefix else child_name)
        if new is not child:
            module.add_module(child_name, new)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every :class:`SyncBatchNorm` in ``module`` by plain BN.

    Each layer becomes the class it was converted from, or ``nn.BatchNorm2d`` if it was
    built as a :class:`SyncBatchNorm` (the BN classes differ only in their input check).

    Args:
        module: a model, or a single :class:`SyncBatchNorm`.

    Returns:
        ``module`` with its SyncBN children replaced in place, or the new layer.
    """
    if isinstance(module, SyncBatchNorm):
        plain = getattr(module, "_plain_class", nn.BatchNorm2d)
        return _copy_state(module, plain(module.num_features, **_factory(module)))
    for child_name, child in module.named_children():
        new = revert_sync_batchnorm(child)
        if new is not child:
            module.add_module(child_name, new)
    return module
