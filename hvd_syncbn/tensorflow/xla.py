"""A float64 allreduce (sum) over MPI that runs inside ``tf.function(jit_compile=True)`` on CPU,
and outside XLA as a plain TensorFlow op.

One library (``xla_allreduce.cc``, built by :mod:`hvd_syncbn.tensorflow.xla_build`), one
loop: ``MPI_Iallreduce`` polled with ``MPI_Test`` until a deadline, then an error naming
the collective. Inside XLA it is an XLA FFI handler registered for XLA's ``"Host"``
platform, emitted as a StableHLO ``custom_call`` (``api_version = 4``, typed FFI) inside an
``XlaCallModule`` op; outside XLA (eager, plain ``tf.function``) the library's CPU kernel
``HvdSyncbnAllreduce`` runs it (there the XLA call compiled on its own cost about 45 µs
more per collective, in a training step at 2 ranks). :func:`checked_allreduce` also sums an
identity header in front of the buffer and reports where it did not add up; what the
header identifies is the caller's. A collective that fails (the deadline, MPI) counts as
step the calls of its name before it; the caller may give it a diagnosis
(:func:`on_failure`), which writes the error's message.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import tensorflow as tf

from hvd_syncbn import launchers
from hvd_syncbn.tensorflow.xla_build import BUILD_COMMAND, library_path

TARGET = "hvd_syncbn_allreduce"
# TensorFlow exports the FFI API table's getter as a C++ function (xla/ffi/ffi_api.h);
# there is no C symbol for it. Only this name depends on TensorFlow's C++ ABI.
_GET_API = "_ZN3xla3ffi12GetXlaFfiApiEv"  # xla::ffi::GetXlaFfiApi()
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_kernel: Any = None  # the library's TensorFlow ops (tf.load_op_library)
_world: Any = None  # the default communicator: a duplicate of MPI.COMM_WORLD
# Per graph being traced, the name of the last allreduce op in it (a name, not the op:
# the op would keep its graph, the key, alive).
_last: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
# Per (communicator handle, collective name), what diagnoses its failure (on_failure).
_diagnoses: Dict[Tuple[int, str], Callable[[int, float, str], None]] = {}
# Per (communicator handle, collective name), what makes a long wait's Waiting (on_slow);
# per (handle, name, step), the waits in progress that are long.
_slows: Dict[Tuple[int, str], Callable[[int, float], Any]] = {}
_waits: Dict[Tuple[int, str, int], Any] = {}


def available() -> Optional[str]:
    """``None`` when :func:`allreduce` can run here, else why not (and what to do)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed: pip install mpi4py (it needs an MPI library, e.g. Open MPI)"
    if tf.config.list_physical_devices("GPU"):
        return ("a GPU is visible: the XLA allreduce has a host (CPU) target only; no CUDA target "
                "is shipped")
    if not library_path().exists():
        return (f"the XLA allreduce is not built for TensorFlow {tf.__version__} (no {library_path()}): "
                f"run {BUILD_COMMAND} (launch/install.sh does)")
    if _tensorflow_ffi() is None:
        return f"this TensorFlow ({tf.__version__}) exports no xla::ffi::GetXlaFfiApi to register an XLA FFI handler"
    return None


def _tensorflow_ffi() -> Optional[ctypes._CFuncPtr]:
    """TensorFlow's ``xla::ffi::GetXlaFfiApi`` (in ``libtensorflow_cc``), or None."""
    path = os.path.join(os.path.dirname(tf.__file__), "libtensorflow_cc.so.2")
    try:
        getter = ctypes.CDLL(path)[_GET_API]
    except (OSError, AttributeError):
        return None
    getter.restype = ctypes.c_void_p
    return getter


