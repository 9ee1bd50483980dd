"""The PyTorch device path in one process: what a GPU pays for, counted on the CPU (the
aten ops a step dispatches, host reads, tensors made from Python data, a step on the
``meta`` device), shape propagation under ``FakeTensorMode``, the deferred checks and
their host point, and the functional collective's path against plain BN.

A fake ``torch.distributed`` group of 2 ranks (``torch.testing``'s ``FakeStore``) gives
the layers a world without peers: its all_reduce leaves each buffer as it is, so values
are one rank's, which is what these tests need (the sums are tested across real ranks by
``ranks_compile.py`` and in thread worlds by ``test_thread_worlds.py``). The budgets of
each kernel set are ``test_kernels.py``'s; the tests here that a kernel set could change
run on both (the ``kernels`` fixture).
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hvd_syncbn import comm as transport  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm, check, convert_sync_batchnorm  # noqa: E402
from conftest import collective_timeout, results, run  # noqa: E402

SYNCING_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__array__")
aten = torch.ops.aten
SYNCING_OPS = (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default)


class HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value on the host (a device sync on CUDA):
    ``_local_scalar_dense`` (``item``, ``bool``, ...), ``nonzero``, boolean-mask indexing."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func is aten.index.Tensor and any(
            t is not None and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else []))
        if func in SYNCING_OPS or masked:
            self.log.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    """A list that fills with every host read made while the test runs: the Tensor
    methods that sync, and (by :class:`HostReads`) the ops that do."""
    log: list = []
    for name in SYNCING_METHODS:
        real = getattr(torch.Tensor, name)

        def wrapped(self, *args, _real=real, _name=name, **kwargs):
            log.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return log


def cnn(stats: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5, momentum=None), nn.ReLU())
    model = convert_sync_batchnorm(model)
    for m in model.modules():
        if isinstance(m, SyncBatchNorm):
            m.stats = stats
    return model


@pytest.fixture
def made_from_data(monkeypatch):
    """A list that fills with every tensor made from Python or numpy data while the test
    runs (on a GPU a copy from pageable host memory: a sync, and a failed graph capture)."""
    log: list = []
    for owner, name in ((torch, "tensor"), (torch, "as_tensor"), (torch, "from_numpy"), (torch.Tensor, "new_tensor")):
        real = getattr(owner, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            log.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)
    return log


def second_step(stats: str, rows: int, log: list, mode=None) -> list:
    """What ``log`` holds after the second training step (the first makes the layers'
    constants) of ``cnn(stats)`` on ``rows`` rows, run in ``mode`` if given; ``"host"``
    over a local communicator of 2 (numpy buffers, checks read at the step), for contrast."""
    model = cnn(stats)
    for m in model.modules():
        if isinstance(m, SyncBatchNorm) and stats == "host":
            m.comm = transport.LocalCommunicator(2)
    x = torch.randn(rows, 3, 6, 6, requires_grad=True)
    model(x).square().sum().backward()
    log.clear()
    with mode or contextlib.nullcontext():
        model(x).square().sum().backward()
    return list(log)


@pytest.mark.parametrize("rows", [3, 0])
def test_device_step_makes_no_tensor_from_data(fake_world, kernels, made_from_data, rows):
    """After a layer's first step (which makes its constants), a training step of a
    converted model makes no tensor from Python or numpy data, on either kernel set;
    ``stats="host"`` over a local communicator, for contrast, does (its buffers cross as
    numpy), so the count can fail."""
    device, host = (second_step(stats, rows, made_from_data) for stats in ("device", "host"))
    assert device == [], f"tensors made from data on the device path: {device}"
    assert len(host) > 0, "the wrapper saw no tensor made from data on the host path"


def test_device_step_runs_on_the_meta_device(fake_world):
    """A training step of a converted model on ``meta`` tensors (no data; any CPU tensor
    mixed in fails), with the layers' running update: shapes and dtypes as plain BN's."""
    model = cnn("device").to("meta")
    x = torch.randn(3, 3, 6, 6, device="meta", requires_grad=True)
    y = model(x)
    y.sum().backward()
    assert y.device.type == "meta" and y.shape == (3, 5, 6, 6) and x.grad.shape == x.shape
    assert model[1].running_mean.device.type == "meta" and model[1].weight.grad.shape == (4,)


@pytest.mark.parametrize("rows", [3, 0])
def test_device_path_makes_no_host_read_in_forward_and_backward(fake_world, kernels, host_reads, rows):
    """Zero host reads on the device path (an empty rank included), on either kernel set;
    ``stats="host"`` (over a local communicator), for contrast, makes them, so the count
    can fail."""
    device, host = (second_step(stats, rows, host_reads, HostReads(host_reads)) for stats in ("device", "host"))
    assert device == [], f"host reads on the device path: {device}"
    assert len(host) > 0, "the counter saw no host read on the host path"


def test_device_path_runs_under_fake_tensor_mode(fake_world):
    """Shapes and dtypes propagate with no real data (how torch.compile traces it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = cnn("device")
        x = torch.randn(3, 3, 6, 6, requires_grad=True)
        y = model(x)
        y.sum().backward()
    assert y.shape == (3, 5, 6, 6) and x.grad.shape == x.shape
    assert model[1].running_mean.shape == (4,)


def test_deferred_errors_are_raised_by_check_and_on_mode_switch(kernels):
    """Over a thread world of 2 (the custom op), on either kernel set: a global batch of one row, and
    non-finite statistics with check_finite, raise on every rank at ``check(model)`` or
    ``model.eval()``, naming the layer, and leave the running statistics alone; a later
    clean step updates them."""

    def rank(r, comm):
        model = cnn("device")
        for m in model.modules():
            if isinstance(m, SyncBatchNorm):
                m.comm, m.check_finite = comm, True
        before = model[1].running_mean.clone()
        model(torch.randn(1 - r, 3, 1, 1))  # one value per channel in all
        assert torch.equal(model[1].running_mean, before) and model[1].num_batches_tracked.item() == 0
        with pytest.raises(ValueError, match=r"^SyncBatchNorm \(deferred check\): 1: expected more than 1 value"):
            check(model)
        check(model)  # cleared
        bad = torch.randn(2, 3, 6, 6)
        bad[0, 0, 0, 0] = float("nan") if r == 1 else 0.0
        model(bad)
        with pytest.raises(ValueError, match="1: expected finite inputs"):
            model.eval()  # stops after the first layer with an error, which has switched ...
        assert not model[1].training and model[4].training
        with pytest.raises(ValueError, match="4: expected finite inputs"):
            check(model)  # ... the others raise at the next host point
        assert torch.equal(model[1].running_mean, before)
        model.train()
        model(torch.randn(2, 3, 6, 6))
        check(model)
        assert model[1].num_batches_tracked.item() == 1 and not torch.equal(model[1].running_mean, before)
        return True

    with collective_timeout(10.0):
        assert results(run(2, rank)) == [True, True]


@pytest.mark.parametrize("kwargs", [{}, dict(affine=False), dict(momentum=None)], ids=["affine", "no-affine",
                                                                                     "cumulative"])
@pytest.mark.parametrize("shape", [(6, 4, 5, 5), (7, 4), (5, 4, 3, 2, 2)], ids=["2d", "1d", "3d"])
def test_functional_collective_path_equals_plain_bn(gloo_world, kernels, kwargs, shape):
    """The device path over a real ``torch.distributed`` group of 1 (Gloo; the layer is
    given its communicator, as alone it would be plain BN), on either kernel set: its
    functional collectives carry and check the header, and 3 training steps at an offset
    of 100 equal float64 plain BN on the same batch (outputs, input and parameter
    gradients, running statistics) as closely as float32 BN does."""
    torch.manual_seed(0)
    plain = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}[len(shape) - 1](
        shape[1], **kwargs).double()
    layer = SyncBatchNorm(shape[1], stats="device", **kwargs)
    if layer.affine:
        with torch.no_grad():
            for m in (plain, layer):
                m.weight.copy_(torch.linspace(0.5, 1.5, shape[1]))
                m.bias.copy_(torch.linspace(-0.3, 0.3, shape[1]))
    for step in range(3):
        x = (torch.randn(shape, dtype=torch.float64) * 2 + 100).requires_grad_()
        x32 = x.detach().float().requires_grad_()
        y, y32 = plain(x), layer(x32)
        dy = torch.randn_like(y)
        y.backward(dy)
        y32.backward(dy.float())
        torch.testing.assert_close(y32.double(), y.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x32.grad.double(), x.grad, rtol=1e-4, atol=1e-4)
        for name, p in plain.named_parameters():
            torch.testing.assert_close(getattr(layer, name).grad.double(), p.grad, rtol=1e-4, atol=1e-3)
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(layer, name).double(), getattr(plain, name), rtol=1e-5, atol=1e-5)
        assert layer.num_batches_tracked.item() == plain.num_batches_tracked.item() == step + 1
        check(layer)


