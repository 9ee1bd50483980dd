"""PyTorch SyncBatchNorm over Horovod.

A drop-in for ``nn.BatchNorm1d/2d/3d`` whose batch statistics cover every rank.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from hvd_syncbn import backend
from hvd_syncbn import comm as transport
from hvd_syncbn import transports
from hvd_syncbn.torch import comm as torch_comm
from hvd_syncbn.torch import device

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_layer_ids = itertools.count()


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
_CENTRED_FROM = 1 << 15  # values; below, the native statistics kernel is as fast on CPU


_TORCH_OPS = device.TORCH_OPS


def _host(t: Tensor) -> np.ndarray:
    """A per-channel tensor as a numpy array: zero-copy for float32/float64 on the CPU,
    other dtypes (a model cast to bfloat16 or float16) as float32."""
    t = t.detach()
    return (t if t.dtype in _NUMPY else t.float()).cpu().numpy()


def _to(arr: np.ndarray, like: Tensor, dtype: torch.dtype) -> Tensor:
    """A numpy per-channel vector as a ``dtype`` tensor on ``like``'s device."""
    return torch.from_numpy(np.asarray(arr, dtype=_NUMPY[dtype])).to(like.device)


_call = device.call


def _allreduce_sum(layer: "SyncBatchNorm", comm: transport.Communicator, x: Tensor) -> backend.AllreduceSum:
    return lambda buf, direction: transport.allreduce(comm, buf, _call(layer, comm, direction, x))


def _local_moments(x: Tensor, acc: torch.dtype, shift: Optional[Tensor] = None) -> tuple[np.ndarray, np.ndarray]:
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
    dims, channels = device.reduced_dims(x), x.shape[1]
    if x.numel() == 0:
        return np.zeros(channels), np.zeros(channels)
    rows = x.numel() // channels
    if x.dtype == acc and x.dim() > 2 and x.numel() >= _CENTRED_FROM and x.is_contiguous():
        mean_h = var_h = None
        if shift is not None:
            total, squares = _shifted_sums(x, shift)
            offset, mean_square = total / rows, squares / rows
            if (offset * offset <= 0.5 * mean_square).all():  # |mean − shift| <= std, and no NaN
                mean_h, var_h = _host(shift) + offset, mean_square - offset * offset
        if mean_h is None:
            mean = x.sum(dims).div_(rows)
            mean_h, var_h = _host(mean), _shifted_sums(x, mean)[1] / rows
    else:
        if x.dtype == acc:
            mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        else:  # mixed precision: float32 buffers make the native kernel accumulate in float32
            scratch = torch.zeros(2, channels, dtype=acc, device=x.device)
            mean, var = torch.batch_norm_update_stats(x, scratch[0], scratch[1], 0.0)
        mean_h, var_h = _host(mean), _host(var)
    if acc != torch.float64 and backend.needs_float64(backend.NUMPY_OPS, mean_h, var_h):
        _, mean, var = backend.local_moments(_TORCH_OPS, x, dims)
        return _host(mean), _host(var)
    return mean_h, var_h


