"""The PyTorch kernel sets (``hvd_syncbn.torch.kernels``): the native
set (torch's fused CUDA kernels), run here through ``cuda_kernels.py``'s CPU stand-ins,
checked first against torch's own CPU kernels; the choice between the sets; what a step
of each costs (dispatched ops, touches of input-sized tensors); the native set's
variance at large offsets against its derived bound; and the layer's configurations on
both sets against plain BN on the concatenated batch, at 2 ranks.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import cuda_kernels  # noqa: E402
from conftest import collective_timeout, results, run, world  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm  # noqa: E402
from hvd_syncbn.torch import device  # noqa: E402
from hvd_syncbn.torch.kernels import KERNELS_ENV, Composite, Native, constant, kernels_for  # noqa: E402
from hvd_syncbn.torch import kernels as kernels_module  # noqa: E402
from oracle import UNEQUAL, Ranks, TorchTrainer, as_accurate, eval_batch, shard_sizes, train_like_one_process  # noqa: E402
from oracle import training_batches  # noqa: E402

aten = torch.ops.aten


def test_stand_ins_agree_with_torchs_cpu_kernels_and_refuse_what_cuda_refuses():
    """The stand-ins against torch's CPU batch-norm kernels on one batch (bfloat16 input,
    float32 statistics and parameters; float32 channels-last): statistics, output,
    gradient sums and the input gradient with the count of the whole batch; then the
    arguments CUDA's kernels refuse, and one layout they take."""
    with cuda_kernels.registered():
        for x in (torch.randn(5, 3, 4, 4, dtype=torch.bfloat16) * 2 + 3,
                  torch.randn(5, 3, 4, 4).contiguous(memory_format=torch.channels_last)):
            dy, w, b = torch.randn_like(x), torch.rand(3) + 0.5, torch.randn(3)
            mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
            want_var, want_mean = torch.var_mean(x.double(), [0, 2, 3], correction=0)
            assert mean.dtype == var.dtype == torch.float32
            torch.testing.assert_close(mean.double(), want_mean, rtol=2**-24, atol=0)
            torch.testing.assert_close(var.double(), want_var, rtol=2**-24, atol=0)
            invstd = torch.rsqrt(var + 1e-5)
            y = torch.batch_norm_elemt(x, w, b, mean, invstd, 1e-5)
            want_y = aten._native_batch_norm_legit_no_training(x.float(), w, b, mean, var, 0.0, 1e-5)[0]
            torch.testing.assert_close(y.float(), want_y, rtol=1e-2 if x.dtype == torch.bfloat16 else 1e-5, atol=1e-5)
            assert y.dtype == x.dtype and y.stride() == x.stride()
            sum_dy, sum_dy_xmu, gw, gb = torch.batch_norm_backward_reduce(dy, x, mean, invstd, w, True, True, True)
            dx = torch.batch_norm_backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu,
                                                 torch.tensor([x.numel() // 3], dtype=torch.int32))
            want_dx, want_gw, want_gb = aten.native_batch_norm_backward(
                dy.double(), x.double(), w.double(), None, None, mean.double(), invstd.double(), True, 1e-5,
                [True, True, True])
            torch.testing.assert_close(gw.double(), want_gw, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(gb.double(), want_gb, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(dx.double(), want_dx, rtol=1e-2 if x.dtype == torch.bfloat16 else 1e-5,
                                       atol=1e-2 if x.dtype == torch.bfloat16 else 1e-5)
        x, x4 = torch.randn(4, 3, 5), torch.randn(4, 3, 5, 4)
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
        refused = [
            (lambda: torch.batch_norm_elemt(x, None, None, mean.double(), var.double(), 0.0), "Expected mean to have type"),
            (lambda: torch.batch_norm_elemt(x, torch.ones(3), torch.zeros(3, dtype=torch.float64), mean, var, 0.0),
             "Expected bias to have type"),
            (lambda: torch.batch_norm_backward_elemt(x, x, mean, var, None, mean, var, torch.tensor([20])),
             "Expected count to have type torch.int32"),
            (lambda: torch.batch_norm_backward_elemt(x4.contiguous(memory_format=torch.channels_last), x4, mean, var,
                                                     None, mean, var, torch.tensor([80], dtype=torch.int32)),
             "expected input with strides"),
            (lambda: torch.batch_norm_update_stats(x[:0], None, None, 0.0), "expected a non-empty"),
            (lambda: torch.batch_norm_backward_reduce(x, x, mean, var.double(), None, True, False, False),
             "same data types"),
        ]
        for call, message in refused:
            with pytest.raises(RuntimeError, match=message):
                call()
        # strides of dims of size 1 address nothing: (2, 3, 1, 1) is one layout, whatever they say
        ones = torch.randn(2, 3, 1, 1)  # strides (3, 1, 1, 1), a copy (3, 1, 3, 3)
        torch.batch_norm_backward_elemt(ones, torch.empty_strided((2, 3, 1, 1), (3, 1, 3, 3)).copy_(ones), mean, var,
                                        None, mean, var, torch.tensor([2], dtype=torch.int32))
    with pytest.raises(NotImplementedError):  # gone with the block, as on a machine without CUDA
        torch.batch_norm_elemt(x, None, None, mean, var, 0.0)


def test_kernel_set_is_chosen_by_the_device_and_the_environment(monkeypatch):
    """``auto`` takes the native set where the device has all its kernels (here only with
    the stand-ins, on the CPU), else the composite; ``native`` elsewhere, or a bad value,
    is refused saying what was expected."""
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert kernels_for(cpu) is Composite and kernels_for(meta) is Composite
    with cuda_kernels.registered():
        assert kernels_for(cpu) is Native and kernels_for(meta) is Composite
        monkeypatch.setenv(KERNELS_ENV, "composite")
        assert kernels_for(cpu) is Composite
    monkeypatch.setenv(KERNELS_ENV, "native")
    with pytest.raises(ValueError, match=r"HVD_SYNCBN_KERNELS=native: this torch has no CPU kernel of "
                                         r"batch_norm_elemt, .*expected tensors on a device that has torch's fused"):
        kernels_for(cpu)
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=r"expected \$HVD_SYNCBN_KERNELS to be 'auto', 'native' or 'composite', "
                                         r"got 'cuda'"):
        kernels_for(cpu)


class Counted(TorchDispatchMode):
    """The aten ops dispatched while active (views and the collectives aside: each of
    the others is a kernel launch on a GPU), and the touches of tensors of ``size``
    elements: each such tensor among an op's arguments and results, once per op."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.ops, self.touches = size, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.namespace != "_c10d_functional":
            self.ops.append(str(func).replace("aten.", ""))
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.touches += len({(t.data_ptr(), t.shape, t.stride()) for t in tensors if t.numel() == self.size})
        return out


def counted_step(layer: nn.Module, x) -> Counted:
    """One training step of ``layer`` on ``x`` (forward, backward into fresh gradients),
    counted, after a first step that makes the layer's constants."""
    dy = torch.randn_like(x)
    layer(x).backward(dy)
    x.grad = None
    layer.zero_grad(set_to_none=True)
    with Counted(x.numel()) as seen:
        layer(x).backward(dy)
    return seen


BUDGETS = {"native": (28, 8), "composite": (36, 12)}
"""Per kernel set, what a layer step (forward, backward, running update and flags) may
dispatch besides its two collectives and views, and its touches of input-sized tensors;
``nn.BatchNorm2d``'s step, counted the same way: 4 ops, 5 touches."""


@pytest.mark.parametrize("dtype, kwargs", [(torch.float32, {}), (torch.bfloat16, {}), (torch.float32, dict(affine=False)),
                                           (torch.float32, dict(momentum=None))],
                         ids=["float32", "bfloat16", "no-affine", "cumulative"])
def test_step_dispatches_at_most_its_budget(fake_world, kernels, dtype, kwargs):
    """A device-path layer step over a ``torch.distributed`` group, on each kernel set,
    within :data:`BUDGETS` (the cumulative average's weight: 3 ops more); plain BN's,
    counted the same way, for contrast."""
    x = torch.randn(4, 8, 5, 5, dtype=dtype, requires_grad=True)
    ops, touches = BUDGETS[kernels]
    seen = counted_step(SyncBatchNorm(8, stats="device", **kwargs), x)
    extra = 3 if "momentum" in kwargs else 0
    assert len(seen.ops) <= ops + extra, f"{len(seen.ops)} ops > {ops + extra}: {seen.ops}"
    assert seen.touches <= touches, f"{seen.touches} touches of input-sized tensors > {touches}: {seen.ops}"
    if kernels == "native":
        assert {"batch_norm_update_stats.default", "batch_norm_elemt.default", "batch_norm_backward_reduce.default",
                "batch_norm_backward_elemt.default"} <= set(seen.ops), seen.ops
    plain = counted_step(nn.BatchNorm2d(8, dtype=torch.float32 if dtype == torch.bfloat16 else dtype), x)
    assert (len(plain.ops), plain.touches) == (4, 5), plain.ops


# Per offset (mean/std of every channel), the float32 data of 3 ranks with unequal shards,
# 2 channels, the second of them with a spread of the ranks' means of about one std.
def sharded(offset: float, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy((rng.standard_normal((rows, 2, 3)) + np.array([0.0, 1.0 * rank])[:, None]
                              + offset).astype(np.float32)) for rank, rows in enumerate((7, 12, 5))]


def native_bound(shards: list) -> np.ndarray:
    """What the native set's global variance may be off by, per channel, with each rank's
    mean ``m`` and variance ``v`` off by a relative ``δ`` (float32 rounding, as CUDA
    returns them) and the buffer's sums in float64 (``u``), ``W`` ranks of ``n`` rows:

        δ·V + 2δ·Σn·|m − M|·|m|/N + δ²·Σn·m²/N + 2(W + 4)·u·(Σn·(v + m²)/N + (Σn·|m|/N)²)

    the first term from ``v``; the next two from the means, through the spread of the
    ranks' means about the global ``M``; the last from the float64 sums, ``E[x²] − M²``
    and the reference's own rounding. torch's SyncBN combines the same float32 local
    moments (its ``invstd`` adds ``2δ·(v + ε)``) in float32: its bound is this one with
    ``u`` the float32 epsilon."""
    delta, u = 2.0**-24, 2.0**-53
    n = np.array([s.shape[0] * s[0, 0].numel() for s in shards], dtype=np.float64)[:, None]  # (W, 1)
    var, mean = (np.stack(t) for t in zip(*(torch.var_mean(s.double(), [0, 2], correction=0) for s in shards)))
    rows, width = n.sum(), len(shards)
    big_m = (n * mean).sum(0) / rows
    big_v = (n * (var + mean**2)).sum(0) / rows - big_m**2
    return (delta * big_v + 2 * delta * (n * np.abs(mean - big_m) * np.abs(mean)).sum(0) / rows
            + delta**2 * (n * mean**2).sum(0) / rows
            + 2 * (width + 4) * u * ((n * (var + mean**2)).sum(0) / rows + ((n * np.abs(mean)).sum(0) / rows) ** 2))


@pytest.mark.parametrize("offset", [1e3, 1e4])
def test_native_variance_at_large_offsets_within_its_bound(offset):
    """The native set's global variance of 3 ranks, the local moments rounded to float32
    as CUDA returns them, summed in the float64 buffer: within :func:`native_bound` of
    the float64 variance of the concatenated batch; the composite set's (shifted
    moments) within 8 float32 roundings of it whatever the offset."""
    shards = sharded(offset)
    want = torch.cat(shards).double().var([0, 2], correction=0).numpy()
    plan = device.Plan(None, 1e-5, torch.float32, False)
    for kernel_set, bound in ((Native, native_bound(shards)), (Composite, 8 * 2.0**-24 * want)):
        seed = constant((1.0,), torch.device("cpu"))
        with cuda_kernels.registered():
            total = sum(kernel_set.local(s, seed, torch.float32) for s in shards)
        fwd = device.lanes(None, "fwd").on(total.device)
        stats = device.global_stats(total, fwd, plan)[0]  # [−N | −Σx | −Σx²], no header
        err = np.abs(stats[1].double().numpy() - want)
        assert (err <= bound).all(), f"{kernel_set.name} at offset {offset:g}: error {err} > bound {bound}"


CASES = {  # the layer's configurations, per kernel set at 2 ranks against plain BN in the same precision
    "bfloat16-input": dict(tail=(4, 3, 3), dtype=torch.bfloat16),
    "float16-input": dict(tail=(4, 3, 3), dtype=torch.float16),
    "channels-last-2d": dict(tail=(4, 3, 3), channels_last=True),
    "channels-last-3d": dict(tail=(3, 2, 3, 2), channels_last=True),
    "1d-NC": dict(tail=(5,)),
    "no-affine": dict(tail=(4, 3, 3), kwargs=dict(affine=False)),
    "frozen-gamma": dict(tail=(4, 3, 3), frozen=True),
    "cumulative": dict(tail=(4, 3, 3), kwargs=dict(momentum=None)),
    "no-running-stats": dict(tail=(4, 3, 3), kwargs=dict(track_running_stats=False)),
}


@pytest.mark.parametrize("case", CASES)
def test_configurations_on_each_kernel_set_match_plain_bn(kernels, case):
    """Two training steps and an evaluation of the device path at 2 ranks of a thread
    world (unequal shards; the custom op), against plain BN on the concatenated batch:
    as close to float64 as plain BN in the same precision (its parameters float32, its
    input in the case's dtype) is."""
    c = CASES[case]
    tail, dtype, channels_last = c["tail"], c.get("dtype"), c.get("channels_last", False)
    plain_cls = {1: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}[len(tail)]
    plain = plain_cls(tail[0], **c.get("kwargs", {}))
    comms = world(2)
    layers = [SyncBatchNorm(tail[0], name="bn", comm=comm, stats="device", **c.get("kwargs", {})) for comm in comms]
    for layer in (plain, *layers):
        if layer.affine:
            with torch.no_grad():
                layer.weight.copy_(torch.linspace(0.5, 1.5, tail[0]))
                layer.bias.copy_(torch.linspace(-0.3, 0.3, tail[0]))
            layer.weight.requires_grad_(not c.get("frozen", False))
    sizes = shard_sizes(UNEQUAL, 2)
    ranks = Ranks(2, lambda fn: dict(enumerate(results(run(2, lambda r, _: fn(r), comms)))),
                  lambda values, name: sum(values.values()))
    with collective_timeout(10.0):
        train_like_one_process(
            ranks, sizes, training_batches(sum(sizes), tail, 2, offset=3.0), eval_batch(sum(sizes), tail, offset=3.0),
            lambda rank: TorchTrainer(layers[rank], channels_last, dtype),
            [TorchTrainer(plain, channels_last, dtype), TorchTrainer(copy.deepcopy(plain).double(), channels_last)],
            as_accurate())


OPAQUE = {"forward_local", "forward_apply", "backward_local", "backward_apply"}


def test_compiled_step_is_four_opaque_ops_whatever_the_shapes(gloo_world, kernels):
    """``torch.compile(fullgraph=True, dynamic=True)`` of a conv and a SyncBN layer: the
    traced graphs hold the step's four custom ops and no batch-norm kernel (torch's fused
    ones have no fake implementation: with symbolic shapes they could not be traced), and
    two batch sizes train as float64 plain BN on the same batch; the ops make their
    constants once (the heads cross the ops as floats: a NaN among them is a new object
    at every call)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    ours = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), SyncBatchNorm(4, stats="device"))
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)).double()
    plain.load_state_dict(ours.state_dict())
    step = torch.compile(ours, fullgraph=True, dynamic=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    constants = []
    for rows in (5, 7):
        x = torch.randn(rows, 3, 6, 6) * 2 + 3
        dy = torch.randn(rows, 4, 6, 6)
        step(x).backward(dy)
        plain(x.double()).backward(dy.double())
        for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-4, msg=f"{rows} rows: {name}")
            p.grad = q.grad = None
        torch.testing.assert_close(ours[1].running_var.double(), plain[1].running_var, rtol=1e-5, atol=1e-6)
        constants.append(len(kernels_module._cache))
    assert constants[0] == constants[1], f"the ops made new constants at the second step: {constants}"
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert OPAQUE <= {t.split(".")[1] for t in targets if t.startswith("hvd_syncbn.")}, targets
    assert not [t for t in targets if "batch_norm" in t], targets
