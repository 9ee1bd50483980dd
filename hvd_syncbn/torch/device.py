"""The device path of :class:`~hvd_syncbn.torch.SyncBatchNorm`: statistics stay tensors.

Every per-channel vector lives on the input's device, the backend runs with torch ops
(``xp``), and nothing in forward or backward reads a value on the host, so the path
traces whole under ``torch.compile(fullgraph=True)``. The summing allreduce is:

- over ``torch.distributed``: a functional collective on the layer's group (NCCL for
  CUDA tensors, Gloo on the CPU), which Dynamo traces; the buffer carries a static
  identity header ``[h, h²]`` (layer, direction, channels, input rank, dtype) whose
  mismatch raises a deferred flag;
- over any other transport (Horovod, MPI): the custom op ``hvd_syncbn::allreduce``
  around :func:`hvd_syncbn.comm.allreduce`, which keeps the step-counted header, the
  deadline and the diagnosis at run time. CUDA buffers go to the transport as they are
  where it reads device memory (Horovod built with GPU support, NCCL where built so;
  CUDA-aware MPI; :func:`joiner`), else through one copy into pinned host memory: one
  wait for the device per collective.

Checks that would need a host read (a global batch of one row, ``check_finite``, the
static header) set flags in the layer's ``_sync_errors`` buffer instead; the running
statistics are left alone on such a step and the output is NaN after a header mismatch.
:func:`check` raises them, naming the layers; :meth:`SyncBatchNorm.train` and
:meth:`~SyncBatchNorm.eval` call it. With ``$HVD_SYNCBN_DEVICE_ASSERT=1`` (debugging)
each flag is also a ``torch._assert_async`` at the step.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from hvd_syncbn import backend
from hvd_syncbn import comm as transport

MISMATCH, SINGLE_ROW, NON_FINITE = range(3)
"""The flags of a layer's ``_sync_errors``."""


class TorchOps:
    """:class:`hvd_syncbn.backend.ArrayOps` for torch tensors on any device."""

    concat, maximum, any = staticmethod(torch.cat), staticmethod(torch.clamp_min), staticmethod(torch.any)

    @staticmethod
    def wide(x: Tensor) -> Tensor:
        return x.to(torch.float64)

    @staticmethod
    def sum(x: Tensor, axes) -> Tensor:
        return x.sum(list(axes), keepdim=True)

    @staticmethod
    def flat(x: Tensor) -> Tensor:
        return x.reshape(-1)

    @staticmethod
    def keep(x: Tensor, where: Tensor) -> Tensor:
        return torch.where(where, x, 0.0)

    @staticmethod
    def rows(x: Tensor, axes) -> Tensor:
        return torch.full((1,), math.prod([x.shape[a] for a in axes]), dtype=torch.float64, device=x.device)


TORCH_OPS = TorchOps()
Reduce = Callable[[Tensor, str], Tensor]


def per_channel(v: Tensor, like: Tensor) -> Tensor:
    """``(C,)`` viewed to broadcast against ``(N, C, *)``."""
    return v.view((1, -1) + (1,) * (like.dim() - 2))


def reduced_dims(x: Tensor) -> list:
    """Every dim of ``(N, C, *)`` but the channels."""
    return [0, *range(2, x.dim())]


def call(layer, comm: transport.Communicator, direction: str, x: Tensor) -> transport.Call:
    """This rank's identity of the layer's next collective in ``direction``."""
    return transport.make_call(comm, layer.layer_name, direction, layer.num_features, x.dim(),
                               str(x.dtype).replace("torch.", ""))


