"""The passes over the data of :class:`~hvd_syncbn.torch.SyncBatchNorm`'s host path, for
the driver in :mod:`hvd_syncbn.backend` (:class:`HostKernels`: the per-channel vectors
in numpy float64 on the host, where small ops cost less than framework dispatches; the
passes over the data in torch), torch's ops as ``xp`` (:class:`TorchOps`) and the
layout helpers and cached constants the device path (:mod:`hvd_syncbn.torch.device`) shares.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, NamedTuple, Optional

import numpy as np
import torch
from torch import Tensor

from hvd_syncbn import backend


class TorchOps:
    """:class:`hvd_syncbn.backend.ArrayOps` for torch tensors on any device."""

    concat, maximum, any = staticmethod(torch.cat), staticmethod(torch.clamp_min), staticmethod(torch.any)
    rsqrt = staticmethod(torch.rsqrt)

    @staticmethod
    def wide(x: Tensor) -> Tensor:
        return x.to(torch.float64)

    @staticmethod
    def mul_no_nan(x: Tensor, y: Any) -> Tensor:
        return torch.where(y == 0, 0.0, x * y)

    @staticmethod
    def sum(x: Tensor, axes) -> Tensor:
        return x.sum(list(axes), keepdim=True)

    @staticmethod
    def flat(x: Tensor) -> Tensor:
        return x.reshape(-1)

    @staticmethod
    def where(cond: Tensor, a: Any, b: Any) -> Tensor:
        if not isinstance(a, Tensor):  # a Python number: float64, not torch's default float32
            a = torch.tensor(a, dtype=torch.float64, device=cond.device)
        return torch.where(cond, a, b)

    @staticmethod
    def all_finite(x: Tensor) -> Tensor:
        return torch.isfinite(x).all()

    @staticmethod
    def rows(x: Tensor, axes) -> Tensor:
        return torch.full((1,), math.prod([x.shape[a] for a in axes]), dtype=torch.float64, device=x.device)


TORCH_OPS = TorchOps()


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


class Stats(NamedTuple):
    """The global statistics as the native kernels take them: ``acc`` tensors on the
    input's device."""

    mean: Tensor
    var: Tensor
    invstd: Tensor


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
_CENTRED_FROM = 1 << 15  # values; below, the native statistics kernel is as fast on CPU


def host(t: Tensor) -> np.ndarray:
    """A per-channel tensor as a numpy array: zero-copy for float32/float64 on the CPU,
    other dtypes (a model cast to bfloat16 or float16) as float32."""
    t = t.detach()
    return (t if t.dtype in _NUMPY else t.float()).cpu().numpy()


