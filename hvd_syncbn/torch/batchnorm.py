"""PyTorch SyncBatchNorm over Horovod.

A drop-in for ``nn.BatchNorm1d/2d/3d`` whose batch statistics cover every rank.
"""

from __future__ import annotations

import inspect
import itertools
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import init
from torch.nn.modules.batchnorm import _BatchNorm

from hvd_syncbn import validation
from hvd_syncbn.comm import Communicator
from hvd_syncbn.groups import check_group_size
from hvd_syncbn.torch import deferred, reducers, replicas, transports
from hvd_syncbn.torch.device import Plan, plan as device_plan
from hvd_syncbn.torch.kernels import cast, kernels_for
from hvd_syncbn.torch.step import DeviceFunction
from hvd_syncbn.torch.reducers import GroupReducer, Identity, OpReducer
from hvd_syncbn.transports import requested_kind

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_layer_ids = itertools.count()
_sync_ids = itertools.count()
_layers: "weakref.WeakValueDictionary[int, SyncBatchNorm]" = weakref.WeakValueDictionary()
"""Every layer by its ``_sync_id``: how a traced call finds its layer (Dynamo passes no
module to a function it treats as constant)."""


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
        process_set: Horovod process set to synchronise within (or, with
            ``comm="torch"``, a ``torch.distributed`` group). Default: all ranks.
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
        stats: when the checks of the global batch (ranks that summed different
            collectives, a global batch of one row, ``check_finite``) raise. The
            statistics are tensors on the input's device whatever this says. ``"auto"``:
            at the step, on every rank, for CPU tensors in eager mode (a host read costs
            nothing there); for CUDA tensors and under ``torch.compile`` no host read:
            the output is NaN after a mismatch, nothing updates, and
            :func:`~hvd_syncbn.torch.check` (or ``train()``/``eval()``) raises. ``"device"``:
            deferred on every device. ``"host"`` (deprecated): at the step on every
            device. Default: ``$HVD_SYNCBN_STATS``, else ``"auto"``. The passes over the
            data are torch's fused batch-norm kernels where the device has them (CUDA),
            else generic ops (``$HVD_SYNCBN_KERNELS``: ``"auto"``, ``"native"`` or
            ``"composite"``).
        process_group: ``process_set`` under ``torch.nn.SyncBatchNorm``'s name; give
            one of the two, not both.
        group_size: synchronise within groups of ranks instead of all of them (BN
            groups, as apex's ``group_size``): ``k`` consecutive ranks (``k`` must divide
            the number of ranks), or ``"node"``, the ranks on one host (groups may then
            differ in size). A group of one rank is plain BN and makes no collective;
            the replicas of ``nn.DataParallel`` in one process are always in its group.
            Not with ``process_set``; with ``comm`` a :class:`~hvd_syncbn.comm.Communicator`,
            groups of its ranks. Default: ``None`` (all ranks).

    Under a launcher of several processes (torchrun, mpirun, srun, horovodrun), a
    training layer that finds no transport warns once per process that it normalises
    with local statistics only; ``HVD_SYNCBN_STRICT=1`` makes that an error.

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
        process_group: Any = None,
        group_size: Any = None,
    ) -> None:
        _check_args(num_features, eps, momentum)
        group = one_group("SyncBatchNorm", process_set, process_group, group_size)
        if "bias" in inspect.signature(_BatchNorm.__init__).parameters:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        else:  # torch before the keyword (2.11 and older): no β by hand, as torch's later versions do
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
            if not bias and self.bias is not None:
                self.register_parameter("bias", None)
        self._init_sync(group, name, comm, check_finite, stats, group_size)

    def reset_parameters(self) -> None:
        """As ``_BatchNorm``'s, for a layer without ``β`` too (older torch resets ``β`` unasked)."""
        self.reset_running_stats()
        if self.weight is not None:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None, **layer_args: Any) -> nn.Module:
        """``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` under its usual name: the
        same as :func:`hvd_syncbn.torch.convert_sync_batchnorm` (which this calls, with
        ``layer_args``: ``comm``, ``check_finite``, ``stats``, ``classes``).

        Examples::

            >>> model = hvd_syncbn.torch.SyncBatchNorm.convert_sync_batchnorm(model, comm="mpi")
        """
        from hvd_syncbn.torch.convert import convert_sync_batchnorm  # convert builds on this module

        return convert_sync_batchnorm(module, process_group=process_group, **layer_args)

    def _init_sync(self, process_set: Any, name: Optional[str], comm: Optional[str], check_finite: bool,
                   stats: Optional[str] = None, group_size: Any = None) -> None:
        """Set what this class adds to ``_BatchNorm`` (also for a layer made by conversion)."""
        requested_kind(comm)
        self.process_set = process_set
        self.group_size = group_size
        self.layer_name = name or f"SyncBatchNorm_{next(_layer_ids)}"
        self.comm = comm
        self.check_finite = bool(check_finite)
        self.stats = stats_choice(stats)
        self._plans: dict = {}  # the step's, by input signature (see _plan)
        like = next((t for t in (self.weight, self.running_mean) if t is not None), None)
        self.register_buffer("_sync_errors", torch.zeros(len(deferred.SLOTS), dtype=torch.int64,
                                                         device=None if like is None else like.device),
                             persistent=False)
        self._register()

    def _register(self) -> None:
        self._sync_id = next(_sync_ids)
        _layers[self._sync_id] = self

    def __getstate__(self) -> dict:
        """As ``nn.Module``'s, without the step's plans (they hold communicators)."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "_plans": {}}

    def __setstate__(self, state: dict) -> None:
        """As ``nn.Module``'s (``copy.deepcopy``, unpickling), the copy a layer of its own."""
        super().__setstate__(state)
        if "_sync_id" in state:
            self.__dict__.setdefault("_plans", {})
            self._register()

    _SYNC_ATTRIBUTES = ("process_set", "group_size", "layer_name", "comm", "check_finite", "stats", "_plans", "_sync_id")
    """What :meth:`_init_sync` sets (and the ``_sync_errors`` buffer); reverting to plain BN drops these."""

    def train(self, mode: bool = True) -> "SyncBatchNorm":
        """As ``nn.Module.train``, then raise the deferred errors of this
        layer (:func:`~hvd_syncbn.torch.check`)."""
        super().train(mode)
        deferred.check(self)
        return self

    def _check_input_dim(self, input: Tensor) -> None:
        validation.check_input(
            self.layer_name, input.shape, 1, self.num_features,
            input.is_floating_point() and not input.is_complex(), input.dtype, "x.float()",
        )

    def _acc_dtype(self, x: Tensor) -> torch.dtype:
        params = self.weight if self.weight is not None else self.running_mean
        if params is not None and params.dtype not in _LOW_PRECISION:
            return params.dtype
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def _resolve_comm(self, nccl: bool = False) -> Optional[Communicator]:
        return transports.resolve(self.comm, self.process_set, self.layer_name, nccl,
                                  self.__dict__.get("group_size"))  # absent in layers pickled before it

    def _comm(self, nccl: bool = False) -> Optional[Communicator]:
        """The communicator of this call, or ``None`` when this process is alone; ``nccl``:
        CUDA tensors (see :func:`hvd_syncbn.torch.transports.resolve`)."""
        comm = _traced_comm(self._sync_id, nccl) if torch.compiler.is_compiling() else self._resolve_comm(nccl)
        return comm if comm is not None and comm.size > 1 else None

    def _reducer(self, x: Tensor, comm: Communicator) -> Any:
        """How this call's buffers are summed: a functional collective (``torch.distributed``)
        or the custom op (Horovod, MPI)."""
        identity = Identity.of(self.layer_name, self.num_features, x, kernels_for(x.device).name)
        return GroupReducer(comm, identity) if comm.traceable else OpReducer(comm, identity, x.device)

    def _replicate_for_data_parallel(self) -> "SyncBatchNorm":
        """``nn.DataParallel``'s copy of this layer for one of its devices: the copies made by
        one ``replicate`` synchronize with each other (:mod:`hvd_syncbn.torch.replicas`)."""
        replica = super()._replicate_for_data_parallel()
        replica._replicas, replica._replica_rank = replicas.join(self)
        return replica

    def forward(self, input: Tensor) -> Tensor:
        comm = None
        if "_replicas" in self.__dict__ and (self.training or not self.track_running_stats):  # under DataParallel
            return replicas.forward(self, input)
        if self.training or not self.track_running_stats:  # synchronized
            comm = self._comm(input.device.type == "cuda")
        if comm is None:
            return self._alone(input)
        plan = self._plan(input, comm)
        if not torch.compiler.is_compiling():
            return DeviceFunction.apply(input, self.weight, self.bias, plan, self)
        y, stats, count, flags = DeviceFunction.apply(input, self.weight, self.bias, plan, None)
        self._after_step(stats, count, flags, plan)
        return y

    def _checked(self, x: Tensor, reduce: Any, joins: bool = False) -> None:
        """Check ``x``; bad input fails every rank's step together, not this one alone
        (``joins``: see :meth:`~hvd_syncbn.torch.reducers.GroupReducer.fail`)."""
        try:
            self._check_input_dim(x)
        except ValueError as e:
            reduce.fail(str(e), joins=joins)

    def _plan(self, x: Tensor, comm: Communicator) -> Plan:
        """The step's :class:`~hvd_syncbn.torch.device.Plan` for ``x`` over ``comm``:
        its reducer, kernel set (``$HVD_SYNCBN_KERNELS``), the dtype of the statistics it
        takes and its lanes. Eagerly made at the first step of each input signature and
        kept (``x`` checked then; later only its channel count)."""
        compiling = torch.compiler.is_compiling()
        key = None if compiling else (comm, x.dtype, x.device, x.dim(), self._acc_dtype(x), self.layer_name, self.eps,
                                      self.check_finite, self.stats)
        found = None if compiling else self._plans.get(key)
        if found is None or x.shape[1] != self.num_features:
            reduce = self._reducer(x, comm)
            raises = not compiling and (self.stats == "host" or self.stats == "auto" and x.device.type == "cpu")
            self._checked(x, reduce, raises)
            found = self._make_plan(x, reduce, None if compiling else x.device, raises)
            if not compiling:  # traced once: nothing kept
                self._plans[key] = found
        return found

    def _make_plan(self, x: Tensor, reduce: Any, device: Optional[torch.device], raises: bool = False) -> Plan:
        """A :class:`~hvd_syncbn.torch.device.Plan` for ``x`` over ``reduce`` (``None``: one
        process), its lanes as tensors on ``device`` where given; ``raises``: its checks
        raise at the step (a host read) instead of being deferred."""
        kernels = kernels_for(x.device)
        return device_plan(reduce, self.eps, kernels.acc(x, self._acc_dtype(x)), self.check_finite, kernels, device,
                           raises)

    def _after_step(self, stats: Tensor, count: Tensor, flags: Tensor, plan: Plan) -> None:
        """Apply a step's checks (raised now where ``plan.raises``, else recorded for
        :func:`~hvd_syncbn.torch.check`) and update the running statistics from its global
        ``stats`` and ``count`` (:class:`~hvd_syncbn.torch.step.DeviceFunction`'s: not
        differentiable, so no autograd records these in-place updates)."""
        heads = len(plan.fwd.expected) - 2
        if plan.raises:
            self._raise_now(flags.tolist(), heads, plan)
        else:
            deferred.record(self.layer_name, self._sync_errors, flags, heads, plan.asserts)
        if self.training and self.track_running_stats:
            updated = count < -1.0  # 2+ rows, matching headers (a NaN count compares false)
            if self.check_finite:
                updated &= ~flags[-1]
            var = stats[1]
            unbiased = torch.addcdiv(var, var, count + 1.0, value=-1.0)  # var·N/(N−1)
            self._running_update(stats[0], unbiased, updated)

    def _raise_now(self, flags: list, heads: int, plan: Plan) -> None:
        """Raise on every rank, before any update, what the step's ``flags`` (read on the
        host) say: ranks that summed different collectives (after the diagnosis, which
        names each rank's layer), a global batch of one row, non-finite statistics."""
        if any(flags[:heads]):
            plan.reduce.diagnose("ranks summed different collectives")
        if not flags[heads]:
            raise ValueError(validation.single_row_message(self.layer_name))
        if self.check_finite:
            validation.check_finite(self.layer_name, not flags[-1])

    def _running_update(self, mean: Tensor, var: Tensor, updated: Tensor) -> None:
        """Count the batch and move the running statistics toward ``mean`` and the unbiased
        ``var`` where ``updated`` (a 0-dim boolean tensor), without a host read."""
        tracked, buffers = self.num_batches_tracked, [self.running_mean, self.running_var]
        tracked.add_(updated)
        news = [cast(torch.where(updated, new, old), old.dtype) for new, old in zip((mean, var), buffers)]
        if self.momentum is not None:
            torch._foreach_lerp_(buffers, news, self.momentum)  # lerp(old, old, w) is old: no update
            return
        weight = tracked.clamp_min(1).reciprocal()  # a cumulative average
        for buf, new in zip(buffers, news):
            buf.lerp_(new, cast(weight, buf.dtype))

    def _alone(self, input: Tensor) -> Tensor:
        """Plain BN, but as across ranks a lone training row raises, an empty batch counts nothing."""
        rows = _rows(input) if self.training else None
        if rows is not None and (self.check_finite or rows < 2):
            self._check_input_dim(input)
            validation.check_global_count(self.layer_name, rows, training=True)
            if self.check_finite:
                validation.check_finite(self.layer_name, bool(torch.isfinite(input).all()))
            if rows == 0:
                return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return super().forward(input)  # plain BN: the native fast path; it checks the input

    def extra_repr(self) -> str:
        return super().extra_repr() + f", name={self.layer_name!r}"


