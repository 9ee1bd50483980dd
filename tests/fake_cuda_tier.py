"""The fake-CUDA tier: the PyTorch layer's GPU path on CUDA tensors without a GPU
(``fake_cuda.py``), over a fake ``torch.distributed`` world of 2 ranks (``FakeStore``: its
collectives leave each buffer as it is).

Per input layout, dtype, option and kernel set (``auto`` picking the native set, as on a
CUDA build), for one layer, a torchvision ResNet-18 and a DeepLabV3 head: two training
steps, an eval forward and ``check(model)``. Each step, the first included, must make no
host read, no copy between host and device and no op with a CPU tensor among CUDA
tensors (``check``, ``train()`` and ``eval()`` are the host points); every output,
gradient and buffer stays on the device in its dtype; every call of a CUDA kernel keeps
its CUDA contract (``cuda_kernels.CONTRACTS``); a layer step keeps the op budget of its
kernel set. Over Horovod or MPI (a local communicator) each collective makes one copy to
the host and one back, and nothing else. The last tests plant each defect the tier
guards against and show that it is caught.

Fake CUDA cannot look at: numerics (fake tensors hold no data), streams and their
ordering, NCCL, CUDA graphs, ``torch.compile`` on CUDA, ``nn.DataParallel``'s replicas,
and what a kernel costs. ``benchmarks/gpu_check.py`` is the check on a GPU.

Runs in a process of its own (``test_fake_cuda.py``): the shim must load before torch.
"""

from __future__ import annotations

import fake_cuda  # first: it boots fake CUDA, before torch is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402

from hvd_syncbn.communicator import LocalCommunicator  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm, check, convert_sync_batchnorm  # noqa: E402
from hvd_syncbn.torch import device as device_module, kernels  # noqa: E402
from hvd_syncbn.torch.kernels import Composite, Native, kernels_for  # noqa: E402

BUDGETS = {"native": 28, "composite": 35}
"""Ops a float32 layer step dispatches besides its collectives and views
(``momentum=None``: 3 more), as ``tests/unit/test_kernels.py`` counts them on the CPU."""


@pytest.fixture(scope="module", autouse=True)
def world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.fixture(params=["auto", "composite"])
def kernel_set(request, monkeypatch):
    """``auto`` (the native set, as on a CUDA build) or ``composite``, by ``$HVD_SYNCBN_KERNELS``."""
    if request.param == "auto":
        monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.KERNELS_ENV, request.param)
    return request.param


@pytest.fixture
def fake():
    with fake_cuda.FakeCuda() as world:
        yield world


def problems(fake, phase: str) -> list:
    return [str(op) for op in fake.recorder.of(phase, problems=True)]


def layer_ops(fake, phase: str) -> list:
    """The ops the package dispatched in ``phase``, views and collectives aside (each of
    the others is a kernel launch)."""
    return [op.name for op in fake.recorder.of(phase) if op.line.startswith("hvd_syncbn/")
            and not op.view and not op.name.startswith(("_c10d_functional.", "prim."))]


def train_steps(fake, model: nn.Module, make_input, steps: int = 2) -> list:
    """``steps`` training steps of ``model`` (recorded as ``"step k"``), then an eval forward
    (``"eval"``) and ``check(model)``; each step's input and output."""
    seen = []
    model.train()
    for step in range(1, steps + 1):
        x = make_input().requires_grad_()
        for p in model.parameters():
            p.grad = None
        with fake.recorder.recording(f"step {step}"):
            y = model(x)
            y.float().square().sum().backward()
        seen.append((x, y))
    check(model)
    model.eval()
    with fake.recorder.recording("eval"), torch.no_grad():
        model(make_input())
    check(model)
    return seen


def assert_on_the_device(model: nn.Module, seen: list, dtypes: dict) -> None:
    """Every output, input gradient, parameter, gradient and buffer on CUDA, in its dtype
    (``dtypes``: of each parameter and buffer by name, as before the steps)."""
    for x, y in seen:
        assert y.is_cuda and y.dtype == x.dtype, (y.device, y.dtype, x.dtype)
        assert x.grad is not None and x.grad.is_cuda and x.grad.dtype == x.dtype and x.grad.shape == x.shape
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.is_cuda and t.dtype == dtypes[name], (name, t.device, t.dtype, dtypes[name])
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.is_cuda and p.grad.dtype == p.dtype, (name, p.grad)