def moments(x: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The contract of :func:`hvd_syncbn.backend.local_moments` for ``(N, C, *)``, on the
    device with no host read: ``var_mean`` in ``acc`` of the data shifted by one of its
    own values per channel (a shift within a few standard deviations of the mean keeps
    the float32 mean's rounding far below the spread), the shift added back in float64."""
    dims = reduced_dims(x)
    count = TORCH_OPS.rows(x, dims)
    if x.numel() == 0:  # zeros that depend on x, so that a compiler keeps the collective in place
        zeros = x.detach().to(torch.float64).sum(dims)
        return count, zeros, zeros
    shift = x.detach()[(0, slice(None)) + (0,) * (x.dim() - 2)].to(acc)  # (C,)
    var, mean = torch.var_mean(x.detach().to(acc) - per_channel(shift, x), dims, correction=0)
    return count, shift.double() + mean.double(), var.double()


@torch.compiler.assume_constant_result
def header(layer: str, direction: str, channels: int, ndim: int, dtype: str, world: int) -> List[float]:
    """The static ``[h, h²]`` of a functional collective (no step: it is traced once)."""
    return transport.header(transport.Call(layer, direction, 0, channels, ndim, dtype), world)


_comms: List[transport.Communicator] = []


def _comm_index(comm: transport.Communicator) -> int:
    for i, known in enumerate(_comms):
        if known is comm:
            return i
    _comms.append(comm)
    return len(_comms) - 1


@torch.compiler.assume_constant_result
def _resolved(layer: nn.Module, nccl: bool) -> int:
    comm = layer._resolve_comm(nccl)
    return -1 if comm is None else _comm_index(comm)


def traced_comm(layer: nn.Module, nccl: bool = False) -> Optional[transport.Communicator]:
    """``layer._resolve_comm(nccl)`` while ``torch.compile`` traces: resolved once per trace
    (Dynamo cannot trace the resolver, which asks Horovod and the environment)."""
    index = _resolved(layer, nccl)
    return None if index < 0 else _comms[index]


ASSERT_ENV = "HVD_SYNCBN_DEVICE_ASSERT"


@torch.compiler.assume_constant_result
def asserts() -> bool:
    """Whether the deferred checks also assert at the step (``$HVD_SYNCBN_DEVICE_ASSERT=1``),
    with ``torch._assert_async``: a debug mode, since on CUDA a failed assert loses its
    message and leaves the CUDA context unusable."""
    return transport.env_flag(ASSERT_ENV, False, "errors deferred to check(), the default",
                              "also assert at the step, for debugging")


COMPILE_TIMEOUT_ENV = "HVD_SYNCBN_COMPILE_TIMEOUT"


def compile_timeout() -> float:
    """Seconds a first collective waits beyond the timeout: ``$HVD_SYNCBN_COMPILE_TIMEOUT``, else 600."""
    return transport.env_seconds(COMPILE_TIMEOUT_ENV, 600.0, zero=True)


@torch.library.custom_op("hvd_syncbn::allreduce", mutates_args=(),
                         tags=tuple(getattr(torch.Tag, t) for t in ("cudagraph_unsafe",) if hasattr(torch.Tag, t)))
def _allreduce(buf: Tensor, comm: int, layer: str, direction: str, channels: int, ndim: int, dtype: str) -> Tensor:
    """:func:`hvd_syncbn.comm.allreduce` of a float64 buffer over ``_comms[comm]``; the
    first call of each layer and direction waits :data:`COMPILE_TIMEOUT_ENV` more, as a
    peer may still be compiling."""
    c = _comms[comm]
    call = transport.make_call(c, layer, direction, channels, ndim, dtype)
    timeout = transport.get_timeout() + (compile_timeout() if call.step == 0 else 0.0)
    join = joiner(c, buf.device)
    payload = buf.detach()
    if join is transport.prepend:  # host memory: a CUDA buffer crosses once, into pinned memory
        payload = payload.to("cpu", non_blocking=True)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()
        payload = payload.numpy()
    out = transport.allreduce(c, payload, call, timeout, join=join)
    return torch.as_tensor(out).to(buf.device, non_blocking=True)


def joiner(comm: transport.Communicator, device: torch.device) -> transport.Join:
    """How the custom op's buffers on ``device`` reach ``comm``: CUDA buffers as they are
    where the transport reads device memory (``comm.device_buffers``: Horovod built with
    GPU support, CUDA-aware MPI), after the collective's one wait for the device (the
    transport reads from the host's side); anything else as numpy
    (:func:`hvd_syncbn.comm.prepend`)."""
    if device.type != "cuda" or not comm.device_buffers:
        return transport.prepend

    def join(head: List[float], payload) -> Tensor:
        head_t = torch.tensor(head, dtype=torch.float64, pin_memory=True)
        payload = torch.as_tensor(payload, dtype=torch.float64, device=device)  # poison's are numpy zeros
        out = torch.cat([head_t.to(device, non_blocking=True), payload])
        torch.cuda.current_stream(device).synchronize()
        return out

    return join


@_allreduce.register_fake
def _(buf, comm, layer, direction, channels, ndim, dtype):
    return torch.empty_like(buf)


def reducer(layer, comm: transport.Communicator, x: Tensor, flags: List[Tensor]) -> Reduce:
    """``allreduce_sum(buf, direction)`` for the backend, on ``x``'s device; a static
    header mismatch over ``torch.distributed`` (the user's group or a private one) is
    appended to ``flags``."""
    channels, ndim, dtype = layer.num_features, x.dim(), str(x.dtype).replace("torch.", "")
    if comm.kind != "torch":
        index = _comm_index(comm)
        return lambda buf, direction: _allreduce(buf, index, layer.layer_name, direction, channels, ndim, dtype)

    def over_group(buf: Tensor, direction: str) -> Tensor:
        head = header(layer.layer_name, direction, channels, ndim, dtype, comm.size)
        out = funcol.all_reduce(torch.cat([buf.new_tensor(head), buf]), "sum", comm.group)
        out = funcol.wait_tensor(out)
        flags.append((out[0] != comm.size * head[0]) | (out[1] != comm.size * head[1]))
        return out[transport.HEADER:]

    return over_group


class _DeviceFn(torch.autograd.Function):
    """Normalise with global statistics; backward with one packed allreduce; every
    per-channel vector a float64 tensor on the device. Returns ``y`` and the global
    count, mean, variance and header flag (not differentiable)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, comm, acc):  # noqa: D401 - autograd API
        flags: List[Tensor] = []
        reduce = reducer(layer, comm, x, flags)
        count, mean, var = moments(x, acc)
        total, g_mean, g_var = backend.sync_moments(TORCH_OPS, reduce, count, mean, var)
        bad = flags[0] if flags else torch.zeros((), dtype=torch.bool, device=x.device)
        invstd = torch.rsqrt(g_var + layer.eps)
        mean_t, var_t = g_mean.to(acc), g_var.to(acc)
        w, b = (p if p is None or p.dtype == acc else p.to(acc) for p in (weight, bias))
        y = torch.batch_norm(x, w, b, mean_t, var_t, False, 0.0, layer.eps, torch.backends.cudnn.enabled)
        y = torch.where(bad, torch.nan, y)  # mixed statistics: nothing trains on them
        ctx.save_for_backward(x, weight, mean_t, var_t, invstd, total)
        ctx.layer, ctx.comm = layer, comm
        ctx.mark_non_differentiable(total, g_mean, g_var, bad)
        return y, total, g_mean, g_var, bad

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, *_):
        x, weight, mean, var, invstd, total = ctx.saved_tensors
        layer = ctx.layer
        if x.numel() == 0:  # zeros from dy: with constants AOTAutograd moves the collective forward
            sum_dy_xhat = sum_dy = dy.to(mean.dtype).sum(reduced_dims(x))
        else:
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, None, None, None, mean, invstd.to(mean.dtype), True, layer.eps, [False, True, True])
        dx = None
        if ctx.needs_input_grad[0]:
            reduce = reducer(layer, ctx.comm, x, [])
            g_dy, g_dy_xhat = backend.sync_grad_sums(TORCH_OPS, reduce, sum_dy.double(), sum_dy_xhat.double())
            w = None if weight is None else weight.double()
            k, s, t = backend.input_grad_coeffs(TORCH_OPS, total, invstd, w, g_dy, g_dy_xhat)
            dx = torch.batch_norm(x, s.to(mean.dtype), t.to(mean.dtype), mean, var, False, 0.0, layer.eps,
                                  torch.backends.cudnn.enabled)
            dx = dx + dy * per_channel(k.to(x.dtype), x)
        dw = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


def forward(layer, x: Tensor, comm: transport.Communicator, acc: torch.dtype) -> Tensor:
    """The synchronized training forward of ``layer`` on the device path."""
    try:
        layer._check_input_dim(x)
    except ValueError as e:  # over a transport with a diagnosis, every rank fails together
        if comm.kind != "torch":
            transport.poison(comm, call(layer, comm, "fwd", x), str(e), join=joiner(comm, x.device))
        raise
    y, total, mean, var, bad = _DeviceFn.apply(x, layer.weight, layer.bias, layer, comm, acc)
    errors = [bad, total[0] == 1]
    if layer.check_finite:
        errors.append(~(torch.isfinite(mean).all() & torch.isfinite(var).all()))
    else:
        errors.append(torch.zeros((), dtype=torch.bool, device=x.device))
    errors = torch.stack(errors)
    if asserts():  # before anything updates
        for flag, text in zip(errors, messages(layer.layer_name)):
            torch._assert_async(~flag, f"SyncBatchNorm (device path): {text}")
    with torch.no_grad():
        layer._sync_errors |= errors.to(layer._sync_errors.device)
        if layer.training and layer.track_running_stats:
            update = (total[0] > 0) & ~errors.any()
            tracked = layer.num_batches_tracked + update.to(layer.num_batches_tracked.dtype)
            if layer.momentum is None:
                weight = 1.0 / tracked.clamp_min(1).double()
            else:
                weight = torch.full((), layer.momentum, dtype=torch.float64, device=x.device)
            for buf, new in ((layer.running_mean, mean), (layer.running_var, backend.unbiased(var, total))):
                fresh = backend.ema(buf.double(), new, 1.0 - weight)
                buf.copy_(torch.where(update, fresh, buf.double()).to(buf.dtype))
            layer.num_batches_tracked.copy_(tracked)
    return y


def messages(name: str) -> tuple:
    """What each flag of ``_sync_errors`` means, for layer ``name``."""
    return (f"{name}: ranks summed different collectives (they disagree on the SyncBN layers, their order, "
            f"channel count, input rank or dtype)", backend.single_row_message(name), backend.non_finite_message(name))


def check(module: nn.Module) -> None:
    """Raise the device path's deferred errors of ``module``'s SyncBN layers (one host
    read), naming each layer and what it saw since the last check, and clear them.

    Raises:
        SyncBatchNormError: ranks summed different collectives.
        ValueError: a global batch of one row, or non-finite statistics with ``check_finite``.
    """
    layers = [m for m in module.modules() if getattr(m, "_sync_errors", None) is not None]
    if not layers:
        return
    first = layers[0]._sync_errors.device
    seen = torch.stack([m._sync_errors.to(first) for m in layers]).cpu().numpy()  # (layers, 3)
    for m in layers:
        m._sync_errors.zero_()
    problems = []
    for m, row in zip(layers, seen):
        problems += [text for text, bad in zip(messages(m.layer_name), row) if bad]
    if not problems:
        return
    message = "SyncBatchNorm (device path): " + "; ".join(problems)
    if seen[:, MISMATCH].any():
        raise transport.SyncBatchNormError(message)
    raise ValueError(message)
