"""Local moments: the backend's reference (``backend.local_moments``) against numpy, then
every adapter kernel (PyTorch host and device paths, the Keras layer's fused kernel)
against the reference, on the same adversarial inputs."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tensorflow
from hvd_syncbn import backend
from oracle import assert_close

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


# (shape, how the tensor is laid out): channels-first contiguous input takes the shifted
# sums of the native backward kernel, other layouts var_mean.
TORCH_LAYOUTS = {
    "nchw-small": (3, 6, 9, 7),
    "nchw": (4, 6, 40, 40),
    "ncl": (8, 6, 700),
    "ncdhw": (2, 6, 16, 16, 16),
    "channels-last": (4, 6, 40, 40),
    "strided": (4, 6, 80, 40),
    "nc": (40, 6),
}


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


# bfloat16 leaves out mean 1e4 with std 0.1, which rounds every bfloat16 value alike.
@pytest.mark.parametrize("dtype, kind", [(d, k) for d in ("float32", "bfloat16", "float64") for k in DATA
                                         if (d, k) != ("bfloat16", "offset-1e4")])
@pytest.mark.parametrize("layout", TORCH_LAYOUTS)
def test_torch_device_kernel_matches_reference(layout, dtype, kind):
    """The device path's local buffer (the composite kernel set's: no host read, no fall-back),
    read back as moments: the data shifted by one of its values keeps the mean within
    1e-5 absolute even at mean 1e4 / std 0.1, where a plain float32 mean is off by 1e-3;
    the variance within the kernels' tolerance."""
    torch = pytest.importorskip("torch")
    from hvd_syncbn.torch.kernels import Composite, constant

    x = torch_input(layout, kind, dtype)
    count, mean, var = torch_reference(x)
    channels = x.shape[1]
    buf = Composite.local(x, constant((1.0,), x.device), torch.float64 if dtype == "float64" else torch.float32)
    assert buf.dtype == torch.float64 and buf.shape == (2 * channels + 1,)
    n, sums = -buf[:1], -buf[1:].view(2, channels)  # [-n | -n·mean | -n·(var + mean²)]
    assert n.tolist() == count.tolist()
    got_mean, ex2 = sums / n.clamp_min(1)  # no rows: zeros
    tol = KERNEL_TOL["float64"] if dtype == "float64" else dict(mean_rtol=0.0, mean_atol=1e-5, var_rtol=1e-5)
    # The buffer holds var + mean², so reading var back loses float64 roundoff u times (mean/std)² (backend's
    # Accuracy note): at most 4u·(mean/std)² from rounding mean, mean², var + mean² and the difference; measured
    # here at most 1.2u·(mean/std)² (offset 1e4).
    offset = float(np.nanmax(np.asarray(mean) ** 2 / np.maximum(np.asarray(var), 1e-300), initial=0.0))
    tol["var_rtol"] = max(tol["var_rtol"], 4 * (np.finfo(np.float64).eps / 2) * offset)
    assert_moments((got_mean, ex2 - got_mean * got_mean), (mean, var), f"torch device {layout} {dtype} {kind}",
                   **tol)


# (shape, channel axis): 4D in both data formats, and other ranks reshaped to 4D.
TF_LAYOUTS = {"nhwc": ((4, 9, 7, 6), 3), "nchw": ((4, 6, 9, 7), 1), "nlc": ((5, 30, 6), 2), "nc": ((40, 6), 1)}


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("layout", TF_LAYOUTS)
def test_tf_fused_kernel_matches_reference(layout, kind):
    """The Keras layer's ``_fused_moments`` (one ``FusedBatchNormV3`` pass; the reference
    where its float32 mean is too coarse) in eager mode and in a ``tf.function``."""
    tf = tensorflow()
    from hvd_syncbn.tensorflow.kernels import _fused_layout, _fused_moments

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
