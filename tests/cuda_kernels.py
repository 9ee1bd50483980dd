"""CPU stand-ins of torch's fused batch-norm kernels that only CUDA has, for the tests
that run SyncBN's native kernel set without a GPU (``hvd_syncbn.torch.kernels.Native``)
and for torch's own SyncBN Function in ``benchmarks/gpu_check.py --dry-run``.

Each is written from the CUDA kernel's contract as ``aten/src/ATen/native/cuda/
Normalization.cu`` and ``Normalization.cuh`` state it, and computes in float64, its
results rounded to the dtypes CUDA returns (the statistics in the input's accumulation
dtype: float32 for half, bfloat16 and float32 input, float64 for float64):

- ``batch_norm_stats(x, eps)`` -> ``(mean, invstd)`` and
  ``batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, running_mean?,
  running_var?, momentum, eps, counts)`` -> the ``(mean, invstd)`` of ``W`` ranks' rows,
  with the running update: what torch's own SyncBN Function calls besides the four below;
- ``batch_norm_update_stats(x, running_mean?, running_var?, momentum)`` -> ``(mean, var)``,
  biased; the running update with the unbiased variance. It overrides the CPU kernel,
  which returns half-precision statistics for half-precision input where CUDA's are float32.
- ``batch_norm_elemt(x, γ?, β?, mean, invstd, eps)`` -> ``(x − mean)·invstd·γ + β``
  (``eps`` unused), in ``x``'s dtype and memory format.
- ``batch_norm_backward_reduce(dy, x, mean, invstd, γ?, input_g, weight_g, bias_g)`` ->
  ``(Σdy, Σdy·(x − mean), Σdy·(x − mean)·invstd, Σdy)``: sums, not means; the first two
  in ``mean``'s dtype where ``input_g``, the gradients in ``γ``'s where asked.
- ``batch_norm_backward_elemt(dy, x, mean, invstd, γ?, sum_dy, sum_dy_xmu, count)`` ->
  ``(dy − sum_dy/n − (x − mean)·invstd²·sum_dy_xmu/n)·invstd·γ`` with ``n`` the sum of
  the int32 ``count`` (one entry per rank, in torch's SyncBN).

Each op's CUDA contract is one function of :data:`CONTRACTS` (also those of the two
kernels with CPU twins that SyncBN's composite set calls, ``native_batch_norm_backward``
and ``_native_batch_norm_legit_no_training``, whose CUDA kernels refuse more than the
CPU's): it raises where a CUDA kernel refuses its arguments (a dtype its accessors do
not take, ``mean`` and ``invstd`` of different dtypes, a non-int32 count, gradients of
``γ`` and ``β`` asked for without ``γ``) or would go wrong without saying so (a
per-channel tensor not of ``(C,)``, read past its end; ``dy`` not of ``x``'s shape; an empty
input, which a channels-last kernel launches as an empty grid; an ``x`` whose layout
differs from ``dy``'s where the elementwise backward picks its channels-last kernel by
``dy``'s and reads ``x`` in it; the channels-last reduction's ``(0,)``-shaped gradients
without ``γ``). The stand-ins check it first; the fake-CUDA tier (``fake_cuda.py``)
checks it on every call of fake CUDA tensors. There is no Meta kernel here, as on CUDA:
under ``torch.compile`` the layer must not hand these ops to fake tensors.

Use :func:`registered` as a context manager, or :func:`chosen` (the ``kernels`` fixture's).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
from torch import Tensor
from torch._prims_common import suggest_memory_format  # what CUDA gives an output

ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
       torch.float64: torch.float64}


def acc_of(op: str, x: Tensor) -> torch.dtype:
    if x.dtype not in ACC:
        raise RuntimeError(f'"{op}" not implemented for \'{str(x.dtype).replace("torch.", "")}\'')
    return ACC[x.dtype]


def check_input(op: str, x: Tensor) -> None:
    if x.dim() < 2 or x.numel() == 0:
        raise RuntimeError(f"{op}: expected a non-empty (N, C, *) input, got shape {tuple(x.shape)} (CUDA's "
                           f"channels-last kernels launch an empty grid)")


def check_dtype(op: str, name: str, t: Optional[Tensor], *dtypes: torch.dtype) -> None:
    """As a CUDA packed accessor: ``Expected <name> to have type <T> but got <U>``."""
    if t is not None and t.dtype not in dtypes:
        raise RuntimeError(f"{op}: Expected {name} to have type {dtypes[0]} but got {t.dtype}")


def check_channels(op: str, x: Tensor, **per_channel: Optional[Tensor]) -> None:
    """Each given tensor of ``(C,)`` for ``x`` of ``(N, C, *)``: a kernel indexes it by channel
    (a shorter one is read past its end, without an error)."""
    for name, t in per_channel.items():
        if t is not None and tuple(t.shape) != (x.shape[1],):
            raise RuntimeError(f"{op}: expected {name} of shape ({x.shape[1]},), got {tuple(t.shape)}")


def check_params(op: str, x: Tensor, acc: torch.dtype, *params: Optional[Tensor]) -> None:
    """γ and β: ``(C,)``, in the input's dtype, or all in its accumulation dtype ("mixed")."""
    check_channels(op, x, **dict(zip(("weight", "bias"), params)))
    first = next((p for p in params if p is not None), None)
    if first is None:
        return
    want = x.dtype if first.dtype == x.dtype else acc
    for name, p in zip(("weight", "bias"), params):
        check_dtype(op, name, p, want)


