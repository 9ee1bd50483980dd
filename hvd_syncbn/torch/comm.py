"""The PyTorch transports of :mod:`hvd_syncbn.comm`: Horovod, MPI (mpi4py) and torch.distributed.

Chosen per layer call by :func:`resolve`, by the rule of :func:`hvd_syncbn.transports.choose`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from hvd_syncbn import comm as base
from hvd_syncbn import transports

try:
    import horovod.torch as hvd
except ImportError:  # pragma: no cover - exercised only where Horovod is missing
    hvd = None


class HorovodComm(base.Communicator):
    """Horovod's allreduce, in place on a CPU tensor over the numpy buffer."""

    kind = "horovod"

    def __init__(self, process_set: Any) -> None:
        self.ps = process_set
        self.rank, self.size = process_set.rank(), process_set.size()

    def start(self, buf, name):
        return hvd.allreduce_async_(torch.from_numpy(buf), op=hvd.Sum, name=name, process_set=self.ps)

    def done(self, handle):
        return hvd.poll(handle)

    def result(self, handle):
        return hvd.synchronize(handle).numpy()

    def abort(self):
        hvd.shutdown()


class TorchDistComm(base.Communicator):
    """``torch.distributed`` on ``group`` (``None``: the default group), with a second
    group of the same ranks for diagnostics (``diagnostics=True``: this is that one).
    Buffers cross on the device the group's backend works on (CUDA for NCCL)."""

    kind = "torch"

    def __init__(self, group: Any, diagnostics: bool = False) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._side: base.Communicator = self
        if not diagnostics:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            self._side = TorchDistComm(dist.new_group(ranks, use_local_synchronization=True), diagnostics=True)

    def start(self, buf, name):
        tensor = torch.from_numpy(buf).to(self.device)
        return tensor, dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def done(self, handle):
        return handle[1].is_completed()

    def result(self, handle):
        handle[1].wait()
        return handle[0].cpu().numpy()

    def side(self):
        return self._side


_resolved: dict = {}
_horovod_seen = False


def _horovod_on() -> bool:
    """Whether ``hvd.init()`` has run; once it has, that is remembered (every layer asks
    on every forward, and the ctypes call is slow right after a collective)."""
    global _horovod_seen
    if not _horovod_seen:
        _horovod_seen = hvd is not None and bool(hvd.is_initialized())
    return _horovod_seen


def resolve(kind: Any, process_set: Any, layer: str) -> Optional[base.Communicator]:
    """The communicator a layer uses now, or ``None`` when it is alone (plain BN).

    Called on every forward: the answer is remembered for the state it depends on.
    """
    hvd_on = _horovod_on()
    state = (id(kind) if isinstance(kind, base.Communicator) else kind, os.environ.get(transports.COMM_ENV), hvd_on,
             dist.is_available() and dist.is_initialized(), _set_key(process_set))
    if state not in _resolved:
        _resolved[state] = _resolve(kind, process_set, layer, hvd_on)
    return _resolved[state]


def _resolve(kind: Any, process_set: Any, layer: str, hvd_on: bool) -> Optional[base.Communicator]:
    if hvd_on and isinstance(process_set, hvd.ProcessSet) and not process_set.included():
        raise transports.not_a_member(layer, hvd.rank(), process_set.ranks)
    group = process_set if process_set is not None else hvd.global_process_set if hvd_on else None
    return transports.resolve(
        kind, layer, (hvd.size(), hvd.rank()) if hvd_on else None, ("torch", _set_key(process_set)),
        _ranks(process_set), lambda: HorovodComm(group),
        lambda: _torch_dist(process_set, layer), dist.is_available() and dist.is_initialized())


def _set_key(process_set: Any) -> Any:
    if process_set is None:
        return None
    if hvd is not None and isinstance(process_set, hvd.ProcessSet):
        return ("hvd", process_set.process_set_id)
    return ("obj", id(process_set))


def _ranks(process_set: Any) -> Optional[list]:
    """The world ranks of a Horovod process set or a ``torch.distributed`` group."""
    if process_set is None:
        return None
    if isinstance(process_set, dist.ProcessGroup):
        return dist.get_process_group_ranks(process_set)
    return list(process_set.ranks)


def _torch_dist(process_set: Any, layer: str) -> TorchDistComm:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{layer}: comm='torch' needs torch.distributed.init_process_group() first")
    if process_set is not None and not isinstance(process_set, dist.ProcessGroup):
        raise ValueError(
            f"{layer}: with comm='torch', expected process_set to be a torch.distributed "
            f"ProcessGroup (from dist.new_group), got {type(process_set).__name__}"
        )
    if process_set is not None and dist.get_rank(process_set) < 0:
        raise transports.not_a_member(layer, dist.get_rank(), dist.get_process_group_ranks(process_set))
    return TorchDistComm(process_set)
