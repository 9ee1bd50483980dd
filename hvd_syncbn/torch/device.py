"""The device path of :class:`~hvd_syncbn.torch.SyncBatchNorm`: the steps of
:mod:`hvd_syncbn.backend` as a few fused torch ops on the input's device.

On a GPU every op is a kernel launch, so this path spends ops as it spends collectives:
no host read, no tensor made from Python data after a layer's first step (the identity
header, its expected sum and the ones of a layer without ``γ`` are made once, by fills,
and reused), and 36 dispatched ops per layer step (float32) besides the two collectives
(``tests/unit/test_device.py`` holds it to 40; ``nn.BatchNorm2d`` takes 7).

The forward's buffer, float64, one per layer and step::

    [shift (C) | header (H) | −n | −n·mean | −n·(var + mean²)]
                '--------- summed over the ranks ------------'

- ``shift``: one row of ``x`` per channel; the moments of ``x − shift`` in the
  accumulation dtype, the shift added back in float64, keep the variance accurate at
  large offsets (the backend's buffer, :func:`~hvd_syncbn.backend.pack_moments`, by sign).
- the header (``H = 2``, :func:`hvd_syncbn.comm.header`) where the reducer checks it on
  the device (:class:`~hvd_syncbn.torch.reducers.GroupReducer`); ``H = 0`` where the
  custom op checks it on the host (:class:`~hvd_syncbn.torch.reducers.OpReducer`).
- the negative count makes ``sum / count`` the global moments and ``k / count`` the
  gradient's ``−k/N`` without a negation; ``count`` is clamped at ``−1`` (an empty global
  batch divides by 1) and NaN after a header mismatch, which makes the output NaN and
  leaves the running statistics alone.

The backward's buffer is ``[header (H) | Σdy | Σdy·x̂]``; ``dx = k·dy + s·x̂ + t`` as in
:func:`~hvd_syncbn.backend.input_grad_coeffs`, with ``s·x̂ + t`` by the native inference
kernel. Flags (header mismatch per header value, a global batch of one row, non-finite
statistics with ``check_finite``) go to :mod:`hvd_syncbn.torch.deferred`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from hvd_syncbn.torch.kernels import cached, ones, per_channel, reduced_dims

NAN = float("nan")


def cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """``t`` in ``dtype`` (``None`` stays): no call where it already is (each costs host time)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def constant(values: Tuple[float, ...], device: torch.device) -> Tensor:
    """``values`` as a float64 tensor on ``device``, by fills (no copy from host memory)."""

    def make() -> Tensor:
        t = torch.empty(len(values), dtype=torch.float64, device=device)
        for i, v in enumerate(values):
            t[i] = v
        return t

    return cached(("values", values, device), make)


def seeds(reduce: Any, direction: str, device: torch.device) -> Tuple[Tensor, Tensor]:
    """The head of ``direction``'s buffer (the header, then the count's 1 forward) and
    what the ranks' sum of it must be (the header times the world size, then ``−1``: a
    global batch of one row); ``reduce`` ``None``: no header (nothing crosses processes)."""
    head = () if reduce is None else reduce.head(direction)
    expected = tuple(reduce.size * h for h in head)
    if direction == "fwd":
        head, expected = head + (1.0,), expected + (-1.0,)
    return constant(head, device), constant(expected, device)


def local_buffer(x: Tensor, seed: Tensor, acc: torch.dtype) -> Tensor:
    """``[shift | seed | −n | −n·mean | −n·(var + mean²)]`` of this rank's ``x`` (the seed's
    last value, 1, becomes ``−n``), float64."""
    channels, rows = x.shape[1], x.numel() // x.shape[1]
    if rows == 0:  # zeros that depend on x, so that a compiler keeps the collective after the data
        shift = mean = var = x.sum(reduced_dims(x))
    else:
        shift = x[(0, slice(None)) + (0,) * (x.dim() - 2)]  # (C,)
        shift = cast(shift, acc)
        var, mean = torch.var_mean(x - per_channel(shift, x), reduced_dims(x), correction=0)
    buf = torch.cat([shift, seed, mean, var])  # float64: the seed's dtype
    mean, square = buf[channels + seed.numel():].view(2, channels).unbind()
    mean.add_(buf[:channels])  # the shift added back
    square.addcmul_(mean, mean)  # var + mean²
    buf[channels + seed.numel() - 1:].mul_(-rows)
    return buf


def normalize(x: Tensor, scale: Optional[Tensor], offset: Optional[Tensor], mean: Tensor, var: Tensor,
              eps: float) -> Tensor:
    """``scale·(x − mean)/√(var + ε) + offset`` by the native inference kernel (one op)."""
    return torch.ops.aten._native_batch_norm_legit_no_training(x, scale, offset, mean, var, 0.0, eps)[0]