def check_stats(op: str, acc: torch.dtype, mean: Tensor, invstd: Tensor) -> None:
    if mean.dtype != invstd.dtype:
        raise RuntimeError(f"{op}: mean and invstd need to have the same data types")
    check_dtype(op, "mean", mean, acc)


def channel(v: Tensor, like: Tensor) -> Tensor:
    return v.double().view((1, -1) + (1,) * (like.dim() - 2))


def dims(x: Tensor) -> list:
    return [0, *range(2, x.dim())]


def layout(t: Tensor) -> tuple:
    """Where ``t``'s elements lie: its strides but those of dims of size 1 (any stride
    there addresses the same memory, as a kernel reading by pointer sees it)."""
    return tuple(s if n > 1 else None for n, s in zip(t.shape, t.stride()))


def channels_last_kernels(t: Tensor) -> bool:
    """``batch_norm_use_channels_last_kernels``."""
    return (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or (
        t.is_contiguous() and t.stride(1) == 1)


def update_stats_contract(x, running_mean=None, running_var=None, momentum=0.0) -> torch.dtype:
    op = "batch_norm_update_stats"
    acc = acc_of(op, x)
    check_input(op, x)
    if (running_mean is None) != (running_var is None):
        raise RuntimeError(f"{op}: expected running_mean and running_var both or neither")
    return acc


def update_stats(x, running_mean, running_var, momentum):
    acc = update_stats_contract(x, running_mean, running_var, momentum)
    xd = x.double()
    var, mean = torch.var_mean(xd, dims(x), correction=0)
    n = x.numel() // x.shape[1]
    running_update(running_mean, running_var, mean, var * n / (n - 1), momentum)  # a tensor: n = 1 gives inf
    return mean.to(acc), var.to(acc)


def running_update(running_mean: Optional[Tensor], running_var: Optional[Tensor], mean: Tensor, unbiased: Tensor,
                   momentum: float) -> None:
    """The kernels' running update, each buffer given: ``(1 − momentum)·old + momentum·new``."""
    with torch.no_grad():
        for buf, new in ((running_mean, mean), (running_var, unbiased)):
            if buf is not None:
                buf.copy_(buf.double() * (1 - momentum) + new * momentum)


def elemt_contract(x, weight, bias, mean, invstd, eps=0.0) -> torch.dtype:
    op = "batch_norm_elemt"
    acc = acc_of(op, x)
    check_input(op, x)
    check_stats(op, acc, mean, invstd)
    check_channels(op, x, mean=mean, invstd=invstd)
    check_params(op, x, acc, weight, bias)
    return acc


def elemt(x, weight, bias, mean, invstd, eps):
    elemt_contract(x, weight, bias, mean, invstd, eps)
    y = (x.double() - channel(mean, x)) * channel(invstd, x)
    if weight is not None:
        y = y * channel(weight, x)
    if bias is not None:
        y = y + channel(bias, x)
    return y.to(x.dtype).contiguous(memory_format=suggest_memory_format(x))


def check_backward(op: str, dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor) -> torch.dtype:
    """What both backward kernels check: the input, ``dy`` in its dtype, the statistics;
    the accumulation dtype."""
    acc = acc_of(op, x)
    check_input(op, x)
    check_dtype(op, "grad_output", dy, x.dtype)
    if dy.shape != x.shape:
        raise RuntimeError(f"{op}: expected grad_output of input's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    check_stats(op, acc, mean, invstd)
    check_channels(op, x, mean=mean, invstd=invstd)
    return acc


def backward_reduce_contract(dy, x, mean, invstd, weight, input_g=True, weight_g=False, bias_g=False,
                             op: str = "batch_norm_backward_reduce") -> torch.dtype:
    acc = check_backward(op, dy, x, mean, invstd)
    check_params(op, x, acc, weight)
    if (weight_g or bias_g) and weight is None:
        if channels_last_kernels(dy) and channels_last_kernels(x):
            raise RuntimeError(f"{op}: the gradients of weight and bias asked for without a weight: CUDA's "
                               f"channels-last kernel returns them (0,)-shaped; expected a weight")
        raise RuntimeError(f"{op}: tensor does not have a device (CUDA makes the gradients of weight and bias with "
                           f"weight's options: expected a weight where they are asked for)")
    return acc


def backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    backward_reduce_contract(dy, x, mean, invstd, weight, input_g, weight_g, bias_g)
    centred = x.double() - channel(mean, x)
    sum_dy = dy.double().sum(dims(x))
    sum_dy_xmu = (dy.double() * centred).sum(dims(x))
    return (sum_dy.to(mean.dtype) if input_g else None,
            sum_dy_xmu.to(mean.dtype) if input_g else None,
            (sum_dy_xmu * invstd.double()).to(weight.dtype) if weight_g else None,
            sum_dy.to(weight.dtype) if bias_g else None)


def backward_elemt_contract(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count) -> torch.dtype:
    op = "batch_norm_backward_elemt"
    acc = check_backward(op, dy, x, mean, invstd)
    for name, t in (("sum_dy", sum_dy), ("sum_dy_xmu", sum_dy_xmu)):
        check_dtype(op, name, t, acc)
    check_channels(op, x, sum_dy=sum_dy, sum_dy_xmu=sum_dy_xmu, weight=weight)
    # the contiguous kernel takes a half input's γ in float32 only; the others the input's dtype
    check_dtype(op, "weight", weight, acc)
    check_dtype(op, "count", count, torch.int32)
    if not count.is_contiguous():  # the kernels read count.numel() ints from its data pointer
        raise RuntimeError(f"{op}: expected a contiguous count, got strides {count.stride()}")
    if channels_last_kernels(dy) and layout(x) != layout(dy):
        raise RuntimeError(f"{op}: grad_output takes the channels-last kernel, which reads input in its layout: "
                           f"expected input with strides {dy.stride()}, got {x.stride()}")
    return acc


def backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    backward_elemt_contract(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
    n = count.sum(dtype=torch.int64).double()
    inv = channel(invstd, x)
    dx = (dy.double() - channel(sum_dy, x) / n - (x.double() - channel(mean, x)) * inv * inv
          * channel(sum_dy_xmu, x) / n) * inv
    if weight is not None:
        dx = dx * channel(weight, x)
    return dx.to(x.dtype).contiguous(memory_format=suggest_memory_format(dy))


def stats_contract(x, eps=0.0) -> torch.dtype:
    op = "batch_norm_stats"
    acc = acc_of(op, x)
    check_input(op, x)
    return acc


def stats(x, eps):
    acc = stats_contract(x, eps)
    var, mean = torch.var_mean(x.double(), dims(x), correction=0)
    return mean.to(acc), (var + eps).rsqrt().to(acc)


def gather_stats_contract(x, mean_all, invstd_all, running_mean=None, running_var=None, momentum=0.0, eps=0.0,
                          counts=None) -> torch.dtype:
    op = "batch_norm_gather_stats_with_counts"
    check_stats(op, mean_all.dtype, mean_all, invstd_all)
    return mean_all.dtype


def gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    """The ranks' ``(mean, invstd)`` rows of ``counts`` rows each combined: the global
    ``(mean, invstd)``, and the running update with the unbiased variance (no guard: a
    zero total count divides by zero, as on CUDA)."""
    gather_stats_contract(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts)
    n = counts.double()[:, None]  # (W, 1)
    total = n.sum(0)
    mean = (n * mean_all.double()).sum(0) / total
    var_n = (n * (invstd_all.double() ** -2 - eps + (mean_all.double() - mean) ** 2)).sum(0)
    running_update(running_mean, running_var, mean, var_n / (total - 1), momentum)
    return mean.to(mean_all.dtype), (var_n / total + eps).rsqrt().to(mean_all.dtype)


def native_backward_contract(dy, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                             mask) -> torch.dtype:
    """``native_batch_norm_backward`` on CUDA (``batch_norm_backward_cuda``): in training,
    or where the gradients of ``γ`` and ``β`` are asked for, the gradient sums of
    :func:`backward_reduce_contract` from the saved statistics (the fused kernel, where
    ``dx`` is asked for of a channels-first input, reads them alike)."""
    op = "native_batch_norm_backward"
    if save_mean is None or save_invstd is None:
        raise RuntimeError(f"{op}: save_mean and save_invstd should always be defined")
    if not (train or mask[1] or mask[2]):
        return acc_of(op, x)
    return backward_reduce_contract(dy, x, save_mean, save_invstd, weight, mask[0], mask[1], mask[2], op=op)


def no_training_contract(x, weight, bias, running_mean, running_var, momentum=0.0, eps=0.0) -> torch.dtype:
    """``_native_batch_norm_legit_no_training`` on CUDA (``batch_norm_cuda``, not training):
    the running statistics given; ``γ`` and ``β`` as :func:`batch_norm_elemt`'s."""
    op = "_native_batch_norm_legit_no_training"
    acc = acc_of(op, x)
    if running_mean is None or running_var is None:
        raise RuntimeError(f"{op}: expected running_mean and running_var")
    check_params(op, x, acc, weight, bias)
    return acc


CONTRACTS = {"batch_norm_update_stats": update_stats_contract, "batch_norm_elemt": elemt_contract,
             "batch_norm_backward_reduce": backward_reduce_contract,
             "batch_norm_backward_elemt": backward_elemt_contract, "batch_norm_stats": stats_contract,
             "batch_norm_gather_stats_with_counts": gather_stats_contract,
             "native_batch_norm_backward": native_backward_contract,
             "_native_batch_norm_legit_no_training": no_training_contract}
"""What each CUDA kernel SyncBN calls accepts, by aten op name: a function of the op's
arguments that raises outside the contract and returns the accumulation dtype."""


STAND_INS = {"batch_norm_update_stats": update_stats, "batch_norm_elemt": elemt,
             "batch_norm_backward_reduce": backward_reduce, "batch_norm_backward_elemt": backward_elemt,
             "batch_norm_stats": stats, "batch_norm_gather_stats_with_counts": gather_stats_with_counts}
"""Every CUDA-only kernel of SyncBN's native set and of torch's own SyncBN Function."""


@contextlib.contextmanager
def registered(kernels: Optional[dict] = None):
    """``kernels`` (default: the stand-ins; ``{op name: function}``) as the CPU kernels of
    their aten ops inside the block (the CPU's own ``batch_norm_update_stats`` back after it)."""
    from hvd_syncbn.torch.kernels import missing_kernels

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the CPU update_stats
        warnings.simplefilter("ignore")
        for name, fn in (STAND_INS if kernels is None else kernels).items():
            lib.impl(name, fn, "CPU")
    missing_kernels.cache_clear()  # the layers ask the dispatcher once per process
    try:
        yield
    finally:
        lib._destroy()
        missing_kernels.cache_clear()


@contextlib.contextmanager
def chosen(kernels: str, monkeypatch):
    """The device path on the kernel set ``kernels`` (``native`` or ``composite``) inside
    the block: ``$HVD_SYNCBN_KERNELS`` set by ``monkeypatch``, the native set through
    the stand-ins."""
    monkeypatch.setenv("HVD_SYNCBN_KERNELS", kernels)
    with registered() if kernels == "native" else contextlib.nullcontext():
        yield
