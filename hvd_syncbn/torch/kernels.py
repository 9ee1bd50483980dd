"""The passes over the data of a step (:mod:`hvd_syncbn.torch.device`): two kernel sets,
and the constants and layout helpers they share.

- :class:`Native`: torch's fused batch-norm kernels, those ``torch.nn.SyncBatchNorm``
  uses (``batch_norm_update_stats``: the per-channel Welford mean and variance,
  ``batch_norm_elemt``, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``):
  8 touches of input-sized tensors per step;
- :class:`Composite`: generic ops, for every device (the CPU's): the local sums of
  ``x − mean`` by the native backward kernel, 12 touches.

``$HVD_SYNCBN_KERNELS`` (``auto``, ``native`` or ``composite``) chooses; ``auto`` takes the
native set where the input's device has its kernels (CUDA), else the composite. The
local ``mean`` and ``var`` are in the accumulation dtype; the native set's by Welford, as
CUDA returns them (``docs/design.md`` bounds what that costs at large offsets).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch._prims_common import suggest_memory_format

NAN = float("nan")

_cache: Dict[Any, Tensor] = {}
_fake_caches: "weakref.WeakKeyDictionary[Any, Dict[Any, Tensor]]" = weakref.WeakKeyDictionary()
_MODES = torch._C._TorchDispatchModeKey


def cached(key: Any, make: Callable[[], Tensor]) -> Tensor:
    """A constant tensor, made by ``make`` once per process and ``key`` and reused by
    every later step; under ``torch.compile`` or a tracer (``make_fx``, ``torch.export``)
    made in the graph (a constant there), each time; under a ``FakeTensorMode`` alone
    made fake, once per mode (a fake tensor belongs to its mode)."""
    if torch.compiler.is_compiling():
        return make()
    cache = _cache
    if torch._C._len_torch_dispatch_stack():  # under a dispatch mode: a tracer's, fake tensors' or another
        get_mode = torch._C._get_dispatch_mode
        if get_mode(_MODES.PROXY) is not None or get_mode(_MODES.FUNCTIONAL) is not None:
            return make()
        fake = get_mode(_MODES.FAKE)
        if fake is not None:
            cache = _fake_caches.setdefault(fake, {})
    found = cache.get(key)
    if found is None:
        with torch.inference_mode(False):  # usable by later steps outside inference mode
            found = cache[key] = make()
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


KERNELS_ENV = "HVD_SYNCBN_KERNELS"


def cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``t`` in ``dtype`` (``None`` stays): no call where it already is (each costs host time)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def constant(values: Tuple[float, ...], device: torch.device, dtype: torch.dtype = torch.float64) -> Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, by fills: no copy from host memory
    (``t[i] = v`` is one on CUDA, from a CPU scalar, and a sync)."""

    def make() -> Tensor:
        t = torch.empty(len(values), dtype=dtype, device=device)
        for i, v in enumerate(values):
            t[i].fill_(v)
        return t

    key = tuple("nan" if v != v else v for v in values)  # NaN equals nothing, itself included: not as a key
    return cached(("values", key, device, dtype), make)


def moments_buffer(seed: Tensor, mean: Tensor, var: Tensor, rows: int, shift: Optional[Tensor] = None) -> Tensor:
    """``[seed | −n·mean | −n·(var + mean²)]`` in float64 (the seed's dtype; its last value,
    1, becomes ``−n``) from this rank's ``mean`` and ``var`` of ``rows`` rows, with ``shift``
    added back to ``mean`` first where given (it rides at the end of the cat, cast with
    the rest, and is cut off: the buffer starts its storage). Three ops (four with a shift)."""
    channels, start = mean.numel(), seed.numel()
    buf = torch.cat([seed, mean, var] + ([] if shift is None else [shift]))
    mean, square = buf[start:start + channels], buf[start + channels:start + 2 * channels]
    if shift is not None:
        mean.add_(buf[start + 2 * channels:])
        buf = buf[:start + 2 * channels]
    square.addcmul_(mean, mean)  # var + mean²
    buf[start - 1:].mul_(-rows)
    return buf


def sums_buffer(seed: Tensor, neg_sum: Tensor, neg_squares: Tensor, rows: int, shift: Tensor) -> Tensor:
    """The buffer of :func:`moments_buffer`, ``[seed | −Σx | −Σx²]`` with the seed's 1 become
    ``−n``, from this rank's ``−Σc`` and ``−Σc²`` of ``c = x − shift`` over ``rows`` rows:
    ``−Σx = −Σc − n·shift`` and ``−Σx² = −Σc² − 2·shift·Σc − n·shift²`` in float64 (exact
    enough where ``shift`` is near the mean: ``Σc`` is then small). Four ops."""
    channels, start = shift.numel(), seed.numel()
    buf = torch.cat([seed, neg_sum, neg_squares, shift])
    total, squares, shift = buf[start:start + channels], buf[start + channels:start + 2 * channels], buf[-channels:]
    squares.addcmul_(shift, total, value=2.0).addcmul_(shift, shift, value=-float(rows))
    total.sub_(shift, alpha=float(rows))
    buf = buf[:start + 2 * channels]
    buf[start - 1:start].mul_(-rows)
    return buf


