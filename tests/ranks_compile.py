"""The device path of the PyTorch layer, eager and under ``torch.compile(fullgraph=True)``,
against one process running plain BN on the concatenated batch.

Launched by ``test_launch.py`` under mpirun at 2 and 3 ranks, once per transport
(``$HVD_SYNCBN_COMM``): ``torch`` (functional collectives: first on the private group
bootstrapped over MPI, with no ``init_process_group``; then on the user's Gloo group),
``mpi`` and ``horovod`` (the custom op). A converted small CNN trains 3 SGD steps on
unequal shards (one rank empty at 3 ranks); outputs, parameters after every step (so
every gradient), running statistics and ``num_batches_tracked`` must match float64
plain BN. On the composite kernel set, and on the native one (``-native``, through the
CPU stand-ins of ``cuda_kernels.py``) eagerly and under ``aot_eager``.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import torch.distributed as dist
from hvd_syncbn import settings
from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm
from hvd_syncbn.torch import transports as torch_transports
import cuda_kernels
from oracle import EMPTY, UNEQUAL, assert_close, global_batch, shard_sizes, shard_slice

RANK, WORLD = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
COMM = os.environ["HVD_SYNCBN_COMM"]
if COMM == "horovod":
    import horovod.torch as hvd

    hvd.init()
# Inductor's own conv backward fails on an empty batch (a stride assertion on the weight's
# gradient, without SyncBN too), so it runs on unequal shards with no empty rank.
PATTERN = UNEQUAL if WORLD == 2 else EMPTY
STEPS, LR = 3, 0.1


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5, momentum=None), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3))


def batches(sizes):
    n = sum(sizes)
    return [(torch.from_numpy(global_batch(s, n, (3, 6, 6), offset=0.5 * s)),
             torch.from_numpy(global_batch(100 + s, n, (3,)))) for s in range(STEPS)]


def train(model, step_fn, data, rows, allreduce=None):
    """``STEPS`` of SGD on ``loss = Σ(out·target)/N`` over the global batch; each step's
    output and the state after it. ``allreduce`` sums the gradients over the ranks."""
    seen = []
    for x, target in data:
        out = step_fn(x)
        (out * target).sum().div(rows).backward()
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad if allreduce is None else allreduce(p.grad)
                p -= LR * g
                p.grad = None
        seen.append(dict(out=out.detach().clone(), **{k: v.detach().clone() for k, v in model.state_dict().items()}))
    return seen


def grads_summed(g: torch.Tensor) -> torch.Tensor:
    buf = g.detach().double().numpy().copy()
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return torch.from_numpy(buf).to(g.dtype)


_expected: dict = {}


def expected(sizes):
    """Float64 plain BN on the whole batches, once per shard pattern."""
    key = tuple(sizes)
    if key not in _expected:
        model = net().double()
        data = [(x.double(), t.double()) for x, t in batches(sizes)]
        _expected[key] = train(model, model, data, sum(sizes))
    return _expected[key]


# aot_eager first: its first step builds the transport (over torch, the private group)
# while Dynamo traces. inductor (7-45 s a compile here) lowers what aot_eager traced: once
# around the functional collectives (the private group) and once around the custom op
# (over mpi; horovod changes only the op's transport), at 2 ranks, where it runs unequal
# shards as at 3 (it cannot run the empty one).
# "-native": the native kernel set, through the CPU stand-ins of cuda_kernels.py; inductor
# on it around the functional collectives, on the composite set around the custom op.
MODES = ["aot_eager", "eager", "eager-device", "eager-device-native", "aot_eager-native"] + (
    [{"torch": "inductor-native", "mpi": "inductor"}[COMM]] if COMM != "horovod" and WORLD == 2 else [])


def transport_of(model) -> str:
    """What carries the model's statistics: ``private`` (a private group), ``torch``
    (the user's group), ``mpi`` or ``horovod``."""
    comm = model[1]._resolve_comm()
    return "private" if isinstance(comm, torch_transports.PrivateGroupComm) else comm.kind


# Over torch, the private group first: init_process_group runs after its tests.
EXPECTED = "private" if COMM == "torch" else COMM


@pytest.mark.parametrize("mode", MODES)
def test_converted_cnn_matches_plain_bn_on_the_whole_batch(mode, monkeypatch):
    trains_as_plain_bn_on_the_whole_batch(mode, monkeypatch)


def trains_as_plain_bn_on_the_whole_batch(mode, monkeypatch):
    with cuda_kernels.chosen("native" if mode.endswith("-native") else "composite", monkeypatch):
        trains_on_one_kernel_set(mode.removesuffix("-native"))


def trains_on_one_kernel_set(mode):
    sizes = shard_sizes(UNEQUAL if mode == "inductor" else PATTERN, WORLD)  # (its empty rank: above)
    mine = shard_slice(sizes, RANK)
    model = convert_sync_batchnorm(net())
    for m in model.modules():
        if isinstance(m, SyncBatchNorm):
            m.stats = "auto" if mode == "eager" else "device"  # auto: on the CPU its checks raise at the step
    step = model if mode.startswith("eager") else torch.compile(model, fullgraph=True, backend=mode)
    data = [(x[mine], t[mine]) for x, t in batches(sizes)]
    got = train(model, step, data, sum(sizes), grads_summed)
    for s, (g, want) in enumerate(zip(got, expected(sizes))):
        assert_close(g.pop("out"), want["out"][mine], f"{mode} output, step {s}, {sizes} rows", rtol=1e-4, atol=1e-5)
        for name, value in g.items():
            assert_close(value, want[name], f"{mode} {name} after step {s}", rtol=1e-4, atol=1e-5)
    assert model[4].num_batches_tracked.item() == STEPS
    assert model[1].layer_name == "1" and model[1].comm is None
    assert transport_of(model) == EXPECTED


def test_converted_cnn_forward_has_no_graph_break():
    forward_has_no_graph_break()


def forward_has_no_graph_break():
    model = convert_sync_batchnorm(net())
    explained = torch._dynamo.explain(model)(torch.randn(shard_sizes(PATTERN, WORLD)[RANK], 3, 6, 6))
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    assert explained.graph_count == 1, explained.graph_count
    assert transport_of(model) == EXPECTED


if COMM == "torch":
    def test_the_private_group_leaves_torch_distributed_to_the_user():
        """After the tests above: no default group, ``auto`` still picks MPI. Then the
        user's own Gloo group, for the tests below."""
        global EXPECTED
        assert not dist.is_initialized()
        assert torch_transports.resolve("auto", None, "probe").kind == "mpi"
        dist.init_process_group("gloo", init_method=os.environ["HVD_SYNCBN_TEST_INIT"], rank=RANK,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=300))  # fails, not hangs
        EXPECTED = "torch"
        assert torch_transports.resolve("auto", None, "probe").kind == "torch"

    @pytest.mark.parametrize("mode", [m for m in MODES if not m.startswith("inductor")])  # as the private group's
    def test_on_the_users_group_converted_cnn_matches_plain_bn_on_the_whole_batch(mode, monkeypatch):
        trains_as_plain_bn_on_the_whole_batch(mode, monkeypatch)

    def test_on_the_users_group_converted_cnn_forward_has_no_graph_break():
        forward_has_no_graph_break()


