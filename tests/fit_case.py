"""The training job the engine tests run at 2 ranks (``tests/lightning_fit.py``,
``tests/engine_train.py``) and its one-process reference: a small net with two BN layers,
3 SGD steps; rank r trains on its half of every global batch."""

from __future__ import annotations

import torch
from torch import nn

STEPS, ROWS, LR, WORLD = 3, 4, 0.1, 2  # ROWS per rank and step


def net() -> nn.Module:
    """The model, the same on every rank and in the one-process reference."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6), nn.Linear(6, 1)).double()


def global_batches() -> list:
    """``(x, y)`` of ``WORLD * ROWS`` rows per step, off-centre so the statistics matter."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(WORLD * ROWS, 3, 5, 5, generator=g, dtype=torch.float64) * 2 + 1,
             torch.randn(WORLD * ROWS, 1, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def shard(batch: tuple, rank: int) -> tuple:
    """Rank ``rank``'s half of a global batch."""
    return tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in batch)


def reference() -> dict:
    """One process, plain BN, the whole global batch each step: the state after training."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in global_batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def assert_states_equal(got: dict, want: dict, what: str) -> None:
    """Every tensor within 1e-10 (float64: only the order of sums differs)."""
    assert got.keys() == want.keys(), f"{what}: keys {sorted(got)} != {sorted(want)}"
    worst = max(((got[k].double() - want[k].double()).abs().max().item(), k) for k in want)
    assert worst[0] <= 1e-10, f"{what}: largest difference {worst[0]:.3g} in {worst[1]}"
