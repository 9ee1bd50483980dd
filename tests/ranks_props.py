"""Property-based: PyTorch SyncBatchNorm on random shapes, shards, dtypes and offsets
equals one process running float64 ``nn.BatchNorm`` on the concatenated batch.

Launched at 1 rank plainly and at 2 and 3 ranks under mpirun (what it varies is the
split over the ranks, not the transport: ``test_launch.py``). Every rank draws the same
examples (``derandomize``, no shrinking, so no rank's sequence depends on another's
outcome); a rank that fails stops its peers through the layer's own timeout instead of
leaving them in a collective.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from hvd_syncbn import comm
from hvd_syncbn.torch import SyncBatchNorm
from oracle import assert_close, shard_slice

hvd = pytest.importorskip("horovod.torch")
hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()
comm.set_timeout(float(os.environ.get("HVD_SYNCBN_TIMEOUT", "30")))
PLAIN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
EXAMPLES = 200


@st.composite
def cases(draw):
    ndim = draw(st.integers(2, 5))
    rows = draw(st.lists(st.integers(0, 4), min_size=WORLD, max_size=WORLD).filter(lambda r: sum(r) >= 2))
    return dict(
        channels=draw(st.integers(1, 12)),
        spatial=draw(st.lists(st.integers(1, 3), min_size=ndim - 2, max_size=ndim - 2)),
        rows=rows,
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        offset=draw(st.sampled_from([0.0, 10.0, -100.0])),
        scale=draw(st.floats(0.5, 5.0)),
        affine=draw(st.booleans()),
        momentum=draw(st.sampled_from([0.1, 0.5, None])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(cases())
def test_random_cases_match_float64_bn_on_global_batch(case):
    c, rows = case["channels"], case["rows"]
    rng = np.random.default_rng(case["seed"])
    shape = (sum(rows), c, *case["spatial"])
    x_all = torch.from_numpy(case["offset"] + case["scale"] * rng.standard_normal(shape)).to(case["dtype"])
    r_all = torch.from_numpy(rng.standard_normal(shape))
    kwargs = dict(affine=case["affine"], momentum=case["momentum"])
    plain = PLAIN[len(shape)](c, dtype=torch.float64, **kwargs)
    sync = SyncBatchNorm(c, dtype=case["dtype"], name="props.bn", **kwargs)
    if case["affine"]:
        with torch.no_grad():
            for layer in (plain, sync):
                layer.weight.copy_(torch.linspace(0.5, 1.5, c))
                layer.bias.copy_(torch.linspace(-0.3, 0.3, c))

    ref = x_all.to(torch.float64, copy=True).requires_grad_(True)
    y_ref = plain(ref)
    (y_ref * r_all).sum().backward()
    mine = shard_slice(rows, RANK)
    x = x_all[mine].detach().clone().requires_grad_(True)
    y = sync(x)
    (y * r_all[mine].to(y.dtype)).sum().backward()

    # Tolerance from the batch's conditioning, cond = max|x| / (smallest per-channel std):
    # the input dtype's rounding of x costs eps·cond in x̂ (so in the output), and the
    # float64 moments buffer (n·(var + mean²), see hvd_syncbn.backend) 1e-16·cond². The
    # input gradient is the output's scaled by γ/std, dγ = Σr·x̂ and dβ = Σr sum the
    # output's error over each channel's rows: so are their tolerances. A bug is off by O(1).
    dims = [d for d in range(len(shape)) if d != 1]
    std = float(x_all.double().std(dims, unbiased=False).min().clamp_min(1e-12))
    cond = float(x_all.double().abs().max()) / std
    eps = 1e-13 if case["dtype"] == torch.float64 else 1e-6
    tol = dict(rtol=100 * eps, atol=20 * eps + 10 * (eps * cond + 1e-16 * cond**2))
    what = f"{case} rank {RANK}"
    assert y.dtype == case["dtype"]
    assert_close(y, y_ref.detach()[mine], f"output {what}", **tol)
    assert_close(x.grad, ref.grad[mine], f"input grad {what}", **dict(tol, atol=tol["atol"] * max(1.0, 1.5 / std)))
    if case["affine"]:
        per_channel = float(r_all.abs().sum(dims).max())  # Σ|r| over a channel's rows
        for name in ("weight", "bias"):
            got = hvd.allreduce(getattr(sync, name).grad.to(torch.float64), op=hvd.Sum, name=f"props.{name}")
            assert_close(got, getattr(plain, name).grad, f"{name} grad {what}",
                         **dict(tol, atol=tol["atol"] * max(1.0, per_channel)))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert_close(getattr(sync, name), getattr(plain, name), f"{name} {what}", **tol)