def a_peer_still_compiling_does_not_trip_the_timeout():
    """A first step that takes 3 timeouts on rank 0 (as a slow compile would) is waited
    for: the first collective of each layer gets HVD_SYNCBN_COMPILE_TIMEOUT more."""
    model = convert_sync_batchnorm(nn.Sequential(OrderedDict(fresh=net())))  # layers "fresh.1", "fresh.4"
    step = torch.compile(model, fullgraph=True, backend="aot_eager")
    settings.set_timeout(1.0)
    try:
        if RANK == 0:
            time.sleep(3.0)
        out = step(torch.randn(shard_sizes(PATTERN, WORLD)[RANK], 3, 6, 6))
        out.sum().backward()
    finally:
        settings._timeout = None
    assert np.isfinite(out.detach().numpy()).all()


if COMM == "mpi":
    def test_mpi_reads_cuda_buffers_as_the_library_says(monkeypatch):
        """Unset, HVD_SYNCBN_MPI_CUDA is what Open MPI was built with (``ompi_info``; the
        apt build here has no CUDA), and the layers' communicator follows it."""
        monkeypatch.delenv("HVD_SYNCBN_MPI_CUDA", raising=False)
        info = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True, check=True)
        built = "mpi_built_with_cuda_support:value:true" in info.stdout
        assert "mpi_built_with_cuda_support:value:" in info.stdout
        import ctypes

        from hvd_syncbn import mpi

        assert hasattr(ctypes.CDLL(MPI.__file__), "MPIX_Query_cuda_support")  # so the answer is Open MPI's
        assert mpi.mpi_reads_cuda() is built
        assert SyncBatchNorm(4, name="cuda.bn")._comm().device_buffers is built


if COMM != "torch":  # functional collectives wait by the process group's own timeout
    test_a_peer_still_compiling_does_not_trip_the_timeout = a_peer_still_compiling_does_not_trip_the_timeout
