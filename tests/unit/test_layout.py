"""One buffer layout (:mod:`hvd_syncbn.layout`) for every driver: the same input gives the
same forward and backward buffers from PyTorch's step (each kernel set), TensorFlow's and
the numpy reference, and a reference computed here from the definitions, in float64."""

import numpy as np
import pytest
import tensorflow as tf
import torch

import cuda_kernels
from hvd_syncbn import backend, layout
from hvd_syncbn.tensorflow.kernels import TF_OPS, CompositeKernels
from hvd_syncbn.torch import device
from hvd_syncbn.torch.kernels import KERNEL_SETS

EPS = 1e-5
AXES = [0, 2]  # (N, C, L): every axis but the channels'


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 3, 7)) * 2.0 + 10.0).astype(np.float32)  # an offset the variance survives
    dy = rng.standard_normal(x.shape).astype(np.float32)
    weight = np.array([0.5, 1.0, 2.0], np.float32)
    return x, dy, weight


def definitions(x, dy):
    """Both buffers from the definitions, in float64; and ``std`` per channel."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    n = x.size // x.shape[1]
    mean, var = x.mean(axis=tuple(AXES)), x.var(axis=tuple(AXES))
    xhat = (x - mean[:, None]) / np.sqrt(var + EPS)[:, None]
    fwd = np.concatenate([[-n], -n * mean, -n * (var + mean**2)])
    bwd = np.concatenate([dy.sum(axis=(0, 2)), (dy * xhat).sum(axis=(0, 2))])
    return fwd, bwd, np.sqrt(var + EPS)


def torch_buffers(x, dy, weight, kernels):
    """PyTorch's step alone (no header): its forward buffer, then its backward buffer."""
    x, dy, weight = (torch.from_numpy(a) for a in (x, dy, weight))
    plan = device.plan(None, EPS, torch.float32, False, KERNEL_SETS[kernels], torch.device("cpu"))
    fwd = device.forward_local(x, plan.fwd, plan)
    _, stats, invstd, _, _ = device.forward_apply(x, weight, None, fwd.clone(), plan.fwd, plan)
    bwd, *_ = device.backward_local(dy, x, weight, stats, invstd, plan.bwd, plan)
    return fwd.numpy(), bwd.numpy()


def tf_buffers(x, dy, weight):
    """TensorFlow's driver's buffers (:func:`hvd_syncbn.backend.forward` packs them so)."""
    kernels = CompositeKernels(AXES, EPS)
    count, mean, var = kernels.moments(tf.constant(x))
    stats = kernels.prepare(mean, var)
    sum_dy, sum_dy_xhat, _ = kernels.grad_sums(tf.constant(dy), tf.constant(x), stats, tf.constant(weight))
    fwd = layout.pack_moments(TF_OPS, count, mean, var)
    return fwd.numpy(), layout.pack_grad_sums(TF_OPS, sum_dy, sum_dy_xhat).numpy()


def test_every_driver_packs_the_same_buffers(data):
    x, dy, weight = data
    want_fwd, want_bwd, std = definitions(x, dy)
    channels = x.shape[1]
    assert want_fwd.shape == (layout.forward_size(channels),) and want_bwd.shape == (layout.backward_size(channels),)
    numpy_fwd = layout.pack_moments(backend.NUMPY_OPS, *backend.local_moments(backend.NUMPY_OPS, x, AXES))
    with cuda_kernels.registered():  # the native set's CUDA kernels, by their CPU stand-ins
        got = {"numpy": (numpy_fwd, None), "tensorflow": tf_buffers(x, dy, weight),
               "torch composite": torch_buffers(x, dy, weight, "composite"),
               "torch native": torch_buffers(x, dy, weight, "native")}
    # float32 moments and sums: as close as float32 arithmetic over 35 rows allows
    scale_fwd, scale_bwd = np.abs(want_fwd).max(), np.abs(want_bwd).max()
    for driver, (fwd, bwd) in got.items():
        np.testing.assert_allclose(fwd, want_fwd, rtol=0, atol=1e-5 * scale_fwd, err_msg=f"{driver}: forward")
        if bwd is None:
            continue
        if layout.grad_lane(driver.split()[-1]):  # Σdy·(x − mean): Σdy·x̂ times std
            bwd = np.concatenate([bwd[:channels], bwd[channels:] / std])
        np.testing.assert_allclose(bwd, want_bwd, rtol=0, atol=1e-5 * scale_bwd, err_msg=f"{driver}: backward")


def test_unpack_gives_the_global_moments_of_summed_shards(data):
    x = data[0]
    shards = (x[:2], x[2:], x[:0])  # unequal, and one empty
    total = sum(layout.pack_moments(backend.NUMPY_OPS, *backend.local_moments(backend.NUMPY_OPS, s, AXES))
                for s in shards)
    count, mean, var = layout.unpack_moments(backend.NUMPY_OPS, total)
    x64 = x.astype(np.float64)
    assert count.tolist() == [x.size // x.shape[1]]
    np.testing.assert_allclose(mean, x64.mean(axis=(0, 2)), rtol=1e-12)
    np.testing.assert_allclose(var, x64.var(axis=(0, 2)), rtol=1e-9)
    empty = layout.unpack_moments(backend.NUMPY_OPS, np.zeros(layout.forward_size(3)))
    assert [v.tolist() for v in empty] == [[0.0], [0.0] * 3, [0.0] * 3]