def test_header_mismatch_poisons_the_output_and_raises_at_check(fake_world, kernels):
    """The fake group's all_reduce returns each buffer as it is, so the static header
    sums to ``h``, not ``2h``, as when ranks sum different collectives: the output is
    NaN, nothing updates, and ``check`` raises SyncBatchNormError naming the layers."""
    model = cnn("device")
    y = model(torch.randn(3, 3, 6, 6))
    assert torch.isnan(y).all()
    assert model[1].num_batches_tracked.item() == 0 and model[4].num_batches_tracked.item() == 0
    with pytest.raises(transport.SyncBatchNormError, match="1: ranks summed different collectives.*; 4: ranks"):
        check(model)


def test_cpu_checks_raise_at_the_step_in_eager_mode(fake_world):
    """For CPU tensors in eager mode (``stats="auto"``, the default) the fake group's header
    mismatch raises at the step, after the diagnosis, naming the layer, before any
    update and with nothing left for ``check``; ``stats="device"`` defers it (the test
    above); ``"host"`` warns that it is deprecated, saying what it now does."""
    model = cnn("auto")
    with collective_timeout(0.5), pytest.raises(transport.SyncBatchNormError,
                                                match=r"(?s)ranks summed different collectives.*layer '1' forward"):
        model(torch.randn(3, 3, 6, 6))
    assert model[1].num_batches_tracked.item() == 0 and not model[1]._sync_errors.any()
    with pytest.warns(DeprecationWarning, match=r"stats='host' is deprecated .* use 'auto'"):
        SyncBatchNorm(4, stats="host")