class Composite:
    """The passes over the data by generic ops (every device): the local moments of
    ``x − shift`` by the native backward kernel (``var_mean`` for other layouts than
    channels-first), ``y`` and ``s·x̂ + t`` by the inference kernel, the
    gradient sums by the native backward kernel; 12 touches of input-sized tensors."""

    name = "composite"

    @staticmethod
    def acc(x: Tensor, params: torch.dtype) -> torch.dtype:
        """The statistics' dtype: on the CPU the layer's (``params``); elsewhere the
        accumulation dtype of ``x`` (:meth:`Native.acc`), the only one CUDA's batch-norm
        kernels take for the statistics."""
        return params if x.device.type == "cpu" else Native.acc(x, params)

    @staticmethod
    def local(x: Tensor, seed: Tensor, acc: torch.dtype) -> Tensor:
        """This rank's forward buffer. Channels-first input: the sums of ``c = shift − x``,
        ``shift`` this rank's mean in ``acc``, by the native backward kernel with ``dy = x =
        c``, mean 0 and invstd −1 (``−Σc²`` and ``Σ(shift − x)`` in one fused pass: on the
        CPU 5-18x ``var_mean``'s speed); other layouts (whose CPU kernel sums less exactly):
        ``var_mean`` of ``x − shift``, ``shift`` one row of ``x``. The kernel is given ``γ = 1``:
        CUDA's makes the gradients of ``γ`` and ``β`` with ``γ``'s options (and its
        channels-last kernel returns them ``(0,)``-shaped without it)."""
        rows, channels = x.numel() // x.shape[1], x.shape[1]
        if rows == 0:  # zeros that depend on x, so that a compiler keeps the collective after the data
            shift = mean = var = x.sum(reduced_dims(x))
        elif x.is_contiguous():
            shift = x.mean(reduced_dims(x), dtype=acc)  # (C,)
            c = per_channel(shift, x) - x
            zeros = cached(("mean 0", channels, acc, x.device), lambda: torch.zeros(channels, dtype=acc, device=x.device))
            minus = cached(("invstd -1", channels, acc, x.device), lambda: torch.full((channels,), -1.0, dtype=acc,
                                                                                   device=x.device))
            _, neg_squares, neg_sum = torch.ops.aten.native_batch_norm_backward(
                c, c, ones(channels, acc, x.device), None, None, zeros, minus, True, 0.0,
                [False, True, True])  # −Σc², Σ(shift − x)
            return sums_buffer(seed, neg_sum, neg_squares, rows, shift)
        else:
            shift = cast(x[(0, slice(None)) + (0,) * (x.dim() - 2)], acc)  # (C,)
            var, mean = torch.var_mean(x - per_channel(shift, x), reduced_dims(x), correction=0)
        return moments_buffer(seed, mean, var, rows, shift)

    @staticmethod
    def normalize(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], stats: Tensor, invstd: Tensor,
                  eps: float) -> Tensor:
        """``weight·(x − mean)·invstd + bias`` by the inference kernel (one op)."""
        return torch.ops.aten._native_batch_norm_legit_no_training(x, weight, bias, *stats.unbind(), 0.0, eps)[0]

    @staticmethod
    def grad_sums(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor, eps: float,
                  acc: torch.dtype) -> Tuple[Tensor, ...]:
        """This rank's ``Σdy`` and ``Σdy·x̂`` (``acc``), then the gradients of ``γ`` and ``β``
        (the same sums)."""
        if x.numel() == 0:  # zeros from dy: constants would let a compiler move the collective before the data
            sum_dy_xhat = sum_dy = dy.sum(reduced_dims(x), dtype=acc)
        else:
            gamma = ones(x.shape[1], acc, x.device) if weight is None else weight  # CUDA's kernel takes no None
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, gamma, None, None, stats[0], invstd, True, eps, [False, True, True])
        return sum_dy, sum_dy_xhat, sum_dy_xhat, sum_dy

    @staticmethod
    def input_grad(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor, means: Tensor,
                   eps: float) -> Tensor:
        """``dx = k·dy + s·x̂ + t`` (:func:`~hvd_syncbn.backend.input_grad_coeffs`), ``k = γ·invstd``,
        from ``means`` = ``[Σdy, Σdy·x̂]/−N`` (``(2, C)``, accumulation dtype; in place)."""
        k = invstd if weight is None else invstd * weight
        t, s = means.mul_(k).unbind()
        dx = Composite.normalize(x, s, t, stats, invstd, eps)  # s·x̂ + t
        return dx.addcmul_(dy, per_channel(cast(k, dx.dtype), x))


