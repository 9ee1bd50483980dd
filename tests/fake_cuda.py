"""Fake CUDA on a CPU-only torch: the PyTorch layer's GPU path run without a GPU, for the
fake-CUDA tier (``fake_cuda_tier.py``).

- :func:`boot`, run by importing this module, which must come before torch's import:
  ``fake_cuda_shim.cpp`` (built once per torch with g++, about 3 s, and cached) gives
  CUDA a no-op device guard and hooks that say CUDA is built, which the autograd engine
  asks about every CUDA tensor.
- :class:`FakeCuda`: a ``FakeTensorMode`` (CUDA tensors with shapes, dtypes, strides and
  a device but no data; it refuses ops that mix devices, but for CPU scalars), torch's
  CUDA-only batch-norm kernels given (a CUDA kernel that only says it exists, so that
  the layer's ``auto`` picks the native set as on a CUDA build; a Meta kernel that
  returns what CUDA's returns), and above it a :class:`Recorder`, which sees each op
  first.

Host memory is real: a copy from fake device memory to the host gives zeros, so that
host code (a transport's numpy buffers, ``check(model)``) runs on.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import List, NamedTuple, Tuple

ROOT = Path(__file__).resolve().parents[1]
SHIM = Path(__file__).with_name("fake_cuda_shim.cpp")
SOURCES = (str(ROOT / "hvd_syncbn"), str(ROOT / "tests"))
"""Where an op is issued from (the innermost such frame), for the record."""


def boot() -> None:
    """Build (once per torch and shim source) and load the shim. Before torch is
    imported: torch asks for its CUDA hooks once, at import."""
    if "torch" in sys.modules:
        raise RuntimeError("fake_cuda.boot(): expected to run before torch is imported, got torch imported already "
                           "(run the tier in a process of its own: tests/test_fake_cuda.py does)")
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    key = hashlib.sha256(SHIM.read_bytes() + importlib.metadata.version("torch").encode()).hexdigest()[:16]
    cache = Path(os.environ.get("HVD_SYNCBN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "hvd_syncbn")
    lib = cache / f"fake_cuda-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / lib.name
            # torch's wheels are built with the C++11 ABI (2.6 and later, every platform)
            subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-std=c++20", "-D_GLIBCXX_USE_CXX11_ABI=1", "-w",
                            f"-I{torch_dir}/include", f"-I{torch_dir}/include/torch/csrc/api/include", str(SHIM),
                            f"-L{torch_dir}/lib", f"-Wl,-rpath,{torch_dir}/lib", "-lc10", "-ltorch_cpu", "-o",
                            str(out)], check=True)
            os.replace(out, lib)
    ctypes.CDLL(str(lib))


boot()  # importing this module boots fake CUDA: before torch
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.weak import WeakTensorKeyDictionary  # noqa: E402

import cuda_kernels  # noqa: E402

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.is_nonzero.default, aten.equal.default}
"""Ops that read a tensor's value on the host: on CUDA each waits for the device."""


class Op(NamedTuple):
    """One dispatched op: its name, the devices of its tensors (arguments, then results),
    the kind of problem it is on a GPU (``""``: none), the line that issued it and
    whether it is a view (no kernel launch)."""

    name: str
    devices: Tuple[str, ...]
    problem: str
    line: str
    view: bool = False

    def __str__(self) -> str:
        return f"{self.name} {self.problem or ''} ({', '.join(self.devices)}) at {self.line}".replace("  ", " ")


