"""PyTorch SyncBatchNorm against plain BN on the concatenated global batch.

Runs at any world size: plainly under pytest (1 rank), and at 2 and 3 ranks under
horovodrun and mpirun, all launched by ``test_launch.py``. Expected values come from one
process running ``nn.BatchNorm`` on the whole batch, which every rank builds itself: in
the oracle cases ours must be as close to float64 BN as float32 BN is
(``oracle.assert_as_accurate``).

At 1 rank the contract is different, and so is what the oracle cases assert: alone,
``SyncBatchNorm`` *is* ``nn.BatchNorm`` (docs/pytorch.md), so its outputs, gradients and running
statistics must be bitwise equal to plain BN's (``rtol=atol=0``: :func:`tolerance`, and
``alone`` in :func:`run_steps`) and it makes no SyncBN collective
(:func:`no_collective_when_alone`). The synchronized path in one process is covered by
the thread-world tests of ``unit/test_thread_worlds.py`` (2 and 3 ranks as threads, each with its
own communicator).
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from hvd_syncbn import comm as transport
from hvd_syncbn.torch import SyncBatchNorm, convert_sync_batchnorm
from hvd_syncbn.torch import reducers
from hvd_syncbn.torch.kernels import Composite, Native
from oracle import (
    EMPTY, UNEQUAL, Ranks, TorchTrainer, as_accurate, assert_close, eval_batch, global_batch, launched, shard_sizes,
    shard_slice, train_like_one_process, training_batches,
)

hvd = pytest.importorskip("horovod.torch")

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
# The test that counts collectives in Horovod's timeline exists where test_launch.py turns
# the timeline on (TIMELINE there says why in one launch only).
TIMELINE = os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC"
hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()
# test_launch.py runs this suite once with the layers' statistics over torch.distributed.
TORCH_DIST = os.environ.get("HVD_SYNCBN_COMM") == "torch"
if TORCH_DIST:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["HVD_SYNCBN_TEST_INIT"], rank=RANK, world_size=WORLD)
PLAIN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def tolerance(world: int = WORLD, **tol) -> dict:
    """``tol`` across ranks; ``rtol=atol=0`` alone, where the layer is plain BN."""
    return dict(rtol=0.0, atol=0.0) if world == 1 else tol


@pytest.fixture(autouse=True)
def no_collective_when_alone(monkeypatch):
    """At 1 rank, fail the test if any SyncBN collective (a sum, or a poisoned one) ran."""
    if WORLD > 1:
        yield
        return
    made = []

    def recorded(module, name):
        real = getattr(module, name)
        return lambda *args, **kwargs: made.append(name) or real(*args, **kwargs)

    # where the layer's reducers call them: MPI and Horovod (allreduce, poison), torch.distributed (summed)
    for name in ("allreduce", "poison", "summed"):
        monkeypatch.setattr(reducers, name, recorded(reducers, name))
    yield
    assert not made, f"a SyncBN collective ran at 1 rank: {made}"


def allreduce_sum(t: torch.Tensor, name: str, ps=None) -> torch.Tensor:
    """Sum of a tensor over the ranks (the test's own collective, not the layer's)."""
    ps = ps or hvd.global_process_set
    return hvd.allreduce(t.detach().contiguous(), op=hvd.Sum, name=f"test.{name}", process_set=ps)


def ranks_of(ps=None) -> Ranks:
    """This rank of ``ps`` (default: all ranks), summing over it (Horovod sums no
    bfloat16, hence the float32 round trip)."""
    ps = ps or hvd.global_process_set
    return launched(ps.rank(), ps.size(), lambda t, name: allreduce_sum(t.float(), name, ps).to(t.dtype))


def run_steps(sync, plain, tail, pattern, steps=3, seed=0, channels_last=False, ps=None, drift=1.0, dtype=None):
    """Train ``sync`` on this rank's shards, and ``plain`` and a float64 copy of it on the
    whole batches: ``sync`` must be as close to float64 as ``plain`` is (alone: equal).
    Returns ours' results (:func:`oracle.train_like_one_process`).

    ``ps``: the process set the layer synchronises within (default: all ranks).
    ``drift``: how far the batches' mean moves per step, in standard deviations.
    ``dtype``: the inputs rounded to it (all three layers see the same values).
    """
    ranks = ranks_of(ps)
    sizes = shard_sizes(pattern, ranks.size)
    batches = training_batches(sum(sizes), tail, steps, seed, drift=drift)
    eval_x = eval_batch(sum(sizes), tail, seed)
    if dtype is not None:
        def rounded(x):
            return torch.from_numpy(x).to(dtype).double().numpy()

        batches, eval_x = [(rounded(x), r, m) for x, r, m in batches], rounded(eval_x)
    references = [TorchTrainer(layer, channels_last) for layer in (plain, copy.deepcopy(plain).double())]
    return train_like_one_process(ranks, sizes, batches, eval_x, lambda rank: TorchTrainer(sync, channels_last),
                                  references, as_accurate(alone=ranks.size == 1))


def make_pair(channels, ndim, **kwargs):
    torch.manual_seed(0)
    plain = PLAIN[ndim](channels, **kwargs)
    sync = SyncBatchNorm(channels, **kwargs)
    if plain.affine:  # non-trivial, identical affine parameters
        with torch.no_grad():
            for layer in (plain, sync):
                layer.weight.copy_(torch.linspace(0.5, 1.5, channels))
                layer.bias.copy_(torch.linspace(-0.3, 0.3, channels))
    return sync, plain


CASES = {
    "2d-unequal": dict(tail=(4, 5, 5), pattern=UNEQUAL),
    "2d-empty-rank": dict(tail=(4, 5, 5), pattern=EMPTY),
    "1d-NC": dict(tail=(6,), pattern=UNEQUAL),
    "1d-NCL": dict(tail=(3, 7), pattern=EMPTY),
    "3d": dict(tail=(2, 3, 4, 5), pattern=UNEQUAL),
    "channels-last": dict(tail=(4, 5, 5), pattern=UNEQUAL, channels_last=True),
    "affine-false": dict(tail=(4, 5, 5), pattern=UNEQUAL, kwargs=dict(affine=False)),
    "momentum-none": dict(tail=(4, 5, 5), pattern=EMPTY, kwargs=dict(momentum=None)),
    "no-running-stats": dict(tail=(4, 3, 3), pattern=UNEQUAL, kwargs=dict(track_running_stats=False)),
    "momentum-0.5-eps-1e-3": dict(tail=(4, 3, 3), pattern=UNEQUAL, kwargs=dict(momentum=0.5, eps=1e-3)),
    # Enough values per rank for the centred moments; the mean moves little (the last
    # global mean centres the next step) or far (a fresh mean first).
    "2d-large-steady": dict(tail=(4, 64, 64), pattern=UNEQUAL, drift=0.1),
    "2d-large-drifting": dict(tail=(4, 64, 64), pattern=UNEQUAL, drift=5.0),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_plain_bn_on_global_batch(case):
    c = CASES[case]
    sync, plain = make_pair(c["tail"][0], len(c["tail"]) + 1, **c.get("kwargs", {}))
    run_steps(sync, plain, c["tail"], c["pattern"], channels_last=c.get("channels_last", False),
              drift=c.get("drift", 1.0))


def test_bf16_autocast_keeps_float32_statistics():
    sync, plain = make_pair(4, 4)
    sizes = shard_sizes(UNEQUAL, WORLD)
    mine = shard_slice(sizes, RANK)
    x_all = torch.from_numpy(global_batch(7, sum(sizes), (4, 6, 6), offset=2.0)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_all = plain(x_all)
        y = sync(x_all[mine])
    assert y.dtype == torch.bfloat16 and sync.running_mean.dtype == torch.float32
    assert_close(y.float(), y_all.float()[mine], "bf16 output", **tolerance(rtol=1e-2, atol=1e-2))
    assert_close(sync.running_mean, plain.running_mean, "bf16 running_mean", **tolerance(rtol=1e-5, atol=1e-6))
    assert_close(sync.running_var, plain.running_var, "bf16 running_var", **tolerance(rtol=1e-4, atol=1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_model_cast_to_low_precision_matches_plain_bn(dtype):
    """``model.to(bfloat16 / float16)``: input, parameters and running statistics all in
    that dtype, as close to float64 BN on the global batch as plain BN run the same way."""
    sync, plain = (layer.to(dtype) for layer in make_pair(4, 4))
    got = run_steps(sync, plain, (4, 6, 6), UNEQUAL, steps=1, seed=11, dtype=dtype)
    assert {t.dtype for t in got[RANK][0].values() if t.is_floating_point()} == {dtype}


def test_double_backward_raises_across_ranks():
    """A second derivative through the layer raises across ranks (its backward sums
    through numpy, so one would be wrong); alone the layer is plain BN and has one."""
    sync, plain = make_pair(4, 4)
    x = torch.from_numpy(global_batch(13, 3, (4, 5, 5))).requires_grad_(True)
    grad, = torch.autograd.grad((sync(x) ** 2).sum(), x, create_graph=True)
    if WORLD == 1:
        want, = torch.autograd.grad((plain(x) ** 2).sum(), x, create_graph=True)
        assert_close(torch.autograd.grad(grad.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0], "second derivative")
    else:
        with pytest.raises(RuntimeError, match="differentiate twice"):
            grad.sum().backward()


def test_variance_survives_large_offset():
    """Mean 1e4, std 0.1, float32 input: variance within 1e-4 of a float64 reference."""
    sizes = shard_sizes(UNEQUAL, WORLD)
    x_all = global_batch(3, sum(sizes), (8, 4, 4), offset=1e4, scale=0.1)
    sync = SyncBatchNorm(8, momentum=1.0)  # running_var = unbiased batch variance
    sync(torch.from_numpy(x_all[shard_slice(sizes, RANK)]))
    want = x_all.astype(np.float64).transpose(1, 0, 2, 3).reshape(8, -1).var(axis=1, ddof=1)
    assert_close(sync.running_var, want, "variance, mean 1e4 and std 0.1", rtol=1e-4, atol=0.0)
    assert_close(sync.running_mean, x_all.mean(axis=(0, 2, 3), dtype=np.float64), "mean", rtol=1e-6)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 6 * 6, 5), nn.BatchNorm1d(5))

    def forward(self, x):
        return self.head(self.body(x))


def test_converted_cnn_trains_like_one_process():
    """SGD on shards with SyncBN == SGD on the concatenated batch with plain BN."""
    torch.manual_seed(1)
    plain = SmallCNN()
    sync = convert_sync_batchnorm(SmallCNN())
    sync.load_state_dict(plain.state_dict())
    assert sum(isinstance(m, SyncBatchNorm) for m in sync.modules()) == 3
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(sync.parameters(), lr=0.1, momentum=0.9),
        named_parameters=sync.named_parameters(), op=hvd.Sum,
    )
    sizes = shard_sizes(EMPTY if WORLD > 2 else UNEQUAL, WORLD)
    mine, total = shard_slice(sizes, RANK), sum(sizes)
    for step in range(3):
        x_all = torch.from_numpy(global_batch(20 + step, total, (3, 6, 6)))
        t_all = torch.from_numpy(global_batch(40 + step, total, (5,)))
        for model, optim, rows in ((plain, opt_plain, slice(None)), (sync, opt, mine)):
            optim.zero_grad()
            loss = ((model(x_all[rows]) - t_all[rows]) ** 2).sum() / total  # share of the global mean
            loss.backward()
            optim.step()
    for (name, p), q in zip(sync.state_dict().items(), plain.state_dict().values()):
        assert_close(p, q, f"{name} after 3 SGD steps, rank {RANK}", **tolerance(rtol=1e-4, atol=1e-5))


def test_process_set_syncs_only_within_itself():
    """At 3+ ranks a set of ranks 0 and 1; below that, the global set passed explicitly."""
    members = [0, 1] if WORLD >= 3 else list(range(WORLD))
    ps = hvd.add_process_set(members) if WORLD >= 3 else hvd.global_process_set
    try:
        sync, plain = make_pair(4, 4)
        sync.process_set = dist.new_group(members) if TORCH_DIST else ps
        if RANK in members:
            run_steps(sync, plain, (4, 3, 3), UNEQUAL, steps=2, ps=ps)
        else:
            with pytest.raises(ValueError, match="not in the layer's process set"):
                sync(torch.ones(2, 4, 3, 3))
    finally:
        if ps is not hvd.global_process_set:
            hvd.remove_process_set(ps)


def exactly_one_allreduce_per_direction_per_layer(rank_tmp):
    """Counted in Horovod's own timeline: 2 layers, fwd+bwd -> 2 + 2 allreduces."""
    path = str(rank_tmp / "timeline.json")
    layers = [SyncBatchNorm(4, name=f"count.{k}", comm="horovod") for k in "ab"]
    model = nn.Sequential(layers[0], nn.ReLU(), layers[1])
    x = torch.randn(3, 4, 5, 5, requires_grad=True)
    hvd.start_timeline(path, mark_cycles=False)
    model(x).sum().backward()
    hvd.allreduce(torch.ones(1), name="test.timeline.flush")  # every earlier op is done
    hvd.stop_timeline()
    if RANK != 0:
        return
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    # One timeline "process" per tensor, named "allreduce.<collective name>".
    names = {e["pid"]: e["args"].get("name", "") for e in events if e.get("name") == "process_name"}
    done = [names.get(e.get("pid"), "") for e in events if e.get("name") == "ALLREDUCE" and e.get("ph") == "B"]
    ours = sorted(n.split(".", 1)[1] for n in done if n.startswith("allreduce.hvd_syncbn."))
    expected = [] if WORLD == 1 else sorted(
        f"hvd_syncbn.count.{layer}.{d}" for layer in "ab" for d in ("fwd", "bwd")
    )
    assert ours == expected, f"collectives in the timeline: {ours}, expected {expected}"