def load() -> ctypes.CDLL:
    """Load the library and register its handler with this process's XLA, once.

    Raises ``RuntimeError`` saying what is missing (:func:`available`), or when the launch
    has several processes but MPI's world only this one (horovodrun with Gloo, torchrun).
    """
    global _lib, _kernel
    with _lock:
        if _lib is not None:
            return _lib
        reason = available()
        if reason is not None:
            raise RuntimeError(f"hvd_syncbn XLA allreduce: {reason}")
        from mpi4py import MPI  # initialises MPI before any collective

        declared = launchers.world_size()
        if declared and declared > 1 and MPI.COMM_WORLD.Get_size() == 1:  # e.g. horovodrun with Gloo
            raise RuntimeError(f"hvd_syncbn XLA allreduce: {launchers.launcher()} started {declared} processes, "
                               "but MPI sees this one alone: the XLA allreduce sums over MPI; launch with mpirun")
        _kernel = tf.load_op_library(str(library_path()))  # registers HvdSyncbnAllreduce
        lib = ctypes.CDLL(str(library_path()))
        lib.hvd_syncbn_xla_register.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.hvd_syncbn_xla_stuck.restype = ctypes.c_int64
        lib.hvd_syncbn_xla_calls.restype = ctypes.c_int64
        lib.hvd_syncbn_xla_calls.argtypes = [ctypes.c_int64, ctypes.c_char_p]
        error = ctypes.create_string_buffer(1024)
        if lib.hvd_syncbn_xla_register(_tensorflow_ffi()(), TARGET.encode(), error, len(error)) != 0:
            raise RuntimeError(f"hvd_syncbn XLA allreduce: registering {TARGET!r} with XLA failed: "
                               f"{error.value.decode(errors='replace')}")
        lib.hvd_syncbn_xla_set_diagnose(_diagnose)
        lib.hvd_syncbn_xla_set_slow.argtypes = [ctypes.c_void_p, ctypes.c_double]
        lib.hvd_syncbn_xla_set_slow(ctypes.cast(_slow, ctypes.c_void_p), first_check())
        atexit.register(_abort_if_stuck, lib, MPI)
        _lib = lib
        return lib


def _abort_if_stuck(lib: ctypes.CDLL, MPI: Any) -> None:
    """A timed-out collective is still pending in MPI (collectives cannot be cancelled):
    abort rather than hang in ``MPI_Finalize``."""
    if lib.hvd_syncbn_xla_stuck() > 0:
        MPI.COMM_WORLD.Abort(1)


def on_failure(name: str, comm: Any, diagnose: Callable[[int, float, str], None]) -> None:
    """Where the collective ``name`` over ``comm`` (an mpi4py communicator) fails, call
    ``diagnose(step, since, reason)`` (``step``: this process's earlier calls of it;
    ``since``: when it began, ``time.monotonic()``'s; ``reason``: the library's message)
    on the op's thread: the message of the
    :class:`~hvd_syncbn.errors.SyncBatchNormError` it raises becomes the op's error's."""
    from mpi4py import MPI

    _diagnoses[MPI._handleof(comm), name] = diagnose


def on_slow(name: str, comm: Any, waiting: Callable[[int, float], Any]) -> None:
    """Where the collective ``name`` over ``comm`` (an mpi4py communicator) waits long, make
    its :class:`~hvd_syncbn.waiting.Waiting` by ``waiting(step, since)`` and check it, on
    the op's thread, until the wait ends: it warns."""
    from mpi4py import MPI

    _slows[MPI._handleof(comm), name] = waiting


def first_check() -> float:
    """Seconds of a wait before the library first calls the slow hook: a waiting rank's first
    step (:data:`hvd_syncbn.waiting.MARK_S`, half the warning time at most)."""
    from hvd_syncbn.settings import warn_after
    from hvd_syncbn.waiting import MARK_S

    return min(MARK_S, warn_after() / 2)


@ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double)
def _slow(name: bytes, comm: int, step: int, waited: float) -> float:
    """The library's hook for a long wait: check its Waiting, return the seconds until the
    next check; ``waited < 0``: the wait ended."""
    key = (comm, name.decode(errors="replace"), step)
    try:
        if waited < 0:
            waiting = _waits.pop(key, None)
            if waiting is not None:
                waiting.end()
            return 0.0
        if key not in _waits:
            make = _slows.get(key[:2])
            if make is None:
                return 0.0
            _waits[key] = make(step, time.monotonic() - waited)
        now = time.monotonic()
        waiting = _waits[key]
        waiting.check(now)
        return max(0.01, min(waiting.next, waiting.since + waiting.timeout) - now)
    except Exception:  # noqa: BLE001 - a warning never breaks the collective
        return 0.0


def calls(name: str, comm: Any) -> int:
    """This process's calls so far of the collective ``name`` over ``comm`` (an mpi4py
    communicator): the step of its next one."""
    from mpi4py import MPI

    return int(load().hvd_syncbn_xla_calls(MPI._handleof(comm), name.encode()))


@ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, ctypes.c_char_p,
                  ctypes.c_void_p, ctypes.c_size_t)
def _diagnose(name: bytes, comm: int, step: int, waited: float, reason: bytes, out: int, size: int) -> int:
    """The library's hook for a failed collective: 0 where ``out`` holds the message."""
    from hvd_syncbn.errors import SyncBatchNormError

    diagnose = _diagnoses.get((comm, name.decode(errors="replace")))
    if diagnose is None:
        return 1
    try:
        diagnose(step, time.monotonic() - waited, reason.decode(errors="replace"))
    except SyncBatchNormError as e:
        text = f"{type(e).__name__}: {e}".encode(errors="replace")[:size - 1] + b"\0"
        ctypes.memmove(out, text, len(text))
        return 0
    except Exception:  # noqa: BLE001 - the library's message stands
        return 1
    return 1


def default_comm() -> Any:
    """The communicator :func:`allreduce` uses by default: one duplicate of ``COMM_WORLD``,
    made as SyncBN's MPI communicators are (a rank whose peers never make it raises at
    the timeout, naming them)."""
    global _world
    with _lock:
        if _world is None:
            from hvd_syncbn.mpi import MpiCommunicator

            _world = MpiCommunicator(layer="the XLA allreduce").comm
        return _world


