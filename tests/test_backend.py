"""The framework-free backend, driven by numpy with ranks simulated as threads."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import collective_timeout, results, run, world
from hvd_syncbn import backend, comm
from oracle import EMPTY, UNEQUAL, assert_as_accurate, assert_close, global_batch, shard_sizes, shard_slice


class ThreadRanks:
    """``size`` ranks as threads sharing a summing allreduce; records every call."""

    def __init__(self, size):
        self.world, self.calls = size, []
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def allreduce_for(self, rank):
        def allreduce_sum(buf, name):
            self.slots[rank] = buf
            self.barrier.wait()
            total = np.sum(self.slots, axis=0)
            if rank == 0:
                self.calls.append((name, buf.shape, buf.dtype))
            self.barrier.wait()
            return total

        return allreduce_sum

    def run(self, fn):
        results, errors = [None] * self.world, []

        def target(rank):
            try:
                results[rank] = fn(rank, self.allreduce_for(rank))
            except BaseException as e:  # surfaced below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        if errors:
            raise errors[0]
        return results


def rounded_moments(x, refine=True):
    """Per-channel local (count, mean, biased var) of an (N, C, ...) shard, as adapters do:
    accumulated in float64 (as the native kernels do), rounded to the input's precision,
    the mean kept in float64 where the backend asks for it."""
    c = x.shape[1]
    rows = np.moveaxis(x, 1, 0).reshape(c, -1)  # (C, N*H*W)
    if rows.shape[1] == 0:
        return np.zeros(1), np.zeros(c, np.float32), np.zeros(c, np.float32)
    wide_mean = rows.mean(axis=1, dtype=np.float64)
    mean, var = wide_mean.astype(x.dtype), rows.var(axis=1, dtype=np.float64).astype(x.dtype)
    if refine and backend.needs_float64(backend.NUMPY_OPS, mean, var):
        mean = wide_mean
    return np.array([rows.shape[1]], np.float32), mean, var


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("pattern", [UNEQUAL, EMPTY], ids=["unequal", "empty"])
def test_sync_moments_equal_moments_of_concatenated_batch(size, pattern):
    sizes = shard_sizes(pattern, size)
    x = global_batch(0, sum(sizes), (5, 3, 2), offset=3.0)
    ranks = ThreadRanks(size)

    def step(rank, allreduce):
        n, m, v = rounded_moments(x[shard_slice(sizes, rank)])
        return backend.sync_moments(backend.NUMPY_OPS, allreduce, n, m, v)

    x64 = np.moveaxis(x.astype(np.float64), 1, 0).reshape(5, -1)
    for total, mean, var in ranks.run(step):  # every rank gets the same global moments
        assert total[0] == x64.shape[1]
        assert_close(mean, x64.mean(axis=1), "mean", rtol=1e-6)
        assert_close(var, x64.var(axis=1), "var", rtol=1e-5)
    assert ranks.calls == [("fwd", (2 * 5 + 1,), np.float64)]  # one buffer


def test_variance_survives_large_offset_and_naive_float32_does_not():
    sizes = shard_sizes(UNEQUAL, 2)
    x = global_batch(1, sum(sizes), (4, 8, 8), offset=1e4, scale=0.1)
    want = np.moveaxis(x.astype(np.float64), 1, 0).reshape(4, -1).var(axis=1)

    def rel_error(refine):
        def step(rank, allreduce):
            moments = rounded_moments(x[shard_slice(sizes, rank)], refine)
            return backend.sync_moments(backend.NUMPY_OPS, allreduce, *moments)

        _, _, var = ThreadRanks(2).run(step)[0]
        return np.max(np.abs(var - want) / want)

    assert rel_error(refine=True) <= 1e-5  # 2e-6 measured
    # The check can fail: with float32-rounded local means alone it is 30x worse (6.6e-5),
    assert rel_error(refine=False) > 2e-5
    # and so is a naive float32 Σx² − (Σx)²/n.
    rows = np.moveaxis(x, 1, 0).reshape(4, -1)
    n = np.float32(rows.shape[1])
    naive = (np.sum(rows * rows, axis=1) - np.sum(rows, axis=1) ** 2 / n) / n
    assert np.max(np.abs(naive - want) / want) > 1e-4


def bn_loss(x, w, b, r, eps):
    """Σ r·BN(x) over the whole batch, float64, for finite differences."""
    mean = x.mean(axis=(0, 2), keepdims=True)
    var = x.var(axis=(0, 2), keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * w[None, :, None] + b[None, :, None]
    return float(np.sum(r * y))


def test_input_grad_matches_finite_differences_across_ranks():
    sizes, eps = shard_sizes(UNEQUAL, 3), 1e-3
    x = global_batch(2, sum(sizes), (3, 4)).astype(np.float64)
    r = global_batch(3, sum(sizes), (3, 4)).astype(np.float64)
    w, b = np.array([0.5, 1.0, 2.0]), np.array([0.1, -0.2, 0.3])

    def step(rank, allreduce):
        xs, dy = x[shard_slice(sizes, rank)], r[shard_slice(sizes, rank)]
        n, m, v = rounded_moments(xs)
        total, mean, var = backend.sync_moments(backend.NUMPY_OPS, allreduce, n, m.astype(np.float64), v)
        invstd = 1.0 / np.sqrt(var + eps)
        xhat = (xs - mean[None, :, None]) * invstd[None, :, None]
        g, h = backend.sync_grad_sums(backend.NUMPY_OPS, allreduce, dy.sum(axis=(0, 2)), (dy * xhat).sum(axis=(0, 2)))
        k, s, t = backend.input_grad_coeffs(backend.NUMPY_OPS, total, invstd, w, g, h)
        return k[None, :, None] * dy + s[None, :, None] * xhat + t[None, :, None]

    dx = np.concatenate(ThreadRanks(3).run(step))
    numeric = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = 1e-6
        numeric[i] = (bn_loss(x + d, w, b, r, eps) - bn_loss(x - d, w, b, r, eps)) / 2e-6
    assert_close(dx, numeric, "dx vs finite differences", rtol=1e-5, atol=1e-7)


def test_running_statistics_helpers():
    assert backend.ema(np.float64(10.0), np.float64(0.0), old_weight=0.9) == pytest.approx(9.0)
    assert backend.unbiased(np.float64(2.0), np.float64(5.0)) == pytest.approx(2.5)


def test_collective_names_say_which_layer_and_direction():
    """A collective's name is the layer's and the direction's, and nothing else: the same
    on every rank and at every step, distinct across layers and directions."""
    names = {comm.Call(layer, d, step, 4, 4, "float32", rank).name
             for layer in ("layer1.0.bn1", "layer1.0.bn2") for d in ("fwd", "bwd")
             for step in (0, 5) for rank in (0, 3)}
    assert names == {"hvd_syncbn.layer1.0.bn1.fwd", "hvd_syncbn.layer1.0.bn1.bwd",
                     "hvd_syncbn.layer1.0.bn2.fwd", "hvd_syncbn.layer1.0.bn2.bwd"}


@pytest.mark.parametrize(
    "shape, floating, match",
    [
        ((4,), True, r"bn7: expected an input with at least 2 dims \(N, C, \.\.\.\), got 1D"),
        ((4, 3, 2), True, r"bn7: expected 8 channels on axis 1, got 3"),
        ((4, 8), False, r"bn7: expected a floating-point input .* got int32; cast it first, e\.g\. x\.float\(\)"),
    ],
)
def test_check_input_messages(shape, floating, match):
    with pytest.raises(ValueError, match=match):
        backend.check_input("bn7", shape, 1, 8, floating, "int32", "x.float()")
    backend.check_input("bn7", (None, 8, 5), 1, 8, True, "float32", "x.float()")  # unknown batch is fine


def test_single_global_row_raises_when_training():
    with pytest.raises(ValueError, match="bn: expected more than 1 value per channel"):
        backend.check_global_count("bn", 1.0, training=True)
    backend.check_global_count("bn", 1.0, training=False)


def test_import_loads_no_framework():
    code = (
        "import sys, hvd_syncbn, hvd_syncbn.backend; "
        "bad = sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod') if m in sys.modules); "
        "print(bad); sys.exit(bool(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, f"importing hvd_syncbn loaded {out.stdout.strip()} {out.stderr[-500:]}"


# ---------------------------------------------------------------- local moments
# The reference (backend.local_moments) against numpy, then every adapter kernel against
# the reference, on the same adversarial inputs.

DATA = ["unit", "offset-3", "offset-1e4", "nan", "empty", "one-row"]
"""Adversarial inputs: N(0, 1); N(3, 0.5²); mean 1e4 with std 0.1 in float32 (where a
float32 mean is too coarse); NaN in one value of channel 1; no rows; one value per channel."""


def adversarial(kind: str, shape, channel: int, seed: int = 5, dtype=np.float32) -> np.ndarray:
    """A ``kind`` input of ``shape`` (its batch and non-channel sizes replaced for
    ``empty`` and ``one-row``) whose channels are on axis ``channel``."""
    if kind == "empty":
        shape = (0, *shape[1:])
    if kind == "one-row":
        shape = tuple(s if a == channel else 1 for a, s in enumerate(shape))
    offset, scale = {"offset-3": (3.0, 0.5), "offset-1e4": (1e4, 0.1), "nan": (3.0, 0.5)}.get(kind, (0.0, 1.0))
    x = (offset + scale * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)
    if kind == "nan":
        where = [0] * len(shape)
        where[channel] = 1
        x[tuple(where)] = np.nan
    return x


def numpy_moments(x: np.ndarray, channel: int):
    """Independent oracle: count, mean and biased variance per channel with np.mean and
    np.var in float64 on the ``(C, rows)`` view; zeros for no rows."""
    rows = np.moveaxis(np.asarray(x, np.float64), channel, 0).reshape(x.shape[channel], -1)  # (C, rows)
    if rows.shape[1] == 0:
        return 0, np.zeros(len(rows)), np.zeros(len(rows))
    return rows.shape[1], rows.mean(axis=1), rows.var(axis=1)


def assert_moments(got, want, what: str, mean_rtol: float, mean_atol: float, var_rtol: float,
                   var_atol: float = 0.0) -> None:
    """``(mean, var)`` against ``(mean, var)``: NaN in exactly the same channels, the
    rest within the tolerances (``var_atol`` 0: a variance of 0 must be exactly 0)."""
    for name, g, w, rtol, atol in (("mean", got[0], want[0], mean_rtol, mean_atol),
                                   ("var", got[1], want[1], var_rtol, var_atol)):
        g, w = np.asarray(g, np.float64).reshape(-1), np.asarray(w, np.float64).reshape(-1)
        assert g.shape == w.shape, f"{what} {name}: shape {g.shape} != {w.shape}"
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what} {name}: NaN in other channels")
        finite = ~np.isnan(w)
        assert_close(g[finite], w[finite], f"{what} {name}", rtol=rtol, atol=atol)


# Channels first (N, C, H, W) and last (N, H, W, C): (shape, channel axis, reduced axes).
REFERENCE_LAYOUTS = {"channels-first": ((6, 5, 4, 3), 1, (0, 2, 3)),
                     "channels-last": ((6, 4, 3, 5), 3, (0, 1, 2))}


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("layout", REFERENCE_LAYOUTS)
def test_reference_local_moments_match_numpy(layout, kind):
    shape, channel, axes = REFERENCE_LAYOUTS[layout]
    x = adversarial(kind, shape, channel)
    count, mean, var = backend.local_moments(backend.NUMPY_OPS, x, axes)
    rows, want_mean, want_var = numpy_moments(x, channel)
    assert count.shape == (1,) and count.dtype == mean.dtype == var.dtype == np.float64
    assert count[0] == rows
    assert_moments((mean, var), (want_mean, want_var), f"{layout} {kind}", mean_rtol=1e-12, mean_atol=1e-12,
                   var_rtol=1e-9)
    if kind == "nan":
        assert np.isnan(mean[1]) and np.isnan(var[1]) and np.isfinite(np.delete(var, 1)).all()


@pytest.mark.parametrize("kind", ["unit", "offset-1e4", "nan", "all-masked", "nan-masked"])
@pytest.mark.parametrize("layout", REFERENCE_LAYOUTS)
def test_reference_local_moments_with_weights_are_those_of_the_kept_rows(layout, kind):
    """A 0/1 weight per position (the same on every channel) leaves those positions out."""
    shape, channel, axes = REFERENCE_LAYOUTS[layout]
    x = adversarial({"all-masked": "unit", "nan-masked": "nan"}.get(kind, kind), shape, channel)
    positions = tuple(s if a != channel else 1 for a, s in enumerate(shape))
    keep = np.random.default_rng(9).random(positions) > (1.1 if kind == "all-masked" else 0.4)
    if kind in ("nan", "nan-masked"):  # kept: NaN in its channel only; masked: every channel finite
        keep[(0,) * len(shape)] = kind == "nan"
    weights = np.broadcast_to(keep, shape).astype(np.float32)
    count, mean, var = backend.local_moments(backend.NUMPY_OPS, x, axes, weights)
    kept = np.moveaxis(x, channel, -1)[np.moveaxis(keep, channel, -1)[..., 0]]  # (kept rows, C)
    rows, want_mean, want_var = numpy_moments(kept, 1)
    assert count[0] == rows == keep.sum()
    assert_moments((mean, var), (want_mean, want_var), f"{layout} {kind} masked", mean_rtol=1e-12,
                   mean_atol=1e-12, var_rtol=1e-9)
    assert np.isfinite(np.delete(var, 1) if kind == "nan" else var).all()


# Float32 kernels against the float64 reference: the native kernel sums in float32, in
# order with one thread: about sqrt(n)·6e-8 relative, 4.8e-6 for the 6400 values of the
# largest input (5e-6 seen, bfloat16 channels-last), so the variance within rtol 2e-5 and
# the mean (1e-6 seen) within 1e-5. Where |mean| > 100·std (offset-1e4) the kernels must
# hand over to the reference: float64 to 1e-9.
KERNEL_TOL = {
    "float32": dict(mean_rtol=1e-5, mean_atol=1e-6, var_rtol=2e-5),
    "float64": dict(mean_rtol=1e-12, mean_atol=1e-12, var_rtol=1e-10),
    "reference": dict(mean_rtol=1e-12, mean_atol=1e-9, var_rtol=1e-9),
}


def kernel_tol(kind: str, acc: str) -> dict:
    return KERNEL_TOL["reference" if kind == "offset-1e4" else acc]


# (shape, how the tensor is laid out): small inputs and other layouts take the native
# statistics kernel; large contiguous channels-first ones the shifted sums.
TORCH_LAYOUTS = {
    "nchw-small": (3, 6, 9, 7),
    "nchw": (4, 6, 40, 40),
    "ncl": (8, 6, 700),
    "ncdhw": (2, 6, 16, 16, 16),
    "channels-last": (4, 6, 40, 40),
    "strided": (4, 6, 80, 40),
    "nc": (40, 6),
}
SHIFTED = ("nchw", "ncl", "ncdhw")


def torch_input(layout: str, kind: str, dtype: str = "float32"):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(adversarial(kind, TORCH_LAYOUTS[layout], 1)).to(getattr(torch, dtype))
    if layout == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        x = x[:, :, ::2]
    return x


def torch_reference(x):
    """The backend's reference on exactly the values the kernel sees (``x`` in float64)."""
    import torch

    dims = [0, *range(2, x.dim())]
    return backend.local_moments(backend.NUMPY_OPS, x.to(torch.float64).numpy(), dims)


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("layout, guess", [(layout, None) for layout in TORCH_LAYOUTS]
                         + [(layout, g) for layout in SHIFTED for g in (0.3, 3.0, 300.0)])