if TIMELINE:
    test_exactly_one_allreduce_per_direction_per_layer = exactly_one_allreduce_per_direction_per_layer


def _state(layer):
    return {k: v.clone() for k, v in layer.state_dict().items()}


def assert_state_unchanged(layer, before, what):
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), f"{what}: {k} changed from {before[k]} to {v}"


def test_empty_global_batch_leaves_statistics_untouched():
    """Every rank 0 rows: empty output, no NaN in any gradient, no update, no count."""
    bn = SyncBatchNorm(4, name="empty.bn", momentum=None)
    before = _state(bn)
    x = torch.zeros(0, 4, 3, 3, requires_grad=True)
    y = bn(x)
    y.sum().backward()
    assert y.shape == (0, 4, 3, 3) and x.grad.shape == x.shape
    assert torch.isfinite(bn.weight.grad).all() and torch.isfinite(bn.bias.grad).all()
    assert_state_unchanged(bn, before, "empty global batch")


def test_single_global_row_raises_on_every_rank():
    """One row in the whole global batch (on rank 0): every rank raises, nothing updates."""
    bn = SyncBatchNorm(4, name="one_row.bn")
    before = _state(bn)
    x = torch.ones(1 if RANK == 0 else 0, 4, 1, 1)
    with pytest.raises(ValueError, match=r"one_row\.bn: expected more than 1 value per channel"):
        bn(x)
    assert_state_unchanged(bn, before, "single global row")