def _shifted_sums(x: Tensor, shift: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``Σc`` and ``Σc²`` of ``c = x − shift``, in float64 on the host: one
    pass for ``c``, one for both sums, by the gradient kernel's ``Σdy`` and
    ``Σdy·(x − m)·invstd`` with ``dy = x = c``, m 0 and invstd 1."""
    centred = x - device.per_channel(shift, x)  # (N, C, *)
    zeros, ones = torch.zeros_like(shift), torch.ones_like(shift)
    _, squares, total = torch.ops.aten.native_batch_norm_backward(
        centred, centred, None, None, None, zeros, ones, True, 0.0, [False, True, True]
    )
    return _host(total).astype(np.float64), _host(squares).astype(np.float64)


class _SyncBatchNormFn(torch.autograd.Function):
    """Normalise with global statistics; backward with one packed allreduce.

    The per-channel vectors (moments, sums, coefficients) live on the host in numpy
    float64, where small ops are cheaper than framework dispatches; only the passes over
    the data run in torch.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, layer, comm):  # noqa: D401 - autograd API
        acc = layer._acc_dtype(x)
        try:
            layer._check_input_dim(x)
        except ValueError as e:  # bad input: every rank fails together, not this one alone
            transport.poison(comm, _call(layer, comm, "fwd", x), str(e))
        try:
            guess = layer._mean_guess  # the previous global mean, to centre on
            usable = guess is not None and guess.dtype == acc and guess.device == x.device
            mean, var = _local_moments(x, acc, guess if usable else None)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: release the peers, raise it here
            transport.poison(comm, _call(layer, comm, "fwd", x), f"{layer.layer_name}: {type(e).__name__}: {e}",
                             transport.SyncBatchNormError, cause=e)
        count = np.array([_rows(x)], dtype=np.float64)
        total, g_mean, g_var = backend.sync_moments(backend.NUMPY_OPS, _allreduce_sum(layer, comm, x), count, mean, var)
        n = float(total[0])
        backend.check_global_count(layer.layer_name, n, training=True)
        if layer.check_finite:
            backend.check_finite(layer.layer_name, bool(np.isfinite(g_mean).all() and np.isfinite(g_var).all()))
        momentum = layer._momentum_now(n)
        if momentum is not None:
            with torch.no_grad():
                for buf, new in ((layer.running_mean, g_mean), (layer.running_var, backend.unbiased(g_var, total))):
                    buf.copy_(torch.from_numpy(backend.ema(_host(buf), new, 1 - momentum)))
        invstd = 1.0 / np.sqrt(g_var + layer.eps)
        mean_t, var_t = _to(g_mean, x, acc), _to(g_var, x, acc)
        layer._mean_guess = mean_t if np.isfinite(g_mean).all() else None
        # The native inference kernel normalises with the global statistics; it takes
        # float16 input with float32 statistics only if the affine parameters are float32 too.
        w, b = (p if p is None or p.dtype == acc else p.to(acc) for p in (weight, bias))
        y = torch.batch_norm(x, w, b, mean_t, var_t, False, 0.0, layer.eps, torch.backends.cudnn.enabled)
        ctx.save_for_backward(x, weight, mean_t, var_t, _to(invstd, x, acc))
        ctx.layer, ctx.comm, ctx.total, ctx.invstd = layer, comm, total, invstd
        return y

    @staticmethod
    @once_differentiable  # the sums pass through numpy: a second derivative would be silently wrong
    def backward(ctx, dy):
        x, weight, mean, var, invstd = ctx.saved_tensors
        layer = ctx.layer
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if x.numel() == 0:
            sum_dy_xhat = sum_dy = torch.zeros(x.shape[1], dtype=mean.dtype, device=x.device)
        else:
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, None, None, None, mean, invstd, True, layer.eps, [False, True, True]
            )
        dx = None
        if need_x:
            g_dy, g_dy_xhat = backend.sync_grad_sums(
                backend.NUMPY_OPS, _allreduce_sum(layer, ctx.comm, x), _host(sum_dy), _host(sum_dy_xhat))
            w = None if weight is None else _host(weight)
            k, s, t = backend.input_grad_coeffs(backend.NUMPY_OPS, ctx.total, ctx.invstd, w, g_dy, g_dy_xhat)
            # s·x̂ + t through the native kernel (it normalises x with mean/var), then + k·dy.
            dx = torch.batch_norm(x, _to(s, x, mean.dtype), _to(t, x, mean.dtype), mean, var, False, 0.0,
                                  layer.eps, torch.backends.cudnn.enabled)
            dx = dx.addcmul_(dy, device.per_channel(_to(k, x, mean.dtype).to(x.dtype), x))
        dw = sum_dy_xhat.to(weight.dtype) if need_w else None
        db = sum_dy.to(weight.dtype) if need_b else None
        return dx, dw, db, None, None


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalization whose statistics cover the global batch of all Horovod ranks.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    The mean and variance are taken per channel over the rows of *every* rank in
    ``process_set``; ranks may hold different numbers of rows, zero included. Each
    training step makes one allreduce in the forward pass and one in the backward pass,
    over Horovod, MPI or ``torch.distributed`` (see ``comm``). Alone (no transport, or one
    rank), or in eval mode with running statistics, it is exactly ``nn.BatchNorm`` and
    makes no collective call. An empty global batch leaves the running statistics and
    ``num_batches_tracked`` as they were. NaN/Inf inputs propagate as in ``nn.BatchNorm``
    unless ``check_finite``. When ranks disagree (see :mod:`hvd_syncbn.comm`) every rank
    raises :class:`~hvd_syncbn.comm.SyncBatchNormError` within the timeout.

    Args:
        num_features: ``C`` from an input of size ``(N, C, *)``.
        eps: added to the variance for numerical stability. Default: 1e-5.
        momentum: weight of the new batch in the running statistics (``None`` for a
            cumulative average). This is not optimizer momentum: PyTorch's BN momentum
            is ``1 −`` Keras's. Default: 0.1.
        affine: learnable ``γ`` and ``β``. Default: ``True``.
        track_running_stats: keep running mean/variance (unbiased, from the global
            count) for eval mode; if ``False`` batch statistics are used always.
            Default: ``True``.
        process_set: Horovod process set to synchronise within. Default: all ranks.
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.
        bias: learnable ``β`` when ``affine``. Default: ``True``.
        name: collective name of this layer; must be the same on every rank. Default:
            the module path given by :func:`convert_sync_batchnorm`, else
            ``SyncBatchNorm_<k>`` in construction order.
        comm: how statistics travel: ``"horovod"``, ``"mpi"`` (mpi4py, under mpirun),
            ``"torch"`` (the default ``torch.distributed`` group, or ``process_set`` as a
            group; with no process group, a private one built over MPI or Horovod) or
            ``"auto"``: torch if a process group exists, else MPI under mpirun with
            mpi4py, else Horovod. Default: ``$HVD_SYNCBN_COMM``, else ``"auto"``.
        check_finite: raise ``ValueError`` on every rank, before any update, when the
            global statistics are not finite (NaN/Inf in some rank's input). Default: ``False``.
        stats: where the per-channel statistics are computed between the passes over the
            data: ``"host"`` (numpy, fastest for CPU tensors in eager mode), ``"device"``
            (tensors on the input's device, no host read, traceable by ``torch.compile``;
            its checks are deferred to :func:`~hvd_syncbn.torch.check`) or ``"auto"``:
            the device for CUDA inputs and under ``torch.compile``, else the host.
            Default: ``$HVD_SYNCBN_STATS``, else ``"auto"``.

    Shape:
        - Input: ``(N, C, *)``, any memory format; ``N`` may differ per rank, even 0.
        - Output: same shape and dtype as the input.

    Examples::

        >>> hvd.init()
        >>> bn = hvd_syncbn.torch.SyncBatchNorm(64)
        >>> y = bn(torch.randn(2, 64, 32, 32))
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: Any = None,
        device: Any = None,
        dtype: Optional[torch.dtype] = None,
        *,
        bias: bool = True,
        name: Optional[str] = None,
        comm: Optional[str] = None,
        check_finite: bool = False,
        stats: Optional[str] = None,
    ) -> None:
        _check_args(num_features, eps, momentum)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self._init_sync(process_set, name, comm, check_finite, stats)

    def _init_sync(self, process_set: Any, name: Optional[str], comm: Optional[str], check_finite: bool,
                   stats: Optional[str] = None) -> None:
        """Set what this class adds to ``_BatchNorm`` (also for a layer made by conversion)."""
        transports.requested_kind(comm)
        self.process_set = process_set
        self.layer_name = name or f"SyncBatchNorm_{next(_layer_ids)}"
        self.comm = comm
        self.check_finite = bool(check_finite)
        self.stats = _stats_choice(stats)
        self._mean_guess: Optional[Tensor] = None  # last global batch mean (see _local_moments)
        like = next((t for t in (self.weight, self.running_mean) if t is not None), None)
        self.register_buffer("_sync_errors", torch.zeros(3, dtype=torch.bool, device=None if like is None
                                                         else like.device), persistent=False)

    _SYNC_ATTRIBUTES = ("process_set", "layer_name", "comm", "check_finite", "stats", "_mean_guess")
    """What :meth:`_init_sync` sets (and the ``_sync_errors`` buffer); reverting to plain BN drops these."""

    def train(self, mode: bool = True) -> "SyncBatchNorm":
        """As ``nn.Module.train``, then raise the device path's deferred errors of this
        layer (:func:`~hvd_syncbn.torch.check`)."""
        super().train(mode)
        device.check(self)
        return self

    def _check_input_dim(self, input: Tensor) -> None:
        backend.check_input(
            self.layer_name, input.shape, 1, self.num_features,
            input.is_floating_point() and not input.is_complex(), input.dtype, "x.float()",
        )

    def _acc_dtype(self, x: Tensor) -> torch.dtype:
        params = self.weight if self.weight is not None else self.running_mean
        if params is not None and params.dtype not in _LOW_PRECISION:
            return params.dtype
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def _resolve_comm(self, nccl: bool = False) -> Optional[transport.Communicator]:
        return torch_comm.resolve(self.comm, self.process_set, self.layer_name, nccl)

    def _comm(self, nccl: bool = False) -> Optional[transport.Communicator]:
        """The communicator of this call, or ``None`` when this process is alone; ``nccl``:
        CUDA tensors on the device path (see :func:`hvd_syncbn.torch.comm.resolve`)."""
        comm = device.traced_comm(self, nccl) if torch.compiler.is_compiling() else self._resolve_comm(nccl)
        return comm if comm is not None and comm.size > 1 else None

    def _momentum_now(self, count: float) -> Optional[float]:
        """Count the batch (unless the global batch was empty) and return the weight of
        the new statistics, or ``None`` to leave the running statistics alone."""
        if not (self.training and self.track_running_stats) or count == 0:
            return None
        self.num_batches_tracked.add_(1)
        return self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)

    def forward(self, input: Tensor) -> Tensor:
        comm, on_device = None, False
        if self.training or not self.track_running_stats:  # synchronized
            on_device = self.stats == "device" or self.stats == "auto" and (
                input.device.type != "cpu" or torch.compiler.is_compiling())
            comm = self._comm(on_device and input.device.type == "cuda")
        if comm is not None:
            if on_device:
                return device.forward(self, input, comm, self._acc_dtype(input))
            return _SyncBatchNormFn.apply(input, self.weight, self.bias, self, comm)
        rows = _rows(input) if self.training else None
        if rows is not None and (self.check_finite or rows < 2):
            # alone as across ranks: a lone row raises, an empty batch counts nothing
            self._check_input_dim(input)
            backend.check_global_count(self.layer_name, rows, training=True)
            if self.check_finite:
                backend.check_finite(self.layer_name, bool(torch.isfinite(input).all()))
            if rows == 0:
                return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return super().forward(input)  # plain BN: the native fast path; it checks the input

    def extra_repr(self) -> str:
        return super().extra_repr() + f", name={self.layer_name!r}"


def _rows(x: Tensor) -> int:
    """Rows per channel of ``(N, C, *)`` (0 for an empty or malformed input)."""
    return x.numel() // x.shape[1] if x.dim() > 1 and x.shape[1] else 0


STATS_ENV = "HVD_SYNCBN_STATS"


def _stats_choice(stats: Optional[str]) -> str:
    """``stats``, else ``$HVD_SYNCBN_STATS``, else ``"auto"``, checked."""
    value = stats if stats is not None else os.environ.get(STATS_ENV, "auto")
    if value not in ("auto", "host", "device"):
        where = "stats" if stats is not None else f"${STATS_ENV}"
        raise ValueError(f"SyncBatchNorm: expected {where} to be 'auto', 'host' or 'device', got {value!r}")
    return value


def _check_args(num_features: Any, eps: Any, momentum: Any) -> None:
    if not isinstance(num_features, int) or num_features <= 0:
        raise ValueError(f"SyncBatchNorm: expected num_features to be a positive int, got {num_features!r}")
    backend.check_args("SyncBatchNorm", eps, momentum, momentum_none=True)