def test_torch_kernel_matches_reference(layout, guess, kind):
    """The PyTorch layer's ``host_moments`` in every layout and path. ``guess``: the
    mean guess (the layer passes its last global mean) that many standard deviations off
    this batch's mean; ``None``: no guess. (Sums centred on a guess 300 std off would
    lose 5 digits to cancellation: the kernel must notice and centre on the mean.)"""
    torch = pytest.importorskip("torch")
    from hvd_syncbn.torch.kernels import _CENTRED_FROM, host_moments

    x = torch_input(layout, kind)
    if kind in ("unit", "offset-3") and layout in SHIFTED:  # large enough for the shifted sums
        assert x.numel() >= _CENTRED_FROM and x.is_contiguous()
    _, mean, var = torch_reference(x)
    shift = None
    if guess is not None:
        shift = torch.from_numpy(np.nan_to_num(mean + guess * np.sqrt(np.nan_to_num(var)))).float()
    got = host_moments(x, torch.float32, shift)
    assert_moments(got, (mean, var), f"torch {layout} {kind} guess {guess}", **kernel_tol(kind, "float32"))


@pytest.mark.parametrize("kind", ["unit", "offset-3", "nan", "empty", "one-row"])
@pytest.mark.parametrize("layout", ["nchw-small", "nchw", "channels-last"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_kernel_low_precision_input_accumulates_in_float32(dtype, layout, kind):
    """bf16/fp16 input with float32 statistics (autocast, or a half model with float32
    BN): against the reference on the half values themselves. (Mean 1e4 with std 0.1
    rounds every half value alike, so it is left out.)"""
    torch = pytest.importorskip("torch")
    from hvd_syncbn.torch.kernels import host_moments

    x = torch_input(layout, kind, dtype)
    _, mean, var = torch_reference(x)
    got = host_moments(x, torch.float32)
    assert_moments(got, (mean, var), f"torch {dtype} {layout} {kind}", **KERNEL_TOL["float32"])


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("layout, guess", [("nchw-small", None), ("nchw", None), ("nchw", 0.3), ("nchw", 3.0),
                                           ("nchw", 300.0), ("channels-last", None)])
def test_torch_kernel_float64(layout, guess, kind):
    torch = pytest.importorskip("torch")
    from hvd_syncbn.torch.kernels import host_moments

    x = torch_input(layout, kind, "float64")
    _, mean, var = torch_reference(x)
    shift = None if guess is None else torch.from_numpy(np.nan_to_num(mean + guess * np.sqrt(np.nan_to_num(var))))
    got = host_moments(x, torch.float64, shift)
    assert_moments(got, (mean, var), f"torch float64 {layout} {kind} guess {guess}", **KERNEL_TOL["float64"])


# bfloat16 leaves out mean 1e4 with std 0.1, which rounds every bfloat16 value alike.
@pytest.mark.parametrize("dtype, kind", [(d, k) for d in ("float32", "bfloat16", "float64") for k in DATA
                                         if (d, k) != ("bfloat16", "offset-1e4")])
@pytest.mark.parametrize("layout", TORCH_LAYOUTS)
def test_torch_device_kernel_matches_reference(layout, dtype, kind):
    """The device path's ``DeviceKernels.moments`` (no host read, no fall-back): the data shifted by one
    of its values keeps the mean within 1e-5 absolute even at mean 1e4 / std 0.1, where a
    plain float32 mean is off by 1e-3; the variance within the kernels' tolerance."""
    torch = pytest.importorskip("torch")
    from hvd_syncbn.torch.kernels import DeviceKernels

    x = torch_input(layout, kind, dtype)
    count, mean, var = torch_reference(x)
    got = DeviceKernels(1e-5, torch.float64 if dtype == "float64" else torch.float32).moments(x)
    assert got[0].tolist() == count.tolist() and all(t.dtype == torch.float64 for t in got)
    tol = KERNEL_TOL["float64"] if dtype == "float64" else dict(mean_rtol=0.0, mean_atol=1e-5, var_rtol=1e-5)
    assert_moments(got[1:], (mean, var), f"torch device {layout} {dtype} {kind}", **tol)


# (shape, channel axis): 4D in both data formats, and other ranks reshaped to 4D.
TF_LAYOUTS = {"nhwc": ((4, 9, 7, 6), 3), "nchw": ((4, 6, 9, 7), 1), "nlc": ((5, 30, 6), 2), "nc": ((40, 6), 1)}


def tf_module():
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("tensorflow")


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("layout", TF_LAYOUTS)
def test_tf_fused_kernel_matches_reference(layout, kind):
    """The Keras layer's ``_fused_moments`` (one ``FusedBatchNormV3`` pass; the reference
    where its float32 mean is too coarse) in eager mode and in a ``tf.function``."""
    tf = tf_module()
    from hvd_syncbn.tensorflow.functional import _fused_layout, _fused_moments

    shape, channel = TF_LAYOUTS[layout]
    x_np = adversarial(kind, shape, channel)
    axes = [a for a in range(len(shape)) if a != channel]
    x = tf.constant(x_np)
    to_fused, fmt = _fused_layout(x, axes)
    assert fmt == ("NHWC" if channel == len(shape) - 1 else "NCHW")
    count, mean, var = backend.local_moments(backend.NUMPY_OPS, x_np, axes)

    def moments(x):
        return _fused_moments(x, axes, to_fused(x), fmt)

    for how, fn in (("eager", moments), ("tf.function", tf.function(moments))):
        got = [t.numpy() for t in fn(x)]
        assert got[0].shape == (1,) and got[0][0] == count[0], f"{how} count {got[0]} != {count}"
        assert_moments(got[1:], (mean, var), f"tf {how} {layout} {kind}", **kernel_tol(kind, "float32"))


# ------------------------------------------------ the layers over a world of threads
# Each rank is a thread with its own layer and its own Communicator of one world(W):
# the layers' real synchronized path, against plain BN on the concatenated batch.

STEPS = 3


@pytest.fixture(autouse=True)
def bounded_collectives():
    """A rank that waits for a peer raises within seconds rather than the default minute."""
    with collective_timeout(10.0):
        yield


def torch_pair(size: int, tail, stats=None, **kwargs):
    """``size`` SyncBatchNorm layers over one thread world, and a float64 plain BN, all
    with the same non-trivial affine parameters."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from hvd_syncbn.torch import SyncBatchNorm

    channels = tail[0]
    plain_cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(tail) + 1]
    plain = plain_cls(channels, dtype=torch.float64, **kwargs)
    comms = world(size)
    layers = [SyncBatchNorm(channels, name="bn", comm=c, stats=stats, **kwargs) for c in comms]
    if plain.affine:
        with torch.no_grad():
            for layer in (plain, *layers):
                layer.weight.copy_(torch.linspace(0.5, 1.5, channels))
                layer.bias.copy_(torch.linspace(-0.3, 0.3, channels))
    return comms, layers, plain


TORCH_WORLD_CASES = {
    "2d-unequal": dict(tail=(4, 5, 5), pattern=UNEQUAL),
    "2d-empty-rank": dict(tail=(4, 5, 5), pattern=EMPTY),
    "1d-NC": dict(tail=(6,), pattern=UNEQUAL),
    "3d": dict(tail=(3, 2, 3, 4), pattern=EMPTY),
    "channels-last": dict(tail=(4, 5, 5), pattern=UNEQUAL, channels_last=True),
    "affine-false": dict(tail=(4, 5, 5), pattern=UNEQUAL, kwargs=dict(affine=False)),
    # mean/std 1000: the local moments take the float64 reference; x̂ in float32 is off by
    # up to ulp(100)/std ≈ 1e-4, in plain float32 BN as in ours.
    "large-offset": dict(tail=(4, 5, 5), pattern=UNEQUAL, offset=100.0, scale=0.1),
}


@pytest.mark.parametrize("stats", ["host", "device"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case", TORCH_WORLD_CASES)
def test_torch_layer_in_a_thread_world_matches_plain_bn(case, size, stats):
    """``STEPS`` training steps, then eval: outputs, input grads, weight/bias grads summed
    over the ranks, running statistics and ``num_batches_tracked``, as close to
    ``nn.BatchNorm`` in float64 on the concatenated batch as ``nn.BatchNorm`` in float32
    is (``assert_as_accurate``); one collective per direction per step. On both paths of
    the statistics (the device path over the custom op)."""
    torch = pytest.importorskip("torch")
    c = TORCH_WORLD_CASES[case]
    tail, channels_last = c["tail"], c.get("channels_last", False)
    offset, scale = c.get("offset", 0.0), c.get("scale", 1.0)
    comms, layers, plain = torch_pair(size, tail, stats=stats, **c.get("kwargs", {}))
    plain32 = copy.deepcopy(plain).float()
    sizes = shard_sizes(c["pattern"], size)
    batches = [(torch.from_numpy(global_batch(step, sum(sizes), tail, offset=offset + scale * step, scale=scale)),
                torch.from_numpy(global_batch(100 + step, sum(sizes), tail))) for step in range(STEPS)]
    state = ("running_mean", "running_var", "num_batches_tracked")

    def train(layer, x, r):
        x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        x = x.clone().requires_grad_(True)
        y = layer(x)
        (y * r).sum().backward()
        params = {f"{n} grad": getattr(layer, n).grad.clone() for n in ("weight", "bias")
                  if getattr(layer, n) is not None}
        layer.zero_grad(set_to_none=True)
        return dict(output=y.detach(), **{"input grad": x.grad}, **params,
                    **{n: getattr(layer, n).clone() for n in state})

    want = [train(plain, x.double(), r.double()) for x, r in batches]
    want32 = [train(plain32, x, r) for x, r in batches]

    def rank(r, comm):
        assert layers[r].comm is comm
        mine = shard_slice(sizes, r)
        return [train(layers[r], x[mine], t[mine]) for x, t in batches]

    got = results(run(size, rank, comms))
    for step, expected in enumerate(want):
        what = f"{case}, step {step}, {sizes} rows"
        for r in range(size):
            mine, ours = shard_slice(sizes, r), dict(got[r][step])
            if channels_last and sizes[r]:
                assert ours["output"].is_contiguous(memory_format=torch.channels_last), "channels_last output lost"
            for name in ("weight grad", "bias grad"):  # summed over the ranks, as an optimizer would
                if name in ours:
                    ours[name] = sum(got[q][step][name] for q in range(size))
            ref, ref32 = ({n: t[mine] if n in ("output", "input grad") else t for n, t in e.items()}
                          for e in (expected, want32[step]))
            assert_as_accurate(ours, ref32, ref, f"rank {r} ({what})")
    assert [c.calls for c in comms] == [2 * STEPS] * size, "expected one collective per direction per step"
    x = torch.from_numpy(global_batch(50, sum(sizes), tail, offset=offset, scale=scale))
    with torch.no_grad():
        ref, ref32 = (model.eval()(x.to(dtype)) for model, dtype in ((plain, torch.float64), (plain32, torch.float32)))
        for r, layer in enumerate(layers):
            mine = shard_slice(sizes, r)
            assert_as_accurate({"eval output": layer.eval()(x[mine])}, {"eval output": ref32[mine]},
                               {"eval output": ref[mine]}, f"rank {r}")
    assert [c.calls for c in comms] == [2 * STEPS] * size, "eval communicated"


def test_torch_bad_input_on_one_rank_fails_every_rank_naming_it():
    """Rank 1's input has 3 channels for a 4-channel layer: rank 1 raises
    SyncBatchNormInputError (a ValueError), its peers SyncBatchNormError, every message
    naming rank 1 and the problem; no rank's running statistics move."""
    torch = pytest.importorskip("torch")
    comms, layers, _ = torch_pair(3, (4, 5))
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]

    def rank(r, comm):
        x = torch.from_numpy(global_batch(r, 3, (3 if r == 1 else 4, 5))).requires_grad_(True)
        layers[r](x).sum().backward()

    with collective_timeout(5.0):
        out = run(3, rank, comms)
    assert_everyone_names_the_bad_rank(out, "rank 1: bn: expected 4 channels on axis 1, got 3 (input shape (3, 3, 5))")
    for layer, state in zip(layers, before):
        for k, v in layer.state_dict().items():
            assert torch.equal(v, state[k]), f"{k} changed in a failed step"


def assert_everyone_names_the_bad_rank(out: list, problem: str, bad: int = 1) -> None:
    """The row of docs/failures.md: SyncBatchNormInputError on the bad rank, SyncBatchNormError on its
    peers, every one with the bad rank's problem."""
    for r, e in enumerate(out):
        assert isinstance(e, comm.SyncBatchNormError), f"rank {r}: {e!r}"
        assert (r == bad) == isinstance(e, comm.SyncBatchNormInputError), f"rank {r}: {type(e).__name__}"
        assert (r == bad) <= isinstance(e, ValueError), f"rank {r}: {type(e).__name__}"
        text = str(e)
        assert f"this is rank {r}, in layer 'bn' forward, step 0" in text, f"rank {r}: {text}"
        assert problem in text, f"rank {r}'s message lacks {problem!r}:\n{text}"


def keras_pair(size: int, tail, axis: int):
    """``size`` SyncBatchNormalization layers over one thread world, and a float64 plain
    Keras BN, built in this thread with the same non-trivial gamma and beta."""
    tf_module()
    keras = pytest.importorskip("keras")
    from hvd_syncbn.tensorflow import SyncBatchNormalization

    comms = world(size)
    plain = keras.layers.BatchNormalization(axis=axis, dtype="float64")
    layers = [SyncBatchNormalization(axis=axis, comm=c, name="bn") for c in comms]
    for layer in (plain, *layers):
        layer.build((None, *tail))
        for name, lo, hi in (("gamma", 0.5, 1.5), ("beta", -0.3, 0.3)):
            w = getattr(layer, name)
            w.assign(np.linspace(lo, hi, int(np.prod(w.shape))).reshape(w.shape))
    return comms, layers, plain


KERAS_WORLD_CASES = {
    "channels-last": dict(tail=(5, 5, 4), axis=-1, pattern=UNEQUAL),
    "channels-first": dict(tail=(4, 5, 5), axis=1, pattern=EMPTY),
    "3d-channels-last-mask": dict(tail=(6, 4), axis=-1, pattern=UNEQUAL, mask=True),
}
# Keras in tf.function runs at 2 ranks only: with 3 threads of one process, TF's shared
# inter-op pool runs the stateful numpy_function hops of the ranks' graphs in an order
# that does not match across ranks (the identity header then raises); one process per
# rank, as under a launcher, has no such pool to share.
KERAS_WORLDS = [(case, size, False) for case in KERAS_WORLD_CASES for size in (2, 3)]
KERAS_WORLDS += [("channels-last", 2, True), ("3d-channels-last-mask", 2, True)]


@pytest.mark.parametrize("case, size, compiled", KERAS_WORLDS,
                         ids=[f"{c}-{s}-{'tf.function' if f else 'eager'}" for c, s, f in KERAS_WORLDS])
def test_keras_layer_in_a_thread_world_matches_keras_bn(case, size, compiled):
    """``STEPS`` training steps, then inference: outputs, input grads, gamma/beta grads
    summed over the ranks and moving statistics, against ``keras.layers.BatchNormalization``
    in float64 on the concatenated batch; one collective per direction per step."""
    tf = tf_module()
    c = KERAS_WORLD_CASES[case]
    tail, mask = c["tail"], c.get("mask", False)
    comms, layers, plain = keras_pair(size, tail, c["axis"])
    sizes = shard_sizes(c["pattern"], size)
    batches = [(global_batch(step, sum(sizes), tail, offset=step), global_batch(100 + step, sum(sizes), tail),
                global_batch(200 + step, sum(sizes), tail[:-1]) > -0.5 if mask else None) for step in range(STEPS)]

    def train(layer, x, r, m):
        x, r = tf.cast(x, layer.variable_dtype), tf.cast(r, layer.variable_dtype)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=m)
            loss = tf.reduce_sum(y * r)
        dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return y, dx, dgamma, dbeta

    def tensors(x, r, m, rows=slice(None)):
        return tf.constant(x[rows]), tf.constant(r[rows]), None if m is None else tf.constant(m[rows])

    def moving(layer):
        return [layer.moving_mean.numpy(), layer.moving_variance.numpy()]

    want = []
    for x, r, m in batches:
        want.append([t.numpy() for t in train(plain, *tensors(x, r, m))] + moving(plain))

    def rank(k, comm):
        assert layers[k].comm is comm
        step = tf.function(train) if compiled else train
        mine, out = shard_slice(sizes, k), []
        for x, r, m in batches:
            grads = step(layers[k], *tensors(x, r, m, mine))
            assert all(g is not None for g in grads), f"rank {k}: a gradient is None"
            out.append([t.numpy() for t in grads] + moving(layers[k]))
        return out

    got = results(run(size, rank, comms))
    names = ("output", "input grad", "gamma grad", "beta grad", "moving_mean", "moving_variance")
    for step, expected in enumerate(want):
        what = f"{case}, step {step}, {sizes} rows"
        for k in range(size):
            mine = shard_slice(sizes, k)
            for i, name in enumerate(names):
                if name in ("gamma grad", "beta grad"):
                    continue
                exp = expected[i][mine] if i < 2 else expected[i]
                assert_close(got[k][step][i], exp, f"{name}, rank {k} ({what})")
        for i in (2, 3):  # float32 sums of ~10² O(1) terms that nearly cancel
            summed = sum(got[k][step][i] for k in range(size))
            assert_close(summed, expected[i], f"{names[i]} summed over ranks ({what})", atol=1e-5)
    assert [c.calls for c in comms] == [2 * STEPS] * size, "expected one collective per direction per step"
    x = global_batch(50, sum(sizes), tail)
    want_eval = plain(x, training=False).numpy()
    for k, layer in enumerate(layers):
        mine = shard_slice(sizes, k)
        assert_close(layer(x[mine], training=False), want_eval[mine], f"inference output, rank {k}")
    assert [c.calls for c in comms] == [2 * STEPS] * size, "inference communicated"


def test_keras_bad_input_on_one_rank_fails_every_rank_naming_it():
    """As for PyTorch: rank 1's input has 3 channels for a 4-channel layer (axis 1)."""
    tf = tf_module()
    comms, layers, _ = keras_pair(3, (4, 5), axis=1)
    before = [[w.numpy().copy() for w in layer.weights] for layer in layers]

    def rank(r, comm):
        x = tf.constant(global_batch(r, 3, (3 if r == 1 else 4, 5)))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layers[r](x, training=True)
        tape.gradient(y, x)

    with collective_timeout(5.0):
        out = run(3, rank, comms)
    assert_everyone_names_the_bad_rank(out, "rank 1: bn: expected 4 channels on axis 1, got 3 (input shape (3, 3, 5))")
    for layer, state in zip(layers, before):
        for w, b in zip(layer.weights, state):
            assert np.array_equal(w.numpy(), b), f"{w.name} changed in a failed step"
