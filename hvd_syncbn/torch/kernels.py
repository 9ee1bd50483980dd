"""Helpers of :mod:`hvd_syncbn.torch.device`'s kernel sets: constants made once and kept,
and the per-channel layout of ``(N, C, *)`` tensors."""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch
from torch import Tensor

_cache: Dict[Any, Tensor] = {}


def cached(key: Any, make: Callable[[], Tensor]) -> Tensor:
    """A constant tensor, made by ``make`` once per process and ``key`` and reused by
    every later step; under ``torch.compile`` made in the graph (a constant there), and
    under a ``FakeTensorMode`` (shape propagation) made fake, each time."""
    if torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return make()
    found = _cache.get(key)
    if found is None:
        with torch.inference_mode(False):  # usable by later steps outside inference mode
            found = _cache[key] = make()
    return found


def ones(channels: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``γ`` of a layer without one: the native backward kernels take no ``None`` on CUDA."""
    return cached(("ones", channels, dtype, device), lambda: torch.ones(channels, dtype=dtype, device=device))


def per_channel(v: Tensor, like: Tensor) -> Tensor:
    """``(C,)`` viewed to broadcast against ``(N, C, *)``."""
    return v.view((1, -1) + (1,) * (like.dim() - 2))


def reduced_dims(x: Tensor) -> list:
    """Every dim of ``(N, C, *)`` but the channels."""
    return [0, *range(2, x.dim())]