def global_stats(out: Tensor, expected: Tensor, plan: "Plan") -> Tuple[Tensor, Tensor, Tensor]:
    """From the summed forward buffer ``out`` (``[W·header | −N | −Σx | −Σx²]``) and what its
    head must be (``expected``, of :func:`seeds`): the global
    ``(mean, biased var)`` as a ``(2, C)`` tensor in ``plan.acc``, ``−max(N, 1)`` (NaN after
    a header mismatch) and the step's flags (a mismatch per header value, a global batch
    of one row, then non-finite statistics with ``check_finite``)."""
    heads = expected.numel() - 1
    flags = torch.ne(out[:heads + 1], expected)  # [header mismatch (H), N != 1]
    count = out[heads:heads + 1]
    nan = constant((NAN,), out.device)
    count = (torch.where(flags[:heads].any(), nan, count) if heads else count).clamp_max(-1.0)
    moments = out[heads + 1:].view(2, -1) / count  # [mean, E[x²]]
    mean, square = moments.unbind()
    square.addcmul_(mean, mean, value=-1.0).clamp_min_(0.0)  # biased var
    flags[heads:].logical_not_()  # N == 1: a global batch of one row
    if plan.check_finite:
        flags = torch.cat([flags, torch.isfinite(moments).all().logical_not().view(1)])
    return cast(moments, plan.acc), count, flags


def grad_sums(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, plan: "Plan",
              needs: Tuple[bool, bool]) -> Tuple[Tuple[Tensor, Tensor], Tensor, list]:
    """This rank's ``(Σdy, Σdy·x̂)`` (accumulation dtype), ``k = γ·invstd``, and the
    gradients of ``γ`` and ``β`` where ``needs`` them (local: the optimizer sums them)."""
    mean, var = stats.unbind()
    invstd = torch.rsqrt(var + plan.eps)
    gamma = ones(x.shape[1], plan.acc, x.device) if weight is None else cast(weight, plan.acc)
    if x.numel() == 0:  # zeros from dy (the CPU kernel divides by the rows); constants would let a compiler
        sum_dy_xhat = sum_dy = dy.sum(reduced_dims(x), dtype=plan.acc)  # move the collective before the data
    else:
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, gamma, None, None, mean, invstd, True, plan.eps, [False, True, True])
    grads = [cast(s, weight.dtype) if weight is not None and need else None
             for s, need in zip((sum_dy_xhat, sum_dy), needs)]
    return (sum_dy, sum_dy_xhat), invstd if weight is None else invstd * gamma, grads


def input_grad_terms(x: Tensor, sums: Tensor, k: Tensor, count: Tensor, stats: Tensor, plan: "Plan") -> Tensor:
    """``s·x̂ + t`` of :func:`~hvd_syncbn.backend.input_grad_coeffs` from the global
    ``[Σdy | Σdy·x̂]`` (``sums``, ``(2C,)``) and ``count`` (``−N``, or one per header value,
    NaN where it mismatched), by the native inference kernel."""
    t, s = cast(sums.view(2, -1) * (k / count.view(-1, 1)), plan.acc).unbind()  # −k·[Σdy, Σdy·x̂]/N
    return normalize(x, s, t, *stats.unbind(), plan.eps)


class Plan(NamedTuple):
    """What a device-path call needs besides tensors: the summing ``reduce`` (with its
    ``head(direction)`` and ``size``), ``eps``, the accumulation dtype and ``check_finite``."""

    reduce: Any
    eps: float
    acc: torch.dtype
    check_finite: bool


class DeviceFunction(torch.autograd.Function):
    """Normalise with global statistics, one allreduce each way. Returns ``y`` and, not
    differentiable, the global ``(mean, biased var)`` as a ``(2, C)`` tensor in the
    accumulation dtype, ``−max(N, 1)`` (NaN after a header mismatch) and the step's flags
    (:func:`hvd_syncbn.torch.deferred.record`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: Plan):  # noqa: D401 - autograd API
        ctx.set_materialize_grads(False)
        seed, expected = seeds(plan.reduce, "fwd", x.device)
        out = plan.reduce(local_buffer(x, seed, plan.acc)[x.shape[1]:], "fwd")  # [W·header | −N | −Σx | −Σx²]
        stats, count, flags = global_stats(out, expected, plan)
        y = normalize(x, cast(weight, plan.acc), cast(bias, plan.acc), *stats.unbind(), plan.eps)
        ctx.save_for_backward(x, weight, stats, count)
        ctx.plan = plan
        ctx.mark_non_differentiable(stats, count, flags)
        return y, stats, count, flags

    @staticmethod
    @once_differentiable  # the sums are taken outside autograd: a second derivative would be silently wrong
    def backward(ctx, dy, *_):
        x, weight, stats, count = ctx.saved_tensors
        plan = ctx.plan
        dy = torch.zeros_like(x) if dy is None else dy
        (sum_dy, sum_dy_xhat), k, grads = grad_sums(dy, x, weight, stats, plan, ctx.needs_input_grad[1:3])
        if not ctx.needs_input_grad[0]:
            return None, *grads, None
        seed, expected = seeds(plan.reduce, "bwd", x.device)
        heads = seed.numel()
        # float64 by the header's dtype; with no header explicitly (inductor drops an empty tensor from a cat)
        buf = torch.cat([seed, sum_dy, sum_dy_xhat]) if heads else torch.cat([sum_dy, sum_dy_xhat]).double()
        out = plan.reduce(buf, "bwd")  # [W·header | ΣΣdy | ΣΣdy·x̂]
        nan = constant((NAN,), x.device)
        count = torch.where(torch.ne(out[:heads], expected), nan, count) if heads else count  # (H or 1,)
        dx = input_grad_terms(x, out[heads:], k, count, stats, plan)
        return dx.addcmul_(dy, per_channel(cast(k, dx.dtype), x)), *grads, None
