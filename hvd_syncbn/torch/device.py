"""The device path of :class:`~hvd_syncbn.torch.SyncBatchNorm`: the steps of
:mod:`hvd_syncbn.backend` as a few fused torch ops on the input's device.

On a GPU every op is a kernel launch, so this path spends ops as it spends collectives:
no host read, no tensor made from Python data after a layer's first step (the identity
header, its expected sum and the other constants are made once, by fills, and reused).
Its passes over the data come from one of two kernel sets, the rest (the buffers, their
header, the count, the flags, the running update) written once around them:

- :class:`Native`: torch's fused batch-norm kernels, those ``torch.nn.SyncBatchNorm``
  uses (``batch_norm_update_stats``: the per-channel Welford mean and variance,
  ``batch_norm_elemt``, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``):
  8 touches of input-sized tensors per step, 28 dispatched ops (float32);
- :class:`Composite`: generic ops, for every device: 11 touches, 33 ops.

``$HVD_SYNCBN_KERNELS`` (``auto``, ``native`` or ``composite``) chooses; ``auto`` takes the
native set where the input's device has its kernels (CUDA), else the composite.

The forward's buffer, float64, one per layer and step::

    [header (H) | −n | −n·mean | −n·(var + mean²)]      summed over the ranks

- the local ``mean`` and ``var`` in the accumulation dtype: the composite set's of
  ``x − shift`` (one row of ``x`` per channel) with the shift added back in float64, so
  the variance stays float64-grade at any offset; the native set's by Welford, as CUDA
  returns them (``docs/design.md`` bounds what that costs at large offsets).
- the header (``H = 2``, :func:`hvd_syncbn.comm.header`) where the reducer checks it on
  the device (:class:`~hvd_syncbn.torch.reducers.GroupReducer`); ``H = 0`` where the
  custom op checks it on the host (:class:`~hvd_syncbn.torch.reducers.OpReducer`).
- the negative count makes ``sum / count`` the global moments without a negation; it is
  NaN after a header mismatch, which makes the output NaN and leaves the running
  statistics alone. An empty global batch (``N = 0``) gives NaN statistics that nothing
  reads (with ``check_finite`` the count is clamped at ``−1``: zeros).

The backward's buffer is ``[header (H) | Σdy | Σdy·(x − mean)·s]`` (``s`` the composite
set's ``invstd``, the native set's 1); each set turns the global sums divided by ``−N``
into ``dx``. Flags (header mismatch per header value, a global batch of one row, the
step, non-finite statistics with ``check_finite``) go to :mod:`hvd_syncbn.torch.deferred`.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch._prims_common import suggest_memory_format

from hvd_syncbn.torch import deferred
from hvd_syncbn.torch.kernels import cached, ones, per_channel, reduced_dims

NAN = float("nan")
KERNELS_ENV = "HVD_SYNCBN_KERNELS"


def cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``t`` in ``dtype`` (``None`` stays): no call where it already is (each costs host time)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def constant(values: Tuple[float, ...], device: torch.device, dtype: torch.dtype = torch.float64) -> Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, by fills (no copy from host memory)."""

    def make() -> Tensor:
        t = torch.empty(len(values), dtype=dtype, device=device)
        for i, v in enumerate(values):
            t[i] = v
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
    gradient sums by the native backward kernel; 11 touches of input-sized tensors."""

    name = "composite"

    @staticmethod
    def acc(x: Tensor, params: torch.dtype) -> torch.dtype:
        """The statistics' dtype: the layer's (``params``)."""
        return params

    @staticmethod
    def local(x: Tensor, seed: Tensor, acc: torch.dtype) -> Tensor:
        """This rank's forward buffer. Channels-first input: the sums of ``c = shift − x``,
        ``shift`` this rank's mean in ``acc``, by the native backward kernel with ``dy = x =
        c``, mean 0 and invstd −1 (``−Σc²`` and ``Σ(shift − x)`` in one fused pass: on the
        CPU 5-18x ``var_mean``'s speed); other layouts (whose CPU kernel sums less exactly):
        ``var_mean`` of ``x − shift``, ``shift`` one row of ``x``."""
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
                c, c, None, None, None, zeros, minus, True, 0.0, [False, True, True])  # −Σc², Σ(shift − x)
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
        minus_one = _MINUS_ONE.get(x.device)
        if minus_one is None:
            minus_one = _MINUS_ONE[x.device] = constant((-1,), x.device, torch.int32)
        return torch.batch_norm_backward_elemt(dy, x, stats[0], invstd, weight, means[0], means[1], minus_one)


_MINUS_ONE: dict = {}
"""The native backward's count, ``[−1]`` (int32), by device."""


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


class Lanes(NamedTuple):
    """The lanes of one direction's buffer that the step checks: the ``head`` this rank
    puts in front (the header, then, forward, the count's 1) and what the ranks' sum of
    the checked lanes must be (``expected``: the header times the world size, then,
    forward, ``−1`` (a global batch of one row) and NaN (which the first moment never
    equals: a lane that counts the steps)). As tuples, and as float64 tensors on the
    input's device (:meth:`on`; eagerly made once per layer and input signature)."""

    head: Tuple[float, ...]
    expected: Tuple[float, ...]
    head_t: Optional[Tensor] = None
    expected_t: Optional[Tensor] = None
    nan: Optional[Tensor] = None
    """A 0-dim float64 NaN on the device: what the count becomes after a mismatch."""

    def on(self, device: torch.device) -> "Lanes":
        return self._replace(head_t=constant(self.head, device), expected_t=constant(self.expected, device),
                             nan=constant((NAN,), device).view(()))


def lanes(reduce: Any, direction: str) -> Lanes:
    """``direction``'s :class:`Lanes` over ``reduce`` (``None``: no header, nothing crosses
    processes)."""
    head = () if reduce is None else tuple(reduce.head(direction))
    expected = tuple(reduce.size * h for h in head)
    if direction == "fwd":
        head, expected = head + (1.0,), expected + (-1.0, NAN)
    return Lanes(head, expected)


class Plan(NamedTuple):
    """What a device-path call needs besides tensors: the summing ``reduce`` (with its
    ``head(direction)`` and ``size``), ``eps``, the statistics' dtype, ``check_finite``,
    the ``kernels`` (:class:`Native` or :class:`Composite`), each direction's
    :class:`Lanes`, whether the deferred checks also assert at the step (``asserts``) and
    whether they raise at the step instead (``raises``: CPU tensors in eager mode, where
    a host read costs nothing). Eagerly a layer makes one per input signature and keeps
    it (:func:`plan`): a step then looks nothing up."""

    reduce: Any
    eps: float
    acc: torch.dtype
    check_finite: bool
    kernels: Any = Composite
    fwd: Optional[Lanes] = None
    bwd: Optional[Lanes] = None
    asserts: bool = False
    raises: bool = False


def plan(reduce: Any, eps: float, acc: torch.dtype, check_finite: bool, kernels: Any,
         device: Optional[torch.device] = None, raises: bool = False) -> Plan:
    """A :class:`Plan` with both directions' lanes, as tensors on ``device`` where given
    (eagerly; a traced step hands its custom ops the tuples), and whether the deferred
    checks also assert at the step (:func:`hvd_syncbn.torch.deferred.asserts`)."""
    fwd, bwd = lanes(reduce, "fwd"), lanes(reduce, "bwd")
    if device is not None:
        fwd, bwd = fwd.on(device), bwd.on(device)
    return Plan(reduce, eps, acc, check_finite, kernels, fwd, bwd, deferred.asserts(), raises)


def global_stats(out: Tensor, fwd: Lanes, plan: Plan) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """From the summed forward buffer ``out`` (``[W·header | −N | −Σx | −Σx²]``) and its
    lanes ``fwd``: the global ``(mean, biased var)`` as a ``(2, C)`` tensor in
    ``plan.acc``, ``invstd``, ``−N`` (0-dim; NaN after a header mismatch) and the step's
    flags (:data:`hvd_syncbn.torch.deferred.SLOTS` from the first mismatch: a mismatch per
    header value, ``N ≠ 1``, the step, then non-finite statistics with ``check_finite``).
    Seven ops, and two for ``invstd``."""
    heads = len(fwd.expected) - 2
    flags = torch.ne(out[:heads + 2], fwd.expected_t)  # [header mismatch (H), N != 1, True]
    count = out[heads]
    if heads:
        count = torch.where(flags[:heads].any(), fwd.nan, count)
    if plan.check_finite:  # an empty global batch: zero statistics, which check_finite sees as finite
        count = count.clamp_max(-1.0)
    channels = (out.numel() - heads - 1) // 2
    moments = out.as_strided((2, channels), (channels, 1), out.storage_offset() + heads + 1) / count  # [mean, E[x²]]
    mean, square = moments[0], moments[1]
    square.addcmul_(mean, mean, value=-1.0).clamp_min_(0.0)  # biased var
    if plan.check_finite:
        flags = torch.cat([flags, torch.isfinite(moments).all().logical_not().view(1)])
    stats = cast(moments, plan.acc)
    return stats, torch.rsqrt(stats[1] + plan.eps), count, flags


def backward_buffer(head: Optional[Tensor], sum_dy: Tensor, sum_dy_x: Tensor) -> Tensor:
    """The backward's buffer ``[head | Σdy | Σdy·(x − mean)·s]``, float64."""
    if head is None or not head.numel():  # float64 explicitly: inductor drops an empty tensor from a cat
        return torch.cat([sum_dy, sum_dy_x]).double()
    return torch.cat([head, sum_dy, sum_dy_x])


def global_means(out: Tensor, bwd: Lanes, count: Tensor, acc: torch.dtype) -> Tensor:
    """The summed backward buffer ``out`` (``[W·header | ΣΣdy | ΣΣdy·(x − mean)·s]``) divided
    by the forward's ``count`` (``−N``), as ``(2, C)`` in ``acc``; a row is NaN where its
    header value is not ``bwd.expected``. Three ops (ne, where, addcdiv_)."""
    device, heads = out.device, len(bwd.expected)
    channels = (out.numel() - heads) // 2
    zeros = cached(("zeros", channels, acc, device), lambda: torch.zeros(2, channels, dtype=acc, device=device))
    if heads:
        mismatch = torch.ne(out[:heads], bwd.expected_t).view(-1, 1)
        means = torch.where(mismatch, bwd.nan, zeros)  # in zeros' dtype: a 0-dim NaN does not promote it
    else:
        means = zeros.clone()
    return means.addcdiv_(out[heads:].view(2, -1), count)


def forward_local(x: Tensor, fwd: Lanes, plan: Plan) -> Tensor:
    """This rank's forward buffer ``[head | −n | −n·mean | −n·(var + mean²)]``."""
    return plan.kernels.local(x, fwd.head_t, plan.acc)


def forward_apply(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], out: Tensor, fwd: Lanes,
                  plan: Plan) -> Tuple[Tensor, ...]:
    """From the summed forward buffer ``out``: ``y``, the global ``(mean, biased var)`` as
    ``(2, C)``, ``invstd`` (both in ``plan.acc``), ``−N`` and the step's flags
    (:func:`global_stats`)."""
    stats, invstd, count, flags = global_stats(out, fwd, plan)
    y = plan.kernels.normalize(x, cast(weight, plan.acc), cast(bias, plan.acc), stats, invstd, plan.eps)
    return y, stats, invstd, count, flags


def backward_local(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor,
                   bwd: Lanes, plan: Plan) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """This rank's backward buffer (:func:`backward_buffer` behind ``bwd.head``) and the
    gradients of ``γ`` and ``β`` (``None`` without ``γ``), in ``weight``'s dtype."""
    sum_dy, sum_dy_x, *grads = plan.kernels.grad_sums(dy, x, cast(weight, plan.acc), stats, invstd, plan.eps,
                                                      plan.acc)
    grads = [None] * 2 if weight is None else [cast(g, weight.dtype) for g in grads]
    return backward_buffer(bwd.head_t, sum_dy, sum_dy_x), *grads


def backward_apply(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor, count: Tensor,
                   out: Tensor, bwd: Lanes, plan: Plan) -> Tensor:
    """``dx`` from the summed backward buffer ``out`` (:func:`global_means`)."""
    means = global_means(out, bwd, count, plan.acc)
    return plan.kernels.input_grad(dy, x, cast(weight, plan.acc), stats, invstd, means, plan.eps)