def test_nan_input_follows_plain_bn_or_raises_with_check_finite():
    sizes = shard_sizes(UNEQUAL, WORLD)
    x_all = torch.from_numpy(global_batch(7, sum(sizes), (4, 3, 3)))
    x_all[0, 1, 0, 0] = float("nan")  # in rank 0's rows; channel 1 only
    sync, plain = make_pair(4, 4)
    mine = shard_slice(sizes, RANK)
    assert_close(torch.nan_to_num(sync(x_all[mine]), 7.0), torch.nan_to_num(plain(x_all)[mine], 7.0),
                 "NaN input: output as plain BN's", **tolerance(rtol=1e-5, atol=1e-6))
    for name in ("running_mean", "running_var"):
        assert_close(torch.nan_to_num(getattr(sync, name), 7.0), torch.nan_to_num(getattr(plain, name), 7.0), name,
                     **tolerance(rtol=1e-5, atol=1e-6))

    strict = SyncBatchNorm(4, name="strict.bn", check_finite=True)
    before = _state(strict)
    with pytest.raises(ValueError, match=r"strict\.bn: expected finite inputs"):
        strict(x_all[mine])
    assert_state_unchanged(strict, before, "check_finite")


def test_transport_follows_the_documented_rule():
    """$HVD_SYNCBN_COMM if set, else MPI under mpirun, else Horovod; none when alone."""
    from hvd_syncbn import mpi

    want = os.environ.get("HVD_SYNCBN_COMM") or ("mpi" if mpi.launched_by_mpirun() else "horovod")
    chosen = SyncBatchNorm(4, name="rule.bn")._comm()
    assert (chosen is None) == (WORLD == 1) and (chosen is None or chosen.kind == want), (chosen, want)