def issuer() -> str:
    """The innermost frame of this project's code (the package, the tests) below the modes."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename.startswith(SOURCES) and not frame.filename.endswith("fake_cuda.py"):
            return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"
    return "?"


def kind(t: torch.Tensor) -> str:
    return t.device.type


def classify(func, args, kwargs, out) -> str:
    """What ``func`` costs or breaks on a GPU, by its tensors' devices: a host read of a
    CUDA tensor, a copy between host and device (``H2D``, ``D2H``), a CPU tensor in an
    op on CUDA tensors; ``""`` for none."""
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    devices = {kind(t) for t in ins}
    if func in HOST_READS or (func is aten.index.Tensor and any(
            t is not None and t.dtype == torch.bool for t in args[1])):
        return "host read" if "cuda" in devices else ""
    if func in (aten._to_copy.default, aten.copy_.default):
        src, dst = (args[0], outs[0]) if func is aten._to_copy.default else (args[1], args[0])
        if {kind(src), kind(dst)} == {"cpu", "cuda"}:
            return "H2D copy" if kind(src) == "cpu" else "D2H copy"
        return ""
    return "CPU tensor in a CUDA op" if devices == {"cpu", "cuda"} else ""


class Recorder(TorchDispatchMode):
    """Records every op (:class:`Op`) of ``phase`` (a label its user sets) into ``ops``,
    and checks each call of a CUDA kernel of :data:`cuda_kernels.CONTRACTS` on CUDA
    tensors against its contract (raising as CUDA would). A host read of fake device
    memory raises (it has no data); a copy of it to the host gives zeros, on which ops
    run for real."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Tuple[str, Op]] = []
        self.phase = ""
        self.host = WeakTensorKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and all(t in self.host for t in tensors):
            with unset_fake_temporarily():  # real host memory (a copy from the device): real ops
                return self.on_host(func(*args, **kwargs))
        contract = cuda_kernels.CONTRACTS.get(func._schema.name.replace("aten::", ""))
        if contract is not None and any(t.is_cuda for t in tensors):
            contract(*args, **kwargs)
        problem = classify(func, args, kwargs, None) if func is not aten._to_copy.default else ""
        if problem == "host read":
            self.ops.append((self.phase, Op(str(func), tuple(kind(t) for t in tensors), problem, issuer())))
            raise RuntimeError(f"fake CUDA: a host read of a CUDA tensor ({func}) at {issuer()}: on a GPU a sync")
        out = func(*args, **kwargs)
        problem = classify(func, args, kwargs, out)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((self.phase, Op(str(func).replace("aten.", ""), tuple(kind(t) for t in tensors + outs),
                                        problem, issuer(), func.is_view)))
        if problem == "D2H copy" and func is aten._to_copy.default:
            with unset_fake_temporarily():  # host memory is real: what fake device memory holds reads as zeros
                return self.on_host(torch.zeros(out.shape, dtype=out.dtype))
        return out

    def on_host(self, out):
        """``out``'s tensors marked as real host memory: ops on them alone run for real."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.host[t] = True
        return out

    def of(self, phase: str, problems: bool = False) -> List[Op]:
        """The ops of ``phase`` (only those with a problem where ``problems``)."""
        return [op for p, op in self.ops if p == phase and (op.problem or not problems)]

    @contextlib.contextmanager
    def recording(self, phase: str):
        self.phase = phase
        try:
            yield
        finally:
            self.phase = ""


def meta_outputs(name: str):
    """The Meta kernel of a CUDA-only op: its outputs as CUDA makes them (shapes, dtypes,
    memory formats), nothing computed."""

    def update_stats(x, running_mean, running_var, momentum):
        acc = cuda_kernels.acc_of(name, x)
        return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)

    def elemt(x, weight, bias, mean, invstd, eps):
        return torch.empty_like(x, memory_format=cuda_kernels.suggest_memory_format(x))

    def backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
        sums = [mean.new_empty(x.shape[1]) if input_g else None] * 2
        grads = [weight.new_empty(x.shape[1]) if flag else None for flag in (weight_g, bias_g)]
        return (*sums, *grads)

    def backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        if cuda_kernels.channels_last_kernels(dy):
            return torch.empty_like(x)
        return torch.empty(x.shape, dtype=dy.dtype, device=x.device)

    return {"batch_norm_update_stats": update_stats, "batch_norm_elemt": elemt,
            "batch_norm_backward_reduce": backward_reduce, "batch_norm_backward_elemt": backward_elemt}[name]


def no_data(*args, **kwargs):
    raise RuntimeError("fake CUDA: a CUDA kernel called on real tensors (there are none here)")


class FakeCuda:
    """The fake-CUDA world of one test: ``with FakeCuda() as fake:`` makes ``torch.device("cuda")``
    the default device, fake tensors of everything made inside, and ``fake.recorder``
    the :class:`Recorder`."""

    NATIVE = ("batch_norm_update_stats", "batch_norm_elemt", "batch_norm_backward_reduce", "batch_norm_backward_elemt")

    def __init__(self) -> None:
        self.recorder = Recorder()
        self.mode = FakeTensorMode()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "FakeCuda":
        from hvd_syncbn.torch.kernels import missing_kernels

        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel" (update_stats's Meta)
            warnings.simplefilter("ignore")
            for name in self.NATIVE:
                lib.impl(name, meta_outputs(name), "Meta")
                lib.impl(name, no_data, "CUDA")
        self._stack.callback(lib._destroy)
        self._stack.callback(missing_kernels.cache_clear)
        missing_kernels.cache_clear()  # the layers ask the dispatcher once per process
        for context in (self.mode, self.recorder, torch.device("cuda")):
            self._stack.enter_context(context)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