def dtypes_of(model: nn.Module) -> dict:
    return {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_clean(fake, phases=("step 1", "step 2", "eval")) -> None:
    for phase in phases:
        assert problems(fake, phase) == [], f"{phase}: {problems(fake, phase)}"


LAYOUTS = {"(N, C)": ((6, 5), None), "(N, C, L)": ((4, 5, 7), None), "4-D": ((3, 5, 4, 4), None),
           "5-D": ((2, 5, 3, 3, 3), None), "channels_last": ((3, 5, 4, 4), torch.channels_last),
           "channels_last_3d": ((2, 5, 3, 3, 3), torch.channels_last_3d)}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OPTIONS = {"affine=False": dict(affine=False), "track_running_stats=False": dict(track_running_stats=False),
           "momentum=None": dict(momentum=None)}


def one_layer(fake, shape, fmt=None, dtype=torch.float32, rows=None, **options):
    """A layer (float32 parameters) through :func:`train_steps` on ``shape`` inputs of
    ``dtype`` (``rows`` rows: an empty shard where 0)."""
    layer = SyncBatchNorm(shape[1], **options)
    before = dtypes_of(layer)
    size = (shape[0] if rows is None else rows, *shape[1:])
    seen = train_steps(fake, layer, lambda: torch.randn(size, dtype=dtype).contiguous(
        memory_format=fmt or torch.contiguous_format))
    assert_on_the_device(layer, seen, before)
    assert all(y.shape == x.shape for x, y in seen)
    if fmt is not None:
        assert all(y.is_contiguous(memory_format=fmt) for _, y in seen), "the output left the input's memory format"
    return layer


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_layer_every_layout_and_dtype(fake, kernel_set, layout, dtype):
    """Steps 1 and 2, eval and ``check``, clean, on the device, in the budget (float32)."""
    shape, fmt = LAYOUTS[layout]
    assert kernels_for(torch.device("cuda")) is (Native if kernel_set == "auto" else Composite)
    one_layer(fake, shape, fmt, dtype)
    assert_clean(fake)
    if dtype == torch.float32:
        ops = layer_ops(fake, "step 2")
        budget = BUDGETS["native" if kernel_set == "auto" else "composite"]
        assert len(ops) <= budget, f"{len(ops)} ops > {budget}: {ops}"
        if kernel_set == "auto":  # the count sees the kernels themselves
            assert {f"{op}.default" for op in fake_cuda.FakeCuda.NATIVE} <= set(ops), ops


@pytest.mark.parametrize("option", [*OPTIONS, "empty shard"])
def test_one_layer_options(fake, kernel_set, option):
    """The layer's options, and a rank with no rows: clean and on the device."""
    if option == "empty shard":
        one_layer(fake, (3, 5, 4, 4), rows=0)
    else:
        one_layer(fake, (3, 5, 4, 4), **OPTIONS[option])
    assert_clean(fake)
    if option == "momentum=None":
        ops = layer_ops(fake, "step 2")
        budget = BUDGETS["native" if kernel_set == "auto" else "composite"] + 3
        assert len(ops) <= budget, f"{len(ops)} ops > {budget}: {ops}"


def vision():
    from vision import import_vision

    return import_vision()[0]


@pytest.mark.parametrize("model", ["resnet18", "deeplabv3 head"])
def test_real_models(fake, kernel_set, model):
    """A converted torchvision ResNet-18 and DeepLabV3's head (ASPP: its pooled branch
    normalizes ``(N, 256, 1, 1)``): clean, on the device."""
    torchvision = vision()
    if model == "resnet18":
        net, shape = torchvision.models.resnet18(num_classes=10), (2, 3, 32, 32)
    else:
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead

        net, shape = DeepLabHead(64, 5), (2, 64, 8, 8)
    net = convert_sync_batchnorm(net)
    assert sum(isinstance(m, SyncBatchNorm) for m in net.modules()) > 1
    before = dtypes_of(net)
    seen = train_steps(fake, net, lambda: torch.randn(shape))
    assert_on_the_device(net, seen, before)
    assert_clean(fake)


def test_horovod_and_mpi_reducers_copy_once_each_way(fake):
    """Over a transport that reads host memory (Horovod, MPI; here a local communicator of
    2), each collective copies its buffer to the host once and the sum back once: 2 and 2
    per training step, no other copy, read or CPU tensor; ``check`` syncs, the step not."""
    layer = SyncBatchNorm(5, comm=LocalCommunicator(2))
    seen = train_steps(fake, layer, lambda: torch.randn(3, 5, 4, 4))
    assert_on_the_device(layer, seen, dtypes_of(SyncBatchNorm(5)))
    for phase in ("step 1", "step 2"):
        kinds = sorted(op.problem for op in fake.recorder.of(phase, problems=True))
        assert kinds == ["D2H copy", "D2H copy", "H2D copy", "H2D copy"], (phase, problems(fake, phase))
        assert all(op.line.startswith("hvd_syncbn/torch/reducers.py") for op in fake.recorder.of(phase, True))
    assert problems(fake, "eval") == []


# The tier's own checks, each shown to fail on the defect it guards against.

def test_recorder_sees_copies_host_reads_and_cpu_scalars(fake):
    """Each problem by itself: a fill from a Python number on a CUDA tensor copies from the
    host; a copy to the host reads as zeros there; a CPU 0-dim tensor in a CUDA op (which
    torch allows) is one too; a host read raises (fake memory has no data)."""
    t = torch.zeros(3)
    with fake.recorder.recording("planted"):
        t[0] = 1.0
        host = t.cpu()
        assert not isinstance(host, FakeTensor) and host.numpy().tolist() == [0.0] * 3
        torch.where(t > 0, t, torch.tensor(0.0, device="cpu"))
        with pytest.raises(RuntimeError, match=r"a host read of a CUDA tensor .*_local_scalar_dense"):
            t.sum().item()
    assert [op.problem for op in fake.recorder.of("planted", True)] == [
        "H2D copy", "D2H copy", "CPU tensor in a CUDA op", "host read"]
    with pytest.raises(RuntimeError, match="found at least two devices"):  # fake mode refuses mixed devices
        t + torch.zeros(3, device="cpu")


def test_planted_defects_in_the_layer_are_caught(fake, monkeypatch):
    """The step's defects, planted in the layer: constants filled as ``t[i] = v`` (copies
    from the host at the first step), a lane on the CPU (a CPU tensor in a CUDA op), a
    host read in the running update, a step in which a layer checks at once."""
    real_on = device_module.Lanes.on

    def planted(name, patch):
        with monkeypatch.context() as m:
            patch(m)
            layer = SyncBatchNorm(5)
            with fake.recorder.recording(name):
                layer(torch.randn(3, 5, 4, 4, requires_grad=True)).sum().backward()
        return sorted({op.problem for op in fake.recorder.of(name, True)})

    def by_setitem(values, device, dtype=torch.float64):
        t = torch.empty(len(values), dtype=dtype, device=device)
        for i, v in enumerate(values):
            t[i] = v
        return t

    assert planted("setitem", lambda m: m.setattr(device_module, "constant", by_setitem)) == ["H2D copy"]
    cpu_nan = torch.tensor(float("nan"), dtype=torch.float64, device="cpu")
    assert planted("cpu lane", lambda m: m.setattr(device_module.Lanes, "on", lambda self, d: real_on(
        self, d)._replace(nan=cpu_nan))) == ["CPU tensor in a CUDA op"]
    with pytest.raises(RuntimeError, match="a host read of a CUDA tensor"):
        planted("item", lambda m: m.setattr(SyncBatchNorm, "_running_update",
                                            lambda self, mean, var, updated: updated.item()))


def test_contracts_refuse_what_cuda_refuses(fake):
    """The CUDA kernels' contracts on fake CUDA tensors: the composite set's former call
    (no ``γ``, its gradients asked: both layouts), an int64 count, ``x`` in another layout
    than ``dy`` for the channels-last backward, float32 statistics of float64 input,
    statistics of another channel count."""
    x, dy = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    zeros, minus = torch.zeros(3), torch.full((3,), -1.0)
    for c in (x, torch.randn(8, 3)):
        with pytest.raises(RuntimeError, match="tensor does not have a device|returns them \\(0,\\)-shaped"):
            torch.ops.aten.native_batch_norm_backward(c, c, None, None, None, zeros, minus, True, 0.0,
                                                      [False, True, True])
    with pytest.raises(RuntimeError, match="Expected count to have type torch.int32"):
        torch.batch_norm_backward_elemt(dy, x, zeros, minus, None, zeros, zeros, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="reads input in its layout"):
        torch.batch_norm_backward_elemt(dy.contiguous(memory_format=torch.channels_last), x, zeros, minus, None,
                                        zeros, zeros, torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"expected mean of shape \(3,\), got \(4,\)"):
        torch.batch_norm_elemt(x, None, None, torch.zeros(4), torch.ones(4), 0.0)
    with pytest.raises(RuntimeError, match="Expected mean to have type torch.float64"):
        torch.ops.aten.native_batch_norm_backward(x.double(), x.double(), torch.ones(3), None, None, zeros, minus,
                                                  True, 0.0, [False, True, True])
