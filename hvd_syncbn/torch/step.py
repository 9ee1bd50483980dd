"""One training step (:mod:`hvd_syncbn.torch.device`'s phases): the autograd
Function around its four phases and two collectives.

Eagerly the phases are Python calls. Under ``torch.compile`` each is a custom op
(``hvd_syncbn::forward_local``, ``forward_apply``, ``backward_local``,
``backward_apply``) with a fake implementation: Dynamo and AOTAutograd see four ops and
the collectives per layer step, not the ops inside (a first compile near plain BN's),
and torch's fused kernels, which have no fake (Meta) implementation, never meet fake
tensors. The ops are opaque to inductor, which runs them as they are; the running
update and the flags around them (the module's) it fuses.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch._prims_common import suggest_memory_format
from torch.autograd.function import once_differentiable

from hvd_syncbn import layout
from hvd_syncbn.comm import SyncBatchNormError
from hvd_syncbn.torch.device import Lanes, Plan, backward_apply, backward_local, forward_apply, forward_local
from hvd_syncbn.torch.kernels import KERNEL_SETS


def _plan(eps: float, acc: torch.dtype, check_finite: bool, kernels: str) -> Plan:
    return Plan(None, eps, acc, check_finite, KERNEL_SETS[kernels])


def _lanes(device: torch.device, head: List[float] = (), expected: List[float] = ()) -> Lanes:
    """A custom op's lanes, as tensors (each made once per process and value)."""
    return Lanes(tuple(head), tuple(expected)).on(device)


def _like(t: Tensor, x: Tensor) -> Tensor:
    """``t`` (``x``'s shape) in ``x``'s suggested memory format: what the fake says."""
    return t.contiguous(memory_format=suggest_memory_format(x))


@torch.library.custom_op("hvd_syncbn::forward_local", mutates_args=())
def _forward_local(x: Tensor, head: List[float], eps: float, acc: torch.dtype, kernels: str) -> Tensor:
    return forward_local(x, _lanes(x.device, head), _plan(eps, acc, False, kernels))


@_forward_local.register_fake
def _(x, head, eps, acc, kernels):  # head: the header, then the count's lane
    return x.new_empty(layout.forward_size(x.shape[1], len(head) - 1), dtype=torch.float64)


@torch.library.custom_op("hvd_syncbn::forward_apply", mutates_args=())
def _forward_apply(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], out: Tensor, expected: List[float],
                   eps: float, acc: torch.dtype, check_finite: bool, kernels: str
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    y, stats, invstd, count, flags = forward_apply(x, weight, bias, out, _lanes(x.device, expected=expected),
                                                   _plan(eps, acc, check_finite, kernels))
    return _like(y, x), stats, invstd, count.clone(), flags  # with no header, the count is a view of out


@_forward_apply.register_fake
def _(x, weight, bias, out, expected, eps, acc, check_finite, kernels):
    channels = x.shape[1]
    return (torch.empty_like(x, memory_format=suggest_memory_format(x)), x.new_empty(2, channels, dtype=acc),
            x.new_empty(channels, dtype=acc), x.new_empty((), dtype=torch.float64),
            x.new_empty(len(expected) + check_finite, dtype=torch.bool))


@torch.library.custom_op("hvd_syncbn::backward_local", mutates_args=())
def _backward_local(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor, head: List[float],
                    eps: float, acc: torch.dtype, kernels: str) -> Tuple[Tensor, Tensor]:
    buf, *grads = backward_local(dy, x, weight, stats, invstd, _lanes(x.device, head),
                                 _plan(eps, acc, False, kernels))
    return buf, x.new_empty(0) if weight is None else torch.stack(grads)


@_backward_local.register_fake
def _(dy, x, weight, stats, invstd, head, eps, acc, kernels):
    grads = x.new_empty(0) if weight is None else weight.new_empty(2, x.shape[1])
    return x.new_empty(layout.backward_size(x.shape[1], len(head)), dtype=torch.float64), grads


@torch.library.custom_op("hvd_syncbn::backward_apply", mutates_args=())
def _backward_apply(dy: Tensor, x: Tensor, weight: Optional[Tensor], stats: Tensor, invstd: Tensor, count: Tensor,
                    out: Tensor, expected: List[float], eps: float, acc: torch.dtype, kernels: str) -> Tensor:
    dx = backward_apply(dy, x, weight, stats, invstd, count, out, _lanes(x.device, expected=expected),
                        _plan(eps, acc, False, kernels))
    return _like(dx, x)


