"""How :class:`~hvd_syncbn.torch.SyncBatchNorm` sums its buffers over the ranks: the
``reduce(buf, direction)`` of a step (:mod:`hvd_syncbn.torch.step`), per transport.

- :class:`OpReducer`: over Horovod or MPI, :func:`hvd_syncbn.comm.allreduce` (the
  step-counted identity header, checked on the host, the deadline, the diagnosis);
  under ``torch.compile`` in the custom op ``hvd_syncbn::allreduce``, which it keeps
  opaque. CUDA buffers go to the transport as they are where it reads device memory
  (``device_buffers``), else through one copy to host memory and one back.
- :class:`GroupReducer`: over ``torch.distributed``, a functional collective on SyncBN's
  own group (NCCL for CUDA tensors, Gloo on the CPU) with SyncBN's timeout, in the
  custom op ``hvd_syncbn::group_allreduce`` under ``torch.compile``; a failed collective
  is diagnosed over the side channel. Its header is static (no step), in the buffer the
  step builds and checks (:mod:`hvd_syncbn.torch.device`); a mismatch makes the step's
  output NaN and sets a flag, raised at the step (:meth:`diagnose`) or by
  :func:`~hvd_syncbn.torch.check`.

Each can also ``fail(problem)``: end every rank's step with ``problem`` (joining the
forward collective the peers wait in, where the transport has a diagnosis).
"""

from __future__ import annotations

import functools
import re
import time
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from hvd_syncbn.comm import Join, allreduce, poison, prepend
from hvd_syncbn.communicator import Communicator
from hvd_syncbn.diagnosis import fail
from hvd_syncbn.errors import SyncBatchNormInputError
from hvd_syncbn.identity import Call, make_call, static_header
from hvd_syncbn.layout import grad_lane
from hvd_syncbn.settings import TIMEOUT_ENV, collective_timeout
from hvd_syncbn.waiting import blocking, unblocked

def _header(layer: str, direction: str, channels: int, ndim: int, dtype: str, world: int) -> Tuple[float, ...]:
    return tuple(static_header(layer, direction, channels, ndim, dtype, world))


_known_header = functools.lru_cache(maxsize=None)(_header)  # eager: each step asks
_traced_header = torch.compiler.assume_constant_result(_header)  # Dynamo cannot trace the crc32


class Identity(NamedTuple):
    """What names a layer's collectives and its header: layer, channels, input rank, dtype."""

    layer: str
    channels: int
    ndim: int
    dtype: str

    @classmethod
    def of(cls, layer: str, channels: int, x: Tensor, kernels: str = "composite") -> "Identity":
        """``x``'s; under a ``kernels`` set whose backward lane differs
        (:func:`hvd_syncbn.layout.grad_lane`) the dtype says so, so that ranks summing
        different lanes fail as a mismatch."""
        lane = grad_lane(kernels)
        dtype = str(x.dtype).replace("torch.", "")
        return cls(layer, channels, x.dim(), f"{dtype}, backward lane {lane}" if lane else dtype)

    def call(self, comm: Communicator, direction: str) -> Call:
        """This rank's next collective in ``direction`` over ``comm`` (it counts the step)."""
        return make_call(comm, self.layer, direction, self.channels, self.ndim, self.dtype)


    def current(self, comm: Communicator, direction: str) -> Call:
        """This rank's latest collective in ``direction`` over ``comm`` (no step counted)."""
        return make_call(comm, self.layer, direction, self.channels, self.ndim, self.dtype, count=False)


_comms: List[Communicator] = []
"""The communicators the custom op has seen: it takes an index (ops take no objects)."""


def comm_index(comm: Communicator) -> int:
    """``comm``'s index in the communicators the custom op knows (added if new)."""
    for i, known in enumerate(_comms):
        if known is comm:
            return i
    _comms.append(comm)
    return len(_comms) - 1


def known_comm(index: int) -> Communicator:
    return _comms[index]


