"""SyncBatchNorm across the replicas that ``nn.DataParallel`` makes of a layer in one
process, and across processes with one collective per process and direction.

``nn.DataParallel`` copies the model for each of its devices at every forward
(``torch.nn.parallel.replicate``, which calls each module's
``_replicate_for_data_parallel``: the seam; no wrapper class, no patch) and runs the
copies in threads, one per device. The copies of one layer made by one ``replicate``
form a :class:`ReplicaSet`. In the forward each replica computes its local buffer (the
step's, by its kernel set's ``local``); the last to arrive sums
them, sums that over the processes where there are several (the layer's communicator,
one collective), and every replica normalises with the result.

The backward has no meeting point: on one device the autograd engine runs every
replica's backward in one thread, one after the other, so a replica waiting for another
would wait forever. The sums travel through the autograd graph instead, in three
Functions per layer and step:

- :class:`ReplicaNorm` (per replica): ``y`` from the global buffer ``G``; its backward
  keeps ``dy`` for later and gives, as ``G``'s "gradient", this replica's gradient sums
  (a linear stand-in, not the true gradient: the engine sums it over the replicas);
- :class:`ReplicaSum` (one per layer and step): its backward gets that sum once every
  replica's has arrived, sums it over the processes (the backward collective) and hands
  the global sums, divided by ``−N``, to every replica's
- :class:`ReplicaStats`, whose backward gives ``x`` its gradient (the kernel set's
  ``input_grad``, as :class:`~hvd_syncbn.torch.step.DeviceFunction`'s backward).

Replicas run eagerly: under ``torch.compile`` the layer is a graph break
(``torch.compiler.disable``; with ``fullgraph=True`` Dynamo raises, saying so), as
``torch.compile`` cannot trace the meeting of threads.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from hvd_syncbn.comm import SyncBatchNormError, get_timeout
from hvd_syncbn.torch.device import (
    Lanes, Plan, backward_buffer, backward_local, forward_apply, forward_local, global_means,
)
from hvd_syncbn.torch.kernels import cast

_forming: "weakref.WeakKeyDictionary[nn.Module, ReplicaSet]" = weakref.WeakKeyDictionary()


class ReplicaSet:
    """The replicas of one layer made by one ``replicate``: they meet once per call of the
    layer in the forward (``round``), and the last to arrive combines what they brought."""

    def __init__(self, origin: nn.Module) -> None:
        self.origin = weakref.proxy(origin)  # held by _forming, whose weak key it must not keep alive
        self.size, self.started = 0, False
        # Resolved here, in the thread that replicates: a transport's first use is collective.
        like = next((t for t in (origin.weight, origin.running_mean) if t is not None), None)
        self.comm = origin._comm(like is not None and like.device.type == "cuda")
        self.ready = threading.Condition()
        self.rounds: Dict[int, dict] = {}

    def meet(self, rank: int, round: int, item: Any, combine: Callable[[List[Any]], Any], timeout: float) -> Any:
        """``combine`` of every replica's ``item`` of this ``round``, computed once (by the
        last to arrive) and returned to each. A replica that failed brings its exception
        as ``item`` (``combine`` decides what the others learn) and raises it."""
        with self.ready:
            self.started = True
            meeting = self.rounds.setdefault(round, {"items": {}, "result": None})
            meeting["items"][rank] = item
            if len(meeting["items"]) == self.size:
                try:
                    meeting["result"] = (combine([meeting["items"][r] for r in range(self.size)]),)
                except BaseException as e:  # noqa: BLE001 - every replica raises it
                    meeting["result"] = e
                self.ready.notify_all()
            elif not self.ready.wait_for(lambda: meeting["result"] is not None, timeout):
                missing = sorted(set(range(self.size)) - set(meeting["items"]))
                meeting["result"] = SyncBatchNormError(
                    f"{self.origin.layer_name}: DataParallel replicas {missing} of {self.size} did not reach this "
                    f"layer within {timeout:g} s (every replica must call the same SyncBN layers in the same order)")
                self.ready.notify_all()
            result = meeting["result"]
        if isinstance(item, BaseException):
            raise item
        if isinstance(result, BaseException):
            raise SyncBatchNormError(f"{self.origin.layer_name}: another DataParallel replica failed: "
                                     f"{type(result).__name__}: {result}") from result
        return result[0]


def join(origin: nn.Module) -> Tuple[ReplicaSet, int]:
    """The set a new replica of ``origin`` belongs to (a new one once the last has met),
    and its rank in it."""
    current = _forming.get(origin)
    if current is None or current.started:
        current = _forming[origin] = ReplicaSet(origin)
    current.size += 1
    return current, current.size - 1


class State:
    """What one replica's step shares between its Functions: the global statistics
    (forward) and ``dy`` (backward, kept for :class:`ReplicaStats`)."""

    stats: Tensor
    invstd: Tensor
    count: Tensor
    dy: Tensor


@torch.compiler.disable(reason="SyncBatchNorm under nn.DataParallel: its replicas meet in threads, which "
                                "torch.compile cannot trace; the layer runs eagerly, a graph break "
                                "(compile without fullgraph=True)")
def forward(layer: nn.Module, x: Tensor) -> Tensor:
    """A replica's synchronized forward, eager under ``torch.compile`` (a graph break)."""
    replicas, rank = layer._replicas, layer._replica_rank
    reduce = None if replicas.comm is None else layer._reducer(x, replicas.comm)  # over the processes
    round = layer.__dict__["_replica_round"] = layer.__dict__.get("_replica_round", -1) + 1
    state = State()

    def combine(items: List[Any]) -> Tensor:
        failed = next((t for t in items if isinstance(t, BaseException)), None)
        if failed is not None:
            if reduce is not None:  # the other processes' step fails with it too (the transport's diagnosis)
                reduce.fail(f"{type(failed).__name__}: {failed}")
            raise failed
        return ReplicaSum.apply(plan, [s for _, s in items], *(t for t, _ in items))

    try:
        layer._check_input_dim(x)
        plan = layer._make_plan(x, reduce, x.device)
        fwd = plan.fwd
        if rank > 0:  # the header once per process: the others add zeros
            fwd = Lanes((0.0,) * (len(fwd.head) - 1) + (1.0,), fwd.expected).on(x.device)
        tail = ReplicaStats.apply(x, layer.weight, plan, fwd, state)
    except BaseException as e:  # noqa: BLE001 - every replica fails with it
        replicas.meet(rank, round, e, combine, get_timeout())
        raise
    total = replicas.meet(rank, round, (tail, state), combine, get_timeout())
    y, stats, count, flags = ReplicaNorm.apply(x, layer.weight, layer.bias, total.to(x.device), plan, state)
    if rank == 0:  # the module DataParallel keeps gets the flags and the running statistics, once
        replicas.origin._after_step(stats, count, flags, plan)
    return y