@_backward_apply.register_fake
def _(dy, x, weight, stats, invstd, count, out, expected, eps, acc, kernels):
    return torch.empty_like(x, memory_format=suggest_memory_format(x))


def _split(weight: Optional[Tensor], buf: Tensor, grads: Tensor) -> tuple:
    return buf, *((None, None) if weight is None else grads.unbind())


class Traced:
    """Each phase as its custom op takes it (the lanes as lists, the plan as its fields):
    what :class:`DeviceFunction` calls while ``torch.compile`` traces."""

    @staticmethod
    def forward_local(x, fwd, p):
        return _forward_local(x, list(fwd.head), p.eps, p.acc, p.kernels.name)

    @staticmethod
    def forward_apply(x, w, b, out, fwd, p):
        return _forward_apply(x, w, b, out, list(fwd.expected), p.eps, p.acc, p.check_finite, p.kernels.name)

    @staticmethod
    def backward_local(dy, x, w, stats, invstd, bwd, p):
        return _split(w, *_backward_local(dy, x, w, stats, invstd, list(bwd.head), p.eps, p.acc, p.kernels.name))

    @staticmethod
    def backward_apply(dy, x, w, stats, invstd, count, out, bwd, p):
        return _backward_apply(dy, x, w, stats, invstd, count, out, list(bwd.expected), p.eps, p.acc, p.kernels.name)


class Eager:
    """Each phase as a Python call (:mod:`hvd_syncbn.torch.device`)."""

    forward_local, forward_apply = staticmethod(forward_local), staticmethod(forward_apply)
    backward_local, backward_apply = staticmethod(backward_local), staticmethod(backward_apply)


class DeviceFunction(torch.autograd.Function):
    """Normalise with global statistics, one allreduce each way.

    ``layer``: eagerly, the :class:`~hvd_syncbn.torch.SyncBatchNorm` whose flags and
    running statistics the step updates in place (its ``_after_step``); the Function then
    returns ``y`` alone. ``None`` while ``torch.compile`` traces (the phases are then
    :class:`Traced`): it returns ``y`` and, not differentiable, the global
    ``(mean, biased var)`` as a ``(2, C)`` tensor in the accumulation dtype, ``−N`` (NaN
    after a header mismatch) and the step's flags, for the module to apply."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: Plan, layer):  # noqa: D401 - autograd API
        ctx.set_materialize_grads(False)
        phases = Traced if layer is None else Eager
        try:
            buf = phases.forward_local(x, plan.fwd, plan)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: release the peers, raise it here
            if layer is None:
                raise
            plan.reduce.fail(f"{layer.layer_name}: {type(e).__name__}: {e}", SyncBatchNormError, e, plan.raises)
        out = plan.reduce(buf, "fwd")  # [W·header | −N | −Σx | −Σx²]
        y, stats, invstd, count, flags = phases.forward_apply(x, weight, bias, out, plan.fwd, plan)
        ctx.save_for_backward(x, weight, stats, invstd, count)
        ctx.plan, ctx.phases = plan, phases
        if layer is not None:
            layer._after_step(stats, count, flags, plan)
            return y
        ctx.mark_non_differentiable(stats, count, flags)
        return y, stats, count, flags

    @staticmethod
    def backward(ctx, dy, *_):
        if torch.is_grad_enabled():  # create_graph=True: the sums are taken outside autograd, so a
            return _once(ctx, dy)  # second derivative would be silently wrong: it raises instead
        return _backward(ctx, dy)


def _backward(ctx, dy):
    x, weight, stats, invstd, count = ctx.saved_tensors
    plan, phases = ctx.plan, ctx.phases
    if dy is None:
        dy = torch.zeros_like(x)
    buf, grad_weight, grad_bias = phases.backward_local(dy, x, weight, stats, invstd, plan.bwd, plan)
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    if not need_weight:
        grad_weight = None
    if not need_bias:
        grad_bias = None
    if not need_x:
        return None, grad_weight, grad_bias, None, None
    out = plan.reduce(buf, "bwd")  # [W·header | ΣΣdy | ΣΣdy·(x − mean)·s]
    dx = phases.backward_apply(dy, x, weight, stats, invstd, count, out, plan.bwd, plan)
    return dx, grad_weight, grad_bias, None, None


_once = once_differentiable(_backward)
