"""A step's phases of :class:`~hvd_syncbn.torch.SyncBatchNorm`, on tensors on the input's
device: the local buffer, the global statistics and ``y``, the local gradient sums, and
``dx``, around the collectives (:mod:`hvd_syncbn.torch.step`).

On a GPU every op is a kernel launch, so a step spends ops as it spends collectives: no
host read, no tensor made from Python data after a layer's first step (the identity
header, its expected sum and the other constants are made once, by fills, and reused).
The passes over the data come from a kernel set (:mod:`hvd_syncbn.torch.kernels`); the
rest (the buffers, their header, the count, the flags) is written once around them.

The buffers are :mod:`hvd_syncbn.layout`'s, one per layer, step and direction::

    forward   [header (H) | −n | −n·mean | −n·(var + mean²)]      summed over the ranks
    backward  [header (H) | Σdy | Σdy·(x − mean)·s]

- the header (``H = 2``) where the step checks it
  (:class:`~hvd_syncbn.torch.reducers.GroupReducer`); ``H = 0`` where the transport's
  call checks it on the host (:class:`~hvd_syncbn.torch.reducers.OpReducer`).
- the summed count is made NaN after a header mismatch, which makes the output NaN and
  leaves the running statistics alone. An empty global batch (``N = 0``) gives NaN
  statistics that nothing reads (with ``check_finite`` the count is clamped at ``−1``:
  zeros).
- ``s`` is the composite set's ``invstd``, the native set's 1; each set turns the global
  sums divided by ``−N`` into ``dx``.

Flags (header mismatch per header value, a global batch of one row, the step, non-finite
statistics with ``check_finite``) go to :mod:`hvd_syncbn.torch.deferred` or raise at the
step.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from hvd_syncbn import layout
from hvd_syncbn.torch import deferred
from hvd_syncbn.torch.kernels import NAN, Composite, cached, cast, constant

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
    count = torch.where(flags[:heads].any(), fwd.nan, out[heads]) if heads else out[heads]
    if plan.check_finite:  # an empty global batch: zero statistics, which check_finite sees as finite
        count = count.clamp_max(-1.0)
    moments = out[heads + 1:].view(2, -1) / count  # [mean, E[x²]]
    mean, square = moments.unbind()
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
    channels = layout.channels_of(out.numel(), heads, "bwd")
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