class Native:
    """torch's fused batch-norm kernels (CUDA; those ``torch.nn.SyncBatchNorm`` uses):
    8 touches of input-sized tensors per step (``1 + 2 + 2 + 3``). Their contracts
    (``aten/src/ATen/native/cuda/Normalization.cu``): statistics in the accumulation
    dtype of the input (float32 for half, bfloat16 and float32, else float64); ``γ`` and
    ``β`` in that dtype too (or the input's, which the backward's elementwise kernel
    refuses for half inputs); no empty input (a channels-last kernel would launch an
    empty grid); the elementwise backward reads ``x`` in ``dy``'s layout; its count is
    int32, and it divides the sums by the count's sum."""

    name = "native"
    OPS = ("batch_norm_update_stats", "batch_norm_elemt", "batch_norm_backward_reduce", "batch_norm_backward_elemt")

    @staticmethod
    def acc(x: Tensor, params: torch.dtype) -> torch.dtype:
        """The kernels' accumulation dtype of ``x`` (CUDA's ``acc_type``)."""
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    @staticmethod
    def local(x: Tensor, seed: Tensor, acc: torch.dtype) -> Tensor:
        rows = x.numel() // x.shape[1]
        if rows == 0:  # zeros that depend on x, as Composite.local's
            mean = var = x.sum(reduced_dims(x))
        else:
            mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        return moments_buffer(seed, mean, var, rows)

    @staticmethod
    def normalize(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], stats: Tensor, invstd: Tensor,
                  eps: float) -> Tensor:
        if x.numel() == 0:
            return torch.empty_like(x)
        return torch.batch_norm_elemt(x, weight, bias, stats[0], invstd, eps)

    @staticmethod
    def grad_sums(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor, eps: float,
                  acc: torch.dtype) -> Tuple[Tensor, ...]:
        """This rank's ``Σdy`` and ``Σdy·(x − mean)`` (``acc``), then the gradients of ``γ``
        and ``β`` (``weight``'s dtype; ``None`` without it)."""
        if x.numel() == 0:
            zeros = dy.sum(reduced_dims(x), dtype=acc)
            return zeros, zeros, zeros, zeros
        dy, x = same_layout(dy, x)
        has_weight = weight is not None
        return torch.batch_norm_backward_reduce(dy, x, stats[0], invstd, weight, True, has_weight, has_weight)

    @staticmethod
    def input_grad(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor, means: Tensor,
                   eps: float) -> Tensor:
        """``dx`` by the elementwise backward kernel from ``means`` = ``[Σdy, Σdy·(x − mean)]/−N``:
        sums over a global batch of ``−1`` rows, so that the kernel's division by its
        count's sum gives the sums over ``N`` back."""
        if x.numel() == 0:
            return torch.empty_like(x)
        dy, x = same_layout(dy, x)
        minus_one = constant((-1,), x.device, torch.int32)
        return torch.batch_norm_backward_elemt(dy, x, stats[0], invstd, weight, means[0], means[1], minus_one)


def same_layout(dy: Tensor, x: Tensor) -> Tuple[Tensor, Tensor]:
    """``dy`` and ``x`` in one memory format, ``x``'s suggested one: CUDA's elementwise
    backward picks its kernel by ``dy``'s layout and reads ``x`` in it. No op where both
    already are (asked first of both contiguous: the common case, in a fraction of the
    memory-format query's time)."""
    if x.is_contiguous() and dy.is_contiguous():
        return dy, x
    fmt = suggest_memory_format(x)
    return dy.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt)


KERNEL_SETS = {k.name: k for k in (Native, Composite)}


@functools.lru_cache(maxsize=None)
def missing_kernels(device_type: str) -> Tuple[str, Tuple[str, ...]]:
    """The dispatch key of ``device_type`` and the native set's ops that have no kernel for
    it (asked once per process: ``missing_kernels.cache_clear()`` after registering one)."""
    key = {"meta": "Meta", "mps": "MPS"}.get(device_type, device_type.upper())
    return key, tuple(op for op in Native.OPS if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key))


@torch.compiler.assume_constant_result
def kernels_name(device_type: str) -> str:
    """The kernel set ``$HVD_SYNCBN_KERNELS`` picks for tensors on ``device_type``: ``auto``
    (default) the native set where the device has all its kernels, else the composite."""
    choice = os.environ.get(KERNELS_ENV, "auto") or "auto"
    if choice not in ("auto", "native", "composite"):
        raise ValueError(f"expected ${KERNELS_ENV} to be 'auto', 'native' or 'composite', got {choice!r}")
    if choice == "composite":
        return choice
    key, missing = missing_kernels(device_type)
    if missing and choice == "native":
        raise ValueError(f"${KERNELS_ENV}=native: this torch has no {key} kernel of {', '.join(missing)}; expected "
                         f"tensors on a device that has torch's fused batch-norm kernels (CUDA), got {device_type} "
                         f"tensors (set {KERNELS_ENV} to 'auto' or 'composite' for them)")
    return "composite" if missing else "native"


def kernels_for(device: torch.device) -> Any:
    """The kernel set (:class:`Native` or :class:`Composite`) for tensors on ``device``."""
    return KERNEL_SETS[kernels_name(device.type)]