def in_xla() -> bool:
    """Whether the code being traced is inside an XLA compilation context
    (``jit_compile=True`` or an XLA cluster). Uses TensorFlow's internal
    ``control_flow_util.GraphOrParentsInXlaContext``."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def allreduce(buf: Any, name: str, comm: Any = None, timeout: Optional[float] = None) -> tf.Tensor:
    """Sum a 1-D float64 tensor over the ranks of ``comm``; a tensor of the same shape.

    Inside ``jit_compile=True`` it is one XLA custom call; eagerly and in a plain
    ``tf.function`` the library's TensorFlow kernel (a function traced outside XLA and
    then called inside it therefore fails to compile: trace it inside). Calls traced into
    one graph run in the order they were traced (each takes the previous one's result as
    an extra operand).

    Args:
        buf: 1-D float64 tensor of a static length.
        name: The collective's name, in the error when the other ranks do not join.
        comm: An mpi4py communicator, which must outlive the compiled function (default:
            :func:`default_comm`, a duplicate of ``COMM_WORLD``). Every rank of it must
            run the same calls in the same order.
        timeout: Seconds to wait for the other ranks (default:
            :func:`hvd_syncbn.settings.get_timeout`, ``$HVD_SYNCBN_TIMEOUT``); fixed when traced.

    Raises:
        RuntimeError: the library is not available (:func:`available` says why).
        ValueError: ``buf`` is not a 1-D float64 tensor of a static length.
        tf.errors.DeadlineExceededError: when run, if the other ranks did not join in time.
    """
    return checked_allreduce(buf, name, (), comm, timeout)[0]


@tf.autograph.experimental.do_not_convert
def checked_allreduce(buf: Any, name: str, header: Sequence[float], comm: Any = None,
                      timeout: Optional[float] = None) -> Tuple[tf.Tensor, tf.Tensor]:
    """:func:`allreduce` of ``header`` followed by ``buf``, in one collective: ``(sum of buf,
    mismatch)``, ``mismatch`` a boolean scalar, true (and the sum all NaN) where the
    header's sum is not ``comm``'s size times ``header`` (the ranks summed different
    collectives). ``header``: integers below 2**53 whose sum over the ranks is exact
    (:func:`hvd_syncbn.identity.static_header`'s), fixed when traced."""
    from mpi4py import MPI
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops
    from tensorflow.compiler.tf2xla.python import xla as tf_xla

    from hvd_syncbn.settings import get_timeout

    load()
    buf = tf.convert_to_tensor(buf)
    if buf.dtype != tf.float64 or buf.shape.rank != 1 or buf.shape[0] is None:
        raise ValueError(f"allreduce {name!r}: expected a 1-D float64 tensor of a static length, "
                         f"got {buf.dtype.name} of shape {buf.shape}")
    timeout = get_timeout() if timeout is None else float(timeout)
    header = [int(h) for h in header]
    handle = MPI._handleof(default_comm() if comm is None else comm)
    order = _previous()
    operands = [buf] + ([order] if order is not None else [])  # the buffer, then what it follows
    if not in_xla():
        out, mismatch = _kernel.hvd_syncbn_allreduce(buf=buf, order=operands[1:], comm=handle, timeout=timeout,
                                                     label=name, header=header, name="hvd_syncbn_allreduce")
        _remember(out)
        return out, mismatch
    attributes = (f"comm = {handle} : i64, timeout = {timeout:.6e} : f64, name = {_mlir_string(name)}, "
                  f"header = array<i64{': ' if header else ''}{', '.join(map(str, header))}>")
    out, mismatch = gen_xla_ops.xla_call_module(
        operands, version=tf_xla.call_module_maximum_supported_version(), module=_module(operands, attributes),
        Sout=[buf.shape, []], Tout=[tf.float64, tf.bool], platforms=["CPU"], name="hvd_syncbn_xla_allreduce")
    _remember(out)
    return out, mismatch


def _module(operands: list, attributes: str) -> bytes:
    """A serialized StableHLO module whose ``main`` is our custom call on ``operands``,
    with the typed-FFI ``attributes`` (an MLIR dictionary's body): the sum and the mismatch."""
    from tensorflow.compiler.mlir.stablehlo import stablehlo

    types = [_mlir_type(t) for t in operands]
    params = ", ".join(f"%arg{i}: {t}" for i, t in enumerate(types))
    args = ", ".join(f"%arg{i}" for i in range(len(types)))
    results = f"{types[0]}, tensor<i1>"
    text = f"""module @hvd_syncbn {{
  func.func public @main({params}) -> ({results}) {{
    %0:2 = stablehlo.custom_call @{TARGET}({args}) {{api_version = 4 : i32, has_side_effect = true,
        backend_config = {{{attributes}}}}} : ({", ".join(types)}) -> ({results})
    return %0#0, %0#1 : {results}
  }}
}}"""
    return stablehlo.serialize_portable_artifact_str(text, stablehlo.get_current_version())


def _mlir_type(t: tf.Tensor) -> str:
    return f"tensor<{t.shape[0]}xf64>" if t.shape.rank == 1 else "tensor<f64>"


def _mlir_string(text: str) -> str:
    """``text`` as an MLIR string literal (bytes other than printable ASCII as ``\\XX``)."""
    return '"' + "".join(chr(b) if 32 <= b < 127 and chr(b) not in '"\\' else f"\\{b:02X}"
                         for b in text.encode("utf-8")) + '"'


def _previous() -> Optional[tf.Tensor]:
    """A scalar of the last allreduce traced into this graph (None eagerly or if none)."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    if graph not in _last:
        return None
    last = graph.get_operation_by_name(_last[graph]).outputs[0]
    return last[0] if last.shape[0] else None


def _remember(out: tf.Tensor) -> None:
    if not tf.executing_eagerly():
        _last[out.graph] = out.op.name
