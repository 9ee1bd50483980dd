"""SyncBatchNorm under ``nn.DataParallel``, without a GPU: the replicas are made by the
seam DataParallel uses (each module's ``_replicate_for_data_parallel``, wired as
``torch.nn.parallel.replicate`` wires them: replicas share the module's parameters and
buffers, as on one device) and run in threads, one per replica, as
``parallel_apply`` runs them; the backward runs in one thread, as the autograd engine
runs every replica's backward on one device. Against float64 plain BN on the
concatenated batch, at 2 and 3 replicas, with unequal and empty slices.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from conftest import collective_timeout, results, run  # noqa: E402
from data_parallel import net, parallel_apply, replicate  # noqa: E402
from hvd_syncbn import SyncBatchNormError  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm, check  # noqa: E402
from oracle import EMPTY, UNEQUAL, assert_close, global_batch, shard_sizes, shard_slice  # noqa: E402


@pytest.mark.parametrize("pattern", [UNEQUAL, EMPTY], ids=["unequal", "empty"])
@pytest.mark.parametrize("copies", [2, 3])
def test_replicas_equal_one_process_on_the_concatenated_batch(kernels, copies, pattern):
    """2 training steps of a converted CNN under a DataParallel of ``copies`` replicas
    (made anew each step, as DataParallel does): the outputs, the input's and every
    parameter's gradients, the running statistics and ``num_batches_tracked`` of the module
    DataParallel keeps equal float64 plain BN on the whole batch, as closely as float32
    BN does."""
    sizes = shard_sizes(pattern, copies)
    rows = sum(sizes)
    ours, plain = net(True), net(False)
    for step in range(2):
        x = torch.from_numpy(global_batch(step, rows, (3, 6, 6), offset=2.0))
        target = torch.from_numpy(global_batch(100 + step, rows, (5, 6, 6)))
        xs = [x[shard_slice(sizes, r)].clone().requires_grad_() for r in range(copies)]
        with collective_timeout(20.0):
            ys = parallel_apply(replicate(ours, copies), xs)
        for y in ys:
            if isinstance(y, BaseException):
                raise y
        sum((y * target[shard_slice(sizes, r)]).sum() for r, y in enumerate(ys)).backward()
        xd = x.double().requires_grad_()
        yd = plain(xd)
        (yd * target.double()).sum().backward()
        assert_close(torch.cat([y.detach() for y in ys]), yd.detach(), f"step {step} y", rtol=1e-4, atol=1e-4)
        assert_close(torch.cat([x.grad for x in xs]), xd.grad, f"step {step} x.grad", rtol=1e-4, atol=1e-4)
        for (name, p), (_, q) in zip(ours.named_parameters(), plain.named_parameters()):
            assert_close(p.grad, q.grad, f"step {step} {name}.grad", rtol=1e-4, atol=1e-3)
        ours_buffers = dict(ours.named_buffers())
        for name, b in plain.named_buffers():
            assert_close(ours_buffers[name], b, f"step {step} {name}", rtol=1e-5, atol=1e-5)
        check(ours)


def test_compiled_replicas_break_the_graph_at_the_layer():
    """``torch.compile`` of each replica (``aot_eager``): the layer runs eagerly, a graph
    break, and a step equals float64 plain BN on the whole batch as the eager replicas do;
    with ``fullgraph=True`` Dynamo raises, saying why."""
    import torch._dynamo

    sizes = shard_sizes(UNEQUAL, 2)
    ours, plain = net(True), net(False)
    x = torch.from_numpy(global_batch(0, sum(sizes), (3, 6, 6), offset=2.0))
    xs = [x[shard_slice(sizes, r)].clone().requires_grad_() for r in range(2)]
    try:
        with collective_timeout(20.0):
            ys = parallel_apply([torch.compile(r, backend="aot_eager") for r in replicate(ours, 2)], xs)
            torch._dynamo.reset()  # else the graph-broken code is reused as it is
            failed = parallel_apply([torch.compile(r, backend="aot_eager", fullgraph=True)
                                     for r in replicate(ours, 2)], xs)
    finally:
        torch._dynamo.reset()
    for y in ys:
        if isinstance(y, BaseException):
            raise y
    sum(y.square().sum() for y in ys).backward()
    xd = x.double().requires_grad_()
    yd = plain(xd)
    yd.square().sum().backward()
    assert_close(torch.cat([y.detach() for y in ys]), yd.detach(), "y", rtol=1e-4, atol=1e-4)
    assert_close(torch.cat([x.grad for x in xs]), xd.grad, "x.grad", rtol=1e-4, atol=1e-4)
    assert_close(ours[1].running_mean, plain[1].running_mean, "running_mean", rtol=1e-5, atol=1e-5)
    for e in failed:
        assert isinstance(e, Exception) and "SyncBatchNorm under nn.DataParallel" in str(e), repr(e)


@pytest.mark.parametrize("copies", [2, 3])
def test_bad_input_on_one_replica_fails_every_replica(copies):
    """The last replica feeds 4 channels to a 3-channel layer: it raises its own error,
    and every other replica a SyncBatchNormError naming it, within the timeout."""
    layer = SyncBatchNorm(3, name="bad.bn", stats="device")
    inputs = [torch.randn(2, 3, 4, 4) for _ in range(copies - 1)] + [torch.randn(2, 4, 4, 4)]
    with collective_timeout(5.0):
        out = parallel_apply(replicate(layer, copies), inputs)
    assert isinstance(out[-1], ValueError) and "bad.bn: expected 3 channels on axis 1, got 4" in str(out[-1])
    for e in out[:-1]:
        assert isinstance(e, SyncBatchNormError) and "another DataParallel replica failed" in str(e), e
        assert "expected 3 channels on axis 1, got 4" in str(e)


def test_a_replica_that_skips_the_layer_fails_the_others_in_time():
    layer = SyncBatchNorm(3, name="skipped.bn", stats="device")
    first, second = replicate(layer, 2)
    with collective_timeout(1.0):
        out = parallel_apply([first, lambda x: x], [torch.randn(2, 3, 4, 4)] * 2)
    assert isinstance(out[0], SyncBatchNormError), out[0]
    assert "skipped.bn: DataParallel replicas [1] of 2 did not reach this layer within 1 s" in str(out[0])


def test_eval_mode_replicas_use_the_running_statistics_without_meeting():
    """In eval mode a replica normalises with the running statistics, alone, as plain BN."""
    layer = SyncBatchNorm(3, stats="device").eval()
    with torch.no_grad():
        layer.running_mean.copy_(torch.tensor([0.5, -0.5, 1.0]))
    x = torch.randn(2, 3, 4, 4)
    out = parallel_apply(replicate(layer, 2)[:1], [x])  # one replica of two: no meeting in eval
    np.testing.assert_allclose(out[0].detach().numpy(), nn.functional.batch_norm(
        x, layer.running_mean, layer.running_var, layer.weight, layer.bias, False).detach().numpy(), atol=1e-6)


def test_deferred_checks_and_check_finite_hold_across_replicas(kernels):
    """A NaN in one replica's slice with ``check_finite``, and a global batch of one row
    over the replicas: :func:`check` raises on the module DataParallel keeps, naming the
    layer, and its running statistics stay as they were."""
    layer = SyncBatchNorm(3, name="dp.bn", stats="device", check_finite=True)
    bad = torch.randn(2, 3, 4, 4)
    bad[0, 1, 0, 0] = float("nan")
    with collective_timeout(5.0):
        for inputs, match in (([torch.randn(2, 3, 4, 4), bad], "dp.bn: expected finite inputs"),
                              ([torch.randn(1, 3, 1, 1), torch.randn(0, 3, 1, 1)], "dp.bn: expected more than 1 value")):
            out = parallel_apply(replicate(layer, 2), inputs)
            assert all(isinstance(y, torch.Tensor) for y in out), out
            with pytest.raises(ValueError, match=match):
                check(layer)
            assert layer.num_batches_tracked.item() == 0 and layer.running_mean.abs().sum() == 0


def test_replica_sets_let_their_layer_go():
    """The set of replicas being formed does not keep its layer alive."""
    layer = SyncBatchNorm(3, stats="device")
    replicate(layer, 2)
    gone = weakref.ref(layer)
    del layer
    gc.collect()
    assert gone() is None


def test_bad_input_on_one_replica_fails_every_replica_of_every_process():
    """2 processes (a thread world, the custom op) of 2 replicas each: process 1's second
    replica gets 4 channels for 3. It raises its own error; every other replica of both
    processes a SyncBatchNormError naming the problem (process 0's with the rank), within
    the timeout."""
    def process(rank, comm):
        layer = SyncBatchNorm(3, name="bad.bn", stats="device", comm=comm)
        inputs = [torch.randn(2, 3, 4, 4), torch.randn(2, 3 + rank, 4, 4)]
        return parallel_apply(replicate(layer, 2), inputs)

    with collective_timeout(5.0):
        (first, second), (third, fourth) = results(run(2, process))
    assert isinstance(fourth, ValueError) and "bad.bn: expected 3 channels on axis 1, got 4" in str(fourth)
    for e in (first, second, third):
        assert isinstance(e, SyncBatchNormError) and "expected 3 channels on axis 1, got 4" in str(e), repr(e)
    assert "rank 1" in str(first) and "rank 1" in str(second), (first, second)