def host_summed(comm: Communicator, identity: Identity, buf: Tensor, direction: str, traced: bool = False) -> Tensor:
    """:func:`hvd_syncbn.comm.allreduce` of a float64 buffer over ``comm``; ``traced`` (the
    custom op of a compiled step): the first call of each layer and direction waits
    :func:`hvd_syncbn.settings.compile_timeout` more, as a peer may still be compiling."""
    call = identity.call(comm, direction)
    timeout = collective_timeout(traced and call.step == 0)
    join = joiner(comm, buf.device)
    payload = buf.detach()
    if join is prepend:  # host memory: a CUDA buffer crosses once, a copy that waits for the device
        payload = payload.cpu().numpy()
    out = allreduce(comm, payload, call, timeout, join=join)
    return torch.as_tensor(out).to(buf.device, non_blocking=True)


@torch.library.custom_op("hvd_syncbn::allreduce", mutates_args=(),
                         tags=tuple(getattr(torch.Tag, t) for t in ("cudagraph_unsafe",) if hasattr(torch.Tag, t)))
def _allreduce(buf: Tensor, comm: int, layer: str, direction: str, channels: int, ndim: int, dtype: str) -> Tensor:
    """:func:`host_summed` over ``_comms[comm]`` under ``torch.compile``."""
    if buf.dtype != torch.float64:  # what its fake returns must be what it returns
        raise TypeError(f"hvd_syncbn::allreduce: expected a float64 buffer, got {buf.dtype}")
    return host_summed(_comms[comm], Identity(layer, channels, ndim, dtype), buf, direction, traced=True)


@_allreduce.register_fake
def _(buf, comm, layer, direction, channels, ndim, dtype):
    return torch.empty_like(buf)


def joiner(comm: Communicator, device: torch.device) -> Join:
    """How the custom op's buffers on ``device`` reach ``comm``: CUDA buffers as they are
    where the transport reads device memory (``comm.device_buffers``: Horovod built with
    GPU support, CUDA-aware MPI), after the collective's one wait for the device (the
    transport reads from the host's side); anything else as numpy
    (:func:`hvd_syncbn.comm.prepend`)."""
    if device.type != "cuda" or not comm.device_buffers:
        return prepend

    def join(head: List[float], payload) -> Tensor:
        head_t = torch.tensor(head, dtype=torch.float64, pin_memory=True)
        payload = torch.as_tensor(payload, dtype=torch.float64, device=device)  # poison's are numpy zeros
        out = torch.cat([head_t.to(device, non_blocking=True), payload])
        torch.cuda.current_stream(device).synchronize()
        return out

    return join


class OpReducer:
    """Tensors over Horovod or MPI (:func:`host_summed`; under ``torch.compile`` its custom op)."""

    def __init__(self, comm: Communicator, identity: Identity, device: torch.device) -> None:
        self.comm, self.identity = comm, identity
        self.index, self.device, self.size = comm_index(comm), device, comm.size

    @staticmethod
    def head(direction: str) -> Tuple[float, ...]:
        """Nothing: the step-counted header goes in front on the host and is checked there."""
        return ()

    def __call__(self, buf: Tensor, direction: str) -> Tensor:
        if torch.compiler.is_compiling():
            return _allreduce(buf, self.index, self.identity.layer, direction, *self.identity[1:])
        return host_summed(self.comm, self.identity, buf, direction)

    def fail(self, problem: str, error: type = SyncBatchNormInputError,
             cause: Optional[BaseException] = None, joins: bool = True) -> None:
        """Join the forward collective the peers wait in with a header none matches, then
        raise ``problem`` after the diagnosis (:func:`hvd_syncbn.comm.poison`; always joins)."""
        poison(self.comm, self.identity.call(self.comm, "fwd"), problem, error, cause,
               join=joiner(self.comm, self.device))