class HostKernels:
    """:class:`hvd_syncbn.backend.Kernels` of the host path for ``(N, C, *)`` torch tensors,
    accumulating in ``acc``: the per-channel vectors in numpy float64 on the host, the
    passes over the data by PyTorch's native batch-norm kernels given the global
    statistics.

    ``guess``: a guess of the batch mean (the layer's previous global mean) to centre
    the data on; ``fail(problem, cause)``: how a failure of the local pass ends every
    rank's step (joining the collective the peers wait in)."""

    xp = backend.NUMPY_OPS

    def __init__(self, eps: float, acc: torch.dtype, device: torch.device, guess: Optional[Tensor],
                 fail: Callable[[str, BaseException], None]) -> None:
        self.eps, self.acc, self.device, self.guess, self.fail = eps, acc, device, guess, fail

    def vector(self, v: Any, dtype: torch.dtype) -> Tensor:
        """A per-channel numpy vector as a ``dtype`` tensor on the input's device."""
        if dtype in _NUMPY:
            return torch.from_numpy(np.asarray(v, dtype=_NUMPY[dtype])).to(self.device)
        return torch.from_numpy(np.asarray(v, dtype=np.float64)).to(self.device, dtype)

    def wide(self, t: Tensor) -> Any:
        """A per-channel torch tensor as a float64 numpy vector."""
        return host(t).astype(np.float64)

    def moments(self, x: Tensor) -> tuple:
        try:
            mean, var = host_moments(x, self.acc, self.guess)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: release the peers, raise it here
            self.fail(f"{type(e).__name__}: {e}", e)
        return np.array([x.numel() // x.shape[1]], dtype=np.float64), mean, var

    def prepare(self, mean: Any, var: Any) -> Stats:
        invstd = self.xp.rsqrt(var + self.eps)
        return Stats(*(self.vector(v, self.acc) for v in (mean, var, invstd)))

    def normalize(self, x: Tensor, stats: Stats, scale: Optional[Tensor], offset: Optional[Tensor]) -> Tensor:
        # The native inference kernel takes float16 input with float32 statistics only if
        # the affine parameters are float32 too.
        w, b = (p if p is None or p.dtype == self.acc else p.to(self.acc) for p in (scale, offset))
        return torch.batch_norm(x, w, b, stats.mean, stats.var, False, 0.0, self.eps, torch.backends.cudnn.enabled)

    def grad_sums(self, dy: Tensor, x: Tensor, stats: Stats, scale: Any) -> tuple:
        if x.numel() == 0:
            sum_dy_xhat = sum_dy = dy.to(stats.mean.dtype).sum(reduced_dims(x))
        else:  # with a γ of ones: CUDA's kernel takes no None (CPU's does)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, ones(x.shape[1], stats.mean.dtype, x.device), None, None, stats.mean, stats.invstd, True,
                self.eps, [False, True, True])
        return self.wide(sum_dy), self.wide(sum_dy_xhat), None

    def input_grad(self, dy: Tensor, x: Tensor, stats: Stats, coeffs: tuple, kept: Any) -> Tensor:
        # s·x̂ + t through the native kernel (it normalises x with mean/var), then + k·dy.
        (k, s, t), dtype = coeffs, stats.mean.dtype
        dx = torch.batch_norm(x, self.vector(s, dtype), self.vector(t, dtype), stats.mean, stats.var, False, 0.0,
                              self.eps, torch.backends.cudnn.enabled)
        return dx.addcmul_(dy, per_channel(self.vector(k, dtype).to(x.dtype), x))  # in place: no second buffer


def host_moments(x: Tensor, acc: torch.dtype, shift: Optional[Tensor] = None) -> tuple:
    """Local per-channel mean and biased variance of ``(N, C, *)`` on the host: the
    contract of :func:`hvd_syncbn.backend.local_moments`, by faster kernels.

    - Large channels-first contiguous ``acc`` input: the sums of ``c = x − shift`` and
      ``c²`` (:func:`_shifted_sums`). ``shift`` is a guess of the mean (the layer's
      previous global mean); when it is within one standard deviation of this batch's
      mean, ``Σc²/n − (Σc/n)²`` loses at most a factor of 2 to cancellation, else (or
      with no guess) the mean is summed first and the data centred on it.
    - Anything else: the native statistics kernel, accumulating in ``acc``.
    - Where the ``acc`` mean is too coarse (:func:`hvd_syncbn.backend.needs_float64`):
      the reference, in float64.
    """
    if shift is not None and (shift.dtype != acc or shift.device != x.device):
        shift = None
    dims, channels = reduced_dims(x), x.shape[1]
    if x.numel() == 0:
        return np.zeros(channels), np.zeros(channels)
    if x.dtype == acc and x.dim() > 2 and x.numel() >= _CENTRED_FROM and x.is_contiguous():
        mean_h, var_h = _centred_moments(x, dims, shift)
    elif x.dtype == acc:
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        mean_h, var_h = host(mean), host(var)
    else:  # mixed precision: float32 buffers make the native kernel accumulate in float32
        scratch = torch.zeros(2, channels, dtype=acc, device=x.device)
        mean, var = torch.batch_norm_update_stats(x, scratch[0], scratch[1], 0.0)
        mean_h, var_h = host(mean), host(var)
    if acc != torch.float64 and backend.needs_float64(backend.NUMPY_OPS, mean_h, var_h):
        _, mean, var = backend.local_moments(TORCH_OPS, x, dims)
        return host(mean), host(var)
    return mean_h, var_h


def _centred_moments(x: Tensor, dims: list, shift: Optional[Tensor]) -> tuple:
    """Mean and variance from the shifted sums, about ``shift`` if it is close enough."""
    rows = x.numel() // x.shape[1]
    if shift is not None:
        total, squares = _shifted_sums(x, shift)
        offset, mean_square = total / rows, squares / rows
        if (offset * offset <= 0.5 * mean_square).all():  # |mean − shift| <= std, and no NaN
            return host(shift) + offset, mean_square - offset * offset
    mean = x.sum(dims).div_(rows)
    return host(mean), _shifted_sums(x, mean)[1] / rows


def _shifted_sums(x: Tensor, shift: Tensor) -> tuple:
    """Per-channel ``Σc`` and ``Σc²`` of ``c = x − shift``, in float64 on the host: one
    pass for ``c``, one for both sums, by the gradient kernel's ``Σdy`` and
    ``Σdy·(x − m)·invstd`` with ``dy = x = c``, m 0 and invstd 1."""
    centred = x - per_channel(shift, x)  # (N, C, *)
    zeros, ones = torch.zeros_like(shift), torch.ones_like(shift)
    _, squares, total = torch.ops.aten.native_batch_norm_backward(
        centred, centred, None, None, None, zeros, ones, True, 0.0, [False, True, True]
    )
    return host(total).astype(np.float64), host(squares).astype(np.float64)