@pytest.mark.parametrize("compiled", [False, True])
def test_debug_asserts_raise_at_the_step(fake_world, monkeypatch, compiled):
    """With HVD_SYNCBN_DEVICE_ASSERT=1 the header mismatch of the fake group fails the
    step itself (on the CPU ``_assert_async`` raises at once), naming the first layer,
    before any running statistic moves; eager and compiled alike."""
    monkeypatch.setenv("HVD_SYNCBN_DEVICE_ASSERT", "1")
    model = cnn("device")
    step = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm \(deferred check\): 1: ranks summed different collectives"):
        step(torch.randn(3, 3, 6, 6))
    assert model[1].num_batches_tracked.item() == 0 and not model[1]._sync_errors.any()
    torch._dynamo.reset()
    monkeypatch.setenv("HVD_SYNCBN_DEVICE_ASSERT", "yes")  # read at a layer's first step
    with pytest.raises(ValueError, match=r"HVD_SYNCBN_DEVICE_ASSERT: expected 0 .* or 1 .*, got 'yes'"):
        cnn("device")(torch.randn(3, 3, 6, 6))


def test_bad_stats_and_compile_timeout_are_refused_with_what_was_expected(monkeypatch):
    from hvd_syncbn import settings

    with pytest.raises(ValueError, match=r"expected stats to be 'auto', 'host' or 'device', got 'gpu'"):
        SyncBatchNorm(4, stats="gpu")
    monkeypatch.setenv("HVD_SYNCBN_STATS", "cuda")
    with pytest.raises(ValueError, match=r"expected \$HVD_SYNCBN_STATS to be 'auto', 'host' or 'device', got 'cuda'"):
        convert_sync_batchnorm(nn.BatchNorm2d(4))
    monkeypatch.setenv("HVD_SYNCBN_STATS", "device")
    assert SyncBatchNorm(4).stats == "device" and SyncBatchNorm(4, stats="host").stats == "host"
    monkeypatch.setenv("HVD_SYNCBN_COMPILE_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="HVD_SYNCBN_COMPILE_TIMEOUT: expected a non-negative number of seconds, got '-1'"):
        settings.compile_timeout()
    monkeypatch.setenv("HVD_SYNCBN_COMPILE_TIMEOUT", "0")
    assert settings.compile_timeout() == 0.0


def test_revert_drops_what_the_device_path_added():
    from hvd_syncbn.torch import revert_sync_batchnorm

    model = revert_sync_batchnorm(cnn("device"))
    assert type(model[1]) is nn.BatchNorm2d and "_sync_errors" not in dict(model[1].named_buffers())
    assert not hasattr(model[1], "stats")
    assert set(model.state_dict()) == set(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                                        nn.Conv2d(4, 5, 3), nn.BatchNorm2d(5)).state_dict())


def test_bad_input_on_one_rank_fails_every_rank_on_the_device_path():
    """Rank 1 feeds 4 channels to a 3-channel layer: over a thread world (the custom op)
    it raises its own error as bad input, and rank 0, whose input is fine, a
    SyncBatchNormError naming rank 1 and the problem, within the timeout."""
    from hvd_syncbn import SyncBatchNormError, SyncBatchNormInputError

    def rank(r, comm):
        layer = SyncBatchNorm(3, name="bad.bn", stats="device", comm=comm)
        with pytest.raises(SyncBatchNormError) as raised:
            layer(torch.randn(2, 3 + r, 4, 4))
        return isinstance(raised.value, SyncBatchNormInputError), str(raised.value)

    with collective_timeout(5.0):
        (input0, text0), (input1, text1) = results(run(2, rank))
    assert not input0 and input1
    problem = "rank 1: bad.bn: expected 3 channels on axis 1, got 4"
    assert problem in text0 and problem in text1, (text0, text1)
