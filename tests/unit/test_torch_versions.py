"""The PyTorch layer on the torch its users have, checked on the newer one installed here:
torch's older signatures stood in by monkeypatching (older torch cannot be installed on a
CPU-only machine), and what an older Dynamo refuses avoided by construction.

- ``_BatchNorm.__init__`` without the ``bias`` keyword (torch 2.11 and older): the layer
  constructs (with and without ``β``), converts, resets and steps on both paths, at 2
  ranks of a thread world against plain BN's formula on the concatenated batch.
- ``torch.compile``: the function Dynamo treats as a constant gets Python constants only
  (torch 2.11's Dynamo refuses a module there, issue #46).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import init  # noqa: E402
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase  # noqa: E402

from conftest import collective_timeout, results, run  # noqa: E402
from hvd_syncbn.torch import SyncBatchNorm, check, convert_sync_batchnorm  # noqa: E402
from hvd_syncbn.torch import batchnorm  # noqa: E402


@pytest.fixture
def old_signatures(monkeypatch):
    """``_BatchNorm.__init__`` as before its ``bias`` keyword, and ``reset_parameters`` as
    it was then (it resets ``β`` unasked)."""
    real = _BatchNorm.__init__

    def old_init(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None,
                 dtype=None):
        real(self, num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def old_reset(self):
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    monkeypatch.setattr(_BatchNorm, "__init__", old_init)
    monkeypatch.setattr(_NormBase, "reset_parameters", old_reset)
    with pytest.raises(TypeError, match="bias"):
        nn.BatchNorm2d(4, bias=False)  # the stand-in is in place


def test_constructs_and_resets_without_the_bias_keyword(old_signatures):
    with_bias, without = SyncBatchNorm(4), SyncBatchNorm(4, bias=False)
    assert with_bias.bias.shape == (4,) and without.bias is None and without.weight.shape == (4,)
    assert "bias" not in without.state_dict() and "weight" in without.state_dict()
    without.reset_parameters()
    with_bias.reset_parameters()
    assert torch.equal(with_bias.bias, torch.zeros(4)) and torch.equal(without.weight, torch.ones(4))
    assert SyncBatchNorm(4, affine=False).bias is None


@pytest.mark.parametrize("stats", ["device", "host"])
@pytest.mark.parametrize("bias", [True, False])
def test_converts_and_steps_without_the_bias_keyword(old_signatures, stats, bias):
    """A converted layer (with β) and one built without β, at 2 ranks (3 + 2 rows):
    outputs, input and γ gradients and running statistics equal plain BN's formula on
    the concatenated batch, in float64."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64) + 3.0
    dy = torch.randn_like(x)
    weight = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    wr = weight.clone().requires_grad_()
    br = torch.full((3,), 0.2, dtype=torch.float64, requires_grad=True) if bias else None
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    F.batch_norm(xr, mean, var, wr, br, True, 0.1, 1e-5).backward(dy)

    def rank(r, comm):
        if bias:  # converted from plain BN
            model = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3).double()), comm=comm, stats=stats)
        else:  # built without β
            model = nn.Sequential(SyncBatchNorm(3, bias=False, name="0", comm=comm, stats=stats).double())
        with torch.no_grad():
            model[0].weight.copy_(weight)
            if bias:
                model[0].bias.fill_(0.2)
        rows = slice(0, 3) if r == 0 else slice(3, 5)
        xs = x[rows].clone().requires_grad_()
        y = model(xs)
        y.backward(dy[rows])
        check(model)
        return y.detach(), xs.grad, model[0].weight.grad, model[0].running_mean, model[0].running_var

    with collective_timeout(10.0):
        got = results(run(2, rank))
    y_ref = F.batch_norm(x, None, None, weight, None if not bias else torch.full((3,), 0.2, dtype=torch.float64),
                         True, 0.0, 1e-5)
    torch.testing.assert_close(torch.cat([g[0] for g in got]), y_ref)
    torch.testing.assert_close(torch.cat([g[1] for g in got]), xr.grad)
    torch.testing.assert_close(got[0][2] + got[1][2], wr.grad)  # each rank's γ gradient is its rows' share
    for g in got:
        torch.testing.assert_close(g[3], mean)
        torch.testing.assert_close(g[4], var)


def test_compile_resolves_the_communicator_from_constants_only(fake_world, monkeypatch):
    """A compiled step asks for its layers' communicators through a function Dynamo treats
    as a constant, with Python constants only (the layer's id, not the layer)."""
    seen = []
    real = batchnorm._traced_index

    def spy(layer_id, nccl):
        seen.append((type(layer_id), type(nccl)))
        return real(layer_id, nccl)

    monkeypatch.setattr(batchnorm, "_traced_index", torch.compiler.assume_constant_result(spy))
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    torch._dynamo.reset()
    try:
        torch.compile(model, backend="aot_eager", fullgraph=True)(torch.randn(2, 3, 6, 6)).sum().backward()
    finally:
        torch._dynamo.reset()
    assert seen and set(seen) == {(int, bool)}, seen