def summed(comm: Communicator, identity: Identity, buf: Tensor, direction: str, traced: bool = False) -> Tensor:
    """``buf`` summed over ``comm``'s group (a ``torch.distributed`` one: SyncBN's own, see
    :class:`~hvd_syncbn.torch.transports.TorchDistComm`) by a functional collective,
    waiting the group's timeout: SyncBN's (``traced``, the custom op of a compiled step:
    more for a layer's first collective in a direction, as a peer may still be compiling).
    If the collective fails (Gloo's timeout, a peer gone), the ranks that can still talk
    diagnose over the side channel and raise :class:`SyncBatchNormError` naming the
    layer, the direction, the step and the missing ranks
    (:func:`hvd_syncbn.diagnosis.fail`). NCCL's collectives do not block the host: its
    watchdog ends the process at the timeout (docs/failures.md)."""
    call = identity.call(comm, direction)
    first = traced and call.step == 0
    if comm.group is None:
        comm.set_up(call, first)
    comm.bound(first)
    since = time.monotonic()
    c10d = torch.ops._c10d_functional
    waiting = blocking(comm, call, since, comm.seconds)  # a watchdog thread warns while Gloo blocks
    try:
        # The functional collective's own ops, below autograd (its callers are autograd
        # Functions or an op): the ops' Python autograd kernel took two thirds of their host
        # time (all_reduce + wait: 14.6 µs, 5.0 below it, on a 2-core CPU).
        with torch._C._AutoDispatchBelowAutograd():
            return c10d.wait_tensor(c10d.all_reduce(buf, "sum", comm.group.group_name))
    except RuntimeError as e:  # torch's DistBackendError and Gloo's errors are RuntimeErrors
        text = re.sub(r"^\[[^\]]*\] ", "", str(e).splitlines()[0] if str(e) else "")  # Gloo's source line
        fail(comm, call, f"the collective failed after {time.monotonic() - since:.1f} s (timeout {comm.seconds:g} s, "
                         f"{TIMEOUT_ENV}): {type(e).__name__}: {text}", since=since, stuck=True, cause=e)
    finally:
        unblocked(waiting)


@torch.library.custom_op("hvd_syncbn::group_allreduce", mutates_args=(),
                         tags=tuple(getattr(torch.Tag, t) for t in ("cudagraph_unsafe",) if hasattr(torch.Tag, t)))
def _group_allreduce(buf: Tensor, comm: int, layer: str, direction: str, channels: int, ndim: int,
                     dtype: str) -> Tensor:
    """:func:`summed` under ``torch.compile``: the collective's failure turns into the
    diagnosis in Python, which a traced collective would not reach."""
    return summed(_comms[comm], Identity(layer, channels, ndim, dtype), buf, direction, traced=True)


@_group_allreduce.register_fake
def _(buf, comm, layer, direction, channels, ndim, dtype):
    return torch.empty_like(buf)


@torch.compiler.assume_constant_result
class GroupReducer:
    """Device tensors over a ``torch.distributed`` group by :func:`summed` (under
    ``torch.compile``, its custom op). The identity header travels in the buffer and is
    checked on the device (:mod:`hvd_syncbn.torch.device`): :meth:`head` is what to put
    in front."""

    def __init__(self, comm: Communicator, identity: Identity) -> None:
        # Traced, a layer's comm is one batchnorm._traced_comm registered: the index is found, not added.
        self.comm, self.identity, self.size, self.index = comm, identity, comm.size, comm_index(comm)

    def head(self, direction: str) -> Tuple[float, ...]:
        """The static header of ``direction``'s collective (no step: it is traced once)."""
        header = _traced_header if torch.compiler.is_compiling() else _known_header
        return header(*self.identity[:1], direction, *self.identity[1:], self.size)

    def __call__(self, buf: Tensor, direction: str) -> Tensor:
        if torch.compiler.is_compiling():
            return _group_allreduce(buf, self.index, self.identity.layer, direction, *self.identity[1:])
        return summed(self.comm, self.identity, buf, direction)

    def diagnose(self, problem: str) -> None:
        """Raise :class:`SyncBatchNormError` for ``problem`` in the step's forward collective
        after the diagnosis over the side channel, which every rank (each saw the same sum)
        joins: it names the layer each rank was in."""
        fail(self.comm, self.identity.current(self.comm, "fwd"), problem)

    @torch.compiler.disable  # the diagnosis runs in Python: Dynamo would try to trace it
    def fail(self, problem: str, error: type = SyncBatchNormInputError,
             cause: Optional[BaseException] = None, joins: bool = False) -> None:
        """Raise ``problem`` here after the diagnosis: every rank names this rank and
        ``problem``. ``joins`` (the peers check their step's header at once): first join
        the forward collective they wait in, with a header none matches, so they diagnose
        at once and the group stays usable; else they meet the diagnosis when their
        collective times out (no host read on their side)."""
        call = self.identity.call(self.comm, "fwd")
        if joins:
            poison(self.comm, call, problem, error, cause)  # raises, after the diagnosis
        call.problem = problem
        fail(self.comm, call, problem, error, cause=cause)