class ReplicaStats(torch.autograd.Function):
    """``x`` → this replica's part of the summed buffer, ``[seed | −n | −Σx | −Σx²]``; its
    backward gets the global sums divided by ``−N`` in place of a gradient and returns
    ``x``'s gradient (``weight`` is only read)."""

    @staticmethod
    def forward(ctx, x, weight, plan: Plan, fwd: Lanes, state: State):  # noqa: D401 - autograd API
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.state = plan, state
        return forward_local(x, fwd, plan)

    @staticmethod
    @once_differentiable
    def backward(ctx, means):
        (x, weight), state, plan = ctx.saved_tensors, ctx.state, ctx.plan
        means = means[len(plan.fwd.head):].view(2, -1).to(plan.acc, copy=True)  # each replica's own: used in place
        dx = plan.kernels.input_grad(state.dy, x, cast(weight, plan.acc), state.stats, state.invstd, means, plan.eps)
        return dx, None, None, None, None


class ReplicaSum(torch.autograd.Function):
    """The replicas' buffers summed on the first one's device, then over the processes;
    backward: the replicas' gradient sums summed over the processes and divided by
    ``−N`` (:func:`~hvd_syncbn.torch.device.global_means`), to each replica."""

    @staticmethod
    def forward(ctx, plan: Plan, states: List[State], *tails):  # noqa: D401 - autograd API
        ctx.plan, ctx.states, ctx.devices = plan, states, [t.device for t in tails]
        total = tails[0].clone()
        for t in tails[1:]:
            total += t.to(total.device)
        return total if plan.reduce is None else plan.reduce(total, "fwd")

    @staticmethod
    @once_differentiable
    def backward(ctx, sums):
        plan = ctx.plan
        heads = len(plan.fwd.head)
        local = sums[heads:]  # [Σdy | Σdy·(x − mean)·s], summed over the replicas
        buf = backward_buffer(plan.bwd.head_t, *local.view(2, -1).unbind())
        out = buf if plan.reduce is None else plan.reduce(buf, "bwd")
        means = global_means(out, plan.bwd, ctx.states[0].count, plan.acc)
        grad = torch.cat([sums[:heads], means.view(-1)])
        return None, None, *(grad.to(device) for device in ctx.devices)


class ReplicaNorm(torch.autograd.Function):
    """``y`` from ``x`` and the summed buffer, as :class:`~hvd_syncbn.torch.step.DeviceFunction`
    after its collective; backward: ``dy`` kept for :class:`ReplicaStats`, the gradients
    of ``γ`` and ``β``, and this replica's gradient sums to the buffer."""

    @staticmethod
    def forward(ctx, x, weight, bias, out, plan: Plan, state: State):  # noqa: D401 - autograd API
        ctx.set_materialize_grads(False)
        y, state.stats, state.invstd, state.count, flags = forward_apply(x, weight, bias, out, plan.fwd, plan)
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.state = plan, state
        ctx.mark_non_differentiable(state.stats, state.count, flags)
        return y, state.stats, state.count, flags

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *_):
        x, weight = ctx.saved_tensors
        state, plan = ctx.state, ctx.plan
        state.dy = torch.zeros_like(x) if dy is None else dy
        zeros = Lanes((0.0,) * len(plan.fwd.head), ()).on(x.device)  # the buffer's head gets no gradient
        buf, *grads = backward_local(state.dy, x, weight, state.stats, state.invstd, zeros, plan)
        grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[1:3])]
        return None, *grads, buf, None, None