def test_cuda_statistics_take_a_private_group_over_the_transport(monkeypatch):
    """The device path's CUDA statistics (asked for as the layer does; no GPU here) under
    ``auto`` over MPI or Horovod sum over a private group bootstrapped over that transport
    (across hosts too, under test_multihost.py); HVD_SYNCBN_PRIVATE_GROUP=0, or the
    transport asked for by name (argument or HVD_SYNCBN_COMM), keeps the transport. Alone,
    or on the user's torch.distributed group, nothing is built."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from hvd_syncbn.torch import transports as torch_transports

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)  # as in a CUDA build of torch
    over, comm = SyncBatchNorm(4, name="nccl.bn")._comm(), SyncBatchNorm(4, name="nccl.bn")._comm(nccl=True)
    if over is None or over.kind == "torch" or os.environ.get("HVD_SYNCBN_COMM"):
        assert comm is over, (comm, over)
        return
    assert SyncBatchNorm(4, name="nccl.bn", comm=over.kind)._comm(nccl=True) is over
    assert isinstance(comm, torch_transports.PrivateGroupComm) and comm.over is over, (comm, over)
    total = [WORLD * (WORLD + 1) / 2] * 3
    ones = torch.full((3,), RANK + 1.0, dtype=torch.float64)
    assert funcol.wait_tensor(funcol.all_reduce(ones, "sum", comm.group)).tolist() == total
    call = transport.Call("nccl.bn", "fwd", 0, 3, 4, "float32", RANK)
    assert transport.allreduce(comm, ones.numpy(), call).tolist() == total  # the host path: Gloo
    monkeypatch.setenv("HVD_SYNCBN_PRIVATE_GROUP", "0")
    assert SyncBatchNorm(4, name="nccl.bn")._comm(nccl=True) is over
    assert not dist.is_initialized()


def test_a_failure_that_is_not_bad_input_is_raised_from_the_real_error(monkeypatch):
    """Out of memory (say) while rank 0 takes its local moments: every rank raises
    SyncBatchNormError naming rank 0 and the error, none calls it bad input, and rank 0's
    is raised from the original exception. Alone, the layer is plain BN and never gets
    there."""
    from hvd_syncbn import SyncBatchNormError, SyncBatchNormInputError

    def out_of_memory(*args):
        raise MemoryError("could not allocate 2 GiB")

    bn = SyncBatchNorm(4, name="oom.bn")
    if RANK == 0:
        for kernels in (Native, Composite):
            monkeypatch.setattr(kernels, "local", out_of_memory)
    x = torch.from_numpy(global_batch(21, 3, (4, 2, 2)))
    if WORLD == 1:
        assert_close(bn(x), nn.BatchNorm2d(4)(x), "alone: plain BN", **tolerance())
        return
    with pytest.raises(SyncBatchNormError) as info:
        bn(x)
    assert not isinstance(info.value, SyncBatchNormInputError), info.value
    assert "rank 0: oom.bn: MemoryError: could not allocate 2 GiB" in str(info.value), info.value
    assert (RANK == 0) == isinstance(info.value.__cause__, MemoryError), repr(info.value.__cause__)