@torch.compiler.assume_constant_result
def _traced_index(layer_id: int, nccl: bool) -> int:
    comm = _layers[layer_id]._resolve_comm(nccl)
    return -1 if comm is None else reducers.comm_index(comm)


def _traced_comm(layer_id: int, nccl: bool) -> Optional[Communicator]:
    """``_resolve_comm(nccl)`` of the layer ``layer_id`` (its ``_sync_id``) while
    ``torch.compile`` traces: resolved once per trace (Dynamo cannot trace the resolver,
    which asks Horovod and the environment), from constants only (no module)."""
    index = _traced_index(layer_id, nccl)
    return None if index < 0 else reducers.known_comm(index)


def _rows(x: Tensor) -> int:
    """Rows per channel of ``(N, C, *)`` (0 for an empty or malformed input)."""
    return x.numel() // x.shape[1] if x.dim() > 1 and x.shape[1] else 0


def stats_choice(stats: Optional[str]) -> str:
    """The layer's ``stats`` (else ``$HVD_SYNCBN_STATS``, else ``"auto"``), checked; ``"host"``
    warns that it is deprecated, saying what it now does."""
    value = validation.stats_choice("SyncBatchNorm", stats)
    if value == "host":
        where = "stats='host'" if stats is not None else f"${validation.STATS_ENV}=host"
        warnings.warn(f"SyncBatchNorm: {where} is deprecated and will be removed: the statistics are computed on the "
                      f"input's device on every path now, and 'host' only keeps the checks at the step on every "
                      f"device (a host read per step, a sync on a GPU); use 'auto' (checks at the step for CPU "
                      f"tensors in eager mode, deferred to hvd_syncbn.torch.check() elsewhere)", DeprecationWarning,
                      stacklevel=4)
    return value


def one_group(where: str, process_set: Any, process_group: Any, group_size: Any = None) -> Any:
    """The group of ranks given as ``process_set`` or under torch's name ``process_group``
    (checked, with ``group_size``: :func:`~hvd_syncbn.groups.check_group_size`)."""
    if process_set is not None and process_group is not None:
        raise ValueError(f"{where}: expected process_set or process_group (torch's name for the same argument), "
                         f"got both; drop one of them")
    group = process_set if process_set is not None else process_group
    check_group_size(where, group_size, group)
    return group


def _check_args(num_features: Any, eps: Any, momentum: Any) -> None:
    if not isinstance(num_features, int) or num_features <= 0:
        raise ValueError(f"SyncBatchNorm: expected num_features to be a positive int, got {num_features!r}")
    validation.check_args("SyncBatchNorm", eps, momentum, momentum_none=True)
